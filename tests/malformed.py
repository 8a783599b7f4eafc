"""Moved to tests/helpers/malformed.py. scripts/gen_errors_doc.py still imports ``tests.malformed``
(tests/test_errors_doc.py runs it): remove this module once it imports ``tests.helpers.malformed``."""

from tests.helpers.malformed import CASES  # noqa: F401

"""Moved to tests/helpers/fuzzing.py. scripts/fuzz.py still imports ``tests.fuzzing``: remove this
module once it imports ``tests.helpers.fuzzing``."""

from tests.helpers.fuzzing import CI_CASES, KINDS, OUTCOMES, property_test  # noqa: F401

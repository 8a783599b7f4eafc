"""Hypothesis mutates real fixture files; every outcome is a correct conversion or one of our errors.

CI runs :data:`tests.helpers.fuzzing.CI_CASES` cases (2,160 byte-level and field-level, 2,350 structure-aware),
derandomized so CI is reproducible (inspect and --dry-run probed on every case, or one in
:data:`~tests.helpers.fuzzing.CI_PROBE_EVERY` of the costlier kinds);
``python scripts/fuzz.py --cases N`` runs as many as asked with a fresh seed.
"""

from __future__ import annotations

import pytest

from tests.helpers.fuzzing import CI_CASES, CI_PROBE_EVERY, KINDS, OUTCOMES, STRUCT_KINDS, property_test


def test_ci_runs_at_least_2000_cases() -> None:
    assert set(CI_CASES) == set(KINDS)
    assert sum(n for k, n in CI_CASES.items() if k not in STRUCT_KINDS) >= 2000
    assert sum(CI_CASES[k] for k in STRUCT_KINDS) >= 2000


@pytest.mark.parametrize("kind", KINDS)
def test_mutated_fixture(kind: str) -> None:
    before = sum(OUTCOMES[kind].values())
    property_test(kind, CI_CASES[kind], derandomize=True, probe_every=CI_PROBE_EVERY.get(kind, 1))()
    ran = sum(OUTCOMES[kind].values()) - before
    assert ran >= CI_CASES[kind]

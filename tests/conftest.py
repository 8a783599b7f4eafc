"""pytest fixtures shared by every test module (plain helpers are in tests/helpers/)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tmp_out(tmp_path: Path) -> Path:
    return tmp_path / "out"

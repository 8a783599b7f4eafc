"""formats.writeback: the ranges whose writeback is started while a file is streamed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from formats.dtypes import by_code
from formats.safetensors import SafetensorsReader, SafetensorsWriter
from formats.writeback import WriteBehind


def test_ranges_advised_twice_one_step_apart(tmp_path, monkeypatch):
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)), raising=False)
    with open(tmp_path / "f", "wb") as f:
        f.write(b"h" * 10)
        wb = WriteBehind(f, step=100)
        for _ in range(7):
            f.write(b"x" * 40)
            wb.advance(40)
    dn = os.POSIX_FADV_DONTNEED
    # steps end at 10+120=130, 10+240=250: the first advises [10,130); the second [10,250)
    assert calls == [(10, 120, dn), (10, 240, dn)]


def test_advice_refused_turns_it_off(tmp_path, monkeypatch):
    calls = []

    def refuse(fd, off, n, advice):
        calls.append(off)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    with open(tmp_path / "f", "wb") as f:
        wb = WriteBehind(f, step=8)
        for _ in range(5):
            f.write(b"y" * 8)
            wb.advance(8)
    assert calls == [0]
    assert (tmp_path / "f").read_bytes() == b"y" * 40


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_streamed_file_is_exact_with_write_behind(tmp_path, monkeypatch):
    """A small step so that the advice runs between the writes of one tensor and of the next."""
    monkeypatch.setattr(WriteBehind.__init__, "__defaults__", (4096,))
    real, calls = os.posix_fadvise, []
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: (calls.append(a[1:3]), real(*a))[1])
    rng = np.random.default_rng(5)
    a = rng.standard_normal((300, 7)).astype(np.float32)
    b = rng.integers(0, 255, 20_001, dtype=np.uint8)
    path = tmp_path / "m.safetensors"
    w = SafetensorsWriter(path, [("a", by_code("F32"), a.shape), ("b", by_code("U8"), b.shape)])
    for i in range(0, 300, 37):
        w.write(a[i : i + 37])
    w.write(b[:5])
    w.write(b[5:])
    w.close()
    assert len(calls) >= 2  # the real advice ran on the open file, within what was written
    assert all(off + n <= path.stat().st_size for off, n in calls)
    with SafetensorsReader(path) as r:
        assert np.array_equal(r.array("a"), a)
        assert np.array_equal(r.array("b"), b)

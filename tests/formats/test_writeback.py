"""formats.writeback: the output stream (O_DIRECT from aligned buffers, or the page cache with write-behind)."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

import formats.writeback as wb_mod
from formats.dtypes import by_code
from formats.safetensors import SafetensorsReader, SafetensorsWriter
from formats.writeback import ALIGN, SLAB_ROUND, FileStream, PlacedMemory, WriteBehind, aligned_empty

HAS_DIRECT = hasattr(os, "O_DIRECT")


def test_ranges_advised_twice_one_step_apart(tmp_path, monkeypatch):
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)), raising=False)
    with open(tmp_path / "f", "wb") as f:
        f.write(b"h" * 10)
        wb = WriteBehind(f.fileno(), 10, step=100)
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
        wb = WriteBehind(f.fileno(), 0, step=8)
        for _ in range(5):
            f.write(b"y" * 8)
            wb.advance(8)
    assert calls == [0]
    assert (tmp_path / "f").read_bytes() == b"y" * 40


def _stream(path, head: bytes, pieces: list[bytes], direct: bool) -> FileStream:
    path.write_bytes(head)
    s = FileStream(path, len(head), direct=direct)
    for p in pieces:
        assert s.write(np.frombuffer(p, np.uint8) if len(p) % 2 else p) == len(p)
    return s


def _pieces(rng: np.random.Generator, sizes: list[int]) -> list[bytes]:
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


# header lengths around the 4096-byte blocks; piece sizes that end a buffer exactly, cross one, and wrap the ring
@pytest.mark.parametrize("head_len", [0, 1, 8, 4095, 4096, 4097, 12_345])
@pytest.mark.parametrize("direct", [True, False])
def test_stream_bytes_exact(tmp_path, monkeypatch, head_len, direct):
    monkeypatch.setattr(wb_mod, "BUFFER_BYTES", 4 * ALIGN)  # 16 KiB buffers: the ring of 4 wraps many times
    rng = np.random.default_rng(head_len)
    head = rng.integers(0, 256, head_len, dtype=np.uint8).tobytes()
    pieces = _pieces(rng, [0, 1, 4095, 16_384 - (head_len % 16_384), 16_384, 3, 50_000, 70_001, 0, 7])
    s = _stream(tmp_path / "f", head, pieces, direct)
    if not direct:
        assert not s.direct
    assert s.tell() == head_len + sum(map(len, pieces))
    s.close()
    assert (tmp_path / "f").read_bytes() == head + b"".join(pieces)


@pytest.mark.parametrize("offset", [0, 1, 8, 4095, 4096, 4097, 12_345])
def test_aligned_empty_lies_at_the_offset_modulo_align(offset):
    assert aligned_empty(0, offset).shape == (0,)
    for n in (1, ALIGN, 3 * ALIGN + 5):
        a = aligned_empty(n, offset)
        assert a.dtype == np.uint8 and a.shape == (n,) and a.flags.c_contiguous and a.flags.writeable
        assert (a.ctypes.data - offset) % ALIGN == 0


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 12_345])
def test_placed_memory_lies_at_the_offset_and_is_reused_once_nothing_refers_to_it(offset):
    memory = PlacedMemory(keep=4)
    assert memory.empty(0, offset).shape == (0,)
    memory = PlacedMemory(keep=4)
    for n in (1, ALIGN, 3 * ALIGN + 5, SLAB_ROUND):
        a = memory.empty(n, offset)
        assert a.dtype == np.uint8 and a.shape == (n,) and a.flags.c_contiguous and a.flags.writeable
        assert (a.ctypes.data - offset) % ALIGN == 0
        a[:] = 7
        address = a.ctypes.data
        del a
        assert memory.free_slabs() == [-(-(n + ALIGN) // SLAB_ROUND) * SLAB_ROUND]
        b = memory.empty(n, offset)  # the same slab, so the same address
        assert b.ctypes.data == address and memory.free_slabs() == []
        del b
        memory = PlacedMemory(keep=4)


def test_placed_memory_is_held_by_every_view_of_it():
    memory = PlacedMemory(keep=4)
    a = memory.empty(3 * ALIGN, 0)
    view = a.view(np.uint16)[100:200]
    buffer = memoryview(a[ALIGN:])  # as the writer's pwrite of an in-place array holds it
    del a
    assert memory.free_slabs() == []
    b = memory.empty(3 * ALIGN, 0)  # a new slab: the first is still held
    assert not np.shares_memory(b, view) and not np.shares_memory(b, np.frombuffer(buffer, np.uint8))
    del view
    assert memory.free_slabs() == []
    buffer.release()
    del buffer
    assert memory.free_slabs() == [SLAB_ROUND]
    del b
    assert memory.free_slabs() == [SLAB_ROUND, SLAB_ROUND]


def test_placed_memory_slabs_grow_to_the_largest_request_and_at_most_keep_are_kept():
    memory = PlacedMemory(keep=2)
    a = memory.empty(SLAB_ROUND, 0)  # a 2 MiB slab (1 MiB and the alignment's page, rounded up)
    b = memory.empty(3 * SLAB_ROUND, 0)  # slabs of 4 MiB from now on
    c = memory.empty(10, 5)  # a 4 MiB slab too
    del a  # smaller than the slabs now made: dropped
    assert memory.free_slabs() == []
    del b, c
    assert memory.free_slabs() == [4 * SLAB_ROUND, 4 * SLAB_ROUND]
    arrays = [memory.empty(ALIGN, 0) for _ in range(3)]  # two free slabs, then a new one
    assert memory.free_slabs() == []
    del arrays
    assert memory.free_slabs() == [4 * SLAB_ROUND, 4 * SLAB_ROUND]  # keep=2: the third dropped
    d = memory.empty(4 * SLAB_ROUND, 0)  # larger: the free slabs are dropped, 5 MiB from now on
    assert memory.free_slabs() == [] and d.base is not None and d.base.size == 5 * SLAB_ROUND
    del d
    assert memory.free_slabs() == [5 * SLAB_ROUND]
    assert PlacedMemory(keep=0).free_slabs() == []


def test_placed_memory_out_of_memory_is_a_memory_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(wb_mod.mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="cannot map 2097152 bytes for a chunk"):
        PlacedMemory(keep=2).empty(SLAB_ROUND, 0)


def test_placed_memory_never_hands_out_memory_in_use_across_threads():
    memory = PlacedMemory(keep=3)
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(300):
            n = (1 + (i * 7 + k) % 5) * ALIGN * 64
            a = memory.empty(n, i)
            a[:] = k
            held = a[::4096]  # a view outliving the array for a while
            del a
            if not (held == k).all():
                errors.append(f"thread {k}, round {i}: memory changed under it")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(memory.free_slabs()) <= 3


# placed arrays of every size class around the blocks (inside one block, whole blocks, partial ends),
# given up or not, between plain writes; in-place from 1 byte on, and buffers of 4 blocks
@pytest.mark.parametrize("head_len", [0, 1, 4095, 4096, 12_345])
@pytest.mark.parametrize("direct", [True, False])
def test_placed_arrays_written_in_place_bytes_exact(tmp_path, monkeypatch, head_len, direct):
    monkeypatch.setattr(wb_mod, "BUFFER_BYTES", 4 * ALIGN)
    monkeypatch.setattr(wb_mod, "IN_PLACE_MIN", 1)
    in_place = []
    real = FileStream._pwrite_from
    monkeypatch.setattr(FileStream, "_pwrite_from", lambda self, data, offset: (
        in_place.append(isinstance(data, np.ndarray)), real(self, data, offset))[1])
    rng = np.random.default_rng(head_len + 7)
    path = tmp_path / "f"
    head = rng.integers(0, 256, head_len, dtype=np.uint8).tobytes()
    path.write_bytes(head)
    s = FileStream(path, head_len, direct=direct)
    expected = [head]
    sizes = [1, 100, ALIGN - 1, ALIGN, ALIGN + 1, 5 * ALIGN, 50_000, 3, 70_001, 2 * ALIGN]
    for i, n in enumerate(sizes):
        a = aligned_empty(n, s.tell())
        a[:] = rng.integers(0, 256, n, dtype=np.uint8)
        expected.append(a.tobytes())
        assert s.write(a, in_place=i % 3 != 2) == n
        if i % 2:  # a plain write between: the next array's block is shared with it
            b = rng.integers(0, 256, 777 * i, dtype=np.uint8).tobytes()
            expected.append(b)
            s.write(b)
    s.close()
    assert path.read_bytes() == b"".join(expected)
    if direct and s.direct:
        assert any(in_place)  # some blocks went to the disk from the arrays themselves


@pytest.mark.skipif(not HAS_DIRECT, reason="no O_DIRECT on this system")
def test_unplaced_or_kept_arrays_are_copied(tmp_path, monkeypatch):
    if not _direct_here(tmp_path / "probe"):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    from_arrays = []
    real = FileStream._pwrite_from
    monkeypatch.setattr(FileStream, "_pwrite_from", lambda self, data, offset: (
        from_arrays.append(isinstance(data, np.ndarray)), real(self, data, offset))[1])
    path = tmp_path / "f"
    path.write_bytes(b"h" * 10)
    s = FileStream(path, 10)
    n = 2 << 20
    kept = aligned_empty(n, s.tell())  # placed but not given up
    kept[:] = 1
    s.write(kept)
    kept[:] = 9  # the caller changes it afterwards: the file has what was written
    moved = aligned_empty(n + 1, s.tell() + 1)[1:]  # given up but not placed
    moved[:] = 2
    s.write(moved, in_place=True)
    small = aligned_empty(1000, s.tell())  # placed and given up, under IN_PLACE_MIN
    small[:] = 3
    s.write(small, in_place=True)
    s.close()
    assert not any(from_arrays)
    assert path.read_bytes() == b"h" * 10 + b"\x01" * n + b"\x02" * n + b"\x03" * 1000


def _direct_here(path) -> bool:
    path.write_bytes(b"")
    s = FileStream(path, 0)
    ok = s.direct
    s.abort()
    return ok


@pytest.mark.skipif(not HAS_DIRECT, reason="no O_DIRECT on this system")
def test_direct_used_where_the_file_system_takes_it(tmp_path):
    if not _direct_here(tmp_path / "probe"):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    rng = np.random.default_rng(1)
    pieces = _pieces(rng, [100_000, 3 << 20, 9 << 20, 5])  # the real 8 MiB buffers, a padded last block
    s = _stream(tmp_path / "f", b"header", pieces, True)
    assert s.direct
    s.close()
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 6 + sum(map(len, pieces))  # cut to its length after the padded last block
    assert data == b"header" + b"".join(pieces)


@pytest.mark.skipif(not HAS_DIRECT, reason="no O_DIRECT on this system")
def test_open_refusing_o_direct_goes_through_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    rng = np.random.default_rng(2)
    pieces = _pieces(rng, [5000, 70_000])
    s = _stream(tmp_path / "f", b"hh", pieces, True)
    assert not s.direct
    s.close()
    assert (tmp_path / "f").read_bytes() == b"hh" + b"".join(pieces)


@pytest.mark.skipif(not HAS_DIRECT, reason="no O_DIRECT on this system")
def test_write_refusing_o_direct_falls_back_for_the_rest(tmp_path, monkeypatch):
    if not _direct_here(tmp_path / "probe"):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    monkeypatch.setattr(wb_mod, "BUFFER_BYTES", 2 * ALIGN)
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if fd in direct_fds:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    rng = np.random.default_rng(3)
    pieces = _pieces(rng, [10_000, 30_000, 123])
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    s = FileStream(path, 10)
    direct_fds = {s._direct_fd}
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(wb_mod, "IN_PLACE_MIN", 1)
    for i, p in enumerate(pieces):
        if i == 1:  # an array written in place meets the refusal too
            a = aligned_empty(len(p), s.tell())
            a[:] = np.frombuffer(p, np.uint8)
            s.write(a, in_place=True)
        else:
            s.write(p)
    s.close()
    assert refused and not s.direct
    assert path.read_bytes() == b"x" * 10 + b"".join(pieces)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("direct", [True, False])
def test_write_error_reaches_close_and_nothing_leaks(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(wb_mod, "BUFFER_BYTES", 2 * ALIGN)

    def full(fd, data, offset=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = _open_fds()
    path = tmp_path / "f"
    path.write_bytes(b"")
    s = FileStream(path, 0, direct=direct)
    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as e:
        for _ in range(10):
            s.write(b"z" * 5000)
        s.close()
    assert e.value.errno == errno.ENOSPC
    s.abort()  # what a writer does after the error: no second error, every descriptor closed
    monkeypatch.undo()
    assert _open_fds() == before


@pytest.mark.parametrize("direct", [True, False])
def test_abort_discards_and_closes(tmp_path, direct):
    path = tmp_path / "f"
    s = _stream(path, b"abc", [b"q" * 10_000], direct)
    s.abort()
    s.abort()  # twice is harmless
    s.close()  # and close after abort writes nothing
    assert path.read_bytes()[:3] == b"abc"


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_streamed_file_is_exact_with_write_behind(tmp_path, monkeypatch):
    """Through the page cache (no O_DIRECT), with a small step so that the advice runs between the
    writes of one tensor and of the next."""
    monkeypatch.setattr(WriteBehind.__init__, "__defaults__", (4096,))
    monkeypatch.setattr(FileStream.__init__, "__defaults__", (False,))
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

"""Streaming the data of an output file front to back (the safetensors and GGUF writers' sink).

:class:`FileStream` appends bytes to a file whose first ``start`` bytes (the header) are already
written. Where the file system takes it (Linux ``O_DIRECT``: ext4, xfs, btrfs, NFS...), the bytes
go to the disk from a ring of :data:`BUFFERS` page-aligned buffers of :data:`BUFFER_BYTES`, each
written by ``pwrite`` from a background thread while the next one fills (up to ``BUFFERS - 1``
writes in flight): no copy into the page cache, no dirty pages for the kernel to write back later.
On a 2-core machine with a virtual disk, a buffered write of 2.7 GB cost 6.7 s of system CPU and an
``O_DIRECT`` one 0.3 s (``dd`` and the same ``pwrite`` loop; docs/performance.md, "Figures behind the
design"): CPU the converter's workers need. ``O_DIRECT`` wants the file offset, the length and the buffer's
address to be multiples of the device's block size: the stream keeps the file's bytes in
:data:`ALIGN`-byte blocks (the block holding the header's end is read back and rewritten whole), the
last block is written padded with zeros and the file is then cut to its length (``ftruncate``).
An array the caller gives up (``write(data, in_place=True)``: a chunk made for the file) that lies at
the file's offset modulo :data:`ALIGN` (:func:`aligned_empty`: the converter's workers make their
chunks there) skips the ring: the blocks it fills whole are written from its own memory, only its
partial first and last blocks go through the ring (the copy into the ring cost the writing thread
0.3 ns a byte, 8% of a bf16 run's wall time; docs/performance.md, "Figures behind the design").

Where ``O_DIRECT`` does not exist (macOS, Windows) or the file system refuses it (``EINVAL`` at
``open``, or at the first write: tmpfs before Linux 6.6, some FUSE and network file systems), the
stream writes through the page cache instead, with :class:`WriteBehind` starting the writeback as it
goes. Either way the bytes in the file are the same, and :meth:`FileStream.close` fsyncs before the
caller renames the file into place.

:class:`WriteBehind`: Linux keeps written pages dirty in the page cache until
``vm.dirty_background_ratio`` (10% of the free memory by default: gigabytes) is reached, so a
converter that writes a few GB and fsyncs at the end computes while the disk idles, then waits for
the disk. It starts the kernel's writeback of each ``step`` bytes as soon as they are written:
``posix_fadvise(POSIX_FADV_DONTNEED)`` on a range with dirty pages starts their writeback without
waiting for it (``WB_SYNC_NONE`` in ``mm/fadvise.c``) and drops the pages that are already clean;
each range is advised twice, one step apart, so the pages written back in between leave the page
cache too. Where ``posix_fadvise`` does not exist, nothing is done.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = [
    "ALIGN",
    "BUFFERS",
    "BUFFER_BYTES",
    "IN_PLACE_MIN",
    "IN_PLACE_WRITES",
    "SLAB_ROUND",
    "WRITE_BEHIND_STEP",
    "FileStream",
    "PlacedMemory",
    "WriteBehind",
    "aligned_empty",
    "bytes_of",
]

#: Bytes between two write-behind calls (64 MiB: a few calls a second at disk speed).
WRITE_BEHIND_STEP = 64 << 20
#: ``O_DIRECT`` alignment of file offsets, lengths and buffer addresses, in bytes (4096 serves
#: devices of 512- and 4096-byte logical blocks).
ALIGN = 4096
#: Bytes of one direct-write buffer (large writes keep a virtual disk's queue busy: 16 MiB pieces took
#: 4.5 s for 2.7 GB where 4 MiB took 7.3 s here).
BUFFER_BYTES = 8 << 20
#: Direct-write buffers: one filling while the others are written (32 MiB in all, inside the
#: memory cap's baseline).
BUFFERS = 4
#: Bytes from which :meth:`FileStream.write` sends an array given up to it and placed at the file's
#: alignment (:func:`aligned_empty`) to the disk from its own memory instead of copying it.
IN_PLACE_MIN = 1 << 20
#: Such in-place writes in flight at most (each keeps its array alive until written).
IN_PLACE_WRITES = 2
#: :class:`PlacedMemory` slabs are multiples of this many bytes (chunks of a run differ by a few pages).
SLAB_ROUND = 1 << 20


class WriteBehind:
    """Starts the writeback of a file's bytes as they are written (see the module docstring).

    Args:
        fd: the file descriptor being written.
        pos: the offset where the streamed bytes start.
        step: bytes between two calls.
    """

    def __init__(self, fd: int, pos: int, step: int = WRITE_BEHIND_STEP) -> None:
        self._fd = fd
        self._step = step
        self._pos = pos  # bytes written so far
        self._done = pos  # advised once up to here
        self._previous = pos  # start of the range advised once (advised again next time)
        self._enabled = hasattr(os, "posix_fadvise")

    def advance(self, nbytes: int) -> None:
        """Call after each write of ``nbytes`` (written to the file, not buffered in the process): every
        ``step`` bytes, advise the new range and the previous one. An error of the advice (a file system
        that refuses it) turns it off: it is a hint.
        """
        self._pos += nbytes
        pos = self._pos
        if pos - self._done < self._step or not self._enabled:
            return
        try:
            os.posix_fadvise(self._fd, self._previous, pos - self._previous, os.POSIX_FADV_DONTNEED)
        except OSError:
            self._enabled = False
        self._previous, self._done = self._done, pos


def aligned_empty(nbytes: int, offset: int) -> np.ndarray:
    """An uninitialised ``uint8[nbytes]`` whose address is ``offset`` modulo :data:`ALIGN`: memory for the
    bytes bound for file offset ``offset``, which :meth:`FileStream.write` then sends to the disk with
    ``O_DIRECT`` from where they lie (the blocks they fill whole), without copying them. Fresh memory
    each call: :class:`PlacedMemory` reuses it."""
    return _placed_in(np.empty(nbytes + ALIGN, dtype=np.uint8), nbytes, offset)


def _placed_in(raw: np.ndarray, nbytes: int, offset: int) -> np.ndarray:
    """``raw[skip : skip + nbytes]`` with ``skip < ALIGN`` putting its address at ``offset`` modulo ALIGN
    (``raw``: at least ``nbytes + ALIGN`` bytes)."""
    skip = (offset - raw.ctypes.data) % ALIGN
    return raw[skip : skip + nbytes]


class PlacedMemory:
    """:func:`aligned_empty` from slabs used again: the chunks of a run land on pages already resident.

    A fresh page costs a page fault and the kernel's zeroing of it: on this project's 2-core virtual
    machine writing 32 MiB into fresh memory took 0.05-0.26 ns a byte more than into memory written
    before, by the hour (``scripts/bench.py pages``; the bf16 kernel itself takes about 0.5 ns a byte
    of output), and unmapping a freed chunk interrupts the other core to flush its TLB. Two-thread runs
    took less CPU with it: bf16 0.94x, gguf:f16 0.86x (docs/performance.md, "Figures behind the design").

    Each slab is an anonymous ``mmap`` (page-aligned) seen through one NumPy array that does not own its
    memory; every array sliced or viewed from it refers to that array (NumPy makes a view's base the
    first array owning its data or whose base is not an array), so when the last of them is gone (the
    writer's in-place write of it included) the slab comes back here (``weakref.finalize``). Every slab
    is as large as the largest request so far (rounded up to :data:`SLAB_ROUND`), so any free slab serves
    any request and the slabs of a run are never more than its chunks in flight at once: a larger request
    drops the smaller free slabs, a smaller slab coming back is dropped, and at most ``keep`` free slabs
    are kept (a slab's pages are resident once written: a small chunk in a large slab costs only its own).
    Thread-safe.

    Args:
        keep: free slabs kept at most (the chunks a run has in flight at once).
    """

    def __init__(self, keep: int) -> None:
        self._keep = max(0, keep)
        self._size = 0  # bytes of every slab made from now on
        self._free: list[mmap.mmap] = []
        self._lock = threading.RLock()  # (a finalizer may run in a thread inside either method)

    def empty(self, nbytes: int, offset: int) -> np.ndarray:
        """An uninitialised ``uint8[nbytes]`` at ``offset`` modulo :data:`ALIGN`, as :func:`aligned_empty`."""
        need = nbytes + ALIGN
        with self._lock:  # (nothing here makes a container: no garbage collection runs a finalizer inside)
            if need > self._size:
                self._size = -(-need // SLAB_ROUND) * SLAB_ROUND
                self._free.clear()  # (too small now; unmapped once nothing refers to them)
            slab = self._free.pop() if self._free else None
            size = self._size
        if slab is None:
            try:
                slab = mmap.mmap(-1, size)
            except OSError as e:  # (out of memory is no fault of the output path: as np.empty says it)
                if e.errno != errno.ENOMEM:
                    raise
                raise MemoryError(f"cannot map {size} bytes for a chunk") from None
        raw = np.frombuffer(slab, dtype=np.uint8)
        weakref.finalize(raw, self._give_back, slab).atexit = False  # (nothing to give back at exit)
        return _placed_in(raw, nbytes, offset)

    def _give_back(self, slab: mmap.mmap) -> None:
        with self._lock:
            if len(slab) == self._size and len(self._free) < self._keep:
                self._free.append(slab)

    def free_slabs(self) -> list[int]:
        """The sizes of the free slabs kept, in bytes (for tests)."""
        with self._lock:
            return sorted(len(m) for m in self._free)


def bytes_of(data: Any) -> np.ndarray:
    """``data`` (an array, bytes or any buffer) as a flat uint8 array of its bytes, without a copy
    where it is contiguous."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


class FileStream:
    """Appends bytes to a file from offset ``start`` to its end (see the module docstring).

    Args:
        path: an existing file whose first ``start`` bytes are written (and stay as they are).
        start: where the streamed bytes begin; the file is cut there first.
        direct: try ``O_DIRECT`` (False: always through the page cache, as on systems without it).

    Raises:
        OSError: the file cannot be opened or written (e.g. ``ENOSPC``), from the call that meets it.
    """

    def __init__(self, path: str | os.PathLike[str], start: int, direct: bool = True) -> None:
        self.path = os.fspath(path)
        self._pos = start  # the file offset of the next byte
        self._fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
        self._direct_fd = -1
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        os.ftruncate(self._fd, start)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # the file system refuses O_DIRECT: through the page cache
                self._direct_fd = -1
        self._use_direct = self._direct_fd >= 0  # turned off by a write the file system refuses
        if not self._use_direct:
            os.lseek(self._fd, start, os.SEEK_SET)
            self._behind = WriteBehind(self._fd, start)
            return
        self._maps = [mmap.mmap(-1, BUFFER_BYTES) for _ in range(BUFFERS)]  # page-aligned
        self._bufs = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self._inflight: list[Future[None] | None] = [None] * BUFFERS
        self._in_place: deque[Future[None]] = deque()  # writes from the callers' arrays
        self._pool = ThreadPoolExecutor(max_workers=BUFFERS - 1, thread_name_prefix="convert-bnb-write")
        self._cur = 0
        self._base = start - start % ALIGN  # the file offset of the current buffer's first byte
        self._fill = start - self._base  # bytes in the current buffer
        if self._fill:  # the header's last block: written again whole, with the first streamed bytes
            with open(self.path, "rb") as f:
                f.seek(self._base)
                head = f.read(self._fill)
            self._bufs[0][: self._fill] = np.frombuffer(head, dtype=np.uint8)

    @property
    def direct(self) -> bool:
        """True while the bytes go to the disk with ``O_DIRECT``."""
        return self._use_direct

    def tell(self) -> int:
        """The file offset of the next byte."""
        return self._pos

    def write(self, data: Any, in_place: bool = False) -> int:
        """Append ``data``'s bytes (an array as it lies in memory, bytes, or any buffer).

        Args:
            data: the bytes.
            in_place: the caller gives ``data`` up (it will not change it, nor unmap its memory): when it
                is an array of at least :data:`IN_PLACE_MIN` bytes lying at the stream's position modulo
                :data:`ALIGN` (:func:`aligned_empty`), the whole blocks it fills are written from its own
                memory (the stream keeps a reference until they are), only its partial first and last
                blocks copied. Otherwise ``data`` is copied and may change once this returns.

        Returns:
            The number of bytes appended.
        """
        src = bytes_of(data)
        n = src.size
        if self._pool is None:
            view = memoryview(src)
            done = 0
            while done < n:
                done += os.write(self._fd, view[done:])
            self._behind.advance(n)
        elif in_place and n >= IN_PLACE_MIN and (src.ctypes.data - self._pos) % ALIGN == 0:
            self._write_in_place(src)
        else:
            done = 0
            while done < n:
                take = min(BUFFER_BYTES - self._fill, n - done)
                self._bufs[self._cur][self._fill : self._fill + take] = src[done : done + take]
                self._fill += take
                done += take
                if self._fill == BUFFER_BYTES:
                    self._submit(BUFFER_BYTES)
        self._pos += n
        return n

    def _write_in_place(self, src: np.ndarray) -> None:
        """Write ``src`` (its address the stream's position modulo ALIGN): its first bytes complete the
        current buffer's last block, which is written; the whole blocks after them go to the disk from
        ``src`` itself (kept alive until written); the bytes of its last partial block start the next
        buffer."""
        assert self._pool is not None
        head = -self._pos % ALIGN
        head = min(head, src.size)
        self._bufs[self._cur][self._fill : self._fill + head] = src[:head]
        self._fill += head
        if self._fill % ALIGN:  # (src ends inside the block: nothing more to place)
            return
        if self._fill:
            self._submit(self._fill)
        whole = (src.size - head) // ALIGN * ALIGN
        if whole:
            while len(self._in_place) >= IN_PLACE_WRITES:
                self._in_place.popleft().result()
            self._in_place.append(self._pool.submit(self._pwrite_from, src[head : head + whole], self._base))
            self._base += whole
        tail = src[head + whole :]
        self._bufs[self._cur][: tail.size] = tail
        self._fill = tail.size

    def _submit(self, length: int) -> None:
        """Hand the current buffer's first ``length`` bytes (a multiple of ALIGN) to a writing thread and
        move to the next buffer, waiting for its previous write."""
        assert self._pool is not None
        i = self._cur
        self._inflight[i] = self._pool.submit(self._pwrite, i, length, self._base)
        self._base += length
        self._fill = 0
        self._cur = (i + 1) % BUFFERS
        self._wait(self._cur)

    def _wait(self, i: int) -> None:
        fut = self._inflight[i]
        if fut is not None:
            self._inflight[i] = None
            fut.result()

    def _pwrite(self, i: int, length: int, offset: int) -> None:
        """Write buffer ``i``'s first ``length`` bytes at ``offset`` (a writing thread)."""
        with memoryview(self._maps[i]) as whole, whole[:length] as view:
            self._pwrite_from(view, offset)

    def _pwrite_from(self, data: Any, offset: int) -> None:
        """Write ``data`` (a buffer: its address, length and ``offset`` multiples of ALIGN) at ``offset`` (a
        writing thread). A file system that refuses the direct write (``EINVAL``) gets it and every later
        one through the page cache."""
        with memoryview(data).cast("B") as view:
            done, length = 0, view.nbytes
            while done < length:
                direct = self._use_direct
                try:
                    done += os.pwrite(self._direct_fd if direct else self._fd, view[done:], offset + done)
                except OSError as e:
                    if e.errno != errno.EINVAL or not direct:
                        raise
                    self._use_direct = False

    def close(self, fsync: bool = True) -> None:
        """Write what is buffered, cut the file to its length, fsync (when asked) and close.

        Raises:
            OSError: a write failed (the file is closed; the caller removes it).
        """
        if self._closed:
            return
        try:
            if self._pool is not None:
                fill = self._fill
                if fill:
                    padded = -(-fill // ALIGN) * ALIGN
                    self._bufs[self._cur][fill:padded] = 0
                    self._submit(padded)
                for i in range(BUFFERS):
                    self._wait(i)
                while self._in_place:
                    self._in_place.popleft().result()
                os.ftruncate(self._fd, self._pos)
            if fsync:
                os.fsync(self._fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Close without writing what is buffered (the caller removes the file); waits for the writes in
        flight, whose errors are dropped."""
        if self._pool is not None:
            for fut in [*self._inflight, *self._in_place]:
                if fut is not None:
                    fut.exception()
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            self._bufs = []
            for m in self._maps:
                try:
                    m.close()
                except BufferError:  # a view is held by a write's error: the mapping goes with it
                    pass
        for fd in {self._fd, self._direct_fd} - {-1}:
            os.close(fd)

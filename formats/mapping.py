"""Read-only memory maps of input files: one owner for mapping, releasing and unmapping an input, and for
the rule that an input must not change while it is read.

The readers (:mod:`formats.safetensors`, :mod:`formats.torch_pickle`) hand out NumPy views into one
``mmap`` per file. A file cut shorter while it is mapped (another program rewriting or truncating it)
makes the next touch of a vanished page a ``SIGBUS``, which kills the process without a word unless the
command line reports it (:func:`convert.signals.on_bus_error` reports :func:`changed_input`). Where the
change can be seen in time, the rule is checked instead:

=========  ==========================  ====================================================
CKPT-012   InputChangedError           a mapped input keeps the size, inode and modification time it had
                                       when it was opened (checked when it is mapped, on every view
                                       handed out, and for every open input before an output is committed)
=========  ==========================  ====================================================

Every live map is recorded (weakly) with its path, so that :func:`changed_input` can name the file
that shrank from inside a signal handler: it only calls ``fstat`` on the maps' own descriptors.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np
import numpy.typing as npt

from .errors import InputChangedError

__all__ = ["PAGE", "InputMap", "changed_input", "check_inputs"]

#: The page size: :meth:`InputMap.release` drops only whole pages.
PAGE = mmap.PAGESIZE

#: Every live map -> the path it maps (for :func:`changed_input`).
_LIVE: weakref.WeakKeyDictionary[mmap.mmap, str] = weakref.WeakKeyDictionary()
#: Every open :class:`InputMap` (for :func:`check_inputs`).
_MAPS: weakref.WeakSet[InputMap] = weakref.WeakSet()


class InputMap:
    """One read-only ``mmap`` of a whole input file whose size is known from its header.

    Args:
        path: the file.
        size: its size in bytes when its header was read.

    Raises:
        InputChangedError: the file's size is no longer ``size`` (CKPT-012).
        OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        self.path = os.fspath(path)
        self.size = size
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._stamp = (st.st_ino, st.st_mtime_ns)
        # (check and close exclude each other: another thread's check_inputs must not fstat the map's descriptor
        # while close closes it, which gave EBADF, or a file opened meanwhile under the same number)
        self._lock = threading.Lock()
        _LIVE[self._mm] = self.path
        _MAPS.add(self)
        self.check()

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself (for parsers that read it in place)."""
        return self._mm

    def check(self) -> None:
        """Raise if the file's size differs from the size its header was read with.

        A map closed meanwhile (by another thread: its reader is done) is read no more: nothing to check.

        Raises:
            InputChangedError: CKPT-012, naming the file, the size read and the size now.
        """
        with self._lock:
            if self._mm.closed:
                return
            now = self._mm.size()  # fstat of the map's own descriptor: the inode being read, even if renamed
            mapped = len(self._mm)
        if now != self.size or mapped != self.size:
            raise InputChangedError("the file changed while it was read (another program rewrote or truncated "
                                    "it); its size in bytes", path=self.path, expected=self.size, found=now)
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is None or (st.st_ino, st.st_mtime_ns) != self._stamp:
            raise InputChangedError("the file changed while it was read (another program wrote to it or replaced "
                                    "it: its modification time or inode changed)", path=self.path,
                                    expected="the file as opened", found="missing" if st is None else "a newer file")

    def view(self, offset: int, count: int, dtype: npt.DTypeLike = np.uint8) -> np.ndarray:
        """A read-only ``dtype[count]`` view at byte ``offset``, after :meth:`check`.

        Raises:
            InputChangedError: the file's size changed (CKPT-012).
        """
        self.check()
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)

    def release(self, start: int, stop: int) -> None:
        """Drop the whole pages inside bytes [start, stop) of the file from the resident set
        (``madvise(MADV_DONTNEED)``); the data stays readable from the page cache or disk."""
        lo = -(-start // PAGE) * PAGE
        hi = (stop // PAGE) * PAGE
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Unmap the file, unless a view handed out is still alive (the mapping then goes with it)."""
        _MAPS.discard(self)
        with self._lock:
            try:
                self._mm.close()
            except BufferError:
                pass


def check_inputs() -> None:
    """:meth:`InputMap.check` of every live map: called before an output is committed, so that a file
    rewritten in place (same size) after its last read is not silently mixed into a finished output.

    Raises:
        InputChangedError: CKPT-012, the first input that changed.
    """
    for im in list(_MAPS):
        try:
            im.check()
        except InputChangedError:
            raise
        except ValueError:  # (closed: InputMap.check returns for a closed map; kept for a map closed otherwise)
            if not im.buffer.closed:
                raise


def changed_input() -> InputChangedError:
    """The error for a ``SIGBUS`` while reading a mapped input: the first live map whose file is now
    shorter than the map (its path, the size when opened and now), or, when none is (the file was cut
    and grown back), one that names no file.

    Safe to call from a ``SIGBUS`` handler of the main thread: one ``fstat`` per live map, no exception
    escapes.
    """
    for mm, path in list(_LIVE.items()):
        try:
            if mm.closed:
                continue
            now = mm.size()
        except (OSError, ValueError):
            continue
        if now < len(mm):
            return InputChangedError("the file was cut shorter while it was read (SIGBUS on a vanished page); "
                                     "its size in bytes", path=path, expected=len(mm), found=now)
    return InputChangedError("an input file was cut shorter while it was read (SIGBUS on a vanished page)")

"""Write-behind for output files written front to back (the safetensors and GGUF writers).

Linux keeps written pages dirty in the page cache until ``vm.dirty_background_ratio`` (10% of the
free memory by default: gigabytes) is reached, so a converter that writes a few GB and fsyncs at
the end computes while the disk idles, then waits for the disk. :class:`WriteBehind` starts the
kernel's writeback of each ``step`` bytes as soon as they are written, so the disk works while the
next bytes are computed: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on a range with dirty pages starts
their writeback without waiting for it (``WB_SYNC_NONE`` in ``mm/fadvise.c``) and drops the pages
that are already clean; each range is advised twice, one step apart, so the pages written back in
between leave the page cache too. Durability is unchanged: the writers still fsync before a file
is renamed into place. Where ``posix_fadvise`` does not exist (macOS, Windows), nothing is done.
"""

from __future__ import annotations

import os
from typing import IO

__all__ = ["WRITE_BEHIND_STEP", "WriteBehind"]

#: Bytes between two write-behind calls (64 MiB: a few calls a second at disk speed).
WRITE_BEHIND_STEP = 64 << 20


class WriteBehind:
    """Starts the writeback of a file's bytes as they are written (see the module docstring).

    Args:
        file: the binary file being written, positioned where the streamed bytes start.
        step: bytes between two calls.
    """

    def __init__(self, file: IO[bytes], step: int = WRITE_BEHIND_STEP) -> None:
        self._file = file
        self._step = step
        self._pos = file.tell()  # bytes written so far
        self._done = self._pos  # advised once up to here
        self._previous = self._done  # start of the range advised once (advised again next time)
        self._enabled = hasattr(os, "posix_fadvise")

    def advance(self, nbytes: int) -> None:
        """Call after each write of ``nbytes``: every ``step`` bytes, advise the new range and the
        previous one. An error of the advice (a file system that refuses it) turns it off: it is a hint.
        """
        self._pos += nbytes
        pos = self._pos
        if pos - self._done < self._step or not self._enabled:
            return
        self._file.flush()
        try:
            os.posix_fadvise(self._file.fileno(), self._previous, pos - self._previous, os.POSIX_FADV_DONTNEED)
        except OSError:
            self._enabled = False
        self._previous, self._done = self._done, pos

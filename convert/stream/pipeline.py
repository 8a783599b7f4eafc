"""How every target streams: run settings, chunk sizing under the memory cap, progress, peak RSS.

A target writes its tensors in chunks made by ``threads`` workers and written in order, so the bytes are
the same for every thread count, and holds at most ``2 * threads + 1`` chunks at once, so the resident
set stays near ``max_memory`` whatever the model size. :func:`ordered_chunks` is that loop, the one
every writer runs (:mod:`convert.stream.safetensors_job`, :mod:`convert.gguf.encode`): a writer lists its
chunks in file order (:class:`Chunk`, :data:`FENCE`) and writes what the loop hands back.
:func:`chunk_elements` and :func:`max_threads` size the chunks and the threads for a cap;
:class:`RunSettings` carries the settings to a target's writer.
"""

from __future__ import annotations

import resource
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

from convert.options import MIN_MEMORY
from convert.stream.plan import PlannedTensor
from formats.writeback import BUFFER_BYTES, BUFFERS, IN_PLACE_WRITES, PlacedMemory

__all__ = ["FENCE", "SET_TARGET_MEMORY", "Chunk", "InputLifetime", "RunSettings", "chunk_elements", "chunk_size",
           "max_threads", "min_memory", "ordered_chunks", "peak_rss_bytes", "placed_memory", "ranges", "share_memory"]

#: Bytes of working memory per element in flight (fp32 value + output + temporaries).
_BYTES_PER_ELEMENT = 16
#: Memory left for the interpreter, NumPy and the libraries, out of ``max_memory``.
_BASELINE = 96 * 1024 * 1024


class InputLifetime(Protocol):
    """Keeps the input files a tensor reads on disk while it is written, and no longer (a low-disk Hub
    run, :class:`convert.hub.shards.ShardLifetime`: each shard is fetched before the first tensor that
    reads it and deleted after the last one is written)."""

    def ready(self, tensor: PlannedTensor) -> bool:
        """Whether every input file ``tensor`` reads is on disk already."""

    def need(self, tensor: PlannedTensor) -> None:
        """``tensor`` is about to be made: its input files must be readable from now on (the pipeline
        first writes every chunk in flight, so the files earlier tensors were the last to read are gone)."""

    def done(self, tensor: PlannedTensor) -> None:
        """``tensor`` is written (or was reused from a killed run): it reads its inputs no more."""


@dataclass(frozen=True)
class RunSettings:
    """How a target writes.

    Attributes:
        threads: worker threads (>= 1).
        max_memory: the working-memory cap in bytes.
        progress: show a tqdm bar (bytes written) on stderr.
        label: the bar's label (the output's name).
        on_progress: called with (bytes written, bytes to write) as the output is written (batch
            workers report their progress through it), or None.
        inputs: told when each tensor is about to be made and when it is written (a low-disk Hub
            run's shard lifetime), or None.
        processes: a GGUF target may encode in worker processes (``ConvertOptions.processes``).
    """

    threads: int
    max_memory: int
    progress: bool = False
    label: str = ""
    on_progress: Callable[[int, int], None] | None = None
    inputs: InputLifetime | None = None
    processes: bool = False

    def bar(self, total: int) -> Any:
        """A progress sink of ``total`` bytes with ``update(n)`` and ``close()``: a tqdm bar on stderr
        (``progress``), :attr:`on_progress`, both, or None when neither is asked for."""
        tq = None
        if self.progress:
            # (heavy: ~40 ms to import; only a progress bar needs it)
            from tqdm import tqdm

            tq = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=self.label, file=sys.stderr,
                      leave=False)
        if self.on_progress is None:
            return tq
        return _Progress(total, tq, self.on_progress)


class _Progress:
    """Bytes written, passed on to a callback (and a tqdm bar, when there is one)."""

    def __init__(self, total: int, bar: Any, callback: Callable[[int, int], None]) -> None:
        self.total, self.done, self.bar, self.callback = total, 0, bar, callback
        self._lock = threading.Lock()
        callback(0, total)

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            done = self.done
        if self.bar is not None:
            self.bar.update(n)
        self.callback(done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes.

    Linux: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this process's own address space
    (which :func:`reset_peak_rss` restarts). Not ``ru_maxrss``: Linux carries the spawning process's
    peak into it across exec, so a batch worker started by a big batch process reported at least that
    process's peak. Elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_rss() -> bool:
    """Start :func:`peak_rss_bytes` again from the current resident set (Linux: ``5`` to
    ``/proc/self/clear_refs``), for a process that runs one job after another.

    Returns:
        whether it was reset (False where the kernel does not offer it: the peak stays the process's).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def chunk_elements(unit: int, max_memory: int, threads: int) -> int:
    """Elements per chunk: a multiple of ``unit`` such that all chunks in flight fit ``max_memory``.

    Args:
        unit: required alignment in elements (a layer's blocksize, or 1).
        max_memory: the memory cap in bytes.
        threads: worker threads (2 * threads + 1 chunks can be in flight).
    """
    budget = max(max_memory - _BASELINE, 16 * 1024 * 1024)
    n = budget // ((2 * threads + 1) * _BYTES_PER_ELEMENT)
    n = min(n, 1 << 24)
    return max(unit, (n // unit) * unit)


#: What each target of a run of several adds to the least ``max_memory`` the run keeps to (:func:`min_memory`): its
#: output stream's buffers and the floor of its chunks (:func:`share_memory`).
SET_TARGET_MEMORY = BUFFERS * BUFFER_BYTES + 16 * 1024 * 1024


def min_memory(writers: int) -> int:
    """The least ``max_memory`` a run of ``writers`` targets keeps to (its peak within the cap and the project's
    100 MiB allowance, as a single run at :data:`convert.options.MIN_MEMORY`): that minimum, and
    :data:`SET_TARGET_MEMORY` for each target after the first (6 targets: 304 MiB)."""
    return MIN_MEMORY + (max(1, writers) - 1) * SET_TARGET_MEMORY


def share_memory(max_memory: int, writers: int) -> tuple[int, int]:
    """One cap for a run of several targets, each writing in threads of its own: ``(each writer's cap, bytes of
    the shared blocks)`` (:class:`convert.stream.shared.SharedProducts`). The interpreter's baseline is counted
    once, and with it one output stream's buffers (:data:`formats.writeback.BUFFERS` of
    :data:`~formats.writeback.BUFFER_BYTES`); each further writer's stream is taken off first; of the rest an
    eighth holds the shared blocks and the writers split the other seven eighths, each given its part plus the
    baseline as its own ``max_memory`` (which :func:`chunk_elements` takes off again). Each writer's chunks
    are at least :func:`chunk_elements`'s floor of 16 MiB, so a run holds more than ``max_memory`` below
    :func:`min_memory` (which a run of several targets refuses: USE-001).
    """
    streams = (max(1, writers) - 1) * BUFFERS * BUFFER_BYTES
    budget = max(max_memory - _BASELINE - streams, 16 * 1024 * 1024)
    shared = budget // 8
    return (budget - shared) // max(1, writers) + _BASELINE, shared


#: The smallest chunk worth giving a thread, in elements: more threads than the cap allows at this size
#: would only cut every chunk smaller.
MIN_CHUNK_ELEMENTS = 1 << 16


def max_threads(max_memory: int, unit: int = 1) -> int:
    """The most worker threads whose chunks in flight (``2 * threads + 1`` of at least
    ``max(unit, MIN_CHUNK_ELEMENTS)`` elements) fit ``max_memory``.

    Args:
        max_memory: the memory cap in bytes.
        unit: the largest chunk alignment of the plan, in elements (an int8 row, a blocksize).
    """
    budget = max(max_memory - _BASELINE, 16 * 1024 * 1024)
    per_chunk = max(unit, MIN_CHUNK_ELEMENTS) * _BYTES_PER_ELEMENT
    return max(1, (budget // per_chunk - 1) // 2)


def ranges(t: PlannedTensor, chunk: int) -> Iterator[tuple[int, int]]:
    """The element ranges ``[start, stop)`` of ``t`` in chunks of ``chunk`` elements, in order."""
    n = t.numel
    for s in range(0, n, chunk):
        yield s, min(n, s + chunk)


def chunk_size(t: PlannedTensor, run: RunSettings) -> int:
    """Elements per chunk of ``t``: :func:`chunk_elements`, at most the source's ``max_chunk`` (in whole units)."""
    unit = t.source.unit
    n = chunk_elements(unit, run.max_memory, run.threads)
    if t.source.max_chunk:
        n = min(n, max(unit, t.source.max_chunk // unit * unit))
    return n


def placed_memory(threads: int) -> PlacedMemory:
    """Reused memory for the chunks of one run of ``threads`` workers (:class:`formats.writeback.PlacedMemory`,
    keeping as many free slabs as chunks can be in flight: ``2 * threads + 1`` made or written, and the
    writer's in-place writes)."""
    return PlacedMemory(keep=2 * threads + 1 + IN_PLACE_WRITES)


@dataclass(frozen=True)
class Chunk:
    """One chunk of an output, in file order, for :func:`ordered_chunks`.

    Attributes:
        key: what the writer needs to know of the chunk (its tensor, its range, ...): handed back with it.
        make: makes the chunk's data: in a worker, or with ``in_order`` in the writing thread once every
            chunk before it is written (a barrier source, made from what the earlier chunks left); None
            when ``data`` is given.
        data: the data, made already (a tiny tensor made by the writing thread), or None with ``make``
            None: a marker that holds nothing (e.g. a tensor's end), neither counted nor made.
        in_order: run ``make`` in the writing thread when the chunk's turn to be written comes.
    """

    key: Any
    make: Callable[[], Any] | None = None
    data: Any = None
    in_order: bool = False


#: Given among the chunks: every chunk before it is handed back (written) before the next one is asked for.
FENCE = Chunk(None)


def ordered_chunks(chunks: Iterable[Chunk], pool: Executor | None, held: int) -> Iterator[tuple[Any, Any]]:
    """Make ``chunks`` with ``pool``'s workers and hand them back in their order, ``(key, data)``.

    The one chunk loop of every writer: the chunks of consecutive tensors flow through the workers as one
    stream (no worker waits at a tensor's end), and are written in order, so the bytes do not depend on the
    thread count. At most ``held`` chunks (markers aside) are made, being made or waiting to be written;
    the next chunk is asked of ``chunks`` only when there is room, so a generator of chunks runs at most
    ``held`` chunks ahead of the writer, and code after it yields :data:`FENCE` runs once every earlier
    chunk has been handed back. A worker's exception is raised here when its chunk's turn comes.

    Args:
        chunks: the chunks in file order (a generator: made lazily).
        pool: the workers; None: each chunk is made when it is taken (one thread).
        held: the most chunks in flight (``2 * workers``).

    Yields:
        ``(chunk.key, data)`` in the order of ``chunks`` (``data`` None for a marker).
    """
    pending: deque[tuple[Chunk, Any]] = deque()  # (chunk, a worker's future or the data), in file order
    counted = 0
    for c in chunks:
        if c is FENCE:
            while pending:
                yield _take(pending)
            counted = 0
            continue
        if c.make is None or c.in_order:
            pending.append((c, c.data))
        elif pool is None:
            pending.append((c, c.make()))
        else:
            pending.append((c, pool.submit(c.make)))
        counted += _counted(c)
        del c  # (the pending queue holds it; once taken, nothing here does)
        while counted > held:
            counted -= _counted(pending[0][0])
            yield _take(pending)
    while pending:
        yield _take(pending)


def _counted(c: Chunk) -> bool:
    return c.make is not None or c.data is not None


def _take(pending: deque[tuple[Chunk, Any]]) -> tuple[Any, Any]:
    """The oldest chunk's ``(key, data)``, made now when it is made in order; nothing here keeps a
    reference to the data once it is handed back (a zero-copy chunk is a view of an input file that
    the writer may unmap right after writing it)."""
    c, held = pending.popleft()
    if c.in_order:
        return c.key, c.make()  # type: ignore[misc]
    return c.key, held.result() if isinstance(held, Future) else held


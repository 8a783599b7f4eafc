"""Several targets from one read: each weight dequantized once, its values handed to every target's writer
(:class:`SharedProducts`).

A run of several targets (``--to bf16,gguf:q8_0,nf4``: :func:`convert.run.several.convert_set`) runs each target as
a single run does, in a thread of its own: its own plan, sources, job and chunk loop
(:func:`convert.stream.pipeline.ordered_chunks`), so each output has the bytes of its single run. The
sources that dequantize (:class:`~convert.stream.sources.Dequant4Source`,
:class:`~convert.stream.sources.Int8Source`) of every target are linked to one :class:`SharedProducts`
(:meth:`Consumer.link`), which makes each *block* of a weight (about :data:`BLOCK_ELEMENTS` elements on its
chunk unit) once and keeps it while another target still has to read it. Each target reads a weight in the
dtype it would alone (the ``dequantize_to`` of each target is unchanged: a bf16 output and GGUF
F16/BF16/Q8_0 take the checkpoint's dtype, the llama-quantize types the exact float32 products), so a block
is held as the exact float32 products (:meth:`~convert.stream.sources.Dequant4Source.exact_into`), which
each reader rounds once to its dtype as the source's own kernel would, or, where every reader asks for
bfloat16, as bfloat16 made by the kernel, which each reader takes as a read-only view where its chunks are whole
blocks (a GGUF target's row chunks, a safetensors target's chunks: :meth:`~convert.stream.sources.Source.produce_view`)
and copies elsewhere. A block is made in reused memory (:class:`formats.writeback.PlacedMemory`), placed at the file
offset of the safetensors target that asks for it first, whose writer sends it to the disk from there. Nothing
else is shared: plain tensors are read from the input by each target (a copy or a cast, no dequantization), and a
LoRA merge is made by each target in its own dtype from the shared base.

Order and memory. The targets write their files in their own orders, which agree for the dequantized
weights of a transformers checkpoint (tensor names in order) and differ where a format sorts otherwise
(a GGUF file's stacked MoE experts; an NF4 output's absmax pass). A block is made by the first target
that asks for it and held, within ``budget`` bytes, until every other target that reads it has: a target
that runs ahead waits for room (the targets stay in step, at the pace of the slowest, which sets the
wall time anyway), and when every target a held block waits for is itself waiting for room (their orders
differ), the oldest blocks are dropped and made again by whoever still needs them: the cap always holds,
and nothing waits for ever. A block that no other target will read is not held: its reader makes it
straight in its own dtype, as a single run does.

The run's threads: :meth:`Consumer.ready` holds each target until every target is planned (or has failed)
before the first block is made, and gives it its share of the run's worker threads (:func:`allot_threads`:
the targets move in step, so each gets threads in proportion to the CPU it spends on what it reads);
:meth:`Consumer.withdraw` takes a finished or failed target out, so no block waits for it;
:meth:`SharedProducts.cancel` makes every waiting and later call raise ``KeyboardInterrupt`` (a stopped run).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from convert.dequant.kernels_f16 import count_f16_loss
from convert.options import FLOAT_TARGETS
from formats.dtypes import BY_NAME, DType
from formats.writeback import PlacedMemory

if TYPE_CHECKING:
    from convert.stream.sources import Source

__all__ = ["BLOCK_ELEMENTS", "Consumer", "SharedProducts", "allot_threads", "block_elements", "shared_leaves"]

#: Elements of a shared block, about (a multiple of the source's chunk unit): 8 MiB of bfloat16, 16 MiB of float32.
#: A safetensors target writes each block with one direct write (a virtual disk takes large writes faster), and every
#: block costs each target a few hand-offs between threads: with blocks of 2^21 elements ``--to bf16,gguf:q8_0,nf4``
#: of the bench model took 1.047x the wall time (paired, n=7) and 0.76x the peak RSS (210 vs 275 MiB), with 2^20
#: 1.158x and 0.66x (n=5; docs/performance.md).
BLOCK_ELEMENTS = 1 << 22
#: Float32 blocks the shared budget holds at least (:func:`block_elements`: smaller blocks under a small budget).
HELD_BLOCKS = 4
#: The least elements of a block under a small budget (smaller blocks cost more in hand-offs than they share).
MIN_BLOCK_ELEMENTS = 1 << 20
#: Free slabs of the blocks' memory kept for the next blocks (:class:`formats.writeback.PlacedMemory`; 3 and 8 ran
#: alike).
KEPT_SLABS = 4
#: Seconds a read waits for room with nothing changing in the cache before it makes its block for itself
#: (a guard: the wait rule above ends every wait sooner).
STALL_SECONDS = 30.0


def block_elements(budget: int) -> int:
    """Elements of the shared blocks of a run whose blocks are held within ``budget`` bytes: :data:`BLOCK_ELEMENTS`,
    or fewer where :data:`HELD_BLOCKS` blocks of float32 would not fit (a smaller ``--max-memory``: 44 MiB of blocks
    for three targets at 512 MiB), at least :data:`MIN_BLOCK_ELEMENTS` (three targets at 256 MiB, 12 MiB: blocks
    of 2^22 would hold no float32 block, and of 2^16 cost the run at 160 MiB 1.4x the wall time of 2^20)."""
    return min(BLOCK_ELEMENTS, max(MIN_BLOCK_ELEMENTS, budget // (HELD_BLOCKS * 4)))


def allot_threads(threads: int, work: dict[int, float]) -> dict[int, int]:
    """The worker threads of each target of a run of ``threads``: ``work`` is each target's CPU for what it
    reads from the shared blocks (its weights times its CPU per weight). The targets move in step (a block is
    held until every target has read it), so the run goes at the pace of the target with the least threads for
    its work: each gets ``ceil(threads * work / total)``, at least 1 (a target whose layers are copied as they
    are reads nothing: 1). No work at all (nothing is shared): each gets ``threads``, as alone.

    Example: ``--to bf16,gguf:q8_0,nf4`` of an NF4 model, 2 threads: works 1, 2.5 and 0 per weight give
    1, 2 and 1 threads (each target alone would take 2)."""
    total = sum(work.values())
    if total <= 0:
        return dict.fromkeys(work, threads)
    return {c: max(1, math.ceil(threads * w / total - 1e-9)) for c, w in work.items()}


def shared_leaves(sources: Iterable[Source]) -> list[Source]:
    """The sources that dequantize (those with ``exact_into``) under ``sources``, each once, found through
    :meth:`~convert.stream.sources.Source.reads` (a merge's base, a stack's slices, a re-quantized weight's
    input)."""
    out: dict[int, Source] = {}
    seen: set[int] = set()
    todo = list(sources)
    while todo:
        src = todo.pop()
        if id(src) in seen:
            continue
        seen.add(id(src))
        if hasattr(src, "exact_into"):
            out[id(src)] = src
        todo.extend(src.reads())
    return list(out.values())


@dataclass
class _Block:
    """One held block: its values (None while being made), the readers using it now, its bytes."""

    nbytes: int
    data: np.ndarray | None = None
    users: int = 0


@dataclass
class _Key:
    """One shared weight: its block grid, per reader the elements of each block it has still to read (its first
    pass: a second pass by the same reader does not hold a block) and the dtype it asks for, and the dtype its
    blocks are held in (:meth:`held_dtype`)."""

    numel: int
    grid: int
    left: dict[int, npt.NDArray[np.int64]] = field(default_factory=dict)
    wants: dict[int, str] = field(default_factory=dict)
    dtype: DType | None = None

    def held_dtype(self) -> DType:
        """The dtype the blocks are made in, chosen at the first block: the one every reader asks for when they
        agree on bfloat16 (made straight by the kernel, copied to each; half the bytes of float32), else the exact
        float32 products, which each reader rounds (float16 too, so that each counts its own losses)."""
        if self.dtype is None:
            asked = set(self.wants.values())
            self.dtype = BY_NAME["bfloat16" if asked == {"bfloat16"} else "float32"]
        return self.dtype

    def lengths(self) -> npt.NDArray[np.int64]:
        n = -(-self.numel // self.grid)
        lens = np.full(n, self.grid, dtype=np.int64)
        if n:
            lens[-1] = self.numel - (n - 1) * self.grid
        return lens


class SharedProducts:
    """The blocks of the dequantized weights shared by the targets of one run (see the module docstring).

    Args:
        budget: bytes of blocks held at once, at most.
        consumers: the number of targets (each takes one :meth:`consumer`).
        block: elements of a block, about (default :func:`block_elements` of ``budget``).
        threads: the run's worker threads, shared out among the targets (:func:`allot_threads`).
    """

    def __init__(self, budget: int, consumers: int, block: int | None = None, threads: int = 1) -> None:
        self.budget = budget
        self.block = max(1, block_elements(budget) if block is None else block)
        self._memory = PlacedMemory(keep=KEPT_SLABS)  # the blocks' memory, used again
        self.threads = threads
        self._work: dict[int, float] = {}  # reader -> its CPU for the weights it reads (link)
        #: reader -> its worker threads, set once every target is ready (:func:`allot_threads`)
        self.allotted: dict[int, int] = {}
        self._cond = threading.Condition()
        self._keys: dict[str, _Key] = {}
        self._blocks: dict[tuple[str, int], _Block] = {}  # insertion order: oldest first
        self._used = 0
        self._expected = consumers
        self._ready: set[int] = set()
        self._gone: set[int] = set()
        self._inside: dict[int, int] = {}  # reader -> its threads in read()
        self._waiting: dict[int, int] = {}  # reader -> those of them waiting for room
        self._changes = 0  # counts every block freed, made or dropped and every reader leaving
        self._cancelled = False
        self._next = 0
        #: figures: blocks made and held, values handed out from held blocks, blocks dropped for room, the
        #: most bytes held at once
        self.made = self.hits = self.dropped = self.peak = 0

    def consumer(self) -> Consumer:
        """A new reader (one per target)."""
        with self._cond:
            c = Consumer(self, self._next)
            self._next += 1
            return c

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled

    def cancel(self) -> None:
        """Stop the run: every waiting and later call raises ``KeyboardInterrupt``."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    # --- called through Consumer ------------------------------------------------------------------

    def _link(self, c: int, sources: Iterable[Source], dequantize_to: str, work: float) -> None:
        with self._cond:
            leaves = shared_leaves(sources)
            self._work[c] = work * sum(src.numel for src in leaves)
            for src in leaves:
                unit = max(1, src.unit)
                key = self._keys.get(src.name)
                if key is None:
                    key = _Key(src.numel, _grid(self.block, unit, src.row_elements))
                    self._keys[src.name] = key
                if key.numel != src.numel or key.grid % unit:  # (never for one checkpoint: not shared then)
                    continue
                key.left[c] = key.lengths()
                key.wants[c] = _asked(src, dequantize_to)
                src.shared = _Link(self, c)

    def _arrive(self, c: int) -> int:
        with self._cond:
            self._ready.add(c)
            self._cond.notify_all()
            while len(self._ready | self._gone) < self._expected:
                if self._cancelled:
                    raise KeyboardInterrupt("stopped")
                self._cond.wait()
            if not self.allotted:  # (the first target past the wait: the others ready are those that share)
                self.allotted = allot_threads(self.threads, {r: self._work.get(r, 0.0) for r in self._ready})
            return self.allotted.get(c, self.threads)

    def _leave(self, c: int) -> None:
        with self._cond:
            if c in self._gone:
                return
            self._gone.add(c)
            for key in self._keys.values():
                key.left.pop(c, None)
                key.wants.pop(c, None)
            for k in [k for k, b in self._blocks.items() if b.data is not None and not b.users
                      and not self._wanted(k, None)]:
                self._free(k)
            self._changes += 1
            self._cond.notify_all()

    def _wanted(self, k: tuple[str, int], but: int | None) -> list[int]:
        """The readers other than ``but`` that have still to read block ``k``."""
        key = self._keys[k[0]]
        return [c for c, left in key.left.items() if c != but and left[k[1]] > 0]

    def _free(self, k: tuple[str, int]) -> None:
        b = self._blocks.pop(k)
        self._used -= b.nbytes
        self._changes += 1

    def _stuck(self, c: int) -> bool:
        """Whether waiting for room could last for ever: every reader some held block waits for is itself
        waiting for room with no read under way (``c`` counts as waiting)."""
        for k, b in self._blocks.items():
            if b.data is None:
                return False  # a block being made: it will be handed out
            for r in self._wanted(k, None):  # (a reader's threads in read(), this one too, count in _inside)
                waiting = self._waiting.get(r, 0) + (r == c)
                if waiting < self._inside.get(r, 0) or not waiting:
                    return False
        return True

    def _room(self, nbytes: int) -> bool:
        """Drop the oldest held blocks no read is using until ``nbytes`` more fit ``budget``."""
        for k in [k for k, b in self._blocks.items() if b.data is not None and not b.users]:
            if self._used + nbytes <= self.budget:
                break
            self._free(k)
            self.dropped += 1
        return self._used + nbytes <= self.budget

    def _get(self, c: int, src: Source, name: str, j: int, b0: int, b1: int, dtype: DType,
             at: int = 0) -> _Block | None:
        """Block ``j`` of ``name`` (elements [b0, b1)) for reader ``c`` asking for ``dtype``, held and marked used;
        None when ``c`` makes its part itself (nobody else reads it, no room, or the blocks are held in a dtype
        ``dtype`` is not made from). A block made here lies in memory at ``at`` modulo
        :data:`formats.writeback.ALIGN` (a writer's file offset for it: written from there without a copy)."""
        k = (name, j)
        with self._cond:
            held = self._keys[name].held_dtype()
            if held != dtype and held.name != "float32":
                return None
            nbytes = (b1 - b0) * held.itemsize
            since, seen = time.monotonic(), self._changes
            while True:
                if self._cancelled:
                    raise KeyboardInterrupt("stopped")
                b = self._blocks.get(k)
                if b is not None:
                    if b.data is not None:
                        b.users += 1
                        return b
                    self._cond.wait()  # being made by another reader
                    continue
                if not self._wanted(k, c) or nbytes > self.budget:
                    return None
                if self._used + nbytes <= self.budget or (self._stuck(c) and self._room(nbytes)):
                    b = _Block(nbytes)
                    self._blocks[k] = b
                    self._used += nbytes
                    self.peak = max(self.peak, self._used)
                    break
                if self._changes != seen:
                    since, seen = time.monotonic(), self._changes
                elif time.monotonic() - since > STALL_SECONDS:
                    return None
                self._waiting[c] = self._waiting.get(c, 0) + 1
                try:
                    self._cond.wait(timeout=1.0)
                finally:
                    self._waiting[c] -= 1
        try:
            data = self._memory.empty(nbytes, at).view(held.numpy)
            if held.name == "float32":
                src.exact_into(b0, b1, data)  # type: ignore[attr-defined]
            else:
                src.dequant_into(b0, b1, held, data)  # type: ignore[attr-defined]
        except BaseException:
            with self._cond:
                self._free(k)
                self._cond.notify_all()
            raise
        with self._cond:
            b.data, b.users = data, 1
            self.made += 1
            self._changes += 1
            self._cond.notify_all()
        return b

    def _done(self, c: int, name: str, j: int, n: int, b: _Block | None) -> None:
        """Reader ``c`` has read ``n`` elements of block ``j`` (from ``b`` when held)."""
        with self._cond:
            key = self._keys[name]
            left = key.left.get(c)
            if left is not None:
                left[j] = max(0, left[j] - n)
            if b is not None:
                b.users -= 1
                self.hits += n
                if not b.users:  # (room made, or a block that may be dropped for room: waiters look again)
                    if self._blocks.get((name, j)) is b and not self._wanted((name, j), None):
                        self._free((name, j))
                    self._cond.notify_all()

    def _view(self, c: int, src: Source, start: int, stop: int, dtype: DType, at: int = 0) -> np.ndarray | None:
        """Elements [start, stop) of ``src`` for reader ``c`` as a view of the one held block that holds them in
        ``dtype`` (made now if no reader has, placed so that ``start`` lies at ``at`` modulo
        :data:`formats.writeback.ALIGN`), read at once (the view keeps the values alive after the block leaves
        the cache); None when they span blocks, are held in another dtype, or ``c`` makes them itself
        (:meth:`_get`)."""
        name = src.name
        key = self._keys[name]
        j = start // key.grid
        b0, b1 = j * key.grid, min(key.numel, (j + 1) * key.grid)
        if stop > b1 or stop <= start:
            return None
        with self._cond:
            if key.held_dtype() != dtype:
                return None
            self._inside[c] = self._inside.get(c, 0) + 1
        try:
            b = self._get(c, src, name, j, b0, b1, dtype, at - (start - b0) * dtype.itemsize)
            if b is None:
                return None
            assert b.data is not None
            view = b.data[start - b0 : stop - b0]
            view.flags.writeable = False  # (the other readers' values)
            self._done(c, name, j, stop - start, b)
            return view
        finally:
            with self._cond:
                self._inside[c] -= 1

    def _read(self, c: int, src: Source, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        name = src.name
        key = self._keys[name]
        flat = out.reshape(-1)
        with self._cond:
            self._inside[c] = self._inside.get(c, 0) + 1
        try:
            g = key.grid
            for j in range(start // g, -(-stop // g)):
                b0, b1 = j * g, min(key.numel, (j + 1) * g)
                s, e = max(start, b0), min(stop, b1)
                part = flat[s - start : e - start]
                b = self._get(c, src, name, j, b0, b1, dtype)
                try:
                    if b is None:
                        src.dequant_into(s, e, dtype, part)  # type: ignore[attr-defined]
                    else:
                        assert b.data is not None
                        _round_into(b.data[s - b0 : e - b0], dtype, part, src)
                finally:
                    self._done(c, name, j, e - s, b)
        finally:
            with self._cond:
                self._inside[c] -= 1


def _grid(block: int, unit: int, row: int) -> int:
    """Elements of a weight's shared blocks: about ``block``, a multiple of ``unit`` (a chunk boundary of the
    source); whole rows of ``row`` elements when a row is whole units (a GGUF writer's row chunks can then be
    whole blocks, handed out without a copy: :meth:`~convert.stream.sources.Source.produce_view`)."""
    if row and row % unit == 0:
        return max(1, block // row) * row
    return max(unit, block // unit * unit)


def _asked(src: Source, dequantize_to: str) -> str:
    """The dtype a target of ``dequantize_to`` reads ``src`` in: the ``--to`` dtype, or with ``auto`` a 4-bit
    layer's QuantState dtype (float32 where unknown: an int8 layer's comes from the config)."""
    named = FLOAT_TARGETS.get(dequantize_to)
    if named is not None:
        return named
    state = getattr(getattr(src, "layer", None), "state", None)
    return state.dtype if state is not None else "float32"


def _round_into(x: np.ndarray, dtype: DType, out: np.ndarray, counts: Source) -> None:
    """Held values ``x`` into ``out`` as ``dtype``: copied when they are of it already (bfloat16 made by the
    kernel), else float32 products rounded once, as the source's kernels round them (round to nearest even;
    float16's overflows to inf and non-zero values flushed to zero counted in ``counts.stats``, as
    :func:`convert.dequant.kernels.dequantize_4bit` counts them)."""
    if x.dtype == dtype.numpy:
        np.copyto(out, x)
    elif dtype.name == "float16":
        with np.errstate(over="ignore"):
            np.copyto(out, x, casting="unsafe")
        local = np.zeros(2, dtype=np.int64)
        count_f16_loss(x, out, local)
        counts._add_stats(local)
    else:
        np.copyto(out, x, casting="unsafe")  # bfloat16: ml_dtypes' cast, round to nearest even


class _Link:
    """What a linked source holds: its run's :class:`SharedProducts` and its reader."""

    def __init__(self, products: SharedProducts, reader: int) -> None:
        self.products, self.reader = products, reader

    def read(self, src: Source, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        """Elements [start, stop) of ``src`` as ``dtype`` into ``out`` (flat, C-contiguous), from the shared
        blocks (or made by ``src`` itself where no other target reads them)."""
        self.products._read(self.reader, src, start, stop, dtype, out)

    def view(self, src: Source, start: int, stop: int, dtype: DType, at: int = 0) -> np.ndarray | None:
        """Elements [start, stop) of ``src`` as a view of the shared block holding them in ``dtype`` (not to be
        written into), or None where :meth:`read` has to make or round them."""
        return self.products._view(self.reader, src, start, stop, dtype, at)

    def grid(self, src: Source) -> int:
        """Elements of ``src``'s shared blocks (from its first element)."""
        return self.products._keys[src.name].grid


class Consumer:
    """One target of a shared run (:meth:`SharedProducts.consumer`)."""

    def __init__(self, products: SharedProducts, reader: int) -> None:
        self.products, self.reader = products, reader

    def link(self, sources: Iterable[Source], dequantize_to: str, work: float = 1.0) -> None:
        """Read the dequantized weights under ``sources`` (the target's job's: its
        :meth:`~convert.targets.TargetJob.sources`) through the shared blocks from now on; the target dequantizes
        to ``dequantize_to`` (:attr:`convert.options.Target.dequantize_to`) and spends ``work`` CPU per weight
        (:attr:`~convert.targets.TargetJob.work_per_weight`: its share of the threads, :func:`allot_threads`)."""
        self.products._link(self.reader, sources, dequantize_to, work)

    def ready(self) -> int:
        """Wait until every target of the run is linked (or has left).

        Returns:
            this target's worker threads (:func:`allot_threads`).

        Raises:
            KeyboardInterrupt: the run was cancelled.
        """
        return self.products._arrive(self.reader)

    def withdraw(self) -> None:
        """The target is done (written or failed): no block waits for it any more."""
        self.products._leave(self.reader)

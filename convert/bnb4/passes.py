"""The passes over one weight that ``--to nf4|fp4`` makes its 4-bit tensors from, under the memory cap.

A weight is read from its planned source in block-aligned pieces (:class:`LayerInput`), never whole.

Pass 1, the absmax pass (:class:`AbsmaxPass`)
    Double quantization needs the mean of the whole layer's absmax before its QuantState JSON (whose
    length is in the header) can be written, so a pre-pass reads every nested layer once and keeps
    its nested statistics (``nested_absmax``, offset, absmax median and max), then drops the
    input's caches and pages. A layer's fp32 absmax (from the pre-pass, or a non-nested layer's first
    full pass) is kept until the layer is written if it fits a share of ``--max-memory``
    (:class:`AbsmaxBudget`: 1/8, taken first come first served), otherwise recomputed by the codes pass.

Pass 2, the codes pass (:meth:`LayerJob.encode`)
    Makes the packed 4-bit codes piece by piece, feeds the report (:class:`~convert.bnb4.report.ReportAccumulator`)
    and, for a nested layer, records the 8-bit absmax codes (1 byte a block, :class:`AbsmaxCodes`) for
    the layer's absmax tensor, written after the weight: a nested layer is read exactly twice.

:class:`LayerJob` ties the passes of one weight together and frees what they keep once its last output
tensor is written (the sources in :mod:`convert.bnb4.sources` call :meth:`LayerJob.done_one`).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from convert.bnb4.absmax8 import NESTED_BLOCKSIZE, encode_8bit, nested_statistics, resolve_nested
from convert.bnb4.encode import blockwise_absmax, codec
from convert.bnb4.report import QuantReport, ReportAccumulator, stored_nbytes
from convert.bnb4.settings import QuantSettings
from convert.stream.plan import PlannedTensor
from formats.bnb import QuantState
from formats.errors import NestedOffsetOverflowError, NonFiniteWeightError

__all__ = ["AbsmaxBudget", "AbsmaxCodes", "AbsmaxPass", "LayerInput", "LayerJob", "nested_codes"]

#: Elements released either side of each piece read: 2 MiB at 4 bits per element. A fault maps the
#: whole page-cache folio around it (64 KiB of fault-around, and up to 2 MiB with the large folios of
#: recent kernels, e.g. ext4 on Linux 6.16+), which re-maps pages of pieces released already.
_RELEASE_MARGIN = 1 << 22


def _source_file(src: Any) -> str | None:
    """The input file behind a source, when it has one (for error messages)."""
    for _ in range(4):
        for attr in ("record", "layer"):
            obj = getattr(src, attr, None)
            rec = getattr(obj, "packed", obj) if attr == "layer" else obj
            if rec is not None and hasattr(rec, "file"):
                return str(rec.file)
        src = getattr(src, "inner", None)
        if src is None:
            break
    return None


class LayerInput:
    """One weight's planned source, read in block-aligned pieces in the weight's own dtype.

    Attributes:
        name: the weight.
        source: its planned :class:`~convert.stream.sources.Source`.
        dtype: its dtype in the plan (read as is, no conversion).
        shape: its shape in elements.
        n: elements.
        blocksize: elements per absmax block.
        n_blocks: ``ceil(n / blocksize)``.
        align: pieces start on multiples of this many elements (the blocksize and the source's unit).
        piece: elements read at a time, a multiple of ``align``.
    """

    def __init__(self, t: PlannedTensor, blocksize: int, piece: int) -> None:
        self.name = t.name
        self.source = t.source
        self.dtype = t.dtype
        self.shape = tuple(int(d) for d in t.shape)
        self.n = math.prod(self.shape)
        self.blocksize = blocksize
        self.n_blocks = -(-self.n // blocksize)
        self.align = math.lcm(blocksize, max(1, int(getattr(self.source, "unit", 1) or 1)))
        self.piece = max(self.align, (piece // self.align) * self.align)

    def pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        """Elements [a, b) as (start, stop) pieces of at most :attr:`piece` elements."""
        return [(s, min(b, s + self.piece)) for s in range(a, b, self.piece)]

    def read(self, a: int, b: int) -> np.ndarray:
        """Elements [a, b) of the flat weight in its natural dtype (a on an aligned boundary).

        A zero-copy source hands out a view of the input file's pages: call :meth:`release` once the
        values are used (released any earlier, they would be faulted in again by the use, and stay).
        """
        x = np.asarray(self.source.produce(a, b, self.dtype)).reshape(-1)
        if x.dtype != self.dtype.numpy:  # a copying source hands out raw bytes
            x = x.view(self.dtype.numpy)
        return x

    def release(self, a: int, b: int) -> None:
        """Drop the input pages of elements [a, b), read and used, and of a margin either side.

        The margin: the kernel maps pages around each fault ("fault-around", 64 KiB, or a large folio),
        which re-maps pages of a neighbouring piece released already.
        """
        self.source.release(max(0, a - _RELEASE_MARGIN), min(self.n, b + _RELEASE_MARGIN))

    def absmax(self, x: np.ndarray, start: int) -> npt.NDArray[np.float32]:
        """:func:`~convert.bnb4.encode.blockwise_absmax` of elements read from ``start``.

        Raises:
            NonFiniteWeightError: QNT-003, naming this tensor, its file and the block holding NaN or infinity.
        """
        try:
            return blockwise_absmax(x, self.blocksize)
        except NonFiniteWeightError as exc:
            am = np.abs(np.asarray(x, dtype=np.float32))
            bad = start // self.blocksize + int(np.flatnonzero(~np.isfinite(am))[0]) // self.blocksize
            raise NonFiniteWeightError(exc.reason, path=_source_file(self.source), tensor=self.name,
                                       expected=exc.expected, found=f"non-finite value in block {bad}",
                                       hint=exc.hint, action="quantize") from None

    def absmax_blocks(self, ba: int, bb: int) -> npt.NDArray[np.float32]:
        """``float32[bb - ba]`` fp32 absmax of blocks [ba, bb), read from the source."""
        a, b = ba * self.blocksize, min(self.n, bb * self.blocksize)
        out = np.empty(max(0, bb - ba), dtype=np.float32)  # filled in place: no list of parts to join
        for s, e in self.pieces(a, b):
            k = s // self.blocksize - ba
            am = self.absmax(self.read(s, e), s)
            self.release(s, e)
            out[k : k + am.size] = am
        return out

    def finish(self) -> None:
        """Drop the source's caches and pages (:meth:`convert.stream.sources.Source.finish`)."""
        self.source.finish()


class AbsmaxBudget:
    """Bytes of cached absmax allowed across layers (a share of --max-memory)."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Reserve n bytes; False (nothing reserved) when fewer are left."""
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def give(self, n: int) -> None:
        """Return n bytes reserved by :meth:`take`."""
        with self._lock:
            self.left += n


class AbsmaxPass:
    """Pass 1 over one weight: its whole fp32 absmax, and what the later passes keep of it.

    Attributes:
        cached: ``[n_blocks]`` the layer's fp32 absmax while the budget allows, or None: held in the weight's
            own dtype when that is bfloat16 or float16 (the largest magnitude of a block of such values is one
            of them: exact, half the bytes; a tail block's floor 1e-38 is not, and keeps the layer in
            float32), so twice the layers fit the budget; read through :meth:`cached_blocks`.
        nested: (``float32[ceil(n_blocks/256)]`` nested_absmax, nested offset) of a nested layer
            (:func:`~convert.bnb4.absmax8.nested_statistics`), or None until the absmax was read.
        median_max: (median, max) of the fp32 absmax (the report's outlier threshold), or None until read.
    """

    def __init__(self, layer: LayerInput, settings: QuantSettings, budget: AbsmaxBudget) -> None:
        self.layer = layer
        self.settings = settings
        self.budget = budget
        self.cached: npt.NDArray[np.float32] | None = None
        self.nested: tuple[npt.NDArray[np.float32], float] | None = None
        self.median_max: tuple[float, float] | None = None
        self._cached_nbytes = 0
        self._lock = threading.RLock()

    def cached_blocks(self, ba: int, bb: int) -> npt.NDArray[np.float32] | None:
        """``float32[bb - ba]`` the cached absmax of blocks [ba, bb), or None when the layer is not cached."""
        cached = self.cached
        return None if cached is None else np.asarray(cached[ba:bb], dtype=np.float32)

    def blocks(self, ba: int, bb: int) -> npt.NDArray[np.float32]:
        """fp32 absmax of blocks [ba, bb) (cached, or recomputed from the source)."""
        am = self.cached_blocks(ba, bb)
        return self.layer.absmax_blocks(ba, bb) if am is None else am

    def _cache(self, am: npt.NDArray[np.float32]) -> None:
        """Keep ``am`` (the whole layer's) as :attr:`cached` if the budget allows, in the weight's 16-bit dtype
        when that holds it exactly."""
        kept: np.ndarray = am
        if self.layer.dtype.name in ("bfloat16", "float16"):
            compact = am.astype(self.layer.dtype.numpy)
            if np.array_equal(compact.astype(np.float32), am):
                kept = compact
        if self.budget.take(kept.nbytes):
            self.cached = kept
            self._cached_nbytes = kept.nbytes

    def full(self) -> npt.NDArray[np.float32]:
        """``float32[n_blocks]`` the whole layer's fp32 absmax (a full pass), cached while the budget allows.

        Nested layers are not cached here (their stored absmax codes are recorded by the codes pass),
        only by :meth:`prepass`.
        """
        with self._lock:
            am = self.blocks(0, self.layer.n_blocks)
            if self.cached is None:
                self._keep(am)
                if not self.settings.nested:
                    self._cache(am)
            return am

    def _keep(self, am: npt.NDArray[np.float32], scratch: bool = False) -> None:
        """Keep what later passes need of a full absmax: nested statistics, median and max.

        ``scratch``: am is not needed afterwards (the median may reorder it instead of copying).
        """
        if self.settings.nested and self.nested is None:
            try:
                self.nested = nested_statistics(am, num_threads=self.settings.num_threads)
            except NestedOffsetOverflowError as exc:
                raise NestedOffsetOverflowError(exc.reason, path=_source_file(self.layer.source),
                                                tensor=self.layer.name, expected=exc.expected, found=exc.found,
                                                hint=exc.hint, action="quantize") from None
        if self.median_max is None and am.size:
            top = float(am.max())
            with np.errstate(over="ignore"):  # the mean of the two middle values, in float32
                median = float(np.median(am, overwrite_input=scratch))
            if math.isinf(median):  # both near float32's largest: their mean in float64 is finite
                median = float(np.median(am.astype(np.float64)))
            self.median_max = (median, top)

    def prepass(self, want_median: bool) -> None:
        """Pass 1 of a nested layer: its nested statistics and absmax median/max, and its fp32 absmax
        while the budget allows (the codes pass then reads it instead of recomputing it).

        The input's caches and pages are dropped afterwards (``Source.finish``), so a pre-pass over
        every layer holds no more than the layers being read (and the absmax the budget allows).

        Args:
            want_median: the median and max are needed (for the report) even when the statistics are known.
        """
        with self._lock:
            if self.nested is not None and (self.median_max is not None or not want_median):
                return
            am = self.blocks(0, self.layer.n_blocks)
            if self.cached is None:
                self._cache(am)
            self._keep(am, scratch=self.cached is None or self.cached.dtype != am.dtype)
        self.layer.finish()

    def nested_statistics(self) -> tuple[npt.NDArray[np.float32], float]:
        """(nested_absmax, nested_offset), computed from a full pass once."""
        with self._lock:
            if self.nested is None:
                self._keep(self.full())
            assert self.nested is not None
            return self.nested

    def median_and_max(self) -> tuple[float, float]:
        """(median, max) of the layer's fp32 absmax, computed from a full pass once."""
        with self._lock:
            if self.median_max is None:
                self.full()
            assert self.median_max is not None
            return self.median_max

    def release(self) -> None:
        """Drop the cached absmax and give its bytes back to the budget."""
        with self._lock:
            if self.cached is not None:
                self.cached = None
                self.budget.give(self._cached_nbytes)
                self._cached_nbytes = 0


def nested_codes(
    absmax: npt.NDArray[np.float32], first_block: int, nested: tuple[npt.NDArray[np.float32], float]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """The stored 8-bit codes of a run of a layer's absmax (:func:`~convert.bnb4.absmax8.encode_8bit`).

    Args:
        absmax: ``float32[k]`` fp32 absmax of blocks [first_block, first_block + k).
        first_block: the index of the first block.
        nested: the layer's (``nested_absmax``, offset).

    Returns:
        (``uint8[k]`` codes, ``float32[k]`` the ``nested_absmax`` of each block).
    """
    nested_absmax, offset = nested
    scale = nested_absmax[np.arange(first_block, first_block + absmax.size) // NESTED_BLOCKSIZE]
    return encode_8bit(absmax - np.float32(offset), scale), scale


class AbsmaxCodes:
    """The stored 8-bit absmax codes of a nested weight, recorded as its packed codes are made (1 byte a block).

    Tracked block by block, so a repeated or uneven encode never hands out codes not filled.

    Attributes:
        values: ``uint8[n_blocks]``, or None before the first record and after :meth:`clear`.
        filled: ``bool[n_blocks]`` which blocks of values are recorded; None once all are (or none).
    """

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.values: npt.NDArray[np.uint8] | None = None
        self.filled: npt.NDArray[np.bool_] | None = None
        self._complete = False
        self._lock = threading.Lock()

    def record(self, first_block: int, codes: npt.NDArray[np.uint8]) -> None:
        """Keep the codes of blocks [first_block, first_block + codes.size)."""
        with self._lock:
            if self.values is None:
                self.values = np.empty(self.n_blocks, dtype=np.uint8)
                self.filled = np.zeros(self.n_blocks, dtype=np.bool_)
                self._complete = False
            self.values[first_block : first_block + codes.size] = codes
            if self.filled is not None:
                self.filled[first_block : first_block + codes.size] = True

    def get(self, ba: int, bb: int) -> npt.NDArray[np.uint8] | None:
        """A copy of the codes of blocks [ba, bb) once every block is recorded, else None."""
        with self._lock:
            if self.values is not None and not self._complete and self.filled is not None:
                self._complete = bool(self.filled.all())
                if self._complete:
                    self.filled = None
            if self.values is not None and self._complete:
                return self.values[ba:bb].copy()
        return None

    def clear(self) -> None:
        """Drop the codes (the absmax tensor is written)."""
        with self._lock:
            self.values = self.filled = None
            self._complete = False


class LayerJob:
    """One weight quantized to 4 bits: its two passes, and the report, until its last tensor is written.

    Attributes:
        name: the weight.
        input: its :class:`LayerInput`.
        settings: the quantization settings.
        absmax: its :class:`AbsmaxPass`.
        codes: its recorded 8-bit absmax codes (used when nested).
        tensors_left: output tensors not written yet (each source of :mod:`convert.bnb4.sources` adds one).
        report: its :class:`~convert.bnb4.report.QuantReport` once every tensor is written (when asked for).
    """

    def __init__(self, t: PlannedTensor, settings: QuantSettings, piece: int, budget: AbsmaxBudget,
                 report: bool, outlier_factor: float, report_sample: int = 1) -> None:
        self.name = t.name
        self.input = LayerInput(t, settings.blocksize, piece)
        self.settings = settings
        self.absmax = AbsmaxPass(self.input, settings, budget)
        self.codes = AbsmaxCodes(self.input.n_blocks)
        self.tensors_left = 0
        self.report: QuantReport | None = None
        self._want_report = report
        self._outlier_factor = outlier_factor
        self._report_sample = report_sample
        self._codec = codec(settings.quant_type)
        self._acc: ReportAccumulator | None = None
        self._lock = threading.Lock()

    def prepass(self) -> None:
        """Pass 1 of a nested layer ahead of writing (:meth:`AbsmaxPass.prepass`)."""
        self.absmax.prepass(want_median=self._want_report)

    def state(self) -> QuantState:
        """The weight's QuantState (a nested one needs pass 1 for its offset)."""
        offset = self.absmax.nested_statistics()[1] if self.settings.nested else None
        return self.settings.state(self.input.shape, self.input.dtype.name, offset)

    def encode(self, a: int, b: int) -> npt.NDArray[np.uint8]:
        """``uint8[ceil((b - a) / 2)]`` packed codes of elements [a, b) (pass 2), adding to the report."""
        acc = self._accumulator()
        bs = self.input.blocksize
        out = []
        for s, e in self.input.pieces(a, b):
            x = self.input.read(s, e)
            am = self.absmax.cached_blocks(s // bs, -(-e // bs))  # (from the pre-pass, checked finite there)
            if am is None:
                am = self.input.absmax(x, s)
            packed = self._codec.encode(x, am, bs)
            out.append(packed)
            resolved = am  # the absmax a loader sees
            if self.settings.nested:
                nested = self.absmax.nested_statistics()
                codes, scale = nested_codes(am, s // bs, nested)
                self.codes.record(s // bs, codes)
                if acc is not None:
                    resolved = resolve_nested(codes, scale, nested[1])
            if acc is not None:
                acc.add(s, np.asarray(x).reshape(-1), packed, resolved, am)
            del x
            self.input.release(s, e)
        return np.concatenate(out) if len(out) != 1 else out[0]

    def absmax_codes(self, ba: int, bb: int) -> npt.NDArray[np.uint8]:
        """The stored 8-bit absmax codes of blocks [ba, bb) (recorded by :meth:`encode`, or recomputed)."""
        nested = self.absmax.nested_statistics()
        recorded = self.codes.get(ba, bb)
        if recorded is not None:
            return recorded
        return nested_codes(self.absmax.blocks(ba, bb), ba, nested)[0]

    def _accumulator(self) -> ReportAccumulator | None:
        if not self._want_report:
            return None
        with self._lock:
            if self._acc is None:
                median, top = self.absmax.median_and_max()
                self._acc = ReportAccumulator(self.name, self.state(), median, top,
                                              outlier_factor=self._outlier_factor, sample=self._report_sample)
            return self._acc

    def done_one(self) -> None:
        """One of this layer's output tensors is written; the last one frees everything."""
        with self._lock:
            self.tensors_left -= 1
            if self.tensors_left > 0:
                return
            if self._acc is not None:
                self.report = self._acc.result(stored_nbytes(self.state()))
            self.absmax.release()
            self.codes.clear()
        self.input.finish()

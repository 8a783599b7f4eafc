"""How much a 4-bit quantization cost, per weight: error, size and outlier blocks.

Figures of one weight (:class:`QuantReport`), gathered chunk by chunk in any thread order
(:class:`ReportAccumulator`) and summed in element order, so they do not depend on scheduling:

- relative Frobenius error ``||x - dq(q(x))||_F / ||x||_F``: float32 differences and BLAS dots per
  cache-sized piece, summed in float64 (relative error about 1e-6: ample for a 3-digit figure), with dq bnb's exact
  dequantization (:func:`convert.dequant.kernels.dequantize_4bit`; nested absmax resolved as a loader does);
- bits per weight from the size-dependent tensors only (packed codes, absmax, nested_absmax:
  :func:`stored_nbytes`), as bnb's own figures count them;
- outlier blocks: blocks whose fp32 absmax exceeds ``outlier_factor`` times the layer's median
  absmax, and the share of their non-zero weights that dequantize to 0.

``--to nf4|fp4`` accumulates while it streams (:mod:`convert.bnb4.plan`);
:func:`quantization_report` measures a layer quantized in memory (:mod:`convert.bnb4.layer`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from convert.bnb4.absmax8 import NESTED_BLOCKSIZE
from convert.bnb4.encode import iter_block_chunks
from convert.bnb4.layer import QuantizedLayerArrays
from convert.dequant.kernels import dequantize_4bit, dequantize_nested_absmax
from convert.dequant.products import PIECE
from formats.bnb import DYNAMIC_MAP_SIGNED, QUANT_TABLES, QuantState

__all__ = ["QuantReport", "ReportAccumulator", "quantization_report", "stored_nbytes"]

_F32 = np.float32


@dataclass(frozen=True)
class QuantReport:
    """How much one re-quantization cost.

    Attributes:
        name: the weight.
        numel: elements.
        rel_error: relative Frobenius error ``||x - dq(q(x))||_F / ||x||_F`` (0 when x is all zero),
            with dq the exact bnb dequantization (nested absmax resolved as a loader does).
        bits_per_weight: ``8 * (packed + absmax + nested_absmax bytes) / numel``; the fixed per-layer
            tables (quant_map 64 B, nested_quant_map 1 KiB, JSON) are left out, as in bnb's figures.
        absmax_median: median block absmax (fp32 before nesting).
        absmax_max: largest block absmax.
        outlier_blocks: blocks whose absmax exceeds ``outlier_factor * absmax_median``.
        outlier_zero_share: share of the non-zero weights in those blocks that dequantize to 0.
        zero_share: share of all non-zero weights that dequantize to 0.
        outlier: True when the layer has outlier blocks.
    """

    name: str
    numel: int
    rel_error: float
    bits_per_weight: float
    absmax_median: float
    absmax_max: float
    outlier_blocks: int
    outlier_zero_share: float
    zero_share: float
    outlier: bool

    def as_dict(self) -> dict[str, object]:
        """Plain values for JSON or a table."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}



def _sum_squares(x: npt.NDArray[np.float32], y: npt.NDArray[np.float32] | None = None) -> float:
    """``sum((x - y)^2)`` (``sum(x^2)`` without ``y``) by a float32 BLAS dot; in float64 when that
    overflows (values near float32's largest)."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = x if y is None else x - y
        s = float(np.dot(d, d))
    if math.isfinite(s):
        return s
    d64 = x.astype(np.float64) if y is None else x.astype(np.float64) - y
    return float(np.dot(d64, d64))

class ReportAccumulator:
    """Collects the :class:`QuantReport` figures of one weight chunk by chunk (thread-safe).

    Chunk results are kept per chunk start and summed in order at the end, so the figures do not
    depend on which thread finished first.

    The flat weight is measured in pieces of a fixed grid (``PIECE`` elements rounded to whole blocks,
    from element 0). With ``sample`` k > 1 only pieces ``0, k, 2k, ...`` give the error and the zero
    share (an estimate from 1/k of the weight, the same pieces for every chunking, cap and thread
    count); outlier blocks are counted and measured wherever they are, every one.

    Args:
        name: the weight name.
        state: its QuantState (numel, blocksize, quant_type).
        absmax_median: median of the layer's fp32 absmax (outlier threshold base).
        absmax_max: largest absmax.
        outlier_factor: a block is an outlier when its absmax exceeds this many medians.
        sample: measure one grid piece in ``sample`` (1: every element, exact figures).
    """

    def __init__(self, name: str, state: QuantState, absmax_median: float, absmax_max: float,
                 outlier_factor: float = 10.0, sample: int = 1) -> None:
        self.name = name
        self.state = state
        self.median = absmax_median
        self.max = absmax_max
        self.threshold = outlier_factor * absmax_median if absmax_median > 0 else math.inf
        if self.threshold > float(np.finfo(np.float32).max):  # (no float32 absmax is above it)
            self.threshold = math.inf
        self.sample = max(1, sample)
        self._qmap = QUANT_TABLES[state.quant_type]
        self._parts: dict[int, tuple[float, float, int, int, int, int, int]] = {}
        self._lock = threading.Lock()

    def add(self, start: int, x: np.ndarray, packed: npt.NDArray[np.uint8], resolved: npt.NDArray[np.float32],
            block_absmax: npt.NDArray[np.float32]) -> None:
        """Add elements [start, start + len(x)) of the flat weight.

        Args:
            start: first element, on a block boundary.
            x: the original values (any float dtype), flat.
            packed: ``uint8[ceil(len(x) / 2)]`` their packed 4-bit codes.
            resolved: ``float32`` the absmax a loader sees for their blocks (nested absmax resolved).
            block_absmax: ``float32`` the fp32 absmax of the blocks these elements cover.
        """
        bs = self.state.blocksize
        err2 = ref2 = 0.0
        nonzero = zeroed = out_nonzero = out_zeroed = 0
        is_out = np.asarray(block_absmax) > self.threshold
        n_out = int(is_out.sum())
        step = max(bs, (PIECE // bs) * bs)
        end = start + x.size
        a = start
        while a < end:
            b = min(end, (a // step + 1) * step)  # the grid piece holding element a
            la, lb = a - start, b - start  # (la is a multiple of the even blocksize)
            blk = is_out[la // bs : -(-lb // bs)]
            sampled = (a // step) % self.sample == 0
            has_out = bool(blk.any())
            if sampled or has_out:
                xf = np.asarray(x[la:lb]).astype(np.float32)  # exact (float16/bfloat16/float32 values)
                yf = dequantize_4bit(packed[la // 2 : (lb + 1) // 2], resolved[la // bs : -(-lb // bs)], self._qmap,
                                     bs, lb - la, "float32")
                nz = xf != 0
                zz = nz & (yf == 0)
                if sampled:
                    # float32 BLAS dots of a cache-sized piece (relative error ~1e-6, summed in float64)
                    err2 += _sum_squares(xf, yf)
                    ref2 += _sum_squares(xf)
                    nonzero += int(np.count_nonzero(nz))
                    zeroed += int(np.count_nonzero(zz))
                if has_out:
                    mask = np.repeat(blk, bs)[: lb - la]
                    out_nonzero += int(np.count_nonzero(nz & mask))
                    out_zeroed += int(np.count_nonzero(zz & mask))
            a = b
        with self._lock:
            self._parts[start] = (err2, ref2, nonzero, zeroed, out_nonzero, out_zeroed, n_out)

    def result(self, stored_bytes: int) -> QuantReport:
        """The report, given the bytes the layer's packed, absmax and nested_absmax tensors take."""
        err2 = ref2 = 0.0
        nonzero = zeroed = out_nonzero = out_zeroed = n_out = 0
        for k in sorted(self._parts):
            e, r, nz, zz, onz, ozz, no = self._parts[k]
            err2 += e
            ref2 += r
            nonzero += nz
            zeroed += zz
            out_nonzero += onz
            out_zeroed += ozz
            n_out += no
        n = self.state.numel
        return QuantReport(
            name=self.name,
            numel=n,
            rel_error=math.sqrt(err2 / ref2) if ref2 > 0 else 0.0,
            bits_per_weight=8 * stored_bytes / n,
            absmax_median=self.median,
            absmax_max=self.max,
            outlier_blocks=n_out,
            outlier_zero_share=out_zeroed / out_nonzero if out_nonzero else 0.0,
            zero_share=zeroed / nonzero if nonzero else 0.0,
            outlier=n_out > 0,
        )


def stored_nbytes(state: QuantState) -> int:
    """Bytes of a layer's packed codes, absmax and nested_absmax (the size-dependent tensors)."""
    if state.nested:
        return state.packed_nbytes + state.n_blocks + 4 * state.n_nested_blocks
    return state.packed_nbytes + 4 * state.n_blocks


def quantization_report(
    name: str,
    source: Callable[[int, int], np.ndarray] | np.ndarray,
    arrays: QuantizedLayerArrays,
    *,
    outlier_factor: float = 10.0,
    max_elements: int = 1 << 22,
) -> QuantReport:
    """Measure the error, size and outlier blocks of one quantized weight, chunk by chunk.

    Args:
        name: the weight name.
        source: the original values: an array of n elements (any shape), or a callable
            ``(start, stop) -> array`` giving elements [start, stop) of the flat tensor.
        arrays: the quantized weight (:func:`convert.bnb4.layer.quantize_layer`).
        outlier_factor: a block is an outlier when its absmax exceeds this many layer medians.
        max_elements: elements per chunk.

    Returns:
        the :class:`QuantReport`.
    """
    st = arrays.state
    n, bs = st.numel, st.blocksize
    read: Callable[[int, int], np.ndarray]
    if isinstance(source, np.ndarray):
        flat = source.reshape(-1)
        read = lambda a, b: flat[a:b]  # noqa: E731
    else:
        read = source
    if st.nested:
        assert arrays.nested_absmax is not None
        resolved = dequantize_nested_absmax(arrays.absmax, arrays.nested_absmax, DYNAMIC_MAP_SIGNED,
                                            NESTED_BLOCKSIZE, float(np.float32(st.nested_offset)))
    else:
        resolved = np.asarray(arrays.absmax, dtype=_F32)
    stats = arrays.absmax_f32
    acc = ReportAccumulator(name, st, float(np.median(stats)) if stats.size else 0.0,
                            float(stats.max()) if stats.size else 0.0, outlier_factor)
    for a, b in iter_block_chunks(n, bs, max_elements):
        x = read(a, b)
        blocks = slice(a // bs, -(-b // bs))
        acc.add(a, np.asarray(x).reshape(-1), arrays.packed[a // 2 : (b + 1) // 2], resolved[blocks], stats[blocks])
    return acc.result(stored_nbytes(st))

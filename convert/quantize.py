"""4-bit quantization in bitsandbytes' layout, byte-identical to ``bitsandbytes.functional.quantize_4bit``.

Pure NumPy, no I/O. Numerics (docs/bnb-format.md section 3, verified byte for byte against files
bitsandbytes 0.50.2 wrote, and against bitsandbytes and torch 2.13 themselves):

4-bit codes (``backends/default/ops.py``, the generic ``quantize_4bit`` kernel)
    The input is upcast to fp32 and cut into flat blocks of ``blocksize`` elements (blocks cross
    rows). ``absmax[b] = max |x|`` over the block. A full block is scaled by the fp32 reciprocal,
    ``s = clip(x * fp32(1 / max(absmax, 1e-38)), -1, 1)``, and stores absmax as is (an all-zero
    block stores 0.0). The partial last block uses a true division ``x / max(absmax, 1e-38)`` and
    stores the clamped value (an all-zero tail stores 1e-38, fp32 bits 0x006ce3ee).
    ``code = searchsorted(midpoints, s, side="left")`` over the fp32 midpoints of the sorted table,
    so a tie goes to the lower code; FP4 maps the sorted index through :data:`FP4_ORDER`. Byte k
    holds code 2k in its high nibble and code 2k+1 in its low one; an odd count is padded with a
    scaled value of 0.0 (nibble 7 for NF4, 0 for FP4).

Double quantization of absmax (``compress_statistics=True``)
    ``offset = torch.mean(absmax)`` in fp32 exactly as torch computes it on CPU (see
    :func:`torch_mean_float32`: torch's cascade sum, which is neither NumPy's pairwise sum nor a
    sequential one), then ``quantize_blockwise(absmax - offset, blocksize=256)`` with bnb's signed
    dynamic map, as its CPU C kernel does it: per block ``m = max|v|`` (stored as
    ``nested_absmax``; m == 0 gives code 0), ``t = clip(v * fp32(1/m), -1, 1)``,
    ``i16 = uint16(fp32(fp32(fp32((t + 1) * 0.5) * 65535) + 0.5))`` (truncating, no fused
    multiply-add), ``code = LUT[i16]`` with ``LUT[i] = count(midpoints < fp32(-1 + fp32(2i) / 65535))``.

Chunking: every function that takes a slice of the flat tensor accepts any slice that starts on a
block boundary; only the slice that ends the tensor may end inside a block (its partial block is the
tensor's tail) or on an odd element. Concatenating the results of consecutive slices gives the
result for the whole tensor, byte for byte.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import numpy.typing as npt

from formats.bnb import BLOCKSIZES, DYNAMIC_MAP_SIGNED, QUANT_TABLES, QuantState
from formats.errors import UnsupportedError, UsageError

from .kernels import dequantize_4bit, dequantize_nested_absmax

__all__ = [
    "ABSMAX_FLOOR",
    "FP4_ORDER",
    "NESTED_BLOCKSIZE",
    "QUANT_STORAGES",
    "TORCH_GRAIN_SIZE",
    "TORCH_NUM_THREADS",
    "TORCH_SUM_VECTOR_WIDTH",
    "QuantSettings",
    "QuantizedLayerArrays",
    "QuantReport",
    "ReportAccumulator",
    "blockwise_absmax",
    "double_quantize_absmax",
    "dynamic_map_lut",
    "encode_4bit",
    "encode_8bit",
    "iter_block_chunks",
    "layer_tensors",
    "quantization_report",
    "quantize_4bit",
    "quantize_blockwise_8bit",
    "quantize_bounds",
    "quantize_layer",
    "resolve_nested",
    "stored_nbytes",
    "torch_mean_float32",
    "torch_sum_float32",
]

#: The floor bnb clamps absmax to before dividing (``absmax.clamp(min=1e-38)``), fp32 bits 0x006ce3ee.
ABSMAX_FLOOR = np.float32(1e-38)
#: FP4 code of each position of the sorted FP4 table (``torch.argsort(code)`` in bnb, fixed here so
#: that the two +0.0 entries, codes 0 and 8, keep bnb's order).
FP4_ORDER = np.array([11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3], dtype=np.uint8)
#: absmax values per nested block (``quantize_blockwise(..., blocksize=256)`` in ``quantize_4bit``).
NESTED_BLOCKSIZE = 256
#: ``bnb_4bit_quant_storage`` values: the dtype the packed bytes are stored under.
QUANT_STORAGES = ("uint8", "bfloat16", "float16", "float32")
#: fp32 lanes of torch's CPU sum kernel. torch registers its reduction kernels without an AVX512
#: variant, so an AVX512 machine runs the AVX2 kernel: 8 lanes on every x86-64 CPU torch supports.
TORCH_SUM_VECTOR_WIDTH = 8
#: Elements below which torch reduces on one thread (``at::internal::GRAIN_SIZE``).
TORCH_GRAIN_SIZE = 32768
#: torch's intra-op thread count assumed for the mean of 32768 or more absmax values (layers of
#: 2,097,152+ weights at blocksize 64). 2 is the setting the reference files were written with.
TORCH_NUM_THREADS = 2

_F32 = np.float32
_PIECE = 1 << 16  # elements per inner piece, so fp32 temporaries stay in cache


def _check_quant_type(quant_type: str) -> None:
    if quant_type not in QUANT_TABLES:
        raise UsageError("quant_type must be nf4 or fp4", rule="QNT-001", expected="'nf4' or 'fp4'",
                         found=quant_type)


def _check_blocksize(blocksize: int) -> None:
    if blocksize not in BLOCKSIZES:
        raise UsageError("blocksize must be a power of two from 32 to 4096", rule="QNT-002",
                         expected=list(BLOCKSIZES), found=blocksize)


def quantize_bounds(quant_type: str) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8]]:
    """The decision bounds of the 4-bit encoder.

    Matches bitsandbytes ``backends/default/ops.py::_get_4bit_quantize_bounds``.

    Args:
        quant_type: ``"nf4"`` or ``"fp4"``.

    Returns:
        (``float32[15]`` midpoints of the sorted table, each ``fp32((a + b) / 2)``;
        ``uint8[16]`` the code of each sorted position: identity for NF4, :data:`FP4_ORDER` for FP4).

    Raises:
        UsageError: QNT-001, unknown quant_type.
    """
    _check_quant_type(quant_type)
    table = QUANT_TABLES[quant_type]
    order = np.arange(16, dtype=np.uint8) if quant_type == "nf4" else FP4_ORDER
    srt = table[order]
    mid = ((srt[:-1] + srt[1:]) / _F32(2)).astype(_F32)
    return mid, order


def _flat_f32(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    a = np.asarray(x)
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return a.reshape(-1)


def _finite_absmax(absmax: npt.NDArray[np.float32]) -> None:
    if not np.isfinite(absmax).all():
        bad = int(np.flatnonzero(~np.isfinite(absmax))[0])
        raise UnsupportedError("the tensor to quantize holds NaN or infinite values", rule="QNT-003",
                               expected="finite values", found=f"non-finite value in block {bad}",
                               hint="fix or skip this tensor (--skip-modules)")


def blockwise_absmax(x: npt.ArrayLike, blocksize: int) -> npt.NDArray[np.float32]:
    """Per-block absmax of a block-aligned slice of the flat tensor (pass 1 of two).

    Matches the absmax that bitsandbytes ``quantize_4bit`` (generic kernel) returns: ``max |x|`` in
    fp32 for full blocks; for a partial last block ``max(max |x|, 1e-38)``.

    Args:
        x: ``float16|bfloat16|float32[m]`` (any shape; read flat), starting on a block boundary.
        blocksize: elements per block.

    Returns:
        ``float32[ceil(m / blocksize)]``.

    Raises:
        UnsupportedError: QNT-003, x holds NaN or infinity.
    """
    x = np.asarray(x).reshape(-1)
    m = x.size
    nb_full = m // blocksize
    out = np.empty(-(-m // blocksize), dtype=_F32)
    piece = max(1, _PIECE // blocksize)
    for b in range(0, nb_full, piece):
        e = min(nb_full, b + piece)
        blk = _flat_f32(x[b * blocksize : e * blocksize]).reshape(e - b, blocksize)
        np.max(np.abs(blk), axis=1, out=out[b:e])
    if m > nb_full * blocksize:
        out[-1] = max(np.abs(_flat_f32(x[nb_full * blocksize :])).max(), ABSMAX_FLOOR)
    _finite_absmax(out)
    return out


def encode_4bit(
    x: npt.ArrayLike,
    absmax: npt.NDArray[np.float32],
    blocksize: int,
    quant_type: str,
    bounds: tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8]] | None = None,
) -> npt.NDArray[np.uint8]:
    """Packed 4-bit codes of a block-aligned slice, given its absmax (pass 2 of two).

    Matches the codes of bitsandbytes ``quantize_4bit`` (generic kernel): fp32 reciprocal for full
    blocks, true division for a partial last block, ties to the lower code, odd count padded.

    Args:
        x: ``float16|bfloat16|float32[m]`` (any shape; read flat), starting on a block boundary.
        absmax: ``float32[ceil(m / blocksize)]`` from :func:`blockwise_absmax` of the same slice.
        blocksize: elements per block (even).
        quant_type: ``"nf4"`` or ``"fp4"``.
        bounds: optional :func:`quantize_bounds` result (saves recomputing it per slice).

    Returns:
        ``uint8[ceil(m / 2)]``; byte k = code[2k] << 4 | code[2k+1].

    Raises:
        UsageError: QNT-001, unknown quant_type.
    """
    mid, order = bounds if bounds is not None else quantize_bounds(quant_type)
    is_nf4 = quant_type == "nf4"
    x = np.asarray(x).reshape(-1)
    absmax = np.asarray(absmax, dtype=_F32).reshape(-1)
    m = x.size
    nb_full = m // blocksize
    out = np.empty(-(-m // 2), dtype=np.uint8)
    piece = max(1, _PIECE // blocksize)
    with np.errstate(over="ignore"):  # 1/1e-38 is finite; silence the huge-but-finite path
        for b in range(0, nb_full, piece):
            e = min(nb_full, b + piece)
            blk = _flat_f32(x[b * blocksize : e * blocksize]).reshape(e - b, blocksize)
            recip = _F32(1) / np.maximum(absmax[b:e], ABSMAX_FLOOR)
            s: npt.NDArray[np.float32] = np.multiply(blk, recip[:, None], dtype=_F32)
            np.clip(s, -1, 1, out=s)
            _pack_codes(s.reshape(-1), mid, order, is_nf4, out[b * blocksize // 2 : e * blocksize // 2])
        if m > nb_full * blocksize:
            tail = _flat_f32(x[nb_full * blocksize :])
            t = np.zeros(tail.size + tail.size % 2, dtype=_F32)  # an odd count pads with 0.0
            np.clip(np.divide(tail, absmax[-1], dtype=_F32), -1, 1, out=t[: tail.size])
            _pack_codes(t, mid, order, is_nf4, out[nb_full * blocksize // 2 :])
    return out


_TABLE_CACHE: dict[bytes, tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8], npt.NDArray[np.uint8]] | None] = {}


def _code_tables(
    mid: npt.NDArray[np.float32], order: npt.NDArray[np.uint8]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8], npt.NDArray[np.uint8]] | None:
    """Tables that replace ``order[searchsorted(mid, s, side="left")]`` by lookups on s's top 16 bits.

    The fp32 values sharing their top 16 bits form one interval ("bucket"). For bucket h:
    ``lo[h] = order[count(mid < bucket start)]``; if a midpoint m lies in the bucket, ``thr[h] = m`` and
    ``hi[h]`` is the next code, so ``code = hi[h] if s > thr[h] else lo[h]`` equals the search exactly
    (ties, s == m, stay low). Returns None when a bucket holds two midpoints (not the case for the
    NF4 and FP4 tables), and the caller searches instead.
    """
    key = mid.tobytes() + order.tobytes()
    if key in _TABLE_CACHE:
        return _TABLE_CACHE[key]
    h = np.arange(65536, dtype=np.uint32)
    first = (h << 16).view(np.float32)
    last = ((h << 16) | 0xFFFF).view(np.float32)
    start = np.minimum(first, last)  # negative buckets run downwards
    stop = np.maximum(first, last)
    base = np.searchsorted(mid, start, side="left")  # count(mid < start)
    inside = np.searchsorted(mid, stop, side="right") - base  # midpoints in [start, stop]
    tables: tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8], npt.NDArray[np.uint8]] | None = None
    finite = np.isfinite(start) & np.isfinite(stop)
    if int(inside[finite].max()) <= 1:
        thr = np.full(65536, np.inf, dtype=np.float32)
        has = finite & (inside == 1)
        thr[has] = mid[base[has]]
        top = mid.size
        lo = order[np.minimum(base, top)].astype(np.uint8)
        hi = order[np.minimum(base + 1, top)].astype(np.uint8)
        tables = (thr, lo, hi)
    _TABLE_CACHE[key] = tables
    return tables


def _pack_codes(
    s: npt.NDArray[np.float32],
    mid: npt.NDArray[np.float32],
    order: npt.NDArray[np.uint8],
    is_nf4: bool,
    out: npt.NDArray[np.uint8],
) -> None:
    tables = _code_tables(mid, order)
    if tables is not None:
        thr, lo, hi = tables
        h = np.right_shift(s.view(np.uint32), 16)
        codes = np.where(s > thr[h], hi[h], lo[h])
    else:
        idx = np.searchsorted(mid, s, side="left").astype(np.uint8)
        codes = idx if is_nf4 else order[idx]
    pairs = codes.reshape(-1, 2)
    np.left_shift(pairs[:, 0], 4, out=out)
    np.bitwise_or(out, pairs[:, 1], out=out)


def quantize_4bit(
    x: npt.ArrayLike, blocksize: int = 64, quant_type: str = "nf4"
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Quantize a tensor (or a block-aligned slice of it) to packed 4-bit codes and absmax.

    Matches bitsandbytes ``functional.quantize_4bit`` (generic kernel, ``compress_statistics=False``)
    byte for byte.

    Args:
        x: ``float16|bfloat16|float32`` of n elements, any shape (quantized flat, row-major).
        blocksize: 32, 64, ..., 4096.
        quant_type: ``"nf4"`` or ``"fp4"``.

    Returns:
        (``uint8[ceil(n/2)]`` packed codes, ``float32[ceil(n/blocksize)]`` absmax).

    Raises:
        UsageError: QNT-001/QNT-002, bad quant_type or blocksize.
        UnsupportedError: QNT-003, x holds NaN or infinity.
    """
    _check_quant_type(quant_type)
    _check_blocksize(blocksize)
    absmax = blockwise_absmax(x, blocksize)
    return encode_4bit(x, absmax, blocksize, quant_type), absmax


# --- torch.mean, as torch computes it for a 1-D float32 tensor on CPU -----------------------------


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else (x - 1).bit_length()


def _seq_sum(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """0 + rows[0] + rows[1] + ... in fp32, left to right, elementwise over the trailing axes."""
    # np.add.accumulate is sequential by definition (no pairwise regrouping); "+ 0" turns -0 to +0
    # as torch's zero-initialised accumulator does.
    return np.add.accumulate(rows, axis=0, dtype=_F32)[-1] + _F32(0)


def _multi_row_sum(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """torch ``multi_row_sum``: a 4-level cascade over ``rows[size, ...]`` returning ``rows.shape[1:]``."""
    size = rows.shape[0]
    level_power = max(4, _ceil_log2(size) // 4)
    step = 1 << level_power
    acc = np.zeros((4,) + rows.shape[1:], dtype=_F32)
    i = 0
    n_full = size // step
    if n_full:
        sums = np.add.accumulate(rows[: n_full * step].reshape((n_full, step) + rows.shape[1:]),
                                 axis=1, dtype=_F32)[:, -1] + _F32(0)
        for c in range(n_full):
            acc[0] = sums[c]
            i += step
            for j in range(1, 4):
                acc[j] += acc[j - 1]
                acc[j - 1] = 0
                if i & ((step - 1) << (j * level_power)):
                    break
    if i < size:
        acc[0] = _seq_sum(rows[i:])
    total = acc[0]
    for j in range(1, 4):
        total = total + acc[j]
    return total


def _row_sum(x: npt.NDArray[np.float32], vector_width: int) -> np.float32:
    """torch's serial CPU sum of a contiguous fp32 vector (``vectorized_inner_sum`` / ``row_sum``)."""
    n = x.size
    if n >= vector_width:
        nvec = n // vector_width
        vecs = x[: nvec * vector_width].reshape(nvec, vector_width)
        n_ilp = nvec // 4
        partial = _multi_row_sum(vecs[: n_ilp * 4].reshape(n_ilp, 4, vector_width))
        p0 = partial[0]
        for v in vecs[n_ilp * 4 :]:
            p0 = p0 + v
        for k in range(1, 4):
            p0 = p0 + partial[k]
        acc = _F32(0)
        for v in x[nvec * vector_width :]:
            acc = _F32(acc + v)
        for v in p0:
            acc = _F32(acc + v)
        return acc
    n_ilp = n // 4
    part = _multi_row_sum(x[: n_ilp * 4].reshape(n_ilp, 4))
    acc = _F32(part[0])
    for v in x[n_ilp * 4 :]:
        acc = _F32(acc + v)
    for k in range(1, 4):
        acc = _F32(acc + part[k])
    return acc


def torch_sum_float32(
    x: npt.ArrayLike,
    *,
    vector_width: int = TORCH_SUM_VECTOR_WIDTH,
    num_threads: int = TORCH_NUM_THREADS,
) -> np.float32:
    """``torch.sum`` of a 1-D contiguous float32 tensor on CPU, bit for bit.

    torch's ``cascade_sum`` (``SumKernel.cpp``) with fp32 accumulators: ``vector_width`` lanes of
    fp32 vectors, four interleaved accumulators (``row_sum``), each a four-level cascade whose level
    step is ``2**max(4, ceil(log2(rows)) // 4)`` rows (``multi_row_sum``); then the scalar tail and
    the lanes are added in order. With ``num_threads > 1`` and ``n >= 32768`` torch splits the range
    into ``min(threads, ceil(n / 32768))`` equal chunks (``parallel_for``), sums each as above into a
    per-thread buffer and then sums the buffer (``two_pass_reduction``). Verified against torch 2.13
    for n = 1..5000 and large n with 1, 2, 3, 4 and 7 threads.

    Args:
        x: ``float32[n]``.
        vector_width: fp32 lanes of the sum kernel (8 on x86-64, AVX2 and AVX512 alike).
        num_threads: torch's intra-op thread count (``torch.get_num_threads()``).

    Returns:
        the sum as ``np.float32``.
    """
    x = _flat_f32(x)
    n = x.size
    if n < TORCH_GRAIN_SIZE or num_threads <= 1:
        return _F32(_row_sum(x, vector_width) + _F32(0))
    used = min(num_threads, -(-n // TORCH_GRAIN_SIZE))
    chunk = -(-n // used)
    buf = np.zeros(num_threads, dtype=_F32)
    for t in range(used):
        lo = t * chunk
        if lo < n:
            buf[t] = _row_sum(x[lo : min(n, lo + chunk)], vector_width) + _F32(0)
    return _F32(_row_sum(buf, vector_width) + _F32(0))


def torch_mean_float32(
    x: npt.ArrayLike,
    *,
    vector_width: int = TORCH_SUM_VECTOR_WIDTH,
    num_threads: int = TORCH_NUM_THREADS,
) -> np.float32:
    """``torch.mean`` of a 1-D contiguous float32 tensor on CPU, bit for bit.

    torch computes a CPU mean as ``sum(x) / n`` (``mean_out`` in ``ReduceOps.cpp``): the sum of
    :func:`torch_sum_float32`, then one fp32 division. NumPy's pairwise ``mean`` rounds differently
    (2 of the 13 nested reference files).

    Args:
        x: ``float32[n]``, n >= 1.
        vector_width: fp32 lanes of the sum kernel.
        num_threads: torch's intra-op thread count.

    Returns:
        the mean as ``np.float32``.
    """
    x = _flat_f32(x)
    total = torch_sum_float32(x, vector_width=vector_width, num_threads=num_threads)
    return _F32(total / _F32(x.size))


# --- 8-bit blockwise quantization of absmax (nested) ---------------------------------------------

_LUT_CACHE: dict[bytes, npt.NDArray[np.uint8]] = {}


def dynamic_map_lut(code: npt.NDArray[np.float32] = DYNAMIC_MAP_SIGNED) -> npt.NDArray[np.uint8]:
    """The 65,536-entry table bnb's CPU ``quantize_blockwise`` looks 16-bit indices up in.

    ``LUT[i] = count(midpoints < fp32(-1 + fp32(2i) / 65535))`` with ``midpoints`` the fp32 means of
    neighbouring entries of the sorted 256-value ``code``.

    Args:
        code: ``float32[256]`` sorted map (bnb's signed dynamic map by default).

    Returns:
        ``uint8[65536]`` (read-only, cached per map).
    """
    code = np.asarray(code, dtype=_F32).reshape(-1)
    key = code.tobytes()
    lut = _LUT_CACHE.get(key)
    if lut is None:
        mid = ((code[:-1] + code[1:]) * _F32(0.5)).astype(_F32)
        i = np.arange(65536, dtype=np.uint32)
        probe = (_F32(-1) + (_F32(2) * i.astype(_F32)) / _F32(65535)).astype(_F32)
        lut = np.searchsorted(mid, probe, side="left").astype(np.uint8)
        lut.setflags(write=False)
        _LUT_CACHE[key] = lut
    return lut


def quantize_blockwise_8bit(
    v: npt.ArrayLike, blocksize: int = NESTED_BLOCKSIZE, code: npt.NDArray[np.float32] = DYNAMIC_MAP_SIGNED
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """8-bit blockwise quantization with a 256-value map, as bnb's CPU C kernel does it.

    Matches bitsandbytes ``functional.quantize_blockwise`` on CPU (``cquantize_blockwise_cpu_fp32``):
    per block ``m = max|v|``, then :func:`encode_8bit`.

    Args:
        v: ``float32[n]`` values (for double quantization: ``absmax - offset``).
        blocksize: values per block (256 for nested absmax).
        code: ``float32[256]`` the map (bnb's signed dynamic map).

    Returns:
        (``uint8[n]`` codes, ``float32[ceil(n / blocksize)]`` per-block max |v|).
    """
    v = _flat_f32(v)
    n = v.size
    nb = -(-n // blocksize)
    padded = np.zeros(nb * blocksize, dtype=_F32)
    padded[:n] = v
    m = np.abs(padded.reshape(nb, blocksize)).max(axis=1)
    return encode_8bit(v, np.repeat(m, blocksize)[:n], code), m


def encode_8bit(
    v: npt.ArrayLike, scale: npt.NDArray[np.float32], code: npt.NDArray[np.float32] = DYNAMIC_MAP_SIGNED
) -> npt.NDArray[np.uint8]:
    """8-bit codes of values whose block maxima are known (any slice of a blockwise quantization).

    ``t = clip(v * fp32(1/m), -1, 1)``; ``i16 = uint16(fp32(fp32(fp32((t + 1) * 0.5) * 65535) + 0.5))``
    (truncating; no fused multiply-add); ``code = LUT[i16]`` (:func:`dynamic_map_lut`); a value
    whose block has m == 0 gets code 0.

    Args:
        v: ``float32[n]`` values.
        scale: ``float32[n]`` the max |v| of each value's block.
        code: ``float32[256]`` the map.

    Returns:
        ``uint8[n]``.
    """
    v = _flat_f32(v)
    scale = _flat_f32(scale)
    zero = scale == 0
    recip = _F32(1) / np.where(zero, _F32(1), scale)
    t = v * recip
    np.clip(t, -1, 1, out=t)
    t += _F32(1)
    t *= _F32(0.5)
    t *= _F32(65535)
    t += _F32(0.5)
    codes = dynamic_map_lut(code)[t.astype(np.uint16)]
    codes[zero] = 0
    return codes


def resolve_nested(
    codes: npt.NDArray[np.uint8], scale: npt.NDArray[np.float32], offset: float,
    code: npt.NDArray[np.float32] = DYNAMIC_MAP_SIGNED,
) -> npt.NDArray[np.float32]:
    """absmax back from 8-bit codes, for any slice: ``fp32(fp32(code[c] * scale) + offset)``.

    The same two roundings as :func:`convert.kernels.dequantize_nested_absmax` (bnb
    ``dequantize_blockwise`` then ``+= offset``), with the nested absmax given per value.

    Args:
        codes: ``uint8[n]``.
        scale: ``float32[n]`` each value's ``nested_absmax``.
        offset: the nested offset (an fp32 value).
        code: ``float32[256]`` the map.

    Returns:
        ``float32[n]``.
    """
    prod = np.asarray(code, dtype=_F32)[np.asarray(codes, dtype=np.uint8)] * _flat_f32(scale)
    return (prod + _F32(offset)).astype(_F32)


def double_quantize_absmax(
    absmax: npt.NDArray[np.float32], *, num_threads: int = TORCH_NUM_THREADS
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32], float]:
    """Nested (double) quantization of a layer's absmax, as ``quantize_4bit(compress_statistics=True)``.

    ``offset = torch.mean(absmax)`` (:func:`torch_mean_float32`), then
    :func:`quantize_blockwise_8bit` of ``fp32(absmax - offset)`` with blocksize 256.

    Args:
        absmax: ``float32[n_blocks]`` the whole layer's absmax.
        num_threads: torch's thread count the mean is reproduced for (matters for n_blocks >= 32768).

    Returns:
        (``uint8[n_blocks]`` codes (the stored ``absmax``), ``float32[ceil(n_blocks/256)]``
        ``nested_absmax``, ``nested_offset`` as a Python float holding the fp32 exactly).
    """
    absmax = _flat_f32(absmax)
    offset = torch_mean_float32(absmax, num_threads=num_threads)
    codes, nested = quantize_blockwise_8bit(absmax - offset, NESTED_BLOCKSIZE, DYNAMIC_MAP_SIGNED)
    return codes, nested, float(offset)


# --- one layer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSettings:
    """What ``--to nf4|fp4`` asks for (``BitsAndBytesConfig`` fields in brackets).

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"`` [bnb_4bit_quant_type].
        blocksize: elements per absmax block, 32..4096 (transformers always uses 64).
        nested: double quantization of absmax [bnb_4bit_use_double_quant].
        quant_storage: dtype the packed bytes are stored under [bnb_4bit_quant_storage].
        num_threads: torch thread count the nested mean is reproduced for.
    """

    quant_type: str = "nf4"
    blocksize: int = 64
    nested: bool = True
    quant_storage: str = "uint8"
    num_threads: int = TORCH_NUM_THREADS

    def __post_init__(self) -> None:
        _check_quant_type(self.quant_type)
        _check_blocksize(self.blocksize)
        if self.quant_storage not in QUANT_STORAGES:
            raise UsageError("quant storage must be uint8, bfloat16, float16 or float32", rule="QNT-004",
                             expected=list(QUANT_STORAGES), found=self.quant_storage)

    def state(self, shape: tuple[int, ...], dtype: str, nested_offset: float | None = None) -> QuantState:
        """The :class:`QuantState` of a weight of ``shape`` and torch dtype name ``dtype``."""
        if self.nested:
            return QuantState(self.quant_type, self.blocksize, dtype, tuple(shape), True,
                              NESTED_BLOCKSIZE, "float32", nested_offset)
        return QuantState(self.quant_type, self.blocksize, dtype, tuple(shape))

    def storage_shape(self, n: int, name: str | None = None) -> tuple[int, int]:
        """Shape of the stored ``P.weight`` for n elements: ``[ceil(n/2) / itemsize, 1]``.

        Raises:
            UnsupportedError: QNT-005, ceil(n/2) bytes do not fill whole storage elements (bnb's
                ``packed.squeeze().view(quant_storage)`` fails there too).
        """
        nbytes = -(-n // 2)
        item = np.dtype(_storage_dtype(self.quant_storage)).itemsize
        if nbytes % item:
            raise UnsupportedError(
                f"the packed codes cannot be stored as {self.quant_storage}", rule="QNT-005", tensor=name,
                expected=f"ceil(n/2) a multiple of {item} bytes", found=nbytes,
                hint="use --quant-storage uint8, or skip this tensor",
            )
        return (nbytes // item, 1)


def _storage_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclass(frozen=True)
class QuantizedLayerArrays:
    """Every array of one quantized weight, before naming.

    Attributes:
        state: its :class:`QuantState` (``nested_offset`` filled in when nested).
        packed: ``uint8[ceil(n/2)]`` packed codes.
        absmax: ``float32[n_blocks]`` (not nested) or ``uint8[n_blocks]`` codes (nested).
        absmax_f32: ``float32[n_blocks]`` absmax before double quantization.
        nested_absmax: ``float32[ceil(n_blocks/256)]`` or None.
    """

    state: QuantState
    packed: npt.NDArray[np.uint8]
    absmax: np.ndarray
    absmax_f32: npt.NDArray[np.float32]
    nested_absmax: npt.NDArray[np.float32] | None


def quantize_layer(x: np.ndarray, dtype: str, settings: QuantSettings) -> QuantizedLayerArrays:
    """Quantize one whole weight in memory (the streaming pipeline uses the slice functions instead).

    Matches ``bitsandbytes.functional.quantize_4bit(x, blocksize, compress_statistics=nested,
    quant_type, quant_storage)``.

    Args:
        x: the weight, ``float16|bfloat16|float32`` of any shape.
        dtype: torch name of the weight's dtype (``"bfloat16"``), written into the QuantState.
        settings: quant type, blocksize, nesting.

    Returns:
        the arrays; see :func:`layer_tensors` for their names and stored dtypes.

    Raises:
        UnsupportedError: QNT-003, x holds NaN or infinity.
    """
    packed, absmax = quantize_4bit(x, settings.blocksize, settings.quant_type)
    shape = tuple(int(d) for d in np.shape(x))
    if settings.nested:
        codes, nested, offset = double_quantize_absmax(absmax, num_threads=settings.num_threads)
        return QuantizedLayerArrays(settings.state(shape, dtype, offset), packed, codes, absmax, nested)
    return QuantizedLayerArrays(settings.state(shape, dtype), packed, absmax, absmax, None)


def layer_tensors(
    weight_name: str, arrays: QuantizedLayerArrays, quant_storage: str = "uint8"
) -> dict[str, np.ndarray]:
    """The tensors bnb saves for one 4-bit weight, named and shaped as on disk.

    Matches ``Linear4bit._save_to_state_dict`` + ``QuantState.as_dict(packed=True)``, in that order:
    ``P.weight`` (``[ceil(n/2), 1]`` uint8, or the same bytes viewed as ``quant_storage``),
    ``P.weight.absmax``, ``P.weight.quant_map`` (``float32[16]``), when nested
    ``P.weight.nested_absmax`` and ``P.weight.nested_quant_map`` (``float32[256]``), and
    ``P.weight.quant_state.bitsandbytes__<type>`` (``uint8[len]``, the JSON).

    Args:
        weight_name: ``P.weight``.
        arrays: from :func:`quantize_layer` (or assembled by the streaming pipeline).
        quant_storage: ``uint8``, ``bfloat16``, ``float16`` or ``float32``.

    Returns:
        name -> array (bfloat16 arrays use ml_dtypes).

    Raises:
        UnsupportedError: QNT-005, the packed bytes do not fill whole ``quant_storage`` elements.
    """
    st = arrays.state
    settings_shape = QuantSettings(st.quant_type, st.blocksize, st.nested, quant_storage).storage_shape(
        st.numel, weight_name)
    packed = arrays.packed.reshape(-1).view(_storage_dtype(quant_storage)).reshape(settings_shape)
    out: dict[str, np.ndarray] = {weight_name: packed, f"{weight_name}.absmax": arrays.absmax}
    out[f"{weight_name}.quant_map"] = QUANT_TABLES[st.quant_type].copy()
    if st.nested:
        assert arrays.nested_absmax is not None
        out[f"{weight_name}.nested_absmax"] = arrays.nested_absmax
        out[f"{weight_name}.nested_quant_map"] = DYNAMIC_MAP_SIGNED.copy()
    out[f"{weight_name}.quant_state.bitsandbytes__{st.quant_type}"] = np.frombuffer(
        st.to_json().encode("utf-8"), dtype=np.uint8).copy()
    return out


def iter_block_chunks(n: int, blocksize: int, max_elements: int) -> Iterator[tuple[int, int]]:
    """Block-aligned [start, stop) element ranges covering n elements, each at most ``max_elements``.

    Args:
        n: elements in the flat tensor.
        blocksize: the 4-bit blocksize (chunks hold whole blocks, except the tail).
        max_elements: upper bound per chunk (rounded down to whole blocks, at least one block).

    Yields:
        (start, stop) in elements.
    """
    step = max(blocksize, (max_elements // blocksize) * blocksize)
    for s in range(0, n, step):
        yield s, min(n, s + step)


# --- the per-tensor report -------------------------------------------------------------------------


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


class ReportAccumulator:
    """Collects the :class:`QuantReport` figures of one weight chunk by chunk (thread-safe).

    Chunk results are kept per chunk start and summed in order at the end, so the figures do not
    depend on which thread finished first.

    Args:
        name: the weight name.
        state: its QuantState (numel, blocksize).
        absmax_median: median of the layer's fp32 absmax (outlier threshold base).
        absmax_max: largest absmax.
        outlier_factor: a block is an outlier when its absmax exceeds this many medians.
    """

    def __init__(self, name: str, state: QuantState, absmax_median: float, absmax_max: float,
                 outlier_factor: float = 10.0) -> None:
        self.name = name
        self.state = state
        self.median = absmax_median
        self.max = absmax_max
        self.threshold = outlier_factor * absmax_median if absmax_median > 0 else math.inf
        self._parts: dict[int, tuple[float, float, int, int, int, int, int]] = {}
        self._lock = threading.Lock()

    def add(self, start: int, x: np.ndarray, y: npt.NDArray[np.float32],
            block_absmax: npt.NDArray[np.float32]) -> None:
        """Add elements [start, start + len(x)) of the flat weight.

        Args:
            start: first element, on a block boundary.
            x: the original values (any float dtype), flat.
            y: ``float32`` the dequantized values of the same elements.
            block_absmax: ``float32`` the fp32 absmax of the blocks these elements cover.
        """
        bs = self.state.blocksize
        err2 = ref2 = 0.0
        nonzero = zeroed = out_nonzero = out_zeroed = 0
        is_out = np.asarray(block_absmax) > self.threshold
        n_out = int(is_out.sum())
        step = max(bs, (_PIECE // bs) * bs)
        for a in range(0, x.size, step):
            b = min(x.size, a + step)
            xf = np.asarray(x[a:b]).astype(np.float64)
            yf = y[a:b].astype(np.float64)
            d = xf - yf
            # not np.dot: BLAS threads spin on a busy machine (80 ns per element measured)
            err2 += float(np.add.reduce(d * d))
            ref2 += float(np.add.reduce(xf * xf))
            nz = xf != 0
            zz = nz & (yf == 0)
            nonzero += int(nz.sum())
            zeroed += int(zz.sum())
            blk = is_out[a // bs : -(-b // bs)]
            if blk.any():
                mask = np.repeat(blk, bs)[: b - a]
                out_nonzero += int((nz & mask).sum())
                out_zeroed += int((zz & mask).sum())
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
        arrays: the quantized weight (:func:`quantize_layer`).
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
    qmap = QUANT_TABLES[st.quant_type]
    for a, b in iter_block_chunks(n, bs, max_elements):
        x = read(a, b)
        blocks = slice(a // bs, -(-b // bs))
        y = dequantize_4bit(arrays.packed[a // 2 : (b + 1) // 2], resolved[blocks], qmap, bs, b - a, "float32")
        acc.add(a, np.asarray(x).reshape(-1), y, stats[blocks])
    return acc.result(stored_nbytes(st))

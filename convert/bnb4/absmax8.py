"""8-bit blockwise (nested, double) quantization of absmax, byte-identical to bitsandbytes on CPU.

Pure NumPy, no I/O. ``quantize_4bit(compress_statistics=True)`` stores a layer's absmax as 8-bit codes
(docs/bnb-format.md section 3, verified byte for byte against files bitsandbytes 0.50.2 wrote, and
against bitsandbytes and torch 2.13 themselves):

Double quantization of absmax
    ``offset = torch.mean(absmax)`` in fp32 exactly as torch computes it on CPU
    (:func:`convert.bnb4.torch_reduce.torch_mean_float32`: torch's cascade sum, which is neither NumPy's
    pairwise sum nor a sequential one), then ``quantize_blockwise(absmax - offset, blocksize=256)``
    with bnb's signed dynamic map, as its CPU C kernel does it: per block ``m = max|v|`` (stored as
    ``nested_absmax``; m == 0 gives code 0), ``t = clip(v * fp32(1/m), -1, 1)``,
    ``i16 = uint16(fp32(fp32(fp32((t + 1) * 0.5) * 65535) + 0.5))`` (truncating, no fused
    multiply-add), ``code = LUT[i16]`` with ``LUT[i] = count(midpoints < fp32(-1 + fp32(2i) / 65535))``.

Loading resolves the codes back with two roundings, ``fp32(fp32(code[c] * nested_absmax) + offset)``
(:func:`resolve_nested`, the same as :func:`convert.dequant.kernels.dequantize_nested_absmax`).

Chunking: :func:`encode_8bit` and :func:`resolve_nested` take any slice, given each value's
``nested_absmax``; only the offset and ``nested_absmax`` need the whole layer's absmax
(:func:`nested_statistics`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from convert.bnb4.torch_reduce import TORCH_NUM_THREADS, flat_f32, torch_mean_float32
from convert.dequant.products import PIECE
from formats.bnb import DYNAMIC_MAP_SIGNED
from formats.errors import NestedOffsetOverflowError

__all__ = [
    "NESTED_BLOCKSIZE",
    "double_quantize_absmax",
    "dynamic_map_lut",
    "encode_8bit",
    "nested_statistics",
    "quantize_blockwise_8bit",
    "resolve_nested",
]

#: absmax values per nested block (``quantize_blockwise(..., blocksize=256)`` in ``quantize_4bit``).
NESTED_BLOCKSIZE = 256

_F32 = np.float32



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
    v = flat_f32(v)
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
    v = flat_f32(v)
    scale = flat_f32(scale)
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

    The same two roundings as :func:`convert.dequant.kernels.dequantize_nested_absmax` (bnb
    ``dequantize_blockwise`` then ``+= offset``), with the nested absmax given per value.

    Args:
        codes: ``uint8[n]``.
        scale: ``float32[n]`` each value's ``nested_absmax``.
        offset: the nested offset (an fp32 value).
        code: ``float32[256]`` the map.

    Returns:
        ``float32[n]``.
    """
    prod = np.asarray(code, dtype=_F32)[np.asarray(codes, dtype=np.uint8)] * flat_f32(scale)
    return (prod + _F32(offset)).astype(_F32)


def _nested_offset(absmax: npt.NDArray[np.float32], num_threads: int) -> np.float32:
    """``nested_offset``: ``torch.mean(absmax)`` in fp32 (:func:`torch_mean_float32`).

    Raises:
        NestedOffsetOverflowError: QNT-006, the mean overflows float32 (absmax near float32's largest
            values): bnb would store an infinite offset, which no loader resolves.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        offset = torch_mean_float32(absmax, num_threads=num_threads)
    if not np.isfinite(offset):
        raise NestedOffsetOverflowError(
            "the mean of the absmax overflows float32: no finite nested_offset for double quantization",
            expected="a finite mean", found=f"{float(offset)} (largest absmax {float(absmax.max()):.4g})",
            hint="quantize with --no-double-quant", action="quantize")
    return offset


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

    Raises:
        NestedOffsetOverflowError: QNT-006 (:func:`_nested_offset`).
    """
    absmax = flat_f32(absmax)
    offset = _nested_offset(absmax, num_threads)
    codes, nested = quantize_blockwise_8bit(absmax - offset, NESTED_BLOCKSIZE, DYNAMIC_MAP_SIGNED)
    return codes, nested, float(offset)


def nested_statistics(
    absmax: npt.NDArray[np.float32], *, num_threads: int = TORCH_NUM_THREADS
) -> tuple[npt.NDArray[np.float32], float]:
    """``nested_absmax`` and ``nested_offset`` of :func:`double_quantize_absmax`, without the codes.

    The same values, computed in pieces: beside the input it needs ``float32[ceil(n_blocks/256)]`` and
    small temporaries instead of several ``n_blocks``-sized arrays (the codes are made per chunk later,
    with :func:`encode_8bit`).

    Args:
        absmax: ``float32[n_blocks]`` the whole layer's absmax.
        num_threads: torch's thread count the mean is reproduced for (matters for n_blocks >= 32768).

    Returns:
        (``float32[ceil(n_blocks/256)]`` ``nested_absmax``, ``nested_offset`` as a Python float holding
        the fp32 exactly).

    Raises:
        NestedOffsetOverflowError: QNT-006 (:func:`_nested_offset`).
    """
    absmax = flat_f32(absmax)
    offset = _nested_offset(absmax, num_threads)
    n = absmax.size
    nested = np.empty(-(-n // NESTED_BLOCKSIZE), dtype=_F32)
    step = max(1, PIECE // NESTED_BLOCKSIZE) * NESTED_BLOCKSIZE
    for a in range(0, n, step):
        b = min(n, a + step)
        v = np.abs(absmax[a:b] - offset)
        full = (b - a) // NESTED_BLOCKSIZE
        k = a // NESTED_BLOCKSIZE
        if full:
            np.max(v[: full * NESTED_BLOCKSIZE].reshape(full, NESTED_BLOCKSIZE), axis=1, out=nested[k : k + full])
        if b - a > full * NESTED_BLOCKSIZE:  # the partial last block (bnb pads it with zeros)
            nested[k + full] = v[full * NESTED_BLOCKSIZE :].max()
    return nested, float(offset)

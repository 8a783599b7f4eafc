"""Pure NumPy kernels: 4-bit dequantization, nested absmax, LLM.int8, rounding to bf16/fp16. No I/O.

Numerics (verified bit for bit against bitsandbytes 0.50.2, see docs/bnb-format.md):

- 4-bit: ``y[i] = round_to_dtype(fp32(quant_map[code[i]]) * fp32(absmax[i // blocksize]))``, one
  round-to-nearest-even from the fp32 product; blocks run over the flat index. Code i is the high
  nibble of byte i // 2 when i is even, the low nibble when odd. Matches bitsandbytes
  ``functional.dequantize_4bit`` (generic kernel in ``backends/default/ops.py``, and CUDA).
- nested absmax (double quantization), two roundings:
  ``absmax[j] = fp32(fp32(nested_quant_map[u8[j]] * nested_absmax[j // nested_blocksize]) + offset)``,
  matching ``functional.dequantize_blockwise`` followed by ``+= offset`` in ``dequantize_4bit``.
- LLM.int8 (row format), two roundings in fp32 then one to the output dtype:
  ``y = dtype(fp32(fp32(int8 * SCB[row]) * fp32(7.874015718698502e-3)))`` (7.87e-3 = 1/127 as bnb
  spells it), matching bitsandbytes ``int8_vectorwise_dequant`` / ``Linear8bitLt`` weight dequantization.

Speed: the 4-bit products come from :mod:`convert.dequant.products` (a quad table, one multiply on a
``(n_blocks, blocksize)`` view); rounding to bf16 is ml_dtypes' cast in the same ufunc call. float16
output is :mod:`convert.dequant.kernels_f16` (integer rounding, tables where products leave float16's normal range).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from convert.dequant.kernels_f16 import dequantize_4bit_f16
from convert.dequant.products import BF16, F32, PIECE, piece_elements, products_into, quad_lut
from formats.dtypes import BY_NAME

__all__ = [
    "INT8_SCALE",
    "dequantize_4bit",
    "dequantize_int8",
    "dequantize_nested_absmax",
    "float_output",
    "round_float32",
    "unpack_4bit",
]


def unpack_4bit(packed: npt.NDArray[np.uint8], n: int | None = None) -> npt.NDArray[np.uint8]:
    """Split packed bytes into 4-bit codes.

    Args:
        packed: ``uint8[m]``; byte k holds code 2k in its high nibble and code 2k+1 in its low one.
        n: number of codes wanted (<= 2m; default 2m).

    Returns:
        ``uint8[n]`` codes in 0..15.
    """
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    codes = np.empty((packed.size, 2), dtype=np.uint8)
    np.right_shift(packed, 4, out=codes[:, 0])
    np.bitwise_and(packed, 15, out=codes[:, 1])
    flat = codes.reshape(-1)
    return flat if n is None else flat[:n]


def round_float32(x: npt.NDArray[np.float32], dtype: np.dtype | str) -> np.ndarray:
    """Round fp32 values to ``dtype`` with one round-to-nearest-even.

    Args:
        x: ``float32[...]``.
        dtype: ``bfloat16``, ``float16`` or ``float32`` (NumPy dtype or name).

    Returns:
        array of ``dtype`` with x's shape (x itself for float32).
    """
    dt = float_output(dtype)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if dt is F32:
        return x
    if dt is BF16:  # ml_dtypes' cast sets no floating-point flags (overflow gives inf silently)
        return x.astype(dt)
    with np.errstate(over="ignore"):  # overflow to inf is the IEEE result (and counted for fp16)
        return x.astype(dt)  # NumPy's cast rounds to nearest even


#: Output dtype name -> the NumPy dtype, from the dtype table (looked up once per call: 10^5 tiny tensors).
_FLOAT_OUTPUTS = {name: BY_NAME[name].numpy for name in ("bfloat16", "float16", "float32")}


def float_output(dtype: np.dtype | str) -> np.dtype:
    """The NumPy dtype of a float output named ``bfloat16``, ``float16`` or ``float32`` (or given as a dtype).

    Raises:
        ValueError: any other dtype.
    """
    dt = _FLOAT_OUTPUTS.get(dtype if isinstance(dtype, str) else np.dtype(dtype).name)
    if dt is None:
        raise ValueError(f"cannot round to {dtype}")
    return dt


def dequantize_4bit(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    quant_map: npt.NDArray[np.float32],
    blocksize: int,
    n: int,
    out_dtype: np.dtype | str,
    out: np.ndarray | None = None,
    stats: npt.NDArray[np.int64] | None = None,
) -> np.ndarray:
    """Dequantize n 4-bit codes that start at a block boundary.

    Matches bitsandbytes ``functional.dequantize_4bit`` (generic kernel): one fp32 product
    ``quant_map[code] * absmax[block]``, one round-to-nearest-even to ``out_dtype``.

    Args:
        packed: ``uint8[ceil(n/2)]`` packed codes (high nibble = even element).
        absmax: ``float32[ceil(n/blocksize)]`` resolved absmax (finite).
        quant_map: ``float32[16]`` the NF4 or FP4 table.
        blocksize: elements per absmax value (even).
        n: number of elements.
        out_dtype: ``bfloat16``, ``float16`` or ``float32``.
        out: optional ``out_dtype[n]`` destination.
        stats: optional ``int64[2]``; for float16 output, adds the number of values that overflowed
            to inf and of non-zero values that flushed to zero.

    Returns:
        ``out_dtype[n]``, flat.
    """
    dt = float_output(out_dtype)
    if out is None:
        out = np.empty(n, dtype=dt)
    packed = packed.reshape(-1)
    absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    piece = piece_elements(blocksize)
    if dt == np.float16:
        return dequantize_4bit_f16(packed, absmax, quant_map, blocksize, n, out, stats, piece)
    lut = quad_lut(quant_map)
    quads = np.empty(min(piece, n) // 4 + 1, dtype=np.complex128)  # (a whole piece for a tiny tensor: an mmap)
    for s in range(0, n, piece):
        # the fp32 product written straight into the output: for bf16 the ufunc casts each buffer of
        # products as it goes (ml_dtypes' cast: round to nearest even), no separate pass
        products_into(packed, absmax, lut, blocksize, s, min(n, s + piece), quads, out[s : s + piece])
    return out


def dequantize_nested_absmax(
    codes: npt.NDArray[np.uint8],
    nested_absmax: npt.NDArray[np.float32],
    nested_quant_map: npt.NDArray[np.float32],
    nested_blocksize: int,
    offset: float,
    nested_dtype: str = "float32",
) -> npt.NDArray[np.float32]:
    """Undo double quantization of absmax.

    ``absmax[j] = fp32(fp32(nested_quant_map[codes[j]] * nested_absmax[j // nested_blocksize]) + offset)``:
    two roundings, as bitsandbytes ``dequantize_blockwise`` then ``absmax += offset``. When
    ``nested_dtype`` is not float32 each step is rounded to it.

    Args:
        codes: ``uint8[n_blocks]`` 8-bit codes (the stored ``absmax``).
        nested_absmax: ``float32[ceil(n_blocks / nested_blocksize)]`` (f16/bf16 are upcast).
        nested_quant_map: ``float32[256]`` the signed dynamic map.
        nested_blocksize: codes per nested_absmax value (256 in bitsandbytes).
        offset: the fp32 mean that was subtracted.
        nested_dtype: ``float32``, ``bfloat16`` or ``float16``.

    Returns:
        ``float32[n_blocks]`` resolved absmax.
    """
    codes = np.asarray(codes, dtype=np.uint8).reshape(-1)
    n = codes.size
    qmap = np.asarray(nested_quant_map, dtype=np.float32).reshape(-1)
    nested = np.asarray(nested_absmax, dtype=np.float32).reshape(-1)
    off = np.float32(offset)
    if nested_dtype != "float32":
        off = np.float32(round_float32(np.array([off], np.float32), nested_dtype).astype(np.float32)[0])
    out = np.empty(n, dtype=np.float32)
    # in pieces of whole nested blocks: temporaries stay small whatever the layer size
    step = max(1, (1 << 16) // nested_blocksize) * nested_blocksize
    with np.errstate(over="ignore", invalid="ignore"):  # IEEE inf/NaN: the caller rejects them (BNB-012)
        for a in range(0, n, step):
            b = min(n, a + step)
            scale = np.repeat(nested[a // nested_blocksize : -(-b // nested_blocksize)], nested_blocksize)[: b - a]
            prod = qmap[codes[a:b]] * scale
            if nested_dtype != "float32":
                prod = round_float32(prod, nested_dtype).astype(np.float32)
                out[a:b] = round_float32(prod + off, nested_dtype).astype(np.float32)
            else:
                np.add(prod, off, out=out[a:b])
    return out


#: The int8 scale bitsandbytes multiplies by (its spelling of 1/127), as the fp32 the kernel uses.
INT8_SCALE = np.float32(7.874015718698502e-3)


def dequantize_int8(
    weight: npt.NDArray[np.int8],
    scb: npt.NDArray[np.float32],
    out_dtype: np.dtype | str,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Dequantize LLM.int8 rows (row weight_format).

    Matches bitsandbytes ``functional.int8_vectorwise_dequant`` as applied to a ``Linear8bitLt`` weight:
    ``dtype(fp32(fp32(int8 * SCB[row]) * fp32(7.874015718698502e-3)))``, two fp32 roundings then one
    round-to-nearest-even to ``out_dtype``.

    Args:
        weight: ``int8[rows, in]`` (any slice of whole rows).
        scb: ``float32[rows]`` the rows' absmax (``P.SCB``), finite.
        out_dtype: ``bfloat16``, ``float16`` or ``float32``.
        out: optional ``out_dtype[rows, in]`` destination.

    Returns:
        ``out_dtype[rows, in]``.
    """
    dt = float_output(out_dtype)
    weight = np.asarray(weight).view(np.int8).reshape(np.shape(weight)[0], -1)
    rows, cols = weight.shape
    scb = np.asarray(scb, dtype=np.float32).reshape(rows)
    if out is None:
        out = np.empty((rows, cols), dtype=dt)
    step = max(1, PIECE // max(cols, 1))
    for r in range(0, rows, step):
        e = min(rows, r + step)
        vals = weight[r:e].astype(np.float32)
        np.multiply(vals, scb[r:e, None], out=vals)
        np.multiply(vals, INT8_SCALE, out=vals)
        out[r:e] = round_float32(vals, dt)
    return out

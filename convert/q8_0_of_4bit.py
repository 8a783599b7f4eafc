"""GGUF Q8_0 straight from bitsandbytes 4-bit codes: the bytes of :class:`convert.legacy_quants.Q8_0Codec`
on the bf16 dequantization, without making the bf16 weight or searching its blocks.

``convert_hf_to_gguf.py --outtype q8_0`` of a dequantized bf16 checkpoint quantizes
``x = float32(bf16(fp32(quant_map[code] * absmax[block])))`` (:func:`convert.kernels.dequantize_4bit`)
by llama.cpp's ``quantize_row_q8_0_ref``: per 32 values ``d = max|x| / 127``, ``id = 1 / d`` (0 when
``d == 0``), ``qs = roundf(x * id)``, ``d`` stored as float16. With a blocksize that is a multiple of 32
every Q8_0 block lies in one bnb block, so its largest ``|x|`` is ``bf16(max|quant_map[c]| * |absmax|)``
over the codes ``c`` present (rounding is monotone and odd): a per-block set of codes (one bit per code,
OR-ed over the block's 16 bytes) replaces the maximum over 32 floats, which NumPy reduces slowly.
The rest is the codec's arithmetic, in the same float32 operations: the product, bf16 rounding (by
integer operations: ``(u + 0x7FFF + bit 16 of u)`` with the low 16 bits cleared, ml_dtypes' round to
nearest even, exact for every finite float32), ``x * id``, round half away from zero
(:func:`convert.codec_base.round_half_away_into`), truncation to int8.

The error figures are the codec's (:meth:`convert.legacy_quants.Q8_0Codec.quantize_measured`): on the
tensor's pieces of :data:`convert.legacy_quants.CHUNK_BLOCKS` blocks ``0, sample, 2 * sample, ...``
(counted from the tensor's first value), ``trunc(t) * float32(d16) - x`` and ``x``'s sum of squares,
summed over the same pieces: the same figures for the same values.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from .codec_base import Measured, abs_max, inverse_scale, round_half_away_into, sum_squares
from .kernels import pair_lut
from .legacy_quants import CHUNK_BLOCKS

__all__ = ["q8_0_of_4bit"]

QK = 32
#: Values per piece: one piece of the error sample's grid (:data:`CHUNK_BLOCKS` blocks), 512 KiB of float32.
GRID = CHUNK_BLOCKS * QK


@functools.lru_cache(maxsize=4)
def _tables(quant_map: bytes) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """(:func:`convert.kernels.pair_lut` of the map, ``float32[2^16]``: a set of codes (bit ``c`` for code
    ``c``) -> the largest ``|quant_map[c]|`` in it)."""
    q = np.frombuffer(quant_map, np.float32)
    present = (np.arange(1 << 16)[:, None] >> np.arange(16)) & 1 == 1
    largest = np.where(present, np.abs(q), np.float32(0)).max(axis=1).astype(np.float32)
    return pair_lut(q), largest


def _bf16_round(u: npt.NDArray[np.uint32], tmp: npt.NDArray[np.uint32]) -> None:
    """Round float32 bits ``u`` (finite) in place to the nearest bfloat16, ties to even (ml_dtypes' cast),
    keeping them float32: ``(u + 0x7FFF + bit 16 of u) & 0xFFFF0000``."""
    np.right_shift(u, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(u, tmp, out=u)
    np.add(u, np.uint32(0x7FFF), out=u)
    np.bitwise_and(u, np.uint32(0xFFFF0000), out=u)


def q8_0_of_4bit(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    quant_map: npt.NDArray[np.float32],
    blocksize: int,
    lead: int,
    n: int,
    start: int = 0,
    sample: int = 1,
) -> Measured | None:
    """Q8_0 of values ``[lead, lead + n)`` of a 4-bit run that starts at a bnb block boundary, dequantized
    to bfloat16 (:func:`convert.kernels.dequantize_4bit`) and quantized as :class:`Q8_0Codec` does.

    Args:
        packed: ``uint8[(lead + n) // 2]`` (at least): the run's packed codes (high nibble = even value).
        absmax: ``float32[ceil((lead + n) / blocksize)]``: the run's resolved absmax (finite).
        quant_map: ``float32[16]``.
        blocksize: values per absmax (a multiple of 32, else None is returned).
        lead: values skipped at the run's start (a multiple of 32).
        n: values wanted (a multiple of 32).
        start: the tensor index of value ``lead`` (places the values on the error sample's grid).
        sample: measure the grid's pieces ``0, sample, 2 * sample, ...`` (1: every value).

    Returns:
        :class:`Measured` with ``uint8[n // 32, 34]`` blocks and the codec's error figures; None when this
        route cannot give the codec's bytes: a blocksize or ``lead``/``n`` not a multiple of 32, or a block
        whose ``d`` or ``1 / d`` is not finite (``d < 2^-128``; the codec hands those to gguf-py).
    """
    if blocksize % QK or lead % QK or n % QK or start % QK:
        return None
    with np.errstate(all="ignore"):  # 1 / 0 is inverse_scale's business
        return _encode(packed, absmax, quant_map, blocksize, lead, n, start, sample)


def _encode(
    packed: npt.NDArray[np.uint8], absmax: npt.NDArray[np.float32], quant_map: npt.NDArray[np.float32],
    blocksize: int, lead: int, n: int, start: int, sample: int,
) -> Measured | None:
    lut, largest = _tables(np.ascontiguousarray(quant_map, dtype=np.float32).tobytes())
    out = np.empty((n // QK, QK + 2), np.uint8)
    size = min(n, GRID)
    pairs, x = np.empty(size // 2, np.uint64), np.empty(size, np.float32)
    tmp, t = np.empty(size, np.uint32), np.empty(size, np.float32)
    hi, lo = np.empty(size // 2, np.uint16), np.empty(size // 2, np.uint16)
    ones = np.ones(size // 2, np.uint16)
    per_block = blocksize // QK
    max_err = sq_err = sq_ref = 0.0
    measured = 0
    base = start - lead  # the tensor index of value 0 of the run
    s = lead
    while s < lead + n:
        e = min(lead + n, ((base + s) // GRID + 1) * GRID - base)  # pieces end on the grid
        m, nq = e - s, (e - s) // QK
        src = packed[s // 2 : e // 2]
        xs = x[:m]
        vals = np.take(lut, src, out=pairs[: m // 2], mode="wrap").view(np.float32)  # quant_map[code]
        b0, b1 = s // blocksize, -(-e // blocksize)
        a = s
        while a < e:  # the product, by whole bnb blocks where the piece has them
            b = a // blocksize
            if a % blocksize == 0 and e - a >= blocksize:
                k = (e - a) // blocksize
                np.multiply(vals[a - s : a - s + k * blocksize].reshape(k, blocksize), absmax[b : b + k, None],
                            out=xs[a - s : a - s + k * blocksize].reshape(k, blocksize))
                a += k * blocksize
            else:
                z = min(e, (b + 1) * blocksize)
                np.multiply(vals[a - s : z - s], absmax[b], out=xs[a - s : z - s])
                a = z
        _bf16_round(xs.view(np.uint32), tmp[:m])
        # the set of codes present in each Q8_0 block: one bit per code, OR-ed over its 16 bytes
        h, lw = hi[: m // 2], lo[: m // 2]
        np.left_shift(ones[: m // 2], src >> 4, out=h, casting="unsafe")
        np.left_shift(ones[: m // 2], src & 15, out=lw, casting="unsafe")
        np.bitwise_or(h, lw, out=h)
        w = h.view(np.uint64).reshape(nq, 4)
        codes = w[:, 0] | w[:, 1]
        codes |= w[:, 2]
        codes |= w[:, 3]
        codes |= codes >> np.uint64(32)
        codes |= codes >> np.uint64(16)
        codes &= np.uint64(0xFFFF)
        scale = np.abs(np.repeat(absmax[b0:b1], per_block)[(s - b0 * blocksize) // QK :][:nq])
        amax = largest[codes.astype(np.intp)] * scale  # = |the block's largest product|
        _bf16_round(amax.view(np.uint32), np.empty(nq, np.uint32))
        d = amax / np.float32(127)
        inv, bad = inverse_scale(d)
        if np.count_nonzero(bad):
            return None
        xb = xs.reshape(nq, QK)
        v = np.multiply(xb, inv[:, None], out=t[:m].reshape(nq, QK))
        r = round_half_away_into(v, tmp[:m].view(np.float32).reshape(nq, QK))
        ob = out[(s - lead) // QK : (e - lead) // QK]
        np.copyto(ob[:, 2:].view(np.int8), r, casting="unsafe")  # truncation toward zero
        ob.view("<f2")[:, 0] = d
        if (base + s) // GRID % sample == 0:
            d16 = ob.view("<f2")[:, 0].astype(np.float32)
            err = np.multiply(np.trunc(r, out=r), d16[:, None], out=v)
            err -= xb
            sq_ref += sum_squares(xb)
            max_err = max(max_err, abs_max(err))
            sq_err += sum_squares(err)
            measured += m
        s = e
    return Measured(out, max_err, sq_err, sq_ref, measured)

"""float16 from bitsandbytes' 4-bit codes and from bfloat16, bit for bit as NumPy's cast rounds.

- :func:`dequantize_4bit_f16` (``--to fp16``): ``fp16(fp32(quant_map[code]) * fp32(absmax[block]))``, one
  round-to-nearest-even from the fp32 product, the bits of NumPy's cast (bnb's ``dequantize_4bit`` in
  float16). Where every non-zero product of a span is provably in float16's normal range (nearly every
  span of a real weight), each product is rounded by five integer passes (:func:`f16_bits_of_signed`);
  elsewhere by table: each block's 16 products are rounded once by NumPy's cast (software on most x86
  builds, 4-7 ns a value) and the codes pick from them (:class:`_F16Tables`).
- :func:`dequantize_4bit_f16_of_bf16` (GGUF F16 of a bnb layer): ``fp16(bf16(product))``, what
  ``convert_hf_to_gguf.py`` writes from the dequantized bf16 checkpoint, by one shift of the bfloat16 bits.
- :func:`bf16_to_f16`: bfloat16 values to float16 (a plain bf16 tensor to ``--to fp16`` or GGUF F16).

NumPy's own fp32 -> fp16 cast equals an integer round-to-nearest-even on all 2^32 float32 patterns, and
the integer routes equal it on their whole domains: ``scripts/check_f16_cast.py``. The products come from
:mod:`convert.dequant.products` (the quad table of the quant_map, or of :func:`signed_quad_lut`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

from convert.dequant.products import BF16, PIECE, piece_elements, products_into, quad_lut

__all__ = [
    "TABLE_SPAN",
    "bf16_to_f16",
    "count_f16_loss",
    "dequantize_4bit_f16",
    "dequantize_4bit_f16_of_bf16",
    "f16_bits_of_bf16",
    "f16_bits_of_signed",
    "signed_quad_lut",
]

#: Elements whose float16 route is chosen (and table made) at once (:func:`dequantize_4bit_f16`): its NumPy
#: calls long enough (tens of microseconds) that two threads overlap them instead of waiting for each
#: other's GIL.
TABLE_SPAN = 1 << 20


def dequantize_4bit_f16_of_bf16(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    quant_map: npt.NDArray[np.float32],
    blocksize: int,
    n: int,
    out: npt.NDArray[np.float16] | None = None,
) -> npt.NDArray[np.float16] | None:
    """float16 of the bfloat16 dequantization, ``fp16(bf16(fp32(quant_map[code] * absmax[block])))``,
    when it is exact: the bits of :func:`bf16_to_f16` of :func:`convert.dequant.kernels.dequantize_4bit` to
    bfloat16 (what ``convert_hf_to_gguf.py`` writes as F16 from the dequantized bf16 checkpoint), at the
    bf16 kernel's cost plus one pass.

    When the signed-map route holds (:func:`_signed_route`: every non-zero product provably in
    ``[2^-14, 65280)``, no -0.0 in the map), each product is made from :func:`signed_quad_lut` and
    ``absmax * 2^-112`` (exactly ``x * 2^-112``, or ``x * 2^-80`` for a negative ``x``) and rounded to
    bfloat16 by the multiply (ml_dtypes' cast, as the bf16 kernel); :func:`f16_bits_of_bf16` then moves
    its bits into float16's: no second rounding, a bfloat16 of that range being exact in float16; the
    zero code gives +0, as the product does.

    Args: as :func:`convert.dequant.kernels.dequantize_4bit` (``n`` codes from a block boundary; ``out``: optional
    ``float16[n]``).

    Returns:
        ``float16[n]`` (``out`` when given), or None when the route does not hold (a zero, tiny or huge
        absmax, a -0.0 code; the caller takes the bf16 route; ``out`` is left as it was).
    """
    packed = packed.reshape(-1)
    absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    if not _signed_route(absmax, quant_map, _BF16_F16_MAX):
        return None
    scaled = absmax * np.float32(2.0**-112)  # exact: absmax >= 2^-14 (_signed_route)
    lut = signed_quad_lut(quant_map)
    piece = piece_elements(blocksize)
    out = np.empty(n, np.float16) if out is None else out
    bits, rounded = out.view(np.uint16), out.view(BF16)
    quads = np.empty(min(piece, n) // 4 + 1, dtype=np.complex128)
    for s in range(0, n, piece):
        e = min(n, s + piece)
        products_into(packed, scaled, lut, blocksize, s, e, quads, rounded[s:e])  # bfloat16, in place
        f16_bits_of_bf16(bits[s:e], bits[s:e])
    return out


def dequantize_4bit_f16(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    quant_map: npt.NDArray[np.float32],
    blocksize: int,
    n: int,
    out: np.ndarray,
    stats: npt.NDArray[np.int64] | None,
    piece: int,
) -> np.ndarray:
    """:func:`convert.dequant.kernels.dequantize_4bit` to float16 (``piece``: its inner piece, elements),
    :data:`TABLE_SPAN` elements at a time, each span by one of two routes giving the bits of NumPy's cast
    of every fp32 product (round to nearest even):

    - where the signed-map route holds for the span's blocks (:func:`_signed_route`: every non-zero
      product provably in float16's normal range, ``[2^-14, 65504)``; nearly every span of a real
      weight): each product is made from :func:`signed_quad_lut` and ``absmax * 2^-112`` and rounded
      by :func:`f16_bits_of_signed` (integer operations; nothing can overflow or flush);
    - elsewhere by table (:class:`_F16Tables`: each block has only 16 values, so its 16 products are
      rounded once by NumPy's cast, 4-7 ns a value on x86 without AVX-512 FP16, and the codes pick from
      them). The table is laid out code-major, ``table[code * stride + block]``, so a packed byte gives
      its two codes times ``stride`` by one take (:func:`_code_pairs`), the block index within the piece
      is added and the piece takes from the table starting at its first block.

    ``stats``: values that overflowed to inf and non-zero values flushed to zero, counted from the table
    entries that did so (the elements that picked them are counted only when one exists).
    """
    span = max(piece, (TABLE_SPAN // piece) * piece)  # elements whose route is chosen at once
    first = min(piece, n)
    tables: _F16Tables | None = None
    signed: tuple[npt.NDArray[np.complex128], npt.NDArray[np.complex128], npt.NDArray[np.float32],
                  npt.NDArray[np.uint32]] | None = None
    for s0 in range(0, n, span):
        e0 = min(n, s0 + span)
        b0, nb = s0 // blocksize, -(-(e0 - s0) // blocksize)
        if _signed_route(absmax[b0 : b0 + nb], quant_map, _F16_MAX):
            if signed is None:  # (lut, quads, products, scratch)
                signed = (signed_quad_lut(quant_map), np.empty(first // 4 + 1, np.complex128),
                          np.empty(first, np.float32), np.empty(first, np.uint32))
            lut, quads, products, tmp = signed
            scaled = absmax[b0 : b0 + nb] * np.float32(2.0**-112)  # exact: absmax >= 2^-14 (_signed_route)
            for s in range(s0, e0, piece):
                e = min(e0, s + piece)
                x = products[: e - s]
                products_into(packed[s0 // 2 :], scaled, lut, blocksize, s - s0, e - s0, quads, x)
                f16_bits_of_signed(x.view(np.uint32), tmp[: e - s], out[s:e].view(np.uint16))
            continue
        if tables is None:
            tables = _F16Tables(quant_map, -(-min(span, n) // blocksize), first, blocksize)
        tables.pick(packed, absmax[b0 : b0 + nb], s0, e0, piece, out, stats)
    return out


class _F16Tables:
    """The float16 values ``fp16(fp32(q[code] * absmax[block]))`` of up to ``blocks`` blocks at a time
    by NumPy's cast, code-major: ``table[code * stride + block]``, rows padded to ``stride = blocks + 32``
    entries (rows a power of two apart would share the cache's sets: the takes ran 40% slower), and the
    scratch that picks from them (``first`` elements a piece at most)."""

    def __init__(self, quant_map: npt.NDArray[np.float32], blocks: int, first: int, blocksize: int) -> None:
        self.q = np.asarray(quant_map, dtype=np.float32).reshape(16, 1)
        self.blocksize = blocksize
        self.stride = blocks + 32
        self.products = np.empty((16, self.stride), np.float32)
        self.table = np.empty((16, self.stride), np.uint16)
        self.scaled = _code_pairs(self.stride)  # (byte -> its two codes times the table's row stride)
        self.block_of = _block_of(-(-first // blocksize), blocksize)[:first]
        self.pairs = np.empty(-(-first // 2), dtype=_PAIR)

    def make(
        self, absmax: npt.NDArray[np.float32], count: bool
    ) -> tuple[npt.NDArray[np.uint16], tuple[npt.NDArray[np.bool_] | None, npt.NDArray[np.bool_] | None] | None]:
        """The table of ``absmax``'s blocks (``float32[nb]``, nb <= blocks).

        Returns:
            ``(uint16[16 * stride] table, counts)``: counts None when not asked (``count``) or when no
            entry overflowed to inf or flushed a non-zero product to zero; else ``(over, under)``, each
            ``bool[16 * stride]`` in the table's layout or None when no entry did it.
        """
        nb = absmax.size
        products, table = self.products[:, :nb], self.table[:, :nb]
        np.multiply(self.q, absmax, out=products)  # as bnb's product
        with np.errstate(over="ignore"):  # overflow to inf is the IEEE result (counted)
            np.copyto(table, products.astype(np.float16).view(np.uint16))  # round to nearest even
        if not count:
            return self.table.reshape(-1), None
        magnitude = self.table & np.uint16(0x7FFF)
        over = magnitude == 0x7C00  # the products are finite: every inf is an overflow
        under = magnitude == 0
        under[:, :nb] &= products != 0
        over[:, nb:] = under[:, nb:] = False
        has_over, has_under = bool(over.any()), bool(under.any())
        if not (has_over or has_under):
            return self.table.reshape(-1), None
        flat = self.table.reshape(-1)
        return flat, (over.reshape(-1) if has_over else None, under.reshape(-1) if has_under else None)

    def pick(self, packed: npt.NDArray[np.uint8], absmax: npt.NDArray[np.float32], s0: int, e0: int, piece: int,
             out: np.ndarray, stats: npt.NDArray[np.int64] | None) -> None:
        """``out[s0:e0]`` (elements of the flat weight, ``s0`` on a block) from the table of ``absmax``
        (their blocks'), ``piece`` elements at a time; ``stats`` as :func:`dequantize_4bit_f16`."""
        table, counts = self.make(absmax, stats is not None)
        for s in range(s0, e0, piece):
            e = min(e0, s + piece)
            m = e - s
            src = packed[s // 2 : (e + 1) // 2]
            ix = np.take(self.scaled, src, out=self.pairs[: src.size], mode="wrap").view(np.intp)[:m]  # code * stride
            np.add(ix, self.block_of[:m], out=ix)  # + the block within the piece ...
            first_block = (s - s0) // self.blocksize  # ... indexes the table from the piece's first block
            # (in range by construction: "wrap" changes none)
            np.take(table[first_block:], ix, out=out[s:e].view(np.uint16), mode="wrap")
            if counts is not None:
                over, under = counts
                if over is not None:
                    stats[0] += int(np.count_nonzero(over[first_block:][ix]))
                if under is not None:
                    stats[1] += int(np.count_nonzero(under[first_block:][ix]))


@functools.lru_cache(maxsize=16)
def _map_range(qbytes: bytes) -> tuple[float, float, bool]:
    """Of a quant_map (its float32 bytes; cached: the route is asked once per span): the least and the
    largest ``|q|`` over its non-zero values (float64; NaN for a map of zeros, or when it holds NaN),
    and whether it holds -0.0."""
    q = np.frombuffer(qbytes, dtype=np.float32)
    mag = np.abs(q).astype(np.float64)
    mag = mag[mag != 0]
    lo, hi = (float(mag.min()), float(mag.max())) if mag.size else (math.nan, math.nan)
    return lo, hi, bool(np.any(np.signbit(q) & (q == 0)))


def _signed_route(absmax: npt.NDArray[np.float32], quant_map: npt.NDArray[np.float32], high: float) -> bool:
    """Whether the float16 kernels' signed-map route gives exact bits for these blocks:

    - every non-zero product provably of magnitude in ``[2^-14, high)``: ``min(absmax) * min|q| >= 2^-14``
      and ``max(absmax) * max|q| < high`` over the non-zero ``q``, in float64 (rounding to float32 is
      monotone and the bounds are float32 values), so every scaled product is a float32 normal;
    - ``absmax >= 2^-14``: ``absmax * 2^-112`` exact (implied by the first for ``|q| <= 1``, not for a
      map with larger values; with the upper bound it keeps ``|q| < 2^30``, so a negative value times
      ``2^32`` stays finite);
    - no -0.0 in the quant_map (its product, -0, would come out +0: the route has no sign bit of its own).

    False for an empty absmax, a map of zeros, or NaN/inf anywhere (a comparison with NaN is False)."""
    if not absmax.size:
        return False
    qmin, qmax, negative_zero = _map_range(np.asarray(quant_map, dtype=np.float32).tobytes())
    amin, amax = float(absmax.min()), float(absmax.max())
    return (not negative_zero and amin >= _F16_MIN_NORMAL and amin * qmin >= _F16_MIN_NORMAL
            and amax * qmax < high)


#: float16's smallest normal value and its largest finite one (bounds of :func:`f16_bits_of_signed`'s domain).
_F16_MIN_NORMAL = 2.0**-14
_F16_MAX = 65504.0
#: Below it a float32 rounds to a bfloat16 of at most 65280, exact in float16 (65408 would round up to 65536).
_BF16_F16_MAX = 65280.0


def signed_quad_lut(quant_map: npt.NDArray[np.float32]) -> npt.NDArray[np.complex128]:
    """:func:`quad_lut` of the quant_map with each negative value times ``2^32`` (exactly; cached).

    The float16 kernels multiply it by ``absmax * 2^-112``: a product is then exactly ``x * 2^-112`` for a
    positive ``x = quant_map[code] * absmax`` and ``x * 2^-80`` for a negative one (powers of two commute
    with rounding while every value is a float32 normal: :func:`_signed_route`). Either way float32's
    exponent field holds float16's exponent (``E - 112``, 1..30) in its low five bits, and its sixth bit
    (bit 28) is set exactly for a negative ``x``: shifted down by 13 (float16) or 16 - 3 (bfloat16), that
    bit lands on the float16 sign bit, and float32's own sign (bit 31) falls out of the 16 bits kept.
    """
    q = np.asarray(quant_map, dtype=np.float32).reshape(16)
    return quad_lut(np.where(q < 0, q * np.float32(2.0**32), q).astype(np.float32))


def f16_bits_of_signed(
    u: npt.NDArray[np.uint32], tmp: npt.NDArray[np.uint32], out: npt.NDArray[np.uint16]
) -> npt.NDArray[np.uint16]:
    """float16 bits of ``x``, rounded to nearest even, from the float32 bits of ``x * 2^-112`` (``x > 0``)
    or ``x * 2^-80`` (``x < 0``), for ``2^-14 <= |x| < 65504`` or ``x = +0`` (:func:`signed_quad_lut`;
    outside that the result is meaningless).

    ``(u + 0xFFF + bit 13 of u) >> 13``, its low 16 bits: the fraction rounded from 23 to 10 bits (a
    carry moving into the exponent, as rounding does), float16's exponent in bits 10..14 and bit 28, set
    for a negative ``x``, on the sign bit. Five integer passes (NumPy's fp32 -> fp16 cast is software on
    most x86 builds: 4-7 ns a value). Equal to NumPy's cast on every pattern of the domain, both signs
    (``scripts/check_f16_cast.py --normal``).

    Args:
        u: ``uint32[k]``, the scaled bits; ``tmp``: ``uint32[k]`` scratch (not ``u``).
        out: ``uint16[k]`` destination.

    Returns:
        ``out``.
    """
    np.right_shift(u, 13, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)  # the lowest kept bit: ties go to even
    np.add(tmp, u, out=tmp)
    np.add(tmp, np.uint32(0xFFF), out=tmp)
    np.right_shift(tmp, 13, out=out, casting="unsafe")  # (the low 16 bits)
    return out


def f16_bits_of_bf16(b: npt.NDArray[np.uint16], out: npt.NDArray[np.uint16]) -> npt.NDArray[np.uint16]:
    """float16 bits of ``bf16(x)`` from the bfloat16 bits of ``x * 2^-112`` (``x > 0``) or ``x * 2^-80``
    (``x < 0``) rounded to bfloat16 (ml_dtypes: round to nearest even, the scaling commuting with it), for
    ``2^-14 <= |x| < 65280`` or ``x = +0`` (:func:`signed_quad_lut`; outside that meaningless): ``b << 3``,
    its low 16 bits. The 7 fraction bits and float16's exponent (the low five bits of bfloat16's) move
    into place and bit 12, set for a negative ``x``, onto the sign bit: no second rounding, a bfloat16
    of that range being exact in float16. One pass; equal to NumPy's float16 cast of the bfloat16 on
    every pattern of the domain, both signs (``scripts/check_f16_cast.py --normal``). ``out`` may be ``b``.
    """
    return np.left_shift(b, 3, out=out)


#: A NumPy type of two ``intp`` that ``np.take`` moves fast (its values are never used as numbers).
_PAIR = np.dtype({8: np.complex128, 4: np.uint64}[np.dtype(np.intp).itemsize])


@functools.lru_cache(maxsize=16)
def _block_of(blocks: int, blocksize: int) -> npt.NDArray[np.intp]:
    """``intp[blocks * blocksize]``: each element's block within a piece (read-only; made once per
    shape: a fresh 2 MiB array per call cost as much as the call's work at small ``--max-memory``)."""
    a = np.repeat(np.arange(blocks, dtype=np.intp), blocksize)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=64)
def _code_pairs(scale: int) -> np.ndarray:
    """The 256-entry table byte -> its two codes (high nibble, low nibble) times ``scale``, as two
    ``intp`` in one :data:`_PAIR` item per byte (``np.take`` of it turns packed bytes into table
    indices in one call)."""
    idx = np.arange(256, dtype=np.intp)
    codes = np.stack([idx >> 4, idx & 15], axis=1) * scale
    pairs = codes.view(_PAIR).reshape(256)
    pairs.flags.writeable = False
    return pairs


def bf16_to_f16(
    x: np.ndarray, out: npt.NDArray[np.float16] | None = None, stats: npt.NDArray[np.int64] | None = None
) -> tuple[npt.NDArray[np.float16], npt.NDArray[np.intp]]:
    """Round bfloat16 values to float16: the bits NumPy's cast of their float32 values gives, about 3x
    faster (in cache-sized pieces, no float32 temporaries).

    A bf16 value with a biased exponent E in 113..142 (magnitude in [2^-14, 65280]) has 8 significant
    bits and a float16 normal exponent: it is exact in float16, whose bits are rebuilt by integer
    operations (``sign | ((bits << 3) + (16 << 10)) mod 2^16``: the shift drops the sign and E's top two
    bits, and ``E - 112 == E + 16 mod 64`` in the five bits that remain); so is +-0. The others (float16
    subnormals, overflow to inf, inf, NaN; about 0.2% of a normal(0, 0.02) weight) go through NumPy's
    cast, and are returned by index: they are the only values rounding may change (every one of the
    2^16 patterns is checked in ``tests/dequant/test_dequant.py``).

    Args:
        x: ``bfloat16[...]``.
        out: optional ``float16`` destination with ``x.size`` elements (C-contiguous).
        stats: optional ``int64[2]``: adds the values that overflowed to inf and the non-zero values
            flushed to zero (:func:`count_f16_loss`, over the values by NumPy's cast: the only ones that can).

    Returns:
        ``(float16[x.size], intp[k])``: the values, flat, and the flat indices of the k values that
        went through NumPy's cast (all that were not exact in float16, or inf/NaN).
    """
    b = np.ascontiguousarray(x).reshape(-1).view(np.uint16)
    n = b.size
    y = (np.empty(n, np.float16) if out is None else out.reshape(-1)).view(np.uint16)
    size = min(n, PIECE)
    mag, nonzero, tmp = np.empty(size, np.uint16), np.empty(size, np.uint16), np.empty(size, np.uint16)
    ones, outside = np.ones(size, np.uint16), np.empty(size, np.bool_)
    others = []
    for s in range(0, n, PIECE):
        e = min(n, s + PIECE)
        k = e - s
        bs, ys, mg, nz, t, z = b[s:e], y[s:e], mag[:k], nonzero[:k], tmp[:k], outside[:k]
        np.bitwise_and(bs, 0x7FFF, out=mg)
        np.minimum(mg, ones[:k], out=nz)  # 0 for +-0 (a dequantized NF4 weight: 1 value in 16), else 1
        np.left_shift(bs, 3, out=ys)  # E << 10 | mantissa << 3, mod 2^16 ...
        np.multiply(nz, 16 << 10, out=t)
        np.add(ys, t, out=ys)  # ... + (16 << 10) = (E - 112) << 10 | mantissa << 3 for E in 113..142; 0 for +-0
        np.multiply(nz, 113 << 7, out=t)
        np.subtract(mg, t, out=mg)  # (wraps below E = 113) E in 113..142 -> [0, 30 << 7); +-0 -> 0
        np.greater_equal(mg, 30 << 7, out=z)
        np.bitwise_and(bs, 0x8000, out=t)
        np.bitwise_or(ys, t, out=ys)  # the sign
        if np.count_nonzero(z):
            others.append(np.flatnonzero(z) + s)
    rounded = np.concatenate(others) if others else np.empty(0, np.intp)
    if rounded.size:
        x32 = b[rounded].view(BF16).astype(np.float32)
        with np.errstate(over="ignore"):  # overflow to inf is the IEEE result
            y[rounded] = x32.astype(np.float16).view(np.uint16)
        if stats is not None:
            count_f16_loss(x32, y[rounded].view(np.float16), stats)
    return y.view(np.float16), rounded


def count_f16_loss(x: npt.NDArray[np.float32], y: npt.NDArray[np.float16], stats: npt.NDArray[np.int64]) -> None:
    """Add to ``stats`` [overflow to inf, non-zero flushed to zero] for fp32 ``x`` rounded to fp16 ``y``."""
    yb = y.view(np.uint16) & np.uint16(0x7FFF)
    stats[0] += int(np.count_nonzero((yb == 0x7C00) & np.isfinite(x)))
    stats[1] += int(np.count_nonzero((yb == 0) & (x != 0)))

"""Pure NumPy kernels: 4-bit dequantization, nested absmax, rounding to bf16/fp16. No I/O.

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

Speed: the codes of two bytes are looked up as a quad (one 16-byte gather per two bytes), the product is
one in-place multiply on a ``(n_blocks, blocksize)`` view, rounding to bf16 is ml_dtypes' cast in the
same ufunc call. fp16 goes by table (each block's 16 products rounded once, the codes pick from them),
the tables rounded by integer operations where the products are in float16's normal range (equal to
NumPy's cast on every pattern there) and by NumPy's cast elsewhere (NumPy's own cast equals an integer
round-to-nearest-even on all 2^32 float32 patterns: scripts/check_f16_cast.py; it is software on most
x86 builds, 4-7 ns a value). Work is cut into cache-sized pieces; each NumPy call is kept long enough
(tens of microseconds) that two threads overlap their calls: on a virtual machine, handing the GIL over
to a thread that waits for it costs about 10 microseconds, and two threads running calls of a few
microseconds each ran no faster than one.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import numpy.typing as npt

from formats.dtypes import BY_NAME

__all__ = [
    "BF16",
    "INT8_SCALE",
    "bf16_to_f16",
    "count_f16_loss",
    "dequantize_4bit",
    "dequantize_4bit_f16_of_bf16",
    "dequantize_int8",
    "dequantize_nested_absmax",
    "f16_bits_of_bf16",
    "f16_bits_of_signed",
    "float_output",
    "quad_lut",
    "signed_quad_lut",
    "round_float32",
    "unpack_4bit",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
#: Elements per inner piece: the fp32 temporaries (1 MiB) stay in L2 cache, and each NumPy call on a
#: piece takes tens of microseconds: with pieces of 2^16 two threads often ran no faster than one
#: (handing the GIL to a waiting thread costs ~10 us on a virtual machine); 2^18 made every path 4-20%
#: faster end to end on two threads, 2^20 was slower again (docs/performance.md).
PIECE = 1 << 18
#: Elements whose float16 table is made at once (:func:`_f16_table`): its NumPy calls long enough
#: (tens of microseconds) that two threads overlap them instead of waiting for each other's GIL.
TABLE_SPAN = 1 << 20


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


def quad_lut(quant_map: npt.NDArray[np.float32]) -> npt.NDArray[np.complex128]:
    """The 65536-entry table two packed bytes -> their four codes' ``quant_map`` values, made once per
    map (3 ms; cached, read-only).

    Args:
        quant_map: ``float32[16]``.

    Returns:
        ``complex128[65536]`` (a 16-byte carrier, never used as numbers): entry ``i`` is the float32
        values of the codes of byte ``i & 255`` (high nibble, low nibble) then of byte ``i >> 8``, so
        ``lut[packed.view("<u2")].view(float32)`` is the flat sequence of table values of ``packed`` (an
        even number of bytes), and ``lut[b]`` for a single byte ``b`` starts with its two values. One
        lookup per two bytes: NumPy's take costs about the same per item for 8 or 16 bytes.
    """
    return _quad_lut(np.asarray(quant_map, dtype=np.float32).reshape(16).tobytes())


@functools.lru_cache(maxsize=8)
def _quad_lut(quant_map: bytes) -> npt.NDArray[np.complex128]:
    qm = np.frombuffer(quant_map, dtype=np.float32)
    idx = np.arange(1 << 16)
    quads = np.empty((1 << 16, 4), dtype=np.float32)
    for j, shift in enumerate((4, 0, 12, 8)):  # byte 0's high and low nibbles, then byte 1's
        quads[:, j] = qm[(idx >> shift) & 15]
    lut = quads.view(np.complex128).reshape(1 << 16)
    lut.flags.writeable = False
    return lut


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


def _piece(blocksize: int) -> int:
    """Elements per inner piece of a 4-bit kernel: :data:`PIECE` rounded down to whole blocks (one at least)."""
    return max(blocksize, (PIECE // blocksize) * blocksize)


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
    piece = _piece(blocksize)
    if dt == np.float16:
        return _dequantize_4bit_f16(packed, absmax, quant_map, blocksize, n, out, stats, piece)
    lut = quad_lut(quant_map)
    quads = np.empty(min(piece, n) // 4 + 1, dtype=np.complex128)  # (a whole piece for a tiny tensor: an mmap)
    for s in range(0, n, piece):
        # the fp32 product written straight into the output: for bf16 the ufunc casts each buffer of
        # products as it goes (ml_dtypes' cast: round to nearest even), no separate pass
        _products_into(packed, absmax, lut, blocksize, s, min(n, s + piece), quads, out[s : s + piece])
    return out


def _products_into(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    lut: npt.NDArray[np.complex128],
    blocksize: int,
    s: int,
    e: int,
    quads: npt.NDArray[np.complex128],
    out: np.ndarray,
) -> None:
    """``out[:e - s] = fp32(quant_map[code] * absmax[block])`` for elements [s, e) (``s`` on a block),
    cast to ``out``'s dtype by the multiply (``casting="unsafe"``); ``quads``: scratch of at least
    ``(e - s) // 4 + 1`` items."""
    m = e - s
    src = packed[s // 2 : (e + 1) // 2]
    k = src.size // 2
    # (every uint16 indexes the 65536 entries: "wrap" changes no index and is NumPy's fastest take mode)
    np.take(lut, src[: 2 * k].view("<u2"), out=quads[:k], mode="wrap")
    if src.size > 2 * k:  # an odd byte at the end: its two values start its entry
        quads[k] = lut[src[-1]]
    vals = quads.view(np.float32)[:m]
    nb_full, b0 = m // blocksize, s // blocksize
    full = nb_full * blocksize
    if nb_full:
        np.multiply(vals[:full].reshape(nb_full, blocksize), absmax[b0 : b0 + nb_full, None],
                    out=out[:full].reshape(nb_full, blocksize), casting="unsafe")
    if m > full:
        np.multiply(vals[full:], absmax[b0 + nb_full], out=out[full:m], casting="unsafe")


def dequantize_4bit_f16_of_bf16(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    quant_map: npt.NDArray[np.float32],
    blocksize: int,
    n: int,
    out: npt.NDArray[np.float16] | None = None,
) -> npt.NDArray[np.float16] | None:
    """float16 of the bfloat16 dequantization, ``fp16(bf16(fp32(quant_map[code] * absmax[block])))``,
    when it is exact: the bits of :func:`bf16_to_f16` of :func:`dequantize_4bit` to bfloat16 (what
    ``convert_hf_to_gguf.py`` writes as F16 from the dequantized bf16 checkpoint), at the bf16
    kernel's cost plus one pass.

    When the signed-map route holds (:func:`_signed_route`: every non-zero product provably in
    ``[2^-14, 65280)``, no -0.0 in the map), each product is made from :func:`signed_quad_lut` and
    ``absmax * 2^-112`` (exactly ``x * 2^-112``, or ``x * 2^-80`` for a negative ``x``) and rounded to
    bfloat16 by the multiply (ml_dtypes' cast, as the bf16 kernel); :func:`f16_bits_of_bf16` then moves
    its bits into float16's: no second rounding, a bfloat16 of that range being exact in float16; the
    zero code gives +0, as the product does.

    Args: as :func:`dequantize_4bit` (``n`` codes from a block boundary; ``out``: optional ``float16[n]``).

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
    piece = _piece(blocksize)
    out = np.empty(n, np.float16) if out is None else out
    bits, rounded = out.view(np.uint16), out.view(BF16)
    quads = np.empty(min(piece, n) // 4 + 1, dtype=np.complex128)
    for s in range(0, n, piece):
        e = min(n, s + piece)
        _products_into(packed, scaled, lut, blocksize, s, e, quads, rounded[s:e])  # bfloat16, in place
        f16_bits_of_bf16(bits[s:e], bits[s:e])
    return out


def _dequantize_4bit_f16(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    quant_map: npt.NDArray[np.float32],
    blocksize: int,
    n: int,
    out: np.ndarray,
    stats: npt.NDArray[np.int64] | None,
    piece: int,
) -> np.ndarray:
    """:func:`dequantize_4bit` to float16, :data:`TABLE_SPAN` elements at a time, each span by one of two
    routes giving the bits of NumPy's cast of every fp32 product (round to nearest even):

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
                _products_into(packed[s0 // 2 :], scaled, lut, blocksize, s - s0, e - s0, quads, x)
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
        (their blocks'), ``piece`` elements at a time; ``stats`` as :func:`_dequantize_4bit_f16`."""
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
    return _quad_lut(np.where(q < 0, q * np.float32(2.0**32), q).astype(np.float32).tobytes())


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
    2^16 patterns is checked in ``tests/test_dequant.py``).

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

"""The GGML codec base class and the float32 helpers byte identity with ggml-quants.c needs.

:class:`Codec` is one GGML quantization type (``quantize``/``dequantize``); the table of codecs is
:data:`convert.gguf.codecs.CODECS`. Byte identity with llama.cpp's C reference quantizers needs
their float32 operation order, which the helpers give: :func:`nearest_int` (llama.cpp's
``nearest_int``: round half to even, valid for ``|x| < 2**22``), :func:`fp16_round`
(``GGML_FP32_TO_FP16`` and back: round to nearest even) and :func:`seq_sum` (a sequential float32
loop, not NumPy's pairwise ``sum``). No fused multiply-add: the x86-64 build of ``ggml-quants.c``
has none, and NumPy's ``a * b + c`` rounds twice as C does.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import gguf
import ml_dtypes
import numpy as np
import numpy.typing as npt

from convert.dequant.block_reduce import block_max_bits

__all__ = [
    "Measured",
    "abs_max",
    "sum_squares",
    "Codec",
    "bitmask",
    "HALF_DOWN",
    "block_minmax",
    "block_signed_absmax",
    "encode_by_chunks",
    "encode_into_by_chunks",
    "first_absmax",
    "fp16_bytes",
    "fp16_round",
    "inverse_scale",
    "nearest_int",
    "nearest_int_bits",
    "reduce_axis0_is_sequential",
    "reference_blocks",
    "round_half_away_abs_into",
    "select",
    "seq_sum",
    "seq_sum0",
]

GT = gguf.GGMLQuantizationType
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def nearest_int(x: F32) -> npt.NDArray[np.int32]:
    """llama.cpp's ``nearest_int``: float32 -> nearest int32, ties to even (``|x| < 2**22``)."""
    return np.rint(x).astype(np.int32)


def fp16_round(x: F32) -> F32:
    """float32 -> the float32 value of its float16 rounding (``GGML_FP32_TO_FP16`` round trip)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def seq_sum(x: F32, axis: int = -1) -> F32:
    """Sum along ``axis`` as a sequential float32 loop (``s = 0; for i: s += x[i]``), as C does.

    NumPy's ``np.sum`` adds pairwise, which rounds differently. Cost: one vector add per position
    along ``axis`` (16 or 32 for the K-quants), each over all the other axes at once.
    """
    x = np.moveaxis(np.asarray(x, dtype=np.float32), axis, 0)
    acc = np.zeros(x.shape[1:], dtype=np.float32)
    for row in x:
        acc += row
    return acc


class Measured(NamedTuple):
    """What :meth:`Codec.quantize_measured` gives: the encoded bytes and the error they add.

    Attributes:
        data: uint8 ``(rows, row bytes)``; None (or meaningless) when ``x`` holds inf or NaN.
        max_err: ``max |e|`` with ``e = dequantize(data) - x``, over the measured elements.
        sq_err: ``sum e^2`` over the measured elements (float32 dots: ~1e-6 relative).
        sq_ref: ``sum x^2`` over the measured elements; not finite when ``x`` holds inf or NaN
            anywhere (measured or not): the caller then checks ``x`` itself.
        measured: how many elements the three sums cover (``x.size`` unless sampled).
    """

    data: U8 | None
    max_err: float
    sq_err: float
    sq_ref: float
    measured: int


class Codec:
    """One GGML quantization type: ``quantize`` float32 rows, ``dequantize`` them back.

    Subclasses set :attr:`ggml_type`; the block size (elements) and type size (bytes per block)
    are gguf-py's ``GGML_QUANT_SIZES``. This base class encodes and decodes with gguf-py.
    """

    ggml_type: ClassVar[gguf.GGMLQuantizationType]
    #: Whether ``quantize`` uses an importance matrix (``weights``); the others ignore it, as ggml's
    #: ``ggml_quantize_chunk`` does for their types.
    uses_imatrix: ClassVar[bool] = False

    @classmethod
    def block_size(cls) -> int:
        """Elements per block."""
        return gguf.GGML_QUANT_SIZES[cls.ggml_type][0]

    @classmethod
    def type_size(cls) -> int:
        """Bytes per block."""
        return gguf.GGML_QUANT_SIZES[cls.ggml_type][1]

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(rows, n)`` -> uint8 ``(rows, n // block_size * type_size)``.

        ``weights``: the importance matrix row of the tensor (float32 ``(n,)``, the same for every row
        of the call, as ``ggml_quantize_chunk``'s ``quant_weights``) or None. Codecs with
        :attr:`uses_imatrix` encode with it; this base class ignores it.
        """
        data = np.ascontiguousarray(gguf.quants.quantize(np.asarray(x, dtype=np.float32), cls.ggml_type))
        return data.view(np.uint8)  # F32/F16 come back as float arrays: their bytes

    @classmethod
    def dequantize(cls, data: U8) -> F32:
        """uint8 ``(rows, nbytes)`` -> float32 ``(rows, nbytes // type_size * block_size)``."""
        return gguf.quants.dequantize(np.ascontiguousarray(data).view(np.uint8), cls.ggml_type)

    @classmethod
    def quantize_measured(cls, x: np.ndarray, sample: int = 1, start: int = 0, out: U8 | None = None,
                          weights: F32 | None = None) -> Measured:
        """:meth:`quantize` of ``x`` widened to float32 (exactly: float32, bfloat16 or float16 ``(rows, n)``)
        and the error it adds, ``e = dequantize(data) - x``, measured on all of ``x`` or a sample.

        Args:
            x: ``(rows, n)``, ``n`` a multiple of the block size (1-D: one row).
            sample: measure one piece in this many (1: every element). This base class measures the
                tensor's rows ``0, sample, 2 * sample, ...``; a codec that encodes in chunks measures
                chunks ``0, sample, ...`` of a fixed grid over the tensor.
            start: the flat index of ``x``'s first value in its tensor (a multiple of ``n``), which
                places ``x`` on the sample's grid: the same values are measured however the tensor
                is split into calls.
            out: optional uint8 ``(rows, n // block_size * type_size)`` (C-contiguous) the bytes are
                written into (e.g. memory placed for the writer); this base class copies them there.
            weights: the importance matrix row (float32 ``(n,)``) or None: :meth:`quantize`.

        Returns:
            :class:`Measured` (its ``data`` is ``out`` when given). This base class widens and sums ``x``
            whole (the inf/NaN check), then decodes the sampled rows of the result again.
        """
        x = np.asarray(x, dtype=np.float32)
        total = sum_squares(x)
        if not math.isfinite(total):
            return Measured(None, math.nan, math.nan, total, x.size)
        data = cls.quantize(x, weights)
        if out is not None:
            np.copyto(out, data.reshape(out.shape))
            data = out
        rows_x = x.reshape(-1, x.shape[-1] if x.ndim else 1)
        rows_d = data.reshape(rows_x.shape[0], -1)
        if sample > 1:
            skip = -(start // rows_x.shape[1]) % sample  # rows up to the tensor's next sampled row
            rows_x, rows_d = rows_x[skip::sample], rows_d[skip::sample]
            total = sum_squares(rows_x)
            if not rows_x.shape[0]:  # no sampled row here (gguf-py's dequantize refuses an empty array)
                return Measured(data, 0.0, 0.0, 0.0, 0)
        with np.errstate(invalid="ignore", over="ignore"):
            err = cls.dequantize(rows_d).reshape(rows_x.shape)
            err -= rows_x
        return Measured(data, abs_max(err), sum_squares(err), total, rows_x.size)


def abs_max(a: F32) -> float:
    """``max |a|`` of float32 ``a`` (0.0 when empty; NaN when ``a`` holds NaN)."""
    return float(max(a.max(), -a.min())) if a.size else 0.0


def sum_squares(a: F32) -> float:
    """``sum(a * a)``: one BLAS dot in float32 (relative error about 1e-6 over a chunk, ample for a
    3-digit report; inf or NaN when ``a`` holds them), redone in float64 when float32 overflows."""
    flat = np.ascontiguousarray(a).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(np.dot(flat, flat))
    if math.isinf(total) and bool(np.isfinite(flat).all()):
        total = float(np.square(flat, dtype=np.float64).sum())
    return total


def nearest_int_bits(x: F32) -> npt.NDArray[np.int32]:
    """llama.cpp's ``nearest_int`` bit for bit, for every float32 (also ``|x| >= 2**22``, inf, NaN).

    C adds ``12582912.f`` (``1.5 * 2**23``) in float32 and keeps the low 23 bits of the sum minus
    ``0x400000``; outside ``|x| < 2**22`` that is not a rounding, and this function gives the same
    value. Three vector passes (add, and, subtract), against two for :func:`nearest_int`.
    """
    v = np.asarray(x, dtype=np.float32) + np.float32(12582912.0)
    i = v.view(np.int32)
    i &= 0x007FFFFF
    i -= 0x00400000
    return i


def first_absmax(x: F32, axis: int = 0) -> tuple[F32, F32]:
    """``(amax, max)`` of C's ``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` loop.

    ``amax`` starts at 0, so ``max`` is the first element of largest ``|x|`` (its sign kept) and 0
    when every ``|x|`` is 0; a NaN never wins (``fabsf(NaN) > amax`` is false). ``x`` is float32
    ``(n, m)`` reduced over ``axis`` 0 (one group per column) or 1 (one per row); both results are
    float32 ``(m,)`` / ``(n,)``. Only the sign of ``max`` needs the position: columns holding both
    ``+amax`` and ``-amax`` (a tie) are resolved one by one, the rest from two comparisons.
    """
    x = np.asarray(x, dtype=np.float32)
    if axis == 1:
        x = x.T
    ax = np.abs(x)
    amax = np.fmax.reduce(ax, axis=0)
    amax[np.isnan(amax)] = 0
    has_pos = np.logical_or.reduce(x == amax, axis=0)
    has_neg = np.logical_or.reduce(x == -amax, axis=0)
    mx = select(has_pos, amax, -amax)
    tie = np.nonzero(has_pos & has_neg & (amax > 0))[0]
    if tie.size:
        sub = x[:, tie]
        first = np.argmax(np.abs(sub) == amax[tie], axis=0)
        mx[tie] = sub[first, np.arange(tie.size)]
    mx[amax == 0] = 0
    return amax, mx


def seq_sum0(x: F32) -> F32:
    """:func:`seq_sum` over axis 0 of a C-contiguous float32 ``(n, m)``, faster when ``m >= 2``.

    NumPy reduces axis 0 of such an array row by row (its inner loop runs along the contiguous axis,
    one elementwise add per row), which is C's order; pairwise summation only happens along a
    reduced inner axis. :func:`reduce_axis0_is_sequential` checks that once, and with
    ``m < 2`` (where the reduced axis may become the inner loop) or if the check failed this falls
    back to the explicit loop. The first add is ``x[0]`` rather than ``0.0f + x[0]``: only the sign
    of a zero sum can differ, and the encoders here never let that sign reach their output.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 2 and x.shape[1] >= 2 and reduce_axis0_is_sequential():
        return np.add.reduce(x, axis=0)
    return seq_sum(x, axis=0)


@functools.cache
def reduce_axis0_is_sequential() -> bool:
    """Whether ``np.add.reduce(axis=0)`` adds rows in order, on values that tell pairwise apart and
    the shapes the encoders use; checked on first use (~50 ms), then remembered."""
    rng = np.random.default_rng(0)
    for n, m in ((16, 2), (32, 3), (32, 512), (16, 4096), (16, 16384)):
        a = (rng.standard_normal((n, m)) * 10.0 ** rng.uniform(-8, 8, (n, m))).astype(np.float32)
        if not np.array_equal(np.add.reduce(a, axis=0), seq_sum(a, axis=0)):
            return False
    return True


def bitmask(mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.int32]:
    """bool -> int32 all-ones / all-zeros: the mask :func:`select` takes, made once for several."""
    m = mask.view(np.uint8).astype(np.int32)
    np.negative(m, out=m)
    return m


def select(mask: npt.NDArray[np.bool_] | npt.NDArray[np.int32], a: F32, b: F32) -> F32:
    """``np.where(mask, a, b)`` for float32 arrays of one shape, by bit masks: every bit kept.

    NumPy's ``where`` (and ``copyto(where=)``) branches per element, which costs ~10 ns an element
    on the random masks of the trial loops; this is three branch-free vector passes (five when
    ``mask`` is bool rather than a :func:`bitmask`).
    """
    m = mask if mask.dtype == np.int32 else bitmask(mask.astype(np.bool_, copy=False))
    ai = np.asarray(a, dtype=np.float32).view(np.int32)
    bi = np.asarray(b, dtype=np.float32).view(np.int32)
    r = ai ^ bi
    r &= m
    r ^= bi
    return r.view(np.float32)


def encode_by_chunks(x: F32, block: int, type_size: int, encode: Callable[[F32], U8], chunk: int) -> U8:
    """Run a block encoder over float32 ``(..., n)`` (``n % block == 0``) ``chunk`` blocks at a time.

    ``encode``: float32 ``(blocks, block)`` -> uint8 ``(blocks, type_size)``, blocks independent.
    Returns uint8 ``(..., n // block * type_size)`` (gguf-py's ``quantize`` shape); NumPy's
    floating-point warnings are off inside (inf/NaN arithmetic is part of C's behaviour).

    Raises:
        ValueError: ``x`` is 0-D or its last axis is not a multiple of ``block``.
    """

    def into(xb: F32, ob: U8) -> None:
        ob[...] = encode(xb)

    return encode_into_by_chunks(x, block, type_size, into, chunk)


def encode_into_by_chunks(
    x: F32, block: int, type_size: int, encode_into: Callable[[F32, U8], object], chunk: int, first: int = 0,
    out: U8 | None = None, widen: bool = True,
) -> U8:
    """:func:`encode_by_chunks` for an encoder that writes its blocks in place.

    ``encode_into(xb, ob)``: float32 ``(blocks, block)`` (``blocks <= chunk``) -> fills uint8
    ``(blocks, type_size)`` ``ob``, a slice of the output (no per-chunk result array, no copy); what
    it returns is ignored. ``x`` may be bfloat16 or float16: each chunk is widened (exactly) into one
    float32 scratch, in cache, instead of the whole array into a float32 copy; with ``widen`` False the
    chunks of such an ``x`` are handed over as they are (an encoder that reads their bits). ``first``: blocks of a
    grid of ``chunk``-block chunks that lie before ``x`` (its offset in a larger tensor): the chunks are
    cut on that grid (the first may be shorter), so they are the same pieces however the tensor is split.
    ``out``: optional C-contiguous uint8 array of the result's size to encode into (returned, reshaped).

    Raises:
        ValueError: ``x`` is 0-D or its last axis is not a multiple of ``block``.
    """
    x = np.ascontiguousarray(x)
    if x.dtype not in _WIDENED:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % block:
        raise ValueError(f"expected float32 (..., n) with n a multiple of {block}, got {x.shape}")
    flat = x.reshape(-1, block)
    out = np.empty((flat.shape[0], type_size), dtype=np.uint8) if out is None else out.reshape(-1, type_size)
    scratch = None if x.dtype == np.float32 or not widen else np.empty((min(chunk, flat.shape[0]), block), np.float32)
    with np.errstate(all="ignore"):
        n = flat.shape[0]
        cuts = [0, *range(-first % chunk or chunk, n, chunk), n] if n else []  # the grid's lines in x, its ends
        for s, e in itertools.pairwise(cuts):
            xb = flat[s:e]
            if scratch is not None:
                wide = scratch[: xb.shape[0]]
                np.copyto(wide, xb, casting="unsafe")
                xb = wide
            encode_into(xb, out[s:e])
    return out.reshape(*x.shape[:-1], x.shape[-1] // block * type_size)


#: Input dtypes :func:`encode_into_by_chunks` widens chunk by chunk (float32 itself, and the two whose
#: float32 values are exact); any other is converted whole first.
_WIDENED = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


def block_signed_absmax(xb: F32, scratch: npt.NDArray[np.int32]) -> F32:
    """gguf-py's ``take_along_axis(x, abs(x).argmax(axis=1))`` (C: the first ``x[i]`` of largest
    ``|x[i]|``, sign kept) of float32 ``(blocks, block)`` without NaN -> float32 ``(blocks,)``.

    Two :func:`block_max_bits` trees, no abs pass: the int32 max of the bit patterns is the largest
    non-negative value (negative if none), the uint32 max the negative value of largest magnitude
    (below ``2**31`` if none). Rows holding both ``+a`` and ``-a`` at the top magnitude (and rows
    of ±0 holding both zeros) are resolved by ``argmax`` on those rows only.
    """
    n = xb.shape[0]
    bits = xb.reshape(-1).view(np.int32)
    pos = block_max_bits(bits, n, scratch)
    neg = block_max_bits(bits.view(np.uint32), n, scratch).view(np.int32)
    pos_mag = np.where(pos >= 0, pos, -1)
    neg_mag = np.where(neg < 0, neg & np.int32(0x7FFFFFFF), -1)
    mx = np.where(pos_mag >= neg_mag, pos, neg).view(np.float32)
    tie = np.nonzero(pos_mag == neg_mag)[0]
    if tie.size:
        sub = xb[tie]
        mx[tie] = sub[np.arange(tie.size), np.abs(sub).argmax(axis=1)]
    return mx


def block_minmax(xb: F32, scratch: npt.NDArray[np.int32]) -> tuple[F32, F32]:
    """``(x.min(axis=1), x.max(axis=1))`` of float32 ``(blocks, block)`` without NaN, each float32
    ``(blocks,)``, by two :func:`block_max_bits` trees on order-preserving int32 keys
    (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``, the min as the max of the negated keys' complement).

    Which zero NumPy's ``min``/``max`` return when a row holds both +0.0 and -0.0 and the result is
    a zero is NumPy's business; here -0.0 orders below +0.0, so callers that need NumPy's sign of
    a zero result hand those rows to :func:`reference_blocks`.
    """
    n, size = xb.shape[0], xb.size
    bits = xb.reshape(-1).view(np.int32)
    key = np.right_shift(bits, 31, out=scratch[:size])
    key &= np.int32(0x7FFFFFFF)
    key ^= bits
    mx = block_max_bits(key, n, scratch)
    np.invert(key, out=key)  # ~k orders the other way, without the overflow of -k
    mn = block_max_bits(key, n, scratch)
    np.invert(mn, out=mn)
    for k in (mx, mn):
        k ^= (k >> 31) & np.int32(0x7FFFFFFF)
    return mn.view(np.float32), mx.view(np.float32)


def inverse_scale(d: F32) -> tuple[F32, npt.NDArray[np.bool_]]:
    """gguf-py's ``id = np.where(d == 0, 0, 1 / d)`` (float32 ``(m,)``) and the rows it cannot
    encode the fast way: ``d`` or ``id`` not finite (``1 / d`` overflows for ``d < 2**-128``, a
    ``max - min`` overflows), found as ``id * d`` not finite (0 for ``d == 0``, about 1 otherwise);
    there the reference's arithmetic goes through inf/NaN and its integer casts of NaN are NumPy's
    own business, so those rows are left to :func:`reference_blocks`. Call it with NumPy's
    floating-point warnings off (:func:`encode_into_by_chunks` does)."""
    inv = np.divide(np.float32(1), d)
    inv[d == 0] = 0
    return inv, ~np.isfinite(inv * d)


def reference_blocks(ggml_type: gguf.GGMLQuantizationType, xb: F32, ob: U8, rows: npt.NDArray[np.bool_]) -> None:
    """Overwrite ``ob[rows]`` with gguf-py's encoding of ``xb[rows]`` (the rare rows of
    :func:`inverse_scale`): float32, bfloat16 or float16 ``(blocks, block)`` (widened exactly), uint8
    ``(blocks, type_size)``, bool ``(blocks,)``."""
    if np.count_nonzero(rows):  # (C-level: ndarray.any() goes through a Python wrapper, per chunk)
        wide = np.ascontiguousarray(xb[rows], dtype=np.float32)
        ob[rows] = gguf.quants.quantize(wide, ggml_type).reshape(-1, ob.shape[1])


#: The float32 just below 0.5 (``0.5 - 2**-25``): ``trunc(|v| + HALF_DOWN)`` rounds ``|v|`` half away from zero.
HALF_DOWN = np.float32(0.49999997)


def round_half_away_abs_into(a: F32) -> F32:
    """``a += 0.49999997`` in place, for float32 ``a >= 0`` (magnitudes): its truncation toward zero is gguf-py's
    ``np_roundf(a)`` (round half away from zero) for every finite non-negative float32, and for a signed ``v``
    ``np_roundf(v)`` is ``trunc(|v| + 0.49999997)`` with ``v``'s sign (float32 rounding is symmetric in sign, so
    ``|x| * s`` is ``|x * s|`` for ``s >= 0``). Returns ``a``.

    Why exact (``c = 0.5 - 2**-25``, sums rounded to nearest even): for ``a < 0.5``, ``a <= 0.5 - 2**-25`` and
    ``a + c <= 1 - 2**-24`` (exact or rounded down) truncates to 0; for ``a = k + 0.5`` the exact sum
    ``k + 1 - 2**-25`` is within half an ulp of ``k + 1`` (a tie only at ``k = 0``, which rounds to the even 1.0)
    and truncates to ``k + 1``; otherwise ``a`` is at least one ulp (``>= 2**-24``) from ``k + 0.5`` and ``a + c``
    rounds within ``[k, k + 1)`` or ``[k + 1, k + 2)`` as ``a`` is below or above ``k + 0.5``; for ``a >= 2**23``
    (integers) ``c`` is under half an ulp and the sum is ``a``. ``tests/gguf/codecs/test_legacy.py`` checks every
    float32 in ``[0, 4)`` and the neighbours of every ``k + 0.5`` up to ``2**24``, both signs.
    """
    a += HALF_DOWN
    return a


def fp16_bytes(x: F32) -> U8:
    """float32 ``(m,)`` -> uint8 ``(m, 2)``: little-endian ``GGML_FP32_TO_FP16`` of each value.

    ggml-base converts in software (``ggml_compute_fp32_to_fp16``): round to nearest even, as
    NumPy's ``float16``, except that every NaN becomes ``sign | 0x7e00`` where NumPy keeps payload
    bits.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    with np.errstate(over="ignore"):
        h = x.astype("<f2").view("<u2")
    nan = np.isnan(x)
    if nan.any():
        h[nan] = ((x[nan].view(np.uint32) >> 16) & 0x8000).astype(np.uint16) | 0x7E00
    return h.view(np.uint8).reshape(-1, 2)

"""NumPy encoders of the legacy GGML types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, byte-identical to gguf-py's (and,
with an importance matrix, to ggml's C ``quantize_row_*_impl``).

gguf-py's ``gguf/quants.py`` reproduces llama.cpp's ``quantize_row_q8_0_ref`` (``ggml-quants.c``) in
about twelve whole-array passes (abs, max, divide, where, multiply, ``np_roundf``'s five to seven,
astype, concatenate), ~9 ns a value, and the others similarly (NumPy's reductions over rows of 32
alone cost ~2 ns a value). Here each chunk of blocks (:data:`CHUNK_BLOCKS`) goes through
about six cheap passes with preallocated scratch, and the result is written straight into the
output array.

Block layouts (little-endian; a block is 32 consecutive values of a row):

- Q8_0, 34 bytes: ``d`` float16 (2 bytes), then ``qs`` 32 × int8; ``x[i] ~= d * qs[i]`` with
  ``d = max|x| / 127`` and ``qs[i] = roundf(x[i] / d)`` (round half away from zero), 0 when ``d == 0``.
- Q4_0, 18 bytes: ``d`` float16, ``qs`` 16 bytes, byte ``j`` = ``q[j] | q[j + 16] << 4``;
  ``x[i] ~= d * (q[i] - 8)``, ``d = max / -8`` with ``max`` the first ``x`` of largest ``|x|``, and
  ``q = min(15, trunc(x * id + 8.5))``.
- Q4_1, 20 bytes: ``d``, ``m`` float16, ``qs`` 16 bytes as Q4_0; ``x[i] ~= d * q[i] + m``,
  ``m = min x``, ``d = (max x - m) / 15``, ``q = min(15, trunc((x - m) * id + 0.5))``.
- Q5_0, 22 bytes: ``d`` float16, ``qh`` uint32 (bit ``i`` = bit 4 of ``q[i]``), ``qs`` 16 bytes of
  the low nibbles as Q4_0; ``x[i] ~= d * (q[i] - 16)``, ``d = max / -16``,
  ``q = min(31, trunc(x * id + 16.5))``.
- Q5_1, 24 bytes: ``d``, ``m`` float16, ``qh``, ``qs`` as Q5_0; ``d = (max x - m) / 31``,
  ``q = min(31, trunc((x - m) * id + 0.5))``.

``id`` is ``1 / d``, or 0 when ``d == 0``, everywhere.

Identity with gguf-py, value for value: the same float32 operations in the same order (``d`` the
float32 quotient, ``id = 1 / d`` or 0, the products and sums in gguf-py's order), the same
``float16`` conversion of ``d`` and ``m``, Q8_0's rounding of each magnitude by
:func:`convert.gguf.codecs.base.round_half_away_abs_into` (equal to ``np_roundf`` for every finite
float32) and its sign put back in int8, and the others' float -> uint8 truncation by NumPy's cast, as gguf-py.
Q8_0 reads bfloat16 and float16 input as it is (no widened copy): the block maxima from the 16-bit
magnitudes' bits, the products of the magnitudes widened by the multiply itself. The block maxima come
from :func:`convert.dequant.block_reduce.block_max_bits` trees (Q8_0's by ``block_magnitudes``,
:func:`convert.gguf.codecs.base.block_signed_absmax`, :func:`~convert.gguf.codecs.base.block_minmax`), equal
to NumPy's reductions. Rare blocks are handed to gguf-py itself
(:func:`convert.gguf.codecs.base.reference_blocks`): those whose ``d`` or ``id`` is not finite (``d < 2**-128``,
a block of subnormals; ``max - min`` overflowing), where the reference casts NaN to an integer and we might cast
inf (the same byte on x86-64, but NumPy does not promise it), and for Q4_1/Q5_1 those whose min or max is a zero
(the sign of the zero NumPy's ``min``/``max`` return when a block holds both is NumPy's choice).

With an importance matrix (``weights``, llama-quantize --imatrix), Q4_0, Q4_1, Q5_0 and Q5_1 take the levels
of llama.cpp's weighted scale search (:mod:`convert.gguf.codecs.legacy_imatrix`); Q8_0 ignores the weights, as C.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import gguf
import numpy as np
import numpy.typing as npt

from convert.dequant.block_reduce import block_magnitudes
from convert.gguf.codecs.base import (
    Codec,
    Measured,
    abs_max,
    block_minmax,
    block_signed_absmax,
    encode_into_by_chunks,
    fp16_bytes,
    inverse_scale,
    reference_blocks,
    round_half_away_abs_into,
    sum_squares,
)
from convert.gguf.codecs.legacy_imatrix import imatrix_blocks, row_sigma2, weighted_levels

__all__ = [
    "CHUNK_BLOCKS",
    "SAMPLE_BLOCKS",
    "Q4_0Codec",
    "Q4_1Codec",
    "Q5_0Codec",
    "Q5_1Codec",
    "Q8_0Codec",
]

GT = gguf.GGMLQuantizationType
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

#: Blocks of 32 values per chunk (1 MiB of float32 input; scratch ~4.8 MiB). Each chunk is ~25 NumPy
#: calls, and between two calls a thread needs the GIL: with two threads, 4096 blocks held it about half
#: the wall time (py-spy --gil) and the threads waited for each other. On a 2 MiB-L2 EPYC, 8192 ran q8_0
#: in 0.83x the wall time of 4096 on two threads (0.90x the CPU) and 0.90x on one; 16384 in 1.09x on one.
CHUNK_BLOCKS = 8192
#: Blocks of the error sample's pieces (131,072 values; README), two to a chunk.
SAMPLE_BLOCKS = 4096

QK = 32

class _Work(NamedTuple):
    """Per-call scratch, reused by every chunk: int32 ``(1.75 * CHUNK_BLOCKS * 32,)`` for the block
    maxima, float32 ``(CHUNK_BLOCKS, 32)`` ``v`` and ``t``, uint8 ``(CHUNK_BLOCKS, 32)`` ``q``,
    little-endian uint64 ``(CHUNK_BLOCKS, 4)`` ``h`` and ``(CHUNK_BLOCKS, 2)`` ``p`` (8 levels a word). Q8_0 reads
    ``t``'s bytes as the bool sign of each value."""

    ints: npt.NDArray[np.int32]
    v: F32
    t: F32
    q: U8
    h: npt.NDArray[np.uint64]
    p: npt.NDArray[np.uint64]


def _fp16_into(d: F32, ob: U8, byte: int) -> None:
    """Write float32 ``(blocks,)`` as little-endian float16 at byte offset ``byte`` (even) of each row
    of uint8 ``(blocks, type_size)`` (``type_size`` even; NumPy's float16 cast, as gguf-py's
    ``astype(np.float16)``: round to nearest even, inf on overflow)."""
    ob.view("<f2")[:, byte // 2] = d


class _LegacyCodec(Codec):
    """Chunked encoding with scratch reused across chunks; subclasses give :meth:`_encode_into`."""

    #: Whether :meth:`_encode_into` takes bfloat16 and float16 chunks as they are (else they are widened to
    #: float32 first: :func:`convert.gguf.codecs.base.encode_into_by_chunks`).
    reads_16_bit: ClassVar[bool] = False

    @classmethod
    def _encode_into(cls, xb: F32, ob: U8, w: _Work) -> npt.NDArray[np.bool_]:
        """Encode float32 ``(blocks, 32)`` (bfloat16 or float16 too with :attr:`reads_16_bit`) into uint8
        ``(blocks, type_size)`` (``blocks <= CHUNK_BLOCKS``).

        Returns:
            bool ``(blocks,)``: the rows encoded by gguf-py's reference instead (:func:`reference_blocks`).
        """
        raise NotImplementedError

    @classmethod
    def _chunk_error(cls, xb: F32, ob: U8, w: _Work, bad: npt.NDArray[np.bool_]) -> F32:
        """``dequantize(ob) - xb`` of a piece of the chunk just encoded by :meth:`_encode_into` (which returned
        ``bad``; ``w``'s arrays start at the piece's first block): here by decoding it again while in cache."""
        err = cls.dequantize(ob).reshape(xb.shape)
        err -= xb
        return err

    @classmethod
    def _encode_weighted_into(cls, xb: F32, ob: U8, w: _Work, qw: F32, sigma2: F32) -> npt.NDArray[np.bool_]:
        """:meth:`_encode_into` with an importance matrix: ``qw`` float32 ``(blocks, 32)`` the imatrix values of
        each block's columns, ``sigma2`` float32 ``(blocks,)`` the mean square of each block's row
        (:func:`~convert.gguf.codecs.legacy_imatrix.row_sigma2`). Only codecs with :attr:`uses_imatrix` implement it.

        Returns:
            bool ``(blocks,)``: the blocks of rows whose ``sigma2`` is not finite (inf/NaN in the row, or
            ``x * x`` overflowing), which :meth:`quantize_measured` checks for inf/NaN.
        """
        raise NotImplementedError

    @classmethod
    def _chunk_encoder(
        cls, x: np.ndarray, weights: F32 | None, w: _Work,
    ) -> Callable[[F32, U8, int], npt.NDArray[np.bool_]]:
        """The encoder of the chunks of ``x`` (``(..., n)``): ``(xb, ob, first) -> bad`` with ``first`` the index of
        ``xb``'s first block in ``x``; :meth:`_encode_into`, or :meth:`_encode_weighted_into` with ``weights``
        when the codec uses them (``quantize_q4_0`` & co. take ``quantize_row_*_impl``'s weighted path then).

        Raises:
            ValueError: ``weights`` is not float32-convertible ``(n,)``, or ``n`` not a multiple of 32.
        """
        if weights is None or not cls.uses_imatrix:
            return lambda xb, ob, first: cls._encode_into(xb, ob, w)
        x = np.asarray(x)
        n = x.shape[-1] if x.ndim else 0
        qw = imatrix_blocks(weights, n, QK)
        sigma2 = row_sigma2(x.reshape(-1, n))
        nb = n // QK

        def encode(xb: F32, ob: U8, first: int) -> npt.NDArray[np.bool_]:
            row, pos = np.divmod(np.arange(first, first + xb.shape[0]), nb)
            return cls._encode_weighted_into(xb, ob, w, qw[pos], sigma2[row])

        return encode

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(rows, n)`` (``n % 32 == 0``) -> uint8 ``(rows, n // 32 * type_size)``; ``weights``: the
        importance matrix row (float32 ``(n,)``, :meth:`Codec.quantize`) or None.

        Raises:
            ValueError: ``n`` is not a multiple of 32, or ``weights`` (used) is not ``(n,)``.
        """
        encode = cls._chunk_encoder(x, weights, _work())
        done = 0

        def into(xb: F32, ob: U8) -> None:
            nonlocal done
            encode(xb, ob, done)
            done += xb.shape[0]

        return encode_into_by_chunks(x, QK, cls.type_size(), into, CHUNK_BLOCKS, widen=not cls.reads_16_bit)

    @classmethod
    def quantize_measured(cls, x: np.ndarray, sample: int = 1, start: int = 0, out: U8 | None = None,
                          weights: F32 | None = None) -> Measured:
        """:meth:`Codec.quantize_measured`: each chunk of :data:`CHUNK_BLOCKS` blocks (on a grid from the
        tensor's first value: ``start``) widened to float32 (a 16-bit chunk read as it is with
        :attr:`reads_16_bit`) and encoded (with ``weights``, the importance matrix row, as :meth:`quantize`);
        the tensor's pieces of :data:`SAMPLE_BLOCKS` blocks (on the same
        grid) ``0, sample, 2 * sample, ...`` also summed and their error (:meth:`_chunk_error`) measured
        while in cache. inf/NaN rows go to the reference encoder (:func:`reference_blocks`; with weights,
        their ``sigma2`` is not finite), which is how an unmeasured piece's inf/NaN is seen: every block
        holding one has a ``d`` or ``1 / d`` that is not finite."""
        w = _work()
        encode = cls._chunk_encoder(x, weights, w)
        max_err = sq_err = sq_ref = 0.0
        measured = 0
        block = start // QK  # the next chunk's first block, counted from the tensor's start
        finite = True

        def into(xb: F32, ob: U8) -> None:
            nonlocal max_err, sq_err, sq_ref, measured, block, finite
            first, n = block, xb.shape[0]
            block += n
            bad = encode(xb, ob, first - start // QK)
            if np.count_nonzero(bad):  # inf/NaN in a piece not measured (a measured one's sums show it)
                rows = np.flatnonzero(bad)
                rows = rows[~np.isfinite(xb[rows].astype(np.float32)).all(axis=1)] + first
                if np.count_nonzero((rows // SAMPLE_BLOCKS) % sample):
                    finite = False
            for p in range(first // SAMPLE_BLOCKS, -(-(first + n) // SAMPLE_BLOCKS)):
                if p % sample:
                    continue
                a, b = max(first, p * SAMPLE_BLOCKS) - first, min(first + n, (p + 1) * SAMPLE_BLOCKS) - first
                piece = xb[a:b].astype(np.float32, copy=False)  # (a 16-bit chunk read as it is: widened here)
                sq_ref += sum_squares(piece)
                err = cls._chunk_error(piece, ob[a:b], w._replace(v=w.v[a:], t=w.t[a:]), bad[a:b])
                max_err = max(max_err, abs_max(err))
                sq_err += sum_squares(err)
                measured += err.size

        data = encode_into_by_chunks(x, QK, cls.type_size(), into, CHUNK_BLOCKS, first=start // QK, out=out,
                                     widen=not cls.reads_16_bit)
        return Measured(data, max_err, sq_err, sq_ref if finite else math.nan, measured)


def _work() -> _Work:
    """Scratch for :meth:`_LegacyCodec._encode_into`, one per call of a codec (threads each have theirs)."""
    return _Work(
        np.empty(CHUNK_BLOCKS * QK * 7 // 4, dtype=np.int32),
        np.empty((CHUNK_BLOCKS, QK), dtype=np.float32),
        np.empty((CHUNK_BLOCKS, QK), dtype=np.float32),
        np.empty((CHUNK_BLOCKS, QK), dtype=np.uint8),
        np.empty((CHUNK_BLOCKS, 4), dtype="<u8"),
        np.empty((CHUNK_BLOCKS, 2), dtype="<u8"),
    )


class Q8_0Codec(_LegacyCodec):
    """Q8_0: gguf-py's ``Q8_0.quantize_blocks`` (llama.cpp ``quantize_row_q8_0_ref``) and
    ``Q8_0.dequantize_blocks``, byte for byte and bit for bit; float32, bfloat16 or float16 input."""

    ggml_type: ClassVar[gguf.GGMLQuantizationType] = GT.Q8_0
    reads_16_bit: ClassVar[bool] = True

    @classmethod
    def _encode_into(cls, xb: F32, ob: U8, w: _Work) -> npt.NDArray[np.bool_]:
        """gguf-py's ``d = max|x| / 127``, ``qs = np_roundf(x * (1 / d or 0))`` by magnitudes: those of ``xb``
        (float32, bfloat16 or float16) and their block maxima in ``w.ints``
        (:func:`convert.dequant.block_reduce.block_magnitudes`), the magnitudes
        (widened to float32 by the multiply itself) times ``1 / d`` rounded half away as magnitudes
        (:func:`convert.gguf.codecs.base.round_half_away_abs_into`), truncated to bytes in ``w.q``, and each
        negative value's byte negated in int8 (``(q ^ -s) + s`` with ``s`` 1 for a set sign bit; -0.0 gives
        0 as gguf-py). ~2.0 ns a value on 16-bit input where widening first and rounding signed values took ~2.6.
        """
        n, size = xb.shape[0], xb.size
        mags, d = block_magnitudes(xb, n, w.ints)
        d /= np.float32(127)
        inv, bad = inverse_scale(d)
        v = np.multiply(mags.reshape(n, QK), inv[:, None], out=w.v[:n], dtype=np.float32)
        round_half_away_abs_into(v)
        q = w.q[:n].view(np.int8)
        np.copyto(q, v, casting="unsafe")  # truncation toward zero: 0..127
        negative = np.less(xb.reshape(-1).view(f"i{xb.itemsize}"), 0, out=w.t.reshape(-1).view(np.bool_)[:size])
        s = negative.view(np.int8).reshape(n, QK)
        q ^= np.negative(s)
        q += s
        ob[:, 2:] = q.view(np.uint8)
        _fp16_into(d, ob, 0)
        reference_blocks(cls.ggml_type, xb, ob, bad)
        return bad

    @classmethod
    def dequantize(cls, data: U8) -> F32:
        """uint8 ``(rows, n // 32 * 34)`` -> float32 ``(rows, n)``: ``float32(qs) * float32(d)``."""
        data = np.ascontiguousarray(data).view(np.uint8)
        blocks = data.reshape(-1, 34)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        out = np.empty((blocks.shape[0], QK), dtype=np.float32)
        np.multiply(blocks[:, 2:].view(np.int8), d, out=out, dtype=np.float32)
        return out.reshape(*data.shape[:-1], data.shape[-1] // 34 * QK)


class _Legacy45(_LegacyCodec):
    """Q4_0, Q4_1, Q5_0, Q5_1: gguf-py's ``quantize_blocks`` of those types (llama.cpp
    ``quantize_row_q4_0_ref`` etc.); decoding stays gguf-py's."""

    bits: ClassVar[int]
    with_min: ClassVar[bool]  # Q4_1/Q5_1: d = (max - min) / nmax and m = min; else d = max / -2**(bits-1)

    @classmethod
    def _encode_into(cls, xb: F32, ob: U8, w: _Work) -> npt.NDArray[np.bool_]:
        n = xb.shape[0]
        nmax = (1 << cls.bits) - 1
        v = w.v[:n]
        if cls.with_min:
            mn, mx = block_minmax(xb, w.ints)
            d = (mx - mn) / np.float32(nmax)
            inv, bad = inverse_scale(d)
            bad |= (mn == 0) | (mx == 0)
            np.subtract(xb, mn[:, None], out=v)
            v *= inv[:, None]
            v += np.float32(0.5)
            _fp16_into(mn, ob, 2)
            at = 4
        else:
            half = 1 << (cls.bits - 1)
            d = block_signed_absmax(xb, w.ints) / np.float32(-half)
            inv, bad = inverse_scale(d)
            np.multiply(xb, inv[:, None], out=v)
            v += np.float32(half + 0.5)
            at = 2
        _fp16_into(d, ob, 0)
        np.minimum(v, np.float32(nmax), out=v)  # = gguf-py's clip after the cast: v >= 0 here
        q = w.q[:n]
        np.copyto(q, v, casting="unsafe")  # truncation toward zero, as np.trunc + astype(uint8)
        cls._pack_into(q, ob, at, w)
        reference_blocks(cls.ggml_type, xb, ob, bad)
        return bad

    @classmethod
    def _pack_into(cls, q: U8, ob: U8, at: int, w: _Work) -> None:
        """Write the levels ``q`` (uint8 ``(blocks, 32)``, C-contiguous, below ``2**bits``; clobbered) at byte
        ``at`` of each row of ``ob``: Q5's ``qh`` (bit 4 of each level), then the nibbles (byte ``j``:
        ``q[j] | q[j + 16] << 4``)."""
        n = q.shape[0]
        q8 = q.view("<u8")  # (n, 4): byte j of a block is bits 8j..8j+7 of word j // 8
        if cls.bits == 5:
            h = np.right_shift(q8, np.uint64(4), out=w.h[:n])
            h &= np.uint64(0x0101010101010101)  # bit 4 of every q, one per byte
            h *= np.uint64(0x0102040810204080)  # gathers byte i's bit to bit 56 + i, no carries
            h >>= np.uint64(56)
            ob[:, at : at + 4] = h  # = np.packbits(q >> 4, bitorder="little")
            at += 4
            q8 &= np.uint64(0x0F0F0F0F0F0F0F0F)
        p = np.left_shift(q8[:, 2:], np.uint64(4), out=w.p[:n])  # q[j + 16] << 4, no carry: q[j] < 16
        p |= q8[:, :2]
        ob[:, at : at + 16] = p.view(np.uint8)

    @classmethod
    def _encode_weighted_into(cls, xb: F32, ob: U8, w: _Work, qw: F32, sigma2: F32) -> npt.NDArray[np.bool_]:
        """``quantize_row_q{4,5}_{0,1}_impl`` with ``quant_weights``: the levels, ``d`` (and ``m``) of llama.cpp's
        weighted search (:func:`convert.gguf.codecs.legacy_imatrix.weighted_levels`), ``d`` and ``m`` stored by
        :func:`fp16_bytes` (ggml's conversion, NaN included)."""
        q = w.q[: xb.shape[0]]
        nmax = (1 << cls.bits) - 1 if cls.with_min else 1 << (cls.bits - 1)
        d, mn = weighted_levels(xb, qw, sigma2, nmax, cls.with_min, q)
        ob[:, 0:2] = fp16_bytes(d)
        at = 2
        if cls.with_min:
            ob[:, 2:4] = fp16_bytes(mn)
            at = 4
        cls._pack_into(q, ob, at, w)
        return ~np.isfinite(sigma2)


class Q4_0Codec(_Legacy45):
    """Q4_0: gguf-py's ``Q4_0.quantize_blocks`` (llama.cpp ``quantize_row_q4_0_ref``), byte for byte."""

    ggml_type: ClassVar[gguf.GGMLQuantizationType] = GT.Q4_0
    uses_imatrix: ClassVar[bool] = True
    bits = 4
    with_min = False


class Q4_1Codec(_Legacy45):
    """Q4_1: gguf-py's ``Q4_1.quantize_blocks`` (llama.cpp ``quantize_row_q4_1_ref``), byte for byte."""

    ggml_type: ClassVar[gguf.GGMLQuantizationType] = GT.Q4_1
    uses_imatrix: ClassVar[bool] = True
    bits = 4
    with_min = True


class Q5_0Codec(_Legacy45):
    """Q5_0: gguf-py's ``Q5_0.quantize_blocks`` (llama.cpp ``quantize_row_q5_0_ref``), byte for byte."""

    ggml_type: ClassVar[gguf.GGMLQuantizationType] = GT.Q5_0
    uses_imatrix: ClassVar[bool] = True
    bits = 5
    with_min = False


class Q5_1Codec(_Legacy45):
    """Q5_1: gguf-py's ``Q5_1.quantize_blocks`` (llama.cpp ``quantize_row_q5_1_ref``), byte for byte."""

    ggml_type: ClassVar[gguf.GGMLQuantizationType] = GT.Q5_1
    uses_imatrix: ClassVar[bool] = True
    bits = 5
    with_min = True

"""NumPy encoders for the GGML "scale + min" K-quants Q4_K, Q5_K and Q2_K, byte-identical to llama.cpp.

Pinned upstream: the llama.cpp revision vendored in llama-cpp-python 0.3.36 (its ggml reports
``ggml_version() == "0.25.3"``, ``ggml_commit() == "0c1e570-dirty"``). The functions matched are
``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref`` and ``quantize_row_q2_K_ref`` of
``ggml/src/ggml-quants.c`` with their helpers ``make_qkx2_quants``, ``nearest_int`` and
``get_scale_min_k4``; the block structs are in ``ggml/src/ggml-common.h``. Decoding is gguf-py's
(:meth:`convert.gguf.codecs.base.Codec.dequantize`).

Block layouts (one block = one super-block of 256 values; fp16 fields little-endian)
-----------------------------------------------------------------------------------
- ``block_q4_K`` (144 bytes): ``d`` fp16 [0:2], ``dmin`` fp16 [2:4], ``scales[12]`` [4:16],
  ``qs[128]`` [16:144]. 8 sub-blocks of 32 values, 4-bit quants ``L`` in 0..15.
  ``qs[32*c + l] = L[64*c + l] | L[64*c + 32 + l] << 4`` for ``c`` in 0..3, ``l`` in 0..31.
- ``block_q5_K`` (176 bytes): ``d`` [0:2], ``dmin`` [2:4], ``scales[12]`` [4:16], ``qh[32]``
  [16:48], ``qs[128]`` [48:176]. 8 sub-blocks of 32, quants 0..31: ``qs`` holds the low 4 bits
  as in Q4_K; bit ``2*c`` of ``qh[l]`` is the high bit of ``L[64*c + l]`` and bit ``2*c + 1`` that
  of ``L[64*c + 32 + l]``.
- ``block_q2_K`` (84 bytes): ``scales[16]`` [0:16], ``qs[64]`` [16:80], ``d`` [80:82], ``dmin``
  [82:84]. 16 sub-blocks of 16, quants 0..3; ``scales[j] = ls | lm << 4`` (4-bit scale and min);
  ``qs[32*h + l] = L[128*h + l] | L[128*h + l + 32] << 2 | L[128*h + l + 64] << 4 |
  L[128*h + l + 96] << 6`` for ``h`` in 0..1.
- The 12-byte 6-bit packing of Q4_K/Q5_K (scales ``ls[8]``, mins ``lm[8]``, each 0..63):
  bytes 0..3 ``ls[j] | (ls[j+4] >> 4) << 6``, bytes 4..7 ``lm[j] | (lm[j+4] >> 4) << 6``,
  bytes 8..11 ``(ls[j+4] & 15) | (lm[j+4] & 15) << 4`` (``j`` in 0..3); ``get_scale_min_k4``
  reads back ``ls``/``lm`` exactly.

Algorithm (per super-block)
---------------------------
1. Each sub-block gets a weight per value: Q4_K/Q5_K ``w = av_x + |x|`` with
   ``av_x = sqrt(sum(x*x) / 32)``; Q2_K ``w = |x|``.
2. ``make_qkx2_quants`` fits ``x ~ scale * L - the_min`` (``L`` in 0..nmax, ``the_min >= 0``):
   ``min = min(x, 0)``, ``max = max(x)``; if ``max == min`` -> scale 0, ``L = 0``. Else a first
   guess ``iscale = nmax / (max - min)`` with its weighted error (squared, or absolute when
   ``use_mad``), then ``nstep + 1`` trials ``iscale = (rmin + rdelta*is + nmax) / (max - min)``:
   quantize, solve the weighted least squares for (scale, min) (``min`` clamped to <= 0, then
   ``scale = sum_xl / sum_l2``), keep the trial when its error is strictly lower. A kept trial
   replaces ``min``, so later trials quantize against it. Parameters (nmax, rmin, rdelta, nstep,
   use_mad): Q4_K (15, -1, 0.1, 20, no), Q5_K (31, -0.5, 0.1, 15, no), Q2_K (3, -0.5, 0.1, 15, yes).
3. The sub-block scales and mins are quantized against the largest of each (``max_scale``,
   ``max_min``, both starting at 0): Q4_K/Q5_K 6 bits (``nearest_int(63/max * s)`` cast to
   uint8 then ``min(63, .)``; ``d = fp16(max_scale/63)``, ``dmin = fp16(max_min/63)``); Q2_K 4 bits
   (``nearest_int(15/max * s)``, no clamp, packed ``(ls | lm << 4) & 0xff``; ``d``/``dmin`` are
   ``fp16(max/15)`` or 0 when the max is 0).
4. The values are re-quantized with the rounded factors: ``d_j = fp16(d) * ls_j``,
   ``dm_j = fp16(dmin) * lm_j``, ``L = clamp(nearest_int((x + dm_j) / d_j), 0, nmax)``; a sub-block
   with ``d_j == 0`` keeps the ``L`` of step 2 (NaN is not 0: it re-quantizes).

float32 rules (what byte identity needs)
----------------------------------------
Every operation is one float32 operation in the C order: products are rounded before they are
added (no FMA in the x86-64 build; checked: no ``vfmadd`` in ``libggml-base.so``), ``a*b*c`` is
``(a*b)*c``, ``scale*L + min - x`` is ``((scale*L) + min) - x``, ``(rmin + rdelta*is) + nmax`` is
a float32 scalar, ``1/iscale`` and ``63/max`` are divisions (not reciprocal products), and every sum
is a sequential loop over the 16/32 positions (``sum_w``/``sum_x`` start from position 0, the
others from 0.f). min/max/argmax use the C comparisons (``x < min``, ``s > max_scale``), so NaN
never wins. ``nearest_int`` is the magic-number trick bit for bit
(:func:`convert.gguf.codecs.base.nearest_int_bits`), including for huge values, infinities and NaN.
fp16 conversion rounds to nearest even, overflow to inf (``ggml_compute_fp32_to_fp16``).

Vectorization: every sub-block of a chunk of super-blocks at once, data laid out as
``(positions, sub-blocks)`` so each position is one contiguous float32 row; a sequential sum over
the positions is then a row-after-row ``np.add.reduce(axis=0)`` (:func:`_seq_sum`), and Python loops
run only over the positions (min/max with the C comparisons) and the trials. Scratch arrays are
allocated once per chunk and written in place (fresh arrays cost page faults; chained temporaries
with broadcast operands hit a slow NumPy path). Working set: about ten float32 arrays the size of
the chunk (:data:`CHUNK_BLOCKS` super-blocks, 512 KiB each) plus the output.
"""

from __future__ import annotations

from typing import NamedTuple

import gguf
import numpy as np
import numpy.typing as npt

from convert.gguf.codecs.base import Codec, encode_by_chunks, nearest_int_bits

__all__ = ["Q2_KCodec", "Q4_KCodec", "Q5_KCodec"]

GT = gguf.GGMLQuantizationType
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

QK_K = 256
#: Super-blocks encoded per step (128k values: each working array is 512 KiB; 256..1024 measure alike).
CHUNK_BLOCKS = 512

_MAGIC = np.float32(12582912.0)  # nearest_int's 1.5 * 2**23
_ZERO = np.float32(0.0)
_EXACT_RINT = float(1 << 22)  # below this magnitude nearest_int(t) == rint(t)


class _Fit(NamedTuple):
    """``make_qkx2_quants`` of every sub-block: arrays ``(n_sub,)`` float32."""

    scale: F32  # the returned scale
    the_min: F32  # *the_min (= -min, >= 0)
    iscale: F32  # the iscale the kept L were quantized with
    shift: F32  # the min they were quantized against (x - shift)
    flat: npt.NDArray[np.bool_]  # max == min: L = 0


def _levels(t: F32, nmax: int, out: F32) -> F32:
    """``out = MAX(0, MIN(nmax, nearest_int(t)))`` as float32 (``nearest_int`` bit for bit).

    ``t`` is overwritten (scratch); ``out`` has its shape and is returned. Where every ``|t| < 2**22``
    (NaN fails the test), ``nearest_int`` is round-half-even (``t + 1.5*2**23`` lands on an integer
    of the same exponent), so two passes do (``rint``, ``clip``; ``+ 0.0`` after ``rint`` is not
    needed: ``clip`` to ``[0, nmax]`` turns ``-0.0`` into ``0.0`` only as a value, and ``L`` is only
    multiplied and summed, where ``-0.0`` and ``0.0`` give the same float32 results as in C's
    ``int`` ``0``); otherwise the magic-number trick itself, bit for bit.
    """
    if t.size and -_EXACT_RINT < float(t.min()) and float(t.max()) < _EXACT_RINT:  # NaN: False
        np.rint(t, out=t)
        return np.clip(t, _ZERO, np.float32(nmax), out=out)
    t += _MAGIC
    bits = t.view(np.int32)
    bits &= 0x7FFFFF
    np.clip(bits, 0x400000, 0x400000 + nmax, out=bits)
    np.copyto(out, bits, casting="unsafe")  # int32 -> float32, exact below 2**24
    out -= np.float32(0x400000)
    return out


def _levels_shifted(x: F32, shift: F32, iscale: F32, nmax: int, t: F32, out: F32) -> F32:
    """``out = clamp(nearest_int(iscale * (x - shift)))``: ``x``, ``t`` (scratch), ``out`` ``(n, m)``,
    ``shift``/``iscale`` ``(m,)``. In place: fresh arrays cost page faults, and NumPy's temporary
    elision makes ``(x - shift) * iscale`` several times slower than two in-place steps."""
    np.subtract(x, shift, out=t)
    t *= iscale
    return _levels(t, nmax, out)


def _seq_sum(a: F32, first: bool = False) -> F32:
    """Sequential float32 sum over axis 0 of ``(n, m)``: from ``a[0]`` if ``first``, else from 0.f.

    For ``m >= 2`` this is one ``np.add.reduce(axis=0)``: NumPy adds pairwise only along the
    contiguous axis (documented under ``numpy.sum``); across rows of a C-contiguous array it
    accumulates row after row, as the C loop does. With ``m == 1`` the reduced axis becomes the
    contiguous one (pairwise), so that case loops in Python.
    """
    if a.shape[1] >= 2 and a.flags.c_contiguous:
        if first:
            return np.add.reduce(a, axis=0)
        return np.add.reduce(a, axis=0, initial=_ZERO)
    acc = a[0].copy() if first else _ZERO + a[0]
    for row in a[1:]:
        acc += row
    return acc


def _sum_error(w: F32, lf: F32, scale: F32, mn: F32, x: F32, use_mad: bool, tmp: F32) -> F32:
    """``sum_i w * f(scale*L + min - x)`` (f = abs or square), sequential; ``(n, m)`` arrays, ``(m,)``
    ``scale``/``mn``; ``tmp`` is scratch."""
    np.multiply(lf, scale, out=tmp)
    tmp += mn
    tmp -= x
    if use_mad:
        np.abs(tmp, out=tmp)
    else:
        tmp *= tmp
    tmp *= w
    return _seq_sum(tmp)


def make_qkx2_quants(
    x: F32, w: F32, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> _Fit:
    """``make_qkx2_quants`` of ggml-quants.c for every column of ``x``/``w`` (float32 ``(n, n_sub)``).

    Returns the scale, ``the_min`` and what rebuilds the kept ``L`` (:func:`_fit_levels`).
    Working set: four scratch arrays the shape of ``x``, allocated once.
    """
    n = x.shape[0]
    mn = x[0].copy()
    mx = x[0].copy()
    for i in range(1, n):
        xi = x[i]
        np.copyto(mn, xi, where=xi < mn)
        np.copyto(mx, xi, where=xi > mx)
    t = np.empty_like(x)
    lf = np.empty_like(x)
    wl = np.empty_like(x)
    tmp = np.empty_like(x)
    sum_w = _seq_sum(w, first=True)
    sum_x = _seq_sum(np.multiply(w, x, out=tmp), first=True)
    mn[mn > 0] = _ZERO
    flat = mx == mn
    fnmax = np.float32(nmax)
    with np.errstate(all="ignore"):
        iscale = fnmax / (mx - mn)
        scale = np.float32(1.0) / iscale
        _levels_shifted(x, mn, iscale, nmax, t, lf)
        best = _sum_error(w, lf, scale, mn, x, use_mad, tmp)
        best_iscale = iscale.copy()
        shift = mn.copy()
        for step in range(nstep + 1):
            num = np.float32(rmin) + np.float32(rdelta) * np.float32(step) + fnmax
            isc = num / (mx - mn)
            _levels_shifted(x, mn, isc, nmax, t, lf)
            np.multiply(w, lf, out=wl)
            sum_l = _seq_sum(wl)
            sum_l2 = _seq_sum(np.multiply(wl, lf, out=tmp))
            sum_xl = _seq_sum(np.multiply(wl, x, out=tmp))
            d = sum_w * sum_l2 - sum_l * sum_l
            this_scale = np.asarray((sum_w * sum_xl - sum_x * sum_l) / d, dtype=np.float32)  # float32 already
            this_min = np.asarray((sum_l2 * sum_x - sum_l * sum_xl) / d, dtype=np.float32)
            pos = this_min > 0
            if pos.any():
                this_min[pos] = _ZERO
                np.copyto(this_scale, sum_xl / sum_l2, where=pos)
            cur = _sum_error(w, lf, this_scale, this_min, x, use_mad, tmp)
            take = (d > 0) & (cur < best) & ~flat
            np.copyto(best, cur, where=take)
            np.copyto(scale, this_scale, where=take)
            np.copyto(best_iscale, isc, where=take)
            np.copyto(shift, mn, where=take)  # the min this trial quantized against
            np.copyto(mn, this_min, where=take)
    scale[flat] = _ZERO
    return _Fit(scale, -mn, best_iscale, shift, flat)


def _fit_levels(x: F32, fit: _Fit, nmax: int) -> F32:
    """The ``L`` ``make_qkx2_quants`` left behind, float32 ``(n, n_sub)``."""
    lf = np.empty_like(x)
    with np.errstate(all="ignore"):
        _levels_shifted(x, fit.shift, fit.iscale, nmax, np.empty_like(x), lf)
    lf[:, fit.flat] = _ZERO
    return lf


def _running_max(v: F32) -> F32:
    """``m = 0; for j: if (v[j] > m) m = v[j]`` along axis 1 of ``(nb, n_sub_per_block)``."""
    m = np.zeros(v.shape[0], dtype=np.float32)
    for j in range(v.shape[1]):
        col = v[:, j]
        np.copyto(m, col, where=col > m)
    return m


def _requantize(x: F32, d: F32, dm: F32, nmax: int, fit: _Fit) -> U8:
    """``L = clamp(nearest_int((x + dm) / d))``; sub-blocks with ``d == 0`` keep their fit's ``L``.

    ``x`` is ``(n, n_sub)``, ``d``/``dm`` ``(n_sub,)``; returns uint8 ``(n, n_sub)``.
    """
    with np.errstate(all="ignore"):
        t = x + dm
        t /= d
    lf = _levels(t, nmax, np.empty_like(t))
    skip = d == 0
    if skip.any():
        keep = _fit_levels(x[:, skip], _Fit(*(a[skip] for a in fit)), nmax)
        lf[:, skip] = keep
    return lf.astype(np.uint8)


def _subblocks(xb: F32, sub: int) -> F32:
    """``(nb, 256)`` -> ``(sub, nb * 256 // sub)``: column ``b * (256 // sub) + j`` is sub-block ``j`` of ``b``."""
    return np.ascontiguousarray(xb.reshape(-1, sub).T)


def _to_blocks(levels: U8, sub: int) -> U8:
    """Inverse of :func:`_subblocks` for the quants: ``(sub, n_sub)`` -> ``(nb, 256)``."""
    return levels.T.reshape(-1, QK_K)


def _fp16_bytes(v: F32) -> U8:
    """float32 ``(nb,)`` -> its fp16 (round to nearest even, overflow to inf) as ``(nb, 2)`` bytes."""
    with np.errstate(all="ignore"):
        h = v.astype("<f2")
    return h.view(np.uint8).reshape(-1, 2)


def _q45_block(xb: F32, nmax: int, rmin: float, nstep: int) -> tuple[U8, U8, U8, U8]:
    """The shared Q4_K/Q5_K part for ``(nb, 256)`` float32: ``d``, ``dmin`` (``(nb, 2)``),
    ``scales`` (``(nb, 12)``) and the quants ``L`` (``(nb, 256)`` uint8)."""
    nb = xb.shape[0]
    xs = _subblocks(xb, 32)
    sum_x2 = _seq_sum(xs * xs)
    av_x = np.sqrt(sum_x2 / np.float32(32))
    w = np.abs(xs)
    w += av_x  # av_x + fabsf(x): addition commutes exactly
    fit = make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, False)
    del w
    scales = fit.scale.reshape(nb, 8)
    mins = fit.the_min.reshape(nb, 8)
    max_scale = _running_max(scales)
    max_min = _running_max(mins)
    c63 = np.float32(63.0)
    with np.errstate(all="ignore"):
        inv_scale = np.where(max_scale > 0, c63 / max_scale, _ZERO)
        inv_min = np.where(max_min > 0, c63 / max_min, _ZERO)
        ls = np.minimum(nearest_int_bits(inv_scale[:, None] * scales) & 0xFF, 63)
        lm = np.minimum(nearest_int_bits(inv_min[:, None] * mins) & 0xFF, 63)
    d16 = _fp16_bytes(max_scale / c63)
    dmin16 = _fp16_bytes(max_min / c63)
    sc = np.empty((nb, 12), dtype=np.int32)
    sc[:, 0:4] = ls[:, 0:4] | (ls[:, 4:8] >> 4) << 6
    sc[:, 4:8] = lm[:, 0:4] | (lm[:, 4:8] >> 4) << 6
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | (lm[:, 4:8] & 0xF) << 4
    d = d16.view("<f2").astype(np.float32) * ls.astype(np.float32)  # (nb, 8)
    dm = dmin16.view("<f2").astype(np.float32) * lm.astype(np.float32)
    levels = _requantize(xs, d.reshape(-1), dm.reshape(-1), nmax, fit)
    return d16, dmin16, sc.astype(np.uint8), _to_blocks(levels, 32)


class Q4_KCodec(Codec):
    """Q4_K: ``quantize_row_q4_K_ref`` (144-byte blocks of 256 values; see the module docstring)."""

    ggml_type = GT.Q4_K

    @classmethod
    def _encode_blocks(cls, xb: F32) -> U8:
        """float32 ``(nb, 256)`` -> uint8 ``(nb, 144)``."""
        d16, dmin16, sc, lv = _q45_block(xb, 15, -1.0, 20)
        out = np.empty((xb.shape[0], 144), dtype=np.uint8)
        out[:, 0:2] = d16
        out[:, 2:4] = dmin16
        out[:, 4:16] = sc
        q = lv.reshape(-1, 4, 2, 32)
        out[:, 16:144] = (q[:, :, 0, :] | q[:, :, 1, :] << 4).reshape(-1, 128)
        return out

    @classmethod
    def quantize(cls, x: F32) -> U8:
        """float32 ``(rows, n)`` (``n % 256 == 0``) -> uint8 ``(rows, n // 256 * 144)``."""
        return encode_by_chunks(x, QK_K, 144, cls._encode_blocks, CHUNK_BLOCKS)


class Q5_KCodec(Codec):
    """Q5_K: ``quantize_row_q5_K_ref`` (176-byte blocks of 256 values; see the module docstring)."""

    ggml_type = GT.Q5_K

    @classmethod
    def _encode_blocks(cls, xb: F32) -> U8:
        """float32 ``(nb, 256)`` -> uint8 ``(nb, 176)``."""
        d16, dmin16, sc, lv = _q45_block(xb, 31, -0.5, 15)
        out = np.empty((xb.shape[0], 176), dtype=np.uint8)
        out[:, 0:2] = d16
        out[:, 2:4] = dmin16
        out[:, 4:16] = sc
        q = lv.reshape(-1, 4, 2, 32)
        hi = q >> 4  # 0 or 1
        qh = np.zeros((xb.shape[0], 32), dtype=np.uint8)
        for c in range(4):
            qh |= hi[:, c, 0, :] << (2 * c)
            qh |= hi[:, c, 1, :] << (2 * c + 1)
        out[:, 16:48] = qh
        lo = q & 0xF
        out[:, 48:176] = (lo[:, :, 0, :] | lo[:, :, 1, :] << 4).reshape(-1, 128)
        return out

    @classmethod
    def quantize(cls, x: F32) -> U8:
        """float32 ``(rows, n)`` (``n % 256 == 0``) -> uint8 ``(rows, n // 256 * 176)``."""
        return encode_by_chunks(x, QK_K, 176, cls._encode_blocks, CHUNK_BLOCKS)


class Q2_KCodec(Codec):
    """Q2_K: ``quantize_row_q2_K_ref`` (84-byte blocks of 256 values; see the module docstring)."""

    ggml_type = GT.Q2_K

    @classmethod
    def _encode_blocks(cls, xb: F32) -> U8:
        """float32 ``(nb, 256)`` -> uint8 ``(nb, 84)``."""
        nb = xb.shape[0]
        xs = _subblocks(xb, 16)
        fit = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        scales = fit.scale.reshape(nb, 16)
        mins = fit.the_min.reshape(nb, 16)
        max_scale = _running_max(scales)
        max_min = _running_max(mins)
        c15 = np.float32(15.0)
        with np.errstate(all="ignore"):
            ls = np.where((max_scale > 0)[:, None], nearest_int_bits((c15 / max_scale)[:, None] * scales), 0)
            lm = np.where((max_min > 0)[:, None], nearest_int_bits((c15 / max_min)[:, None] * mins), 0)
        sc = ((ls | lm << 4) & 0xFF).astype(np.uint8)
        d16 = _fp16_bytes(max_scale / c15)  # max_scale == 0 stores fp16(0.f): the same bytes
        dmin16 = _fp16_bytes(max_min / c15)
        d = d16.view("<f2").astype(np.float32) * (sc & 0xF).astype(np.float32)
        dm = dmin16.view("<f2").astype(np.float32) * (sc >> 4).astype(np.float32)
        lv = _to_blocks(_requantize(xs, d.reshape(-1), dm.reshape(-1), 3, fit), 16)
        out = np.empty((nb, 84), dtype=np.uint8)
        out[:, 0:16] = sc
        q = lv.reshape(-1, 2, 4, 32)
        out[:, 16:80] = (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)
        out[:, 80:82] = d16
        out[:, 82:84] = dmin16
        return out

    @classmethod
    def quantize(cls, x: F32) -> U8:
        """float32 ``(rows, n)`` (``n % 256 == 0``) -> uint8 ``(rows, n // 256 * 84)``."""
        return encode_by_chunks(x, QK_K, 84, cls._encode_blocks, CHUNK_BLOCKS)

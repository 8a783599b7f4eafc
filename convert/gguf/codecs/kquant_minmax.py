"""NumPy encoders for the GGML "scale + min" K-quants Q4_K, Q5_K and Q2_K, byte-identical to llama.cpp.

Pinned upstream: the llama.cpp revision vendored in llama-cpp-python 0.3.36 (its ggml reports
``ggml_version() == "0.25.3"``, ``ggml_commit() == "0c1e570-dirty"``). The functions matched are
``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref`` and ``quantize_row_q2_K_ref`` of
``ggml/src/ggml-quants.c`` with their helpers ``make_qkx2_quants``, ``nearest_int`` and
``get_scale_min_k4`` (no importance matrix), and with one (``weights``: what
``ggml_quantize_chunk`` gets as ``quant_weights``) ``quantize_row_q{4,5,2}_K_impl`` with
``make_qkx3_quants`` and ``make_qp_quants`` (see "With an importance matrix"); the block structs are
in ``ggml/src/ggml-common.h``. Decoding is gguf-py's (:meth:`convert.gguf.codecs.base.Codec.dequantize`).

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

With an importance matrix (``quantize_row_q{4,5,2}_K_impl``)
------------------------------------------------------------
The imatrix row has one value ``qw`` per column; super-block ``i`` of every row takes
``qw[256*i : 256*i + 256]``.

1. Per super-block ``sum_x2 = sum x*x`` over its 256 values in order, ``sigma2 = 2*sum_x2/256``
   (Q4_K/Q5_K) or ``sum_x2/256`` (Q2_K); per value ``w = qw * sqrt(sigma2 + x*x)``; per
   sub-block ``sw = sum w`` (from 0.f).
2. ``make_qkx3_quants`` fits each sub-block as in step 2 above with these ``w``, on the grid
   ``rmin = -0.9``, ``rdelta = 0.05``, ``nstep = 36``, squared error, for all three types (with
   weights given its arithmetic is ``make_qkx2_quants``').
3. ``make_qp_quants`` (:func:`make_qp_quants`) quantizes the sub-block scales and, separately, the
   mins of a super-block to 0..63 (Q4_K/Q5_K) or 0..15 (Q2_K), weighted by ``sw``: a scale from
   9 trial factors around ``nmax / max``, then up to 5 passes moving single quants while the
   weighted fit ``sumlx^2 / suml2`` improves; ``d``/``dmin`` are the fp16 of its results. Its
   quants are C ``uint8_t``: a negative ``nearest_int`` (a negative sub-block scale, which
   negative imatrix values can give) wraps, Q5_K clamps the result to 63 and Q4_K does not, so the
   packed bytes may carry bits into a neighbour's field; the re-quantization reads the scales back
   with ``get_scale_min_k4`` (:func:`_scale_min_k4`), as C does.
4. Re-quantization and packing as steps 4 and the layouts above.

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
``make_qp_quants``' ``MAX(max, x)`` is ``max > x ? max : x``: a NaN is taken, and dropped again by the
next value. fp16 conversion rounds to nearest even, overflow to inf, NaN to ``sign | 0x7e00``
(``ggml_compute_fp32_to_fp16``; :func:`convert.gguf.codecs.base.fp16_bytes`).

``make_qp_quants``' passes are sequential over the 8 or 16 sub-blocks of a super-block (each move
changes the sums the next one sees), so they run one position at a time over every super-block of
the chunk (scales and mins side by side); a super-block whose pass moved nothing would move nothing
again, so all run until none moves.

Vectorization: every sub-block of a chunk of super-blocks at once, data laid out as
``(positions, sub-blocks)`` so each position is one contiguous float32 row; a sequential sum over
the positions is then a row-after-row ``np.add.reduce(axis=0)`` (:func:`_seq_sum`), and Python loops
run only over the positions (min/max with the C comparisons) and the trials. Scratch arrays are
allocated once per chunk and written in place (fresh arrays cost page faults; chained temporaries
with broadcast operands hit a slow NumPy path). Working set: about ten float32 arrays the size of
the chunk (:data:`CHUNK_BLOCKS` super-blocks, 512 KiB each) plus the output.

Cost with an importance matrix (4096 x 4096 float32, one thread, CPU seconds on a shared 2-core
machine; ours / C's ``ggml_quantize_chunk``, without the matrix in brackets): Q4_K 2.3 / 1.9
(1.3 / 1.1), Q5_K 2.2 / 2.0 (1.0 / 0.9), Q2_K 2.6 / 2.3 (1.0 / 0.95). The 37 ``make_qkx3_quants``
trials (against 21 or 16 without) are the bulk; ``make_qp_quants``' per-position passes ~15% for
Q2_K (16 positions), less for the others (8).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import gguf
import numpy as np
import numpy.typing as npt

from convert.gguf.codecs.base import Codec, encode_by_chunks, fp16_bytes, nearest_int_bits

__all__ = ["Q2_KCodec", "Q4_KCodec", "Q5_KCodec", "make_qkx2_quants", "make_qkx3_quants", "make_qp_quants"]

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


def _fp16_value(h: U8) -> F32:
    """uint8 ``(nb, 2)`` fp16 bytes -> their float32 values (``GGML_FP16_TO_FP32``, exact)."""
    return h.view("<f2").reshape(-1).astype(np.float32)


def _pack_k4(ls: npt.NDArray[np.int32], lm: npt.NDArray[np.int32]) -> U8:
    """The 12-byte scale/min packing of Q4_K/Q5_K from int32 ``(nb, 8)`` ``ls``/``lm`` (0..255: the
    C ``uint8_t``; bits above the 6 are dropped or land where C's ``|=`` into a byte puts them)."""
    sc = np.empty((ls.shape[0], 12), dtype=np.int32)
    sc[:, 0:4] = ls[:, 0:4] | (ls[:, 4:8] >> 4) << 6
    sc[:, 4:8] = lm[:, 0:4] | (lm[:, 4:8] >> 4) << 6
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | (lm[:, 4:8] & 0xF) << 4
    return sc.astype(np.uint8)  # truncation: the C byte stores


def _scale_min_k4(sc: U8) -> tuple[F32, F32]:
    """``get_scale_min_k4`` of every sub-block: uint8 ``(nb, 12)`` packed bytes -> the 6-bit scales
    and mins as float32 ``(nb, 8)``. Equal to ``ls``/``lm`` of :func:`_pack_k4` when those are <= 63;
    a larger ``ls[j]`` (j < 4, only from ``make_qp_quants``' wrapped quants) also alters sub-block
    ``j + 4``'s scale read back, as in C."""
    q = sc.astype(np.int32)
    ls = np.empty((q.shape[0], 8), dtype=np.int32)
    lm = np.empty_like(ls)
    ls[:, 0:4] = q[:, 0:4] & 63
    lm[:, 0:4] = q[:, 4:8] & 63
    ls[:, 4:8] = (q[:, 8:12] & 0xF) | (q[:, 0:4] >> 6) << 4
    lm[:, 4:8] = (q[:, 8:12] >> 4) | (q[:, 4:8] >> 6) << 4
    return ls.astype(np.float32), lm.astype(np.float32)


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
    return _q45_finish(xs, fit, nmax, fp16_bytes(max_scale / c63), fp16_bytes(max_min / c63), _pack_k4(ls, lm))


def _q45_finish(xs: F32, fit: _Fit, nmax: int, d16: U8, dmin16: U8, sc: U8) -> tuple[U8, U8, U8, U8]:
    """Re-quantize Q4_K/Q5_K sub-block data ``xs`` with the stored ``d``, ``dmin`` (``(nb, 2)``) and
    packed scales ``sc`` (``(nb, 12)``, read back by :func:`_scale_min_k4`); returns them and ``L``."""
    ls, lm = _scale_min_k4(sc)
    d = _fp16_value(d16)[:, None] * ls  # (nb, 8)
    dm = _fp16_value(dmin16)[:, None] * lm
    levels = _requantize(xs, d.reshape(-1), dm.reshape(-1), nmax, fit)
    return d16, dmin16, sc, _to_blocks(levels, 32)


# ---------------------------------------------------------------------------------------------
# with an importance matrix (quantize_row_q{2,4,5}_K_impl)

#: ``make_qkx3_quants``'s trial grid in the ``_impl`` functions: (rmin, rdelta, nstep, use_mad).
_QKX3 = (-0.9, 0.05, 36, False)
#: ``GROUP_MAX_EPS``: ``make_qp_quants`` encodes a group whose largest value is below this as zeros.
_GROUP_MAX_EPS = np.float32(1e-15)


def make_qkx3_quants(x: F32, w: F32, nmax: int) -> _Fit:
    """``make_qkx3_quants`` of ggml-quants.c with its ``weights`` given, for every column of ``x``/``w``
    (float32 ``(n, n_sub)``), at the parameters every caller uses (``rmin=-0.9, rdelta=0.05,
    nstep=36, use_mad=false``). With weights its arithmetic is ``make_qkx2_quants``' (its flat test
    ``max <= min`` equals ``max == min`` there: ``min <= x[0] <= max`` unless NaN, where both fail),
    so this is :func:`make_qkx2_quants` on that grid."""
    return make_qkx2_quants(x, w, nmax, *_QKX3)


def _weighted_sq_err(x: F32, w: F32, scale: F32, levels: F32) -> F32:
    """``sum_i w*diff*diff`` with ``diff = x - scale*l`` (``(w*diff)*diff``), sequential; ``x``, ``w``,
    ``levels`` ``(n, m)``, ``scale`` ``(m,)``."""
    diff = np.multiply(levels, scale)
    np.subtract(x, diff, out=diff)
    t = w * diff
    t *= diff
    return _seq_sum(t)


def make_qp_quants(x: F32, w: F32, nmax: int) -> tuple[F32, npt.NDArray[np.int32]]:
    """``make_qp_quants`` of ggml-quants.c for every column of float32 ``(n, m)`` ``x`` (the values,
    e.g. the sub-block scales of a super-block) with weights ``w`` (same shape).

    Returns the scale (float32 ``(m,)``) and the quants ``L`` (int32 ``(n, m)``, 0..255: C's
    ``uint8_t L[]``, where a negative ``nearest_int`` wraps). Steps, each a float32 operation in
    the C order: ``max = MAX(max, x)`` from 0 (``max > x ? max : x``); columns with
    ``max < 1e-15`` give scale 0 and ``L = 0``; ``L = nearest_int(nmax/max * x)``; the weighted
    squared error of that and of the 8 scales ``(0.1*is + nmax)/max`` (``is`` = -4..4 but 0, quants
    clamped above at ``nmax``) picks ``iscale`` (strictly lower wins); then ``L = min(nmax,
    nearest_int(iscale * x))`` with ``sumlx = sum w*x*L``, ``suml2 = sum w*L*L``; then up to 5
    passes over the positions in order, moving ``L[i]`` to ``min(nmax, nearest_int(x*sl2/slx))``
    (``slx``, ``sl2`` the sums without ``i``, both > 0) when ``slx^2 * suml2 > sumlx^2 * sl2``
    with the moved sums; a column stops after a pass without a move (another pass would change
    nothing, so all columns run until none moves). Result ``sumlx / suml2`` (0 unless ``suml2 > 0``).
    Call with NumPy's floating-point warnings off.
    """
    n, m = x.shape
    mx = np.zeros(m, dtype=np.float32)
    for i in range(n):
        mx = np.where(mx > x[i], mx, x[i])
    empty = mx < _GROUP_MAX_EPS
    fnmax = np.float32(nmax)
    iscale = fnmax / mx
    lq = nearest_int_bits(iscale * x) & 0xFF
    best = _weighted_sq_err(x, w, np.float32(1) / iscale, lq.astype(np.float32))
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        isc = (np.float32(0.1) * np.float32(step) + fnmax) / mx
        lt = np.minimum(nearest_int_bits(isc * x), nmax).astype(np.float32)
        cur = _weighted_sq_err(x, w, np.float32(1) / isc, lt)
        take = cur < best
        np.copyto(best, cur, where=take)
        np.copyto(iscale, isc, where=take)
    lint = np.minimum(nearest_int_bits(iscale * x), nmax)
    lf = lint.astype(np.float32)
    wx = w * x
    sumlx = _seq_sum(wx * lf)
    suml2 = _seq_sum(w * lf * lf)
    lq = lint & 0xFF
    for _ in range(5):
        changed = np.zeros(m, dtype=np.bool_)
        for i in range(n):
            wi, wxi, li = w[i], wx[i], lq[i]
            lif = li.astype(np.float32)
            slx = sumlx - wxi * lif
            sl2 = suml2 - wi * lif * lif
            move = (slx > 0) & (sl2 > 0)
            new_l = np.minimum(nearest_int_bits(x[i] * sl2 / slx), nmax)
            move &= new_l != li
            nf = new_l.astype(np.float32)
            slx += wxi * nf
            sl2 += wi * nf * nf
            move &= slx * slx * suml2 > sumlx * sumlx * sl2
            if move.any():
                lq[i] = np.where(move, new_l & 0xFF, li)
                np.copyto(sumlx, slx, where=move)
                np.copyto(suml2, sl2, where=move)
                changed |= move
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, _ZERO)
    scale[empty] = _ZERO
    lq[:, empty] = 0
    return scale, lq


def _block_sigma2(xb: F32, twice: bool) -> F32:
    """``sigma2`` of each super-block of float32 ``(nb, 256)`` -> ``(nb,)``: ``sum_x2 = sum x*x``
    over its 256 values in order (from 0.f), then ``2*sum_x2/256`` (Q4_K/Q5_K, ``twice``) or
    ``sum_x2/256`` (Q2_K)."""
    sq = np.ascontiguousarray(xb.T)  # (256, nb): the block's values in order down axis 0
    sq *= sq
    s = _seq_sum(sq)
    if twice:
        s *= np.float32(2)
    return s / np.float32(QK_K)


def _imatrix_weights(xs: F32, qs: F32, sigma2: F32) -> F32:
    """``qw * sqrtf(sigma2 + x*x)`` for sub-block data ``xs`` and imatrix values ``qs`` laid out alike
    (``(sub, n_sub)``), ``sigma2`` ``(n_sub,)`` (its super-block's)."""
    w = np.multiply(xs, xs)
    w += sigma2
    np.sqrt(w, out=w)
    w *= qs
    return w


def _scale_min_quants(scales: F32, mins: F32, sw: F32, nmax: int) -> tuple[F32, F32, npt.NDArray[np.int32],
                                                                             npt.NDArray[np.int32]]:
    """``make_qp_quants`` of the sub-block scales and of the mins of each super-block, weighted by the
    sub-blocks' ``sw`` (all float32 ``(nb, n_sub_per_block)``), in one call on both: returns
    ``d_block``, ``m_block`` (``(nb,)``) and ``Ls``, ``Lm`` (int32 ``(nb, n_sub_per_block)``)."""
    nb = scales.shape[0]
    vals = np.concatenate([scales.T, mins.T], axis=1)
    sws = np.ascontiguousarray(sw.T)
    scale, lq = make_qp_quants(vals, np.concatenate([sws, sws], axis=1), nmax)
    return scale[:nb], scale[nb:], np.ascontiguousarray(lq[:, :nb].T), np.ascontiguousarray(lq[:, nb:].T)


def _q45_block_imatrix(xb: F32, qb: F32, nmax: int) -> tuple[U8, U8, U8, U8]:
    """:func:`_q45_block` of ``quantize_row_q{4,5}_K_impl``: float32 ``(nb, 256)`` values ``xb`` and
    imatrix values ``qb`` -> ``d``, ``dmin``, ``scales``, ``L`` as :func:`_q45_block`."""
    nb = xb.shape[0]
    xs = _subblocks(xb, 32)
    sigma2 = np.repeat(_block_sigma2(xb, twice=True), 8)
    w = _imatrix_weights(xs, _subblocks(qb, 32), sigma2)
    sw = _seq_sum(w)
    fit = make_qkx3_quants(xs, w, nmax)
    del w
    d_block, m_block, ls, lm = _scale_min_quants(fit.scale.reshape(nb, 8), fit.the_min.reshape(nb, 8),
                                                 sw.reshape(nb, 8), 63)
    if nmax == 31:  # Q5_K clamps to 63 (only wrapped negative quants exceed it); Q4_K does not
        ls = np.minimum(ls, 63)
        lm = np.minimum(lm, 63)
    return _q45_finish(xs, fit, nmax, fp16_bytes(d_block), fp16_bytes(m_block), _pack_k4(ls, lm))


def _q2_block_imatrix(xb: F32, qb: F32) -> tuple[F32, _Fit, U8, U8, U8]:
    """The fit of ``quantize_row_q2_K_impl``: float32 ``(nb, 256)`` values ``xb`` and imatrix values
    ``qb`` -> sub-block data ``(16, nb * 16)``, its fit, ``scales`` ``(nb, 16)``, ``d``, ``dmin``."""
    nb = xb.shape[0]
    xs = _subblocks(xb, 16)
    sigma2 = np.repeat(_block_sigma2(xb, twice=False), 16)
    w = _imatrix_weights(xs, _subblocks(qb, 16), sigma2)
    sw = _seq_sum(w)
    fit = make_qkx3_quants(xs, w, 3)
    del w
    dm, mm, ls, lm = _scale_min_quants(fit.scale.reshape(nb, 16), fit.the_min.reshape(nb, 16),
                                       sw.reshape(nb, 16), 15)
    sc = ((ls | lm << 4) & 0xFF).astype(np.uint8)
    return xs, fit, sc, fp16_bytes(dm), fp16_bytes(mm)


def _q2_block_ref(xb: F32) -> tuple[F32, _Fit, U8, U8, U8]:
    """The fit of ``quantize_row_q2_K_ref``, returned as :func:`_q2_block_imatrix`."""
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
    # max_scale == 0 stores fp16(0.f): the same bytes as fp16(0/15)
    return xs, fit, sc, fp16_bytes(max_scale / c15), fp16_bytes(max_min / c15)


def _encode(x: F32, weights: F32 | None, type_size: int,
            encode_blocks: Callable[[F32, F32 | None], U8]) -> U8:
    """Run ``encode_blocks(xb, qb)`` (float32 ``(nb, 256)`` values and their imatrix values, or None)
    over float32 ``(..., n)`` in chunks of :data:`CHUNK_BLOCKS` super-blocks.

    ``weights``: the imatrix row (float32 ``(n,)``) or None. Super-block ``k`` of a row takes
    ``weights[256*k : 256*k + 256]`` (C's ``quant_weights + QK_K*i``, per row).

    Raises:
        ValueError: ``x`` is 0-D or its last axis is not a multiple of 256, or ``weights`` is not ``(n,)``.
    """
    if weights is None:
        return encode_by_chunks(x, QK_K, type_size, lambda xb: encode_blocks(xb, None), CHUNK_BLOCKS)
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] % QK_K:  # encode_by_chunks names the problem
        return encode_by_chunks(x, QK_K, type_size, lambda xb: encode_blocks(xb, None), CHUNK_BLOCKS)
    q = np.asarray(weights, dtype=np.float32)
    if q.shape != (x.shape[-1],):
        raise ValueError(f"expected an importance matrix row of shape ({x.shape[-1]},), got {q.shape}")
    qrow = q.reshape(-1, QK_K)
    done = 0  # super-blocks encoded so far: encode_by_chunks hands the chunks over in order

    def encode(xb: F32) -> U8:
        nonlocal done
        qb = qrow[(done + np.arange(xb.shape[0])) % qrow.shape[0]]
        done += xb.shape[0]
        return encode_blocks(xb, qb)

    return encode_by_chunks(x, QK_K, type_size, encode, CHUNK_BLOCKS)


class Q4_KCodec(Codec):
    """Q4_K: ``quantize_row_q4_K_ref``, or ``quantize_row_q4_K_impl`` with an importance matrix
    (144-byte blocks of 256 values; see the module docstring)."""

    ggml_type = GT.Q4_K
    uses_imatrix = True

    @classmethod
    def _encode_blocks(cls, xb: F32, qb: F32 | None = None) -> U8:
        """float32 ``(nb, 256)`` (and its imatrix values ``(nb, 256)`` or None) -> uint8 ``(nb, 144)``."""
        d16, dmin16, sc, lv = _q45_block(xb, 15, -1.0, 20) if qb is None else _q45_block_imatrix(xb, qb, 15)
        out = np.empty((xb.shape[0], 144), dtype=np.uint8)
        out[:, 0:2] = d16
        out[:, 2:4] = dmin16
        out[:, 4:16] = sc
        q = lv.reshape(-1, 4, 2, 32)
        out[:, 16:144] = (q[:, :, 0, :] | q[:, :, 1, :] << 4).reshape(-1, 128)
        return out

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(rows, n)`` (``n % 256 == 0``) -> uint8 ``(rows, n // 256 * 144)``; ``weights``:
        the imatrix row (float32 ``(n,)``) or None (:func:`_encode`)."""
        return _encode(x, weights, 144, cls._encode_blocks)


class Q5_KCodec(Codec):
    """Q5_K: ``quantize_row_q5_K_ref``, or ``quantize_row_q5_K_impl`` with an importance matrix
    (176-byte blocks of 256 values; see the module docstring)."""

    ggml_type = GT.Q5_K
    uses_imatrix = True

    @classmethod
    def _encode_blocks(cls, xb: F32, qb: F32 | None = None) -> U8:
        """float32 ``(nb, 256)`` (and its imatrix values ``(nb, 256)`` or None) -> uint8 ``(nb, 176)``."""
        d16, dmin16, sc, lv = _q45_block(xb, 31, -0.5, 15) if qb is None else _q45_block_imatrix(xb, qb, 31)
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
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(rows, n)`` (``n % 256 == 0``) -> uint8 ``(rows, n // 256 * 176)``; ``weights``:
        the imatrix row (float32 ``(n,)``) or None (:func:`_encode`)."""
        return _encode(x, weights, 176, cls._encode_blocks)


class Q2_KCodec(Codec):
    """Q2_K: ``quantize_row_q2_K_ref``, or ``quantize_row_q2_K_impl`` with an importance matrix
    (84-byte blocks of 256 values; see the module docstring)."""

    ggml_type = GT.Q2_K
    uses_imatrix = True

    @classmethod
    def _encode_blocks(cls, xb: F32, qb: F32 | None = None) -> U8:
        """float32 ``(nb, 256)`` (and its imatrix values ``(nb, 256)`` or None) -> uint8 ``(nb, 84)``."""
        xs, fit, sc, d16, dmin16 = _q2_block_ref(xb) if qb is None else _q2_block_imatrix(xb, qb)
        d = _fp16_value(d16)[:, None] * (sc & 0xF).astype(np.float32)
        dm = _fp16_value(dmin16)[:, None] * (sc >> 4).astype(np.float32)
        lv = _to_blocks(_requantize(xs, d.reshape(-1), dm.reshape(-1), 3, fit), 16)
        out = np.empty((xb.shape[0], 84), dtype=np.uint8)
        out[:, 0:16] = sc
        q = lv.reshape(-1, 2, 4, 32)
        out[:, 16:80] = (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)
        out[:, 80:82] = d16
        out[:, 82:84] = dmin16
        return out

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(rows, n)`` (``n % 256 == 0``) -> uint8 ``(rows, n // 256 * 84)``; ``weights``:
        the imatrix row (float32 ``(n,)``) or None (:func:`_encode`)."""
        return _encode(x, weights, 84, cls._encode_blocks)

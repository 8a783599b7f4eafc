"""llama.cpp's importance-weighted encodings of Q4_0, Q4_1, Q5_0 and Q5_1 (``llama-quantize --imatrix``): the scale
search of each block, byte for byte with ggml's C (:mod:`convert.gguf.codecs.legacy` packs the levels it finds).

Q4_0, Q4_1, Q5_0 and Q5_1 with an importance matrix follow ``ggml_quantize_chunk`` -> ``quantize_q4_0`` & co. ->
``quantize_row_q4_0_impl`` & co. (ggml-quants.c of the llama.cpp revision vendored in llama-cpp-python 0.3.36), byte
for byte with its C build: each row's ``sigma2 = sum(x*x) / n`` (:func:`row_sigma2`), each value's weight ``qw[j] *
sqrtf(sigma2 + x[j]*x[j])``, then per block a weighted search of the scale: ``make_qx_quants(32, 8 or 16, ...,
rmse_type=1)`` for Q4_0/Q5_0 (:func:`_qx_weighted`: 19 trial scales, ``d`` stored, no minimum),
``make_qkx3_quants(32, 15 or 31, ..., -0.9, 0.05, 36)`` for Q4_1/Q5_1 (:func:`_qkx3_weighted`: 38 trial scales and
least-squares scale and minimum). That is not gguf-py's reference rounding (:mod:`convert.gguf.codecs.legacy`): an
all-zero Q4_0 block, for one, stores levels 0, not 8. The searches run on position-major ``(32, blocks)`` pieces of
:data:`WEIGHTED_BLOCKS` blocks with sequential float32 sums, in C's operation order; inf/NaN rows (whose ``sigma2``
is not finite) too, with C's ``nearest_int`` bit trick and the NaN C's row sum ends on (:func:`_sum_nan`). Q8_0
ignores the weights, as C.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from convert.gguf.codecs.base import bitmask, first_absmax, nearest_int_bits, select, seq_sum0

__all__ = ["WEIGHTED_BLOCKS", "imatrix_blocks", "row_sigma2", "weighted_levels"]

F32 = npt.NDArray[np.float32]

QK = 32
#: Values of the rows :func:`row_sigma2` widens at once (a legacy codec's chunk: 8192 blocks of 32).
_SIGMA_VALUES = 8192 * QK
#: Blocks of one piece of the importance-matrix search (:func:`_qx_weighted`, :func:`_qkx3_weighted`; two to a
#: chunk), its working arrays float32 ``(32, blocks)`` (512 KiB each, ~6 of them). Each trial is ~12-17 NumPy
#: passes plus ~40 calls on ``(blocks,)`` vectors: on a 4096 x 4096 matrix (one thread, 2 MiB L2) Q4_1 took
#: 2.57 s with 1024, 2.10 s with 2048, 1.91 s with 4096, 1.93 s with 8192 (Q4_0: 0.80, 0.66, 0.62, 0.84 s).
WEIGHTED_BLOCKS = 4096

#: ggml-quants.c's ``GROUP_MAX_EPS``: a block whose largest ``|x|`` is below it is all zero for ``make_qx_quants``.
GROUP_MAX_EPS = np.float32(1e-15)
#: Below this ``|t|``, ``np.rint(t)`` is C's ``nearest_int(t)`` (valid up to ``2**22``; margin for the bound).
_RINT_SAFE = np.float32(2.0**21)




def weighted_levels(xb: F32, qw: F32, sigma2: F32, nmax: int, with_min: bool, q: npt.NDArray[np.uint8]
                    ) -> tuple[F32, F32]:
    """``quantize_row_q{4,5}_{0,1}_impl`` with ``quant_weights`` on float32 ``(blocks, 32)`` ``xb``: each block's
    weights ``qw[j] * sqrtf(sigma2 + x[j]*x[j])`` (``qw`` float32 ``(blocks, 32)``, ``sigma2`` float32 ``(blocks,)``:
    :func:`row_sigma2` of each block's row), then :func:`_qx_weighted` (no minimum: Q4_0, Q5_0) or
    :func:`_qkx3_weighted` (``with_min``: Q4_1, Q5_1) with levels up to ``nmax``, in pieces of
    :data:`WEIGHTED_BLOCKS` blocks. The levels go into uint8 ``(blocks, 32)`` ``q``.

    Returns:
        float32 ``(blocks,)`` ``d`` and ``m`` (``m`` unset without a minimum).
    """
    n = xb.shape[0]
    d = np.empty(n, dtype=np.float32)
    mn = np.empty(n, dtype=np.float32)
    for s in range(0, n, WEIGHTED_BLOCKS):
        e = min(n, s + WEIGHTED_BLOCKS)
        xp = np.ascontiguousarray(xb[s:e].T)
        wp = np.multiply(xp, xp)
        wp += sigma2[s:e]
        np.sqrt(wp, out=wp)
        wp *= qw[s:e].T
        finite = bool(np.isfinite(sigma2[s:e]).all())  # Σ x*x of a row is finite only if every x is
        if with_min:
            d[s:e], mn[s:e], lv = _qkx3_weighted(xp, wp, nmax, finite)
        else:
            d[s:e], lv = _qx_weighted(xp, wp, nmax, finite)
        q[s:e] = lv.T
    return d, mn


def imatrix_blocks(weights: F32, n: int, block: int) -> F32:
    """An importance matrix row (``quant_weights`` of ``ggml_quantize_chunk``) for rows of ``n`` values, cut in
    blocks: float32 ``(n // block, block)`` (row ``k`` weighs the columns of a row's block ``k``).

    Raises:
        ValueError: ``n`` is not a positive multiple of ``block``, or ``weights`` is not of shape ``(n,)``.
    """
    if n <= 0 or n % block:
        raise ValueError(f"expected float32 (..., n) with n a multiple of {block}, got rows of {n}")
    qw = np.asarray(weights, dtype=np.float32)
    if qw.shape != (n,):
        raise ValueError(f"importance matrix row of shape {qw.shape} for rows of {n} values")
    return qw.reshape(n // block, block)


def row_sigma2(x: np.ndarray) -> F32:
    """``sum(x[j] * x[j]) / n`` of each row of ``(rows, n)`` float32/bfloat16/float16 ``x`` -> float32 ``(rows,)``:
    ``quantize_row_q4_0_impl``'s ``sigma2`` (a sequential float32 sum from 0, then a float32 division),
    computed in batches of rows widened to float32 (inf when ``x * x`` overflows, NaN with NaN)."""
    rows, n = x.shape
    out = np.empty(rows, dtype=np.float32)
    step = max(1, _SIGMA_VALUES // n)
    with np.errstate(over="ignore", invalid="ignore"):
        for r in range(0, rows, step):
            sq = np.square(np.asarray(x[r : r + step], dtype=np.float32))
            out[r : r + step] = seq_sum0(np.ascontiguousarray(sq.T))  # x * x >= +0: no sign of zero to mind
        for r in np.flatnonzero(np.isnan(out)):
            out[r] = _sum_nan(np.asarray(x[r], dtype=np.float32))
        out /= np.float32(n)
    return out


def _sum_nan(row: F32) -> np.float32:
    """The NaN that C's ``sum += x[j]*x[j]`` loop ends on, for a row holding NaN: which of two NaNs an
    ``addss`` keeps is its first operand's, and the x86-64 build of ``libggml-base.so`` (llama-cpp-python
    0.3.36) unrolls the loop by 4 with the product first at ``j % 4`` 1 and 2 and the sum first at 0 and 3.
    So the sum is the (quieted) first NaN of the row, replaced by every later one at ``j % 4`` 1 or 2. Only
    the sign of that NaN reaches the output (a NaN ``d`` as ``sign | 0x7e00``); another build may pick
    another NaN."""
    j = np.flatnonzero(np.isnan(row))
    later = j[1:][(j[1:] % 4 == 1) | (j[1:] % 4 == 2)]
    k = later[-1] if later.size else j[0]
    bits = row[k : k + 1].view(np.uint32) | np.uint32(0x00400000)  # x * x quiets a signalling NaN
    return bits.view(np.float32)[0]


def _levels(t: F32, lo: int, hi: int, rint_ok: bool) -> F32:
    """``MAX(lo, MIN(hi, nearest_int(t)))`` as float32 (``t`` is overwritten): by ``np.rint`` when ``rint_ok``
    (every ``|t|`` below :data:`_RINT_SAFE`, no NaN), else C's bit trick (:func:`nearest_int_bits`) for inf,
    NaN and huge ``t``. A level 0 may come back as -0.0 (C's int 0 converts to +0.0): every product with
    it is a zero, and a zero term never changes a sum's value (only the sign of an all-zero sum, which
    :func:`_sum0` makes +0.0 as C's ``0 + ...`` does)."""
    if rint_ok:
        np.rint(t, out=t)
        np.clip(t, lo, hi, out=t)
        return t
    li = nearest_int_bits(t)
    np.clip(li, lo, hi, out=li)
    return li.astype(np.float32)


def _sum0(a: F32) -> F32:
    """C's ``s = 0; for (i...) s += a[i]`` over axis 0 of float32 ``(32, blocks)``: :func:`seq_sum0`, plus +0.0.

    Starting from +0.0 or from ``a[0]`` changes only the sign of a zero sum whose every term is -0.0 (C's
    is +0.0). NumPy's ``add.reduce`` starts from +0.0 (checked by the tests through
    :func:`_sum_first`'s blocks); the +0.0 keeps C's sign should a NumPy start from ``a[0]``."""
    s = seq_sum0(a)
    s += np.float32(0)
    return s


def _sum_first(a: F32) -> F32:
    """C's ``s = a[0]; for (i = 1...) s += a[i]`` over axis 0 of float32 ``(32, blocks)``: :func:`_sum0`, and -0.0
    where every term is -0.0 (e.g. ``make_qkx3_quants``'s ``sum_x`` with weights 0 at the negative values and
    -0.0 values elsewhere: its sign reaches the stored minimum)."""
    s = _sum0(a)
    z = np.flatnonzero(s == 0)
    if z.size:
        neg = (a[:, z].view(np.uint32) == np.uint32(0x80000000)).all(axis=0)
        s[z[neg]] = np.float32(-0.0)
    return s


def _qx_weighted(xp: F32, wp: F32, nmax: int, finite: bool) -> tuple[F32, npt.NDArray[np.uint8]]:
    """``make_qx_quants(32, nmax, x, L, rmse_type=1, weight)`` of each block (Q4_0: ``nmax`` 8, Q5_0: 16).

    ``xp``, ``wp``: float32 ``(32, blocks)`` position-major values and weights; ``finite``: no inf/NaN in
    ``xp`` (the fast rounding may then be used). Returns the scale ``d`` float32 ``(blocks,)`` and the levels
    ``L`` uint8 ``(32, blocks)`` in ``0 .. 2 * nmax - 1`` (``L = l + nmax``).

    C: ``max`` the first ``x`` of largest ``|x|``; a block with ``amax < GROUP_MAX_EPS`` gets ``d = 0``, ``L = 0``.
    ``iscale = -nmax / max``, ``l = clamp(nearest_int(iscale * x), -nmax, nmax - 1)``, ``sumlx = sum((w*x)*l)``,
    ``suml2 = sum((w*l)*l)``, ``scale = suml2 ? sumlx / suml2 : 0``, ``best = scale * sumlx``; then for
    ``is = -9 .. 9`` (not 0) ``iscale = -(nmax + 0.1f*is) / max`` replaces the levels and
    ``scale = sumlx / suml2`` when ``suml2 > 0 && sumlx*sumlx > best*suml2``. Here the winning ``iscale`` is
    kept and the levels made from it once at the end (C's are made from that same ``iscale``).
    """
    amax, mx = first_absmax(xp, axis=0)
    zero = amax < GROUP_MAX_EPS
    mx[zero] = 1  # any finite scale: those blocks are set to 0 at the end
    wx = wp * xp
    t = np.empty_like(xp)
    p = np.empty_like(xp)

    def sums(iscale: F32) -> tuple[F32, F32]:
        rint_ok = finite and bool((np.abs(iscale) * amax < _RINT_SAFE).all())  # |iscale * x| <= |iscale| * amax
        np.multiply(xp, iscale, out=t)
        lv = _levels(t, -nmax, nmax - 1, rint_ok)
        sumlx = _sum0(np.multiply(wx, lv, out=p))
        np.multiply(wp, lv, out=p)
        return sumlx, _sum0(np.multiply(p, lv, out=p))

    best_is = np.float32(-nmax) / mx
    sumlx, suml2 = sums(best_is)
    scale = np.where(suml2 != 0, sumlx / suml2, np.float32(0))  # C: `suml2 ?` (NaN is true)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / mx
        sumlx, suml2 = sums(iscale)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        if np.count_nonzero(upd):
            m = bitmask(upd)
            scale = select(m, sumlx / suml2, scale)
            best = select(m, scale * sumlx, best)
            best_is = select(m, iscale, best_is)
    li = nearest_int_bits(np.multiply(xp, best_is, out=t))
    np.clip(li, -nmax, nmax - 1, out=li)
    li += nmax
    li[:, zero] = 0
    scale[zero] = 0
    return scale, li.astype(np.uint8)


def _qkx3_weighted(xp: F32, wp: F32, nmax: int, finite: bool) -> tuple[F32, F32, npt.NDArray[np.uint8]]:
    """``make_qkx3_quants(32, nmax, x, weight, L, &the_min, Laux, -0.9f, 0.05f, 36, false)`` of each block
    (Q4_1: ``nmax`` 15, Q5_1: 31). ``xp``, ``wp``, ``finite`` as :func:`_qx_weighted`. Returns the scale ``d``
    and the minimum ``m`` (``-the_min``, what the block stores), float32 ``(blocks,)``, and the levels
    ``L`` uint8 ``(32, blocks)`` in ``0 .. nmax``.

    C: ``min``/``max`` the first smallest/largest ``x`` (a NaN first value sticks, later NaNs are skipped),
    ``min`` raised to +0.0 when positive; ``sum_w``, ``sum_x = sum(w*x)`` from the first term; a block with
    ``max <= min`` gets ``d = 0``, ``L = 0``. Else ``iscale = nmax / (max - min)``, ``scale = 1 / iscale``,
    ``L = clamp(nearest_int(iscale * (x - min)), 0, nmax)``, ``best_mad = sum(w * (scale*L + min - x)**2)``;
    then for ``is = 0 .. 36``, ``iscale = (-0.9f + 0.05f*is + nmax) / (max - min)`` with the *current*
    ``min`` (a trial that wins changes it for the next), levels ``l`` as above, ``sum_l = sum(w*l)``,
    ``sum_l2 = sum((w*l)*l)``, ``sum_xl = sum((w*l)*x)``, ``D = sum_w*sum_l2 - sum_l*sum_l``; when ``D > 0``
    the least-squares ``this_scale``, ``this_min`` (``this_min > 0``: 0 and ``sum_xl / sum_l2``) win when
    their ``mad`` is below ``best_mad``. Here each block's winning ``(iscale, min)`` is kept and ``L`` made
    from it once at the end.
    """
    lo = np.fmin.reduce(xp, axis=0)  # C's values; the sign of a zero and a NaN first value fixed below
    hi = np.fmax.reduce(xp, axis=0)
    mn, mx = _first_of(xp, lo), _first_of(xp, hi)
    sum_w = _sum_first(wp)  # C: sum_w = w[0]; sum_w += w[i]
    p = np.multiply(wp, xp)
    sum_x = _sum_first(p)
    mn[mn > 0] = 0
    early = mx <= mn
    t = np.empty_like(xp)  # the levels
    q = np.empty_like(xp)

    def levels(iscale: F32, mn: F32) -> F32:
        rng = np.maximum(np.abs(lo - mn), np.abs(mx - mn))  # |x - min| <= rng for every x of the block
        rint_ok = finite and bool(((np.abs(iscale) * rng < _RINT_SAFE) | early).all())
        np.subtract(xp, mn, out=t)
        return _levels(np.multiply(t, iscale, out=t), 0, nmax, rint_ok)

    def mad(scale: F32, mn: F32, lv: F32) -> F32:
        np.multiply(lv, scale, out=q)
        np.add(q, mn, out=q)
        np.subtract(q, xp, out=q)
        np.multiply(q, q, out=q)
        return seq_sum0(np.multiply(q, wp, out=q))

    iscale = np.float32(nmax) / (mx - mn)
    scale = np.float32(1) / iscale
    best_mad = mad(scale, mn, levels(iscale, mn))
    best_is, best_mn = iscale, mn.copy()
    for step in range(37):
        iscale = ((np.float32(-0.9) + np.float32(0.05) * np.float32(step)) + np.float32(nmax)) / (mx - mn)
        lv = levels(iscale, mn)
        wl = np.multiply(wp, lv, out=p)
        sum_l = _sum0(wl)
        sum_xl = _sum0(np.multiply(wl, xp, out=q))
        wl *= lv
        sum_l2 = _sum0(wl)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = (det > 0) & ~early
        if not np.count_nonzero(ok):
            continue
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        pos = this_min > 0
        this_min[pos] = 0
        this_scale = select(pos, sum_xl / sum_l2, this_scale)
        this_mad = mad(this_scale, this_min, lv)
        upd = ok & (this_mad < best_mad)
        if np.count_nonzero(upd):
            m = bitmask(upd)
            best_mad = select(m, this_mad, best_mad)
            best_is = select(m, iscale, best_is)
            best_mn = select(m, mn, best_mn)
            scale = select(m, this_scale, scale)
            mn = select(m, this_min, mn)
    li = nearest_int_bits(np.multiply(np.subtract(xp, best_mn, out=t), best_is, out=t))
    np.clip(li, 0, nmax, out=li)
    li[:, early] = 0
    scale[early] = 0
    return scale, mn, li.astype(np.uint8)


def _first_of(xp: F32, v: F32) -> F32:
    """C's running ``if (x[i] < v) v = x[i]`` (or ``>``) result from NumPy's ``fmin``/``fmax`` ``v`` of
    ``xp`` ``(32, blocks)``: a NaN ``x[0]`` is kept (no comparison replaces it), and a zero result takes the
    sign of the block's first zero (C keeps the first of equal values; NumPy's zero sign is its own)."""
    v = v.copy()
    nan0 = np.isnan(xp[0])
    if np.count_nonzero(nan0):
        v[nan0] = xp[0, nan0]
    z = np.flatnonzero(v == 0)
    if z.size:
        sub = xp[:, z]
        v[z] = sub[np.argmax(sub == 0, axis=0), np.arange(z.size)]
    return v

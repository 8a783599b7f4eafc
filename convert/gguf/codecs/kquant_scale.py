"""NumPy encoders for the scale-only GGML K-quants Q6_K and Q3_K, byte-identical to llama.cpp.

Matched revision: the llama.cpp copy vendored in llama-cpp-python 0.3.36
(``vendor/llama.cpp/ggml/src/ggml-quants.c``), the functions ``ggml_quantize_chunk`` calls when
llama-quantize runs without an importance matrix: ``quantize_q6_K`` -> ``quantize_row_q6_K_ref``
and ``quantize_q3_K`` -> ``quantize_row_q3_K_ref``; with one (``quantize(x, weights)``, C's
``quant_weights``: one float32 per column, the same for every row): ``quantize_row_q6_K_impl`` and
``quantize_row_q3_K_impl``, row by row, the row's super-block ``i`` taking weights
``256*i .. 256*i + 255``. IQ4_NL, the fallback type for Q2_K/Q3_K rows
that are not a multiple of 256, is in :mod:`convert.gguf.codecs.iq4_nl`.

Block layouts (little-endian, ``QK_K = 256`` weights per super-block of 16 sub-blocks of 16):

- ``block_q6_K`` (210 bytes): ``ql[128]`` low 4 bits of the 6-bit codes, ``qh[64]`` their high 2
  bits, ``scales[16]`` int8 sub-block scales, ``d`` fp16 super-block scale. Code ``L`` (0..63) of
  weight ``j`` of half ``h`` (``j = 128*h + 32*q + l``, ``q`` 0..3, ``l`` 0..31): ``ql[64*h + l]``
  holds ``q = 0`` (low nibble) and ``q = 2`` (high nibble), ``ql[64*h + 32 + l]`` holds ``q = 1``
  and ``q = 3``; ``qh[32*h + l]`` holds ``L >> 4`` of ``q`` at bits ``2q``. Value
  ``d * scales[j // 16] * (L - 32)``.
- ``block_q3_K`` (110 bytes): ``hmask[32]`` (bit ``j // 32`` of byte ``j % 32`` is bit 2 of the
  3-bit code of weight ``j``), ``qs[64]`` (low 2 bits: ``qs[32*h + l]`` holds weights
  ``128*h + 32*q + l`` at bits ``2q``), ``scales[12]`` (16 6-bit scales ``s + 32``: low nibbles of
  0..7 in bytes 0..7, of 8..15 in the high nibbles of bytes 0..7; high 2 bits of scale ``j`` in
  byte ``8 + j % 4`` at bits ``2 * (j // 4)``), ``d`` fp16. Value ``d * s * (L - 4)``.

Algorithm (per super-block; all float32):

- Q6_K: each sub-block gets a scale from ``make_qx_quants(16, nmax=32, rmse_type=1, qw=NULL)``:
  ``iscale = -32 / max`` (``max`` the first element of largest ``|x|``), codes
  ``clamp(nearest_int(iscale * x), -32, 31)``, weights ``w = x * x``, least-squares scale
  ``sumlx / suml2``; then 18 more trial ``iscale = -(32 + 0.1f * is) / max`` (``is`` = -9..9 but 0),
  keeping a trial when ``sumlx**2 > best * suml2``. A sub-block with ``amax < GROUP_MAX_EPS``
  (1e-15) gets scale 0 and codes 0. The 16 scales are quantized to int8 with
  ``iscale = -128 / max_scale``, ``d = fp16(1 / iscale)``, ``scales = min(127, nearest_int(iscale
  * scale))``; the codes are re-made from the rounded factor ``d * scales[j]`` by
  ``clamp(nearest_int(x / (d * s)), -32, 31) + 32``, except in a sub-block whose ``d * s`` is 0,
  which keeps the ``make_qx_quants`` codes. A super-block whose scales all are below
  ``GROUP_MAX_EPS`` is all zero bytes.
- Q3_K: each sub-block gets a scale from ``make_q3_quants(16, nmax=4, do_rmse=true)``: codes from
  ``iscale = -4 / max``, then up to 5 passes that move one code at a time to
  ``nearest_int(x * sl2 / slx)`` when that raises ``sumlx**2 / suml2`` (weights ``x * x``), scale
  ``sumlx / suml2``. The scales go to 6 bits with ``iscale = -32 / max_scale``,
  ``d = fp16(1 / iscale)`` (0 and zero scale bytes when ``max_scale`` is 0); codes are re-made
  from ``d * s`` as for Q6_K (range -4..3).
- Q6_K with an importance matrix: as above, but ``make_qx_quants`` weighs element ``i`` by the
  importance ``qw[i]`` itself instead of ``x * x``.
- Q3_K with an importance matrix: ``sigma2 = 2 * sum(x*x) / 256`` (sequential over the
  super-block), element weights ``qw * sqrt(sigma2 + x*x)``; each sub-block's scale and codes from
  ``make_qx_quants(16, nmax=4, rmse_type=1, weights)`` (not ``make_q3_quants``); the 16 scales are
  themselves put on the 6-bit grid by ``make_qx_quants(16, nmax=32, rmse_type=1, sw)`` (``sw`` the
  sub-blocks' sequential sums of weights): its codes are the scale bytes, its scale the fp16 ``d``
  (0, with scale bytes 0, when every scale is below ``GROUP_MAX_EPS``); codes re-made from
  ``d * (Ls - 32)`` as in the ref path.

Float32 order rules (what byte identity needs): sums are sequential loops over the 16 positions
of a sub-block (``s = 0; s += v[i]``; weighted Q3_K's ``sum(x*x)`` over the 256 of a super-block),
never pairwise; products associate left to right as
written in C (``w*x[i]*l`` is ``(w * x) * l``, ``w*l*l`` is ``(w * l) * l``); division stays
division (``x / d``, not ``x * (1 / d)``) and ``1 / iscale`` is a division; no fused multiply-add
(the x86-64 ``libggml-base`` has none); ``nearest_int`` is the ``+ 1.5 * 2**23`` bit trick
(:func:`~convert.gguf.codecs.base.nearest_int_bits` where the argument can be large; ``np.rint`` where
it stays below ``nmax + 1``, which is the same there). Selections take whole bit patterns
(:func:`~convert.gguf.codecs.base.select`), so NaN payloads and signed zeros pass as in C: NaN, inf and
overflowing inputs give C's bytes too.

Vectorization: one NumPy operation covers every sub-block of a chunk of super-blocks (data laid
out position-major, ``(16, sub-blocks)``, so a sequential sum is ``np.add.reduce`` over axis 0,
see :func:`~convert.gguf.codecs.base.seq_sum0`); Python loops only run over the 16 positions and the
trial scales. Chunks of :data:`CHUNK_BLOCKS` (Q6_K) / :data:`CHUNK_BLOCKS_Q3` super-blocks bound
the working set (a few float32 copies of the chunk). Q3_K's first refinement pass runs by column
blocks of :data:`Q3_COLUMNS` sub-blocks; the later passes only over the sub-blocks whose codes
changed in the pass before (C breaks out of the loop for the others, and a pass without a change
would leave them as they are), all of the chunk at once.

Cost (4096 x 4096 float32, one thread, CPU time on a shared 2-core machine; C is
``ggml_quantize_chunk``): Q6_K about 1.4 s against C's 0.9 s (1.3-1.6x; 19 trial scales x 8
full-array passes each is the bulk, at NumPy's ~0.25 ns per element and pass), Q3_K about 1.0 s
against 0.36 s (~3x; each refinement step is ~17 vector operations over all sub-blocks, C's loop
is cheap). With an importance matrix (measured on another day, same machine, one thread; CPU s
for ours / C, the unweighted ones in brackets): Q6_K 0.51 / 0.50 (0.49 / 0.47), Q3_K 0.67 / 0.62
(0.34 / 0.20): weighted Q3_K is ``make_qx_quants`` (the 19 trials) plus the per-super-block
``sigma2``, and C's weighted Q3_K costs 3x its ref path too. The GGUF writer's ``threads`` run
chunks in parallel (NumPy releases the GIL).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from convert.gguf.codecs.base import (
    GT,
    Codec,
    bitmask,
    encode_by_chunks,
    first_absmax,
    fp16_bytes,
    fp16_round,
    nearest_int_bits,
    select,
    seq_sum0,
)

__all__ = ["CHUNK_BLOCKS", "CHUNK_BLOCKS_Q3", "Q3_KCodec", "Q6_KCodec", "make_q3_quants", "make_qx_quants"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
#: Super-blocks per vectorized chunk of Q6_K (512 KiB of float32 per working array): large enough
#: that NumPy's per-call cost (~3 us) is small against the 19 trial passes, small enough to stay
#: in L2/L3.
CHUNK_BLOCKS = 512
#: Super-blocks per chunk of Q3_K: larger, because the refinement passes after the first run over
#: few sub-blocks and cost mostly per-call overhead, paid once per chunk.
CHUNK_BLOCKS_Q3 = 4096
#: Sub-blocks per column block of Q3_K's first refinement pass (1 MiB of float32 per array).
Q3_COLUMNS = 16384


def _qx_sums(x: F32, w: F32, wx: F32, iscale: F32, lo: int, hi: int, t: F32, p: F32,
             exact: bool = False) -> tuple[F32, F32]:
    """``(sumlx, suml2)`` of codes ``clamp(rint(iscale * x), lo, hi)``; ``t``, ``p`` are scratch.

    ``exact``: the codes by C's ``nearest_int`` bit trick (:func:`nearest_int_bits`), which gives an
    integer (from the NaN's bits) where ``iscale * x`` is NaN and ``rint`` keeps the NaN.
    """
    np.multiply(x, iscale, out=t)
    if exact:
        li = nearest_int_bits(t)
        np.clip(li, lo, hi, out=li)
        t[...] = li
    else:
        np.rint(t, out=t)
        np.clip(t, lo, hi, out=t)
    np.multiply(wx, t, out=p)
    sumlx = seq_sum0(p)
    np.multiply(w, t, out=p)
    p *= t
    return sumlx, seq_sum0(p)


def make_qx_quants(x: F32, nmax: int, w: F32 | None = None) -> tuple[F32, F32, npt.NDArray[np.bool_]]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` for every column of ``x`` at once.

    ``x``: float32 ``(n, m)``, one sub-block per column (position-major). ``w``: C's ``qw``, the
    per-element weights (float32 ``(n, m)``), or None for ``qw = NULL`` (``w = x * x``). Returns the
    scales (float32 ``(m,)``), the ``iscale`` whose codes C leaves in ``L`` (``L = clamp(nearest_int(
    iscale * x), -nmax, nmax - 1) + nmax``) and the all-zero mask (``amax < GROUP_MAX_EPS``: scale 0,
    ``L`` 0). In the trials ``rint`` stands for ``nearest_int``: ``iscale * x`` stays below
    ``nmax + 1`` in magnitude where ``x`` is finite. Where it is not, ``iscale * x`` is NaN: without
    ``w`` the sums are NaN there whatever the code (``w`` is NaN or inf too); with ``w`` C's integer
    code of that NaN matters (a finite ``w * l * l``), so the columns holding inf or NaN are
    redone with the exact bit trick. The kept codes are made with the exact bit trick.
    """
    amax, mx = first_absmax(x, axis=0)
    zero = amax < GROUP_MAX_EPS
    mx[zero] = 1
    if w is None:
        return (*_make_qx(x, nmax, x * x, mx, zero, exact=False), zero)
    scale, best_is = _make_qx(x, nmax, w, mx, zero, exact=False)
    # (the subset reuses mx: NumPy's fmax.reduce of a single column holding a signalling NaN is wrong)
    bad = np.nonzero(~np.logical_and.reduce(np.isfinite(x), axis=0))[0]
    if bad.size:
        scale[bad], best_is[bad] = _make_qx(x[:, bad], nmax, w[:, bad], mx[bad], zero[bad], exact=True)
    return scale, best_is, zero


def _make_qx(x: F32, nmax: int, w: F32, mx: F32, zero: npt.NDArray[np.bool_], exact: bool) -> tuple[F32, F32]:
    """:func:`make_qx_quants`' scales and ``iscale`` given the weights ``w`` (float32 ``(n, m)``), the
    first element of largest ``|x|`` of each column (``mx``, 1 where ``zero``) and the all-zero mask;
    ``exact``: :func:`_qx_sums`."""
    wx = w * x
    t = np.empty_like(x)
    p = np.empty_like(x)
    lo, hi = -nmax, nmax - 1
    best_is = np.float32(-nmax) / mx
    sumlx, suml2 = _qx_sums(x, w, wx, best_is, lo, hi, t, p, exact)
    scale = np.where(suml2 != 0, sumlx / suml2, np.float32(0))
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(i)) / mx
        sumlx, suml2 = _qx_sums(x, w, wx, iscale, lo, hi, t, p, exact)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        if upd.any():
            bm = bitmask(upd)
            scale = select(bm, sumlx / suml2, scale)
            best = select(bm, scale * sumlx, best)
            best_is = select(bm, iscale, best_is)
    scale[zero] = 0
    return scale, best_is


def _kept_codes(x: F32, best_is: F32, zero: npt.NDArray[np.bool_], nmax: int) -> npt.NDArray[np.int32]:
    """The codes :func:`make_qx_quants` leaves in C's ``L`` (0..2*nmax-1; 0 in an all-zero column):
    int32 ``(n, m)`` from float32 ``x`` ``(n, m)`` and its ``best_is`` / ``zero`` ``(m,)``."""
    prod: F32 = x * best_is
    li = nearest_int_bits(prod)
    np.clip(li, -nmax, nmax - 1, out=li)
    li += nmax
    li[:, zero] = 0
    return li


def _requant(x: F32, d: F32, nmax: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.intp]]:
    """Codes ``clamp(nearest_int(x / d), -nmax, nmax - 1) + nmax`` and the columns where ``d == 0``.

    ``x`` float32 ``(n, m)``, ``d`` float32 ``(m,)``. C skips a sub-block whose ``d`` is 0 and keeps
    the codes it had: the caller puts those into the returned columns (their codes here are junk).
    """
    dz = d == 0
    d1 = d.copy()
    d1[dz] = 1
    q = x / d1
    li = nearest_int_bits(q)
    np.clip(li, -nmax, nmax - 1, out=li)
    li += nmax
    return li, np.nonzero(dz)[0]


def _position_major(xb: F32) -> F32:
    """float32 ``(blocks, 256)`` -> ``(16, blocks * 16)``: column ``16*b + j`` is sub-block ``j``."""
    return np.ascontiguousarray(xb.reshape(-1, 16).T)


def _from_position_major(lp: npt.NDArray[np.int32], nblocks: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`_position_major` for codes: uint8 ``(blocks, 256)``."""
    return lp.T.reshape(nblocks, QK_K).astype(np.uint8)


def _q6_k_blocks(xb: F32, qw: F32 | None = None) -> U8:
    """``quantize_row_q6_K_ref`` (``qw`` None) or ``quantize_row_q6_K_impl`` of float32 ``(m, 256)``
    -> uint8 ``(m, 210)``. ``qw``: the importance weights of the super-blocks, position-major
    (float32 ``(16, m * 16)``, see :func:`_position_major`), which ``make_qx_quants`` takes as its ``qw``
    (the rest of the two C functions is the same)."""
    m = xb.shape[0]
    xp = _position_major(xb)
    scale, best_is, zero = make_qx_quants(xp, 32, qw)
    scales = scale.reshape(m, 16)
    max_abs, max_scale = first_absmax(scales, axis=1)
    blank = max_abs < GROUP_MAX_EPS
    max_scale[blank] = 1
    iscale = np.float32(-128) / max_scale
    d = fp16_round(np.float32(1) / iscale)
    sc = np.minimum(nearest_int_bits(iscale[:, None] * scales), 127).astype(np.int8)
    dl = (d[:, None] * sc.astype(np.float32)).reshape(-1)
    li, keep = _requant(xp, dl, 32)
    if keep.size:  # make_qx_quants' codes (0 in an all-zero sub-block)
        li[:, keep] = _kept_codes(xp[:, keep], best_is[keep], zero[keep], 32)
    codes = _from_position_major(li, m)
    lr = codes.reshape(m, 2, 4, 32)
    out = np.empty((m, 210), dtype=np.uint8)
    out[:, :128] = ((lr[:, :, 0:2] & 15) | ((lr[:, :, 2:4] & 15) << 4)).reshape(m, 128)
    qh = (lr[:, :, 0] >> 4) | ((lr[:, :, 1] >> 4) << 2) | ((lr[:, :, 2] >> 4) << 4) | ((lr[:, :, 3] >> 4) << 6)
    out[:, 128:192] = qh.reshape(m, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = fp16_bytes(d)
    out[blank] = 0
    return out


def _q3_pass(x: F32, w: F32, wx: F32, lv: F32, sumlx: F32, suml2: F32, cols: npt.NDArray[np.intp] | slice,
             nmax: int) -> npt.NDArray[np.bool_]:
    """One refinement pass of ``make_q3_quants`` over the sub-blocks ``cols`` (or all: ``slice(None)``).

    Returns which of them changed.

    ``x``, ``w = x*x``, ``wx = w*x``: float32 ``(n, len(cols))``, gathered. ``lv`` (float32 codes
    ``(n, m)``, -nmax..nmax-1), ``sumlx`` and ``suml2`` (float32 ``(m,)``) are updated in place.
    """
    lc = lv[:, cols]
    sx = sumlx[cols]
    s2 = suml2[cols]
    changed = np.zeros(x.shape[1], dtype=np.bool_)
    for i in range(x.shape[0]):
        li = lc[i]
        slx = sx - wx[i] * li
        sl2 = s2 - (w[i] * li) * li
        ratio: F32 = (x[i] * sl2) / slx
        new = nearest_int_bits(ratio)
        np.maximum(new, -nmax, out=new)  # np.clip's Python wrapper costs more than two ufuncs
        np.minimum(new, nmax - 1, out=new)
        newf = new.astype(np.float32)
        cand = (slx > 0) & (newf != li)
        if not cand.any():
            continue
        # ~2% of the sub-blocks get a new code proposed at a position: finish only those
        j = np.nonzero(cand)[0]
        nf = newf[j]
        slx_j = slx[j] + wx[i, j] * nf
        sl2_j = sl2[j] + (w[i, j] * nf) * nf
        sx_j = sx[j]
        take = (sl2_j > 0) & ((slx_j * slx_j) * s2[j] > (sx_j * sx_j) * sl2_j)
        k = j[take]
        li[k] = nf[take]
        sx[k] = slx_j[take]
        s2[k] = sl2_j[take]
        changed[k] = True
    lv[:, cols] = lc
    sumlx[cols] = sx
    suml2[cols] = s2
    return changed


def make_q3_quants(x: F32, nmax: int) -> tuple[F32, F32, npt.NDArray[np.bool_]]:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)`` for every column of ``x`` at once.

    ``x``: float32 ``(n, m)``, one sub-block per column (position-major). Returns the scales
    (float32 ``(m,)``), the codes before C's final ``+ nmax`` (float32 ``(n, m)``, ``-nmax ..
    nmax - 1``) and the all-zero mask (``amax < GROUP_MAX_EPS``: scale 0 and C's ``L`` all 0, not
    ``nmax``). The refinement runs its 5 passes position by position, each position one vector
    operation over the sub-blocks still refining: a sub-block leaves after a pass that changed none
    of its codes (C's ``break``).
    """
    n, m = x.shape
    lv = np.empty((n, m), dtype=np.float32)
    sumlx = np.empty(m, dtype=np.float32)
    suml2 = np.empty(m, dtype=np.float32)
    zero = np.empty(m, dtype=np.bool_)
    still = []
    for c0 in range(0, m, Q3_COLUMNS):  # first pass by cache-sized column blocks
        cs = slice(c0, c0 + Q3_COLUMNS)
        xs = x[:, cs]
        amax, mx = first_absmax(xs, axis=0)
        zero[cs] = amax < GROUP_MAX_EPS
        mx[zero[cs]] = 1
        ls = lv[:, cs]
        prod: F32 = xs * (np.float32(-nmax) / mx)
        li = nearest_int_bits(prod)  # not rint: these codes are kept, and C's of a NaN come from its bits
        np.clip(li, -nmax, nmax - 1, out=li)
        ls[...] = li
        w = xs * xs
        wx = w * xs
        sumlx[cs] = seq_sum0(wx * ls)
        p = w * ls
        p *= ls
        suml2[cs] = seq_sum0(p)
        still.append(c0 + np.nonzero(_q3_pass(xs, w, wx, lv, sumlx, suml2, cs, nmax))[0])
    active = np.concatenate(still)
    for _ in range(4):  # the later passes over the few sub-blocks still changing, all at once
        if not active.size:
            break
        xs = x[:, active]
        w = xs * xs
        changed = _q3_pass(xs, w, w * xs, lv, sumlx, suml2, active, nmax)
        active = active[changed]
    scale = np.where(suml2 > 0, sumlx / suml2, np.float32(0))
    scale[zero] = 0
    return scale, lv, zero


def _q3_k_blocks(xb: F32) -> U8:
    """``quantize_row_q3_K_ref`` of float32 ``(m, 256)`` -> uint8 ``(m, 110)``."""
    m = xb.shape[0]
    xp = _position_major(xb)
    scale, lv, zero = make_q3_quants(xp, 4)
    scales = scale.reshape(m, 16)
    _, max_scale = first_absmax(scales, axis=1)
    nz = max_scale != 0
    max_scale[~nz] = 1
    iscale = np.float32(-32) / max_scale
    ls = nearest_int_bits(iscale[:, None] * scales).astype(np.int8).astype(np.int32)
    np.clip(ls, -32, 31, out=ls)
    ls += 32
    ls[~nz] = 0
    d = fp16_round(np.float32(1) / iscale)
    d[~nz] = 0
    dl = (d[:, None] * (ls - 32).astype(np.float32)).reshape(-1)
    li, keep = _requant(xp, dl, 4)
    if keep.size:  # make_q3_quants' codes (0 in an all-zero sub-block)
        l_make = lv[:, keep].astype(np.int32) + 4
        l_make[:, zero[keep]] = 0
        li[:, keep] = l_make
    return _q3_k_pack(li, ls, fp16_bytes(d))


def _q3_k_blocks_imatrix(xb: F32, qw: F32) -> U8:
    """``quantize_row_q3_K_impl`` with ``quant_weights`` of float32 ``(m, 256)`` -> uint8 ``(m, 110)``.

    ``qw``: the importance weights of the super-blocks, position-major (float32 ``(16, m * 16)``, see
    :func:`_position_major`). Per super-block: ``sigma2 = 2 * sum(x*x) / 256`` (a sequential sum over
    the 256 weights), element weights ``qw * sqrt(sigma2 + x*x)``; each sub-block's scale and codes
    from ``make_qx_quants(16, nmax=4, rmse_type=1, weights)``; the 16 scales themselves quantized by
    ``make_qx_quants(16, nmax=32, rmse_type=1, sw)`` (``sw`` each sub-block's sequential sum of
    weights): its codes are the 6-bit scale bytes (``Ls - 32`` the signed scale), its scale the
    super-block's ``d`` (fp16); the codes are re-made from ``d * (Ls - 32)`` as in the ref path.
    """
    m = xb.shape[0]
    xp = _position_major(xb)
    sq = xb * xb
    sumx2 = seq_sum0(sq.T)  # (256, m): C's loop over the super-block's 256 weights, in order
    sigma2 = np.float32(2) * sumx2 / np.float32(QK_K)
    weight = xp * xp
    weight += np.repeat(sigma2, 16)
    np.sqrt(weight, out=weight)
    weight *= qw
    sw = seq_sum0(weight) + np.float32(0)  # C starts from +0.0f: a sum of -0.0s is +0.0
    scale, best_is, zero = make_qx_quants(xp, 4, weight)
    scales = np.ascontiguousarray(scale.reshape(m, 16).T)  # (16, m): one super-block per column
    d_block, d_is, d_zero = make_qx_quants(scales, 32, np.ascontiguousarray(sw.reshape(m, 16).T))
    ls = _kept_codes(scales, d_is, d_zero, 32).T  # (m, 16), 0..63
    db = fp16_bytes(d_block)
    d = db.reshape(-1).view("<f2").astype(np.float32)  # C's fp16 (its one NaN) back to float32
    dl = (d[:, None] * (ls - 32).astype(np.float32)).reshape(-1)
    li, keep = _requant(xp, dl, 4)
    if keep.size:  # make_qx_quants' codes (0 in an all-zero sub-block)
        li[:, keep] = _kept_codes(xp[:, keep], best_is[keep], zero[keep], 4)
    return _q3_k_pack(li, ls, db)


def _q3_k_pack(li: npt.NDArray[np.int32], ls: npt.NDArray[np.int32], db: U8) -> U8:
    """``block_q3_K`` bytes: uint8 ``(m, 110)`` from the codes (int32 ``(16, m * 16)`` position-major,
    0..7), the scales (int32 ``(m, 16)``, 0..63, ``s + 32``) and ``d`` (uint8 ``(m, 2)``, fp16)."""
    m = ls.shape[0]
    codes = _from_position_major(li, m)
    out = np.empty((m, 110), dtype=np.uint8)
    high = (codes > 3).astype(np.uint8).reshape(m, 8, 32)
    out[:, :32] = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    lr = (codes & 3).reshape(m, 2, 4, 32)
    out[:, 32:96] = (lr[:, :, 0] | (lr[:, :, 1] << 2) | (lr[:, :, 2] << 4) | (lr[:, :, 3] << 6)).reshape(m, 64)
    lb = ls.astype(np.uint8)
    out[:, 96:104] = (lb[:, :8] & 15) | ((lb[:, 8:] & 15) << 4)
    hi = (lb >> 4).reshape(m, 4, 4)
    out[:, 104:108] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    out[:, 108:110] = db
    return out


def _encode_imatrix(x: F32, weights: F32, type_size: int, blocks: Callable[[F32, F32], U8], chunk: int) -> U8:
    """:func:`encode_by_chunks` of ``blocks(xb, qw)`` with the importance row ``weights`` (float32
    ``(n,)``, ``x`` float32 ``(..., n)``): chunks of whole rows (about ``chunk`` super-blocks, at least
    one row), each given the row's weights position-major, tiled over its rows (``qw`` of its first
    ``xb.shape[0]`` super-blocks). Returns uint8 ``(..., n // 256 * type_size)``.

    Raises:
        ValueError: ``weights`` is not float32-convertible of shape ``(n,)``, or ``x`` is 0-D or its
            last axis is not a multiple of 256 (:func:`encode_by_chunks`).
    """
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] % QK_K:
        return encode_by_chunks(x, QK_K, type_size, lambda xb: xb, chunk)  # raises its ValueError
    w = np.asarray(weights, dtype=np.float32)
    if w.shape != (x.shape[-1],):
        raise ValueError(f"expected importance weights of shape ({x.shape[-1]},), got {w.shape}")
    per_row = x.shape[-1] // QK_K
    rows = max(1, chunk // per_row) if per_row else 1
    qw = np.tile(_position_major(w.reshape(per_row, QK_K)), (1, rows))
    return encode_by_chunks(x, QK_K, type_size, lambda xb: blocks(xb, qw[:, : xb.shape[0] * 16]),
                            rows * max(per_row, 1))


class Q6_KCodec(Codec):
    """Q6_K: ``quantize_row_q6_K_ref`` (``quantize_q6_K`` without imatrix) or ``quantize_row_q6_K_impl``
    (with one), byte for byte."""

    ggml_type = GT.Q6_K
    uses_imatrix = True

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(..., n)`` (``n % 256 == 0``) -> uint8 ``(..., n // 256 * 210)``; ``weights``: the
        importance row (float32 ``(n,)``) or None. Raises ValueError on shapes (:func:`_encode_imatrix`)."""
        if weights is None:
            return encode_by_chunks(x, QK_K, 210, _q6_k_blocks, CHUNK_BLOCKS)
        return _encode_imatrix(x, weights, 210, _q6_k_blocks, CHUNK_BLOCKS)


class Q3_KCodec(Codec):
    """Q3_K: ``quantize_row_q3_K_ref`` (``quantize_q3_K`` without imatrix) or ``quantize_row_q3_K_impl``
    (with one), byte for byte."""

    ggml_type = GT.Q3_K
    uses_imatrix = True

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(..., n)`` (``n % 256 == 0``) -> uint8 ``(..., n // 256 * 110)``; ``weights``: the
        importance row (float32 ``(n,)``) or None. Raises ValueError on shapes (:func:`_encode_imatrix`)."""
        if weights is None:
            return encode_by_chunks(x, QK_K, 110, _q3_k_blocks, CHUNK_BLOCKS_Q3)
        return _encode_imatrix(x, weights, 110, _q3_k_blocks_imatrix, CHUNK_BLOCKS)

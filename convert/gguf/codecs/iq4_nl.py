"""NumPy encoder for GGML's IQ4_NL, byte-identical to llama-quantize's (with or without an importance matrix).

IQ4_NL is what llama-quantize writes for a Q2_K/Q3_K tensor whose rows are not a multiple of 256.
Matched revision: the llama.cpp copy vendored in llama-cpp-python 0.3.36
(``vendor/llama.cpp/ggml/src/ggml-quants.c``). llama-quantize goes through ``ggml_quantize_chunk``
-> ``quantize_iq4_nl`` -> ``quantize_row_iq4_nl_impl(32, 32, ..., kvalues_iq4nl, qw=NULL,
ntry=7)``. That is *not* ``quantize_row_iq4_nl_ref``, which passes ``ntry=-1`` (no trial scales,
other signs) and gives other bytes; this module matches the ``ntry=7`` path.

Block layout ``block_iq4_nl`` (18 bytes, 32 weights): ``d`` fp16 (little-endian), then ``qs[16]``:
byte ``j`` holds the 4-bit index of weight ``j`` (low nibble) and of weight ``j + 16`` (high nibble).
Value ``d * kvalues_iq4nl[index]``, ``kvalues_iq4nl = -127, -104, -83, -65, -49, -35, -22, -10, 1,
13, 25, 38, 53, 69, 89, 113``.

Algorithm (per block, float32): weights ``w = x * x``; ``max`` the first element of largest
``|x|``; a block with ``amax < GROUP_MAX_EPS`` (1e-15) gets ``d = 0`` (every index then is that of
0, 8). Otherwise ``d = -max / -127``, ``id = 1 / d``, each weight takes the table value nearest to
``id * x`` (``best_index_int8``: below -127 or above 113 the end values, a tie between two values
goes to the upper one), and the least-squares ``d = sumqx / sumq2`` (``sumqx = sum((w*q)*x)``,
``sumq2 = sum((w*q)*q)``); then the trial ``id = (itry - 127) / max`` for ``itry = -7 .. 7`` replace
``d`` when ``sumqx**2 > best * sumq2`` (``best = d * sumqx``). Last, ``d`` is stored as fp16 and the
indices are made again from the unrounded ``id = 1 / d`` (``0`` when ``d`` is 0).

Float32 order rules: sums are sequential loops over the 32 positions of the block (``s = 0;
s += v[i]``); ``w*q*x`` is ``(w * q) * x``; divisions stay divisions; the nearest-value test is
``x - val[mu-1] < val[mu] - x`` in float32. Vectorized over all blocks of a chunk (position-major
``(32, blocks)``, sums by ``np.add.reduce`` over axis 0, see
:func:`~convert.gguf.codecs.base.seq_sum0`); Python loops run over the 16 trials only. The bracket
``(val[mu-1], val[mu])`` of every weight comes from one ``take`` in a 243-entry table indexed by
``floor(al) + 128`` (the table values are integers) when the chunk is finite, from
``np.searchsorted`` otherwise (NaN). In the trials the nearest value is ``hi - down * (hi - lo)``
(exact: small integers); the scale choices are bit selects (:func:`~convert.gguf.codecs.base.select`).

With an importance matrix (``weights``: llama-quantize --imatrix, C's ``quant_weights``) the only change is
the weights: ``qw[j] * sqrtf(sigma2 + x[j]*x[j])`` with ``sigma2 = sum(x*x) * 2 / 32`` over the block (a
sequential float32 sum) instead of ``x * x`` (:func:`imatrix_weights`). That costs about nothing: 1.77 s
against 1.72 s unweighted on 4096 x 4096 float32, one thread, where C's weighted path took 3.0 s (another
day and load than the figure below).

Cost (4096 x 4096 float32, one thread, CPU time): about 5 s against C's 7.4 s (C's per-weight
binary search over 16 trials is slow; here a table ``take`` per weight and trial dominates).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from convert.gguf.codecs.base import GT, Codec, bitmask, encode_by_chunks, first_absmax, fp16_bytes, select, seq_sum0
from convert.gguf.codecs.legacy_imatrix import imatrix_blocks

__all__ = ["IQ4_NLCodec", "KVALUES_IQ4NL", "best_index_iq4nl", "block_scales", "encode_weighted", "imatrix_weights"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

QK4_NL = 32
GROUP_MAX_EPS = np.float32(1e-15)
#: ``kvalues_iq4nl`` of ggml-common.h, as float32.
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
#: Blocks per vectorized chunk (64 KiB of float32 per working array).
CHUNK_BLOCKS = 512


def _bracket_table() -> npt.NDArray[np.uint64]:
    """For ``k`` = 0..242 (``floor(al) + 128``, clamped): ``(val[mu-1], val[mu])`` as two float32
    bit patterns packed in one uint64 (low word, high word), ``mu`` as in :data:`_MU`."""
    mu = np.clip(np.searchsorted(KVALUES_IQ4NL, np.arange(-128, 115, dtype=np.float32), side="right"), 1, 15)
    pair = np.stack([KVALUES_IQ4NL[mu - 1], KVALUES_IQ4NL[mu]], axis=1)
    return np.ascontiguousarray(pair).view(np.uint64).reshape(-1)


#: :func:`_bracket_table`: one ``take`` gives both neighbours of ``al`` (the bracket C's binary
#: search ends on), indexed by ``clip(al + 128, 0, 242)`` truncated (values are integers, so the
#: count of values ``<= al`` is that of values ``<= floor(al)``).
_BRACKETS = _bracket_table()
#: C's ``mu`` (count of table values ``<= k - 128``, kept in 1..15) for ``k`` = 0..242.
_MU = np.clip(np.searchsorted(KVALUES_IQ4NL, np.arange(-128, 115, dtype=np.float32), side="right"), 1, 15)


def _brackets(al: F32, finite: bool) -> tuple[npt.NDArray[np.intp] | None, F32, F32, npt.NDArray[np.bool_]]:
    """C's final bracket for each ``al``: (``mu`` or None, ``val[mu-1]``, ``val[mu]``, take the lower).

    ``mu`` is the count of table values ``<= al``, kept in 1..15 (where C's binary search ends);
    the lower value is taken when ``al - val[mu-1] < val[mu] - al``. With ``finite`` (no NaN in
    ``al``; infinities are fine) both values come from one table ``take`` on ``floor(al)`` and ``mu``
    is not made (None); otherwise from ``np.searchsorted``, ~20x slower, which places NaN last as
    C's search does.
    """
    if finite:
        t = al + np.float32(128)
        np.clip(t, 0, 242, out=t)
        k = t.astype(np.int32)
        pair = _BRACKETS.take(k).view(np.float32).reshape(*k.shape, 2)
        lo, hi = pair[..., 0], pair[..., 1]
        mu = None
    else:
        mu = np.searchsorted(KVALUES_IQ4NL, al, side="right")
        np.clip(mu, 1, 15, out=mu)
        lo = KVALUES_IQ4NL[mu - 1]
        hi = KVALUES_IQ4NL[mu]
    return mu, lo, hi, (al - lo) < (hi - al)


def best_index_iq4nl(al: F32, finite: bool = False) -> tuple[npt.NDArray[np.intp], F32]:
    """``best_index_int8(16, kvalues_iq4nl, al)`` elementwise: (indices, their table values).

    The index is ``mu - 1`` or ``mu`` of :func:`_brackets`; that also gives C's answer below the
    first value, above the last and for NaN (15). ``finite``: ``al`` holds no NaN (faster path).
    """
    mu, lo, hi, down = _brackets(al, finite)
    if mu is None:
        k = np.clip(al + np.float32(128), 0, 242).astype(np.int32)
        mu = _MU.take(k)
    mu -= down
    return mu, select(down, lo, hi)


def _sums(x: F32, w: F32, iscale: F32, finite: bool) -> tuple[F32, F32]:
    """``(sumqx, sumq2)`` of the table values nearest to ``iscale * x``; ``x``, ``w`` ``(32, m)``.

    C's sums start from +0.0: :func:`seq_sum0` plus +0.0. That changes only an all -0.0 sum (possible with
    importance-matrix weights of 0; its sign reaches ``d``), which NumPy's ``add.reduce`` already starts
    from +0.0: the +0.0 keeps C's sign should a NumPy start from the first term."""
    al: F32 = x * iscale
    _, lo, hi, down = _brackets(al, finite and bool(np.isfinite(iscale).all()))
    q = hi - down * (hi - lo)  # exact: small integers (select() bit for bit would cost 5 passes, this 3)
    wq = w * q
    sumqx, sumq2 = seq_sum0(wq * x), seq_sum0(wq * q)
    sumqx += np.float32(0)
    sumq2 += np.float32(0)
    return sumqx, sumq2


def imatrix_weights(xp: F32, qwp: F32, superblock: int) -> F32:
    """``quantize_row_iq4_nl_impl``'s weights with ``quant_weights``: ``qw[j] * sqrtf(sigma2 + x[j]*x[j])`` with
    ``sigma2 = sum(x*x) * (2 / superblock)`` over each super-block (a sequential float32 sum from 0).

    ``xp``, ``qwp``: float32 ``(32, sub-blocks)`` position-major values and their imatrix values, the
    ``superblock // 32`` sub-blocks of a super-block adjacent (sub-block ``k`` of super-block ``k // (superblock
    // 32)``). Returns float32 ``(32, sub-blocks)``.
    """
    sq = xp * xp
    per = superblock // QK4_NL
    m = xp.shape[1] // per
    # the super-block's values in C's order: sub-block by sub-block, position by position
    sigma2 = seq_sum0(np.ascontiguousarray(sq.reshape(QK4_NL, m, per).transpose(2, 0, 1)).reshape(superblock, m))
    sigma2 *= np.float32(2.0 / superblock)
    w = sq + np.repeat(sigma2, per)
    np.sqrt(w, out=w)
    w *= qwp
    return w


def block_scales(xp: F32, finite: bool, w: F32 | None = None) -> F32:
    """The scale ``d`` of each 32-weight block after the 15 trial scales (``quantize_row_iq4_nl_impl``'s
    first loop, ``ntry=7``); ``xp`` position-major ``(32, blocks)``; ``w`` the weights, same shape
    (:func:`imatrix_weights`; None: no importance matrix, ``x * x``); 0 for a block whose largest ``|x|`` is
    below ``GROUP_MAX_EPS`` (IQ4_XS's ``scales[ib]``)."""
    amax, mx = first_absmax(xp, axis=0)
    zero = amax < GROUP_MAX_EPS
    mx[zero] = 1
    if w is None:
        w = xp * xp
    d = (-mx) / np.float32(-127)
    sumqx, sumq2 = _sums(xp, w, np.float32(1) / d, finite)
    d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0))
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = _sums(xp, w, np.float32(itry - 127) / mx, finite)
        upd = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        if upd.any():
            bm = bitmask(upd)
            d = select(bm, sumqx / sumq2, d)
            best = select(bm, d * sumqx, best)
    d[zero] = 0
    return d


def _iq4_nl_blocks(xb: F32, qw: F32 | None = None) -> U8:
    """``quantize_row_iq4_nl_impl(32, 32, ..., ntry=7)`` of float32 ``(m, 32)`` -> uint8 ``(m, 18)``; ``qw``: the
    imatrix values of each block's columns, float32 ``(m, 32)``, or None."""
    m = xb.shape[0]
    xp = np.ascontiguousarray(xb.T)
    finite = bool(np.isfinite(xp).all())
    d = block_scales(xp, finite, None if qw is None else imatrix_weights(xp, qw.T, QK4_NL))
    dz = d == 0
    d1 = d.copy()
    d1[dz] = 1
    iscale = np.float32(1) / d1
    iscale[dz] = 0
    al: F32 = xp * iscale
    idx, _ = best_index_iq4nl(al, finite and bool(np.isfinite(iscale).all()))
    codes = idx.T.astype(np.uint8)
    out = np.empty((m, 18), dtype=np.uint8)
    out[:, :2] = fp16_bytes(d)
    out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out


def encode_weighted(
    x: F32, weights: F32, block: int, type_size: int, blocks: Callable[[F32, F32], U8], chunk: int,
) -> U8:
    """:func:`encode_by_chunks` of ``blocks(xb, qwb)``, which also takes the imatrix values of each block's
    columns (float32 ``(blocks, block)``, from ``weights``, float32 ``(n,)``: :func:`imatrix_blocks`).

    Raises:
        ValueError: the last axis of ``x`` is not a multiple of ``block``, or ``weights`` not ``(n,)``.
    """
    x = np.asarray(x)
    qw = imatrix_blocks(weights, x.shape[-1] if x.ndim else 0, block)
    done = 0

    def encode(xb: F32) -> U8:
        nonlocal done
        pos = np.arange(done, done + xb.shape[0]) % qw.shape[0]
        done += xb.shape[0]
        return blocks(xb, qw[pos])

    return encode_by_chunks(x, block, type_size, encode, chunk)


class IQ4_NLCodec(Codec):
    """IQ4_NL as llama-quantize writes it (``quantize_iq4_nl``, ``ntry=7``), byte for byte, with or without an
    importance matrix."""

    ggml_type = GT.IQ4_NL
    uses_imatrix = True

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(..., n)`` (``n % 32 == 0``) -> uint8 ``(..., n // 32 * 18)``; ``weights``: the importance
        matrix row, float32 ``(n,)`` (:meth:`Codec.quantize`), or None.

        Raises:
            ValueError: ``n`` is not a multiple of 32, or ``weights`` is not ``(n,)``.
        """
        if weights is None:
            return encode_by_chunks(x, QK4_NL, 18, _iq4_nl_blocks, CHUNK_BLOCKS)
        return encode_weighted(x, weights, QK4_NL, 18, _iq4_nl_blocks, CHUNK_BLOCKS)

"""NumPy encoder for GGML's IQ4_XS, byte-identical to llama-quantize's (with or without an importance matrix).

Matched revision: the llama.cpp copy vendored in llama-cpp-python 0.3.36
(``vendor/llama.cpp/ggml/src/ggml-quants.c``): ``ggml_quantize_chunk`` -> ``quantize_iq4_xs`` ->
``quantize_row_iq4_nl_impl(QK_K=256, 32, ..., kvalues_iq4nl, qw=NULL, ntry=7)`` per super-block.

Block layout ``block_iq4_xs`` (136 bytes, 256 weights): ``d`` fp16, ``scales_h`` uint16 (2 high bits of
each of the 8 sub-block scales, sub-block ``ib`` at bits ``2*ib``), ``scales_l[4]`` (4 low bits, sub-block
``ib`` in the low nibble of byte ``ib/2`` when ``ib`` is even, the high one when odd), ``qs[128]`` (per
sub-block of 32, byte ``j`` holds the index of weight ``j`` low and of weight ``j + 16`` high). Value
``d * (l - 32) * kvalues_iq4nl[index]``.

Algorithm (float32): each sub-block of 32 gets IQ4_NL's scale search
(:func:`~convert.gguf.codecs.iq4_nl.block_scales`: weights ``x * x``, 15 trial scales, least squares;
0 for an all-tiny sub-block); ``max_scale`` is the first sub-block scale of largest ``|s|`` (+0.0 when
every one is 0), ``d = -max_scale / 32`` (so an all-zero super-block stores -0.0), ``id = 1 / d`` (0 when
``d`` is 0), ``l = clamp(nearest_int(id * s), -32, 31)``, ``dl = d * l``, ``idl = 1 / dl`` (0 when 0) and
every weight takes the table index nearest to ``idl * x`` (:func:`~convert.gguf.codecs.iq4_nl.best_index_iq4nl`).
``d`` is stored as fp16; ``id`` and ``dl`` use the unrounded ``d``. With an importance matrix (``weights``) the
sub-block searches weigh by ``qw[j] * sqrtf(sigma2 + x[j]*x[j])``, ``sigma2 = sum(x*x) * 2 / 256`` over the
super-block (:func:`~convert.gguf.codecs.iq4_nl.imatrix_weights`); the rest is unchanged (and so is the cost:
1.89 s against 1.82 s on 4096 x 4096 float32, one thread; C's weighted path 3.1 s). Vectorized over all
super-blocks of a chunk, sub-block scales position-major ``(32, 8 * blocks)``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from convert.gguf.codecs.base import GT, Codec, encode_by_chunks, fp16_bytes, nearest_int_bits
from convert.gguf.codecs.iq4_nl import best_index_iq4nl, block_scales, encode_weighted, imatrix_weights

__all__ = ["IQ4_XSCodec"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

QK_K = 256
#: Bytes of ``block_iq4_xs``.
TYPE_SIZE = 136
#: Super-blocks per vectorized chunk (the sub-blocks' working arrays stay near IQ4_NL's 512 blocks).
CHUNK_BLOCKS = 64


def _iq4_xs_blocks(xb: F32, qw: F32 | None = None) -> U8:
    """``quantize_row_iq4_nl_impl(256, 32, ..., ntry=7)`` of float32 ``(m, 256)`` -> uint8 ``(m, 136)``; ``qw``: the
    imatrix values of each super-block's columns, float32 ``(m, 256)``, or None."""
    m = xb.shape[0]
    xp = np.ascontiguousarray(xb.reshape(m * 8, 32).T)  # (32, sub-blocks), sub-block k = 8 * block + ib
    finite = bool(np.isfinite(xp).all())
    w = None if qw is None else imatrix_weights(xp, qw.reshape(m * 8, 32).T, QK_K)
    s = block_scales(xp, finite, w).reshape(m, 8)
    with np.errstate(invalid="ignore"):
        a = np.abs(s)
        a[np.isnan(a)] = 0  # C's `abs_d > amax_scale` is false for a NaN scale (w = x*x overflowed)
    k = np.argmax(a, axis=1)  # the first of the largest |s| (C: strictly greater than the best so far)
    max_scale = s[np.arange(m), k]
    max_scale[a[np.arange(m), k] == 0] = np.float32(0)  # C's initial +0.0 when no |s| is above 0
    d = -max_scale / np.float32(32)
    dz = d == 0
    id_ = np.float32(1) / np.where(dz, np.float32(1), d)
    id_[dz] = 0
    with np.errstate(invalid="ignore"):
        lv = np.clip(nearest_int_bits(id_[:, None] * s), -32, 31)  # C's bits: NaN scales too
    dl = d[:, None] * lv.astype(np.float32)
    dlz = dl == 0
    idl = np.float32(1) / np.where(dlz, np.float32(1), dl)
    idl[dlz] = 0
    al: F32 = xp * idl.reshape(-1)[None, :]
    idx, _ = best_index_iq4nl(al, finite and bool(np.isfinite(idl).all()))
    codes = idx.T.astype(np.uint8).reshape(m, 8, 32)
    lu = (lv + 32).astype(np.uint16)
    out = np.empty((m, TYPE_SIZE), dtype=np.uint8)
    out[:, :2] = fp16_bytes(d)
    scales_h = np.zeros(m, dtype=np.uint16)
    for ib in range(8):
        scales_h |= (lu[:, ib] >> 4) << (2 * ib)
    out[:, 2:4] = scales_h.astype("<u2").view(np.uint8).reshape(m, 2)
    low = (lu & 0xF).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)
    out[:, 8:] = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).reshape(m, 128)
    return out


class IQ4_XSCodec(Codec):
    """IQ4_XS as llama-quantize writes it (``quantize_iq4_xs``), byte for byte, with or without an importance
    matrix."""

    ggml_type = GT.IQ4_XS
    uses_imatrix = True

    @classmethod
    def quantize(cls, x: F32, weights: F32 | None = None) -> U8:
        """float32 ``(..., n)`` (``n % 256 == 0``) -> uint8 ``(..., n // 256 * 136)``; ``weights``: the importance
        matrix row, float32 ``(n,)`` (:meth:`Codec.quantize`), or None.

        Raises:
            ValueError: ``n`` is not a multiple of 256, or ``weights`` is not ``(n,)``.
        """
        if weights is None:
            return encode_by_chunks(x, QK_K, TYPE_SIZE, _iq4_xs_blocks, CHUNK_BLOCKS)
        return encode_weighted(x, weights, QK_K, TYPE_SIZE, _iq4_xs_blocks, CHUNK_BLOCKS)

"""NumPy encoders of the legacy GGML types (Q8_0 first), byte-identical to gguf-py's.

gguf-py's ``gguf/quants.py`` reproduces llama.cpp's ``quantize_row_q8_0_ref`` (``ggml-quants.c``) in
about twelve whole-array passes (abs, max, divide, where, multiply, ``np_roundf``'s five to seven,
astype, concatenate), ~9 ns a value. Here each chunk of blocks (:data:`CHUNK_BLOCKS`) goes through
about six cheap passes with preallocated scratch, and the result is written straight into the
output array.

Block layouts (little-endian; a block is 32 consecutive values of a row):

- Q8_0, 34 bytes: ``d`` float16 (2 bytes), then ``qs`` 32 × int8; ``x[i] ~= d * qs[i]`` with
  ``d = max|x| / 127`` and ``qs[i] = roundf(x[i] / d)`` (round half away from zero), 0 when ``d == 0``.

Identity with gguf-py, value for value: the same float32 operations in the same order (``d`` the
float32 quotient, ``id = 1 / d`` or 0, the product ``x * id``), the same ``float16`` conversion of
``d``, and the rounding of :func:`convert.codec_base.round_half_away_into`, which equals
``np_roundf`` for every finite float32. Blocks whose ``id`` is not finite (``d < 2**-128``: a block
of subnormals) are handed to gguf-py itself (:func:`convert.codec_base.reference_blocks`), since
there the reference casts NaN to int8 and we would cast inf (the same byte on x86-64, but NumPy
does not promise it).
"""

from __future__ import annotations

from typing import ClassVar

import gguf
import numpy as np
import numpy.typing as npt

from .codec_base import (
    Codec,
    block_absmax,
    encode_into_by_chunks,
    inverse_scale,
    reference_blocks,
    round_half_away_into,
)

__all__ = ["CHUNK_BLOCKS", "Q8_0Codec"]

GT = gguf.GGMLQuantizationType
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

#: Blocks of 32 values per chunk (512 KiB of float32 input; scratch 1.75 MiB): measured best of
#: 1024..16384 on a 1 MiB-L2 EPYC (smaller chunks pay NumPy's per-call overhead, ~100 us a chunk).
CHUNK_BLOCKS = 4096

QK = 32


def _fp16_into(d: F32, ob: U8) -> None:
    """Write float32 ``(blocks,)`` as little-endian float16 into the first two bytes of each row of
    uint8 ``(blocks, type_size)`` (``type_size`` even; NumPy's float16 cast, as gguf-py's
    ``astype(np.float16)``: round to nearest even, inf on overflow)."""
    ob.view("<f2")[:, 0] = d


class Q8_0Codec(Codec):
    """Q8_0: gguf-py's ``Q8_0.quantize_blocks`` (llama.cpp ``quantize_row_q8_0_ref``) and
    ``Q8_0.dequantize_blocks``, byte for byte and bit for bit."""

    ggml_type: ClassVar[gguf.GGMLQuantizationType] = GT.Q8_0

    @classmethod
    def quantize(cls, x: F32) -> U8:
        """float32 ``(rows, n)`` (``n % 32 == 0``) -> uint8 ``(rows, n // 32 * 34)``."""
        scratch = np.empty(CHUNK_BLOCKS * QK * 3 // 2, dtype=np.int32)
        v = np.empty((CHUNK_BLOCKS, QK), dtype=np.float32)
        t = np.empty((CHUNK_BLOCKS, QK), dtype=np.float32)

        def encode(xb: F32, ob: U8) -> None:
            n = xb.shape[0]
            d = block_absmax(xb, scratch) / np.float32(127)
            inv, bad = inverse_scale(d)
            np.multiply(xb, inv[:, None], out=v[:n])
            round_half_away_into(v[:n], t[:n])
            np.copyto(ob[:, 2:].view(np.int8), t[:n], casting="unsafe")  # truncation toward zero
            _fp16_into(d, ob)
            reference_blocks(cls.ggml_type, xb, ob, bad)

        return encode_into_by_chunks(x, QK, 34, encode, CHUNK_BLOCKS)

    @classmethod
    def dequantize(cls, data: U8) -> F32:
        """uint8 ``(rows, n // 32 * 34)`` -> float32 ``(rows, n)``: ``float32(qs) * float32(d)``."""
        data = np.ascontiguousarray(data).view(np.uint8)
        blocks = data.reshape(-1, 34)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        out = np.empty((blocks.shape[0], QK), dtype=np.float32)
        np.multiply(blocks[:, 2:].view(np.int8), d, out=out, dtype=np.float32)
        return out.reshape(*data.shape[:-1], data.shape[-1] // 34 * QK)

"""The GGML codec base class and the float32 helpers byte identity with ggml-quants.c needs.

:class:`Codec` is one GGML quantization type (``quantize``/``dequantize``); the table of codecs is
:data:`convert.ggml_codecs.CODECS`. Byte identity with llama.cpp's C reference quantizers needs
their float32 operation order, which the helpers give: :func:`nearest_int` (llama.cpp's
``nearest_int``: round half to even, valid for ``|x| < 2**22``), :func:`fp16_round`
(``GGML_FP32_TO_FP16`` and back: round to nearest even) and :func:`seq_sum` (a sequential float32
loop, not NumPy's pairwise ``sum``). No fused multiply-add: the x86-64 build of ``ggml-quants.c``
has none, and NumPy's ``a * b + c`` rounds twice as C does.
"""

from __future__ import annotations

from typing import ClassVar

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["Codec", "fp16_round", "nearest_int", "seq_sum"]

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


class Codec:
    """One GGML quantization type: ``quantize`` float32 rows, ``dequantize`` them back.

    Subclasses set :attr:`ggml_type`; the block size (elements) and type size (bytes per block)
    are gguf-py's ``GGML_QUANT_SIZES``. This base class encodes and decodes with gguf-py.
    """

    ggml_type: ClassVar[gguf.GGMLQuantizationType]

    @classmethod
    def block_size(cls) -> int:
        """Elements per block."""
        return gguf.GGML_QUANT_SIZES[cls.ggml_type][0]

    @classmethod
    def type_size(cls) -> int:
        """Bytes per block."""
        return gguf.GGML_QUANT_SIZES[cls.ggml_type][1]

    @classmethod
    def quantize(cls, x: F32) -> U8:
        """float32 ``(rows, n)`` -> uint8 ``(rows, n // block_size * type_size)``."""
        data = np.ascontiguousarray(gguf.quants.quantize(np.asarray(x, dtype=np.float32), cls.ggml_type))
        return data.view(np.uint8)  # F32/F16 come back as float arrays: their bytes

    @classmethod
    def dequantize(cls, data: U8) -> F32:
        """uint8 ``(rows, nbytes)`` -> float32 ``(rows, nbytes // type_size * block_size)``."""
        return gguf.quants.dequantize(np.ascontiguousarray(data).view(np.uint8), cls.ggml_type)


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


def first_absmax(x: F32, axis: int = -1) -> tuple[F32, F32]:
    """``(amax, max)`` of C's ``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` loop.

    ``amax`` starts at 0, so ``max`` is the first element of largest ``|x|`` (its sign kept) and 0
    when every ``|x|`` is 0; a NaN never wins (``fabsf(NaN) > amax`` is false). Both float32, with
    ``axis`` removed.
    """
    ax = np.abs(np.asarray(x, dtype=np.float32))
    ax[np.isnan(ax)] = 0
    idx = np.expand_dims(np.argmax(ax, axis=axis), axis)
    amax = np.take_along_axis(ax, idx, axis=axis).squeeze(axis)
    mx = np.take_along_axis(np.asarray(x, dtype=np.float32), idx, axis=axis).squeeze(axis)
    return amax, np.where(amax > 0, mx, np.float32(0)).astype(np.float32)


__all__ += ["first_absmax", "nearest_int_bits"]

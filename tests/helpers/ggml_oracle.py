"""ctypes access to ggml's C quantizers: the library llama-cpp-python 0.3.36 installs (libggml-base.so,
the llama.cpp revision our encoders are written against).

:meth:`GgmlOracle.quantize` calls ``ggml_quantize_chunk``, which is what llama-quantize calls per chunk
of rows, with or without an importance matrix (``quant_weights``: one float32 per column, the same for
every row of the call); :meth:`GgmlOracle.dequantize` calls ``dequantize_row_<type>``.
Tests using it skip without llama_cpp (:func:`ggml_oracle`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

import gguf
import numpy as np
import pytest

GT = gguf.GGMLQuantizationType

#: GGML type -> its C dequantizer.
DEQUANT = {
    GT.Q4_0: "dequantize_row_q4_0", GT.Q4_1: "dequantize_row_q4_1", GT.Q5_0: "dequantize_row_q5_0",
    GT.Q5_1: "dequantize_row_q5_1", GT.Q8_0: "dequantize_row_q8_0", GT.Q2_K: "dequantize_row_q2_K",
    GT.Q3_K: "dequantize_row_q3_K", GT.Q4_K: "dequantize_row_q4_K", GT.Q5_K: "dequantize_row_q5_K",
    GT.Q6_K: "dequantize_row_q6_K", GT.IQ4_NL: "dequantize_row_iq4_nl", GT.IQ4_XS: "dequantize_row_iq4_xs",
}


class GgmlOracle:
    """ctypes view of libggml-base.so's ``ggml_quantize_chunk`` and ``dequantize_row_*``."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("llama_cpp")
        assert spec is not None and spec.origin is not None
        self.lib = ctypes.CDLL(os.path.join(os.path.dirname(spec.origin), "lib", "libggml-base.so"))
        f = self.lib.ggml_quantize_chunk
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_void_p]
        for name in DEQUANT.values():
            g = getattr(self.lib, name)
            g.restype = None
            g.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(self, t: GT, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """float32 ``(rows, n)`` -> uint8 ``(rows, row bytes)``; ``imatrix``: float32 ``(n,)`` or None."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        out = np.zeros((x.shape[0], x.shape[1] // bs * ts), dtype=np.uint8)
        w = None
        if imatrix is not None:
            w = np.ascontiguousarray(imatrix, dtype=np.float32)
            assert w.shape == (x.shape[1],)
        n = self.lib.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                         None if w is None else w.ctypes.data)
        assert n == out.size
        return out

    def dequantize(self, t: GT, q: np.ndarray) -> np.ndarray:
        """uint8 ``(rows, row bytes)`` -> float32 ``(rows, n)``."""
        q = np.ascontiguousarray(q, dtype=np.uint8)
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        out = np.zeros((q.shape[0], q.shape[1] // ts * bs), dtype=np.float32)
        getattr(self.lib, DEQUANT[t])(q.ctypes.data, out.ctypes.data, out.size)
        return out


def ggml_oracle() -> GgmlOracle:
    """The oracle, or a skip without llama_cpp (for a module-scoped fixture)."""
    pytest.importorskip("llama_cpp")
    return GgmlOracle()

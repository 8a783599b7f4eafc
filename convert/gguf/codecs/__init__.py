"""GGML codecs: one class per GGML quantization type, with ``quantize`` and ``dequantize``.

The GGUF writer (:mod:`convert.gguf.encode`) encodes every tensor through :func:`codec`; a new type
is one class and one row in :data:`CODECS` (as gguf-py's ``gguf/quants.py``).

- F32, F16, BF16: gguf-py's own encoders (``gguf.quants.quantize``).
- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: our NumPy encoders (:mod:`convert.gguf.codecs.legacy`, several times
  faster), byte-identical to gguf-py's, which reproduce llama.cpp's ``quantize_row_*_ref``; Q8_0
  also decodes with ours, the others with gguf-py's ``dequantize``.
- Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS: our NumPy encoders (:mod:`convert.gguf.codecs.kquant_minmax`,
  :mod:`convert.gguf.codecs.kquant_scale`, :mod:`convert.gguf.codecs.iq4_nl`, :mod:`convert.gguf.codecs.iq4_xs`),
  byte-identical to ``quantize_row_q{2..6}_K_ref`` of the llama.cpp revision vendored in llama-cpp-python
  0.3.36 (IQ4_NL / IQ4_XS: ``quantize_iq4_nl`` / ``quantize_iq4_xs``); decoding is gguf-py's ``dequantize``.
- With an importance matrix row (``quantize(x, weights)``, ``Codec.uses_imatrix``): Q2_K..Q6_K, Q4_0..Q5_1,
  IQ4_NL and IQ4_XS encode as ggml's ``quantize_row_*_impl`` with ``quant_weights`` (what ``llama-quantize
  --imatrix`` runs; Q4_0..Q5_1's weighted scale search: :mod:`convert.gguf.codecs.legacy_imatrix`); the other types
  ignore it, as ``ggml_quantize_chunk`` does.

Shapes: ``quantize`` takes float32 ``(rows, n_per_row)`` (``n_per_row`` a multiple of the block
size) and returns uint8 ``(rows, n_per_row // block_size * type_size)``; ``dequantize`` inverts it
(float32, same shape as the input of ``quantize``).

The base class and the float32 helpers byte identity needs are in :mod:`convert.gguf.codecs.base`.
"""

from __future__ import annotations

import gguf

from convert.gguf.codecs.base import Codec
from convert.gguf.codecs.iq4_nl import IQ4_NLCodec
from convert.gguf.codecs.iq4_xs import IQ4_XSCodec
from convert.gguf.codecs.kquant_minmax import Q2_KCodec, Q4_KCodec, Q5_KCodec
from convert.gguf.codecs.kquant_scale import Q3_KCodec, Q6_KCodec
from convert.gguf.codecs.legacy import Q4_0Codec, Q4_1Codec, Q5_0Codec, Q5_1Codec, Q8_0Codec

__all__ = ["CODECS", "codec"]

GT = gguf.GGMLQuantizationType


class F32Codec(Codec):
    ggml_type = GT.F32


class F16Codec(Codec):
    ggml_type = GT.F16


class BF16Codec(Codec):
    ggml_type = GT.BF16


#: GGML type -> its codec.
CODECS: dict[gguf.GGMLQuantizationType, type[Codec]] = {
    c.ggml_type: c
    for c in (
        F32Codec, F16Codec, BF16Codec, Q8_0Codec, Q4_0Codec, Q4_1Codec, Q5_0Codec, Q5_1Codec,
        Q2_KCodec, Q3_KCodec, Q4_KCodec, Q5_KCodec, Q6_KCodec, IQ4_NLCodec, IQ4_XSCodec,
    )
}


def codec(ggml_type: gguf.GGMLQuantizationType) -> type[Codec]:
    """The codec of a GGML type.

    Raises:
        KeyError: a type no codec encodes (planning only chooses types of :data:`CODECS`).
    """
    return CODECS[ggml_type]

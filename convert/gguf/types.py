"""The names of the GGUF output types: what ``--to gguf:TYPE`` may say, and what each one means.

Light on purpose: the command-line parser and :func:`convert.options.target_for` import this module
and nothing else of :mod:`convert.gguf` (no planning, tokenizer or codecs).

- :data:`OUTPUT_TYPES`: every ``TYPE`` (lower case) with the GGML type of its matrices and its
  ``general.file_type``: ``convert_hf_to_gguf.py``'s ``--outtype`` values (``f32``, ``f16``, ``bf16``,
  ``q8_0``) and llama-quantize's file types (:data:`FILE_TYPES`: ``q4_0`` ... ``q6_k``).
- :data:`FLOAT32_INPUT`: the types made from the exact float32 dequantized weights.

Rule raised here (see docs/errors.md): GGUF-002, the output type is one of :data:`OUTPUT_TYPES`
(:class:`GgufTypeError`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import gguf

from formats.errors import GgufTypeError

__all__ = ["DEFAULT_OUTPUT_TYPE", "FILE_TYPES", "FLOAT32_INPUT", "OUTPUT_TYPES", "FileType", "parse_output_type"]

GT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class FileType:
    """One llama-quantize file type.

    Attributes:
        name: llama.cpp's name (``Q4_K_M``).
        ftype: the ``llama_ftype`` (``general.file_type``).
        default: ``llama_ftype_get_default_type``: the type of a tensor no rule changes.
    """

    name: str
    ftype: gguf.LlamaFileType
    default: gguf.GGMLQuantizationType


#: ``--to gguf:TYPE`` name (lower case) -> file type, for the mixes :func:`convert.gguf.mix.mix_types` knows.
FILE_TYPES: dict[str, FileType] = {
    ft.name.lower(): ft
    for ft in (
        FileType("Q4_0", FT.MOSTLY_Q4_0, GT.Q4_0),
        FileType("Q4_1", FT.MOSTLY_Q4_1, GT.Q4_1),
        FileType("Q5_0", FT.MOSTLY_Q5_0, GT.Q5_0),
        FileType("Q5_1", FT.MOSTLY_Q5_1, GT.Q5_1),
        FileType("Q2_K", FT.MOSTLY_Q2_K, GT.Q2_K),
        FileType("Q3_K_S", FT.MOSTLY_Q3_K_S, GT.Q3_K),
        FileType("Q3_K_M", FT.MOSTLY_Q3_K_M, GT.Q3_K),
        FileType("Q3_K_L", FT.MOSTLY_Q3_K_L, GT.Q3_K),
        FileType("Q4_K_S", FT.MOSTLY_Q4_K_S, GT.Q4_K),
        FileType("Q4_K_M", FT.MOSTLY_Q4_K_M, GT.Q4_K),
        FileType("Q5_K_S", FT.MOSTLY_Q5_K_S, GT.Q5_K),
        FileType("Q5_K_M", FT.MOSTLY_Q5_K_M, GT.Q5_K),
        FileType("Q6_K", FT.MOSTLY_Q6_K, GT.Q6_K),
    )
}


#: ``--to gguf:TYPE`` names (lower case) -> (GGML type of the matrices, ``general.file_type``); for
#: llama-quantize's file types (:data:`FILE_TYPES`) the mix's default type.
OUTPUT_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (GT.F32, FT.ALL_F32),
    "f16": (GT.F16, FT.MOSTLY_F16),
    "bf16": (GT.BF16, FT.MOSTLY_BF16),
    "q8_0": (GT.Q8_0, FT.MOSTLY_Q8_0),
    # llama-quantize's file types: the default type of the mix (convert.gguf.mix decides per tensor)
    **{name: (ft.default, ft.ftype) for name, ft in FILE_TYPES.items()},
}
DEFAULT_OUTPUT_TYPE = "f16"
#: Output types whose writer gets every weight as exact float32 (a 4-bit layer's fp32 products
#: ``quant_map[code] * absmax`` before any 16-bit rounding, so ``f32`` holds more than the bf16/f16
#: checkpoint transformers would save): ``f32``, and llama-quantize's types, which llama.cpp makes
#: from an ``f32`` file, so ours equal ``llama-quantize`` of our ``f32`` output byte for byte. The
#: other types (``f16``, ``bf16``, ``q8_0``) take each tensor at its own dtype, as
#: ``convert_hf_to_gguf.py`` does from the dequantized model.
FLOAT32_INPUT = frozenset({"f32", *FILE_TYPES})


def parse_output_type(spec: str | None) -> str:
    """Normalize a ``TYPE`` of ``--to gguf:TYPE`` (None or "" -> the default, ``f16``).

    Raises:
        GgufTypeError: GGUF-002, listing the supported types.
    """
    name = (spec or DEFAULT_OUTPUT_TYPE).strip().lower()
    if name not in OUTPUT_TYPES:
        close = difflib.get_close_matches(name, list(OUTPUT_TYPES), n=1, cutoff=0.6)
        raise GgufTypeError(
            "GGUF output type not supported",
            expected=f"one of {', '.join(OUTPUT_TYPES)}",
            found=spec,
            hint=f"did you mean 'gguf:{close[0]}'?" if close else None,
        )
    return name

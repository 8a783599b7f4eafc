"""The names of the GGUF output types: what ``--to gguf:TYPE`` may say, and what each one means.

Light on purpose: the command-line parser and :func:`convert.options.target_for` import this module
and nothing else of :mod:`convert.gguf` (no planning, tokenizer or codecs).

- :data:`OUTPUT_TYPES`: every ``TYPE`` (lower case) with the GGML type of its matrices and its
  ``general.file_type``: ``convert_hf_to_gguf.py``'s ``--outtype`` values (``f32``, ``f16``, ``bf16``,
  ``q8_0``) and llama-quantize's file types (:data:`FILE_TYPES`: ``q4_0`` ... ``q6_k``).
- :data:`FLOAT32_INPUT`: the types made from the exact float32 dequantized weights.

- :class:`MixOptions`: llama-quantize's per-tensor options (``--tensor-type``, ``--output-tensor-type``,
  ``--token-embedding-type``, ``--pure``, ``--leave-output-tensor``), parsed by :func:`parse_mix_options`.

Rule raised here (see docs/errors.md): GGUF-002, the output type is one of :data:`OUTPUT_TYPES` and a type
named by an option is a GGML type (:class:`GgufTypeError`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import gguf

from formats.errors import GgufTypeError, UsageError

__all__ = ["DEFAULT_MIX", "DEFAULT_OUTPUT_TYPE", "FILE_TYPES", "FLOAT32_INPUT", "FileType", "MixOptions",
           "OUTPUT_TYPES", "SPLIT_INT_MAX", "SPLIT_UNITS", "TensorTypeRule", "parse_ggml_type",
           "parse_mix_options", "parse_output_type", "parse_split_size"]

GT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class FileType:
    """One llama-quantize file type.

    Attributes:
        name: llama.cpp's name (``Q4_K_M``).
        ftype: the ``llama_ftype`` (``general.file_type``).
        default: ``llama_ftype_get_default_type``: the type of a tensor no rule changes.
        needs_imatrix: llama-quantize refuses it without an importance matrix (Q2_K_S:
            ``tensor_requires_imatrix``).
    """

    name: str
    ftype: gguf.LlamaFileType
    default: gguf.GGMLQuantizationType
    needs_imatrix: bool = False


#: ``--to gguf:TYPE`` name (lower case) -> file type, for the mixes :func:`convert.gguf.mix.mix_types` knows.
FILE_TYPES: dict[str, FileType] = {
    ft.name.lower(): ft
    for ft in (
        FileType("Q4_0", FT.MOSTLY_Q4_0, GT.Q4_0),
        FileType("Q4_1", FT.MOSTLY_Q4_1, GT.Q4_1),
        FileType("Q5_0", FT.MOSTLY_Q5_0, GT.Q5_0),
        FileType("Q5_1", FT.MOSTLY_Q5_1, GT.Q5_1),
        FileType("Q2_K", FT.MOSTLY_Q2_K, GT.Q2_K),
        FileType("Q2_K_S", FT.MOSTLY_Q2_K_S, GT.Q2_K, needs_imatrix=True),
        FileType("Q3_K_S", FT.MOSTLY_Q3_K_S, GT.Q3_K),
        FileType("Q3_K_M", FT.MOSTLY_Q3_K_M, GT.Q3_K),
        FileType("Q3_K_L", FT.MOSTLY_Q3_K_L, GT.Q3_K),
        FileType("Q4_K_S", FT.MOSTLY_Q4_K_S, GT.Q4_K),
        FileType("Q4_K_M", FT.MOSTLY_Q4_K_M, GT.Q4_K),
        FileType("Q5_K_S", FT.MOSTLY_Q5_K_S, GT.Q5_K),
        FileType("Q5_K_M", FT.MOSTLY_Q5_K_M, GT.Q5_K),
        FileType("Q6_K", FT.MOSTLY_Q6_K, GT.Q6_K),
        FileType("IQ4_NL", FT.MOSTLY_IQ4_NL, GT.IQ4_NL),
        FileType("IQ4_XS", FT.MOSTLY_IQ4_XS, GT.IQ4_XS),
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
#: llama-quantize's file types this build does not write -> the GGML types it lacks encoders for.
_NO_ENCODER = {
    "iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS", "iq2_s": "IQ2_S/IQ3_S", "iq2_m": "IQ2_S/IQ3_S", "iq1_s": "IQ1_S",
    "iq1_m": "IQ1_M", "iq3_xxs": "IQ3_XXS/IQ3_S", "iq3_xs": "IQ3_S/IQ3_XXS", "iq3_s": "IQ3_S", "iq3_m": "IQ3_S",
    "tq1_0": "TQ1_0", "tq2_0": "TQ2_0", "mxfp4_moe": "MXFP4",
}
#: Those of them llama-quantize refuses without an importance matrix (``tensor_requires_imatrix``).
_NO_ENCODER_NEEDS_IMATRIX = frozenset({"iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m", "iq3_xxs"})
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
    if name in _NO_ENCODER:
        needs = (" and an importance matrix (llama-quantize refuses it without --imatrix)"
                 if name in _NO_ENCODER_NEEDS_IMATRIX else "")
        raise GgufTypeError(
            "GGUF output type not supported", expected=f"one of {', '.join(OUTPUT_TYPES)}", found=spec,
            hint=f"llama-quantize's {name.upper()} needs {_NO_ENCODER[name]} encoders, which this build does not "
                 f"have{needs}: make it with llama-quantize from our gguf:f32 (gguf:iq4_xs and gguf:q2_k are "
                 "the smallest types written here)")
    if name not in OUTPUT_TYPES:
        close = difflib.get_close_matches(name, list(OUTPUT_TYPES), n=1, cutoff=0.6)
        raise GgufTypeError(
            "GGUF output type not supported",
            expected=f"one of {', '.join(OUTPUT_TYPES)}",
            found=spec,
            hint=f"did you mean 'gguf:{close[0]}'?" if close else None,
        )
    return name


@dataclass(frozen=True)
class TensorTypeRule:
    """One ``--tensor-type PATTERN=TYPE``: llama-quantize lower-cases ``PATTERN`` and takes the first rule
    whose regular expression is found in a tensor's GGUF name (``std::regex_search``)."""

    pattern: str
    regex: re.Pattern[str]
    ggml_type: gguf.GGMLQuantizationType


@dataclass(frozen=True)
class MixOptions:
    """llama-quantize's per-tensor options (``llama_model_quantize_params``); the default is its default.

    Attributes:
        output_tensor_type: ``--output-tensor-type``: ``output.weight``'s type (and a tied
            ``token_embd``'s, when ``token_embedding_type`` is not given), or None.
        token_embedding_type: ``--token-embedding-type``: ``token_embd.weight``'s type, or None.
        tensor_types: ``--tensor-type`` rules, in the order given (the first match wins).
        pure: ``--pure``: every quantized tensor gets the file type's default type (no mix rules; the
            overrides and the row fallback still apply).
        leave_output_tensor: ``--leave-output-tensor``: ``output.weight`` is not quantized (kept F32).
        imatrix: ``--imatrix FILE``: the importance matrix file as given, or None
            (:func:`convert.gguf.imatrix.load_importance` reads it when the plan is made).
        include_weights: ``--include-weights``: use the matrix only for weights whose name contains one.
        exclude_weights: ``--exclude-weights``: do not use it for weights whose name contains one.
    """

    output_tensor_type: gguf.GGMLQuantizationType | None = None
    token_embedding_type: gguf.GGMLQuantizationType | None = None
    tensor_types: tuple[TensorTypeRule, ...] = ()
    pure: bool = False
    leave_output_tensor: bool = False
    imatrix: str | None = None
    include_weights: tuple[str, ...] = ()
    exclude_weights: tuple[str, ...] = ()

    def argv(self) -> list[list[str]]:
        """The options as command-line words, one list per option (``[["--tensor-type", "attn_v=q8_0"],
        ["--pure"]]``): what :func:`convert.options.mix_from_args` parses back."""
        out = [["--tensor-type", f"{r.pattern}={r.ggml_type.name.lower()}"] for r in self.tensor_types]
        if self.output_tensor_type is not None:
            out.append(["--output-tensor-type", self.output_tensor_type.name.lower()])
        if self.token_embedding_type is not None:
            out.append(["--token-embedding-type", self.token_embedding_type.name.lower()])
        out += [["--pure"]] * self.pure + [["--leave-output-tensor"]] * self.leave_output_tensor
        if self.imatrix is not None:
            out.append(["--imatrix", self.imatrix])
        out += [["--include-weights", w] for w in self.include_weights]
        out += [["--exclude-weights", w] for w in self.exclude_weights]
        return out

    def flags(self) -> list[str]:
        """The options as llama-quantize's command line spells them (for reasons, cards and reproduce lines)."""
        return [" ".join(words) for words in self.argv()]


def parse_ggml_type(value: str, option: str) -> gguf.GGMLQuantizationType:
    """A GGML type named as llama-quantize's ``parse_ggml_type`` accepts it (any case: ``q8_0``, ``Q4_K``).

    Raises:
        GgufTypeError: GGUF-002, no GGML type has that name (the accepted names listed).
    """
    for t in GT:
        if t.name.lower() == value.strip().lower():
            return t
    names = [t.name.lower() for t in GT]
    near = difflib.get_close_matches(value.lower(), names, n=1)
    raise GgufTypeError(f"{option}: not a GGML type" + (f" (did you mean {near[0]}?)" if near else ""),
                        expected=names, found=value)


def parse_mix_options(tensor_types: Sequence[str] = (), output_tensor_type: str | None = None,
                      token_embedding_type: str | None = None, pure: bool = False,
                      leave_output_tensor: bool = False, imatrix: str | None = None,
                      include_weights: Sequence[str] = (), exclude_weights: Sequence[str] = ()) -> MixOptions:
    """llama-quantize's per-tensor options from their command-line values (parsed once, where they enter).

    Args:
        tensor_types: ``--tensor-type PATTERN=TYPE`` values (the pattern lower-cased, as llama-quantize
            does; a regular expression searched in GGUF tensor names).
        output_tensor_type, token_embedding_type: GGML type names, or None.
        pure, leave_output_tensor: the flags.
        imatrix: ``--imatrix FILE`` (read when the plan is made), or None.
        include_weights, exclude_weights: ``--include-weights`` / ``--exclude-weights`` names (substrings).

    Raises:
        UsageError: USE-001, a ``--tensor-type`` without ``=``, an empty pattern or type, or a pattern that is
            not a regular expression; ``--include-weights`` with ``--exclude-weights`` (llama-quantize refuses
            both), either without ``--imatrix``, or an empty name.
        GgufTypeError: GGUF-002, a name that is no GGML type.
    """
    rules = []
    for value in tensor_types:
        pattern, sep, type_name = value.partition("=")
        if not sep or not pattern or not type_name:
            raise UsageError("--tensor-type must be PATTERN=TYPE (e.g. attn_q=q8_0)", found=value)
        pattern = pattern.lower()
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise UsageError(f"--tensor-type pattern is not a regular expression ({exc})", found=pattern) from None
        rules.append(TensorTypeRule(pattern, regex, parse_ggml_type(type_name, "--tensor-type")))
    if include_weights and exclude_weights:
        raise UsageError("--include-weights and --exclude-weights cannot be used together (as in llama-quantize)",
                         found=f"--include-weights {include_weights[0]} --exclude-weights {exclude_weights[0]}")
    for option, names in (("--include-weights", include_weights), ("--exclude-weights", exclude_weights)):
        if names and imatrix is None:
            raise UsageError(f"{option} selects entries of an importance matrix: it needs --imatrix FILE",
                             found=f"{option} {names[0]}")
        if any(not n for n in names):
            raise UsageError(f"{option} needs a tensor name (a part of GGUF names, e.g. attn_v)", found="''")
    if imatrix is not None and not imatrix:
        raise UsageError("--imatrix needs a file name", found="''")
    return MixOptions(
        output_tensor_type=None if output_tensor_type is None else parse_ggml_type(output_tensor_type,
                                                                                   "--output-tensor-type"),
        token_embedding_type=None if token_embedding_type is None else parse_ggml_type(token_embedding_type,
                                                                                       "--token-embedding-type"),
        tensor_types=tuple(rules), pure=pure, leave_output_tensor=leave_output_tensor, imatrix=imatrix,
        include_weights=tuple(include_weights), exclude_weights=tuple(exclude_weights))


#: llama-quantize's default per-tensor options (none given).
DEFAULT_MIX = MixOptions()


#: llama-gguf-split's size units (decimal, upper case only).
SPLIT_UNITS = {"M": 10**6, "G": 10**9}
#: The largest number the tool reads (``sscanf("%d")`` / ``atoi``).
SPLIT_INT_MAX = 2**31 - 1


def parse_split_size(text: str) -> int:
    """``--split-max-size`` as llama-gguf-split reads it: a positive integer and ``M`` (10**6 bytes) or ``G``
    (10**9 bytes), e.g. ``2G``, ``500M``.

    Returns:
        the limit in bytes.

    Raises:
        UsageError: USE-001, another form (no unit or another one, a fraction, a sign, zero).
    """
    m = re.fullmatch(r"([0-9]+)([MG])", text.strip())
    if m is None or not 0 < int(m.group(1)) <= SPLIT_INT_MAX:
        raise UsageError("--split-max-size takes a positive whole number of megabytes or gigabytes, as "
                         "llama-gguf-split does", expected=f"N(M|G), N from 1 to {SPLIT_INT_MAX} (a 32-bit integer), "
                         "e.g. 2G or 500M (10**6 / 10**9 bytes)", found=text[:40])
    return int(m.group(1)) * SPLIT_UNITS[m.group(2)]

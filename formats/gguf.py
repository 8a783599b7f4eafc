"""GGUF output for llama.cpp, written through the ``gguf`` package's ``GGUFWriter``, one tensor at a time.

File layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), all little-endian::

    magic "GGUF", version u32 (3), tensor count u64, key/value count u64
    key/value pairs        "{arch}.context_length" = u32, "tokenizer.ggml.tokens" = [str], ...
    tensor infos           name, n_dims u32, ne[n_dims] u64 (innermost first), GGML type u32,
                           offset u64 (from the start of the data section, multiple of 32)
    padding to 32 bytes
    data section           each tensor's bytes, padded to 32 bytes

How a Hugging Face checkpoint becomes that file is described per architecture as data
(:data:`ARCHITECTURES`), following llama.cpp's ``convert_hf_to_gguf.py`` (classes ``TextModel``,
``LlamaModel``, ``Qwen2Model``, ``GemmaModel``):

- tensor names: the gguf package's ``TensorNameMap`` (``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``); a name it cannot map is refused before any weight is read;
- metadata: ``config.json`` keys -> ``GGUFWriter.add_*`` calls (``max_position_embeddings`` ->
  ``{arch}.context_length``, ...), with the defaults transformers' config classes fill in;
- weight transforms: Llama's q/k row permutation (HF rotary halves -> GGML interleaved pairs,
  ``LlamaModel.permute``) and Gemma's ``+1`` on every ``*norm.weight`` (Gemma's RMSNorm multiplies
  by ``1 + weight``), both computed in float32;
- tokenizer: ``tokenizer.model`` (SentencePiece -> ``tokenizer.ggml.model = "llama"``, read by
  :mod:`formats.sentencepiece`, no sentencepiece package needed) or ``tokenizer.json``
  (byte-level BPE -> ``"gpt2"`` with merges), special token ids, ``add_bos``/``add_eos`` and the
  chat template through the gguf package's ``SpecialVocab``.

GGML types (``--to gguf:TYPE``): ``f32``, ``f16`` (default), ``bf16``, ``q8_0``, ``q4_0``,
``q4_1``, ``q5_0``, ``q5_1``, encoded by ``gguf.quants``. As in llama.cpp, 1-D tensors, norms and
biases stay F32, and a matrix whose rows are not a multiple of the 32-element block falls back to
F16. Every tensor written reports the error it adds relative to the float weight it was given
(:class:`TensorReport`): zero for F32, one rounding for F16/BF16, a second quantization for Q types.

Where the output knowingly differs from ``convert_hf_to_gguf.py`` (which needs torch and
transformers):

- ``tokenizer.ggml.pre`` of a byte-level BPE vocabulary is the architecture's (``qwen2``,
  ``llama-bpe``); llama.cpp derives it from a hash of transformers' tokenization of a test text and
  refuses unknown hashes. Added tokens with ``normalized: false`` are written as stored (llama.cpp
  passes them through ``decode(encode(token))``, which leaves special tokens unchanged).
- A Llama whose only tokenizer is a SentencePiece-style ``tokenizer.json`` (``byte_fallback``) is
  refused (llama.cpp reads it through transformers' ``LlamaHfVocab``); add ``tokenizer.model``.
- ``general.*`` holds type, name (the directory name), size label, file type and quantization
  version; llama.cpp also reads the model card (basename, finetune, license, ...).
- ``q4_0`` ... ``q5_1`` are not converter types in llama.cpp (``llama-quantize`` makes them, and
  keeps ``output.weight`` at Q6_K, which ``gguf.quants`` cannot encode): here every matrix,
  ``token_embd`` and ``output`` included, gets the type asked for.
- CodeGemma's prefix/suffix/middle/fsep ids are set as GemmaModel sets them, but this gguf package
  has no writer for those keys, so (as with llama.cpp's converter on the same package) only
  ``eot`` is written.

Memory: :func:`write_gguf` asks each source for its values only when its turn comes, by row ranges
when the source offers them (:class:`SourceTensor` ``rows``), and converts them in row chunks
(``chunk_elements``), so at most ``threads + 1`` chunks (or one whole source array) are resident.

Rules, each raising :class:`~formats.errors.UnsupportedError` (or ``CheckpointError`` for missing
files) before any weight is read:

========  ======================================================================================
GGUF-001  the architecture (``config.json`` ``architectures[0]``) is one of :data:`ARCHITECTURES`
GGUF-002  the output type is one of :data:`OUTPUT_TYPES`
GGUF-003  every tensor name maps to a GGUF name for the architecture
GGUF-004  a tokenizer (``tokenizer.model`` or ``tokenizer.json``) of a supported kind is present
GGUF-005  the RoPE scaling type is supported (none/default, linear, yarn, llama3 for Llama)
GGUF-006  config.json holds the hyperparameters the architecture needs (no MoE experts)
GGUF-007  a source array has the planned shape and a float dtype
GGUF-008  the written file re-opens with the planned names, types, shapes and sizes (verify)
========  ======================================================================================
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from . import sentencepiece
from .errors import CheckpointError, UnsupportedError, VerificationError

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_OUTPUT_TYPE",
    "OUTPUT_TYPES",
    "Architecture",
    "GGUFPlan",
    "PlannedTensor",
    "SourceTensor",
    "TensorReport",
    "find_architecture",
    "parse_output_type",
    "plan_gguf",
    "verify_gguf",
    "write_gguf",
]

# The gguf package logs its notes (e.g. SpecialVocab's template warnings) through ``logging``; with
# no handler configured anywhere Python would print them, and the library never prints.
logging.getLogger("gguf").addHandler(logging.NullHandler())

GT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

#: ``--to gguf:TYPE`` names -> (GGML type of the matrices, ``general.file_type``).
OUTPUT_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (GT.F32, FT.ALL_F32),
    "f16": (GT.F16, FT.MOSTLY_F16),
    "bf16": (GT.BF16, FT.MOSTLY_BF16),
    "q8_0": (GT.Q8_0, FT.MOSTLY_Q8_0),
    "q4_0": (GT.Q4_0, FT.MOSTLY_Q4_0),
    "q4_1": (GT.Q4_1, FT.MOSTLY_Q4_1),
    "q5_0": (GT.Q5_0, FT.MOSTLY_Q5_0),
    "q5_1": (GT.Q5_1, FT.MOSTLY_Q5_1),
}
DEFAULT_OUTPUT_TYPE = "f16"

#: Source tensors llama.cpp never writes.
_ALWAYS_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


# --------------------------------------------------------------------------------------------
# Architectures as data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One metadata entry: a ``GGUFWriter`` method fed from the first ``config.json`` key present.

    Attributes:
        method: the ``GGUFWriter.add_*`` method (it fixes the GGUF key and value type), e.g.
            ``"add_context_length"`` -> ``{arch}.context_length`` (uint32).
        keys: config.json keys tried in order (``"@head_dim"`` is head_dim or hidden/heads).
        required: raise GGUF-006 when none is present (otherwise the entry is left out).
    """

    method: str
    keys: tuple[str, ...]
    required: bool = False


# TextModel.set_gguf_parameters (order kept); rope scaling and the file type are added separately.
_TEXT_PARAMS = (
    Param(
        "add_context_length",
        (
            "max_position_embeddings",
            "n_ctx",
            "n_positions",
            "max_length",
            "max_sequence_length",
            "model_max_length",
        ),
    ),
    Param("add_embedding_length", ("hidden_size", "n_embd", "dim"), required=True),
    Param("add_feed_forward_length", ("intermediate_size", "n_inner", "hidden_dim")),
    Param("add_head_count", ("num_attention_heads", "n_head", "n_heads"), required=True),
    Param("add_head_count_kv", ("num_key_value_heads", "n_kv_heads")),
    Param("add_rope_freq_base", ("rope_theta",)),
    Param("add_layer_norm_rms_eps", ("rms_norm_eps", "norm_eps")),
    Param("add_layer_norm_eps", ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
    Param("add_key_length", ("head_dim",)),
    Param("add_value_length", ("head_dim",)),
)

# GemmaModel.set_gguf_parameters writes its own list (no rope keys).
_GEMMA_PARAMS = (
    Param("add_context_length", ("max_position_embeddings",), required=True),
    Param("add_embedding_length", ("hidden_size",), required=True),
    Param("add_feed_forward_length", ("intermediate_size",), required=True),
    Param("add_head_count", ("num_attention_heads",), required=True),
    Param("add_head_count_kv", ("num_key_value_heads",), required=True),
    Param("add_layer_norm_rms_eps", ("rms_norm_eps",), required=True),
    Param("add_key_length", ("head_dim",), required=True),
    Param("add_value_length", ("head_dim",), required=True),
)


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture becomes GGUF (the data behind llama.cpp's model class).

    Attributes:
        name: the GGUF architecture (``general.architecture``), e.g. ``"llama"``.
        model_arch: the gguf package's enum member (selects the ``TensorNameMap``).
        hf_architectures: ``config.json`` ``architectures`` values handled.
        params: metadata entries, in order.
        extra_params: entries written after ``params`` (Llama: vocab size, rope dimension count).
        config_defaults: values transformers' config class fills in when config.json omits them
            (llama.cpp reads the config through ``AutoConfig``); ``"=key"`` copies another key.
        permute_qk: apply ``LlamaModel.permute`` to q_proj/k_proj weights and biases.
        norm_offset: added to every ``*norm.weight`` (Gemma: 1.0).
        skip: source tensor names not written (Gemma's tied ``lm_head.weight``).
        tokenizers: tokenizer sources tried in order: ``"sentencepiece"``, ``"bpe"``.
        bpe_pre: ``tokenizer.ggml.pre`` for a byte-level BPE ``tokenizer.json``.
        add_space_prefix: value of ``tokenizer.ggml.add_space_prefix`` (None: from
            tokenizer_config.json ``add_prefix_space`` when set, as Llama does).
        extra_special: (special token types, {type: id}) added after the tokenizer (CodeGemma ids).
        vocab_quirks: vocab size -> special token ids (CodeLlama's infill tokens).
        rope_types: RoPE scaling types accepted.
    """

    name: str
    model_arch: gguf.MODEL_ARCH
    hf_architectures: tuple[str, ...]
    params: tuple[Param, ...]
    extra_params: tuple[Param, ...] = ()
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    permute_qk: bool = False
    norm_offset: float = 0.0
    skip: tuple[str, ...] = ()
    tokenizers: tuple[str, ...] = ("sentencepiece", "bpe")
    bpe_pre: str = "default"
    add_space_prefix: bool | None = None
    extra_special: tuple[tuple[str, ...], Mapping[str, int]] | None = None
    vocab_quirks: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    rope_types: tuple[str, ...] = ("default", "linear", "yarn")


_LLAMA_DEFAULTS = {
    "max_position_embeddings": 2048,
    "num_key_value_heads": "=num_attention_heads",
    "head_dim": "@head_dim",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="llama",
        model_arch=gguf.MODEL_ARCH.LLAMA,
        hf_architectures=("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
        params=_TEXT_PARAMS,
        extra_params=(
            Param("add_vocab_size", ("vocab_size",), required=True),
            Param("add_rope_dimension_count", ("@head_dim",)),
        ),
        config_defaults=_LLAMA_DEFAULTS,
        permute_qk=True,
        tokenizers=("sentencepiece", "bpe"),
        bpe_pre="llama-bpe",
        vocab_quirks={32016: {"prefix": 32007, "suffix": 32008, "middle": 32009, "eot": 32010}},
        rope_types=("default", "linear", "yarn", "llama3"),
    ),
    Architecture(
        name="qwen2",
        model_arch=gguf.MODEL_ARCH.QWEN2,
        hf_architectures=("Qwen2ForCausalLM",),
        params=_TEXT_PARAMS,
        config_defaults={
            "max_position_embeddings": 32768,
            "num_key_value_heads": "=num_attention_heads",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        },
        tokenizers=("sentencepiece", "bpe"),
        bpe_pre="qwen2",
    ),
    Architecture(
        name="gemma",
        model_arch=gguf.MODEL_ARCH.GEMMA,
        hf_architectures=("GemmaForCausalLM",),
        params=_GEMMA_PARAMS,
        config_defaults={
            "max_position_embeddings": 8192,
            "num_key_value_heads": "=num_attention_heads",
            "head_dim": 256,
            "rms_norm_eps": 1e-6,
        },
        norm_offset=1.0,
        skip=("lm_head.weight",),
        tokenizers=("sentencepiece",),
        add_space_prefix=False,
        extra_special=(
            ("prefix", "suffix", "middle", "fsep", "eot"),
            {"prefix": 67, "suffix": 69, "middle": 68, "fsep": 70, "eot": 107},
        ),
        rope_types=("default",),
    ),
)


def _supported() -> str:
    return ", ".join(f"{a} ({arch.name})" for arch in ARCHITECTURES for a in arch.hf_architectures)


def find_architecture(config: Mapping[str, Any], *, path: str | None = None) -> Architecture:
    """The :class:`Architecture` for a ``config.json``.

    Args:
        config: the parsed config.json.
        path: the config file, for error messages.

    Returns:
        The table row whose ``hf_architectures`` holds ``config["architectures"][0]``.

    Raises:
        UnsupportedError: GGUF-001, naming every supported architecture.
    """
    archs = config.get("architectures") or []
    hf = archs[0] if isinstance(archs, list) and archs else None
    for arch in ARCHITECTURES:
        if hf in arch.hf_architectures:
            return arch
    raise UnsupportedError(
        "architecture not supported for GGUF output",
        path=path,
        rule="GGUF-001",
        expected=f"one of {_supported()}",
        found=hf if hf is not None else f"model_type {config.get('model_type')!r}",
        hint="convert to safetensors (--to bf16) instead, and use llama.cpp's converter on the result",
        action="convert",
    )


def parse_output_type(spec: str | None) -> str:
    """Normalize a ``TYPE`` of ``--to gguf:TYPE`` (None or "" -> the default, ``f16``).

    Raises:
        UnsupportedError: GGUF-002, listing the supported types.
    """
    name = (spec or DEFAULT_OUTPUT_TYPE).strip().lower()
    if name not in OUTPUT_TYPES:
        raise UnsupportedError(
            "GGUF output type not supported",
            rule="GGUF-002",
            expected=f"one of {', '.join(OUTPUT_TYPES)}",
            found=spec,
        )
    return name


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceTensor:
    """One float tensor offered for writing.

    Give ``produce`` (the whole array at once) or ``rows`` (a range of rows at a time, so the
    tensor is never whole in memory); when both are given ``rows`` is used.

    Attributes:
        name: the Hugging Face tensor name (``model.layers.0.mlp.up_proj.weight``).
        shape: its shape in elements (PyTorch order, rows first).
        produce: returns the values, any float dtype (float32, float16, bfloat16), ``shape``.
        rows: ``rows(r0, r1)`` returns rows [r0, r1) as a float array of ``(r1 - r0, *shape[1:])``
            (a 1-D tensor is one row); may be called from several threads at once.
        done: called once the tensor is written (e.g. to drop its input pages).
        row_align: chunks start on multiples of this many rows (the source's natural unit).
    """

    name: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray] | None = None
    rows: Callable[[int, int], np.ndarray] | None = None
    done: Callable[[], None] | None = None
    row_align: int = 1


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the GGUF file.

    Attributes:
        source: the Hugging Face name (None for generated tensors such as ``rope_freqs.weight``).
        name: the GGUF name (``blk.0.attn_q.weight``).
        shape: shape in elements, rows first (the GGUF header stores it reversed).
        ggml_type: its GGML type.
        nbytes: bytes in the data section (before the 32-byte padding).
        permute_heads: rows are permuted as ``LlamaModel.permute`` with this many heads (0: not).
        offset: value added in float32 before rounding (Gemma norms: 1.0).
        fallback: why the type differs from the requested one ("" when it does not).
    """

    source: str | None
    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    nbytes: int
    permute_heads: int = 0
    offset: float = 0.0
    fallback: str = ""

    @property
    def numel(self) -> int:
        """Number of elements (Python int)."""
        return math.prod(self.shape)


@dataclass
class GGUFPlan:
    """Everything :func:`write_gguf` needs except the weights.

    Attributes:
        arch: the architecture row.
        output_type: the ``--to gguf:TYPE`` name.
        file_type: ``general.file_type``.
        metadata: key -> (value, GGUF value type, array element type), in write order, without
            ``general.architecture`` (the writer adds it).
        tensors: the tensors in file order.
        generated: GGUF name -> values of tensors made from the config (``rope_freqs.weight``).
    """

    arch: Architecture
    output_type: str
    file_type: gguf.LlamaFileType
    metadata: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]
    tensors: list[PlannedTensor]
    generated: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (padding excluded)."""
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> list[str]:
        """One line per tensor for ``--dry-run``: GGUF name, type, shape (rows first), bytes, source."""
        lines = []
        for t in self.tensors:
            note = f" ({t.fallback})" if t.fallback else ""
            lines.append(
                f"{t.name:<28} {t.ggml_type.name:<5} {list(t.shape)!s:<14} {t.nbytes:>12} "
                f"<- {t.source or 'generated'}{note}"
            )
        return lines


def _hparams(config: Mapping[str, Any], arch: Architecture, path: str | None) -> dict[str, Any]:
    """config.json plus the defaults transformers fills in, with derived ``@`` keys."""
    hp: dict[str, Any] = dict(config)
    text = hp.get("text_config")
    if isinstance(text, dict):
        hp = {**hp, **text}
    # rope_theta lives in rope_parameters (transformers >= 5) or at the top level (older configs).
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        rope = {}
    if "rope_theta" not in hp or hp["rope_theta"] is None:
        theta = rope.get("rope_theta", hp.get("rotary_emb_base"))
        if theta is not None:
            hp["rope_theta"] = theta
    heads = hp.get("num_attention_heads")
    hidden = hp.get("hidden_size")
    derived_head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    for key, default in arch.config_defaults.items():
        if hp.get(key) is not None:
            continue
        if isinstance(default, str) and default.startswith("="):
            default = hp.get(default[1:])
        elif default == "@head_dim":
            default = derived_head_dim
        if default is not None:
            hp[key] = default
    hp["@head_dim"] = hp.get("head_dim") or derived_head_dim
    for key in ("num_local_experts", "num_experts"):
        if hp.get(key):
            raise UnsupportedError(
                "mixture-of-experts models are not supported for GGUF output",
                path=path,
                rule="GGUF-006",
                expected="no experts",
                found=f"{key} = {hp[key]}",
                action="convert",
            )
    return hp


def _rope_metadata(hp: Mapping[str, Any], arch: Architecture, path: str | None) -> list[tuple[str, Any]]:
    """(writer method, value) for the RoPE scaling keys (TextModel.set_gguf_parameters)."""
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return []
    kind = rope.get("rope_type", rope.get("type"))
    if kind is None:
        return []
    kind = str(kind).lower()
    if kind not in arch.rope_types:
        raise UnsupportedError(
            "RoPE scaling type not supported for GGUF output",
            path=path,
            rule="GGUF-005",
            expected=f"one of {', '.join(arch.rope_types)}",
            found=kind,
            action="convert",
        )
    factor = rope.get("factor")
    out: list[tuple[str, Any]] = []
    if kind == "linear" and factor is not None:
        out += [("add_rope_scaling_type", gguf.RopeScalingType.LINEAR), ("add_rope_scaling_factor", factor)]
    elif kind == "yarn" and factor is not None:
        out += [
            ("add_rope_scaling_type", gguf.RopeScalingType.YARN),
            ("add_rope_scaling_factor", factor),
            ("add_rope_scaling_orig_ctx_len", rope["original_max_position_embeddings"]),
        ]
        for method, keys in (
            ("add_rope_scaling_yarn_ext_factor", ("extrapolation_factor",)),
            ("add_rope_scaling_yarn_attn_factor", ("attention_factor", "attn_factor")),
            ("add_rope_scaling_yarn_beta_fast", ("beta_fast",)),
            ("add_rope_scaling_yarn_beta_slow", ("beta_slow",)),
        ):
            value = next((rope[k] for k in keys if rope.get(k) is not None), None)
            if value is not None:
                out.append((method, value))
    return out


def _llama3_rope_freqs(hp: Mapping[str, Any]) -> npt.NDArray[np.float32] | None:
    """The ``rope_freqs.weight`` factors of Llama 3.1 RoPE scaling (LlamaModel.generate_extra_tensors)."""
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    if not isinstance(rope, dict) or str(rope.get("rope_type", rope.get("type", ""))).lower() != "llama3":
        return None
    base = float(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    dim = int(hp["@head_dim"])
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    factor = float(rope.get("factor", 8.0))
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(hp.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", 8192)))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _tensor_nbytes(shape: Sequence[int], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


def _choose_type(
    gguf_name: str, shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType
) -> tuple[gguf.GGMLQuantizationType, str]:
    """llama.cpp's prepare_tensors: 1-D, norms and non-``.weight`` tensors are F32; odd rows -> F16."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return GT.F32, "" if wanted == GT.F32 else "kept F32 (1-D, norm or bias)"
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return GT.F16, f"row of {shape[-1]} is not a multiple of the {wanted.name} block of {block}: F16"
    return wanted, ""


def plan_gguf(
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, Sequence[int]]],
    tokenizer_dir: str | os.PathLike[str],
    output_type: str | None = None,
    *,
    model_name: str | None = None,
    config_path: str | None = None,
) -> GGUFPlan:
    """Plan a GGUF file from headers alone: names, types, shapes, sizes, metadata and tokenizer.

    Matches the metadata, tensor names, tensor types and tokenizer llama.cpp's
    ``convert_hf_to_gguf.py`` writes for the same model and ``--outtype``.

    Args:
        config: the model's config.json (``quantization_config`` is ignored).
        tensors: (Hugging Face name, shape) of every float tensor to write, in file order.
        tokenizer_dir: the directory with ``tokenizer.model`` / ``tokenizer.json`` /
            ``tokenizer_config.json`` (and config.json for special token ids).
        output_type: a key of :data:`OUTPUT_TYPES` (default ``f16``).
        model_name: ``general.name`` (default: the tokenizer directory's name).
        config_path: the config file, for error messages.

    Returns:
        The plan; no weight has been read.

    Raises:
        UnsupportedError: GGUF-001..006.
        CheckpointError: GGUF-004 (no tokenizer), SPM-xxx (bad tokenizer.model).
    """
    arch = find_architecture(config, path=config_path)
    out_name = parse_output_type(output_type)
    wanted, file_type = OUTPUT_TYPES[out_name]
    hp = _hparams(config, arch, config_path)
    n_blocks = hp.get("num_hidden_layers", hp.get("n_layer", hp.get("num_layers")))
    if not isinstance(n_blocks, int):
        raise UnsupportedError(
            "config.json has no layer count",
            path=config_path,
            rule="GGUF-006",
            expected="num_hidden_layers",
            found=None,
            action="convert",
        )
    name_map = gguf.get_tensor_name_map(arch.model_arch, n_blocks)
    n_head = hp.get("num_attention_heads")
    n_head_kv = hp.get("num_key_value_heads", n_head)

    planned: list[PlannedTensor] = []
    generated: dict[str, npt.NDArray[np.float32]] = {}
    rope_freqs = _llama3_rope_freqs(hp) if "llama3" in arch.rope_types else None
    if rope_freqs is not None:
        rf_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        generated[rf_name] = rope_freqs
        planned.append(PlannedTensor(None, rf_name, rope_freqs.shape, GT.F32, rope_freqs.nbytes))
    total_params = 0
    for hf_name, shape_seq in tensors:
        shape = tuple(int(d) for d in shape_seq)
        if hf_name.endswith(_ALWAYS_SKIPPED) or hf_name in arch.skip:
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UnsupportedError(
                "tensor has no GGUF name for this architecture",
                path=config_path,
                tensor=hf_name,
                rule="GGUF-003",
                expected=f"a tensor of a {arch.name} model",
                found=hf_name,
                action="convert",
                hint="only the text model's weights can be written (no vision towers or extra heads)",
            )
        qtype, why = _choose_type(gguf_name, shape, wanted)
        heads = 0
        if arch.permute_qk and isinstance(n_head, int):
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                heads = n_head
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                heads = n_head_kv if isinstance(n_head_kv, int) else n_head
            if heads and shape[0] % (2 * heads):
                raise UnsupportedError(
                    "q/k rows do not split into heads",
                    path=config_path,
                    tensor=hf_name,
                    rule="GGUF-006",
                    expected=f"a multiple of 2 x {heads}",
                    found=shape[0],
                    action="convert",
                )
        offset = arch.norm_offset if arch.norm_offset and hf_name.endswith("norm.weight") else 0.0
        planned.append(
            PlannedTensor(hf_name, gguf_name, shape, qtype, _tensor_nbytes(shape, qtype), heads, offset, why)
        )
        n = 1
        for d in shape:
            n *= d
        total_params += n

    scratch = gguf.GGUFWriter(path=None, arch=arch.name)
    scratch.add_type(gguf.GGUFType.MODEL)
    name = model_name if model_name is not None else Path(tokenizer_dir).resolve().name
    scratch.add_name(name)
    if total_params > 0:
        scratch.add_size_label(gguf.size_label(total_params, total_params, 0, 0))
    scratch.add_block_count(n_blocks)
    for param in arch.params + arch.extra_params:
        if param.method == "add_rope_freq_base":
            # TextModel writes the scaling keys just before the frequency base
            for method, v in _rope_metadata(hp, arch, config_path):
                getattr(scratch, method)(v)
        value = next((hp[k] for k in param.keys if hp.get(k) is not None), None)
        if value is None:
            if param.required:
                raise UnsupportedError(
                    "config.json lacks a hyperparameter llama.cpp needs",
                    path=config_path,
                    rule="GGUF-006",
                    expected=" or ".join(param.keys),
                    found=None,
                    action="convert",
                )
            continue
        getattr(scratch, param.method)(value)
    if not any(p.method == "add_rope_freq_base" for p in arch.params):
        _rope_metadata(hp, arch, config_path)  # validates the scaling type
    if hp.get("is_causal") is False:
        scratch.add_causal_attention(False)
    scratch.add_file_type(file_type)
    scratch.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(scratch, Path(tokenizer_dir), arch, hp)

    metadata = {
        k: (v.value, v.type, v.sub_type) for k, v in scratch.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE
    }
    return GGUFPlan(arch, out_name, file_type, metadata, planned, generated)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _looks_special(text: str) -> bool:
    """TextModel.does_token_look_special: added tokens some models forget to mark special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read JSON: {e}", path=path, rule="GGUF-004") from None


def _sentencepiece_vocab(tok_dir: Path, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    """TextModel._create_vocab_sentencepiece, from tokenizer.model + added tokens."""
    pieces = sentencepiece.read_pieces(tok_dir / "tokenizer.model")
    n = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [int(gguf.TokenType.UNUSED)] * n
    spm_type = {
        sentencepiece.UNKNOWN: gguf.TokenType.UNKNOWN,
        sentencepiece.CONTROL: gguf.TokenType.CONTROL,
        sentencepiece.UNUSED: gguf.TokenType.UNUSED,
        sentencepiece.BYTE: gguf.TokenType.BYTE,
    }
    for i, piece in enumerate(pieces[:n]):
        tokens[i] = piece.text.encode("utf-8")
        scores[i] = piece.score
        types[i] = int(spm_type.get(piece.type, gguf.TokenType.NORMAL))
    added_file = tok_dir / "added_tokens.json"
    if added_file.is_file():
        for text, tid in _read_json(added_file).items():
            if isinstance(tid, int) and 0 <= tid < n:
                tokens[tid], scores[tid], types[tid] = (
                    text.encode("utf-8"),
                    -1000.0,
                    int(gguf.TokenType.USER_DEFINED),
                )
    config_file = tok_dir / "tokenizer_config.json"
    if config_file.is_file():
        decoder = _read_json(config_file).get("added_tokens_decoder", {}) or {}
        for key, data in decoder.items():
            tid = int(key)
            if not 0 <= tid < n:
                continue
            text = data["content"]
            if data.get("special") or _looks_special(text):
                types[tid] = int(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[tid] = int(gguf.TokenType.USER_DEFINED)
            scores[tid] = -1000.0
            tokens[tid] = text.encode("utf-8")
    return tokens, scores, types


def _bpe_vocab(tok_json: Mapping[str, Any], vocab_size: int | None, path: Path) -> tuple[list[str], list[int]]:
    """TextModel.get_vocab_base, from tokenizer.json alone (no transformers)."""
    model = tok_json.get("model") or {}
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: t for t in tok_json.get("added_tokens") or []}
    for text, t in added.items():
        vocab[text] = t["id"]
    if not vocab:
        raise CheckpointError("tokenizer.json has an empty vocabulary", path=path, rule="GGUF-004")
    n = vocab_size or len(vocab)
    if max(vocab.values()) >= n:
        raise CheckpointError(
            "tokenizer.json has token ids beyond the model's vocab_size",
            path=path,
            rule="GGUF-004",
            expected=f"< {n}",
            found=max(vocab.values()),
        )
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        text = reverse.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        if text in added:
            if added[text].get("special") or _looks_special(text):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                text = text.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(text)
    return tokens, types


def _add_tokenizer(w: gguf.GGUFWriter, tok_dir: Path, arch: Architecture, hp: Mapping[str, Any]) -> None:
    vocab_size = hp.get("vocab_size")
    vocab_size = vocab_size if isinstance(vocab_size, int) else None
    config_file = tok_dir / "tokenizer_config.json"
    if arch.add_space_prefix is None and config_file.is_file():
        add_prefix = _read_json(config_file).get("add_prefix_space")
        if add_prefix is not None:
            w.add_add_space_prefix(bool(add_prefix))
    spm, tjson = tok_dir / "tokenizer.model", tok_dir / "tokenizer.json"
    if "sentencepiece" in arch.tokenizers and spm.is_file():
        tokens, scores, types = _sentencepiece_vocab(tok_dir, vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        gguf.SpecialVocab(tok_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    elif "bpe" in arch.tokenizers and tjson.is_file():
        tok = _read_json(tjson)
        model = tok.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback", False):
            raise UnsupportedError(
                "tokenizer.json is not a byte-level BPE tokenizer",
                path=tjson,
                rule="GGUF-004",
                expected="model.type BPE without byte_fallback",
                found=f"{model.get('type')}, byte_fallback={model.get('byte_fallback', False)}",
                hint="add the model's tokenizer.model (SentencePiece)",
                action="convert",
            )
        tokens_s, types = _bpe_vocab(tok, vocab_size, tjson)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(arch.bpe_pre)
        w.add_token_list(tokens_s)
        w.add_token_types(types)
        gguf.SpecialVocab(tok_dir, load_merges=True).add_to_gguf(w, quiet=True)
    else:
        wanted = " or ".join({"sentencepiece": "tokenizer.model", "bpe": "tokenizer.json"}[t] for t in arch.tokenizers)
        raise CheckpointError(
            "no tokenizer next to the weights",
            path=tok_dir,
            rule="GGUF-004",
            expected=wanted,
            found=None,
            hint="llama.cpp needs the vocabulary inside the GGUF: convert a model directory (or repo id), "
            "not a lone weight file",
        )
    quirk = arch.vocab_quirks.get(vocab_size or -1)
    extra = arch.extra_special or ((tuple(quirk), quirk) if quirk else None)
    if extra is not None:
        types_, ids = extra
        special = gguf.SpecialVocab(tok_dir, load_merges=False, special_token_types=types_)
        for typ, tid in ids.items():
            special.special_token_ids.setdefault(typ, tid)
        special.chat_template = None
        special.add_to_gguf(w, quiet=True)
    if arch.add_space_prefix is not None:
        w.add_add_space_prefix(arch.add_space_prefix)


# --------------------------------------------------------------------------------------------
# Write
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorReport:
    """What writing one tensor did to its values.

    The error is the GGUF value (decoded back to float32) minus the float32 weight given (after the
    architecture's transforms), over all elements.

    Attributes:
        name: the GGUF name.
        source: the Hugging Face name (None for generated tensors).
        ggml_type: the type written.
        shape: rows first.
        nbytes: bytes written (padding excluded).
        max_abs_error: largest absolute error.
        rms_error: root mean square of the error.
        rel_rms_error: rms_error / root mean square of the weight (0 for an all-zero weight).
    """

    name: str
    source: str | None
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    max_abs_error: float
    rms_error: float
    rel_rms_error: float


def _permutation(rows: int, heads: int) -> npt.NDArray[np.intp]:
    """Row order of LlamaModel.permute: out[r] = in[perm[r]] for ``reshape(heads, 2, rows/heads/2)
    .swapaxes(1, 2)``; rows stay inside their head's block of rows/heads."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).swapaxes(1, 2).reshape(-1)


#: Source dtypes whose values the GGML type holds exactly.
_SAME_FLOAT = {"bfloat16": GT.BF16, "float16": GT.F16}


@dataclass
class _Chunk:
    data: np.ndarray
    max_err: float
    sq_err: float
    sq_ref: float


def _convert_chunk(
    t: PlannedTensor, x_in: np.ndarray, perm: npt.NDArray[np.intp] | None, exact: bool, path: str
) -> _Chunk:
    """Rows of one tensor: float32, the architecture's transforms, encode, measure the added error."""
    if not (np.issubdtype(x_in.dtype, np.floating) or x_in.dtype.name == "bfloat16"):
        raise UnsupportedError(
            "source array is not a float array",
            path=path,
            tensor=t.source,
            rule="GGUF-007",
            expected="a float dtype",
            found=str(x_in.dtype),
            action="write",
        )
    if not t.offset and _SAME_FLOAT.get(x_in.dtype.name) == t.ggml_type:
        # already in the output type (bf16 -> BF16, f16 -> F16): the stored bits, nothing to measure
        same = np.ascontiguousarray(x_in if perm is None else x_in[perm])
        return _Chunk(same.reshape(-1).view(np.uint8), 0.0, 0.0, 0.0)
    x = np.ascontiguousarray(x_in if perm is None else x_in[perm], dtype=np.float32)
    if t.offset:
        x = x + np.float32(t.offset)  # never in place: x may be the caller's array
    data = np.ascontiguousarray(gguf.quants.quantize(x, t.ggml_type))
    max_err = sq_err = 0.0
    if not exact and x.size:
        err = gguf.quants.dequantize(data, t.ggml_type).reshape(x.shape)
        err -= x
        max_err = float(max(err.max(), -err.min()))
        np.square(err, out=err)
        sq_err = float(err.sum())  # NumPy's pairwise float32 sum: ample for a 3-digit report
    return _Chunk(data, max_err, sq_err, float(np.square(x).sum()))


def write_gguf(
    plan: GGUFPlan,
    path: str | os.PathLike[str],
    sources: Mapping[str, Callable[[], np.ndarray]] | Iterable[SourceTensor],
    *,
    chunk_elements: int = 1 << 20,
    threads: int = 1,
    progress: Callable[[int], None] | None = None,
) -> list[TensorReport]:
    """Write the planned GGUF file, streaming one tensor at a time in row chunks.

    Header, key/value pairs and tensor infos go through ``GGUFWriter`` (``write_header_to_file``,
    ``write_kv_data_to_file``, ``write_ti_data_to_file``); tensor data is then appended chunk by
    chunk with the writer's 32-byte padding (``GGUFWriter.write_tensor_data`` wants a whole tensor).
    Chunks are converted by ``threads`` workers and written in order, so the bytes do not depend on
    the thread count or the chunk size; at most ``threads + 1`` chunks are in flight.

    Args:
        plan: from :func:`plan_gguf`.
        path: the file to create or overwrite (the caller picks a temporary name and renames it
            after :func:`verify_gguf`).
        sources: Hugging Face name -> callable returning the whole float array, or
            :class:`SourceTensor` records (whole arrays or row ranges); used in plan order.
        chunk_elements: elements converted per chunk (rounded to whole rows, and to whole heads
            for permuted q/k).
        threads: worker threads converting chunks.
        progress: called with the bytes written after each chunk.

    Returns:
        One :class:`TensorReport` per tensor, in file order.

    Raises:
        UnsupportedError: GGUF-007 (a source has another shape or a non-float dtype).
        KeyError: a planned tensor has no source.
    """
    spath = os.fspath(path)
    if isinstance(sources, Mapping):
        records = {name: SourceTensor(name, (), produce=fn) for name, fn in sources.items()}
    else:
        records = {s.name: s for s in sources}
    w = gguf.GGUFWriter(path=None, arch=plan.arch.name)
    for key, (value, vtype, sub_type) in plan.metadata.items():
        w.add_key_value(key, value, vtype, sub_type)
    for t in plan.tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
    reports: list[TensorReport] = []
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    try:
        w.write_header_to_file(path=Path(path))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        for t in plan.tensors:
            rec = records[t.source] if t.source is not None else None
            reports.append(_write_tensor(fout, t, rec, plan, chunk_elements, pool, threads, progress, spath))
            w.write_padding(fout, t.nbytes)
            if rec is not None and rec.done is not None:
                rec.done()
        w.flush()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        w.close()
    return reports


def _write_tensor(
    fout: Any,
    t: PlannedTensor,
    rec: SourceTensor | None,
    plan: GGUFPlan,
    chunk_elements: int,
    pool: ThreadPoolExecutor | None,
    threads: int,
    progress: Callable[[int], None] | None,
    path: str,
) -> TensorReport:
    rows = t.shape[0] if t.shape else 1
    cols = t.numel // rows if rows else 0
    whole: np.ndarray | None = None
    if rec is None or rec.rows is None:
        whole = plan.generated[t.name] if rec is None else rec.produce() if rec.produce is not None else None
        if whole is None or tuple(whole.shape) != t.shape:
            raise UnsupportedError(
                "source array does not match the plan",
                path=path,
                tensor=t.source,
                rule="GGUF-007",
                expected=f"float {list(t.shape)}",
                found=None if whole is None else f"{whole.dtype} {list(whole.shape)}",
                action="write",
            )
        whole = whole.reshape(rows, cols)
    perm = _permutation(rows, t.permute_heads) if t.permute_heads else None
    align = rows // t.permute_heads if t.permute_heads else 1
    if rec is not None and rec.row_align > 1:
        align = math.lcm(align, rec.row_align)
    step = max(1, chunk_elements // max(cols, 1))
    step = -(-step // align) * align
    exact = t.ggml_type == GT.F32

    def task(r0: int, r1: int) -> _Chunk:
        if whole is not None:
            x = whole[r0:r1]
        else:
            assert rec is not None and rec.rows is not None
            x = rec.rows(r0, r1)
            if tuple(x.shape) != (r1 - r0, *t.shape[1:]) and x.size != (r1 - r0) * cols:
                raise UnsupportedError(
                    "source rows do not match the plan",
                    path=path,
                    tensor=t.source,
                    rule="GGUF-007",
                    expected=f"{r1 - r0} x {cols} values",
                    found=f"{x.dtype} {list(x.shape)}",
                    action="write",
                )
            x = x.reshape(r1 - r0, cols)
        return _convert_chunk(t, x, None if perm is None else perm[r0:r1] - r0, exact, path)

    max_err = sq_err = sq_ref = 0.0
    written = 0
    pending: deque[Future[_Chunk]] = deque()

    def drain() -> None:
        nonlocal max_err, sq_err, sq_ref, written
        c = pending.popleft().result()
        fout.write(np.ascontiguousarray(c.data).reshape(-1).view(np.uint8).data)
        written += c.data.nbytes
        max_err = max(max_err, c.max_err)
        sq_err += c.sq_err
        sq_ref += c.sq_ref
        if progress is not None:
            progress(c.data.nbytes)

    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if pool is None:
            fut: Future[_Chunk] = Future()
            fut.set_result(task(r0, r1))
        else:
            fut = pool.submit(task, r0, r1)
        pending.append(fut)
        if len(pending) > threads:
            drain()
    while pending:
        drain()
    if written != t.nbytes:
        raise VerificationError(
            "tensor byte count differs from the plan",
            path=path,
            tensor=t.name,
            rule="GGUF-008",
            expected=t.nbytes,
            found=written,
            action="write",
        )
    n = max(t.numel, 1)
    rms_err = math.sqrt(sq_err / n)
    rms_ref = math.sqrt(sq_ref / n)
    return TensorReport(
        t.name, t.source, t.ggml_type, t.shape, t.nbytes, max_err, rms_err, rms_err / rms_ref if rms_ref else 0.0
    )


def verify_gguf(path: str | os.PathLike[str], plan: GGUFPlan) -> None:
    """Re-open a written GGUF with ``gguf.GGUFReader`` and check it against the plan.

    Checks the architecture, every metadata key, and per tensor: name, order, GGML type, shape,
    byte count and that its data lies inside the file.

    Raises:
        VerificationError: GGUF-008, naming the first difference.
    """
    spath = os.fspath(path)

    def fail(what: str, expected: Any, found: Any, tensor: str | None = None) -> VerificationError:
        return VerificationError(
            what, path=spath, tensor=tensor, rule="GGUF-008", expected=expected, found=found, action="verify"
        )

    try:
        reader = gguf.GGUFReader(spath, "r")
    except (ValueError, OSError) as e:
        raise fail(f"the file does not parse as GGUF ({e})", "a GGUF file", "unreadable") from None
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents() if arch_field is not None else None
    if arch != plan.arch.name:
        raise fail("general.architecture differs", plan.arch.name, arch)
    missing = [k for k in plan.metadata if reader.get_field(k) is None]
    if missing:
        raise fail("metadata keys missing", "every planned key", ", ".join(missing))
    if len(reader.tensors) != len(plan.tensors):
        raise fail("tensor count differs", len(plan.tensors), len(reader.tensors))
    size = os.path.getsize(spath)
    for t, rt in zip(plan.tensors, reader.tensors, strict=True):
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        if rt.name != t.name:
            raise fail("tensor order differs", t.name, rt.name)
        if rt.tensor_type != t.ggml_type:
            raise fail("GGML type differs", t.ggml_type.name, getattr(rt.tensor_type, "name", rt.tensor_type), t.name)
        if shape != t.shape or int(rt.n_bytes) != t.nbytes:
            raise fail(
                "shape or size differs",
                f"{list(t.shape)} ({t.nbytes} bytes)",
                f"{list(shape)} ({int(rt.n_bytes)} bytes)",
                t.name,
            )
        if int(rt.data_offset) + t.nbytes > size:
            raise fail(
                "tensor data runs past the end of the file",
                f"<= {size}",
                int(rt.data_offset) + t.nbytes,
                t.name,
            )

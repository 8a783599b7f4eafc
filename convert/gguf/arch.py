"""Architectures as data: how a Hugging Face text model's config.json and tensor names become GGUF.

Follows llama.cpp's ``convert_hf_to_gguf.py`` (classes ``TextModel``, ``LlamaModel``, ``GraniteModel``,
``SmolLM3Model``, ``Qwen2Model``, ``Qwen3Model``, ``GemmaModel``, ``Gemma2Model``, ``Gemma3Model``,
``Phi3MiniModel``) and gguf-py's name tables, one :class:`Architecture` row per model class instead of
one class with methods (docs/gguf.md lists them and what each does specially):

- :data:`ARCHITECTURES` and :func:`find_architecture`: ``config.json`` ``architectures[0]`` -> the
  row (``general.architecture``, the ``gguf.MODEL_ARCH`` that selects the ``TensorNameMap``);
- :func:`hparams`: config.json plus the defaults transformers' config classes fill in (llama.cpp
  reads the config through ``AutoConfig``), ``text_config`` merged, ``rope_theta`` found where
  transformers >= 5 keeps it (per attention kind for sliding-window models), derived ``@`` keys
  (the SWA RoPE base, Phi-3's rotary dimensions and LongRoPE attention factor, with
  :mod:`convert.gguf.rope`'s helpers; Gemma 3's optional keys); :func:`block_count`; :class:`Param`
  rows map keys to ``GGUFWriter.add_*`` calls
  (``TextModel``/``GemmaModel``/``Gemma2Model``/``Gemma3Model``/``Phi3MiniModel.set_gguf_parameters``);
- RoPE scaling (its metadata keys, ``rope_freqs.weight``, ``rope_factors_long/short.weight``) is
  :mod:`convert.gguf.rope`'s, driven by each row's ``rope_types``, ``rope_scaling_keys`` and
  ``longrope_factors``;
- tensor names: :func:`is_skipped` (tensors llama.cpp never writes) and :func:`gguf_tensor_name`
  (gguf-py's ``TensorNameMap.get_name``: ``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``), refused before any weight is read;
- weight transforms: Llama's q/k row permutation (:func:`permute_heads`, :func:`permutation`: HF
  rotary halves -> GGML interleaved pairs, ``LlamaModel.permute``) and Gemma's ``+1`` on every
  ``*norm.weight`` (:func:`norm_offset`; Gemma's RMSNorm multiplies by ``1 + weight``), both applied
  in float32 by :mod:`convert.gguf.encode`.

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-001  the architecture is one of :data:`ARCHITECTURES`, and not a Qwen3 reranker (which llama.cpp
          converts with a classifier head) (:class:`UnsupportedArchitectureError`)
GGUF-003  every tensor name maps to a GGUF name for the architecture (:class:`UnmappedTensorError`)
GGUF-005  ``rope_parameters`` / ``rope_scaling`` is an object (or null) (:class:`RopeScalingError`;
          the scaling type, its keys and Phi-3's LongRoPE factors: :mod:`convert.gguf.rope`)
GGUF-006  config.json holds the hyperparameters the architecture needs, no MoE experts, q/k rows
          split into heads, ``text_config`` an object, head counts and the layer count positive
          integers that divide (:mod:`convert.gguf.config`) (:class:`GgufConfigError`)
========  ======================================================================================

Every value is checked (:mod:`convert.gguf.config`) before it is used; nothing here trusts a
config.json type or range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from convert.gguf.config import check_heads, whole
from convert.gguf.rope import LOCAL_THETA, longrope_attn_factor, rope_object, rotary_dims
from formats.errors import (
    GgufConfigError,
    RopeScalingError,
    UnmappedTensorError,
    UnsupportedArchitectureError,
)

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Experts",
    "Param",
    "block_count",
    "find_architecture",
    "gguf_tensor_name",
    "hparams",
    "is_skipped",
    "norm_offset",
    "permutation",
    "permute_heads",
    "text_name",
]

#: Source tensors llama.cpp never writes.
_ALWAYS_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")

#: The other towers of a multimodal checkpoint (vision, audio, projector), never in the text model's
#: file: names starting with one of these (TextModel.filter_tensors) ...
_TOWER_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
                   "sound_projection.", "speech_embeddings.")
#: ... or holding one of these
_TOWER_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.",
                "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed",
                "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector.")


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
    Param("add_rope_freq_base_swa", ("@rope_theta_swa",)),
    Param("add_layer_norm_rms_eps", ("rms_norm_eps", "norm_eps")),
    Param("add_layer_norm_eps", ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
    Param("add_expert_count", ("num_local_experts", "num_experts", "n_routed_experts")),
    Param("add_expert_used_count", ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")),
    Param("add_key_length", ("head_dim",)),
    Param("add_value_length", ("head_dim",)),
)

# Qwen2MoeModel.set_gguf_parameters' own entries after TextModel's (Qwen3MoeModel inherits them)
_QWEN_MOE_EXTRA = (
    Param("add_expert_feed_forward_length", ("moe_intermediate_size",)),
    Param("add_expert_shared_feed_forward_length", ("shared_expert_intermediate_size",)),
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


# Gemma2Model.set_gguf_parameters: Gemma's list plus softcapping and the sliding window (all required).
_GEMMA2_PARAMS = (
    *_GEMMA_PARAMS,
    Param("add_attn_logit_softcapping", ("attn_logit_softcapping",), required=True),
    Param("add_final_logit_softcapping", ("final_logit_softcapping",), required=True),
    Param("add_sliding_window", ("sliding_window",), required=True),
)

# Gemma3Model.set_gguf_parameters: TextModel's list (its values overwritten with transformers' defaults,
# which hparams() fills in), the final softcapping when set, the sliding window unless every layer is global.
_GEMMA3_EXTRA = (
    Param("add_final_logit_softcapping", ("@final_logit_softcapping",)),
    Param("add_sliding_window", ("@sliding_window",)),
)


# Phi3MiniModel.set_gguf_parameters (its own list: no TextModel RoPE scaling keys) and the LongRoPE
# attention factor of Phi3MiniModel.generate_extra_tensors.
_PHI3_PARAMS = (
    Param("add_context_length", ("n_positions", "max_position_embeddings"), required=True),
    Param("add_rope_scaling_orig_ctx_len", ("@original_max_position_embeddings",), required=True),
    Param("add_embedding_length", ("hidden_size", "n_embd"), required=True),
    Param("add_feed_forward_length", ("intermediate_size",), required=True),
    Param("add_head_count", ("num_attention_heads", "n_head"), required=True),
    Param("add_head_count_kv", ("num_key_value_heads", "n_head_kv"), required=True),
    Param("add_layer_norm_rms_eps", ("rms_norm_eps",), required=True),
    Param("add_rope_dimension_count", ("@rope_dimension_count",), required=True),
    Param("add_rope_freq_base", ("rope_theta",), required=True),
    Param("add_sliding_window", ("@sliding_window_or_0",), required=True),
    Param("add_rope_scaling_attn_factors", ("@rope_attn_factor",)),
)


@dataclass(frozen=True)
class Experts:
    """How a Mixture-of-Experts layer's per-expert weights become GGUF's stacked ``ffn_*_exps`` tensors
    (``LlamaModel.modify_tensors`` for Mixtral, ``Qwen2MoeModel.modify_tensors``).

    Attributes:
        pattern: regular expression over a tensor's text-model name with the groups ``bid`` (layer),
            ``xid`` (expert) and ``w`` (which weight).
        weights: the ``w`` values, in the order the converter writes their stacks.
        merged: the stacked tensor's name before mapping, a format of ``bid`` and ``w``.
    """

    pattern: str
    weights: tuple[str, ...]
    merged: str


_MIXTRAL_EXPERTS = Experts(
    r"^model\.layers\.(?P<bid>\d+)\.block_sparse_moe\.experts\.(?P<xid>\d+)\.(?P<w>w[123])\.weight$",
    ("w1", "w2", "w3"),
    "layers.{bid}.feed_forward.experts.{w}.weight",
)
_QWEN_MOE_EXPERTS = Experts(
    r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<xid>\d+)\.(?P<w>down_proj|gate_proj|up_proj)\.weight$",
    ("down_proj", "gate_proj", "up_proj"),
    "model.layers.{bid}.mlp.experts.{w}.weight",
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
        add_space_prefix: value of ``tokenizer.ggml.add_space_prefix`` (None: from
            tokenizer_config.json ``add_prefix_space`` when set, as Llama does).
        extra_special: (special token types, {type: id}) added after the tokenizer (CodeGemma ids).
        vocab_quirks: vocab size -> special token ids (CodeLlama's infill tokens).
        rope_types: RoPE scaling types accepted.
        keep_null: config.json keys whose explicit ``null`` stays null (transformers keeps it; llama.cpp
            then fails on it) instead of taking the default: a required one is then GGUF-006.
        rope_scaling_keys: write TextModel's RoPE scaling keys (Phi-3 writes its own instead).
        longrope_factors: write ``rope_factors_long/short.weight`` from the LongRoPE factors and the
            attention factor (Phi3MiniModel.generate_extra_tensors).
        phi3_vocab: the SentencePiece vocabulary as Phi3MiniModel.set_vocab builds it (added tokens from
            tokenizer_config.json and tokenizer.json, typed by their ``special`` flag alone; a
            ``GPT2Tokenizer`` tokenizer class takes the byte-level BPE path).
        ignored_keys: config.json keys the converter drops before reading any (Granite's ``head_dim``:
            its key and value lengths are not written and the rotary dimensions are hidden / heads).
        strip: name parts removed before a tensor is named (a multimodal checkpoint's
            ``language_model.``, every architecture: ModelBase.filter_tensors; LlamaModel's ``text_model.``).
        experts: a Mixture-of-Experts model's per-expert weights and how they are stacked (None: a
            model with experts is GGUF-006).
        rope_scaling_none: write ``rope.scaling.type`` none after the entries (CommandR2Model).
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
    add_space_prefix: bool | None = None
    extra_special: tuple[tuple[str, ...], Mapping[str, int]] | None = None
    vocab_quirks: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    rope_types: tuple[str, ...] = ("default", "linear", "yarn")
    keep_null: tuple[str, ...] = ()
    rope_scaling_keys: bool = True
    longrope_factors: bool = False
    phi3_vocab: bool = False
    ignored_keys: tuple[str, ...] = ()
    strip: tuple[str, ...] = ("language_model.",)
    experts: Experts | None = None
    rope_scaling_none: bool = False


_LLAMA_DEFAULTS = {
    "max_position_embeddings": 2048,
    "num_key_value_heads": "=num_attention_heads",
    "head_dim": "@head_dim",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

# LlamaModel.set_gguf_parameters' own entries after TextModel's
_LLAMA_EXTRA = (
    Param("add_vocab_size", ("vocab_size",), required=True),
    Param("add_rope_dimension_count", ("@head_dim",)),
)

# What LlamaModel's subclasses inherit besides its entries: set_vocab (tokenizers, CodeLlama's infill
# ids) and the RoPE scaling types it reads
_LLAMA_FAMILY = {
    "strip": ("text_model.", "language_model."),
    "tokenizers": ("sentencepiece", "bpe"),
    "vocab_quirks": {32016: {"prefix": 32007, "suffix": 32008, "middle": 32009, "eot": 32010}},
    "rope_types": ("default", "linear", "yarn", "llama3"),
}

# GraniteModel.set_gguf_parameters: Llama's entries (head_dim dropped first), then the four multipliers
# (llama.cpp leaves out a zero one, and its loader then refuses a file without logit_scale: a zero is
# GGUF-006 here)
_GRANITE = Architecture(
    name="granite",
    model_arch=gguf.MODEL_ARCH.GRANITE,
    hf_architectures=("GraniteForCausalLM",),
    params=_TEXT_PARAMS,
    extra_params=(
        *_LLAMA_EXTRA,
        Param("add_attention_scale", ("attention_multiplier",)),
        Param("add_embedding_scale", ("embedding_multiplier",)),
        Param("add_residual_scale", ("residual_multiplier",)),
        Param("add_logit_scale", ("logits_scaling",)),
    ),
    # GraniteConfig's defaults
    config_defaults={
        "max_position_embeddings": 2048,
        "num_key_value_heads": "=num_attention_heads",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_multiplier": 1.0,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
    },
    permute_qk=True,
    ignored_keys=("head_dim",),
    **_LLAMA_FAMILY,
)

# SmolLM3Model: LlamaModel under its own architecture name (its no-RoPE layers are not written)
_SMOLLM3 = Architecture(
    name="smollm3",
    model_arch=gguf.MODEL_ARCH.SMOLLM3,
    hf_architectures=("SmolLM3ForCausalLM",),
    params=_TEXT_PARAMS,
    extra_params=_LLAMA_EXTRA,
    # SmolLM3Config's defaults
    config_defaults={
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 2000000.0,
    },
    permute_qk=True,
    **_LLAMA_FAMILY,
)

# Mistral3Model (Mistral3ForConditionalGeneration, Mistral Small 3.x): its text model is Ministral3Model,
# LlamaModel under the mistral3 architecture (the yarn keys of a ``ministral3`` text model: GGUF-006)
_MISTRAL3 = Architecture(
    name="mistral3",
    model_arch=gguf.MODEL_ARCH.MISTRAL3,
    hf_architectures=("Mistral3ForConditionalGeneration",),
    params=_TEXT_PARAMS,
    extra_params=_LLAMA_EXTRA,
    # MistralConfig's defaults (the text_config of Mistral3Config)
    config_defaults={
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": "@head_dim",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
    permute_qk=True,
    **_LLAMA_FAMILY,
)

# Qwen2VLModel (Qwen2-VL, Qwen2.5-VL): TextModel's entries under qwen2vl, the M-RoPE sections from
# rope_parameters (convert.gguf.rope.rope_metadata)
_QWEN2VL = Architecture(
    name="qwen2vl",
    model_arch=gguf.MODEL_ARCH.QWEN2VL,
    hf_architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
    params=_TEXT_PARAMS,
    # Qwen2_5_VLTextConfig's / Qwen2VLTextConfig's defaults
    config_defaults={
        "max_position_embeddings": 32768,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
    },
    tokenizers=("sentencepiece", "bpe"),
    rope_types=("default", "mrope"),
)

# LlamaModel for MixtralForCausalLM: the llama architecture, experts stacked (MixtralConfig's defaults)
_MIXTRAL = Architecture(
    name="llama",
    model_arch=gguf.MODEL_ARCH.LLAMA,
    hf_architectures=("MixtralForCausalLM",),
    params=_TEXT_PARAMS,
    extra_params=_LLAMA_EXTRA,
    config_defaults={
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    permute_qk=True,
    experts=_MIXTRAL_EXPERTS,
    **_LLAMA_FAMILY,
)

# Qwen2MoeModel and Qwen3MoeModel (TextModel.set_vocab: a byte-level BPE vocabulary in llama.cpp; a
# SentencePiece one is read too, as Qwen2Model reads it)
_QWEN2MOE = Architecture(
    name="qwen2moe",
    model_arch=gguf.MODEL_ARCH.QWEN2MOE,
    hf_architectures=("Qwen2MoeForCausalLM",),
    params=_TEXT_PARAMS,
    extra_params=_QWEN_MOE_EXTRA,
    # Qwen2MoeConfig's defaults
    config_defaults={
        "max_position_embeddings": 32768,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
    tokenizers=("sentencepiece", "bpe"),
    experts=_QWEN_MOE_EXPERTS,
)

_QWEN3MOE = Architecture(
    name="qwen3moe",
    model_arch=gguf.MODEL_ARCH.QWEN3MOE,
    hf_architectures=("Qwen3MoeForCausalLM",),
    params=_TEXT_PARAMS,
    extra_params=_QWEN_MOE_EXTRA,
    # Qwen3MoeConfig's defaults
    config_defaults={
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    tokenizers=("sentencepiece", "bpe"),
    experts=_QWEN_MOE_EXPERTS,
)

# Olmo2Model: TextModel's entries (Olmo 3's sliding-window layers are another class)
_OLMO2 = Architecture(
    name="olmo2",
    model_arch=gguf.MODEL_ARCH.OLMO2,
    hf_architectures=("Olmo2ForCausalLM",),
    params=_TEXT_PARAMS,
    # Olmo2Config's defaults
    config_defaults={
        "max_position_embeddings": 2048,
        "num_key_value_heads": "=num_attention_heads",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    },
    tokenizers=("sentencepiece", "bpe"),
    rope_types=("default", "linear", "yarn"),
)

# CommandR2Model (Command-R): the context length from model_max_length first (the trained context), the
# logit scale, RoPE scaling none; the embedding serves as the output
_COMMAND_R = Architecture(
    name="command-r",
    model_arch=gguf.MODEL_ARCH.COMMAND_R,
    hf_architectures=("CohereForCausalLM",),
    params=(
        Param("add_context_length", ("model_max_length", *_TEXT_PARAMS[0].keys)),
        *_TEXT_PARAMS[1:],
    ),
    extra_params=(Param("add_logit_scale", ("logit_scale",), required=True),),
    # CohereConfig's defaults
    config_defaults={
        "max_position_embeddings": 8192,
        "num_key_value_heads": "=num_attention_heads",
        "layer_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "logit_scale": 0.0625,
    },
    tokenizers=("sentencepiece", "bpe"),
    rope_types=("default",),
    rope_scaling_none=True,
)

_GEMMA2 = Architecture(
    name="gemma2",
    model_arch=gguf.MODEL_ARCH.GEMMA2,
    hf_architectures=("Gemma2ForCausalLM",),
    params=_GEMMA2_PARAMS,
    # Gemma2Config's defaults
    config_defaults={
        "max_position_embeddings": 8192,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
    },
    norm_offset=1.0,
    skip=("lm_head.weight",),
    tokenizers=("sentencepiece",),
    add_space_prefix=False,
    rope_types=("default",),
    keep_null=("attn_logit_softcapping", "final_logit_softcapping", "sliding_window"),
)

_GEMMA3 = Architecture(
    name="gemma3",
    model_arch=gguf.MODEL_ARCH.GEMMA3,
    hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    params=_TEXT_PARAMS,
    extra_params=_GEMMA3_EXTRA,
    # Gemma3TextConfig's defaults (the same as Gemma3Model.set_gguf_parameters' own)
    config_defaults={
        "max_position_embeddings": 131072,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 4096,
    },
    norm_offset=1.0,
    tokenizers=("sentencepiece",),
    add_space_prefix=False,
    rope_types=("default", "linear", "yarn"),
)

_PHI3 = Architecture(
    name="phi3",
    model_arch=gguf.MODEL_ARCH.PHI3,
    hf_architectures=("Phi3ForCausalLM",),
    params=_PHI3_PARAMS,
    # Phi3Config's defaults
    config_defaults={
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "num_key_value_heads": "=num_attention_heads",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    },
    tokenizers=("sentencepiece", "bpe"),
    rope_types=("default", "longrope", "su", "yarn"),
    rope_scaling_keys=False,
    longrope_factors=True,
    phi3_vocab=True,
)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="llama",
        model_arch=gguf.MODEL_ARCH.LLAMA,
        hf_architectures=("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
        params=_TEXT_PARAMS,
        extra_params=_LLAMA_EXTRA,
        config_defaults=_LLAMA_DEFAULTS,
        permute_qk=True,
        **_LLAMA_FAMILY,
    ),
    _GRANITE,
    _SMOLLM3,
    _MISTRAL3,
    _MIXTRAL,
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
    ),
    Architecture(
        name="qwen3",
        model_arch=gguf.MODEL_ARCH.QWEN3,
        hf_architectures=("Qwen3ForCausalLM",),
        params=_TEXT_PARAMS,
        # Qwen3Config: head_dim is its own setting (128), not hidden_size / heads
        config_defaults={
            "max_position_embeddings": 32768,
            "num_key_value_heads": "=num_attention_heads",
            "head_dim": 128,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        },
        tokenizers=("sentencepiece", "bpe"),
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
    _QWEN2VL,
    _QWEN2MOE,
    _QWEN3MOE,
    _OLMO2,
    _COMMAND_R,
    _GEMMA2,
    _GEMMA3,
    _PHI3,
)


def _supported() -> str:
    """Every supported class name (the GGUF architecture each becomes: docs/gguf.md)."""
    return ", ".join(a for arch in ARCHITECTURES for a in arch.hf_architectures)


def _is_qwen3_reranker(config: Mapping[str, Any], model_dir: Path) -> bool:
    """Qwen3Model._is_qwen3_reranker: a README heading or a name (directory, ``_name_or_path``,
    ``model_type``) that says Qwen3 reranker."""
    readme = model_dir / "README.md"
    try:
        text = readme.read_bytes()[: 1 << 20].decode("utf-8", "replace").lower() if readme.is_file() else ""
    except OSError:
        text = ""
    if "# qwen3-reranker" in text or "# qwen3-vl-reranker" in text:
        return True
    hints = [model_dir.name, config.get("_name_or_path"), config.get("model_type")]
    return any(isinstance(h, str) and ("qwen3-reranker" in h.lower() or "qwen3-vl-reranker" in h.lower())
               for h in hints)


def find_architecture(config: Mapping[str, Any], *, path: str | None = None) -> Architecture:
    """The :class:`Architecture` for a ``config.json``.

    Args:
        config: the parsed config.json.
        path: the config file, for error messages.

    Returns:
        The table row whose ``hf_architectures`` holds ``config["architectures"][0]``.

    Raises:
        UnsupportedArchitectureError: GGUF-001, naming every supported architecture.
        GgufConfigError: GGUF-006, ``architectures`` is not a list of strings.
    """
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise GgufConfigError(
            "config.json 'architectures' must be a list of class names",
            path=path,
            expected='a list such as ["LlamaForCausalLM"]',
            found=f"{type(archs).__name__} {str(archs)[:80]!r}",
            action="convert",
        )
    hf = archs[0] if archs else None
    for arch in ARCHITECTURES:
        if hf in arch.hf_architectures:
            if arch.name == "qwen3" and path is not None and _is_qwen3_reranker(config, Path(path).parent):
                raise UnsupportedArchitectureError(
                    "a Qwen3 reranker is not supported for GGUF output (llama.cpp writes it with a "
                    "classifier head and rank pooling)",
                    path=path,
                    expected=f"a causal language model: one of {_supported()}",
                    found=f"{hf} named as a Qwen3 reranker",
                    hint="convert to safetensors (--to bf16) instead, and use llama.cpp's converter on the result",
                    action="convert",
                )
            return arch
    raise UnsupportedArchitectureError(
        "architecture not supported for GGUF output",
        path=path,
        expected="a class of the GGUF table (docs/gguf.md)",
        found=hf if hf is not None else f"model_type {config.get('model_type')!r}",
        hint=f"the supported classes are {_supported()}; for another, convert to safetensors (--to bf16) "
             "instead, and use llama.cpp's converter on the result",
        action="convert",
    )


def hparams(config: Mapping[str, Any], arch: Architecture, path: str | None) -> dict[str, Any]:
    """config.json plus the defaults transformers fills in, with derived ``@`` keys.

    Args:
        config: the parsed config.json (``text_config`` entries override the top level).
        arch: the architecture row (its ``config_defaults``).
        path: the config file, for error messages.

    Returns:
        The hyperparameters; ``"@head_dim"`` is ``head_dim`` or hidden size / heads.

    Raises:
        GgufConfigError: GGUF-006 (a mixture-of-experts model, a ``text_config`` that is not an object,
            head counts that are not positive integers or do not divide:
            :func:`convert.gguf.config.check_heads`).
        RopeScalingError: GGUF-005 (``rope_parameters`` / ``rope_scaling`` that is not an object).
    """
    hp: dict[str, Any] = dict(config)
    text = hp.get("text_config")
    if isinstance(text, dict):
        hp = {**hp, **text}
    elif "text_config" in hp:  # gguf-py's SpecialVocab reads token ids from it
        raise GgufConfigError(
            "config.json 'text_config' is not an object",
            path=path,
            expected="an object",
            found=f"{type(text).__name__} {str(text)[:40]}",
            action="convert",
        )
    for key in arch.ignored_keys:
        hp.pop(key, None)
    for key in ("rope_parameters", "rope_scaling"):
        if hp.get(key) is not None and not isinstance(hp[key], dict):
            raise RopeScalingError(
                f"config.json '{key}' is not an object",
                path=path,
                expected="an object (or null)",
                found=f"{type(hp[key]).__name__} {str(hp[key])[:40]}",
                action="convert",
            )
    # rope_theta lives in rope_parameters (transformers >= 5; per attention kind for models with
    # sliding-window layers) or at the top level (older configs); TextModel.__init__
    rope = rope_object(hp)
    if "rope_theta" not in hp or hp["rope_theta"] is None:
        theta = rope.get("rope_theta", hp.get("rotary_emb_base"))
        if theta is not None:
            hp["rope_theta"] = theta
    params = hp.get("rope_parameters")
    swa = params.get("sliding_attention") if isinstance(params, dict) else None
    swa_theta = swa.get("rope_theta") if isinstance(swa, dict) else None
    if swa_theta is None:
        swa_theta = next((hp[k] for k in LOCAL_THETA if hp.get(k) is not None), None)
    check_heads(hp, path)  # before the defaults: head_dim is derived only when config.json has none
    heads = hp.get("num_attention_heads")
    hidden = hp.get("hidden_size")
    derived_head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    for key, default in arch.config_defaults.items():
        if hp.get(key) is not None or (key in arch.keep_null and key in hp):
            continue
        if isinstance(default, str) and default.startswith("="):
            default = hp.get(default[1:])
        elif default == "@head_dim":
            default = derived_head_dim
        if default is not None:
            hp[key] = default
    hp["@head_dim"] = hp.get("head_dim") or derived_head_dim
    if swa_theta is None:
        swa_theta = next((hp[k] for k in LOCAL_THETA if hp.get(k) is not None), None)
    hp["@rope_theta_swa"] = swa_theta
    rope_obj = rope_object(hp)
    orig = rope_obj.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    hp["@original_max_position_embeddings"] = orig
    # Phi3MiniModel: rotary dimensions int(partial_rotary_factor * hidden) // heads, window 0 when unset
    hp["@partial_rotary_factor"] = next(
        (v for v in (rope_obj.get("partial_rotary_factor"), hp.get("partial_rotary_factor"), hp.get("rope_pct"),
                     hp.get("rope_percent")) if v is not None), 1.0)
    hp["@rope_dimension_count"] = rotary_dims(hp, path) if arch.longrope_factors else None
    hp["@sliding_window_or_0"] = hp.get("sliding_window") if hp.get("sliding_window") is not None else 0
    hp["@rope_attn_factor"] = longrope_attn_factor(hp, path) if arch.longrope_factors else None
    # Gemma3Model: the final softcapping only when set, the window unless every layer is global
    hp["@final_logit_softcapping"] = hp.get("final_logit_softcapping") or None
    hp["@sliding_window"] = hp.get("sliding_window") if hp.get("sliding_window_pattern") != 1 else None
    if arch.name == "mistral3" and hp.get("model_type") == "ministral3":
        raise GgufConfigError(
            "a Ministral 3 text model (its YaRN temperature keys) is not supported for GGUF output",
            path=path,
            expected="text_config model_type 'mistral' (Mistral Small 3.x)",
            found="model_type 'ministral3'",
            action="convert",
        )
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hp.get(key) and arch.experts is None:
            raise GgufConfigError(
                "mixture-of-experts models are not supported for GGUF output",
                path=path,
                expected="no experts",
                found=f"{key} = {hp[key]}",
                action="convert",
            )
    return hp


def block_count(hp: Mapping[str, Any], path: str | None) -> int:
    """The number of transformer blocks (``{arch}.block_count``; sizes the ``TensorNameMap``).

    Raises:
        GgufConfigError: GGUF-006 (config.json has no layer count, or one that is not an integer
            from 1 to 2**32 - 1; :func:`convert.gguf.config.layer_count` checks it against the tensors).
    """
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in hp:
            return whole(hp[key], key, path)
    raise GgufConfigError(
        "config.json has no layer count",
        path=path,
        expected="num_hidden_layers",
        found=None,
        action="convert",
    )


def text_name(arch: Architecture, hf_name: str) -> str | None:
    """The name llama.cpp's converter gives a tensor before mapping it, None for a tensor of a
    multimodal checkpoint's other towers (vision, audio, projector: TextModel.filter_tensors).

    ``language_model.model.layers.0.mlp.up_proj.weight`` (transformers 4.x) and
    ``model.language_model.layers.0.mlp.up_proj.weight`` (5.x) -> ``model.layers.0.mlp.up_proj.weight``;
    ``vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight`` -> None.
    """
    if hf_name.startswith(_TOWER_PREFIXES) or any(part in hf_name for part in _TOWER_PARTS):
        return None
    for part in arch.strip:
        hf_name = hf_name.replace(part, "")
    return hf_name


def is_skipped(arch: Architecture, hf_name: str) -> bool:
    """True for a source tensor llama.cpp never writes (rotary caches, masks, Gemma's tied head)."""
    return hf_name.endswith(_ALWAYS_SKIPPED) or hf_name in arch.skip


def gguf_tensor_name(
    name_map: gguf.TensorNameMap, arch: Architecture, hf_name: str, path: str | None
) -> str:
    """The GGUF name of a Hugging Face tensor (gguf-py ``TensorNameMap.get_name``).

    Args:
        name_map: ``gguf.get_tensor_name_map(arch.model_arch, block_count)``.
        arch: the architecture row.
        hf_name: e.g. ``model.layers.3.self_attn.q_proj.weight``.
        path: the config file, for error messages.

    Returns:
        e.g. ``blk.3.attn_q.weight``.

    Raises:
        UnmappedTensorError: GGUF-003 (no GGUF name for this architecture).
    """
    gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise UnmappedTensorError(
            "tensor has no GGUF name for this architecture",
            path=path,
            tensor=hf_name,
            expected=f"a tensor of a {arch.name} model",
            found=hf_name,
            action="convert",
            hint="only the text model's weights can be written (no vision towers or extra heads)",
        )
    return gguf_name


def permute_heads(
    arch: Architecture, hf_name: str, shape: tuple[int, ...], hp: Mapping[str, Any], path: str | None
) -> int:
    """The head count ``LlamaModel.permute`` uses for this tensor's rows, 0 when it is not permuted.

    q_proj weight/bias: ``num_attention_heads``; k_proj: ``num_key_value_heads``; only for an
    architecture with ``permute_qk``.

    Raises:
        GgufConfigError: GGUF-006 (the rows do not split into 2 x heads).
    """
    n_head = hp.get("num_attention_heads")
    n_head_kv = hp.get("num_key_value_heads", n_head)
    heads = 0
    if arch.permute_qk and isinstance(n_head, int):
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_head
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_head_kv if isinstance(n_head_kv, int) else n_head
        if heads and (not shape or shape[0] % (2 * heads)):
            raise GgufConfigError(
                "q/k rows do not split into heads",
                path=path,
                tensor=hf_name,
                expected=f"a multiple of 2 x {heads}",
                found=shape[0] if shape else "a scalar",
                action="convert",
            )
    return heads


def norm_offset(arch: Architecture, hf_name: str) -> float:
    """Value added in float32 before rounding: Gemma's ``1.0`` on every ``*norm.weight``, else 0."""
    return arch.norm_offset if arch.norm_offset and hf_name.endswith("norm.weight") else 0.0


def permutation(rows: int, heads: int) -> npt.NDArray[np.intp]:
    """Row order of ``LlamaModel.permute``: ``out[r] = in[perm[r]]``.

    ``LlamaModel.permute`` reshapes to ``(heads, 2, rows/heads/2, ...)`` and swaps axes 1 and 2, so
    each head's two rotary halves become interleaved pairs; rows stay inside their head's block of
    ``rows/heads``.

    Returns:
        intp[rows], a permutation of ``range(rows)``.
    """
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).swapaxes(1, 2).reshape(-1)

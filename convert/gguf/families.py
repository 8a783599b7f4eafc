"""The GGUF architecture table: one :class:`Architecture` row per llama.cpp model class, as data.

Each row holds what llama.cpp's ``convert_hf_to_gguf.py`` class does for a Hugging Face architecture
(``TextModel``, ``LlamaModel``, ``GraniteModel``, ``SmolLM3Model``, ``Mistral3Model``, ``Qwen2Model``,
``Qwen2VLModel``, ``Qwen2MoeModel``, ``Qwen3Model``, ``Qwen3MoeModel``, ``Olmo2Model``, ``CommandR2Model``,
``GemmaModel``, ``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel``): the metadata entries (:class:`Param`)
in the converter's order, the defaults transformers' config class fills in, the tokenizer kinds, the
RoPE scaling types, the weight transforms to apply and how MoE experts stack (:class:`Experts`). The code
that reads a row is :mod:`convert.gguf.arch` (naming, hyperparameters, transforms); docs/gguf.md lists
the rows and what each does specially. A new family that differs only in data is a new row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import gguf

__all__ = ["ARCHITECTURES", "Architecture", "Experts", "Fused", "Param"]


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
class Fused:
    """A parameter holding several GGUF tensors along its rows (the second-to-last axis), split in equal
    parts: a 3-D ``[experts, 2 * rows, cols]`` gate/up of every expert, or a 2-D one of a shared expert
    (``Qwen2MoeModel`` / ``GraniteMoeModel.modify_tensors``).

    Attributes:
        pattern: regular expression over a tensor's text-model name with the group ``bid`` (layer).
        outputs: the GGUF tensors' names before mapping, one per part in row order, formats of ``bid``.
    """

    pattern: str
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Experts:
    """How a Mixture-of-Experts layer's weights become GGUF's stacked ``ffn_*_exps`` tensors
    (``LlamaModel.modify_tensors`` for Mixtral, ``Qwen2MoeModel`` and ``GraniteMoeModel.modify_tensors``).

    Attributes:
        pattern: regular expression over a tensor's text-model name with the groups ``bid`` (layer),
            ``xid`` (expert) and ``w`` (which weight) for per-expert weights; None when there are none.
        weights: the ``w`` values, in the order the converter writes their stacks.
        merged: the stacked tensor's name before mapping, a format of ``bid`` and ``w``.
        fused: parameters that hold every expert already (split along their rows when they hold more
            than one GGUF tensor).
    """

    pattern: str | None
    weights: tuple[str, ...] = ()
    merged: str = ""
    fused: tuple[Fused, ...] = ()


_MIXTRAL_EXPERTS = Experts(
    r"^model\.layers\.(?P<bid>\d+)\.block_sparse_moe\.experts\.(?P<xid>\d+)\.(?P<w>w[123])\.weight$",
    ("w1", "w2", "w3"),
    "layers.{bid}.feed_forward.experts.{w}.weight",
)
# per-expert weights, or (transformers 5's in-memory layout) a fused gate/up and a 3-D down
_QWEN_MOE_EXPERTS = Experts(
    r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<xid>\d+)\.(?P<w>down_proj|gate_proj|up_proj)\.weight$",
    ("down_proj", "gate_proj", "up_proj"),
    "model.layers.{bid}.mlp.experts.{w}.weight",
    fused=(
        Fused(r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.gate_up_proj(?:\.weight)?$",
              ("model.layers.{bid}.mlp.experts.gate_proj.weight", "model.layers.{bid}.mlp.experts.up_proj.weight")),
        Fused(r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.down_proj(?:\.weight)?$",
              ("model.layers.{bid}.mlp.experts.down_proj.weight",)),
    ),
)
# GraniteMoe's experts are fused parameters (JetMoe's parallel experts): input_linear = gate and up
_GRANITE_MOE_EXPERTS = Experts(
    None,
    fused=(
        Fused(r"^model\.layers\.(?P<bid>\d+)\.block_sparse_moe\.input_linear\.weight$",
              ("blk.{bid}.ffn_gate_exps.weight", "blk.{bid}.ffn_up_exps.weight")),
        Fused(r"^model\.layers\.(?P<bid>\d+)\.shared_mlp\.input_linear\.weight$",
              ("blk.{bid}.ffn_gate_shexp.weight", "blk.{bid}.ffn_up_shexp.weight")),
    ),
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
        mrope: ``rope.dimension_sections`` is required (llama.cpp's loader refuses a file without it).
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
    mrope: bool = False


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
    # an explicit null attention_multiplier is transformers' 1/sqrt(head_dim) scaling, which llama.cpp applies
    # when the key is absent: kept null (not the default 1.0) and left out
    keep_null=("attention_multiplier",),
    ignored_keys=("head_dim",),
    **_LLAMA_FAMILY,
)

# GraniteMoeModel: Granite's entries and multipliers, the shared expert's size, fused experts split
_GRANITE_MOE = replace(
    _GRANITE,
    name="granitemoe",
    model_arch=gguf.MODEL_ARCH.GRANITE_MOE,
    hf_architectures=("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
    extra_params=(*_GRANITE.extra_params,
                  Param("add_expert_shared_feed_forward_length", ("@shared_intermediate_size",))),
    config_defaults={**_GRANITE.config_defaults, "num_local_experts": 8, "num_experts_per_tok": 2},
    experts=_GRANITE_MOE_EXPERTS,
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

# Mistral3Model (Mistral3ForConditionalGeneration: Mistral Small 3.x, Ministral 3): its text model is
# Ministral3Model, LlamaModel under the mistral3 architecture, with two YaRN keys for a ``ministral3`` text model
_MISTRAL3 = Architecture(
    name="mistral3",
    model_arch=gguf.MODEL_ARCH.MISTRAL3,
    hf_architectures=("Mistral3ForConditionalGeneration",),
    params=_TEXT_PARAMS,
    extra_params=(
        *_LLAMA_EXTRA,
        Param("add_rope_scaling_yarn_log_mul", ("@yarn_log_mul",)),
        Param("add_attn_temperature_scale", ("@attn_temperature_scale",)),
    ),
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
    mrope=True,
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
    _GRANITE_MOE,
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

"""Tiny random models of transformers classes, saved bf16 and as transformers + bitsandbytes quantize and save
them (NF4, double quantization): the references of the ``--to nf4`` parity tests. Optional: torch,
transformers and bitsandbytes (the tests skip without them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

COMMON: dict[str, Any] = {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
           "image_size": 56, "patch_size": 14}

#: Mixture-of-Experts classes: name -> (config class, model class, config values)
MOE_CLASSES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**COMMON, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**COMMON, "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 4,
                   "num_experts_per_tok": 2, "head_dim": 32, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**COMMON, "intermediate_size": 256, "moe_intermediate_size": 128,
                   "shared_expert_intermediate_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {**COMMON, "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2}),
}

#: Dense and multimodal classes (a one-layer vision tower, bnb-quantized as well)
DENSE_CLASSES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3cg": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                 {"text_config": {**COMMON, "intermediate_size": 256, "head_dim": 32}, "vision_config": _VISION,
                  "mm_tokens_per_image": 4}),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                 {"text_config": {**COMMON, "intermediate_size": 256, "model_type": "mistral", "head_dim": 32},
                  "vision_config": {**_VISION, "head_dim": 32}, "image_token_index": 10}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   {"text_config": {**COMMON, "intermediate_size": 256,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                        "mrope_section": [4, 6, 6]}},
                    "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                                      "out_hidden_size": 128, "fullatt_block_indexes": [0], "window_size": 56,
                                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 {"text_config": {**COMMON, "intermediate_size": 256,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                      "mrope_section": [4, 6, 6]}},
                  "vision_config": {"depth": 1, "embed_dim": 64, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
                                    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {**COMMON, "intermediate_size": 256}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**COMMON, "intermediate_size": 256}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {**COMMON, "intermediate_size": 256, "tie_word_embeddings": True}),
    "cohere_qk_norm": ("CohereConfig", "CohereForCausalLM",  # Command R+: 2-D per-head q/k norms
                       {**COMMON, "intermediate_size": 256, "tie_word_embeddings": True, "use_qk_norm": True}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {**COMMON, "intermediate_size": 256, "pad_token_id": 0}),
}

CLASSES = {**MOE_CLASSES, **DENSE_CLASSES}


def build(name: str, root: Path):  # noqa: ANN201
    """A seeded tiny bf16 model of the class, saved to ``root/bf16``; quantized and saved by transformers +
    bnb to ``root/bnb``. Returns the torch and transformers modules."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    cfg_cls, model_cls, values = CLASSES[name]
    cfg = getattr(transformers, cfg_cls)(**values)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            p.copy_((1.0 if "norm" in n else 0.0) + (0.1 if "norm" in n else 0.05) * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "bf16")
    bnb_cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    q = getattr(transformers, model_cls).from_pretrained(root / "bf16", quantization_config=bnb_cfg,
                                                         device_map="cpu", dtype=torch.bfloat16)
    q.save_pretrained(root / "bnb")
    return torch, transformers

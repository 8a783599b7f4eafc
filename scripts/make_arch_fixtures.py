"""Build the per-architecture GGUF fixtures: tiny bnb NF4 models and llama.cpp's converter output for them.

Runs in a separate environment with torch, bitsandbytes, transformers, sentencepiece and the llama.cpp
converter's dependencies (never in the CI environment)::

    python3 -m venv .venv-fixtures
    .venv-fixtures/bin/pip install torch==2.13.0 bitsandbytes==0.50.2 transformers peft tokenizers \\
        sentencepiece safetensors numpy
    .venv-fixtures/bin/python scripts/make_arch_fixtures.py --llama-cpp DIR [--only qwen3 ...]

``DIR`` is a llama.cpp source tree holding ``convert_hf_to_gguf.py``, its ``conversion/`` package and
``gguf-py`` (e.g. ``vendor/llama.cpp`` of a llama-cpp-python source distribution). For each architecture
of :data:`ARCHS` it:

1. builds the model from a config with random weights (hidden 256, 2 layers, vocabulary 1000, bf16),
   saves it, loads it back with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
   bnb_4bit_use_double_quant=True)`` and saves that: ``tests/fixtures/models/<arch>_nf4_dq/``, with the
   tokenizer files of ``llama_nf4_dq`` (a 1000-piece SentencePiece model);
2. dequantizes it with this project's ``--to bf16`` (bit-exact with bitsandbytes) into a scratch
   directory named like the fixture, and runs transformers on it (float32) for the reference logits
   (``reference/logits.safetensors``: ``input_ids``, ``logits``);
3. runs llama.cpp's ``convert_hf_to_gguf.py`` on the dequantized model for ``--outtype f16`` and
   ``q8_0`` and stores what it wrote as ``reference/gguf_<type>.json``: every tensor's GGML type, shape
   and the sha256 of its data, and every metadata key with its value (long arrays as length + sha256).

The tests (tests/gguf/test_arch.py) compare ``convert-bnb <fixture> --to gguf:<type>`` against that JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
TOKENIZER_FROM = MODELS / "llama_nf4_dq"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "tokenizer.json")
INPUT_IDS = [1, 15, 300, 42, 7, 999, 128, 64, 3, 511, 200, 77]
OUT_TYPES = ("f16", "q8_0")
#: Arrays longer than this are stored as their length and sha256 (tokens, scores, types).
LONG_ARRAY = 32

COMMON: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.1,  # logits well away from zero, so llama.cpp's are compared at a useful scale
}

#: fixture name -> (transformers config class, model class, config values)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {
        "head_dim": 96, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 64, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "sliding_window": 64, "hidden_activation": "gelu_pytorch_tanh",
    }),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 64,
    }),
    "mistral_hd": ("MistralConfig", "MistralForCausalLM", {
        "head_dim": 96, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    }),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "tie_word_embeddings": False, "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 8.0,
    }),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {
        "rope_theta": 2000000.0, "no_rope_layer_interval": 2,
    }),
    # multimodal: COMMON goes into text_config; a one-layer vision tower (bnb-quantized too, not written)
    "gemma3cg": ("Gemma3Config", "Gemma3ForConditionalGeneration", {
        "text_config": {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 64},
        "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        "mm_tokens_per_image": 4,
    }),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {
        "text_config": {"model_type": "mistral", "head_dim": 64, "rope_theta": 1000000.0, "sliding_window": None,
                        "tie_word_embeddings": False, "initializer_range": 0.2},
        # (3 vision layers: llama.cpp's mmproj name map is sized by the vision depth and names linear_2)
        "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                          "num_attention_heads": 2, "head_dim": 32, "image_size": 56, "patch_size": 14},
        "image_token_index": 10,
    }),
    "ministral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {
        "text_config": {"model_type": "ministral3", "head_dim": 64, "tie_word_embeddings": False,
                        "rope_parameters": {"rope_type": "yarn", "type": "yarn", "rope_theta": 1000000.0,
                                            "factor": 4.0, "original_max_position_embeddings": 64,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                                            "mscale": 1.0, "llama_4_scaling_beta": 0.1}},
        "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "head_dim": 32, "image_size": 56, "patch_size": 14},
        "image_token_index": 10,
    }),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {
        "text_config": {"tie_word_embeddings": False,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                            "mrope_section": [8, 12, 12]}},
        # (depth 3: llama.cpp's mmproj name map is sized by the vision depth and names the merger's mlp.2)
        "vision_config": {"depth": 3, "embed_dim": 64, "hidden_size": 256, "num_heads": 2, "mlp_ratio": 2,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {
        "text_config": {"tie_word_embeddings": False,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                            "mrope_section": [8, 12, 12]}},
        "vision_config": {"depth": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                          "out_hidden_size": 256, "fullatt_block_indexes": [2], "window_size": 56,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }),
    # Mixture of experts: 4 experts, 2 used, per-expert weights as transformers saves them
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    }),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "head_dim": 64,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
    }),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, "tie_word_embeddings": False,
        "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
    }),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, "shared_intermediate_size": 256,
        "tie_word_embeddings": False, "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 8.0,
    }),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"tie_word_embeddings": False, "initializer_range": 0.3}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {
        "logit_scale": 0.25, "use_qk_norm": False, "layer_norm_eps": 1e-5, "rope_theta": 10000.0,
        "model_max_length": 512,
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "num_key_value_heads": 4, "max_position_embeddings": 1024, "original_max_position_embeddings": 256,
        "sliding_window": 128, "partial_rotary_factor": 0.75, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "longrope",
                         "long_factor": [1.0 + 0.25 * i for i in range(24)],
                         "short_factor": [1.0 + 0.01 * i for i in range(24)]},
    }),
}


#: multimodal fixture -> its preprocessor_config.json (image mean/std and tokens per image, which the mmproj
#: holds); llama.cpp's converter --mmproj output is stored for these (reference/mmproj_f16.json)
MMPROJ = {"gemma3cg": {"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "image_seq_length": 4, "size": {"height": 56, "width": 56},
                       "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 2,
                       "rescale_factor": 0.00392156862745098},
          "mistral3": {"image_processor_type": "PixtralImageProcessor",
                       "image_mean": [0.48145466, 0.4578275, 0.40821073],
                       "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14,
                       "size": {"longest_edge": 56}, "do_normalize": True, "do_rescale": True, "do_resize": True,
                       "rescale_factor": 0.00392156862745098},
          "qwen2_5_vl": {"image_processor_type": "Qwen2VLImageProcessor",
                         "image_mean": [0.48145466, 0.4578275, 0.40821073],
                         "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "merge_size": 2,
                         "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12845056},
          "qwen2_vl": {"image_processor_type": "Qwen2VLImageProcessor",
                       "image_mean": [0.48145466, 0.4578275, 0.40821073],
                       "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "merge_size": 2,
                       "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12845056}}

#: fixture -> (converter module, class) that takes Qwen2Model's set_vocab for the reference: llama.cpp's Qwen
#: MoE, Olmo2 and Command-R classes read only a byte-level BPE vocabulary (found by the hash of a real
#: tokenizer's output, which a 1000-token fixture cannot have); the reference reads the fixture's
#: SentencePiece vocabulary as Qwen2Model does (the BPE path is tests/gguf/test_bpe_pre.py's). Tensors
#: and every other key are the class's own.
REFERENCE_VOCAB = {"qwen3_moe": ("qwen", "Qwen3MoeModel"), "qwen2_moe": ("qwen", "Qwen2MoeModel"),
                   "olmo2": ("olmo", "Olmo2Model"), "cohere": ("command_r", "CommandR2Model")}


def _summary_value(value: Any) -> Any:
    if isinstance(value, list) and len(value) > LONG_ARRAY:
        text = json.dumps(value, ensure_ascii=False)
        return {"len": len(value), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return value


def gguf_summary(path: Path, gguf: Any) -> dict[str, Any]:
    """Tensors (type, shape, sha256 of the data) and metadata of a GGUF file, as JSON values."""
    r = gguf.GGUFReader(path)
    meta: dict[str, Any] = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = _summary_value(field.contents())
    tensors = {}
    for t in r.tensors:
        tensors[t.name] = {
            "type": t.tensor_type.name,
            "shape": [int(d) for d in t.shape],
            "sha256": hashlib.sha256(bytes(t.data.tobytes())).hexdigest(),
        }
    return {"metadata": meta, "tensors": tensors}


def build(name: str, llama_cpp: Path, scratch: Path, convert_python: str) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg_cls, model_cls, extra = ARCHS[name]
    if "text_config" in extra:  # a multimodal model: the text model's values in text_config
        values = {**extra, "text_config": {**COMMON, **extra["text_config"]}}
    else:
        values = {**COMMON, **extra}
    config = getattr(transformers, cfg_cls)(**values)
    config.architectures = [model_cls]
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    with torch.no_grad():  # norms away from their init value, so the +1 offsets and copies are visible
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.1)
    orig = scratch / f"{name}_orig"
    model.save_pretrained(orig)
    fixture = MODELS / f"{name}_nf4_dq"
    if fixture.exists():
        shutil.rmtree(fixture)
    q = getattr(transformers, model_cls).from_pretrained(
        orig,
        quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
        dtype=torch.bfloat16,
    )
    q.save_pretrained(fixture)
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_FROM / f, fixture / f)
    if name == "mistral3":  # Pixtral's projector holds the [IMG_BREAK] token's embedding row (id 12, as Mistral's)
        tc = json.loads((fixture / "tokenizer_config.json").read_text())
        tc["added_tokens_decoder"] = {"12": {"content": "[IMG_BREAK]", "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": True}}
        (fixture / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    (fixture / "generation_config.json").unlink(missing_ok=True)

    # the correctly dequantized reference: this project's --to bf16 (bit-exact with bitsandbytes)
    dq = scratch / "dq" / f"{name}_nf4_dq"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([convert_python, "-m", "convert", str(fixture), "--to", "bf16", "-o", str(dq), "-q"],
                   check=True, env=env)
    ref = getattr(transformers, model_cls).from_pretrained(dq, dtype=torch.float32)
    ref.eval()
    with torch.no_grad():
        logits = ref(torch.tensor([INPUT_IDS])).logits[0].float()
    (fixture / "reference").mkdir()
    save_file({"input_ids": torch.tensor([INPUT_IDS], dtype=torch.int64), "logits": logits.contiguous()},
              str(fixture / "reference" / "logits.safetensors"))

    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    for out_type in OUT_TYPES:
        out = scratch / f"{name}-{out_type}.gguf"
        argv = [str(llama_cpp / "convert_hf_to_gguf.py"), str(dq), "--outtype", out_type, "--outfile", str(out)]
        if name in REFERENCE_VOCAB:
            module, cls = REFERENCE_VOCAB[name]
            code = (f"import runpy, sys; sys.argv = {argv!r}; import conversion.{module} as m, conversion.qwen as q; "
                    f"m.{cls}.set_vocab = q.Qwen2Model.set_vocab; runpy.run_path(sys.argv[0], run_name='__main__')")
            subprocess.run([sys.executable, "-c", code], check=True, cwd=llama_cpp)
        else:
            subprocess.run([sys.executable, *argv], check=True, cwd=llama_cpp)
        summary = gguf_summary(out, gguf)
        summary["converter"] = "llama.cpp convert_hf_to_gguf.py"
        (fixture / "reference" / f"gguf_{out_type}.json").write_text(
            json.dumps(summary, indent=1, ensure_ascii=False, sort_keys=False) + "\n")
    if name in MMPROJ:
        _mmproj_reference(name, fixture, dq, scratch, llama_cpp, gguf)
    print(name, "->", fixture, sum(p.stat().st_size for p in fixture.rglob("*") if p.is_file()), "bytes")


def _mmproj_reference(name: str, fixture: Path, dq: Path, scratch: Path, llama_cpp: Path, gguf: Any) -> None:
    """``reference/mmproj_f16.json``: llama.cpp's converter ``--mmproj`` on the dequantized model (Gemma 3's
    vision tower renamed to transformers 4.x's ``vision_tower.vision_model.*`` first: the pinned converter
    cannot map 5.x's ``vision_tower.*``); the fixture gets the preprocessor config too."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors.numpy)
    from safetensors.numpy import load_file, save_file

    pre = json.dumps(MMPROJ[name], indent=2) + "\n"
    (fixture / "preprocessor_config.json").write_text(pre)
    legacy = scratch / "legacy" / dq.name
    shutil.copytree(dq, legacy, dirs_exist_ok=True)
    (legacy / "preprocessor_config.json").write_text(pre)
    if name == "gemma3cg":  # SigLIP under transformers 4.x's name level
        w = load_file(str(legacy / "model.safetensors"))
        save_file({("vision_tower.vision_model." + k.removeprefix("vision_tower.")
                    if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
                   for k, v in w.items()}, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    out = scratch / f"{name}-mmproj-f16.gguf"
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(legacy), "--mmproj", "--outtype",
                    "f16", "--outfile", str(out)], check=True, cwd=llama_cpp)
    summary = gguf_summary(out, gguf)
    summary["converter"] = "llama.cpp convert_hf_to_gguf.py --mmproj"
    (fixture / "reference" / "mmproj_f16.json").write_text(json.dumps(summary, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree with convert_hf_to_gguf.py")
    ap.add_argument("--only", nargs="*", choices=sorted(ARCHS), help="architectures to build (default: all)")
    ap.add_argument("--convert-python", default=sys.executable,
                    help="Python with this project's dependencies, for --to bf16 (default: this one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(ARCHS):
            build(name, args.llama_cpp.resolve(), Path(tmp), args.convert_python)


if __name__ == "__main__":
    main()

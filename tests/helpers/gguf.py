"""What the GGUF test modules share: the Llama fixture and its references, synthetic Qwen2 and Gemma models,
llama.cpp (through llama-cpp-python) as the reference loader and quantizer, and tensor hashes."""

from __future__ import annotations

import ctypes
import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.vocab import bytes_to_unicode
from safetensors.numpy import save_file

from convert.gguf.types import OUTPUT_TYPES
from tests.helpers.fixtures import MODELS

#: The Llama fixture (NF4, double quantization) and its references (dequantized weights, logits).
FIXTURE = MODELS / "llama_nf4_dq"
REF = FIXTURE / "reference"


def decoder_layers(rng: np.random.Generator, cfg: dict, *, bias: bool, norm_center: float, std: float) -> dict:
    """The decoder layers and final norm of a Llama-style model of config ``cfg``, random float32."""
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    w: dict[str, np.ndarray] = {}

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (norm_center + rng.standard_normal(n) * 0.1).astype(np.float32)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(q, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        if bias:
            w[p + "self_attn.q_proj.bias"] = mat(q)
            w[p + "self_attn.k_proj.bias"] = mat(kv)
            w[p + "self_attn.v_proj.bias"] = mat(kv)
        w[p + "self_attn.o_proj.weight"] = mat(h, q)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(ff, h)
        w[p + "mlp.up_proj.weight"] = mat(ff, h)
        w[p + "mlp.down_proj.weight"] = mat(h, ff)
    w["model.norm.weight"] = norm(h)
    return w


def make_qwen2(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Qwen2ForCausalLM (hidden 64, 4 heads, 2 kv heads, q/k/v biases) with a byte-level
    BPE tokenizer.json (256 byte tokens, 3 merges, 3 special tokens; vocab_size 264 pads 2 ids)."""
    root.mkdir(parents=True, exist_ok=True)
    byte_tokens = list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(byte_tokens)}
    merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"]]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [
        {
            "id": len(vocab) + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(specials)
    ]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    (root / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    tcfg = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 128,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}",
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tcfg), encoding="utf-8")
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": 264,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 259,
        "eos_token_id": 261,
        "use_sliding_window": False,
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": (rng.standard_normal((264, 64)) * 0.5).astype(np.float32)}
    w.update(decoder_layers(rng, cfg, bias=True, norm_center=1.0, std=0.15))
    w["lm_head.weight"] = (rng.standard_normal((264, 64)) * 0.3).astype(np.float32)
    save_file(w, str(root / "model.safetensors"), metadata={"format": "pt"})
    return w


def make_gemma(root: Path, seed: int = 1) -> dict[str, np.ndarray]:
    """A 2-layer GemmaForCausalLM (hidden 64, 4 heads of 16, 1 kv head, tied embeddings) with the
    fixture's SentencePiece tokenizer.model (vocab 1000)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE / "tokenizer.model", root / "tokenizer.model")
    tcfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "tokenizer_class": "GemmaTokenizer",
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tcfg), encoding="utf-8")
    cfg = {
        "architectures": ["GemmaForCausalLM"],
        "model_type": "gemma",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": 1000,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": (rng.standard_normal((1000, 64)) * 0.1).astype(np.float32)}
    w.update(decoder_layers(rng, cfg, bias=False, norm_center=0.0, std=0.15))
    save_file(w, str(root / "model.safetensors"), metadata={"format": "pt"})
    return w


def known_pre(monkeypatch, tok_dir: Path, name: str) -> None:
    """Add a test tokenizer's check hash to llama.cpp's table (as convert_hf_to_gguf_update.py would)."""
    pytest.importorskip("tokenizers")
    from convert.gguf import bpe_pre as gguf_bpe_pre

    monkeypatch.setitem(gguf_bpe_pre.PRE_BY_HASH, gguf_bpe_pre.check_hash(tok_dir / "tokenizer.json"), name)


def llama_logits(path: Path, ids: list[int], n_vocab: int, lora: Path | None = None) -> np.ndarray:
    """llama.cpp's logits of ``ids`` for the model ``path`` (with the GGUF LoRA adapter ``lora`` applied at scale 1:
    ``llama_adapter_lora_init`` + ``llama_set_adapters_lora``), ``(len(ids), n_vocab)`` float32."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=2, seed=0,
        lora_path=None if lora is None else str(lora),
    )
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32).reshape(len(ids), n_vocab)
    finally:
        llm.close()


def has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_quantize(src: Path, dst: Path, mix: str, *, output_tensor_type: str | None = None,
                   token_embedding_type: str | None = None, tensor_types: tuple[tuple[str, str], ...] = (),
                   pure: bool = False, leave_output_tensor: bool = False) -> gguf.GGUFReader:
    """``llama_model_quantize`` with one thread, the mix's ftype, and llama-quantize's per-tensor options set
    as its command line sets them (``--tensor-type PATTERN=TYPE``: lower-cased patterns, in order)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = int(OUTPUT_TYPES[mix][1])
    if output_tensor_type is not None:
        params.output_tensor_type = int(gguf.GGMLQuantizationType[output_tensor_type.upper()])
    if token_embedding_type is not None:
        params.token_embedding_type = int(gguf.GGMLQuantizationType[token_embedding_type.upper()])
    params.pure = pure
    params.quantize_output_tensor = not leave_output_tensor
    override = llama_cpp.llama_model_tensor_override  # struct llama_model_tensor_override: pattern, ggml_type
    overrides = (override * (len(tensor_types) + 1))(
        *[override(p.lower().encode(), int(gguf.GGMLQuantizationType[t.upper()])) for p, t in tensor_types],
        override(None, 0))
    if tensor_types:
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(override))
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    return gguf.GGUFReader(dst)


def tensor_hashes(path: Path) -> dict[str, list[str]]:
    """name -> [GGML type name, sha256 of the tensor's bytes] (as scripts/make_kquant_goldens.py)."""
    return {t.name: [t.tensor_type.name, hashlib.sha256(np.asarray(t.data).view(np.uint8).tobytes()).hexdigest()]
            for t in gguf.GGUFReader(path).tensors}

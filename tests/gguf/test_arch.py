"""GGUF per architecture against llama.cpp's own converter (golden files), and llama.cpp loading them.

Each ``tests/fixtures/models/<arch>_nf4_dq`` is a tiny model saved by transformers + bitsandbytes (NF4,
double quantization); its ``reference/gguf_<type>.json`` is what llama.cpp's ``convert_hf_to_gguf.py``
wrote from the correctly dequantized model (every tensor's type, shape and sha256; every metadata key),
and ``reference/logits.safetensors`` transformers' logits of that model (scripts/make_arch_fixtures.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from formats import errors as E
from formats.safetensors import SafetensorsReader
from tests.helpers.fixtures import MODELS, arch_fixtures, plan_inputs
from tests.helpers.gguf import llama_logits, tensor_hashes

ARCHS = arch_fixtures()
OUT_TYPES = ["f16", "q8_0"]
LONG_ARRAY = 32


def _fixture(arch: str) -> Path:
    root = MODELS / f"{arch}_nf4_dq"
    if not (root / "reference" / "gguf_f16.json").is_file():
        pytest.skip(f"no fixture for {arch} (scripts/make_arch_fixtures.py builds it)")
    return root


def _value(value: Any) -> Any:
    if isinstance(value, list) and len(value) > LONG_ARRAY:
        text = json.dumps(value, ensure_ascii=False)
        return {"len": len(value), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return value


def summary(path: Path) -> dict[str, Any]:
    """As scripts/make_arch_fixtures.py ``gguf_summary``: metadata values and tensor type/shape/sha256."""
    r = gguf.GGUFReader(path)
    meta = {k: _value(f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {
        t.name: {"type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
                 "sha256": hashlib.sha256(bytes(t.data.tobytes())).hexdigest()}
        for t in r.tensors
    }
    return {"metadata": meta, "tensors": tensors}


def _convert(tmp_path: Path, arch: str, out_type: str, src: Path | None = None) -> Path:
    from convert.cli import main

    out = tmp_path / f"{arch}-{out_type}.gguf"
    src = src or _fixture(arch)
    assert main([str(src), "--to", f"gguf:{out_type}", "-o", str(out), "-q", "--threads", "2"]) == 0
    return out


def _close(a: Any, b: Any) -> bool:
    """Equal, floats compared as the float32 values GGUF stores."""
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.float32(a) == np.float32(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("out_type", OUT_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_equals_llama_cpp_converter(tmp_path, arch, out_type):
    root = _fixture(arch)
    want = json.loads((root / "reference" / f"gguf_{out_type}.json").read_text())
    got = summary(_convert(tmp_path, arch, out_type))
    assert sorted(got["tensors"]) == sorted(want["tensors"])
    for name, t in want["tensors"].items():
        assert got["tensors"][name] == t, name
    # every key, general.* too: the converter ran on a folder of the fixture's name (general.name "Phi3_Nf4_Dq")
    gm, wm = got["metadata"], want["metadata"]
    assert sorted(gm) == sorted(wm)
    for key, value in wm.items():
        assert _close(gm[key], value), (key, gm[key], value)


#: max |llama.cpp - transformers| relative to the largest reference logit.
LOGIT_BOUND = {"f16": 0.005, "q8_0": 0.04}


@pytest.mark.parametrize("out_type", OUT_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_logits_match_transformers(tmp_path, arch, out_type):
    pytest.importorskip("llama_cpp")
    root = _fixture(arch)
    r = SafetensorsReader(root / "reference" / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    want = np.array(r.array("logits"), dtype=np.float32).reshape(len(ids), -1)
    # llama.cpp gives a model whose general.name holds "phi3" Phi-3's special-token attributes, which
    # need an <|endoftext|> token the fixture's 1000-token vocabulary lacks: convert it under another name
    src = shutil.copytree(root, tmp_path / "tiny_nf4_dq") if arch == "phi3" else root
    got = llama_logits(_convert(tmp_path, arch, out_type, src), ids, want.shape[-1])
    diff = float(np.abs(got - want).max())
    assert diff <= LOGIT_BOUND[out_type] * float(np.abs(want).max()), diff
    # the same next token wherever the reference's top two are further apart than the difference
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * diff
    assert clear.sum() >= len(ids) // 2
    assert np.array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


# --------------------------------------------------------------------------------------------
# Every new config value is checked: a bad one is a named error before any output exists
# --------------------------------------------------------------------------------------------

#: id -> (fixture, config.json keys set (None deletes), error class, message parts)
BAD: dict[str, tuple[str, dict[str, Any], type[Exception], list[str]]] = {
    # llama.cpp's converter leaves a zero logit_scale out, and its loader then refuses the file
    "granite-zero-logits-scaling": ("granite", {"logits_scaling": 0}, E.GgufConfigError,
                                    ["'logits_scaling' is out of range", "> 0"]),
    "granite-string-attention-multiplier": ("granite", {"attention_multiplier": "0.25"}, E.GgufConfigError,
                                            ["'attention_multiplier' is not a number"]),
    "gemma2-null-attn-softcap": ("gemma2", {"attn_logit_softcapping": None}, E.GgufConfigError,
                                 ["lacks a hyperparameter llama.cpp needs", "attn_logit_softcapping"]),
    "gemma2-final-softcap-string": ("gemma2", {"final_logit_softcapping": "30"}, E.GgufConfigError,
                                    ["'final_logit_softcapping' is not a number"]),
    "gemma2-window-negative": ("gemma2", {"sliding_window": -1}, E.GgufConfigError,
                               ["'sliding_window' is out of range", "found -1"]),
    "gemma3-swa-theta-negative": ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": -1.0}}}, E.GgufConfigError,
        ["'rope_theta_swa' is out of range"]),
    "gemma3-unknown-rope-type": ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, E.RopeScalingError,
        ["RoPE scaling type not supported", "found 'dynamic'"]),
    "qwen3-head-dim-0": ("qwen3", {"head_dim": 0}, E.GgufConfigError, ["'head_dim' is out of range"]),
    "phi3-long-factor-short": ("phi3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 256, "long_factor": [1.0] * 23, "short_factor": [1.0] * 24}},
        E.RopeScalingError, ["'long_factor' does not hold one factor per rotary dimension pair", "24 numbers"]),
    "phi3-factor-nan": ("phi3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 256, "long_factor": [1.0] * 24, "short_factor": ["x"] * 24}},
        E.RopeScalingError, ["'rope.short_factor[0]' is not a number"]),
    "phi3-partial-rotary-2": ("phi3", {"partial_rotary_factor": 2.0, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
        "long_factor": [1.0] * 24, "short_factor": [1.0] * 24}}, E.GgufConfigError,
        ["'partial_rotary_factor' is out of range"]),
    "phi3-original-context-0": ("phi3", {"original_max_position_embeddings": 0, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "long_factor": [1.0] * 24, "short_factor": [1.0] * 24}}, E.GgufConfigError,
        ["'original_max_position_embeddings' is out of range"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_value_is_a_named_error_before_any_output(tmp_path, case):
    from convert.cli import main

    arch, values, error, parts = BAD[case]
    src = shutil.copytree(_fixture(arch), tmp_path / "model", ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(values)
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.gguf"
    from tests.helpers.malformed import convert

    with pytest.raises(E.ConvertBnbError) as info:
        convert(src, out, to="gguf:q8_0")
    assert type(info.value) is error
    for part in [error.default_rule, *parts]:
        assert part in str(info.value), (part, str(info.value))
    assert not out.exists()
    assert main(["check", str(src), "--to", "gguf:q8_0", "-q"]) == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_check_to_gguf_is_clean_for_each_fixture(arch):
    from convert.cli import main

    assert main(["check", str(_fixture(arch)), "--to", "gguf:q8_0", "-q"]) == 0


def test_unsupported_architecture_lists_the_new_ones():
    from convert.gguf.arch import find_architecture

    with pytest.raises(E.UnsupportedArchitectureError) as e:
        find_architecture({"architectures": ["FalconForCausalLM"]})
    for name in ("Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                 "MistralForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM", "Gemma3ForConditionalGeneration",
                 "Mistral3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                 "Qwen2_5_VLForConditionalGeneration", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                 "Qwen3MoeForCausalLM", "Olmo2ForCausalLM", "CohereForCausalLM", "GraniteMoeForCausalLM",
                 "GraniteMoeSharedForCausalLM"):
        assert name in str(e.value)
    assert "..." not in str(e.value)  # the whole list, not cut at 300 characters


def test_phi3_with_a_gpt2_tokenizer_class_takes_the_byte_level_bpe_path(tmp_path, monkeypatch):
    """Phi3MiniModel.set_vocab: tokenizer_config.json's GPT2Tokenizer (Phi-4-mini) -> byte-level BPE, even
    with a tokenizer.model beside it; otherwise tokenizer.model (SentencePiece)."""
    from convert.gguf.plan import plan_gguf
    from convert.stream.plan import make_plan
    from formats.checkpoint import open_checkpoint
    from tests.helpers.gguf import known_pre, make_qwen2

    root = _fixture("phi3")
    cfg = json.loads((root / "config.json").read_text())
    shapes = [(t.name, t.shape) for t in make_plan(open_checkpoint(root)).tensors]
    tok = tmp_path / "tok"
    make_qwen2(tok)
    shutil.copy(root / "tokenizer.model", tok / "tokenizer.model")
    known_pre(monkeypatch, tok, "qwen2")
    spm = plan_gguf(cfg, shapes, tok, "f16").metadata
    assert spm["tokenizer.ggml.model"][0] == "llama"
    tcfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "tokenizer_class": "GPT2Tokenizer"}))
    md = plan_gguf(cfg, shapes, tok, "f16").metadata
    assert md["tokenizer.ggml.model"][0] == "gpt2" and md["tokenizer.ggml.pre"][0] == "qwen2"
    assert len(md["tokenizer.ggml.tokens"][0]) == 1000 and "tokenizer.ggml.scores" not in md


@pytest.mark.parametrize("how", ["directory", "readme", "name_or_path"])
def test_a_qwen3_reranker_is_refused_before_any_weight(tmp_path, how):
    """llama.cpp's Qwen3Model recognizes a reranker by name or README and writes another model (a
    classifier head, rank pooling): refused rather than converted differently."""
    from tests.helpers.malformed import convert

    name = "Qwen3-Reranker-tiny" if how == "directory" else "model"
    src = shutil.copytree(_fixture("qwen3"), tmp_path / name, ignore=shutil.ignore_patterns("reference"))
    if how == "readme":
        (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker-0.6B\n")
    if how == "name_or_path":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "Qwen/Qwen3-Reranker-4B"}))
    with pytest.raises(E.UnsupportedArchitectureError) as e:
        convert(src, tmp_path / "m.gguf", to="gguf:f16")
    assert e.value.rule == "GGUF-001" and "Qwen3 reranker" in str(e.value)


# --------------------------------------------------------------------------------------------
# K-quant mixes: byte-identical with llama-quantize run on our f32 file, for every architecture
# --------------------------------------------------------------------------------------------


def _kquant_golden(arch: str) -> dict[str, dict[str, list[str]]]:
    path = _fixture(arch) / "reference" / "gguf_kquant_sha256.json"
    if not path.is_file():
        pytest.skip(f"no K-quant golden for {arch} (scripts/make_kquant_goldens.py makes it)")
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kquant_mix_equals_llama_quantizes_output(tmp_path, arch):
    """``--to gguf:MIX`` for each of llama-quantize's file types: every tensor's type and bytes as
    llama-quantize writes them from our ``gguf:f32`` file (golden hashes; no llama_cpp needed)."""
    from convert.gguf.types import FILE_TYPES

    golden = _kquant_golden(arch)
    assert sorted(golden) == sorted(m for m, ft in FILE_TYPES.items() if not ft.needs_imatrix)
    for mix, want in golden.items():
        out = _convert(tmp_path, arch, mix)
        assert tensor_hashes(out) == want, mix
        out.unlink()


@pytest.mark.parametrize("arch", ARCHS)
def test_kquant_golden_is_what_llama_quantize_makes_now(tmp_path, arch):
    pytest.importorskip("llama_cpp")
    from tests.helpers.gguf import llama_quantize

    golden = _kquant_golden(arch)
    f32 = _convert(tmp_path, arch, "f32")
    llama_quantize(f32, tmp_path / "q4_k_m.gguf", "q4_k_m")
    assert tensor_hashes(tmp_path / "q4_k_m.gguf") == golden["q4_k_m"]


@pytest.mark.parametrize(("layers", "qk_norm", "found"), [(2, True, "2 layers with q/k norms"),
                                                         (64, False, "64 layers without q/k norms")])
def test_command_r_q_k_norms_only_with_64_layers(layers: int, qk_norm: bool, found: str) -> None:
    """llama.cpp's command-r loader takes attn_q/k_norm exactly when n_layer >= 64 (Command R+): any other
    file is "wrong number of tensors" there, so it is refused while planning."""
    root = MODELS / "cohere_nf4_dq"
    config, shapes = plan_inputs(root)
    per_layer = [(n, s) for n, s in shapes if n.startswith("model.layers.0.")]
    shapes = [(n, s) for n, s in shapes if not n.startswith("model.layers.")]
    for i in range(layers):
        shapes += [(n.replace("layers.0.", f"layers.{i}."), s) for n, s in per_layer]
        if qk_norm:
            shapes += [(f"model.layers.{i}.self_attn.q_norm.weight", (4, 64)),
                       (f"model.layers.{i}.self_attn.k_norm.weight", (2, 64))]
    from convert.gguf.plan import plan_gguf

    with pytest.raises(E.GgufConfigError) as info:
        plan_gguf(dict(config, num_hidden_layers=layers, use_qk_norm=qk_norm), shapes, root, "f16")
    assert "GGUF-006 llama.cpp loads a Command-R model's q/k norms exactly when it has 64 layers or more" \
        in str(info.value)
    assert found in str(info.value)


@pytest.mark.parametrize(("rope", "found"), [
    ({"rope_type": "default", "rope_theta": 1e6}, "found \"type 'default', mscale_all_dim None\""),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 1.0},
     "found \"type 'yarn', llama_4_scaling_beta None\""),
])
def test_a_ministral3_text_model_without_its_yarn_keys_is_refused(rope, found):  # noqa: ANN001
    from convert.gguf.plan import plan_gguf

    root = MODELS / "ministral3_nf4_dq"
    config, shapes = plan_inputs(root)
    config = dict(config, text_config=dict(config["text_config"], rope_parameters=rope))
    with pytest.raises(E.RopeScalingError) as info:
        plan_gguf(config, shapes, root, "f16")
    assert "GGUF-005 a Ministral 3 text model needs YaRN RoPE" in str(info.value)
    assert found in str(info.value)


def test_a_null_granite_attention_multiplier_is_left_out():
    """transformers scales attention by 1/sqrt(head_dim) when attention_multiplier is null; llama.cpp does the
    same when granite.attention.scale is absent (f_attention_scale 0). An absent key takes GraniteConfig's 1.0."""
    from convert.gguf.plan import plan_gguf

    root = MODELS / "granite_nf4_dq"
    config, shapes = plan_inputs(root)
    assert "granite.attention.scale" not in plan_gguf(dict(config, attention_multiplier=None), shapes, root).metadata
    absent = {k: v for k, v in config.items() if k != "attention_multiplier"}
    assert plan_gguf(absent, shapes, root).metadata["granite.attention.scale"][0] == 1.0


@pytest.mark.parametrize(("fixture", "drop", "missing"), [
    ("mixtral_nf4_dq", "model.layers.1.block_sparse_moe.gate.weight", "blk.1.ffn_gate_inp.weight"),
    ("granitemoe_nf4_dq", "model.layers.0.block_sparse_moe.output_linear.weight", "blk.0.ffn_down_exps.weight"),
    ("granitemoeshared_nf4_dq", "model.layers.1.shared_mlp.output_linear.weight", "blk.1.ffn_down_shexp.weight"),
    ("olmo2_nf4_dq", "model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
    ("cohere_nf4_dq", "model.layers.1.input_layernorm.weight", "blk.1.attn_norm.weight"),
    ("gemma3cg_nf4_dq", "language_model.model.layers.0.post_feedforward_layernorm.weight",
     "blk.0.post_ffw_norm.weight"),
    ("llama_nf4_dq", "model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight"),
    ("qwen2_moe_nf4_dq", "model.layers.0.mlp.shared_expert_gate.weight", "blk.0.ffn_gate_inp_shexp.weight"),
])
def test_a_tensor_llama_cpp_requires_is_missing(fixture, drop, missing):
    """llama.cpp refuses a file without a required tensor ("tensor ... not found"): refused while planning."""
    from convert.gguf.plan import plan_gguf

    config, shapes = plan_inputs(MODELS / fixture)
    assert drop in dict(shapes)
    with pytest.raises(E.GgufConfigError) as info:
        plan_gguf(config, [(n, s) for n, s in shapes if n != drop], MODELS / fixture, "q8_0")
    assert f"GGUF-006 the weights lack a tensor llama.cpp's loader requires: {missing}" in str(info.value)


@pytest.mark.parametrize(("fixture", "edit", "error", "part"), [
    ("mixtral_nf4_dq", {"num_experts_per_tok": 9}, E.GgufConfigError,
     "routes each token to more experts than the model has (expected 'num_experts_per_tok <= 4 (the expert count)', "
     "found 9)"),
    ("granitemoeshared_nf4_dq", {"shared_intermediate_size": 0}, E.GgufConfigError,
     "the weights hold a shared expert, and config.json gives it no size"),
    ("qwen2_5_vl_nf4_dq", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [0, 0, 0]}},
     E.RopeScalingError, "one of the first three above 0"),
    ("qwen2_5_vl_nf4_dq", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, E.RopeScalingError,
     "a qwen2vl model needs its M-RoPE sections"),
])
def test_a_config_llama_cpp_would_abort_on_is_refused(fixture, edit, error, part):
    from convert.gguf.plan import plan_gguf

    config, shapes = plan_inputs(MODELS / fixture)
    if "text_config" in config:
        config = dict(config, text_config={**config["text_config"], **edit})
    else:
        config = {**config, **edit}
    with pytest.raises(error) as info:
        plan_gguf(config, shapes, MODELS / fixture, "f16")
    assert part in str(info.value)

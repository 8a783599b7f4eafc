"""``--to nf4`` of Mixture-of-Experts models: modules selected as transformers 5 + bitsandbytes select them.

transformers 5 keeps experts as fused parameters and routers as ``*TopKRouter`` modules, neither an
``nn.Linear``, so bnb leaves both 16-bit and saves them under the original per-expert names; a file
with 4-bit experts does not load ("size mismatch"). The parity tests build tiny models of each class
on CPU, quantize and save them with transformers + bnb, and compare our file byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convert.bnb4.select import moe_kept, moe_unknown, should_quantize
from convert.cli import main
from formats.dtypes import BY_NAME
from tests.helpers.fixtures import load_all
from tests.helpers.tiny_models import MOE_CLASSES, build

# --- the rule, header only --------------------------------------------------------------------------


BF16 = BY_NAME["bfloat16"]


@pytest.mark.parametrize(("model_type", "name", "quantized"), [
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w1.weight", False),
    ("mixtral", "model.layers.0.block_sparse_moe.gate.weight", False),
    ("mixtral", "model.layers.0.mlp.gate.weight", False),  # the names transformers uses in memory
    ("mixtral", "model.layers.0.self_attn.q_proj.weight", True),
    ("qwen3_moe", "model.layers.1.mlp.experts.0.gate_proj.weight", False),
    ("qwen3_moe", "model.layers.1.mlp.gate.weight", False),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert.gate_proj.weight", True),  # nn.Linear: quantized
    ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight", True),
    ("granitemoe", "model.layers.0.block_sparse_moe.router.layer.weight", False),
    ("granitemoe", "model.layers.0.block_sparse_moe.input_linear.weight", False),
    ("llama", "model.layers.0.mlp.gate_proj.weight", True),
])
def test_experts_and_router_stay_16_bit(model_type: str, name: str, quantized: bool) -> None:
    moe = moe_kept({"model_type": model_type})
    assert (moe is None) == (model_type == "llama")
    ok, why = should_quantize(name, (256, 128), BF16, moe=moe)
    assert ok is quantized, why
    if not quantized:
        assert why == "MoE expert or router (transformers keeps it 16-bit)"
    # a 4-bit expert of the input (transformers 4.x quantized them) is dequantized, not kept 4-bit
    assert should_quantize(name, (256, 128), BF16, was_quantized=True, moe=moe)[0] is quantized


def test_moe_kept_reads_a_multimodal_text_config_and_ignores_bad_values() -> None:
    assert moe_kept({"model_type": "x", "text_config": {"model_type": "qwen3_moe"}}) is not None
    for config in (None, [], {"model_type": 3}, {"model_type": "llama", "text_config": "qwen3_moe"}):
        assert moe_kept(config) is None


def _moe_dir(root: Path, model_type: str, count_key: str) -> Path:
    """A tiny per-expert-layout checkpoint of ``model_type`` (bf16, 2 experts, random values)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
             *(f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 1) for p in ("gate_proj", "up_proj"))]
    d = root / model_type
    d.mkdir()
    tensors = {n: rng.standard_normal((64, 64), dtype=np.float32).astype(BF16.numpy) for n in names}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"model_type": model_type, count_key: 2, "architectures": ["X"]}))
    return d


@pytest.mark.parametrize(("model_type", "count_key"), [("deepseek_v3", "n_routed_experts"),
                                                       ("gpt_oss", "num_local_experts"),
                                                       ("ernie4_5_moe", "moe_num_experts")])
def test_a_moe_model_of_an_unknown_layout_is_refused_before_writing(
        model_type: str, count_key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """QNT-007: the experts would be quantized where transformers + bnb may keep them 16-bit; nothing is
    written. --skip-modules naming the experts (the user knows the layout) lets it through, as the error says."""
    src = _moe_dir(tmp_path, model_type, count_key)
    assert main([str(src), "--to", "nf4", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight': QNT-007 the experts of this " \
           "Mixture-of-Experts model would be quantized" in err
    assert f"found \"model_type '{model_type}' with {count_key} = 2\"" in err
    assert "mixtral, phimoe, qwen2_moe, qwen3_moe, olmoe, granitemoe, granitemoeshared" in err
    assert "--skip-modules '.*\\.experts'" in err
    assert not (tmp_path / "out").exists()
    assert main([str(src), "--to", "nf4", "--skip-modules", r".*\.experts", "-o", str(tmp_path / "out"), "-q"]) == 0
    out = load_all(tmp_path / "out" / "model.safetensors")
    assert out["model.layers.0.mlp.experts.1.up_proj.weight"].dtype.name == "bfloat16"
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == np.uint8


@pytest.mark.parametrize("count", [None, 0, "4"])
def test_expert_tensors_of_an_unknown_type_are_refused_whatever_the_count_says(
        count: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """QNT-007 also when config.json has no usable expert count: the tensor names show the experts."""
    src = _moe_dir(tmp_path, "deepseek_v3", "n_routed_experts")
    cfg = json.loads((src / "config.json").read_text())
    cfg["n_routed_experts"] = count
    (src / "config.json").write_text(json.dumps(cfg))
    assert main([str(src), "--to", "nf4", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "QNT-007" in err and "found \"model_type 'deepseek_v3' with expert tensors\"" in err
    assert not (tmp_path / "out").exists()


def test_a_dense_model_or_a_single_expert_count_is_not_a_moe_model() -> None:
    assert moe_unknown({"model_type": "llama"}) is None
    assert moe_unknown({"model_type": "x", "num_experts": 1}) is None
    assert moe_unknown({"model_type": "x", "num_experts": True}) is None
    assert moe_unknown({"model_type": "qwen3_moe", "num_experts": 8}) is None  # known layout
    assert moe_unknown({"model_type": "x", "text_config": {"model_type": "glm4_moe", "n_routed_experts": 8}}) \
        == "model_type 'glm4_moe' with n_routed_experts = 8"


# --- against transformers + bitsandbytes ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MOE_CLASSES))
def test_nf4_of_a_moe_model_equals_transformers_and_bnb(name: str, tmp_path: Path) -> None:
    """Optional (torch, transformers, bitsandbytes): our ``--to nf4`` of the bf16 model is the file
    transformers + bnb write, byte for byte (experts and router bf16, attention 4-bit)."""
    torch, _ = build(name, tmp_path)
    assert main([str(tmp_path / "bf16"), "--to", "nf4", "--torch-threads", str(torch.get_num_threads()),
                 "-o", str(tmp_path / "ours"), "-q"]) == 0
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "bnb" / f).read_bytes(), f
    ours = load_all(tmp_path / "ours" / "model.safetensors")
    experts = [k for k in ours if ".experts." in k or "input_linear" in k]
    assert experts and all(ours[k].dtype.name == "bfloat16" for k in experts)
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == np.uint8


def test_4_bit_experts_of_the_input_are_dequantized_and_the_output_loads(tmp_path: Path) -> None:
    """Optional: a checkpoint whose per-expert weights are 4-bit (as transformers 4.x saved MoE models)
    becomes a file transformers 5 loads: experts bf16, equal to bnb's dequantization of them."""
    torch, transformers = build("mixtral", tmp_path)
    import bitsandbytes as bnb  # (optional dependency of this test)
    from safetensors.torch import load_file, save_file

    src = tmp_path / "bnb4x"
    src.mkdir()
    for f in ("config.json", "generation_config.json"):
        (src / f).write_bytes((tmp_path / "bnb" / f).read_bytes())
    tensors, want = {}, {}
    for k, v in load_file(tmp_path / "bnb" / "model.safetensors").items():
        if ".experts." in k:
            q, state = bnb.functional.quantize_4bit(v, blocksize=64, compress_statistics=True, quant_type="nf4")
            tensors[k] = q
            tensors.update({f"{k}.{s}": t for s, t in state.as_dict(packed=True).items()})
            want[k] = bnb.functional.dequantize_4bit(q, state).to(torch.bfloat16)
        else:
            tensors[k] = v
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert main([str(src), "--to", "nf4", "-o", str(tmp_path / "ours"), "-q"]) == 0
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert len(want) == 24
    for k, w in want.items():
        assert ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], w), k
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] \
        == "nf4"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", device_map="cpu")
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(fused[1], want["model.layers.0.block_sparse_moe.experts.1.w2.weight"])


def test_the_plan_says_which_weights_stay_16_bit_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers.fixtures import MODELS

    assert main([str(MODELS / "mixtral_nf4_dq"), "--to", "nf4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("note: 26 weights not quantized: MoE expert or router (transformers keeps it 16-bit) (first: "
            "model.layers.0.block_sparse_moe.experts.0.w1.weight)") in out
    assert "note: 1 weight not quantized: output head (first: lm_head.weight)" in out

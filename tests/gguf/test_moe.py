"""GGUF of Mixture-of-Experts models: per-expert weights stacked into ``ffn_*_exps`` as llama.cpp's converter
stacks them (tests/gguf/test_arch.py compares the fixtures with the converter and llama.cpp's logits; here the
stacking itself: 4-bit experts, chunks across experts, and the named errors of a malformed layout)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from convert.cli import main
from convert.gguf.plan import plan_gguf
from convert.stream.sources import ArraySource, StackSource
from formats import errors as E
from formats.dtypes import BY_NAME
from formats.safetensors import SafetensorsReader
from tests.gguf.test_arch import summary
from tests.helpers.fixtures import MODELS, plan_inputs

MIXTRAL = MODELS / "mixtral_nf4_dq"
QWEN2_MOE = MODELS / "qwen2_moe_nf4_dq"


def _hashes(path: Path) -> dict[str, tuple[str, list[int], str]]:
    """(type, shape, sha256) per tensor, from test_arch's summary (the golden files' format)."""
    return {n: (t["type"], t["shape"], t["sha256"]) for n, t in summary(path)["tensors"].items()}


@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_4_bit_experts_stack_as_their_dequantized_values(tmp_path: Path, out_type: str) -> None:
    """A checkpoint whose experts are 4-bit (as transformers 4.x saved MoE models) gives the GGUF of its
    bf16 dequantization, tensor for tensor; the chunks (64 Ki elements) each span two experts of 32 Ki."""
    q = tmp_path / "experts4"
    assert main([str(MIXTRAL), "--to", "nf4", "--include", ".*experts.*", "-o", str(q), "-q"]) == 0
    with SafetensorsReader(q / "model.safetensors") as r:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight.absmax" in r.tensors
    dq = tmp_path / "dq"
    assert main([str(q), "--to", "bf16", "-o", str(dq), "-q"]) == 0
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main([str(q), "--to", f"gguf:{out_type}", "-o", str(a), "-q", "--threads", "2"]) == 0
    assert main([str(dq), "--to", f"gguf:{out_type}", "-o", str(b), "-q"]) == 0
    got, want = _hashes(a), _hashes(b)
    assert got == want
    assert got["blk.0.ffn_down_exps.weight"][:2] == (out_type.upper(), [128, 256, 4])  # GGUF order


def test_stack_source_reads_across_parts() -> None:
    parts = [(ArraySource(f"e{i}", np.arange(i * 10, i * 10 + 10, dtype=np.float32)), 0, 10) for i in range(3)]
    s = StackSource("stack", parts)
    f32 = BY_NAME["float32"]
    assert s.numel == 30
    np.testing.assert_array_equal(s.produce(7, 23, f32), np.arange(7, 23, dtype=np.float32))
    out = np.zeros(16, np.float32)
    s.produce_into(7, 23, f32, out)
    np.testing.assert_array_equal(out, np.arange(7, 23, dtype=np.float32))
    assert s.codes_4bit(0, 10) is None and s.codes_4bit(5, 15) is None
    with pytest.raises(ValueError, match="parts of one length"):
        StackSource("x", [parts[0], (parts[1][0], 0, 3)])
    # rows of a fused [2 experts, 2 x 2 rows, 3 cols] parameter: the second block of each expert's rows
    fused = ArraySource("f", np.arange(24, dtype=np.float32))
    up = StackSource("up", [(fused, 6, 12), (fused, 18, 24)])
    np.testing.assert_array_equal(up.produce(0, 12, f32), np.r_[6:12, 18:24].astype(np.float32))


def test_a_layer_s_experts_become_three_stacks_with_the_router_kept_f32() -> None:
    config, shapes = plan_inputs(QWEN2_MOE)
    plan = plan_gguf(config, shapes, QWEN2_MOE, "q4_k_m")
    by_name = {t.name: t for t in plan.tensors}
    down = by_name["blk.1.ffn_down_exps.weight"]
    assert down.shape == (4, 256, 128)
    assert down.parts == tuple((f"model.layers.1.mlp.experts.{e}.down_proj.weight", 0, 256 * 128) for e in range(4))
    assert down.source == "model.layers.1.mlp.experts.[0-3].down_proj.weight"
    assert by_name["blk.0.ffn_gate_inp.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    assert plan.metadata["qwen2moe.expert_count"][0] == 4
    assert plan.metadata["qwen2moe.expert_used_count"][0] == 2
    assert plan.metadata["qwen2moe.expert_feed_forward_length"][0] == 128
    reference = json.loads((QWEN2_MOE / "reference" / "gguf_f16.json").read_text())["metadata"]
    assert plan.metadata["general.size_label"][0] == reference["general.size_label"] == "4x1.5M"


@pytest.mark.parametrize(("edit", "parts"), [
    (lambda s: [x for x in s if x[0] != "model.layers.1.mlp.experts.2.up_proj.weight"],
     ["a layer's experts are incomplete", "expected '4 experts x down_proj, gate_proj, up_proj in layer 1'",
      "found 'no up_proj of expert 2 (11 of 12 tensors)'"]),
    (lambda s: s + [("model.layers.0.mlp.experts.4.up_proj.weight", (128, 256))],
     ["an expert past config.json's expert count", "tensor 'model.layers.0.mlp.experts.4.up_proj.weight'",
      "expected 'an expert index < 4', found 4"]),
    (lambda s: [(n, (64, 256) if n == "model.layers.0.mlp.experts.3.gate_proj.weight" else sh) for n, sh in s],
     ["experts of one layer's weight have different shapes", "expected [128, 256], found [64, 256]"]),
])
def test_a_malformed_expert_layout_is_refused_while_planning(edit, parts) -> None:  # noqa: ANN001
    config, shapes = plan_inputs(QWEN2_MOE)
    with pytest.raises(E.GgufConfigError) as info:
        plan_gguf(config, edit(shapes), QWEN2_MOE, "f16")
    for part in ["GGUF-006", *parts]:
        assert part in str(info.value), (part, str(info.value))


def test_an_expert_size_that_disagrees_with_the_config_is_refused(tmp_path: Path) -> None:
    """llama.cpp's loader checks ffn_*_exps against expert_feed_forward_length: caught before writing."""
    src = shutil.copytree(QWEN2_MOE, tmp_path / "m", ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 64
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(E.GgufConfigError) as info:
        plan_gguf(cfg, plan_inputs(src)[1], src, "f16")
    assert "blk.0.ffn_gate_exps.weight has 128 rows; moe_intermediate_size 64" in str(info.value)


def test_a_moe_class_without_a_stacking_rule_is_still_refused() -> None:
    config, shapes = plan_inputs(MIXTRAL)
    with pytest.raises(E.GgufConfigError) as info:
        plan_gguf(dict(config, architectures=["MistralForCausalLM"]), shapes, MIXTRAL, "f16")
    assert ("config.json gives experts, and this architecture has no mixture-of-experts layout (those that do: "
            "GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM, MixtralForCausalLM") in str(info.value)



def test_fused_expert_parameters_give_the_per_expert_layout_s_file(tmp_path: Path) -> None:
    """Qwen3-MoE experts saved fused (transformers 5's in-memory layout: ``mlp.experts.gate_up_proj``
    ``[experts, 2 x rows, cols]`` and ``mlp.experts.down_proj`` ``[experts, cols, rows]``) give the file of
    the per-expert layout, whose tensors equal llama.cpp's converter (reference/gguf_f16.json): the gate and
    up stacks are each expert's first and second block of rows."""
    from safetensors.numpy import load_file, save_file

    root = MODELS / "qwen3_moe_nf4_dq"
    src = shutil.copytree(root, tmp_path / "fused", ignore=shutil.ignore_patterns("reference", "*.safetensors"))
    dq = tmp_path / "dq"
    assert main([str(root), "--to", "bf16", "-o", str(dq), "-q"]) == 0
    w = load_file(str(dq / "model.safetensors"))
    out = {k: v for k, v in w.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [np.concatenate([w[f"{p}.{e}.gate_proj.weight"], w[f"{p}.{e}.up_proj.weight"]]) for e in range(4)]
        out[f"{p}.gate_up_proj"] = np.stack(gate_up)
        out[f"{p}.down_proj"] = np.stack([w[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    save_file(out, str(src / "model.safetensors"), metadata={"format": "pt"})
    got = tmp_path / "fused.gguf"
    assert main([str(src), "--to", "gguf:f16", "-o", str(got), "-q"]) == 0
    want = json.loads((root / "reference" / "gguf_f16.json").read_text())["tensors"]
    hashes = _hashes(got)
    assert sorted(hashes) == sorted(want)
    for name, t in want.items():
        assert hashes[name] == (t["type"], t["shape"], t["sha256"]), name

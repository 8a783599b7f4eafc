"""``--to nf4|fp4`` through the CLI and the pipeline, against files bitsandbytes + transformers wrote."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from convert.bnb4.plan import make_quant_plan, safetensors_order_key
from convert.bnb4.select import matches_module, should_quantize
from convert.bnb4.settings import QuantSettings
from convert.cli import main
from convert.stream.pipeline import RunSettings
from convert.stream.plan import make_plan
from convert.stream.safetensors_job import write_plan
from formats.checkpoint import open_checkpoint
from formats.dtypes import BY_CODE, BY_NAME
from formats.writeback import ALIGN, PlacedMemory
from tests.helpers.fixtures import MODELS, SINGLE, assert_same_tensors, load_all, manifest

ORIG = MODELS / "llama_orig_bf16"
#: fixture -> the options that reproduce it from llama_orig_bf16
MODEL_ARGS = {
    "llama_nf4_dq": ["--to", "nf4"],
    "llama_fp4_nodq": ["--to", "fp4", "--no-double-quant"],
    "llama_nf4_dq_qsbf16": ["--to", "nf4", "--quant-storage", "bfloat16"],
}
SINGLES = manifest()["single"]


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@pytest.mark.parametrize("model", sorted(MODEL_ARGS))
def test_requantized_model_equals_bnb_checkpoint(model: str, tmp_out: Path) -> None:
    assert main([str(ORIG), *MODEL_ARGS[model], "-o", str(tmp_out), "-q"]) == 0
    want_dir = MODELS / model
    # every tensor: name, dtype, shape and bytes
    assert_same_tensors(load_all(tmp_out / "model.safetensors"), load_all(want_dir / "model.safetensors"))
    # and the whole file, header order included, and config.json with its quantization_config
    assert (tmp_out / "model.safetensors").read_bytes() == (want_dir / "model.safetensors").read_bytes()
    assert (tmp_out / "config.json").read_bytes() == (want_dir / "config.json").read_bytes()
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_out / extra).read_bytes() == (want_dir / extra).read_bytes()


@pytest.mark.parametrize("entry", SINGLES, ids=[e["name"] for e in SINGLES])
def test_single_fixture_through_cli(entry: dict, tmp_path: Path) -> None:
    out = tmp_path / "q.safetensors"
    args = [str(SINGLE / f"{entry['name']}.orig.safetensors"), "--to", entry["quant_type"],
            "--blocksize", str(entry["blocksize"]), "--include", "layer.weight", "-o", str(out), "-q"]
    if not entry["nested"]:
        args.append("--no-double-quant")
    assert main(args) == 0
    want = SINGLE / f"{entry['name']}.q.safetensors"
    assert_same_tensors(load_all(out), load_all(want))
    got_header, got_data = _header(out)
    want_header, want_data = _header(want)
    # identical but for the {"format": "pt"} metadata transformers-style outputs carry
    assert got_header.pop("__metadata__") == {"format": "pt"}
    assert list(got_header.items()) == list(want_header.items())
    assert got_data == want_data


@pytest.mark.parametrize(
    ("src", "args", "want"),
    [
        ("llama_nf4_dq", ["--to", "nf4"], "llama_nf4_dq"),
        ("llama_fp4_nodq", ["--to", "fp4", "--no-double-quant"], "llama_fp4_nodq"),
        ("llama_nf4_dq_sharded", ["--to", "nf4"], "llama_nf4_dq"),
        ("llama_nf4_dq", ["--to", "nf4", "--quant-storage", "bfloat16"], "llama_nf4_dq_qsbf16"),
        ("llama_nf4_dq_qsbf16", ["--to", "nf4"], "llama_nf4_dq"),
    ],
)
def test_bnb_layers_in_the_same_settings_pass_through(src: str, args: list[str], want: str,
                                                      tmp_out: Path) -> None:
    assert main([str(MODELS / src), *args, "-o", str(tmp_out), "-q", "--json"]) == 0
    assert (tmp_out / "model.safetensors").read_bytes() == (MODELS / want / "model.safetensors").read_bytes()
    assert (tmp_out / "config.json").read_bytes() == (MODELS / want / "config.json").read_bytes()


def test_bin_checkpoint_passes_through(tmp_out: Path) -> None:
    assert main([str(MODELS / "llama_nf4_dq_bin"), "--to", "nf4", "-o", str(tmp_out), "-q"]) == 0
    assert (tmp_out / "model.safetensors").read_bytes() == (MODELS / "llama_nf4_dq/model.safetensors").read_bytes()


def test_int8_checkpoint_to_nf4_quantizes_its_exact_dequantization(tmp_out: Path) -> None:
    from convert.bnb4.layer import layer_tensors, quantize_layer

    assert main([str(MODELS / "llama_int8"), "--to", "nf4", "-o", str(tmp_out), "-q"]) == 0
    got = load_all(tmp_out / "model.safetensors")
    ref = load_all(MODELS / "llama_int8/reference/dequantized.safetensors")
    n_layers = 0
    for name, values in ref.items():
        if f"{name}.absmax" in got:
            n_layers += 1
            for k, v in layer_tensors(name, quantize_layer(values, "bfloat16", QuantSettings())).items():
                assert got[k].tobytes() == v.tobytes(), k
        else:
            assert got[name].tobytes() == values.tobytes(), name
    assert n_layers == 14


def test_sharded_output_holds_the_same_tensors(tmp_out: Path) -> None:
    assert main([str(ORIG), "--to", "nf4", "--max-shard-size", "500KB", "-o", str(tmp_out), "-q"]) == 0
    index = json.loads((tmp_out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4
    # metadata as transformers wrote it for this model (total_parameters: packed weights count unpacked,
    # QuantState companions not at all, as num_parameters() counts a loaded 4-bit model)
    theirs = json.loads((MODELS / "llama_nf4_dq_sharded/model.safetensors.index.json").read_text())
    assert index["metadata"] == theirs["metadata"] == {"total_parameters": 1987840, "total_size": 1804853}
    assert_same_tensors(load_all(tmp_out), load_all(MODELS / "llama_nf4_dq/model.safetensors"))


def test_requantize_round_trip_keeps_codes(tmp_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "nf4", "--requantize", "-o", str(tmp_out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantized"] == 14 and summary["passthrough"] == 0
    got = load_all(tmp_out / "model.safetensors")
    want = load_all(MODELS / "llama_nf4_dq/model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        if name.endswith("_proj.weight"):  # the packed codes do not move
            assert got[name].tobytes() == want[name].tobytes(), name
    # re-quantizing the nested absmax moves values by about 0.2 %, which the report shows
    errors = [r["rel_error"] for r in summary["report"]]
    assert 0 < max(errors) < 0.005


def test_merged_lora_model_as_nf4_in_one_command(tmp_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--merge-lora + --to nf4: merged layers are bnb's quantization of PEFT's merge (merged_reference),
    the layers the adapter does not touch are copied from the 4-bit base unchanged."""
    from convert.bnb4.layer import layer_tensors, quantize_layer

    lora = MODELS.parent / "lora"
    assert main([str(MODELS / "llama_nf4_dq"), "--merge-lora", str(lora / "adapter"), "--to", "nf4",
                 "-o", str(tmp_out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["quantized"], summary["passthrough"]) == (4, 10)
    assert "lora_merge" in summary
    got = load_all(tmp_out / "model.safetensors")
    base = load_all(MODELS / "llama_nf4_dq/model.safetensors")
    merged = load_all(lora / "merged_reference/model.safetensors")
    assert sorted(got) == sorted(base)
    for name, values in merged.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            want = layer_tensors(name, quantize_layer(values, "bfloat16", QuantSettings()))
        elif f"{name}.absmax" in base:
            want = {k: v for k, v in base.items() if k.startswith(f"{name}")}
        else:
            want = {name: values}
        for k, v in want.items():
            assert got[k].tobytes() == v.tobytes(), k
    assert (tmp_out / "config.json").read_bytes() == (MODELS / "llama_nf4_dq/config.json").read_bytes()


def test_fp4_from_nf4_checkpoint_loads_as_fp4(tmp_out: Path) -> None:
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "fp4", "--no-double-quant", "--blocksize", "128",
                 "-o", str(tmp_out), "-q"]) == 0
    cfg = json.loads((tmp_out / "config.json").read_text())["quantization_config"]
    assert (cfg["bnb_4bit_quant_type"], cfg["bnb_4bit_use_double_quant"]) == ("fp4", False)
    t = load_all(tmp_out / "model.safetensors")
    state = json.loads(t["model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__fp4"].tobytes())
    assert state == {"quant_type": "fp4", "blocksize": 128, "dtype": "bfloat16", "shape": [704, 256]}
    assert t["model.layers.0.mlp.up_proj.weight.absmax"].shape == (704 * 256 // 128,)


def test_pieces_cache_and_threads_do_not_change_bytes(tmp_path: Path) -> None:
    want = (MODELS / "llama_nf4_dq/model.safetensors").read_bytes()
    for i, (piece, cache, threads) in enumerate([(64, 0, 1), (4096, 0, 2), (1 << 20, 1 << 30, 3)]):
        with open_checkpoint(ORIG) as ck:
            plan, info = make_quant_plan(make_plan(ck, "auto"), QuantSettings("nf4", 64, True),
                                         piece_elements=piece, cache_bytes=cache, threads=threads)
            out = tmp_path / f"o{i}"
            out.mkdir()
            write_plan(plan, out, RunSettings(threads, 64 << 20))
        assert (out / "model.safetensors").read_bytes() == want
        assert len(info.jobs) == 14


def test_memory_cap_option(tmp_out: Path) -> None:
    assert main([str(ORIG), "--to", "nf4", "--max-memory", "64MiB", "--threads", "1", "-o", str(tmp_out),
                 "-q"]) == 0
    assert (tmp_out / "model.safetensors").read_bytes() == (MODELS / "llama_nf4_dq/model.safetensors").read_bytes()


def test_skip_modules_go_into_the_config(tmp_out: Path) -> None:
    assert main([str(ORIG), "--to", "nf4", "--skip-modules", "mlp.down_proj", "-o", str(tmp_out), "-q"]) == 0
    cfg = json.loads((tmp_out / "config.json").read_text())
    want = json.loads((MODELS / "llama_nf4_dq/config.json").read_text())
    want["quantization_config"]["llm_int8_skip_modules"] = ["lm_head", "mlp.down_proj"]
    assert cfg == want
    got = load_all(tmp_out / "model.safetensors")
    orig = load_all(ORIG / "model.safetensors")
    for layer in (0, 1):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert got[name].tobytes() == orig[name].tobytes()
        assert f"{name}.absmax" not in got
        assert f"model.layers.{layer}.mlp.up_proj.weight.absmax" in got


def test_patterns_that_match_no_module_are_noted(tmp_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a typo ('q_proj(' is not a valid regex, and no module ends with it) silently left everything quantized
    assert main([str(ORIG), "--to", "nf4", "--skip-modules", "q_proj(", "--skip-modules", "mlp.down_proj",
                 "--include", "nope", "-o", str(tmp_out)]) == 0
    err = capsys.readouterr().err
    assert ("note: --skip-modules 'q_proj(': no module of the input matches (a module name, a suffix of one, or a "
            "regular expression matched from the start)") in err
    assert "note: --include 'nope': no module of the input matches" in err
    assert "mlp.down_proj'" not in err  # (it matches)


def test_input_skip_list_and_compute_dtype_carry_over(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    assert main([str(ORIG), "--to", "nf4", "--skip-modules", "mlp.down_proj", "-o", str(first), "-q"]) == 0
    cfg = json.loads((first / "config.json").read_text())
    cfg["quantization_config"]["bnb_4bit_compute_dtype"] = "float16"
    (first / "config.json").write_text(json.dumps(cfg))
    assert main([str(first), "--to", "fp4", "--no-double-quant", "-o", str(second), "-q"]) == 0
    qc = json.loads((second / "config.json").read_text())["quantization_config"]
    assert qc["llm_int8_skip_modules"] == ["lm_head", "mlp.down_proj"]
    assert qc["bnb_4bit_compute_dtype"] == "float16"
    assert qc["bnb_4bit_quant_type"] == "fp4"
    got = load_all(second / "model.safetensors")
    assert "model.layers.0.mlp.down_proj.weight.absmax" not in got
    assert "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__fp4" in got


def test_including_the_head_drops_it_from_the_skip_list(tmp_out: Path) -> None:
    assert main([str(ORIG), "--to", "nf4", "--include", "lm_head", "-o", str(tmp_out), "-q"]) == 0
    qc = json.loads((tmp_out / "config.json").read_text())["quantization_config"]
    assert qc["llm_int8_skip_modules"] == []  # a list: transformers then converts lm_head too
    assert "lm_head.weight.absmax" in load_all(tmp_out / "model.safetensors")


def test_report_file(tmp_out: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    assert main([str(ORIG), "--to", "nf4", "--quant-report", str(report), "-o", str(tmp_out), "-q"]) == 0
    rows = {r["name"]: r for r in json.loads(report.read_text())}
    assert len(rows) == 14
    down = rows["model.layers.0.mlp.down_proj.weight"]
    assert down["numel"] == 704 * 256
    # 704*256/2 packed + 2816 absmax codes + 11 nested fp32, per weight
    assert down["bits_per_weight"] == 8 * (90112 + 2816 + 44) / (704 * 256)
    # the fixture model has a few 25x outliers per matrix: they are flagged, and most weights in
    # their blocks round to zero
    assert all(r["outlier"] and r["outlier_blocks"] > 0 for r in rows.values())
    assert all(r["outlier_zero_share"] > 0.5 for r in rows.values())
    assert all(0.10 < r["rel_error"] < 0.13 for r in rows.values())


def test_dry_run_writes_nothing(tmp_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ORIG), "--to", "fp4", "--dry-run", "-o", str(tmp_out)]) == 0
    text = capsys.readouterr().out
    assert "quantize fp4 bs64 nested <- copy" in text
    assert "model.embed_tokens.weight" in text
    assert not tmp_out.exists()


@pytest.mark.parametrize("opt", [["--blocksize", "128"], ["--no-double-quant"], ["--quant-storage", "bfloat16"],
                                 ["--skip-modules", "q_proj"], ["--include", "x"], ["--requantize"],
                                 ["--torch-threads", "4"], ["--quant-report", "r.json"]])
def test_4bit_options_need_a_4bit_target(opt: list[str], tmp_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", *opt, "-o", str(tmp_out)]) == 2
    assert f"{opt[0]} needs --to nf4 or --to fp4" in capsys.readouterr().err
    assert not tmp_out.exists()


def test_quant_storage_that_does_not_fit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.safetensors"
    # 3 elements -> 2 packed bytes fit bf16, but float32 needs 4
    src = SINGLE / "edge_nf4_3elem_bs64_nodq_float32_3.orig.safetensors"
    assert main([str(src), "--to", "nf4", "--include", "layer.weight", "--quant-storage", "float32",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tensor 'layer.weight': QNT-005 the packed codes cannot be stored as float32" in err
    assert "(expected 'ceil(n/2) a multiple of 4 bytes', found 2)" in err
    assert not out.exists()


def test_non_finite_weights_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "nan.safetensors"
    x = np.zeros((4, 64), np.float32)
    x[2, 3] = np.inf
    save_file({"proj.weight": x}, str(src))
    assert main([str(src), "--to", "nf4", "-o", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"Failed to quantize '{src}': tensor 'proj.weight': QNT-003 the tensor to quantize holds NaN" in err
    assert "found 'non-finite value in block 2'" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_weights_near_the_float32_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Weights of 3e38 (finite, their absmax's mean is not): double quantization is refused with QNT-006
    (bnb would store an infinite nested_offset, which no loader resolves; we used to write it and then
    refuse our own file); without it the layer quantizes with no RuntimeWarning, its report finite, and
    reads back exactly (NF4's code 15 is 1.0: every value is its block's absmax)."""
    import warnings

    from safetensors.numpy import save_file

    src = tmp_path / "huge.safetensors"
    x = np.full((64, 64), 3e38, np.float32)
    x[1::2] *= -1
    save_file({"model.layers.0.mlp.up_proj.weight": x}, str(src))
    out = tmp_path / "o.safetensors"
    assert main([str(src), "--to", "nf4", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (f"Failed to quantize '{src}': tensor 'model.layers.0.mlp.up_proj.weight': QNT-006 the mean of the "
            "absmax overflows float32") in err
    assert "found 'inf (largest absmax 3e+38)'" in err and "--no-double-quant" in err
    assert not out.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main([str(src), "--to", "nf4", "-o", str(out), "--no-double-quant", "--json"]) == 0
        assert main([str(out), "--to", "fp32", "-o", str(tmp_path / "back.safetensors"), "-q"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["report"]
    assert (report["rel_error"], report["absmax_median"]) == (0.0, float(np.float32(3e38))), report
    assert np.array_equal(load_all(tmp_path / "back.safetensors")["model.layers.0.mlp.up_proj.weight"], x)


# --- rules -------------------------------------------------------------------------------------------

BF16 = BY_NAME["bfloat16"]


@pytest.mark.parametrize(
    ("name", "shape", "want"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (256, 256), (True, "Linear weight")),
        ("transformer.h.3.attn.c_attn.weight", (768, 2304), (True, "Linear weight")),
        ("model.embed_tokens.weight", (1000, 256), (False, "embedding")),
        ("transformer.wte.weight", (1000, 256), (False, "embedding")),
        ("shared.weight", (1000, 256), (False, "embedding")),
        ("lm_head.weight", (1000, 256), (False, "output head")),
        ("score.weight", (2, 256), (False, "output head")),
        ("model.norm.weight", (256,), (False, "not a 2-D weight")),
        ("model.layers.0.self_attn.q_proj.bias", (256,), (False, "not a 2-D weight")),
        ("model.layers.0.mlp.experts", (8, 64, 64), (False, "not a 2-D weight")),
        ("model.layers.0.self_attn.q_proj.weight", (0, 64), (False, "empty (no values to quantize)")),
    ],
)
def test_which_tensors_are_quantized(name: str, shape: tuple[int, ...], want: tuple[bool, str]) -> None:
    assert should_quantize(name, shape, BF16) == want


def test_skip_and_include_patterns() -> None:
    q = "model.layers.1.self_attn.q_proj.weight"
    assert should_quantize(q, (8, 8), BF16, skip=["q_proj"]) == (False, "--skip-modules")
    assert should_quantize(q, (8, 8), BF16, skip=["model.layers.1"]) == (False, "--skip-modules")
    assert should_quantize(q, (8, 8), BF16, skip=["model.layers.11"])[0]
    assert should_quantize(q, (8, 8), BF16, skip=["model.layers.1.*proj"]) == (False, "--skip-modules")
    assert should_quantize("model.norm.weight", (8,), BF16, include=["model.norm"]) == (True, "--include")
    assert should_quantize("lm_head.weight", (8, 8), BF16, include=["lm_head"]) == (True, "--include")
    assert should_quantize("x.weight", (8, 8), BY_CODE["I32"], include=["x"]) == (False, "not a float tensor")
    assert should_quantize("x.weight", (64, 0), BF16, include=["x"]) == (False, "empty (no values to quantize)")
    assert matches_module("model.decoder.layers.23.fc1", "fc1")
    assert not matches_module("model.layers.0.mlp.gate_proj", "mlp.gate")


def test_tensor_order_is_the_safetensors_library_order() -> None:
    names = [("b", "U8"), ("a", "U8"), ("c", "BF16"), ("d", "F32"), ("e", "I64")]
    got = sorted(names, key=lambda t: safetensors_order_key(t[0], BY_CODE[t[1]]))
    assert got == [("e", "I64"), ("d", "F32"), ("c", "BF16"), ("a", "U8"), ("b", "U8")]


# --- optional: the output loads in transformers as bitsandbytes' own ------------------------------------


def test_output_loads_in_transformers_with_bnb_logits(tmp_out: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    assert main([str(ORIG), "--to", "nf4", "-o", str(tmp_out), "-q"]) == 0
    ref = load_all(MODELS / "llama_nf4_dq/reference/logits.safetensors")
    ids = torch.from_numpy(ref["input_ids"].astype(np.int64))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_out))
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    # bitsandbytes' own file of the same model, run on this machine: the forward is the same computation
    # on the same bytes, so the logits are identical (the stored `logits_quantized` came from another CPU,
    # whose bf16 kernels may round differently)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(MODELS / "llama_nf4_dq"))
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
        want = theirs(ids).logits.float().numpy()
    assert np.array_equal(logits, want)
    np.testing.assert_allclose(logits, ref["logits_quantized"].astype(np.float32), rtol=1.6e-2,
                               atol=2.0**-6 * float(np.abs(want).max()))


def test_parity_transformers_quantizes_a_model_with_large_layers(tmp_path: Path) -> None:
    """Optional: transformers + bitsandbytes quantize a fresh model whose MLP layers have 45056 blocks
    (past torch's 32768-element split of the mean over threads); our files equal theirs byte for byte."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
                                   max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "orig")
    bnb_cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_use_double_quant=True,
                                              bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "orig", quantization_config=bnb_cfg,
                                                              dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bnb")
    threads = str(torch.get_num_threads())
    assert main([str(tmp_path / "orig"), "--to", "nf4", "--torch-threads", threads, "-o", str(tmp_path / "ours"),
                 "-q"]) == 0
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "bnb" / f).read_bytes(), f


# --- memory: what the pre-pass and the codes pass hold -----------------------------------------


class _Counting:
    """Wraps a planned source and counts the elements produced (to count passes over the input)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.produced = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def produce(self, start: int, stop: int, dtype):  # noqa: ANN001, ANN201
        self.produced += stop - start
        return self.inner.produce(start, stop, dtype)


@pytest.mark.parametrize("threads", [1, 2])
def test_nested_layers_are_read_twice_and_nothing_kept_between_passes(tmp_path: Path, threads: int) -> None:
    """Pre-pass + codes pass, no third pass for the absmax tensor even with no absmax cache."""
    with open_checkpoint(ORIG) as ck:
        plan = make_plan(ck, "auto")
        counters = {}
        for t in plan.tensors:
            t.source = counters[t.name] = _Counting(t.source)
        qplan, info = make_quant_plan(plan, QuantSettings("nf4", 64, True), piece_elements=4096, cache_bytes=0,
                                      threads=threads, max_memory=64 << 20)
        assert len(info.jobs) == 14
        for job in info.jobs:  # after the pre-pass: statistics only
            assert counters[job.name].produced == job.input.n
            assert job.absmax.cached is None and job.codes.values is None and job.codes.filled is None
        (tmp_path / "out").mkdir()
        write_plan(qplan, tmp_path / "out", RunSettings(threads, 64 << 20))
    for job in info.jobs:
        assert counters[job.name].produced == 2 * job.input.n, job.name
        assert job.codes.values is None  # dropped with the layer
    want = (MODELS / "llama_nf4_dq/model.safetensors").read_bytes()
    assert (tmp_path / "out/model.safetensors").read_bytes() == want


@pytest.mark.parametrize("cache_bytes", [0, 3 * 4096, None])
def test_prepass_drops_the_input_layers_caches(cache_bytes: int | None) -> None:
    """A bnb input's resolved fp32 absmax is not kept for every layer between the passes; the new
    absmax the pre-pass computed is kept for the codes pass only within the budget (first come first
    served: 12 KiB holds four or five layers' absmax), as bfloat16 (the weights' dtype, which holds a
    block's largest magnitude exactly: 2 bytes a block), and the bytes are the same as recomputing it."""
    outs = {}
    with open_checkpoint(MODELS / "llama_nf4_dq") as ck:
        qplan, info = make_quant_plan(make_plan(ck, "auto"), QuantSettings("nf4", 64, True), requantize=True,
                                      threads=2, cache_bytes=cache_bytes)
        assert len(info.jobs) == 14
        kept = 0
        for job in info.jobs:
            assert job.input.source._absmax is None, job.name
            assert job.absmax.nested is not None and job.absmax.median_max is not None
            if job.absmax.cached is not None:
                assert job.absmax.cached.dtype == BY_NAME["bfloat16"].numpy == job.input.dtype.numpy
                assert job.absmax.cached.size == job.input.n_blocks
                kept += job.absmax.cached.nbytes
        if cache_bytes is None:  # the default budget (1/8 of the cap) holds them all
            assert kept == sum(2 * j.input.n_blocks for j in info.jobs)
        else:
            assert kept <= cache_bytes and (kept > 0) == (cache_bytes > 0)
        for t in qplan.tensors:
            outs[t.name] = t.source.produce(0, t.numel, t.dtype).tobytes()
    with open_checkpoint(MODELS / "llama_nf4_dq") as ck:
        qplan, _ = make_quant_plan(make_plan(ck, "auto"), QuantSettings("nf4", 64, True), requantize=True,
                                   threads=2, cache_bytes=0)
        for t in qplan.tensors:
            assert t.source.produce(0, t.numel, t.dtype).tobytes() == outs[t.name], t.name


@pytest.mark.parametrize(("dtype", "n", "kept_dtype"), [
    ("bfloat16", 64 * 40, "bfloat16"),
    ("float16", 64 * 40, "float16"),
    ("float32", 64 * 40, "float32"),
    ("bfloat16", 64 * 40 + 6, "float32"),  # a zero tail block: absmax 1e-38, not a bfloat16 value
])
def test_cached_absmax_is_kept_in_the_weights_dtype_when_exact(dtype: str, n: int, kept_dtype: str) -> None:
    """The absmax the codes pass reads from the cache is the fp32 absmax it would recompute, bit for bit,
    kept in 2 bytes a block for a bfloat16 or float16 weight unless a block's absmax is not such a value
    (the floor 1e-38 of an all-zero tail block); the codes are the same with and without the cache."""
    import convert.bnb4.passes as qp
    from convert.bnb4.encode import blockwise_absmax
    from convert.stream.plan import PlannedTensor

    rng = np.random.default_rng(5)
    values = (rng.standard_normal(n) * 0.03).astype(BY_NAME[dtype].numpy)
    values[64 * 40 :] = 0
    values[64 * 7 : 64 * 8] = 0  # an all-zero full block: absmax +0.0
    want = blockwise_absmax(values, 64)
    packed = {}
    for budget in (1 << 20, 0):
        t = PlannedTensor("w.weight", BY_NAME[dtype], (n,), _ZeroCopy(values, []))  # type: ignore[arg-type]
        job = qp.LayerJob(t, QuantSettings(nested=True), 64 * 8, qp.AbsmaxBudget(budget), False, 10.0)
        job.prepass()
        cached = job.absmax.cached
        if budget:
            assert cached is not None and cached.dtype == BY_NAME[kept_dtype].numpy
            assert cached.nbytes == job.input.n_blocks * BY_NAME[kept_dtype].numpy.itemsize
            got = job.absmax.cached_blocks(0, job.input.n_blocks)
            assert got is not None and got.dtype == np.float32
            assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
        else:
            assert cached is None
        packed[budget] = job.encode(0, n).tobytes() + job.absmax_codes(0, job.input.n_blocks).tobytes()
    assert packed[1 << 20] == packed[0]


def _resident_pages(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Present pages of ``path``'s mappings in this process lying wholly inside one of the byte ranges.

    (A page shared with a neighbouring tensor is never released: release rounds inward.)
    """
    maps = Path("/proc/self/maps").read_text().splitlines()
    count = 0
    with open("/proc/self/pagemap", "rb") as pm:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or parts[5] != str(path):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            off = int(parts[2], 16)
            pm.seek(lo // 4096 * 8)
            entries = np.frombuffer(pm.read((hi - lo) // 4096 * 8), dtype=np.uint64)
            present = np.flatnonzero(entries >> np.uint64(63))
            file_off = off + present * 4096
            for a, b in ranges:
                count += int(((file_off >= a) & (file_off + 4096 <= b)).sum())
    return count


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_prepass_releases_the_input_pages(tmp_path: Path) -> None:
    """After the pre-pass no page of a layer's packed codes or absmax stays mapped (large folios too)."""
    from safetensors.numpy import save_file

    from convert.bnb4.layer import layer_tensors, quantize_layer

    rng = np.random.default_rng(5)
    tensors = {}
    settings = QuantSettings("nf4", 64, True)
    for i in range(6):
        w = (rng.standard_normal((2048, 2048), dtype=np.float32) * 0.02).astype(np.float32)
        tensors.update(layer_tensors(f"model.layers.{i}.mlp.up_proj.weight", quantize_layer(w, "float32", settings)))
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    header, _ = _header(path)
    base = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    big = [(base + v["data_offsets"][0], base + v["data_offsets"][1]) for k, v in header.items()
           if k.endswith((".weight", ".absmax"))]
    with open_checkpoint(path) as ck:
        _, info = make_quant_plan(make_plan(ck, "auto"), settings, requantize=True, threads=1,
                                  max_memory=64 << 20)
        assert len(info.jobs) == 6
        try:
            resident = _resident_pages(path.resolve(), big)
        except PermissionError:
            pytest.skip("/proc/self/pagemap is not readable here")
    # 0 here (Linux 6.18, ext4); the bound leaves room for a folio of a neighbouring layer mapped again by
    # a later read. Before the pre-pass released its input, ~75% of these pages stayed resident.
    total = sum(b // 4096 - -(-a // 4096) for a, b in big)
    assert resident <= total // 10, (resident, total)


class _ZeroCopy:
    """A planned source handing out read-only views of one array (as a zero-copy input file does),
    logging each produce and release."""

    def __init__(self, values: np.ndarray, log: list[tuple[str, int, int]]) -> None:
        from convert.stream.sources import Source

        self.values, self.log = values, log
        self.numel, self.unit, self.kind, self.in_nbytes = values.size, 1, "view", values.nbytes
        self.stats = np.zeros(2, dtype=np.int64)
        self.barrier, self.max_chunk, self.writes_in_place = Source.barrier, Source.max_chunk, Source.writes_in_place

    def produce(self, start: int, stop: int, dtype: object) -> np.ndarray:
        self.log.append(("produce", start, stop))
        view = self.values[start:stop]
        view.flags.writeable = False
        return view

    def produce_view(self, start: int, stop: int, dtype: object) -> None:
        return None  # (a view of shared blocks: a run of several targets only)

    def view_grid(self) -> int:
        return 0

    def release(self, start: int, stop: int) -> None:
        self.log.append(("release", start, stop))

    def finish(self) -> None:
        pass


def test_pieces_are_released_after_they_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each piece's input pages are released once the piece is encoded, never between the read and the use:
    released earlier, the encoder's reads mapped them again for good (peak RSS grew to the input's size,
    2.6 GiB for a 2.8 GB bf16 model at the 1 GiB cap)."""
    import convert.bnb4.passes as qp
    from convert.bnb4.encode import Bnb4Codec
    from convert.bnb4.settings import QuantSettings
    from convert.stream.plan import PlannedTensor
    from formats.dtypes import BY_CODE

    log: list[tuple[str, int, int]] = []
    real = Bnb4Codec.encode

    def logged(self: Bnb4Codec, x: np.ndarray, *args: object, **kw: object) -> np.ndarray:
        log.append(("encode", 0, x.size))
        return real(self, x, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Bnb4Codec, "encode", logged)
    values = np.random.default_rng(3).standard_normal(64 * 40).astype(np.float32)
    t = PlannedTensor("w.weight", BY_CODE["F32"], (40, 64), _ZeroCopy(values, log))  # type: ignore[arg-type]
    job = qp.LayerJob(t, QuantSettings(nested=False), 64 * 8, qp.AbsmaxBudget(0), False, 10.0)
    job.encode(0, values.size)
    kinds = [k for k, _, _ in log]
    assert kinds == ["produce", "encode", "release"] * 5



def test_gguf_rows_are_not_views_of_released_pages() -> None:
    """The GGUF writer's rows of a zero-copy source are copied before their input pages are released."""
    from convert.gguf.rows import RowReader
    from convert.stream.plan import PlannedTensor
    from formats.dtypes import BY_CODE

    log: list[tuple[str, int, int]] = []
    values = np.arange(64 * 8, dtype=np.float32)
    t = PlannedTensor("w.weight", BY_CODE["F32"], (8, 64), _ZeroCopy(values, log))  # type: ignore[arg-type]
    rows = RowReader(1 << 30, 2, PlacedMemory(keep=2)).rows(t, 2, 5)
    assert rows.flags.writeable and not np.shares_memory(rows, values)
    assert np.array_equal(rows, values.reshape(8, 64)[2:5])
    assert [k for k, _, _ in log] == ["produce", "release"]


@pytest.mark.parametrize("place", [None, 0, 4094, 123_456])
def test_gguf_rows_of_a_4bit_layer_are_made_placed_in_the_run_memory(place: int | None) -> None:
    """A 4-bit layer's rows are dequantized into the run's PlacedMemory, lying at the file offset asked for
    (bf16 -> BF16 writes them without a copy), equal to the source's own values; the memory is used again
    once the rows are gone."""
    from convert.gguf.rows import RowReader

    with open_checkpoint(MODELS / "llama_nf4_dq") as ck:
        plan = make_plan(ck, "bf16")
        t = next(u for u in plan.tensors if u.source.writes_in_place and u.shape[0] >= 8)
        cols = t.numel // t.shape[0]
        memory = PlacedMemory(keep=2)
        rows = RowReader(1 << 30, 2, memory).rows(t, 2, 7, place)
        assert rows.dtype == t.dtype.numpy and rows.shape == (5, *t.shape[1:])
        want = t.source.produce(0, t.numel, t.dtype).reshape(-1)[2 * cols : 7 * cols]
        assert rows.reshape(-1).view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
        if place is not None:
            assert (rows.ctypes.data - place) % ALIGN == 0
        assert memory.free_slabs() == []
        del rows
        assert len(memory.free_slabs()) == 1


def test_summary_says_its_error_is_from_a_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --quant-report or --json the summary's relative error is measured on 1/8 of each weight and
    says so; with --quant-report the figures are exact and the line carries no such note; bytes are equal."""
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "nf4", "--requantize", "-o", str(tmp_path / "a")]) == 0
    sampled = capsys.readouterr().err
    assert "relative error (on a 1/8 sample of each weight): mean " in sampled
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "nf4", "--requantize", "-o", str(tmp_path / "b"),
                 "--quant-report", str(tmp_path / "r.json")]) == 0
    exact = capsys.readouterr().err
    assert "relative error: mean " in exact and "sample" not in exact
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()


def test_summary_points_to_the_full_report_only_when_none_was_asked_for(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The outlier note ends with where every layer is listed: said without --quant-report/--json, not with
    --json (whose output holds the report; the note used to send the user to --quant-report there)."""
    src = str(MODELS / "llama_fp4_nodq")  # every matrix has a few 25x absmax outliers
    assert main([src, "--to", "nf4", "-o", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "most affected: " in err and "; all layers in --quant-report or --json" in err
    assert main([src, "--to", "nf4", "-o", str(tmp_path / "b"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    notes = " ".join(summary["notes"])
    assert "most affected: " in notes and "all layers in" not in notes and len(summary["report"]) == 14


def test_elements_are_the_models_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--to nf4 counts the values it converts, as --to bf16 does (it counted its output's elements: the
    packed bytes, half the weights, so its G elements/s read half of what it did)."""
    src = str(MODELS / "llama_nf4_dq")
    assert main([src, "--to", "bf16", "-o", str(tmp_path / "a"), "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main([src, "--to", "nf4", "--requantize", "-o", str(tmp_path / "b"), "--json"]) == 0
    nf4 = json.loads(capsys.readouterr().out)
    from safetensors import safe_open

    with safe_open(str(MODELS / "llama_nf4_dq" / "reference" / "dequantized.safetensors"), "np") as ref:
        values = sum(int(np.prod(ref.get_slice(k).get_shape())) for k in ref.keys())
    assert nf4["elements"] == bf16["elements"] == values


def _cpu_forward_copy(model: Path, root: Path) -> Path:
    """``model`` as bitsandbytes saves it after a CPU forward: each layer's absmax BF16 and 2-D
    ``(K/blocksize, N)``, the transpose of the flat order (bnb-format.md section 1)."""
    import ml_dtypes

    from tests.helpers.malformed import st_bytes

    root.mkdir()
    for p in model.iterdir():
        if p.is_file() and p.name != "model.safetensors":
            (root / p.name).write_bytes(p.read_bytes())
    codes = {"uint8": "U8", "float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    tensors = {}
    everything = load_all(model / "model.safetensors")
    for name, arr in everything.items():
        if name.endswith(".absmax"):
            state = json.loads(bytes(everything[name[: -len(".absmax")] + ".quant_state.bitsandbytes__fp4"]))
            arr = arr.astype(ml_dtypes.bfloat16).reshape(state["shape"][0], -1).T.copy()  # (N, K/bs) -> (K/bs, N)
        tensors[name] = (codes[str(arr.dtype)], list(arr.shape), arr.tobytes())
    (root / "model.safetensors").write_bytes(st_bytes(tensors, {"format": "pt"}))
    return root


def test_layers_saved_after_a_cpu_forward_are_requantized_with_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Same settings as asked, but absmax as a bnb CPU forward leaves it: re-quantized (not copied), and said."""
    src = _cpu_forward_copy(MODELS / "llama_fp4_nodq", tmp_path / "cpu")
    assert main([str(src), "--to", "fp4", "--no-double-quant", "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert ("note: 14 bnb 4-bit layers re-quantized, not copied unchanged: absmax stored as BF16 2-D, as a file "
            "saved after a bnb CPU forward holds it (bnb writes it 1-D F32) (first: "
            "model.layers.0.mlp.down_proj.weight)") in err
    # the canonical file: no such note, every layer copied
    assert main([str(MODELS / "llama_fp4_nodq"), "--to", "fp4", "--no-double-quant", "-o",
                 str(tmp_path / "out2")]) == 0
    assert "re-quantized" not in capsys.readouterr().err
    # other settings asked than stored: said too
    assert main([str(MODELS / "llama_fp4_nodq"), "--to", "nf4", "-o", str(tmp_path / "out3")]) == 0
    assert ("bnb 4-bit layers re-quantized, not copied unchanged: stored as fp4 blocksize 64, asked nf4 blocksize "
            "64 nested (first: ") in capsys.readouterr().err

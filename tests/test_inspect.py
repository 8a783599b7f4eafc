"""``convert-bnb inspect``: settings, counts and bytes equal to the fixtures' manifest; no weight data read."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from convert.cli import main
from convert.inspection import InspectOptions, format_report, inspect_checkpoint
from formats.checkpoint import READERS, open_checkpoint
from tests.helpers.fixtures import MODELS, REFERENCES, SINGLE, manifest, read_safetensors, rewrite_data
from tests.helpers.hubcache import add_model_dir, commit_sha, offline_env, run_cli

_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


def _inspect(path: Path, **kw: object) -> dict:
    with open_checkpoint(path) as ckpt:
        return inspect_checkpoint(ckpt, InspectOptions(**kw))  # type: ignore[arg-type]


SINGLES = manifest()["single"]


@pytest.mark.parametrize("entry", SINGLES, ids=[e["name"] for e in SINGLES])
def test_single_layer_report_matches_manifest(entry: dict) -> None:
    rep = _inspect(SINGLE / f"{entry['name']}.q.safetensors")
    qs = json.loads(entry["quant_state_json"])
    assert len(rep["quantized"]) == 1 and rep["int8"] == [] and rep["unquantized"] == []
    g = rep["quantized"][0]
    nested = entry["nested"]
    assert {k: g[k] for k in ("quant_type", "blocksize", "nested", "dtype", "storage", "absmax_dtype")} == {
        "quant_type": entry["quant_type"], "blocksize": entry["blocksize"], "nested": nested,
        "dtype": entry["dtype"], "storage": "U8", "absmax_dtype": "U8" if nested else "F32",
    }
    assert (g["nested_blocksize"], g["nested_dtype"]) == (
        (qs["nested_blocksize"], qs["nested_dtype"]) if nested else (None, None)
    )
    assert (g["layers"], g["elements"], g["names"]) == (1, entry["numel"], ["layer.weight"])
    packed = math.prod(entry["packed_shape"])
    assert packed == -(-entry["numel"] // 2)
    want = {
        "packed": packed,
        "absmax": entry["n_absmax"] * (1 if nested else 4),
        "nested_statistics": (entry["n_nested_blocks"] * 4 + 256 * 4) if nested else 0,
        "quant_map": 16 * 4,
        "quant_state": len(entry["quant_state_json"].encode()),
    }
    assert g["bytes"] == want
    assert g["total_bytes"] == sum(want.values())
    assert g["bits_per_weight"] == round(8 * sum(want.values()) / entry["numel"], 4)
    item = {"float16": 2, "bfloat16": 2, "float32": 4}[entry["dtype"]]
    assert rep["outputs"]["auto"] == {"bytes": entry["numel"] * item, "files": 1}
    assert rep["outputs"]["fp32"] == {"bytes": entry["numel"] * 4, "files": 1}
    assert rep["outputs"]["bf16"] == {"bytes": entry["numel"] * 2, "files": 1}


MODEL_NAMES = [m for m in manifest()["models"] if m not in ("llama_orig_bf16", "lora")]


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_model_report_matches_manifest(model: str) -> None:
    entry = manifest()["models"][model]
    if model.endswith("_bin"):
        if ".bin" not in READERS:
            pytest.skip("no .bin reader registered (another issue adds it)")
        tensors = manifest()["models"]["llama_nf4_dq"]["tensors"]  # state dict identical to the safetensors save
    else:
        tensors = entry["tensors"]
    qc = entry["config_quantization_config"]
    rep = _inspect(MODELS / model)
    assert rep["tensors"] == len(tensors)
    states = [n for n in tensors if ".quant_state.bitsandbytes__" in n]
    scbs = [n for n in tensors if n.endswith(".SCB")]
    # bytes by kind, computed from the manifest's dtypes and shapes alone
    kinds: dict[str, int] = {}

    def add(k: str, name: str) -> None:
        code, shape, _ = tensors[name]
        kinds[k] = kinds.get(k, 0) + _numel(shape) * _ITEM[code]

    companions = {}
    for s in states:
        base = s.split(".quant_state.")[0]
        add("packed", base)
        add("absmax", base + ".absmax")
        add("quant_map", base + ".quant_map")
        add("quant_state", s)
        if base + ".nested_absmax" in tensors:
            add("nested_statistics", base + ".nested_absmax")
            add("nested_statistics", base + ".nested_quant_map")
        companions.update(dict.fromkeys([base, s] + [base + "." + c for c in (
            "absmax", "quant_map", "nested_absmax", "nested_quant_map")]))
    for s in scbs:
        base = s[: -len(".SCB")] + ".weight"
        add("int8_weight", base)
        add("int8_scale", s)
        add("int8_scale", base + "_format")
        companions.update(dict.fromkeys([base, s, base + "_format"]))
    unq: dict[str, int] = {}
    for n, (code, _shape, _file) in tensors.items():
        if n not in companions:
            add(f"unquantized:{code}", n)
            unq[code] = unq.get(code, 0) + 1
    kinds = {k: v for k, v in kinds.items() if v or not k.startswith("nested")}
    if states and not any(n.endswith(".nested_absmax") for n in tensors):
        kinds["nested_statistics"] = 0
    assert rep["bytes_by_kind"] == dict(sorted(kinds.items()))
    assert {u["dtype"]: u["tensors"] for u in rep["unquantized"]} == unq
    assert rep["total_bytes"] == sum(kinds.values())

    if qc["load_in_4bit"]:
        assert len(rep["quantized"]) == 1 and rep["int8"] == []
        g = rep["quantized"][0]
        base = states[0].split(".quant_state.")[0]
        blocksize = (2 * _numel(tensors[base][1]) * _ITEM[tensors[base][0]]) // _numel(tensors[base + ".absmax"][1])
        assert {k: g[k] for k in ("quant_type", "blocksize", "nested", "dtype", "storage")} == {
            "quant_type": qc["bnb_4bit_quant_type"], "blocksize": blocksize,
            "nested": qc["bnb_4bit_use_double_quant"], "dtype": "bfloat16",
            "storage": {"uint8": "U8", "bfloat16": "BF16"}[qc["bnb_4bit_quant_storage"]],
        }
        assert g["layers"] == len(states) == 14
        assert (g["nested_blocksize"], g["nested_dtype"]) == ((256, "float32") if g["nested"] else (None, None))
        # planned bf16 output == the tensor bytes of the reference written by bitsandbytes + transformers
        ref = read_safetensors(REFERENCES[model])
        assert rep["outputs"]["bf16"]["bytes"] == sum(a.nbytes for a in ref.values())
        assert rep["outputs"]["auto"]["bytes"] == rep["outputs"]["bf16"]["bytes"]
    else:
        assert rep["quantized"] == [] and len(rep["int8"]) == 1
        g = rep["int8"][0]
        assert (g["weight_dtype"], g["scale_dtype"], g["layers"]) == ("I8", "F32", len(scbs))
        assert g["elements"] == sum(_numel(tensors[s[: -len(".SCB")] + ".weight"][1]) for s in scbs)


def test_report_does_not_depend_on_weight_data(tmp_path: Path) -> None:
    src = MODELS / "llama_nf4_dq"
    dst = tmp_path / "m"
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            shutil.copy2(p, dst / p.name)
    tensors = manifest()["models"]["llama_nf4_dq"]["tensors"]
    garbage = [n for n in tensors if n.endswith((".absmax", ".nested_absmax")) or
               (n + ".absmax" in tensors) or tensors[n][0] == "BF16"]
    rewrite_data(dst / "model.safetensors", garbage, 0xFF)  # NaN bf16, 0xFF codes, NaN absmax
    a, b = _inspect(src), _inspect(dst)
    a.pop("source")
    b.pop("source")
    assert a == b


@pytest.mark.parametrize("name", [
    "nf4_bs64_dq_float16_3x40x72_outliers", "fp4_bs32_dq_float32_130x130_outliers",
    "nf4_bs32_nodq_float16_96x100_normal", "fp4_bs128_nodq_float32_96x100_mixed",
])
def test_stats_equal_an_independent_computation(name: str) -> None:
    entry = next(e for e in SINGLES if e["name"] == name)
    rep = _inspect(SINGLE / f"{name}.q.safetensors", stats=True)
    if entry["nested"]:
        absmax = read_safetensors(SINGLE / f"{name}.dq.safetensors")["layer.weight.absmax_resolved_f32"]
    else:
        absmax = read_safetensors(SINGLE / f"{name}.q.safetensors")["layer.weight.absmax"]
    a = np.abs(absmax.astype(np.float64))
    med, mx = float(np.median(a)), float(a.max())
    n_out = int(np.count_nonzero(a > 4.0 * med))
    (e,) = rep["stats"]["layers"]
    assert e == {
        "name": "layer.weight", "blocks": entry["n_absmax"], "min": float(a.min()), "median": med, "max": mx,
        "max_over_median": round(mx / med, 4), "outlier_blocks": n_out, "outlier_share": round(n_out / a.size, 6),
        "flagged": mx / med >= 8.0,
    }
    assert rep["stats"]["flagged"] == (["layer.weight"] if mx / med >= 8.0 else [])
    assert e["flagged"] is ("outliers" in name or "mixed" in name)


def test_stats_on_a_model_flag_the_injected_outliers() -> None:
    rep = _inspect(MODELS / "llama_fp4_nodq", stats=True, flag_ratio=8.0)
    st = rep["stats"]
    assert len(st["layers"]) == 14
    assert st["flagged"] == [e["name"] for e in st["layers"]]  # every matrix has a few 25x outliers
    rep = _inspect(MODELS / "llama_fp4_nodq", stats=True, flag_ratio=1000.0)
    assert rep["stats"]["flagged"] == []


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(MODELS / "llama_nf4_dq_qsbf16")]) == 0
    text = capsys.readouterr().out
    assert ("nf4 blocksize 64, nested (blocksize 256, float32), dtype bfloat16, storage BF16, absmax U8: "
            "14 layers, 1.47 M weights, 4.223 bits/weight") in text
    assert "--to fp32              7,951,360  7.58 MiB in 1 file(s)" in text
    assert main(["inspect", str(MODELS / "llama_nf4_dq"), "--json", "--stats"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["stats"]["outlier_factor"] == 4.0 and len(rep["stats"]["layers"]) == 14
    with open_checkpoint(MODELS / "llama_nf4_dq") as ckpt:
        assert format_report(inspect_checkpoint(ckpt, InspectOptions(stats=True))).count("OUTLIER") == 14


def test_cli_int8_reports_unsupported_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(MODELS / "llama_int8")]) == 0
    text = capsys.readouterr().out
    assert "weight I8, scale F32: 14 layers" in text


def test_inspect_a_hub_repo_offline(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    add_model_dir(cache, "org/llama-fp4", MODELS / "llama_fp4_nodq", commit_sha("fp4"))
    r = run_cli(["inspect", "org/llama-fp4", "--json"], offline_env(tmp_path, cache))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["hub"] == {"repo": "org/llama-fp4", "revision": None, "commit": commit_sha("fp4")}
    assert [(g["quant_type"], g["blocksize"], g["nested"]) for g in rep["quantized"]] == [("fp4", 64, False)]
    r = run_cli(["inspect", "org/llama-fp4"], offline_env(tmp_path, cache))
    assert r.stdout.splitlines()[0] == f"Hub repo org/llama-fp4 at main = commit {commit_sha('fp4')}"


# ----------------------------------------------------------------------------------------------- a LoRA adapter

def test_inspect_the_fixture_adapter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """PEFT 0.21's fixture adapter (r 8, alpha 16, q/v of two layers, float32): its report from the headers."""
    from tests.lora.test_gguf_adapter import ADAPTER

    assert main(["inspect", str(ADAPTER), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {k: rep[k] for k in ("kind", "base_model", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules",
                                "modules", "ranks", "scales", "tensors", "tensor_bytes", "dtypes", "gguf_adapter")} == {
        "kind": "lora-adapter", "base_model": "../models/llama_orig_bf16", "r": 8, "lora_alpha": 16,
        "use_rslora": False, "use_dora": False, "target_modules": ["q_proj", "v_proj"], "modules": 4,
        "ranks": {"8": 4}, "scales": {"2.0": 4}, "tensors": 8,
        "tensor_bytes": sum(4 * math.prod(a.shape) for a in read_safetensors(ADAPTER / "adapter_model.safetensors")
                            .values()),
        "dtypes": {"float32": 8}, "gguf_adapter": None}
    assert main(["inspect", str(ADAPTER)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"{ADAPTER}: PEFT LoRA adapter, 4 LoRA modules, 8 tensors, 56.00 KiB in adapter_model.safetensors"
    assert "  r 8, lora_alpha 16 (scale alpha / r)" in text and "  scales: 2.0 (4 modules)" in text
    assert any(line.startswith("  convert-bnb ADAPTER --to gguf") for line in text)
    # --stats reads absmax, which an adapter has not: USE-001, one line, exit 2
    assert main(["inspect", str(ADAPTER), "--stats"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "USE-001 --stats reads a 4-bit model's absmax; an adapter has none" in err


def test_inspect_adapter_scales_and_refusal(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """rsLoRA with a rank_pattern: each module's PEFT scale (alpha / sqrt(r)); DoRA: the GGUF route's LORA-015."""
    from tests.lora.test_gguf_adapter import P, fixture_config, fixture_tensors, make_adapter, v_rank4

    rs = make_adapter(tmp_path / "rs", fixture_config(use_rslora=True, rank_pattern={"v_proj": 4}),
                      v_rank4(fixture_tensors()))
    assert main(["inspect", str(rs), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ranks"] == {"4": 2, "8": 2} and rep["rank_pattern"] == {"v_proj": 4}
    assert rep["scales"] == {repr(16 / math.sqrt(8)): 2, "8.0": 2} and rep["use_rslora"] is True
    dora = make_adapter(tmp_path / "dora", fixture_config(use_dora=True), {
        **fixture_tensors(), **{f"{P}model.layers.{i}.self_attn.{m}.lora_magnitude_vector": np.ones(n, np.float32)
                                for i in (0, 1) for m, n in (("q_proj", 256), ("v_proj", 128))}})
    assert main(["inspect", str(dora), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["use_dora"] is True and rep["tensors"] == 12
    assert rep["gguf_adapter"]["rule"] == "LORA-015"
    assert rep["gguf_adapter"]["reason"].startswith("DoRA magnitude vector")
    assert rep["gguf_adapter"]["tensor"].endswith("lora_magnitude_vector")
    assert main(["inspect", str(dora)]) == 0
    assert "  --to gguf: refused, LORA-015 DoRA magnitude vector" in capsys.readouterr().out


def test_inspect_a_hub_adapter_offline(tmp_path: Path) -> None:
    from tests.lora.test_gguf_adapter import ADAPTER

    cache = tmp_path / "hub"
    add_model_dir(cache, "org/adapter", ADAPTER, commit_sha("adapter"))
    r = run_cli(["inspect", "org/adapter", "--json"], offline_env(tmp_path, cache))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["kind"] == "lora-adapter" and rep["modules"] == 4
    assert rep["hub"] == {"repo": "org/adapter", "revision": None, "commit": commit_sha("adapter")}


@pytest.mark.parametrize("to", ["gguf:f16", "gguf:q8_0", "gguf:q4_k_m"])
def test_planned_gguf_sizes_are_the_written_tensor_data(to: str, tmp_path: Path) -> None:
    """inspect's GGUF sizes are the GGUF writer's plan: the tensor data a conversion then writes, byte for byte;
    a lone weight file (no config.json) names the rule that refuses it."""
    import gguf

    from convert.job import convert
    from convert.options import ConvertOptions

    rep = _inspect(MODELS / "llama_nf4_dq")
    out = convert(ConvertOptions(str(MODELS / "llama_nf4_dq"), to=to, output=tmp_path / "m.gguf")).output
    assert rep["outputs"][to] == {"bytes": sum(int(t.n_bytes) for t in gguf.GGUFReader(out).tensors), "files": 1}
    lone = _inspect(MODELS / "llama_nf4_dq" / "model.safetensors")
    assert lone["outputs"][to] == {"error": "GGUF output needs the model's config.json and tokenizer"}

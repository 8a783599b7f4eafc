"""Diffusion single-file checkpoints (Flux NF4 as Forge / ComfyUI share them): no config.json, original tensor
names, bnb NF4 layers beside float8 text encoders, int64 ids and a bool mask (scripts/make_diffusion_fixture.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convert.cli import main
from tests.helpers.fixtures import FIXTURES, ROOT, bits, read_safetensors

DIFF = FIXTURES / "diffusion"
NF4 = DIFF / "flux_tiny_nf4.safetensors"
BASE = DIFF / "flux_tiny_bf16.safetensors"
F8_E4M3 = ["text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.k.weight",
           "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight",
           "text_encoders.t5xxl.transformer.shared.weight"]
F8_E5M2 = ["text_encoders.clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight"]


def _quantized(nf4: dict[str, np.ndarray]) -> set[str]:
    return {n for n in nf4 if f"{n}.absmax" in nf4}


def test_the_fixture_is_what_the_script_makes(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_diffusion_fixture", ROOT / "scripts/make_diffusion_fixture.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base, nf4 = mod.make(tmp_path)
    assert base.read_bytes() == BASE.read_bytes() and nf4.read_bytes() == NF4.read_bytes()


def test_the_fixture_looks_like_a_forge_nf4_file() -> None:
    nf4 = read_safetensors(NF4)
    quantized = _quantized(nf4)
    assert len(quantized) == 12 and "double_blocks.0.img_attn.qkv.weight" in quantized
    for n in quantized:  # the companions bnb / transformers write, under the original names
        assert {f"{n}.absmax", f"{n}.quant_map", f"{n}.nested_absmax", f"{n}.nested_quant_map",
                f"{n}.quant_state.bitsandbytes__nf4"} <= set(nf4)
    dtypes = {n: str(v.dtype) for n, v in nf4.items()}
    assert [dtypes[n] for n in F8_E4M3 + F8_E5M2] == ["float8_e4m3fn"] * 3 + ["float8_e5m2"]
    assert dtypes["text_encoders.clip_l.transformer.text_model.embeddings.position_ids"] == "int64"
    assert dtypes["text_encoders.clip_l.transformer.text_model.attention_mask"] == "bool"
    assert not (DIFF / "config.json").exists()


#: The fixture's two 16-column layers (img_in, txt_in) at blocksize 64: bnb's CPU kernel gets them wrong.
ROWS_NOTE = ("2 4-bit layers with rows not a multiple of the blocksize (e.g. img_in.weight: rows of 16, blocksize "
             "64): bitsandbytes' CPU kernel on AVX512 machines (and transformers' model.dequantize() there) computes "
             "them wrongly, so it will disagree with this output, which equals bnb's generic and CUDA kernels")


def test_auto_keeps_every_dtype_and_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flux-dequantized.safetensors"
    assert main([str(NF4), "-o", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["notes"] == [ROWS_NOTE]  # nothing was cast
    got, base, nf4 = read_safetensors(out), read_safetensors(BASE), read_safetensors(NF4)
    assert sorted(got) == sorted(base)  # every name kept; no companion left
    quantized = _quantized(nf4)
    for name, want in base.items():
        if name in quantized:  # dequantized to the QuantState dtype; NF4 error as on any weight
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            w, g = want.astype(np.float32), got[name].astype(np.float32)
            assert 0.05 < np.linalg.norm(g - w) / np.linalg.norm(w) < 0.12, name
        else:  # F8_E4M3, F8_E5M2, I64, BOOL, BF16: the stored bytes
            assert got[name].dtype == want.dtype and got[name].tobytes() == want.tobytes(), name


def test_bf16_names_what_it_cast_from_float8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flux-bf16.safetensors"
    assert main([str(NF4), "--to", "bf16", "-o", str(out), "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes == [
        ROWS_NOTE,
        "3 tensors stored as float8_e4m3fn cast to bfloat16, exactly (every value fits): " + ", ".join(F8_E4M3)
        + " (--to auto keeps them as stored)",
        "1 tensor stored as float8_e5m2 cast to bfloat16, exactly (every value fits): " + F8_E5M2[0]
        + " (--to auto keeps them as stored)",
    ]
    got, base = read_safetensors(out), read_safetensors(BASE)
    for name in F8_E4M3 + F8_E5M2:
        assert str(got[name].dtype) == "bfloat16"
        assert np.array_equal(bits(got[name].astype(np.float32)), bits(base[name].astype(np.float32)))  # exact
    for name in ("text_encoders.clip_l.transformer.text_model.embeddings.position_ids",
                 "text_encoders.clip_l.transformer.text_model.attention_mask"):  # not floats: kept
        assert got[name].dtype == base[name].dtype and got[name].tobytes() == base[name].tobytes()
    r = main([str(NF4), "--to", "bf16", "-o", str(tmp_path / "again.safetensors")])
    assert r == 0 and "note: 3 tensors stored as float8_e4m3fn cast to bfloat16" in capsys.readouterr().err


def test_inspect_and_check_report_the_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(NF4), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["config"] is False
    parts = {c["name"]: (c["layers_4bit"], c["unquantized"]) for c in rep["components"]}
    assert parts == {
        "double_blocks": (5, {"BF16": 2}), "final_layer": (2, {}), "img_in": (1, {"BF16": 1}),
        "single_blocks": (3, {}), "time_in": (1, {"BF16": 1}), "vae": (0, {"BF16": 2}),
        "text_encoders.clip_l": (0, {"BOOL": 1, "F8_E5M2": 1, "I64": 1}), "text_encoders.t5xxl": (0, {"F8_E4M3": 3}),
    }
    assert rep["outputs"]["auto"]["bytes"] == BASE.stat().st_size - (8 + int.from_bytes(BASE.read_bytes()[:8],
                                                                                           "little"))
    assert rep["notes"] == ["unquantized tensors stored as 3 F8_E4M3, 1 F8_E5M2: --to auto keeps them as stored; "
                            "--to bf16/fp16/fp32 cast them (float8 exactly) and a note names them"]
    assert main(["inspect", str(NF4)]) == 0
    text = capsys.readouterr().out
    assert "no config.json: a single-file checkpoint (as diffusion tools write them)" in text
    assert "  text_encoders.t5xxl                      3 F8_E4M3\n" in text
    assert main(["check", str(NF4)]) == 0
    assert "OK (1 file, 84 tensors, 12 4-bit layers, 0 int8 layers, 12 plain tensors)" in capsys.readouterr().out


def test_gguf_of_a_diffusion_file_is_refused_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(NF4), "--to", "gguf", "-o", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GGUF-004" in err and "a lone weight file" in err
    assert list(tmp_path.iterdir()) == []


def test_nf4_keeps_float8_weights_and_its_output_reads_back(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """bnb's QuantState dtype is float16, bfloat16 or float32 (BNB-013): float8 text-encoder weights stay
    float8 instead of becoming 4-bit layers nothing can read back."""
    out = tmp_path / "rq.safetensors"
    assert main([str(BASE), "--to", "nf4", "-o", str(out), "-q"]) == 0
    got, base = read_safetensors(out), read_safetensors(BASE)
    for name in F8_E4M3 + F8_E5M2:
        assert got[name].dtype == base[name].dtype and got[name].tobytes() == base[name].tobytes(), name
        assert f"{name}.absmax" not in got
    assert main(["check", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("OK (1 file, 84 tensors, 12 4-bit layers, 0 int8 layers, "
                                                    "12 plain tensors)")
    assert main([str(out), "--to", "bf16", "-o", str(tmp_path / "back.safetensors"), "-q"]) == 0

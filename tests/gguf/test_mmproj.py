"""The vision projector GGUF (mmproj) of a Gemma 3 checkpoint against llama.cpp's ``convert_hf_to_gguf.py
--mmproj`` (reference/mmproj_f16.json, made by scripts/make_arch_fixtures.py from the dequantized model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from convert.gguf.encode import write_gguf
from convert.gguf.mmproj import mmproj_type, plan_mmproj
from convert.stream.plan import make_plan
from formats import errors as E
from formats.checkpoint import open_checkpoint
from tests.gguf.test_arch import _close, summary
from tests.helpers.fixtures import MODELS

ROOT = MODELS / "gemma3cg_nf4_dq"


def _write(root: Path, out: Path, output_type: str = "f16") -> Path:
    with open_checkpoint(root) as ckpt:
        plan = make_plan(ckpt)
        config = json.loads((root / "config.json").read_text())
        mm = plan_mmproj(config, [(t.name, t.shape) for t in plan.tensors], root, output_type)
        write_gguf(mm, out, {t.name: t for t in plan.tensors})
    return out


@pytest.mark.parametrize("fixture", ["gemma3cg_nf4_dq", "mistral3_nf4_dq", "qwen2_5_vl_nf4_dq", "qwen2_vl_nf4_dq"])
def test_mmproj_equals_llama_cpp_converter(fixture: str, tmp_path: Path) -> None:
    root = MODELS / fixture
    want = json.loads((root / "reference" / "mmproj_f16.json").read_text())
    got = summary(_write(root, tmp_path / "mmproj.gguf"))
    assert got["tensors"] == want["tensors"]
    assert sorted(got["metadata"]) == sorted(want["metadata"])
    for key, value in want["metadata"].items():  # general.* too: the converter's, from the same folder name
        assert _close(got["metadata"][key], value), key


def test_the_mmproj_type_follows_the_converter() -> None:
    assert [mmproj_type(t) for t in ("f32", "f16", "bf16", "q8_0", "q4_k_m", "q6_k")] == [
        "f32", "f16", "bf16", "q8_0", "f16", "f16"]


def test_no_image_mean_or_another_class_is_refused(tmp_path: Path) -> None:
    src = shutil.copytree(ROOT, tmp_path / "m", ignore=shutil.ignore_patterns("reference", "preprocessor_config.json"))
    with pytest.raises(E.GgufConfigError) as info:
        _write(src, tmp_path / "x.gguf")
    assert "GGUF-006 the vision projector needs the image mean and std of preprocessor_config.json, and there is " \
        "none" in str(info.value)
    (src / "preprocessor_config.json").write_text('{"image_mean": "0.5", "image_std": [0.5, 0.5, 0.5]}')
    with pytest.raises(E.GgufConfigError) as info:
        _write(src, tmp_path / "x.gguf")
    assert "GGUF-006 the vision projector needs image_mean from preprocessor_config.json" in str(info.value)
    with pytest.raises(E.GgufConfigError) as info:
        plan_mmproj({"architectures": ["LlavaForConditionalGeneration"]}, [], ROOT)
    assert ("written for Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration, "
            "Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration only so far") in str(info.value)


def test_mmproj_option_writes_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--to gguf:q4_k_m --mmproj PATH``: the text model and the projector (F16, as the converter writes it
    for a mix), the projector equal to the converter's, each committed on its own."""
    from convert.cli import main

    text, mm = tmp_path / "g3.gguf", tmp_path / "mmproj.gguf"
    assert main([str(ROOT), "--to", "gguf:q4_k_m", "-o", str(text), "--mmproj", str(mm), "-q"]) == 0
    want = json.loads((ROOT / "reference" / "mmproj_f16.json").read_text())
    assert summary(mm)["tensors"] == want["tensors"]
    assert summary(text)["metadata"]["general.architecture"] == "gemma3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g3.gguf", "mmproj.gguf"]


@pytest.mark.parametrize(("argv", "parts", "rc"), [
    (["--to", "bf16"], ["USE-001 --mmproj needs --to gguf[:TYPE]", "found '--to bf16'"], 2),
    (["--to", "gguf", "--mmproj-same"], ["USE-001 --mmproj names the text model's output"], 2),
    (["--to", "gguf", "--mmproj-exists"], ["OUT-001 output exists", "choose another --mmproj path"], 2),
    (["--to", "gguf", "--overwrite", "--mmproj-empty"], ["USE-001 --mmproj names no file"], 2),
])
def test_mmproj_refusals_write_nothing(argv, parts, rc, tmp_path: Path,  # noqa: ANN001
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from convert.cli import main

    text, mm = tmp_path / "t.gguf", tmp_path / "mm.gguf"
    if "--mmproj-exists" in argv:
        mm.write_bytes(b"keep")
    target = text if "--mmproj-same" in argv else "" if "--mmproj-empty" in argv else mm
    args = [a for a in argv if not a.startswith("--mmproj-")]
    assert main([str(ROOT), *args, "-o", str(text), "--mmproj", str(target), "-q"]) == rc
    err = capsys.readouterr().err
    for part in parts:
        assert part in err, (part, err)
    assert not text.exists()
    assert not mm.exists() or mm.is_dir() or mm.read_bytes() == b"keep"


def test_mmproj_of_another_multimodal_class_is_refused_before_writing(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from convert.cli import main

    text = tmp_path / "t.gguf"
    assert main([str(MODELS / "granite_nf4_dq"), "--to", "gguf", "-o", str(text), "--mmproj",
                 str(tmp_path / "mm.gguf"), "-q"]) == 2
    assert "GGUF-006 a vision projector (mmproj) is written for Gemma3ForConditionalGeneration, " in \
        capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("fixture", "drop", "missing"), [
    ("qwen2_vl_nf4_dq", "visual.blocks.0.attn.qkv.weight", "v.blk.0.attn_q.weight"),
    ("gemma3cg_nf4_dq", "vision_tower.encoder.layers.0.self_attn.q_proj.weight", "v.blk.0.attn_q.weight"),
    ("mistral3_nf4_dq", "multi_modal_projector.linear_2.weight", "mm.2.weight"),
])
def test_a_missing_vision_tensor_is_refused(fixture: str, drop: str, missing: str) -> None:
    from tests.helpers.fixtures import plan_inputs

    root = MODELS / fixture
    config, shapes = plan_inputs(root)
    assert drop in dict(shapes)
    with pytest.raises(E.GgufConfigError) as info:
        plan_mmproj(config, [(n, sh) for n, sh in shapes if n != drop], root)
    assert f"GGUF-006 the weights lack a tensor of the vision projector: {missing}" in str(info.value)

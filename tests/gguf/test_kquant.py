"""K-quant GGUF files end to end: golden hashes from llama.cpp, logits, --merge-lora and batch.

``tests/fixtures/gguf_mix_sha256.json`` (made by scripts/make_kquant_goldens.py with
``llama_cpp.llama_model_quantize``) holds every tensor's type and sha256 of llama-quantize's output for
the fixture model and every file type, so the byte identity of our ``--to gguf:MIX`` files is checked
without llama_cpp too; where llama_cpp imports, the golden file is checked against llama.cpp itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from convert.cli import main
from convert.gguf.types import FILE_TYPES
from formats.safetensors import SafetensorsReader
from tests.helpers.fixtures import FIXTURES
from tests.helpers.gguf import REF, has_llama_cpp, llama_logits, llama_quantize, tensor_hashes

MODEL = FIXTURES / "models" / "llama_nf4_dq"
ADAPTER = FIXTURES / "lora" / "adapter"
GOLDEN = json.loads((FIXTURES / "gguf_mix_sha256.json").read_text())


def _hashes_of_llama_quantize(f32: Path, dst: Path, mix: str) -> dict[str, list[str]]:
    llama_quantize(f32, dst, mix)
    return tensor_hashes(dst)


def run(args: list[str]) -> None:
    assert main([*args, "-q"]) == 0


@pytest.mark.parametrize("mix", [m for m, ft in FILE_TYPES.items() if not ft.needs_imatrix])
def test_every_mix_equals_llama_quantizes_golden_hashes(mix: str, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    run([str(MODEL), "--to", f"gguf:{mix.upper()}", "-o", str(out)])
    assert tensor_hashes(out) == GOLDEN[mix]


def test_the_golden_hashes_are_what_llama_cpp_makes_now(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    f32 = tmp_path / "f32.gguf"
    run([str(MODEL), "--to", "gguf:f32", "-o", str(f32)])
    for mix in ("q4_k_m", "q2_k", "q3_k_s", "q6_k"):  # one per encoder family; all 13 in test_mix.py
        assert _hashes_of_llama_quantize(f32, tmp_path / f"{mix}.gguf", mix) == GOLDEN[mix], mix


@pytest.mark.parametrize("mix", ["q4_k_m", "q6_k"])
def test_logits_are_as_far_from_the_f32_files_as_llama_quantizes(mix: str, tmp_path: Path) -> None:
    """Our file and llama-quantize's (from our f32 file) give llama.cpp logits at the same distance from
    the f32 file's (they are the same bytes), and both are close to the dequantized model's."""
    pytest.importorskip("llama_cpp")
    f32, ours = tmp_path / "f32.gguf", tmp_path / "ours.gguf"
    run([str(MODEL), "--to", "gguf:f32", "-o", str(f32)])
    run([str(MODEL), "--to", f"gguf:{mix}", "-o", str(ours)])
    theirs = tmp_path / "theirs.gguf"
    llama_quantize(f32, theirs, mix)
    r = SafetensorsReader(REF / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    n_vocab = int(np.array(r.array("logits_dequantized")).shape[-1])
    base = llama_logits(f32, ids, n_vocab)
    d_ours = float(np.abs(llama_logits(ours, ids, n_vocab) - base).max())
    d_theirs = float(np.abs(llama_logits(theirs, ids, n_vocab) - base).max())
    assert d_ours == d_theirs
    assert 0 < d_ours < 0.5 * float(np.abs(base).max())


def test_merge_lora_composes_with_q4_k_m(tmp_path: Path) -> None:
    """--merge-lora --to gguf:q4_k_m equals llama-quantize of --merge-lora --to gguf:f32."""
    ours = tmp_path / "ours.gguf"
    run([str(MODEL), "--merge-lora", str(ADAPTER), "--to", "gguf:Q4_K_M", "-o", str(ours)])
    got = tensor_hashes(ours)
    plain = GOLDEN["q4_k_m"]
    changed = sorted(n for n in got if got[n] != plain[n])
    # the adapter targets q_proj and v_proj of both layers: exactly those tensors change
    assert changed == ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.attn_q.weight", "blk.1.attn_v.weight"]
    if not has_llama_cpp():
        return
    f32 = tmp_path / "f32.gguf"
    run([str(MODEL), "--merge-lora", str(ADAPTER), "--to", "gguf:f32", "-o", str(f32)])
    assert got == _hashes_of_llama_quantize(f32, tmp_path / "theirs.gguf", "q4_k_m")


def test_batch_writes_q4_k_m(tmp_path: Path) -> None:
    src = tmp_path / "in" / "good"
    shutil.copytree(MODEL, src, ignore=shutil.ignore_patterns("reference"))
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src}\n")
    out = tmp_path / "out"
    assert main(["batch", str(jobs), "--out-dir", str(out), "--to", "gguf:Q4_K_M", "--quiet"]) == 0
    made = [p for p in out.iterdir() if not p.name.startswith(".")]
    assert len(made) == 1 and made[0].name == "good-Q4_K_M.gguf"
    assert tensor_hashes(made[0]) == GOLDEN["q4_k_m"]

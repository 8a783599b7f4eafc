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

from formats.safetensors import SafetensorsReader

MODELS = Path(__file__).parent / "fixtures" / "models"
ARCHS = ["qwen3", "gemma2", "gemma3", "mistral_hd", "phi3"]
OUT_TYPES = ["f16", "q8_0"]
#: Keys llama.cpp takes from the directory name or a model card, not from the model.
NAME_KEYS = {"general.name", "general.basename", "general.finetune", "general.size_label", "general.version"}
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
    gm = {k: v for k, v in got["metadata"].items() if k not in NAME_KEYS}
    wm = {k: v for k, v in want["metadata"].items() if k not in NAME_KEYS}
    assert sorted(gm) == sorted(wm)
    for key, value in wm.items():
        assert _close(gm[key], value), (key, gm[key], value)


def _llama_logits(path: Path, ids: list[int], n_vocab: int) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False,
                          n_threads=2, seed=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32).reshape(len(ids), n_vocab)
    finally:
        llm.close()


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
    got = _llama_logits(_convert(tmp_path, arch, out_type, src), ids, want.shape[-1])
    diff = float(np.abs(got - want).max())
    assert diff <= LOGIT_BOUND[out_type] * float(np.abs(want).max()), diff
    # the same next token wherever the reference's top two are further apart than the difference
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * diff
    assert clear.sum() >= len(ids) // 2
    assert np.array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])

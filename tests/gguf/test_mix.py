"""llama-quantize's file-type mixes (``--to gguf:q4_k_m`` ...): every tensor's type, and its bytes where a
codec exists, against ``llama_cpp.llama_model_quantize`` run on our ``--to gguf:f32`` file.

Three layers of checks:

- golden tables (below, made by llama.cpp as vendored in llama-cpp-python 0.3.36): the types of
  every 2-D tensor per model and mix, checked against our plan without llama_cpp;
- the same against a live ``llama_model_quantize`` where llama_cpp imports, plus tensor names,
  ``general.file_type`` and the bytes of every tensor whose type has a codec in
  :data:`convert.gguf.codecs.CODECS` (a loop over tensors; the K-quant codecs are merged
  separately, and until then the test checks what it can and skips naming the types left);
- unit tests of :func:`convert.gguf.mix.mix_types` on synthetic tensor lists, and on header-only
  GGUF files (tiny tensors, real hyperparameters) for the rules no small model reaches: a 70B
  Llama, 80-layer Qwen2, 8 experts, tied embeddings with 32 layers, against llama.cpp.

Models: every fixture under ``tests/fixtures/models`` (one Llama layout: hidden 256, ff 704, which
is not a multiple of 256, 2 layers, GQA 2) and synthetic float models made here in a temporary
directory (no file is checked in): a 32-layer Llama with GQA 4 (a Llama 3 8B's layout in small),
a 16-layer Llama with tied embeddings and no GQA, and the Gemma (tied, hidden 64) and Qwen2
(biases, hidden 64) of ``tests/helpers/gguf.py``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from convert.gguf.codecs import CODECS, codec
from convert.gguf.mix import MixModel, mix_summary, mix_types, use_more_bits
from convert.gguf.types import FILE_TYPES, OUTPUT_TYPES, parse_output_type
from formats.errors import GgufTypeError
from tests.helpers.fixtures import MODELS
from tests.helpers.gguf import decoder_layers, has_llama_cpp, llama_quantize, make_gemma, make_qwen2

GT = gguf.GGMLQuantizationType
FIXTURE = MODELS / "llama_nf4_dq"
#: the Llama fixtures (the other architectures' fixtures have their K-quant goldens in tests/gguf/test_arch.py)
FIXTURES = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").exists() and p.name.startswith("llama"))
SYNTHETIC = ["llama32_gqa4", "llama16_tied", "gemma", "qwen2"]
MIXES = [m for m, ft in FILE_TYPES.items() if not ft.needs_imatrix]  # (q2_k_s: tests/gguf/test_imatrix.py)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def make_llama(root: Path, *, layers: int, heads: int, kv_heads: int, hidden: int, ff: int, tied: bool,
               seed: int = 0) -> Path:
    """A float32 Llama with the fixture's SentencePiece tokenizer (vocab 1000)."""
    root.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.model", "tokenizer_config.json", "tokenizer.json"):
        shutil.copy(FIXTURE / f, root / f)
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               hidden_size=hidden, intermediate_size=ff, head_dim=hidden // heads, tie_word_embeddings=tied,
               torch_dtype="float32")
    (root / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": (rng.standard_normal((1000, hidden)) * 0.1).astype(np.float32)}
    w.update(decoder_layers(rng, cfg, bias=False, norm_center=1.0, std=0.05))
    if not tied:
        w["lm_head.weight"] = (rng.standard_normal((1000, hidden)) * 0.05).astype(np.float32)
    save_file(w, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("mixmodels")
    dirs = {name: MODELS / name for name in FIXTURES}
    dirs["llama32_gqa4"] = make_llama(root / "llama32_gqa4", layers=32, heads=8, kv_heads=2, hidden=256, ff=256,
                                      tied=False)
    dirs["llama16_tied"] = make_llama(root / "llama16_tied", layers=16, heads=4, kv_heads=4, hidden=256, ff=512,
                                      tied=True)
    make_gemma(root / "gemma")
    make_qwen2(root / "qwen2")
    dirs["gemma"], dirs["qwen2"] = root / "gemma", root / "qwen2"
    # the tiny Qwen2's BPE tokenizer is in no table of llama.cpp's: add its check hash as "qwen2"
    pytest.importorskip("tokenizers")
    from convert.gguf import bpe_pre as gguf_bpe_pre

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(gguf_bpe_pre.PRE_BY_HASH, gguf_bpe_pre.check_hash(root / "qwen2" / "tokenizer.json"), "qwen2")
        yield dirs


def _cli(args: list[str]) -> None:
    from convert.cli import main

    assert main(args) == 0


@pytest.fixture(scope="module")
def f32_files(model_dirs, tmp_path_factory) -> dict[str, Path]:
    """Our ``--to gguf:f32`` of every model (made once)."""
    root = tmp_path_factory.mktemp("f32")
    out = {}
    for name, d in model_dirs.items():
        out[name] = root / f"{name}.gguf"
        _cli([str(d), "--to", "gguf:f32", "-o", str(out[name]), "-q"])
    return out


def _plan_types(model_dir: Path, mix: str, capsys) -> list[tuple[str, list[int], str]]:
    """(name, shape rows first, type) of our plan, through the CLI's ``--dry-run --json``."""
    from convert.cli import main

    capsys.readouterr()
    assert main([str(model_dir), "--to", f"gguf:{mix}", "-o", "/nonexistent/x.gguf", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    return [(t["name"], t["shape"], t["type"]) for t in plan["tensors"]]


# --------------------------------------------------------------------------------------------
# Golden tables: {model layout: {mix: {tensor kind: "TYPE" or "TYPE:layers TYPE:layers"}}}
# (2-D tensors only; 1-D tensors are F32 in every mix). Made by llama_model_quantize.
# --------------------------------------------------------------------------------------------

_BLK = re.compile(r"blk\.(\d+)\.")


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def compact(rows: list[tuple[str, list[int], str]]) -> dict[str, str]:
    """(name, shape, type) rows -> {kind: spec}: a kind is the name without ``blk.N.``; spec is the
    type, or ``TYPE:layers`` groups when the layers differ (first-seen order of types)."""
    by_kind: dict[str, dict[str, list[int]]] = {}
    for name, shape, t in rows:
        if sum(d > 1 for d in shape) < 2:
            continue
        m = _BLK.match(name)
        kind = name[m.end():] if m else name
        by_kind.setdefault(kind, {}).setdefault(t, []).append(int(m.group(1)) if m else -1)
    out = {}
    for kind, types in by_kind.items():
        if len(types) == 1:
            out[kind] = next(iter(types))
        else:
            out[kind] = " ".join(f"{t}:{_ranges(sorted(ids))}" for t, ids in types.items())
    return dict(sorted(out.items()))


GOLDEN: dict[str, dict[str, dict[str, str]]] = {
    "fixture": {
        "q4_0": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_0",
        },
        "q4_1": {
            "attn_k.weight": "Q4_1",
            "attn_output.weight": "Q4_1",
            "attn_q.weight": "Q4_1",
            "attn_v.weight": "Q4_1",
            "ffn_down.weight": "Q4_1",
            "ffn_gate.weight": "Q4_1",
            "ffn_up.weight": "Q4_1",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_1",
        },
        "q5_0": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_0",
        },
        "q5_1": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_1",
        },
        "q2_k": {
            "attn_k.weight": "Q2_K",
            "attn_output.weight": "Q3_K",
            "attn_q.weight": "Q2_K",
            "attn_v.weight": "Q3_K",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q2_K",
            "ffn_up.weight": "Q2_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q2_K",
        },
        "q3_k_s": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q3_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q3_K",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q3_K",
        },
        "q3_k_m": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q3_K",
        },
        "q3_k_l": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q3_K",
        },
        "q4_k_s": {
            "attn_k.weight": "Q4_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q4_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q4_K",
            "ffn_up.weight": "Q4_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_K",
        },
        "q4_k_m": {
            "attn_k.weight": "Q4_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q4_K",
            "attn_v.weight": "Q4_K:0 Q6_K:1",
            "ffn_down.weight": "Q5_0:0 Q8_0:1",
            "ffn_gate.weight": "Q4_K",
            "ffn_up.weight": "Q4_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_K",
        },
        "q5_k_s": {
            "attn_k.weight": "Q5_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q5_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_K",
            "ffn_up.weight": "Q5_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_K",
        },
        "q5_k_m": {
            "attn_k.weight": "Q5_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q5_K",
            "attn_v.weight": "Q5_K:0 Q6_K:1",
            "ffn_down.weight": "Q5_1:0 Q8_0:1",
            "ffn_gate.weight": "Q5_K",
            "ffn_up.weight": "Q5_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_K",
        },
        "q6_k": {
            "attn_k.weight": "Q6_K",
            "attn_output.weight": "Q6_K",
            "attn_q.weight": "Q6_K",
            "attn_v.weight": "Q6_K",
            "ffn_down.weight": "Q8_0",
            "ffn_gate.weight": "Q6_K",
            "ffn_up.weight": "Q6_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q6_K",
        },
        "iq4_nl": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "IQ4_NL",
            "ffn_down.weight": "IQ4_NL",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "output.weight": "Q6_K",
            "token_embd.weight": "IQ4_NL",
        },
        "iq4_xs": {
            "attn_k.weight": "IQ4_XS",
            "attn_output.weight": "IQ4_XS",
            "attn_q.weight": "IQ4_XS",
            "attn_v.weight": "IQ4_XS",
            "ffn_down.weight": "IQ4_NL",
            "ffn_gate.weight": "IQ4_XS",
            "ffn_up.weight": "IQ4_XS",
            "output.weight": "Q6_K",
            "token_embd.weight": "IQ4_XS",
        },
    },
    "llama32_gqa4": {
        "q4_0": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_0",
        },
        "q4_1": {
            "attn_k.weight": "Q4_1",
            "attn_output.weight": "Q4_1",
            "attn_q.weight": "Q4_1",
            "attn_v.weight": "Q4_1",
            "ffn_down.weight": "Q4_1",
            "ffn_gate.weight": "Q4_1",
            "ffn_up.weight": "Q4_1",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_1",
        },
        "q5_0": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_0",
        },
        "q5_1": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_1",
        },
        "q2_k": {
            "attn_k.weight": "Q2_K",
            "attn_output.weight": "Q3_K",
            "attn_q.weight": "Q2_K",
            "attn_v.weight": "Q4_K",
            "ffn_down.weight": "Q3_K",
            "ffn_gate.weight": "Q2_K",
            "ffn_up.weight": "Q2_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q2_K",
        },
        "q3_k_s": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q3_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q3_K",
            "ffn_down.weight": "Q3_K",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q3_K",
        },
        "q3_k_m": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q5_K:0-1 Q4_K:2-31",
            "ffn_down.weight": "Q5_K:0-1 Q4_K:2-31",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q3_K",
        },
        "q3_k_l": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_K",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q3_K",
        },
        "q4_k_s": {
            "attn_k.weight": "Q4_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q4_K",
            "attn_v.weight": "Q5_K:0-3 Q4_K:4-31",
            "ffn_down.weight": "Q5_K:0-3 Q4_K:4-31",
            "ffn_gate.weight": "Q4_K",
            "ffn_up.weight": "Q4_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_K",
        },
        "q4_k_m": {
            "attn_k.weight": "Q4_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q4_K",
            "attn_v.weight": "Q6_K:0-3,6,9,12,15,18,21,24,27-31 Q4_K:4-5,7-8,10-11,13-14,16-17,19-20,22-23,25-26",
            "ffn_down.weight": "Q6_K:0-3,6,9,12,15,18,21,24,27-31 Q4_K:4-5,7-8,10-11,13-14,16-17,19-20,22-23,25-26",
            "ffn_gate.weight": "Q4_K",
            "ffn_up.weight": "Q4_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_K",
        },
        "q5_k_s": {
            "attn_k.weight": "Q5_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q5_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_K",
            "ffn_gate.weight": "Q5_K",
            "ffn_up.weight": "Q5_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_K",
        },
        "q5_k_m": {
            "attn_k.weight": "Q5_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q5_K",
            "attn_v.weight": "Q6_K:0-3,6,9,12,15,18,21,24,27-31 Q5_K:4-5,7-8,10-11,13-14,16-17,19-20,22-23,25-26",
            "ffn_down.weight": "Q6_K:0-3,6,9,12,15,18,21,24,27-31 Q5_K:4-5,7-8,10-11,13-14,16-17,19-20,22-23,25-26",
            "ffn_gate.weight": "Q5_K",
            "ffn_up.weight": "Q5_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q5_K",
        },
        "q6_k": {
            "attn_k.weight": "Q6_K",
            "attn_output.weight": "Q6_K",
            "attn_q.weight": "Q6_K",
            "attn_v.weight": "Q6_K",
            "ffn_down.weight": "Q6_K",
            "ffn_gate.weight": "Q6_K",
            "ffn_up.weight": "Q6_K",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q6_K",
        },
        "iq4_nl": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_K:0-3 IQ4_NL:4-31",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "output.weight": "Q6_K",
            "token_embd.weight": "IQ4_NL",
        },
        "iq4_xs": {
            "attn_k.weight": "IQ4_XS",
            "attn_output.weight": "IQ4_XS",
            "attn_q.weight": "IQ4_XS",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_K:0-3 IQ4_XS:4-31",
            "ffn_gate.weight": "IQ4_XS",
            "ffn_up.weight": "IQ4_XS",
            "output.weight": "Q6_K",
            "token_embd.weight": "IQ4_XS",
        },
    },
    "llama16_tied": {
        "q4_0": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "token_embd.weight": "Q6_K",
        },
        "q4_1": {
            "attn_k.weight": "Q4_1",
            "attn_output.weight": "Q4_1",
            "attn_q.weight": "Q4_1",
            "attn_v.weight": "Q4_1",
            "ffn_down.weight": "Q4_1",
            "ffn_gate.weight": "Q4_1",
            "ffn_up.weight": "Q4_1",
            "token_embd.weight": "Q6_K",
        },
        "q5_0": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "token_embd.weight": "Q6_K",
        },
        "q5_1": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "token_embd.weight": "Q6_K",
        },
        "q2_k": {
            "attn_k.weight": "Q2_K",
            "attn_output.weight": "Q3_K",
            "attn_q.weight": "Q2_K",
            "attn_v.weight": "Q3_K",
            "ffn_down.weight": "Q3_K",
            "ffn_gate.weight": "Q2_K",
            "ffn_up.weight": "Q2_K",
            "token_embd.weight": "Q6_K",
        },
        "q3_k_s": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q3_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q3_K",
            "ffn_down.weight": "Q3_K",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "token_embd.weight": "Q6_K",
        },
        "q3_k_m": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q5_K:0-1 Q4_K:2-15",
            "ffn_down.weight": "Q5_K:0 Q4_K:1-15",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "token_embd.weight": "Q6_K",
        },
        "q3_k_l": {
            "attn_k.weight": "Q3_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q3_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_K",
            "ffn_gate.weight": "Q3_K",
            "ffn_up.weight": "Q3_K",
            "token_embd.weight": "Q6_K",
        },
        "q4_k_s": {
            "attn_k.weight": "Q4_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q4_K",
            "attn_v.weight": "Q5_K:0-3 Q4_K:4-15",
            "ffn_down.weight": "Q5_K:0-1 Q4_K:2-15",
            "ffn_gate.weight": "Q4_K",
            "ffn_up.weight": "Q4_K",
            "token_embd.weight": "Q6_K",
        },
        "q4_k_m": {
            "attn_k.weight": "Q4_K",
            "attn_output.weight": "Q4_K",
            "attn_q.weight": "Q4_K",
            "attn_v.weight": "Q6_K:0-1,4,7,10,13-15 Q4_K:2-3,5-6,8-9,11-12",
            "ffn_down.weight": "Q6_K:0-1,4,7,10,13-15 Q4_K:2-3,5-6,8-9,11-12",
            "ffn_gate.weight": "Q4_K",
            "ffn_up.weight": "Q4_K",
            "token_embd.weight": "Q6_K",
        },
        "q5_k_s": {
            "attn_k.weight": "Q5_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q5_K",
            "attn_v.weight": "Q5_K",
            "ffn_down.weight": "Q5_K",
            "ffn_gate.weight": "Q5_K",
            "ffn_up.weight": "Q5_K",
            "token_embd.weight": "Q6_K",
        },
        "q5_k_m": {
            "attn_k.weight": "Q5_K",
            "attn_output.weight": "Q5_K",
            "attn_q.weight": "Q5_K",
            "attn_v.weight": "Q6_K:0-1,4,7,10,13-15 Q5_K:2-3,5-6,8-9,11-12",
            "ffn_down.weight": "Q6_K:0-1,4,7,10,13-15 Q5_K:2-3,5-6,8-9,11-12",
            "ffn_gate.weight": "Q5_K",
            "ffn_up.weight": "Q5_K",
            "token_embd.weight": "Q6_K",
        },
        "q6_k": {
            "attn_k.weight": "Q6_K",
            "attn_output.weight": "Q6_K",
            "attn_q.weight": "Q6_K",
            "attn_v.weight": "Q6_K",
            "ffn_down.weight": "Q6_K",
            "ffn_gate.weight": "Q6_K",
            "ffn_up.weight": "Q6_K",
            "token_embd.weight": "Q6_K",
        },
        "iq4_nl": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "IQ4_NL",
            "ffn_down.weight": "Q5_K:0-1 IQ4_NL:2-15",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "token_embd.weight": "Q6_K",
        },
        "iq4_xs": {
            "attn_k.weight": "IQ4_XS",
            "attn_output.weight": "IQ4_XS",
            "attn_q.weight": "IQ4_XS",
            "attn_v.weight": "IQ4_XS",
            "ffn_down.weight": "Q5_K:0-1 IQ4_XS:2-15",
            "ffn_gate.weight": "IQ4_XS",
            "ffn_up.weight": "IQ4_XS",
            "token_embd.weight": "Q6_K",
        },
    },
    "gemma": {
        "q4_0": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "token_embd.weight": "Q8_0",
        },
        "q4_1": {
            "attn_k.weight": "Q4_1",
            "attn_output.weight": "Q4_1",
            "attn_q.weight": "Q4_1",
            "attn_v.weight": "Q4_1",
            "ffn_down.weight": "Q4_1",
            "ffn_gate.weight": "Q4_1",
            "ffn_up.weight": "Q4_1",
            "token_embd.weight": "Q8_0",
        },
        "q5_0": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "token_embd.weight": "Q8_0",
        },
        "q5_1": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "token_embd.weight": "Q8_0",
        },
        "q2_k": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q5_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "token_embd.weight": "Q8_0",
        },
        "q3_k_s": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "token_embd.weight": "Q8_0",
        },
        "q3_k_m": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "token_embd.weight": "Q8_0",
        },
        "q3_k_l": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "token_embd.weight": "Q8_0",
        },
        "q4_k_s": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "token_embd.weight": "Q8_0",
        },
        "q4_k_m": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0:0 Q8_0:1",
            "ffn_down.weight": "Q5_0:0 Q8_0:1",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "token_embd.weight": "Q8_0",
        },
        "q5_k_s": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "token_embd.weight": "Q8_0",
        },
        "q5_k_m": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1:0 Q8_0:1",
            "ffn_down.weight": "Q5_1:0 Q8_0:1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "token_embd.weight": "Q8_0",
        },
        "q6_k": {
            "attn_k.weight": "Q8_0",
            "attn_output.weight": "Q8_0",
            "attn_q.weight": "Q8_0",
            "attn_v.weight": "Q8_0",
            "ffn_down.weight": "Q8_0",
            "ffn_gate.weight": "Q8_0",
            "ffn_up.weight": "Q8_0",
            "token_embd.weight": "Q8_0",
        },
        "iq4_nl": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "IQ4_NL",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "token_embd.weight": "Q8_0",
        },
        "iq4_xs": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "IQ4_NL",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "token_embd.weight": "Q8_0",
        },
    },
    "qwen2": {
        "q4_0": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q4_0",
        },
        "q4_1": {
            "attn_k.weight": "Q4_1",
            "attn_output.weight": "Q4_1",
            "attn_q.weight": "Q4_1",
            "attn_v.weight": "Q4_1",
            "ffn_down.weight": "Q4_1",
            "ffn_gate.weight": "Q4_1",
            "ffn_up.weight": "Q4_1",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q4_1",
        },
        "q5_0": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q5_0",
        },
        "q5_1": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q5_1",
        },
        "q2_k": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q4_0",
        },
        "q3_k_s": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q4_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q4_0",
            "ffn_down.weight": "Q4_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q4_0",
        },
        "q3_k_m": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q4_0",
        },
        "q3_k_l": {
            "attn_k.weight": "Q4_0",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q4_0",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q4_0",
            "ffn_up.weight": "Q4_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q4_0",
        },
        "q4_k_s": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_0",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q5_0",
        },
        "q4_k_m": {
            "attn_k.weight": "Q5_0",
            "attn_output.weight": "Q5_0",
            "attn_q.weight": "Q5_0",
            "attn_v.weight": "Q5_0:0 Q8_0:1",
            "ffn_down.weight": "Q5_0:0 Q8_0:1",
            "ffn_gate.weight": "Q5_0",
            "ffn_up.weight": "Q5_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q5_0",
        },
        "q5_k_s": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1",
            "ffn_down.weight": "Q5_1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q5_1",
        },
        "q5_k_m": {
            "attn_k.weight": "Q5_1",
            "attn_output.weight": "Q5_1",
            "attn_q.weight": "Q5_1",
            "attn_v.weight": "Q5_1:0 Q8_0:1",
            "ffn_down.weight": "Q5_1:0 Q8_0:1",
            "ffn_gate.weight": "Q5_1",
            "ffn_up.weight": "Q5_1",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q5_1",
        },
        "q6_k": {
            "attn_k.weight": "Q8_0",
            "attn_output.weight": "Q8_0",
            "attn_q.weight": "Q8_0",
            "attn_v.weight": "Q8_0",
            "ffn_down.weight": "Q8_0",
            "ffn_gate.weight": "Q8_0",
            "ffn_up.weight": "Q8_0",
            "output.weight": "Q8_0",
            "token_embd.weight": "Q8_0",
        },
        "iq4_nl": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "IQ4_NL",
            "ffn_down.weight": "IQ4_NL",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "output.weight": "Q8_0",
            "token_embd.weight": "IQ4_NL",
        },
        "iq4_xs": {
            "attn_k.weight": "IQ4_NL",
            "attn_output.weight": "IQ4_NL",
            "attn_q.weight": "IQ4_NL",
            "attn_v.weight": "IQ4_NL",
            "ffn_down.weight": "IQ4_NL",
            "ffn_gate.weight": "IQ4_NL",
            "ffn_up.weight": "IQ4_NL",
            "output.weight": "Q8_0",
            "token_embd.weight": "IQ4_NL",
        },
    },
}


def _layout(model: str) -> str:
    return "fixture" if model in FIXTURES else model


# --------------------------------------------------------------------------------------------
# Types: our plan against the golden tables (no llama_cpp needed) and against llama.cpp
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", FIXTURES + SYNTHETIC)
def test_plan_types_equal_the_golden_tables(model, model_dirs, capsys):
    for mix in MIXES:
        rows = _plan_types(model_dirs[model], mix, capsys)
        assert all(t == "F32" for _, shape, t in rows if sum(d > 1 for d in shape) < 2)
        assert compact(rows) == GOLDEN[_layout(model)][mix], mix


@pytest.mark.skipif(not has_llama_cpp(), reason="llama_cpp (llama-cpp-python) is not installed")
@pytest.mark.parametrize("model", FIXTURES + SYNTHETIC)
def test_types_names_and_bytes_equal_llama_quantize(model, model_dirs, f32_files, tmp_path, capsys):
    """For every mix: llama_model_quantize on our f32 file gives the same tensors and types as our
    plan, the same general.file_type, and the same bytes for every tensor whose type we encode."""
    f32 = gguf.GGUFReader(f32_files[model])
    f32_data = {t.name: np.asarray(t.data) for t in f32.tensors}
    unchecked: dict[str, int] = {}
    checked = 0
    for mix in MIXES:
        ref = llama_quantize(f32_files[model], tmp_path / f"{mix}.gguf", mix)
        ref_t = {t.name: t for t in ref.tensors}
        rows = _plan_types(model_dirs[model], mix, capsys)
        ours = {name: t for name, _, t in rows}
        assert sorted(ours) == sorted(ref_t), mix
        # llama-quantize writes in its loader's order: outside-layer tensors, then by layer and name
        llama_order = sorted(ours, key=lambda n: (int(_BLK.match(n).group(1)) if _BLK.match(n) else -1, n))
        assert [t.name for t in ref.tensors] == llama_order
        for name, t in ref_t.items():
            assert t.tensor_type.name == ours[name], (mix, name)
        assert ref.get_field("general.file_type").contents() == int(OUTPUT_TYPES[mix][1])
        assert compact([(n, [int(d) for d in reversed(t.shape)], t.tensor_type.name) for n, t in ref_t.items()]) \
            == GOLDEN[_layout(model)][mix], mix
        for name, t in ref_t.items():  # bytes, wherever a codec exists
            qtype = GT[ours[name]]
            if qtype not in CODECS:
                unchecked[qtype.name] = unchecked.get(qtype.name, 0) + 1
                continue
            x = f32_data[name].reshape(-1, int(t.shape[0])).astype(np.float32)
            ours_bytes = codec(qtype).quantize(x).reshape(-1)
            assert np.array_equal(ours_bytes, np.asarray(t.data).reshape(-1).view(np.uint8)), (mix, name)
            checked += 1
    if unchecked:
        pytest.skip(f"types and {checked} tensors' bytes equal llama.cpp's; bytes unchecked for "
                    f"{sum(unchecked.values())} tensors of types without a codec yet: {sorted(unchecked)}")


@pytest.mark.skipif(not has_llama_cpp(), reason="llama_cpp (llama-cpp-python) is not installed")
@pytest.mark.parametrize("mix", MIXES)
def test_cli_mix_file_equals_llama_quantize_byte_for_byte(mix, f32_files, tmp_path, capsys):
    """The whole --to gguf:MIX file of the fixture: every tensor's type and bytes as llama-quantize's
    (needs every codec the mix uses)."""
    ft = FILE_TYPES[mix]
    out = tmp_path / "ours.gguf"
    from convert.cli import main

    rc = main([str(FIXTURE), "--to", f"gguf:{ft.name}", "-o", str(out), "-q"])
    err = capsys.readouterr().err
    if rc == 2 and "GGUF-002" in err and "cannot encode" in err and not out.exists():
        found = re.search(r"found '([^']*)'", err)
        pytest.skip(f"{ft.name}: no codec yet for {found.group(1) if found else err.strip()}")
    assert rc == 0
    ref = {t.name: t for t in llama_quantize(f32_files["llama_nf4_dq"], tmp_path / "ref.gguf", mix).tensors}
    got = gguf.GGUFReader(out)
    assert sorted(t.name for t in got.tensors) == sorted(ref)
    for t in got.tensors:
        assert t.tensor_type == ref[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1),
                              np.asarray(ref[t.name].data).view(np.uint8).reshape(-1)), t.name
    assert got.get_field("general.file_type").contents() == int(ft.ftype)


@pytest.mark.skipif(not has_llama_cpp(), reason="llama_cpp (llama-cpp-python) is not installed")
def test_q4_k_m_loads_and_runs_in_llama_cpp(tmp_path):
    from convert.cli import main
    from formats.safetensors import SafetensorsReader
    from tests.helpers.gguf import REF, llama_logits

    missing = [t.name for t in (GT.Q4_K, GT.Q6_K) if t not in CODECS]
    if missing:
        pytest.skip(f"Q4_K_M needs the codecs of {missing} (not merged yet)")
    out = tmp_path / "m.gguf"
    assert main([str(FIXTURE), "--to", "gguf:Q4_K_M", "-o", str(out), "-q"]) == 0
    r = SafetensorsReader(REF / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    want = np.array(r.array("logits_dequantized"), dtype=np.float32).reshape(len(ids), -1)
    got = llama_logits(out, ids, want.shape[-1])
    assert np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95


# --------------------------------------------------------------------------------------------
# The mix function on synthetic tensor lists
# --------------------------------------------------------------------------------------------


def llama_tensors(layers: int, hidden: int, heads: int, kv_heads: int, ff: int, vocab: int,
                  tied: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensor list of a Llama, in our converter's order (rows first)."""
    hd = hidden // heads
    ts: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"blk.{i}."
        ts += [(p + "attn_norm.weight", (hidden,)), (p + "attn_q.weight", (heads * hd, hidden)),
               (p + "attn_k.weight", (kv_heads * hd, hidden)), (p + "attn_v.weight", (kv_heads * hd, hidden)),
               (p + "attn_output.weight", (hidden, heads * hd)), (p + "ffn_norm.weight", (hidden,)),
               (p + "ffn_gate.weight", (ff, hidden)), (p + "ffn_up.weight", (ff, hidden)),
               (p + "ffn_down.weight", (hidden, ff))]
    ts.append(("output_norm.weight", (hidden,)))
    if not tied:
        ts.append(("output.weight", (vocab, hidden)))
    return ts


def _mix_rows(mix: str, ts, model: MixModel) -> list[tuple[str, list[int], str]]:
    return [(n, list(s), c.ggml_type.name) for (n, s), c in zip(ts, mix_types(mix, ts, model), strict=True)]


@pytest.mark.parametrize("mix", MIXES)
def test_an_8b_llama_mix_equals_llama_cpp_on_a_small_file_of_the_same_layout(mix):
    """Llama 3 8B (32 layers, GQA 4, hidden 4096, ff 14336, vocab 128256): every row is a multiple
    of 256, so the types depend on names, layer count, GQA and experts only, and equal those
    llama.cpp gave the 32-layer GQA-4 file (golden ``llama32_gqa4``, rows of 256)."""
    ts = llama_tensors(32, 4096, 32, 8, 14336, 128256)
    got = compact(_mix_rows(mix, ts, MixModel("llama", 32, 32, 8)))
    assert got == GOLDEN["llama32_gqa4"][mix]


def test_q4_k_m_of_an_8b_llama_by_the_rules():
    """Derived from reading llama-quant.cpp (not from a file): Q4_K_M gives output.weight Q6_K, and
    attn_v and ffn_down Q6_K on the use_more_bits layers (first and last 4 of 32, every third
    between), Q4_K elsewhere."""
    ts = llama_tensors(32, 4096, 32, 8, 14336, 128256)
    types = {n: c.ggml_type for (n, _), c in zip(ts, mix_types("q4_k_m", ts, MixModel("llama", 32, 32, 8)),
                                                   strict=True)}
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for i in range(32):
        want = GT.Q6_K if i in more else GT.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == want and types[f"blk.{i}.ffn_down.weight"] == want
        assert types[f"blk.{i}.attn_q.weight"] == GT.Q4_K and types[f"blk.{i}.attn_norm.weight"] == GT.F32
    assert types["output.weight"] == GT.Q6_K and types["token_embd.weight"] == GT.Q4_K
    assert mix_summary(list(types.values())) == "193 Q4_K, 65 F32, 33 Q6_K"


def test_tied_embeddings_give_token_embd_the_output_rule():
    """No output.weight (Llama 3.2 1B: 16 layers, GQA 4, tied): token_embd gets output's Q6_K, as in
    llama.cpp (golden ``llama16_tied`` from a real file, and the Gemma there)."""
    ts = llama_tensors(16, 2048, 32, 8, 8192, 128256, tied=True)
    model = MixModel("llama", 16, 32, 8)
    for mix in MIXES:
        types = {n: c for (n, _), c in zip(ts, mix_types(mix, ts, model), strict=True)}
        assert types["token_embd.weight"].ggml_type == GT.Q6_K, mix
        assert "tied" in types["token_embd.weight"].reason
    untied = llama_tensors(16, 2048, 32, 8, 8192, 128256)
    types = dict(zip([n for n, _ in untied], mix_types("q4_0", untied, model), strict=True))
    assert types["token_embd.weight"].ggml_type == GT.Q4_0 and types["output.weight"].ggml_type == GT.Q6_K


def test_rules_on_gqa_experts_70b_and_fallbacks():
    """Derived from reading llama-quant.cpp: Q2_K's attn_v is Q4_K from GQA 4 on, Q3_K below; a
    70B Llama's attn_v never stays Q3_K/Q4_K; 8 experts put attn_v and attn_k at Q8_0; rows that
    are not a multiple of 256 fall back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K ->
    Q4_0) and to F16 when not a multiple of 32 either; output's row not a multiple of 256 -> Q8_0."""
    ts = llama_tensors(8, 256, 8, 2, 256, 1000)

    def t(mix, model, name, tensors=ts):
        return dict(zip([n for n, _ in tensors], mix_types(mix, tensors, model), strict=True))[name].ggml_type

    assert t("q2_k", MixModel("llama", 8, 8, 2), "blk.3.attn_v.weight") == GT.Q4_K
    assert t("q2_k", MixModel("llama", 8, 8, 4), "blk.3.attn_v.weight") == GT.Q3_K
    big = llama_tensors(80, 256, 64, 8, 256, 1000)
    assert MixModel("llama", 80, 64, 8).is_70b and not MixModel("llama", 80, 64, 64).is_70b
    assert t("q3_k_s", MixModel("llama", 80, 64, 8), "blk.40.attn_v.weight", big) == GT.Q5_K
    assert t("q3_k_s", MixModel("llama", 80, 64, 64), "blk.40.attn_v.weight", big) == GT.Q3_K
    assert t("q4_k_s", MixModel("llama", 8, 8, 2, n_expert=8), "blk.5.attn_v.weight") == GT.Q8_0
    assert t("q4_k_s", MixModel("llama", 8, 8, 2, n_expert=8), "blk.5.attn_k.weight") == GT.Q8_0
    assert t("q4_k_s", MixModel("llama", 8, 8, 2, n_expert=8), "blk.5.attn_output.weight") == GT.Q5_K
    odd = llama_tensors(4, 288, 4, 4, 320, 1000)  # rows of 288 and 320: multiples of 32, not 256
    m = MixModel("llama", 4, 4, 4)
    assert t("q4_k_m", m, "blk.1.attn_q.weight", odd) == GT.Q5_0
    assert t("q5_k_s", m, "blk.1.attn_q.weight", odd) == GT.Q5_1
    assert t("q2_k", m, "blk.1.attn_q.weight", odd) == GT.Q4_0
    assert t("q6_k", m, "blk.1.attn_q.weight", odd) == GT.Q8_0
    assert t("q4_k_m", m, "output.weight", odd) == GT.Q8_0
    tiny = llama_tensors(2, 40, 4, 4, 72, 1000)  # rows of 40 / 72: not multiples of 32
    ch = dict(zip([n for n, _ in tiny], mix_types("q4_k_m", tiny, MixModel("llama", 2, 4, 4)), strict=True))
    assert ch["blk.0.attn_q.weight"].ggml_type == GT.F16 and "F16" in ch["blk.0.attn_q.weight"].reason
    assert ch["output.weight"].ggml_type == GT.F16
    assert t("q4_0", m, "blk.0.attn_q.weight", tiny) == GT.F16


def test_llama_order_drives_the_attn_v_counter():
    """attn_v's use_more_bits counts attn_v tensors in llama.cpp's loader order (by layer number,
    not by name: blk.10 after blk.9), whatever order the list is given in."""
    ts = llama_tensors(12, 256, 8, 2, 256, 1000)
    m = MixModel("llama", 12, 8, 2)
    want = mix_types("q4_k_m", ts, m)
    rev = list(reversed(ts))
    got = list(reversed(mix_types("q4_k_m", rev, m)))
    assert got == want
    v = {n: c.ggml_type for (n, _), c in zip(ts, want, strict=True) if n.endswith("attn_v.weight")}
    assert [i for i in range(12) if v[f"blk.{i}.attn_v.weight"] == GT.Q6_K] == [
        i for i in range(12) if use_more_bits(i, 12)]


def test_file_type_names_any_case_and_help():
    from convert.options import Target, target_for, target_names

    assert parse_output_type("Q4_K_M") == parse_output_type("q4_k_m") == "q4_k_m"
    assert target_for("gguf:Q5_K_S").name == "gguf:q5_k_s" and target_for(" BF16").name == "bf16"
    assert target_for("gguf:Q6_K") == Target("gguf:q6_k", "gguf", "fp32", gguf_type="q6_k")
    assert target_for("gguf") == Target("gguf", "gguf", "auto", gguf_type="f16")
    assert target_for("gguf:Q8_0") == Target("gguf:q8_0", "gguf", "auto", gguf_type="q8_0")
    assert target_for("NF4") == Target("nf4", "bnb4", "auto", quant_type="nf4")
    assert all(f"gguf:{m}" in target_names() for m in MIXES)
    assert OUTPUT_TYPES["q4_k_m"] == (GT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    with pytest.raises(GgufTypeError):
        parse_output_type("iq2_s")


def test_summary_shows_the_type_mix_and_json_carries_types(tmp_path, capsys):
    """The summary's type mix line and reasons; --json carries every tensor's type and the counts
    (q5_1: Q6_K output.weight needs its codec, else the run stops with GGUF-002 before writing)."""
    from convert.cli import main

    out = tmp_path / "m.gguf"
    rc = main([str(FIXTURE), "--to", "gguf:Q5_1", "-o", str(out), "--json"])
    captured = capsys.readouterr()
    if GT.Q6_K not in CODECS:
        assert rc == 2 and "GGUF-002" in captured.err and "Q6_K" in captured.err and not out.exists()
        rc = main([str(FIXTURE), "--to", "gguf:Q5_1", "-o", str(out), "--dry-run", "--json"])
        plan = json.loads(capsys.readouterr().out)
        types = {t["name"]: t["type"] for t in plan["tensors"]}
        assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_down.weight"] == "Q5_1"
        pytest.skip("Q6_K has no codec yet: checked the refusal and the planned types")
    summary = json.loads(captured.out)
    g = summary["gguf"]
    assert g["type"] == "q5_1" and g["type_counts"] == {"Q6_K": 1, "Q5_1": 15, "F32": 5}
    assert {t["name"]: t["type"] for t in g["tensors"]}["output.weight"] == "Q6_K"
    assert any(n.startswith("gguf q5_1: 15 Q5_1, 5 F32, 1 Q6_K") for n in summary["notes"])


def test_any_case_reaches_the_library_and_the_default_name(capsys):
    """``gguf:Q4_K_M`` given to convert() (not only the CLI) is the q4_k_m mix, named in lower case."""
    from convert.cli import main
    from convert.job import convert
    from convert.options import ConvertOptions

    result = convert(ConvertOptions(src=str(FIXTURE), to="gguf:Q4_K_M", dry_run=True))
    assert result.to == "gguf:q4_k_m" and result.output.endswith("Llama_Nf4_Dq-2.0M-Q4_K_M.gguf")
    assert main([str(FIXTURE), "--to", "gguf:Q3_K_L", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "q3_k_l" in text and "attn_output: Q5_K" in text


def _header_only_gguf(path: Path, arch: str, layers: int, heads: int, kv: int, experts: int,
                      tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """A GGUF llama.cpp's quantizer accepts, with the hyperparameters asked for and tiny tensors:
    llama-quantize reads only the hyperparameters and the tensor names and row lengths, so every
    matrix is 2 rows of 256 (the rules see a row length that is a multiple of 256, as in a real model)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
    ts = [(n, (2, 256) if len(s) == 2 else (256,)) for n, s in llama_tensors(layers, 256, 8, 2, 256, 1000, tied)]
    for n, s in ts:
        w.add_tensor(n, np.full(s, 0.01, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ts


@pytest.mark.skipif(not has_llama_cpp(), reason="llama_cpp (llama-cpp-python) is not installed")
@pytest.mark.parametrize("arch,layers,heads,kv,experts,tied", [
    ("llama", 80, 64, 8, 0, False),   # a 70B Llama: attn_v never Q3_K/Q4_K
    ("llama", 80, 64, 64, 0, False),  # 80 layers without GQA: a 65B, not 70B
    ("llama", 8, 8, 2, 8, False),     # 8 experts: attn_v/attn_k Q8_0, attn_output Q5_K
    ("qwen2", 80, 64, 64, 0, False),  # any 80-layer Qwen2 is 70B
    ("llama", 32, 32, 8, 0, True),    # tied embeddings, 32 layers, GQA 4
])
def test_70b_experts_and_tied_rules_equal_llama_quantize(tmp_path, arch, layers, heads, kv, experts, tied):
    src = tmp_path / "in.gguf"
    ts = _header_only_gguf(src, arch, layers, heads, kv, experts, tied)
    model = MixModel(arch, layers, heads, kv, experts)
    for mix in MIXES:
        ref = {t.name: t.tensor_type.name for t in llama_quantize(src, tmp_path / f"{mix}.gguf", mix).tensors}
        ours = {n: c.ggml_type.name for (n, _), c in zip(ts, mix_types(mix, ts, model), strict=True)}
        assert ours == ref, mix


def test_encoder_processes_write_the_same_bytes_as_threads(tmp_path, monkeypatch, capsys):
    """K-quant chunks encoded in spawned worker processes (forced here on the small fixture) give the
    file byte for byte, and the same error report (to float32 rounding), as one thread encoding them; Q3_K_M mixes
    Q3_K/Q4_K/Q5_K/Q6_K, Q4_0 fallbacks and unquantized tensors."""
    from convert.cli import main
    from convert.gguf import encode as gguf_encode
    from convert.gguf import encoder_pool

    one = tmp_path / "one.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q3_k_m", "-o", str(one), "--threads", "1", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(gguf_encode, "PROCESS_MIN_ELEMENTS", 0)
    spawned: list[int] = []
    real = encoder_pool.ProcessPoolExecutor

    def counting(n, **kw):
        spawned.append(n)
        return real(n, **kw)

    monkeypatch.setattr(encoder_pool, "ProcessPoolExecutor", counting)
    two = tmp_path / "two.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q3_k_m", "-o", str(two), "--threads", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert spawned == [2]
    assert one.read_bytes() == two.read_bytes()
    for g, w in zip(got["gguf"]["tensors"], want["gguf"]["tensors"], strict=True):
        errors = ("max_abs_error", "rms_error", "rel_rms_error")
        assert {k: v for k, v in g.items() if k not in errors} == {k: v for k, v in w.items() if k not in errors}
        # the chunk size follows --threads: sums of squares per chunk may differ in the last float32 digits
        assert [g[k] for k in errors] == pytest.approx([w[k] for k in errors], rel=1e-5), g["name"]


def test_encoder_processes_only_for_big_search_work():
    from convert.gguf.encode import PROCESS_MIN_ELEMENTS, encoder_processes
    from convert.gguf.plan import GGUFTensor

    GT = gguf.GGMLQuantizationType

    def tensors(*types_numel):
        return [GGUFTensor(None, f"t{i}", (n,), ty, 0) for i, (ty, n) in enumerate(types_numel)]

    big = PROCESS_MIN_ELEMENTS
    assert encoder_processes(tensors((GT.Q4_K, big)), 2) == 2
    assert encoder_processes(tensors((GT.Q4_K, big)), 1) == 0          # one thread: no process
    assert encoder_processes(tensors((GT.Q4_K, big - 1)), 4) == 0      # too little search work
    assert encoder_processes(tensors((GT.Q8_0, 4 * big)), 4) == 0      # Q8_0 is a few passes: threads do
    assert encoder_processes(tensors((GT.Q6_K, big // 2), (GT.IQ4_NL, big // 2)), 3) == 3


#: llama-quantize's per-tensor options, as our command line and as llama_model_quantize's parameters.
PER_TENSOR = {
    "tensor-type": (["--tensor-type", "attn_v=q8_0", "--tensor-type", r"blk\.1\.ffn_.*=Q5_K"],
                    {"tensor_types": (("attn_v", "q8_0"), (r"blk\.1\.ffn_.*", "q5_k"))}),
    "first-rule-wins": (["--tensor-type", "ATTN=q5_0", "--tensor-type", "attn_q=q8_0"],
                        {"tensor_types": (("ATTN", "q5_0"), ("attn_q", "q8_0"))}),
    "output-and-embedding": (["--output-tensor-type", "q8_0", "--token-embedding-type", "Q4_K"],
                             {"output_tensor_type": "q8_0", "token_embedding_type": "q4_k"}),
    "pure": (["--pure"], {"pure": True}),
    "pure-with-rule": (["--pure", "--tensor-type", "ffn_down=q8_0"],
                       {"pure": True, "tensor_types": (("ffn_down", "q8_0"),)}),
    "leave-output-tensor": (["--leave-output-tensor"], {"leave_output_tensor": True}),
    "q2_k-l": (["--output-tensor-type", "q6_k", "--token-embedding-type", "q6_k"],  # unsloth's q2_k_l preset
               {"output_tensor_type": "q6_k", "token_embedding_type": "q6_k"}),
}


@pytest.mark.skipif(not has_llama_cpp(), reason="llama_cpp (llama-cpp-python) is not installed")
@pytest.mark.parametrize("case", sorted(PER_TENSOR))
@pytest.mark.parametrize(("model", "mix"), [("llama_nf4_dq", "q4_k_m"), ("llama_nf4_dq", "q3_k_m"),
                                            ("llama_nf4_dq", "q5_0"), ("llama16_tied", "q4_k_m"),
                                            ("gemma", "q5_k_s")])
def test_per_tensor_options_equal_llama_quantize(case, model, mix, model_dirs, f32_files, tmp_path, capsys):
    """Each of llama-quantize's per-tensor options, through our command line, against llama_model_quantize
    with the same parameters on our f32 file: every tensor's type and bytes, and general.file_type (tied
    embeddings too: there --output-tensor-type also names token_embd's type, unless
    --token-embedding-type does)."""
    from convert.cli import main

    argv, params = PER_TENSOR[case]
    out = tmp_path / "ours.gguf"
    rc = main([str(model_dirs[model]), "--to", f"gguf:{mix}", "-o", str(out), "-q", *argv])
    if model == "gemma" and params.get("token_embedding_type") in ("q4_k", "q6_k"):
        # token_embd rows of 64: a K-quant given as is cannot hold them (llama-quantize aborts)
        assert rc == 2 and not out.exists()
        assert ("GGUF-002 --token-embedding-type q" in capsys.readouterr().err)
        return
    assert rc == 0
    ref = {t.name: t for t in llama_quantize(f32_files[model], tmp_path / "ref.gguf", mix, **params).tensors}
    got = gguf.GGUFReader(out)
    assert sorted(t.name for t in got.tensors) == sorted(ref)
    for t in got.tensors:
        assert t.tensor_type == ref[t.name].tensor_type, (t.name, t.tensor_type.name, ref[t.name].tensor_type.name)
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1),
                              np.asarray(ref[t.name].data).view(np.uint8).reshape(-1)), t.name
    assert got.get_field("general.file_type").contents() == int(FILE_TYPES[mix].ftype)


def test_per_tensor_options_are_refused_without_a_llama_quantize_type(tmp_path, capsys):
    from convert.cli import main

    for to, argv in (("gguf:q8_0", ["--pure"]), ("bf16", ["--tensor-type", "attn_v=q8_0"]),
                     ("gguf:f16", ["--output-tensor-type", "q8_0"])):
        assert main([str(FIXTURE), "--to", to, "-o", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err
        assert f"USE-001 {argv[0]} needs --to gguf:TYPE of a llama-quantize type" in err and "\n" == err[-1]
        assert not (tmp_path / "x").exists()
    for argv, part in ((["--tensor-type", "attn_v"], "USE-001 --tensor-type must be PATTERN=TYPE"),
                       (["--tensor-type", "=q8_0"], "USE-001 --tensor-type must be PATTERN=TYPE"),
                       (["--tensor-type", "attn_(v=q8_0"], "USE-001 --tensor-type pattern is not a regular expression"),
                       (["--output-tensor-type", "q4k"], "GGUF-002 --output-tensor-type: not a GGML type (did you "
                                                         "mean q4_k?)"),
                       (["--tensor-type", "attn_v=iq3_s"], "GGUF-002 GGUF type q4_k_m needs IQ3_S, which this "
                                                           "build cannot encode"),
                       # (llama-quantize asks for an importance matrix first: tensor_requires_imatrix)
                       (["--tensor-type", "attn_v=iq2_xs"], "IMX-004 gguf:q4_k_m IQ2_XS needs an importance matrix")):
        assert main([str(FIXTURE), "--to", "gguf:q4_k_m", "-o", str(tmp_path / "y.gguf"), *argv]) == 2
        assert part in capsys.readouterr().err, argv
        assert not (tmp_path / "y.gguf").exists()

"""GGUF LoRA adapters (``convert-bnb ADAPTER --to gguf[:TYPE] --base MODEL``, convert/gguf/adapter.py): byte for
byte against llama.cpp's own ``convert_lora_to_gguf.py`` (run here with torch, where it and torch are installed),
loaded by llama.cpp onto our GGUF base with logits equal to our merged model's within the type's error, and PEFT's
scale where the converter gets it wrong (rsLoRA, rank/alpha patterns); what a GGUF adapter cannot hold is refused.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

from convert.cli import main
from convert.gguf.adapter import gguf_scales
from convert.gguf.arch import permutation
from convert.job import convert
from convert.options import ConvertOptions
from formats.errors import (
    AdapterError,
    GgufAdapterError,
    GgufTypeError,
    LoraShapeError,
    NonFiniteAdapterError,
    OutputExistsError,
    UnmappedTensorError,
    UsageError,
)
from formats.peft import open_adapter
from tests.helpers.fixtures import FIXTURES, MODELS
from tests.helpers.gguf import llama_logits
from tests.helpers.llama_tools import llama_script
from tests.lora.test_lora import P, write_safetensors

ADAPTER = FIXTURES / "lora" / "adapter"
BASE = MODELS / "llama_orig_bf16"  # its config.json is all a GGUF adapter reads
QUANT = MODELS / "llama_nf4_dq"  # the bnb checkpoint our GGUF base and merged models are made from
BF = np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------------------ helpers


#: Runs convert_lora_to_gguf.py once per argv in one interpreter (torch and transformers imported once).
_DRIVER = """
import json, os, runpy, sys
argvs = json.loads(sys.argv[1])
sys.path[0] = os.path.dirname(argvs[0][0])  # as when the script is run itself
for argv in argvs:
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
"""


def theirs_all(jobs: dict[str, tuple[Path, Path, str]], out_dir: Path) -> dict[str, Path]:
    """llama.cpp's convert_lora_to_gguf.py (the pinned revision) on each ``name: (adapter, base, outtype)`` with
    ``--base``, into ``out_dir/name.gguf``; skips without the script, torch or transformers."""
    script = llama_script("convert_lora_to_gguf.py")
    for module in ("torch", "transformers"):
        pytest.importorskip(module)
    outs = {name: out_dir / f"{name}.gguf" for name in jobs}
    argvs = [[str(script), str(a), "--base", str(b), "--outtype", t, "--outfile", str(outs[name])]
             for name, (a, b, t) in jobs.items()]
    run = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return outs


def ours(adapter: Path, base: Path | None, to: str, out: Path, *extra: str) -> Path:
    argv = [str(adapter), "--to", to, "-o", str(out), "-q", *extra]
    assert main(argv + (["--base", str(base)] if base is not None else [])) == 0
    return out


def fields(path: Path) -> dict[str, object]:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}


def tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    return {t.name: (t.tensor_type.name, [int(d) for d in t.shape], np.asarray(t.data).tobytes())
            for t in gguf.GGUFReader(path).tensors}


def assert_same_file(got: Path, want: Path) -> None:
    """Key by key, tensor by tensor (names, order, types, shapes, bytes), then every byte of the file."""
    assert fields(got) == fields(want)
    g, w = tensors(got), tensors(want)
    assert list(g) == list(w)
    for name in w:
        assert g[name] == w[name], name
    assert got.read_bytes() == want.read_bytes()


def values(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32, rows first (dequantized for Q8_0)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = [int(d) for d in reversed(t.shape)]
        out[t.name] = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
    return out


def alpha_of(path: Path) -> float:
    return float(fields(path)["adapter.lora.alpha"])


def fixture_tensors() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return dict(load_file(str(ADAPTER / "adapter_model.safetensors")))


def fixture_config(**changes: object) -> dict:
    cfg = json.loads((ADAPTER / "adapter_config.json").read_text())
    cfg.update(changes)
    return cfg


def make_adapter(d: Path, config: dict, tensors_: dict[str, np.ndarray], card: bool = True) -> Path:
    """An adapter directory: config (as given, complete), weights, and the fixture's model card."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(d / "adapter_model.safetensors", tensors_)
    if card:
        shutil.copy(ADAPTER / "README.md", d / "README.md")
    return d


def v_rank4(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fixture adapter with the v_proj modules cut to rank 4 (a rank_pattern adapter)."""
    out = dict(t)
    for key in [k for k in t if ".v_proj." in k]:
        a = t[key]
        out[key] = np.ascontiguousarray(a[:4] if ".lora_A." in key else a[:, :4])
    return out


# ------------------------------------------------------------------------------------------ the converter's bytes


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_fixture_adapter_is_the_converters_file(tmp_path: Path, upstream: dict[str, Path], outtype: str) -> None:
    """The fixture adapter (PEFT 0.21, r 8, q/v of both layers) against convert_lora_to_gguf.py: every byte
    (q8_0: lora_a Q8_0, lora_b F16 since its rows of 8 are no whole block)."""
    got = ours(ADAPTER, BASE, f"gguf:{outtype}", tmp_path / "ours.gguf")
    assert_same_file(got, upstream[f"fixture-{outtype}"])
    if outtype == "q8_0":
        types = {n: t for n, (t, _, _) in tensors(got).items()}
        assert {types[n] for n in types if n.endswith("lora_a")} == {"Q8_0"}
        assert {types[n] for n in types if n.endswith("lora_b")} == {"F16"}


def tiny_base(root: Path, layers: int = 12, tied: bool = False) -> Path:
    """A Llama base as config.json alone (no weights: the converter and we read nothing else)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 96,
           "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


LINEAR = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
          "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
          "mlp.down_proj": (64, 96)}


def wide_adapter(rng: np.random.Generator, layers: int = 12) -> tuple[dict, dict[str, np.ndarray]]:
    """Every Linear of every layer, lm_head and the embedding (lora_embedding_A/B), bf16 (k_proj's lora_B f32:
    the converter widens both of a pair then), rank 8 and rank 32 for the MLP (rank_pattern); layers past 9 sort
    before layer 2 by name, not by data offset."""
    t: dict[str, np.ndarray] = {}

    def pair(module: str, out: int, inp: int, r: int, b_dtype: np.dtype = BF) -> None:
        t[f"{P}{module}.lora_A.weight"] = (rng.standard_normal((r, inp)) * 0.05).astype(BF)
        t[f"{P}{module}.lora_B.weight"] = (rng.standard_normal((out, r)) * 0.05).astype(b_dtype)

    for i in range(layers):
        for m, (out, inp) in LINEAR.items():
            pair(f"model.layers.{i}.{m}", out, inp, 32 if m.startswith("mlp") else 8,
                 np.dtype(np.float32) if m.endswith("k_proj") else BF)
    pair("lm_head", 96, 64, 8)
    t[f"{P}model.embed_tokens.lora_embedding_A"] = (rng.standard_normal((8, 96)) * 0.05).astype(BF)
    t[f"{P}model.embed_tokens.lora_embedding_B"] = (rng.standard_normal((64, 8)) * 0.05).astype(BF)
    cfg = fixture_config(target_modules=[m.split(".")[1] for m in LINEAR] + ["lm_head", "embed_tokens"],
                         rank_pattern={"mlp\\..*_proj": 32}, lora_alpha=32, base_model_name_or_path="tiny-llama")
    return cfg, t


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_every_layout_is_the_converters(tmp_path: Path, inputs: dict[str, tuple[Path, Path]],
                                        upstream: dict[str, Path], outtype: str) -> None:
    """All of a Llama's LoRA targets (q/k permuted in lora_b, the embedding's lora_a transposed, lm_head), 12
    layers, mixed ranks and dtypes: the converter's file, byte for byte."""
    got = ours(*inputs["wide"], f"gguf:{outtype}", tmp_path / "ours.gguf")
    assert_same_file(got, upstream[f"wide-{outtype}"])
    names = list(tensors(got))
    assert names[:4] == ["blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "blk.0.attn_k.weight.lora_a",
                         "blk.0.attn_k.weight.lora_b"]
    assert "token_embd.weight.lora_a" in names and "output.weight.lora_b" in names


def test_the_layouts_are_what_llama_cpp_reads(tmp_path: Path) -> None:
    """Independently of the converter: lora_a is A [r, in], lora_b is B [out, r] (q/k rows in LlamaModel.permute's
    order), the embedding's lora_a is A transposed [vocab, r]; f32 keeps every value."""
    base = tiny_base(tmp_path / "tiny-llama", layers=2)
    cfg, t = wide_adapter(np.random.default_rng(8), layers=2)
    got = values(ours(make_adapter(tmp_path / "a", cfg, t), base, "gguf:f32", tmp_path / "o.gguf"))
    f = {k: v.astype(np.float32) for k, v in t.items()}
    q = f"{P}model.layers.1.self_attn.q_proj"
    k = f"{P}model.layers.1.self_attn.k_proj"
    np.testing.assert_array_equal(got["blk.1.attn_q.weight.lora_a"], f[f"{q}.lora_A.weight"])
    np.testing.assert_array_equal(got["blk.1.attn_q.weight.lora_b"], f[f"{q}.lora_B.weight"][permutation(64, 4)])
    np.testing.assert_array_equal(got["blk.1.attn_k.weight.lora_b"], f[f"{k}.lora_B.weight"][permutation(32, 2)])
    np.testing.assert_array_equal(got["blk.1.attn_v.weight.lora_b"],
                                  f[f"{P}model.layers.1.self_attn.v_proj.lora_B.weight"])
    np.testing.assert_array_equal(got["token_embd.weight.lora_a"], f[f"{P}model.embed_tokens.lora_embedding_A"].T)
    np.testing.assert_array_equal(got["token_embd.weight.lora_b"], f[f"{P}model.embed_tokens.lora_embedding_B"])
    np.testing.assert_array_equal(got["output.weight.lora_a"], f[f"{P}lm_head.lora_A.weight"])


def test_a_pickled_adapter_keeps_its_stored_order(tmp_path: Path, inputs: dict[str, tuple[Path, Path]],
                                                  upstream: dict[str, Path]) -> None:
    """adapter_model.bin (torch.save, read without torch): tensors in the pickle's order, as torch.load gives them
    to the converter; the same bytes as the converter's."""
    if "pickled" not in inputs:
        pytest.skip("torch is needed to write the pickle")
    got = ours(*inputs["pickled"], "gguf:f16", tmp_path / "ours.gguf")
    assert list(tensors(got))[0] == "token_embd.weight.lora_a"
    assert_same_file(got, upstream["pickled-f16"])


def pickled_adapter(d: Path) -> Path:
    """The wide adapter as adapter_model.bin, the embedding first and lm_head last (not the name order)."""
    import torch

    cfg, t = wide_adapter(np.random.default_rng(9))
    order = sorted(t, key=lambda k: ("lm_head" in k, "embed" not in k, k.replace("layers.1", "layers.Z")))
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    torch.save({k: torch.from_numpy(t[k].astype(np.float32)).to(torch.bfloat16 if t[k].dtype == BF else
                                                                   torch.float32) for k in order},
               d / "adapter_model.bin")
    return d


#: The adapters of the llama.cpp loading test: adapter config changes, and whether v_proj has rank 4 ("embedding":
#: the fixture's pairs plus the embedding's and lm_head's, whose alpha the converter gets right).
ADAPTERS = {
    "plain": ({}, False),
    "embedding": ({"target_modules": ["q_proj", "v_proj", "embed_tokens", "lm_head"]}, False),
    "rslora": ({"use_rslora": True}, False),
    "rslora-rank-pattern": ({"use_rslora": True, "rank_pattern": {"v_proj": 4}}, True),
    "alpha-pattern": ({"alpha_pattern": {"v_proj": 64}}, False),
}


def embedding_pairs() -> dict[str, np.ndarray]:
    """lora_embedding_A/B and lm_head's pair for the fixture Llama (vocab 1000, hidden 256, untied), rank 8."""
    rng = np.random.default_rng(11)

    def m(*shape: int, std: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return {f"{P}model.embed_tokens.lora_embedding_A": m(8, 1000), f"{P}model.embed_tokens.lora_embedding_B": m(256, 8),
            f"{P}lm_head.lora_A.weight": m(8, 256), f"{P}lm_head.lora_B.weight": m(1000, 8)}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (adapter, base) of every adapter compared with the converter or loaded by llama.cpp."""
    d = tmp_path_factory.mktemp("inputs")
    base = tiny_base(d / "tiny-llama")
    cfg, t = wide_adapter(np.random.default_rng(7))
    out = {"fixture": (ADAPTER, BASE), "wide": (make_adapter(d / "my-adapter", cfg, t), base)}
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        out["pickled"] = (pickled_adapter(d / "bin-adapter"), base)
    t = fixture_tensors()
    for kind, (changes, rank4) in ADAPTERS.items():
        tk = v_rank4(t) if rank4 else {**t, **embedding_pairs()} if kind == "embedding" else t
        out[kind] = (make_adapter(d / kind / "adapter", fixture_config(**changes), tk), BASE)
    return out


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory, inputs: dict[str, tuple[Path, Path]]) -> dict[str, Path]:
    """convert_lora_to_gguf.py's files of :func:`inputs`, by ``name-outtype`` (one interpreter for all)."""
    jobs = {f"fixture-{t}": (*inputs["fixture"], t) for t in ("f32", "f16", "bf16", "q8_0")}
    jobs |= {f"wide-{t}": (*inputs["wide"], t) for t in ("bf16", "q8_0")}
    jobs |= {f"{k}-f32": (*inputs[k], "f32") for k in ADAPTERS}
    if "pickled" in inputs:
        jobs["pickled-f16"] = (*inputs["pickled"], "f16")
    return theirs_all(jobs, tmp_path_factory.mktemp("upstream"))


# ------------------------------------------------------------------------------------------ scales


def test_scales_follow_peft_and_llama_cpp(tmp_path: Path) -> None:
    """gguf_scales: one alpha when every module's alpha * (sqrt) r is the same float32 value, else the default
    module's with the ratio of each other module's in its lora_b; llama.cpp's alpha / r times it is PEFT's scale."""
    t = fixture_tensors()
    ranks = {f"model.layers.{i}.self_attn.{m}": 8 for i in (0, 1) for m in ("q_proj", "v_proj")}

    def scales(**cfg: object) -> tuple[float, dict[str, float]]:
        d = make_adapter(tmp_path / f"a{len(list(tmp_path.iterdir()))}", fixture_config(**cfg),
                         v_rank4(t) if cfg.get("rank_pattern") else t)
        with open_adapter(d) as ad:
            rk = {m: (4 if "v_proj" in m and cfg.get("rank_pattern") else 8) for m in ranks}
            alpha, factors = gguf_scales(ad, rk)
            for m, r in rk.items():  # what llama.cpp applies is PEFT's scale
                assert float(np.float32(alpha) / np.float32(r)) * factors.get(m, 1.0) == pytest.approx(
                    ad.config.scale_for(m), rel=1e-6)
            return alpha, factors

    assert scales() == (16.0, {})
    assert scales(use_rslora=True) == (float(np.float32(16 * math.sqrt(8))), {})
    assert scales(rank_pattern={"v_proj": 4}) == (16.0, {})  # llama.cpp divides by each tensor's own rank
    alpha, factors = scales(use_rslora=True, rank_pattern={"v_proj": 4})
    assert alpha == float(np.float32(16 * math.sqrt(8)))
    assert factors == {m: 16 * math.sqrt(4) / alpha for m in ranks if "v_proj" in m}
    assert scales(alpha_pattern={"layers\\.1\\.self_attn\\.q_proj": 64}) == (
        16.0, {"model.layers.1.self_attn.q_proj": 4.0})
    assert scales(lora_alpha=0) == (1.0, {m: 0.0 for m in ranks})  # llama.cpp reads alpha 0 as "no scaling"


def test_rslora_and_patterns_fold_exactly_what_the_docstring_says(tmp_path: Path) -> None:
    """rsLoRA with a rank_pattern: adapter.lora.alpha = float32(16 * sqrt(8)); v_proj's lora_b = float32(float64(B)
    * (16 * sqrt(4) / alpha)); every other tensor as the plain adapter's."""
    t = v_rank4(fixture_tensors())
    d = make_adapter(tmp_path / "rs", fixture_config(use_rslora=True, rank_pattern={"v_proj": 4}), t)
    got = ours(d, BASE, "gguf:f32", tmp_path / "rs.gguf")
    alpha = float(np.float32(16 * math.sqrt(8)))
    assert alpha_of(got) == alpha
    v = values(got)
    for i in (0, 1):
        b = t[f"{P}model.layers.{i}.self_attn.v_proj.lora_B.weight"]
        want = (b.astype(np.float64) * (16 * math.sqrt(4) / alpha)).astype(np.float32)
        np.testing.assert_array_equal(v[f"blk.{i}.attn_v.weight.lora_b"], want)
        q = t[f"{P}model.layers.{i}.self_attn.q_proj.lora_B.weight"]
        np.testing.assert_array_equal(v[f"blk.{i}.attn_q.weight.lora_b"], q[permutation(256, 4)])
    plan = convert(ConvertOptions(str(d), to="gguf:f32", base=str(BASE), dry_run=True))
    assert plan.dry_run["adapter"]["alpha"] == alpha
    assert any("lora_b carries the ratio" in n for n in plan.dry_run["notes"])


# ------------------------------------------------------------------------------------------ llama.cpp loads it


#: A GGUF adapter's logits against the merged model's: at most this share of the adapter's own effect on the
#: logits (max |merged - base|); measured on the fixture: f32 2.0e-5, f16 1.1e-3, bf16 3.4e-3, q8_0 1.1e-2.
LOGIT_TOL = {"f32": 2e-4, "f16": 4e-3, "bf16": 1.5e-2, "q8_0": 4e-2}


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], np.ndarray]:
    """Our GGUF (F32) of the bnb fixture, the fixture's input ids and llama.cpp's logits of the base alone."""
    pytest.importorskip("llama_cpp")
    from safetensors.numpy import load_file

    d = tmp_path_factory.mktemp("llama-base")
    base = d / "base.gguf"
    assert main([str(QUANT), "--to", "gguf:f32", "-o", str(base), "-q"]) == 0
    ids = [int(x) for x in load_file(str(FIXTURES / "lora" / "merged_reference" / "logits.safetensors"))[
        "input_ids"].reshape(-1)]
    return base, ids, llama_logits(base, ids, 1000)


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_llama_cpp_applies_the_adapter_as_the_merge(tmp_path: Path, request: pytest.FixtureRequest, llama_base,
                                                    inputs: dict[str, tuple[Path, Path]], kind: str) -> None:
    """llama.cpp loads our GGUF adapter onto our GGUF base (llama_adapter_lora_init + llama_set_adapters_lora) and
    its logits are our merged model's (--merge-lora, PEFT's merge) within the type's error, for every type; where
    the converter's alpha is wrong (rsLoRA, patterns), its file is off by far more."""
    base, ids, base_logits = llama_base
    adapter, _ = inputs[kind]
    merged = tmp_path / "merged.gguf"
    assert main([str(QUANT), "--to", "gguf:f32", "--merge-lora", str(adapter), "-o", str(merged), "-q"]) == 0
    want = llama_logits(merged, ids, 1000)
    effect = float(np.abs(want - base_logits).max())
    assert effect > 0.3  # the adapter changes the model
    for outtype, tol in LOGIT_TOL.items():
        lora = ours(adapter, BASE, f"gguf:{outtype}", tmp_path / f"ours-{outtype}.gguf")
        off = float(np.abs(llama_logits(base, ids, 1000, lora) - want).max())
        assert off <= tol * effect, (outtype, off, effect)
    try:
        upstream = request.getfixturevalue("upstream")[f"{kind}-f32"]
    except pytest.skip.Exception:
        return  # (no converter here: our side is checked)
    if kind in ("plain", "embedding"):  # the converter's alpha is right: its file is ours
        assert upstream.read_bytes() == ours(adapter, BASE, "gguf:f32", tmp_path / "again.gguf").read_bytes()
        return
    off = float(np.abs(llama_logits(base, ids, 1000, upstream) - want).max())
    assert off > 20 * LOGIT_TOL["f32"] * effect and off > 0.05 * effect, off


# ------------------------------------------------------------------------------------------ the output


def test_default_name_dry_run_and_an_existing_output(tmp_path: Path) -> None:
    """Named by llama.cpp's convention with the LoRA kind, beside the adapter directory (never inside it);
    --dry-run writes nothing; an existing output is refused without --overwrite."""
    adapter = tmp_path / "adapter"
    shutil.copytree(ADAPTER, adapter)
    plan = convert(ConvertOptions(str(adapter), to="gguf:q8_0", base=str(BASE), dry_run=True))
    assert plan.output == str(tmp_path / "Adapter-Q8_0-LoRA.gguf")
    assert [t["name"] for t in plan.dry_run["tensors"]][:2] == ["blk.0.attn_q.weight.lora_a",
                                                               "blk.0.attn_q.weight.lora_b"]
    assert "GGUF LoRA adapter for llama" in plan.plan_text
    alpha = json.loads((ADAPTER / "adapter_config.json").read_text())["lora_alpha"]
    assert plan.plan_text.splitlines()[1] == f"  adapter.lora.alpha = {alpha:g}"  # (docs/lora.md: the dry run says it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    before = sorted(p.name for p in adapter.iterdir())
    result = convert(ConvertOptions(str(adapter), to="gguf", base=str(BASE)))
    out = tmp_path / "Adapter-F16-LoRA.gguf"
    assert result.output == str(out) and out.is_file() and result.verified
    assert sorted(p.name for p in adapter.iterdir()) == before
    assert fields(out)["general.type"] == "adapter" and fields(out)["adapter.type"] == "lora"
    with pytest.raises(OutputExistsError):
        convert(ConvertOptions(str(adapter), to="gguf", base=str(BASE)))
    convert(ConvertOptions(str(adapter), to="gguf", base=str(BASE), overwrite=True))


def test_error_notes_name_the_adapters_weights(tmp_path: Path) -> None:
    """An adapter's F16 differs from its own weights, not from a dequantized weight; its F32 equals them."""
    f16 = convert(ConvertOptions(str(ADAPTER), to="gguf", base=str(BASE), output=tmp_path / "a.gguf"))
    assert any(n.startswith("gguf f16: 8 of 8 tensors differ from the adapter's weights (rounding to each tensor's "
                            "type)") for n in f16.notes), f16.notes
    f32 = convert(ConvertOptions(str(ADAPTER), to="gguf:f32", base=str(BASE), output=tmp_path / "b.gguf"))
    assert "gguf f32: every tensor equals the adapter's weights exactly" in f32.notes
    model = convert(ConvertOptions(str(QUANT), to="gguf:f32", output=tmp_path / "m.gguf"))
    assert "gguf f32: every tensor equals the dequantized weights exactly" in model.notes


def test_the_base_comes_from_the_adapter_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --base: base_model_name_or_path, as a path from the working directory (the fixture's, relative)."""
    monkeypatch.chdir(FIXTURES / "lora")  # where the fixture's ../models/llama_orig_bf16 was written from
    result = convert(ConvertOptions(str(ADAPTER), to="gguf:f32", output=tmp_path / "a.gguf"))
    assert any(f"base model: {BASE.resolve()}" in n for n in result.notes)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="neither a local directory nor a Hub repo id"):
        convert(ConvertOptions(str(ADAPTER), to="gguf:f32", output=tmp_path / "b.gguf"))


def test_a_hub_base_gives_its_config_alone(tmp_path: Path) -> None:
    """base_model_name_or_path org/name: only config.json is fetched (online, from a local fake Hub), and read
    offline from the cache afterwards; the weights are never downloaded."""
    from tests.helpers.fakehub import FakeHub
    from tests.helpers.hubcache import commit_sha, offline_env, run_cli

    hub = FakeHub()
    hub.add("org/base", commit_sha("base"), {p.name: p for p in QUANT.iterdir() if p.is_file()})
    url = hub.start()
    try:
        env = offline_env(tmp_path, tmp_path / "hub")
        del env["HF_HUB_OFFLINE"]
        env.update(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
        adapter = make_adapter(tmp_path / "adapter", fixture_config(base_model_name_or_path="org/base"),
                               fixture_tensors())
        r = run_cli([str(adapter), "--to", "gguf:f32", "-o", str(tmp_path / "a.gguf"), "--json"], env)
        assert r.returncode == 0, r.stderr
        assert hub.full_downloads == ["org/base/config.json"]
        assert f"base model: org/base@{commit_sha('base')} (config.json alone)" in json.loads(r.stdout)["notes"]
        r = run_cli([str(adapter), "--to", "gguf:f32", "-o", str(tmp_path / "b.gguf")], dict(env, HF_HUB_OFFLINE="1"))
        assert r.returncode == 0, r.stderr
    finally:
        hub.stop()
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert (tmp_path / "a.gguf").read_bytes() == ours(ADAPTER, BASE, "gguf:f32", tmp_path / "c.gguf").read_bytes()


def test_an_unreachable_hub_base_says_why(tmp_path: Path) -> None:
    """HUB-001's hint says what is true: offline mode when HF_HUB_OFFLINE is set, a failed connection when it is
    not (huggingface_hub then looks in the cache alone, with the same LocalEntryNotFoundError)."""
    import socket

    from tests.helpers.hubcache import offline_env, run_cli

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(ADAPTER), "--to", "gguf", "--base", "org/nonexist", "-o", str(tmp_path / "n.gguf")]
    env = offline_env(tmp_path, tmp_path / "hub")
    r = run_cli(argv, env)
    assert r.returncode == 2 and "HUB-001 cannot fetch Hub repo 'org/nonexist'" in r.stderr
    assert "Hint: HF_HUB_OFFLINE is set and the repo/revision is not in the cache" in r.stderr
    del env["HF_HUB_OFFLINE"]
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    r = run_cli(argv, env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "HUB-001 cannot fetch Hub repo 'org/nonexist'" in r.stderr and "Connection refused" in r.stderr
    assert "Hint: the Hub could not be reached (the connection failed) and the repo/revision is not in the cache" \
        in r.stderr
    assert "HF_HUB_OFFLINE" not in r.stderr
    assert not (tmp_path / "n.gguf").exists()


# ------------------------------------------------------------------------------------------ a Hub adapter as SRC

HUB_ADAPTER = "org/my-qlora-adapter"
#: What the adapter repo holds besides the fixture's three files, never fetched: a tokenizer and PEFT's training
#: leftovers.
HUB_EXTRAS = {"tokenizer.json": b'{"version": "1.0"}', "training_args.bin": b"\x80\x04N."}


@pytest.fixture
def adapter_hub(tmp_path: Path):
    """A fake Hub with the fixture adapter as ``org/my-qlora-adapter`` (branches main and v2) and the fixture base as
    ``org/base``; yields (hub, env for the CLI online, the working directory)."""
    from tests.helpers.fakehub import FakeHub
    from tests.helpers.hubcache import commit_sha, offline_env

    hub = FakeHub()
    hub.add(HUB_ADAPTER, commit_sha("adapter"), {**{p.name: p for p in ADAPTER.iterdir()}, **HUB_EXTRAS},
            refs=("main", "v2"))
    hub.add("org/base", commit_sha("base"), {p.name: p for p in BASE.iterdir() if p.is_file()})
    url = hub.start()
    env = offline_env(tmp_path, tmp_path / "hub")
    del env["HF_HUB_OFFLINE"]
    env.update(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_TOKEN="hf_fake_token_for_the_local_server",
               HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
    work = tmp_path / "work"
    work.mkdir()
    try:
        yield hub, env, work
    finally:
        hub.stop()


def test_a_hub_adapter_is_converted_as_its_folder(tmp_path: Path, adapter_hub) -> None:
    """``org/name`` holding adapter_config.json is an adapter: a dry run fetches its config and card alone (the
    weights' header read in place), the conversion its weights too (never the tokenizer or other files), into the
    HF cache; the GGUF is the local folder's byte for byte but general.name, the repo id as for a Hub model (the
    local folder given that name by --metadata: every byte equal); named as a Hub model's GGUF is, in the working
    directory; offline, the cached snapshot gives the same bytes."""
    from tests.helpers.hubcache import commit_sha, run_cli

    hub, env, work = adapter_hub
    commit = commit_sha("adapter")
    r = run_cli([HUB_ADAPTER, "--to", "gguf:q8_0", "--base", "org/base", "--dry-run", "--json"], env, cwd=work)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["output"] == str(work / "org-my-qlora-adapter-Q8_0-LoRA.gguf") and not plan["output_exists"]
    assert plan["adapter"]["base"] == f"org/base@{commit_sha('base')}"
    assert sorted(hub.full_downloads) == ["org/base/config.json", f"{HUB_ADAPTER}/README.md",
                                          f"{HUB_ADAPTER}/adapter_config.json"]
    assert list(work.iterdir()) == []
    r = run_cli([HUB_ADAPTER, "--to", "gguf:q8_0", "--base", "org/base", "--json"], env, cwd=work)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    out = work / "org-my-qlora-adapter-Q8_0-LoRA.gguf"
    assert (res["source"], res["commit"], res["output"]) == (f"{HUB_ADAPTER}@{commit}", commit, str(out))
    assert res["verified"] and [p.name for p in work.iterdir()] == [out.name]
    assert f"source: Hub repo {HUB_ADAPTER}@{commit} ({(ADAPTER / 'adapter_model.safetensors').stat().st_size} " \
           "bytes downloaded)" in res["notes"]
    assert sorted(set(hub.full_downloads)) == ["org/base/config.json"] + [
        f"{HUB_ADAPTER}/{n}" for n in ("README.md", "adapter_config.json", "adapter_model.safetensors")]
    snap = tmp_path / "hub" / "models--org--my-qlora-adapter" / "snapshots" / commit
    assert sorted(p.name for p in snap.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    # the local folder of the same name: the same file but general.name; with that name given, every byte
    local = tmp_path / "my-qlora-adapter"
    shutil.copytree(ADAPTER, local)
    plain = ours(local, BASE, "gguf:q8_0", tmp_path / "plain.gguf")
    assert fields(out) == {**fields(plain), "general.name": HUB_ADAPTER} and fields(plain)["general.name"] != \
        HUB_ADAPTER
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"general.name": HUB_ADAPTER}))
    assert_same_file(out, ours(local, BASE, "gguf:q8_0", tmp_path / "named.gguf", "--metadata", str(meta)))
    # a revision names the default output; offline, the cached snapshot gives the same bytes, nothing fetched
    r = run_cli([f"{HUB_ADAPTER}@v2", "--to", "gguf:q8_0", "--base", "org/base", "--dry-run", "--json"], env, cwd=work)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["output"] == str(work / "org-my-qlora-adapter-v2-Q8_0-LoRA.gguf")
    fetched = len(hub.downloads)
    r = run_cli([HUB_ADAPTER, "--to", "gguf:q8_0", "--base", "org/base", "-o", str(tmp_path / "offline.gguf")],
                dict(env, HF_HUB_OFFLINE="1"), cwd=work)
    assert r.returncode == 0, r.stderr
    assert len(hub.downloads) == fetched and (tmp_path / "offline.gguf").read_bytes() == out.read_bytes()


def test_a_hub_adapter_s_errors(tmp_path: Path, adapter_hub) -> None:
    """Named errors, exit 2, one line: a repo that is neither a model nor an adapter (CKPT-005), an adapter repo
    without its weights (LORA-005), offline with nothing cached (HUB-001), and the adapter's own usage rules once
    the repo is known to be one (USE-001: a float target, several targets, --low-disk, --base with a model repo)."""
    from tests.helpers.hubcache import commit_sha, offline_env, run_cli

    hub, env, work = adapter_hub
    hub.add("org/card-only", commit_sha("card"), {"README.md": b"# x\n", "config.json": (BASE / "config.json")})
    hub.add("org/no-weights", commit_sha("now"), {"README.md": (ADAPTER / "README.md"),
                                                  "adapter_config.json": (ADAPTER / "adapter_config.json"),
                                                  "tokenizer.json": b"{}"})
    hub.add("org/model", commit_sha("model"), {p.name: p for p in QUANT.iterdir() if p.is_file()})
    cases = [
        (["org/card-only", "--to", "gguf"], env,
         ["CKPT-005 the repo holds neither a model's weights nor a PEFT LoRA adapter", "Failed to read 'org/card-only'",
          "or adapter_config.json with adapter_model.safetensors or adapter_model.bin (a PEFT LoRA adapter)"]),
        (["org/no-weights", "--to", "gguf", "--base", str(BASE)], env,
         ["Failed to read 'org/no-weights': LORA-005 adapter weights not found",
          "expected 'adapter_model.safetensors or adapter_model.bin', found ['README.md', 'adapter_config.json', "
          "'tokenizer.json']"]),
        ([HUB_ADAPTER, "--to", "gguf"], offline_env(tmp_path, tmp_path / "empty-cache"),
         [f"HUB-001 cannot fetch Hub repo '{HUB_ADAPTER}'", "HF_HUB_OFFLINE is set and the repo/revision is not in "
          "the cache"]),
        ([HUB_ADAPTER, "--to", "bf16"], env, ["USE-001 SRC is a PEFT LoRA adapter: it becomes a GGUF LoRA adapter"]),
        ([HUB_ADAPTER, "--to", "gguf,gguf:q8_0"], env, ["USE-001 SRC is a PEFT LoRA adapter: it becomes one GGUF LoRA "
                                                        "adapter, one --to target"]),
        ([HUB_ADAPTER, "--to", "bf16", "--low-disk"], env, ["USE-001 --low-disk applies to a model repo; this repo is "
                                                            "a PEFT LoRA adapter"]),
        (["org/model", "--to", "gguf", "--base", str(BASE)], env, ["USE-001 --base applies to a PEFT LoRA adapter as "
                                                                    "SRC"]),
    ]
    for argv, e, parts in cases:
        r = run_cli(argv, e, cwd=work)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (argv, r.stderr)
        assert all(p in r.stderr for p in parts), (argv, r.stderr)
    assert list(work.iterdir()) == []
    assert not any(d.startswith(("org/card-only/", "org/model/")) for d in hub.downloads)  # refused from the listing
    assert f"{HUB_ADAPTER}/tokenizer.json" not in hub.downloads


def test_an_adapter_folder_without_weights_is_lora_005(tmp_path: Path) -> None:
    """adapter_config.json and no weights at all: an adapter whose weights are missing (LORA-005, naming the folder
    and the files expected), not a model without weights (CKPT-005); with a model's weights beside it, a model."""
    from convert.check import check_source

    d = tmp_path / "half"
    d.mkdir()
    shutil.copy(ADAPTER / "adapter_config.json", d)
    shutil.copy(ADAPTER / "README.md", d)
    with pytest.raises(AdapterError) as err:
        convert(ConvertOptions(str(d), to="gguf", base=str(BASE), output=tmp_path / "o.gguf"))
    assert err.value.rule == "LORA-005" and err.value.path == str(d)
    assert str(err.value) == (f"Failed to read '{d}': LORA-005 adapter weights not found (expected "
                              "'adapter_model.safetensors or adapter_model.bin', found ['README.md', "
                              "'adapter_config.json'])")
    assert main([str(d), "--to", "gguf", "-o", str(tmp_path / "o.gguf")]) == 2
    assert [p.rule for p in check_source(d, "gguf", base=str(BASE)).problems] == ["LORA-005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half"]
    model = tmp_path / "model"  # a merged model that kept its adapter's config: a model
    shutil.copytree(BASE, model)
    shutil.copy(ADAPTER / "adapter_config.json", model)
    assert convert(ConvertOptions(str(model), to="gguf:f32", dry_run=True)).plan_text.startswith(
        f"{model} -> GGUF llama, f32: 21 tensors")


# ------------------------------------------------------------------------------------------ refused


def _tensors_with(**extra: np.ndarray) -> dict[str, np.ndarray]:
    return {**fixture_tensors(), **{f"{P}{k}": v for k, v in extra.items()}}


REFUSED = {
    "modules-to-save": (GgufAdapterError, "modules_to_save",
                        {"modules_to_save": ["lm_head"]}, {"lm_head.weight": np.zeros((1000, 256), np.float32)}),
    "resized-vocab-embedding": (GgufAdapterError, "resized vocabulary", {"target_modules": ["q_proj", "v_proj",
                                                                                            "embed_tokens"]},
                                {"model.embed_tokens.lora_embedding_A": np.zeros((8, 1008), np.float32),
                                 "model.embed_tokens.lora_embedding_B": np.zeros((256, 8), np.float32)}),
    "unknown-module": (UnmappedTensorError, "GGUF-003", {"target_modules": ["q_proj", "v_proj", "rotary"]},
                       {"model.layers.0.self_attn.rotary.lora_A.weight": np.zeros((8, 256), np.float32),
                        "model.layers.0.self_attn.rotary.lora_B.weight": np.zeros((64, 8), np.float32)}),
    "untargeted-module": (AdapterError, "LORA-009", {},
                          {"model.layers.0.mlp.up_proj.lora_A.weight": np.zeros((8, 256), np.float32),
                           "model.layers.0.mlp.up_proj.lora_B.weight": np.zeros((704, 8), np.float32)}),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_a_gguf_adapter_cannot_hold_is_refused(tmp_path: Path, case: str) -> None:
    error, part, changes, extra = REFUSED[case]
    adapter = make_adapter(tmp_path / "adapter", fixture_config(**changes), _tensors_with(**extra))
    with pytest.raises(error, match=part):
        convert(ConvertOptions(str(adapter), to="gguf", base=str(BASE), output=tmp_path / "o.gguf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_tied_heads_and_embeddings_are_refused(tmp_path: Path) -> None:
    """A tied model's GGUF has token_embd alone: an lm_head pair (or an embedding pair, which llama.cpp would apply
    to the output projection too) cannot be applied as PEFT does."""
    base = tiny_base(tmp_path / "tied", layers=2, tied=True)
    for target, keys in (("lm_head", {"lm_head.lora_A.weight": (8, 64), "lm_head.lora_B.weight": (96, 8)}),
                         ("embed_tokens", {"model.embed_tokens.lora_embedding_A": (8, 96),
                                           "model.embed_tokens.lora_embedding_B": (64, 8)})):
        t = {f"{P}{k}": np.full(s, 0.01, np.float32) for k, s in keys.items()}
        adapter = make_adapter(tmp_path / target, fixture_config(target_modules=[target]), t)
        with pytest.raises(GgufAdapterError, match="tied embeddings"):
            convert(ConvertOptions(str(adapter), to="gguf", base=str(base), dry_run=True))


def test_a_base_of_another_size_is_refused_before_writing(tmp_path: Path) -> None:
    """Every lora_A / lora_B is checked against the base config's dimensions (llama.cpp would refuse the file:
    "tensor 'blk.0.attn_q.weight' has incorrect shape"): Qwen3's head_dim 96 makes q_proj [384, 256]; a Llama with
    hidden_size 512 (head_dim 128 derived) makes it [512, 512]; an MLP pair on a tiny base by its intermediate_size."""
    wide = tmp_path / "wide"
    wide.mkdir()
    cfg = json.loads((BASE / "config.json").read_text())
    del cfg["head_dim"]
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 512}))
    q_b = f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"
    q_a = f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"
    for base, tensor, expected in ((MODELS / "qwen3_nf4_dq", q_b, "expected [384, 256], found [256, 256]"),
                                   (wide, q_b, "expected [512, 512], found [256, 256]")):
        with pytest.raises(LoraShapeError, match=re.escape(expected)) as err:
            convert(ConvertOptions(str(ADAPTER), to="gguf", base=str(base), output=tmp_path / "o.gguf"))
        assert err.value.rule == "LORA-010" and err.value.tensor == tensor
        assert main([str(ADAPTER), "--to", "gguf", "--base", str(base), "-o", str(tmp_path / "o.gguf")]) == 2
    # the input side: an adapter trained with hidden 128 on the fixture's base (256)
    t = {k: (v[:, :128] if k.endswith("lora_A.weight") else v) for k, v in fixture_tensors().items()}
    narrow = make_adapter(tmp_path / "narrow", fixture_config(), t)
    with pytest.raises(LoraShapeError, match=re.escape("expected [256, 256], found [256, 128]")) as err:
        convert(ConvertOptions(str(narrow), to="gguf", base=str(BASE), output=tmp_path / "o.gguf"))
    assert err.value.tensor == q_a
    tiny = tiny_base(tmp_path / "tiny", layers=2)
    down = {f"{P}model.layers.0.mlp.down_proj.lora_A.weight": np.full((8, 704), 0.01, np.float32),
            f"{P}model.layers.0.mlp.down_proj.lora_B.weight": np.full((64, 8), 0.01, np.float32)}
    mlp = make_adapter(tmp_path / "mlp", fixture_config(target_modules=["down_proj"]), down)
    with pytest.raises(LoraShapeError, match=re.escape("mlp.down_proj [out, in] = [B rows, A columns], as its "
                                                       "config.json gives it (expected [64, 96], found [64, 704])")):
        convert(ConvertOptions(str(mlp), to="gguf", base=str(tiny), output=tmp_path / "o.gguf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp", "narrow", "tiny", "wide"]


def test_non_finite_values_are_refused_and_nothing_is_left(tmp_path: Path) -> None:
    t = fixture_tensors()
    key = f"{P}model.layers.1.self_attn.v_proj.lora_B.weight"
    t[key] = t[key].copy()
    t[key][3, 5] = np.nan
    adapter = make_adapter(tmp_path / "adapter", fixture_config(), t)
    with pytest.raises(NonFiniteAdapterError, match="the first at flat index 29"):
        convert(ConvertOptions(str(adapter), to="gguf:q8_0", base=str(BASE), output=tmp_path / "o.gguf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


@pytest.mark.parametrize(("argv", "error", "part"), [
    (["--to", "bf16"], UsageError, "it becomes a GGUF LoRA adapter"),
    (["--to", "gguf:q4_k_m"], GgufTypeError, "f32, f16, bf16, q8_0"),
    (["--to", "gguf", "--merge-lora", str(ADAPTER)], UsageError, "--merge-lora does not apply"),
    (["--to", "gguf", "--base", str(FIXTURES / "lora")], UsageError, "has no config.json"),
])
def test_usage_errors(tmp_path: Path, argv: list[str], error: type, part: str) -> None:
    base = [] if "--base" in argv else ["--base", str(BASE)]
    with pytest.raises(error, match=part):
        main([str(ADAPTER), *argv, *base, "-o", str(tmp_path / "o.gguf"), "--debug"])
    assert main([str(ADAPTER), *argv, *base, "-o", str(tmp_path / "o.gguf")]) == 2


@pytest.mark.parametrize("to", ["bf16,gguf:q8_0", "gguf:q8_0,gguf:f16"])
def test_an_adapter_with_several_targets_is_a_plain_usage_line(to: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Several --to targets with an adapter directory as SRC: USE-001 as every usage error prints it (no "Failed to
    read" prefix: the adapter was not misread), exit 2, nothing written."""
    with pytest.raises(UsageError) as info:
        convert(ConvertOptions(str(ADAPTER), to=to, base=str(BASE), output=tmp_path / "set"))
    assert (info.value.rule, info.value.path) == ("USE-001", None)
    line = ("convert-bnb: error: USE-001 SRC is a PEFT LoRA adapter: it becomes one GGUF LoRA adapter, one --to "
            f"target (expected '--to gguf[:TYPE]', found '--to {to}')\n")
    assert str(info.value) + "\n" == line.removeprefix("convert-bnb: error: ")
    assert main([str(ADAPTER), "--to", to, "--base", str(BASE), "-o", str(tmp_path / "set")]) == 2
    assert capsys.readouterr().err == line
    assert list(tmp_path.iterdir()) == []


def test_base_needs_an_adapter_as_src(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--base applies to a PEFT LoRA adapter"):
        convert(ConvertOptions(str(QUANT), to="gguf", base=str(BASE), output=tmp_path / "o.gguf"))


def test_check_plans_the_adapter_as_the_conversion(tmp_path: Path) -> None:
    """``check ADAPTER --to gguf --base MODEL`` is clean exactly when the conversion would succeed: it plans the GGUF
    adapter and reads every value (LORA-014)."""
    from convert.check import check_source

    assert check_source(ADAPTER, "gguf:q8_0", base=str(BASE)).ok
    t = fixture_tensors()
    key = f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"
    t[key] = t[key].copy()
    t[key][0, 0] = np.inf
    bad = make_adapter(tmp_path / "bad", fixture_config(), t)
    assert [p.rule for p in check_source(bad, "gguf", base=str(BASE)).problems] == ["LORA-014"]
    assert check_source(bad).ok  # the adapter's own rules alone: values are read only for a GGUF adapter
    assert [p.rule for p in check_source(ADAPTER, "bf16").problems] == ["USE-001"]
    dora = make_adapter(tmp_path / "dora", fixture_config(use_dora=True), {
        **fixture_tensors(), **{f"{P}model.layers.{i}.self_attn.{m}.lora_magnitude_vector": np.ones(n, np.float32)
                                for i in (0, 1) for m, n in (("q_proj", 256), ("v_proj", 128))}})
    assert [p.rule for p in check_source(dora, "gguf", base=str(BASE)).problems] == ["LORA-015"]

"""LoRA merge: bit for bit against PEFT's merge_and_unload, and against the formula for adapters built here.

Formula checks compute the expected tensor independently of convert/: a NumPy fp32 product, ml_dtypes
rounding. Where torch, transformers and peft are installed, the same adapters are merged by PEFT itself.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from convert.lora.delta import ROW_ALIGN, lora_delta_rows
from convert.lora.plan import plan_merge
from formats.errors import AdapterError, NonFiniteAdapterError, PatternTimeoutError, UnsupportedError
from formats.peft import open_adapter, parse_adapter_key
from formats.peft_config import LoraConfig, load_lora_config, parse_lora_config
from tests.helpers.fixtures import FIXTURES, REFERENCES, ROOT, bits, read_safetensors

#: the merge report's norms are float32 sums of squares per chunk (convert.lora.report.sum_sq): relative error
#: against the float64 reference
REPORT_REL = 1e-4

BF = np.dtype(ml_dtypes.bfloat16)
LORA = FIXTURES / "lora"
BASE_FILE = REFERENCES["llama_nf4_dq"]
P = "base_model.model."
ATTN = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]


# ------------------------------------------------------------------------------------------ helpers

_CODES = {np.dtype(np.float32): "F32", BF: "BF16", np.dtype(np.float16): "F16"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A minimal writer (independent of formats.safetensors)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": _CODES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [off, off + arr.nbytes]}
        blobs.append(arr.tobytes())
        off += arr.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_adapter(d: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
           "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
           "modules_to_save": None, "init_lora_weights": True, "base_model_name_or_path": "llama"}
    cfg.update(config)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "adapter_model.safetensors", tensors)
    return d


def lora_pair(rng: np.random.Generator, r: int, out: int, inp: int, std: float = 0.05) -> tuple[np.ndarray, ...]:
    a = (rng.standard_normal((r, inp)) * std).astype(np.float32)
    b = (rng.standard_normal((out, r)) * std).astype(np.float32)
    return a, b


def attn_adapter(rng: np.random.Generator, ranks: dict[str, int], modules: list[str] = ATTN) -> dict:
    """lora_A/lora_B for the tiny llama's attention projections (q: 256x256, v: 128x256)."""
    out = {}
    for m in modules:
        rows = 256 if m.endswith("q_proj") else 128
        a, b = lora_pair(rng, ranks.get(m, 8), rows, 256)
        out[f"{P}{m}.lora_A.weight"] = a
        out[f"{P}{m}.lora_B.weight"] = b
    return out


def base_tensors() -> dict[str, np.ndarray]:
    return read_safetensors(BASE_FILE)


def merge_all(adapter_dirs: list[Path], base: dict[str, np.ndarray], out_dtype: str = "bfloat16",
              rows_per_chunk: int | None = None) -> dict[str, np.ndarray]:
    adapters = [open_adapter(d) for d in adapter_dirs]
    try:
        plan = plan_merge(adapters, {k: v.shape for k, v in base.items()})
        out = {}
        for name, w in base.items():
            tm = plan.get(name)
            out[name] = w if tm is None else tm.merge(w if tm.needs_base else None, out_dtype, rows_per_chunk)
        return out
    finally:
        for ad in adapters:
            ad.close()


def exact_ba(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``B @ A`` as the merge defines it (independent of any BLAS): the float64 products summed over the
    rank in order k = 0, 1, ..., rounded once to float32."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    acc = np.zeros((b64.shape[0], a64.shape[1]))
    for k in range(a64.shape[0]):
        acc = acc + np.outer(b64[:, k], a64[k])
    return acc.astype(np.float32)


def expected_linear(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float, fifo: bool = False) -> np.ndarray:
    d = exact_ba(a, b)
    if fifo:
        d = d.T
    d = d * np.float32(scale)
    return (w.astype(np.float32) + d).astype(w.dtype)


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert int(np.count_nonzero(bits(got) != bits(want))) == 0


# ------------------------------------------------------------------------------------------ fixture


def assert_within_an_ulp(got: np.ndarray, want: np.ndarray, max_differing: int) -> None:
    """``got`` and PEFT's ``want`` differ by at most one ulp, in at most ``max_differing`` values."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(bits(got).astype(np.int32) - bits(want).astype(np.int32))
    assert int(diff.max(initial=0)) <= 1
    assert int(np.count_nonzero(diff)) <= max_differing


def fixture_merge_reference() -> dict[str, np.ndarray]:
    """The fixture adapter merged into the fixture base by the formula (:func:`expected_linear`, scale 2)."""
    base = base_tensors()
    ad = read_safetensors(LORA / "adapter/adapter_model.safetensors")
    return {k: expected_linear(w, ad[f"{P}{k[:-7]}.lora_A.weight"], ad[f"{P}{k[:-7]}.lora_B.weight"], 2.0)
            if k[: -len(".weight")] in ATTN else w for k, w in base.items()}


def test_fixture_merge_is_within_an_ulp_of_peft() -> None:
    """PEFT's merge (merged_reference, made by scripts/ with torch's sgemm) and the merge's exact product
    differ in 4 of 1,987,840 bf16 values, each by one ulp (docs/lora.md)."""
    ours, peft = fixture_merge_reference(), read_safetensors(LORA / "merged_reference/model.safetensors")
    diffs = [np.abs(bits(ours[k]).astype(np.int32) - bits(peft[k]).astype(np.int32)) for k in peft]
    assert max(int(d.max()) for d in diffs) == 1
    assert (sum(int(np.count_nonzero(d)) for d in diffs), sum(d.size for d in diffs)) == (4, 1987840)


@pytest.mark.parametrize("rows_per_chunk", [None, 1, 7, 64, 100])
def test_fixture_adapter_merge_is_bit_exact(rows_per_chunk: int | None) -> None:
    base = base_tensors()
    got = merge_all([LORA / "adapter"], base, rows_per_chunk=rows_per_chunk)
    want = fixture_merge_reference()
    assert sorted(got) == sorted(want)
    for k in want:
        assert_bits_equal(np.asarray(got[k]), want[k])
    changed = [k for k in want if not np.array_equal(bits(want[k]), bits(base[k]))]
    assert changed == [f"{m}.weight" for m in ATTN]


def test_fixture_config_parsed() -> None:
    cfg = load_lora_config(LORA / "adapter")
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, cfg.use_dora) == (8, 16, False, False)
    assert cfg.target_modules == ("q_proj", "v_proj")
    assert cfg.scale_for("model.layers.0.self_attn.q_proj") == 2.0
    assert cfg.is_targeted("model.layers.1.self_attn.v_proj")
    assert not cfg.is_targeted("model.layers.1.self_attn.k_proj")
    assert not cfg.is_targeted("model.layers.1.self_attn.xq_proj")
    ignored = dict(cfg.ignored)
    assert ignored["lora_dropout"] == 0.0 and "task_type" in ignored


def test_report_figures() -> None:
    base = base_tensors()
    with open_adapter(LORA / "adapter") as ad:
        plan = plan_merge([ad], {k: v.shape for k, v in base.items()})
        stats = plan.new_stats()
        name = "model.layers.0.self_attn.q_proj.weight"
        orig = read_safetensors(FIXTURES / "models/llama_orig_bf16/model.safetensors")[name]
        plan.get(name).merge(base[name], "bfloat16", rows_per_chunk=100, stats=stats, original=orig)
        a = ad.tensors[f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"].array()
        b = ad.tensors[f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"].array()
    rows = stats.rows()
    assert [r["tensor"] for r in rows] == [f"{m}.weight" for m in ATTN]  # plan order
    (row,) = [r for r in rows if r["tensor"] == name]
    delta = exact_ba(a, b) * np.float32(2.0)
    w = base[name].astype(np.float64)
    assert row["delta_norm"] == pytest.approx(np.linalg.norm(delta.astype(np.float64)), rel=REPORT_REL)
    assert row["base_norm"] == pytest.approx(np.linalg.norm(w), rel=REPORT_REL)
    assert row["ratio"] == pytest.approx(row["delta_norm"] / row["base_norm"], rel=1e-12)
    qerr = np.linalg.norm(orig.astype(np.float64) - w)
    assert qerr > 0 and row["quant_error"] == pytest.approx(qerr, rel=REPORT_REL)
    assert (row["rank"], row["scale"], row["kind"]) == (8, 2.0, "lora")
    assert json.loads(json.dumps(stats.to_json()))["tensors"][0] == row


# ------------------------------------------------------------------------------------------ features


def test_rslora_scale(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    t = attn_adapter(rng, {m: 16 for m in ATTN})
    d = write_adapter(tmp_path / "a", {"r": 16, "lora_alpha": 8, "use_rslora": True}, t)
    base = base_tensors()
    got = merge_all([d], base)
    scale = 8 / math.sqrt(16)
    for m in ATTN:
        want = expected_linear(base[f"{m}.weight"], t[f"{P}{m}.lora_A.weight"], t[f"{P}{m}.lora_B.weight"], scale)
        assert_bits_equal(got[f"{m}.weight"], want)


def test_rank_and_alpha_patterns(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    ranks = {"model.layers.0.self_attn.q_proj": 4, "model.layers.0.self_attn.v_proj": 2,
             "model.layers.1.self_attn.v_proj": 2, "model.layers.1.self_attn.q_proj": 8}
    t = attn_adapter(rng, ranks)
    cfg = {"r": 8, "lora_alpha": 16,
           # PEFT: first pattern key with re.match(rf"(.*\.)?({key})$", module) wins
           "rank_pattern": {"layers.0.self_attn.q_proj": 4, "v_proj": 2},
           "alpha_pattern": {r"layers\.1\..*q_proj": 3, "q_proj": 32}}
    d = write_adapter(tmp_path / "a", cfg, t)
    conf = load_lora_config(d)
    scales = {m: conf.scale_for(m) for m in ATTN}
    assert scales == {"model.layers.0.self_attn.q_proj": 32 / 4, "model.layers.0.self_attn.v_proj": 16 / 2,
                      "model.layers.1.self_attn.q_proj": 3 / 8, "model.layers.1.self_attn.v_proj": 16 / 2}
    base = base_tensors()
    got = merge_all([d], base, rows_per_chunk=64)
    for m in ATTN:
        want = expected_linear(base[f"{m}.weight"], t[f"{P}{m}.lora_A.weight"], t[f"{P}{m}.lora_B.weight"],
                               scales[m])
        assert_bits_equal(got[f"{m}.weight"], want)


def test_rank_pattern_mismatch_is_an_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    t = attn_adapter(rng, {"model.layers.0.self_attn.q_proj": 4})
    d = write_adapter(tmp_path / "a", {"r": 8}, t)
    with pytest.raises(AdapterError, match="LORA-010") as e:
        open_adapter(d)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in str(e.value)
    assert "LoRA rank (lora_A rows) differs from the config (expected 8, found 4)" in str(e.value)


GPT_BASE = {"transformer.h.0.attn.c_attn.weight": (64, 192), "transformer.h.0.attn.c_proj.weight": (64, 64),
            "transformer.h.0.mlp.c_fc.weight": (64, 256), "transformer.wte.weight": (100, 64)}


def gpt_base(rng: np.random.Generator, dtype: np.dtype = BF) -> dict[str, np.ndarray]:
    return {k: (rng.standard_normal(s) * 0.02).astype(np.float32).astype(dtype) for k, s in GPT_BASE.items()}


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_fan_in_fan_out_transposes_the_delta(tmp_path: Path, out_dtype: str) -> None:
    rng = np.random.default_rng(4)
    base = gpt_base(rng, np.dtype(BF if out_dtype == "bfloat16" else out_dtype))
    a1, b1 = lora_pair(rng, 8, 192, 64)  # Conv1D c_attn: weight [in=64, out=192]
    a2, b2 = lora_pair(rng, 8, 64, 64)
    t = {f"{P}transformer.h.0.attn.c_attn.lora_A.weight": a1, f"{P}transformer.h.0.attn.c_attn.lora_B.weight": b1,
         f"{P}transformer.h.0.attn.c_proj.lora_A.weight": a2, f"{P}transformer.h.0.attn.c_proj.lora_B.weight": b2}
    d = write_adapter(tmp_path / "a", {"target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True}, t)
    got = merge_all([d], base, out_dtype, rows_per_chunk=5)
    assert_bits_equal(got["transformer.h.0.attn.c_attn.weight"],
                      expected_linear(base["transformer.h.0.attn.c_attn.weight"], a1, b1, 2.0, fifo=True))
    assert_bits_equal(got["transformer.h.0.attn.c_proj.weight"],
                      expected_linear(base["transformer.h.0.attn.c_proj.weight"], a2, b2, 2.0, fifo=True))
    # without fan_in_fan_out the [192, 64] delta does not fit the [64, 192] weight
    d2 = write_adapter(tmp_path / "b", {"target_modules": ["c_attn", "c_proj"]}, t)
    with pytest.raises(AdapterError, match="LORA-010") as e:
        merge_all([d2], base)
    assert "c_attn.lora_A.weight" in str(e.value) and "fan_in_fan_out" in str(e.value)


def test_modules_to_save_replace_the_base_tensor(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    t = attn_adapter(rng, {})
    head = (rng.standard_normal((1000, 256)) * 0.02).astype(np.float32).astype(BF)
    norm = np.linspace(0.5, 1.5, 256, dtype=np.float32)  # F32 in the adapter, written as bf16
    t[f"{P}lm_head.weight"] = head
    t[f"{P}model.norm.weight"] = norm
    # PEFT also saves its wrapper's copies when it saves embedding layers
    t[f"{P}lm_head.modules_to_save.weight"] = head
    t[f"{P}lm_head.original_module.weight"] = np.zeros((1000, 256), BF)
    d = write_adapter(tmp_path / "a", {"modules_to_save": ["lm_head", "norm"]}, t)
    base = base_tensors()
    got = merge_all([d], base, rows_per_chunk=300)
    assert_bits_equal(got["lm_head.weight"], head)
    assert_bits_equal(got["model.norm.weight"], norm.astype(BF))
    assert_bits_equal(got["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    with open_adapter(d) as ad:
        assert [k for k, _ in ad.ignored] == [f"{P}lm_head.modules_to_save.weight",
                                              f"{P}lm_head.original_module.weight"]
        assert ad.modules["lm_head"].full_kind == {"weight": "modules_to_save"}
    # a copy that differs from the saved tensor is an error
    t[f"{P}lm_head.modules_to_save.weight"] = np.ones((1000, 256), BF)
    d2 = write_adapter(tmp_path / "b", {"modules_to_save": ["lm_head", "norm"]}, t)
    with pytest.raises(AdapterError, match="LORA-012"):
        open_adapter(d2)


def test_resized_vocabulary_takes_the_adapter_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    t = attn_adapter(rng, {})
    emb = (rng.standard_normal((1010, 256)) * 0.02).astype(np.float32).astype(BF)
    head = (rng.standard_normal((1010, 256)) * 0.02).astype(np.float32).astype(BF)
    t[f"{P}model.embed_tokens.weight"] = emb
    t[f"{P}lm_head.weight"] = head
    d = write_adapter(tmp_path / "a", {}, t)
    base = base_tensors()
    with open_adapter(d) as ad:
        plan = plan_merge([ad], {k: v.shape for k, v in base.items()})
        assert plan.shape_changes == {"model.embed_tokens.weight": ((1000, 256), (1010, 256)),
                                      "lm_head.weight": ((1000, 256), (1010, 256))}
        assert plan.get("lm_head.weight").needs_base is False
        assert ad.modules["lm_head"].full_kind == {"weight": "saved_layer"}
        text = plan.new_stats().to_json()
        assert text["shape_changes"]["lm_head.weight"] == {"base": [1000, 256], "merged": [1010, 256]}
    got = merge_all([d], base, rows_per_chunk=64)
    assert_bits_equal(got["model.embed_tokens.weight"], emb)
    assert_bits_equal(got["lm_head.weight"], head)
    # only rows may change
    t[f"{P}lm_head.weight"] = head[:, :128]
    d2 = write_adapter(tmp_path / "b", {}, t)
    with pytest.raises(AdapterError, match="LORA-010"):
        merge_all([d2], base)


def torch_row_norm(v: np.ndarray) -> np.ndarray:
    """torch.linalg.norm(v, dim=1) on CPU for rows of a multiple of 8: 8 fp32 lanes, lanes added in order."""
    assert v.shape[1] % 8 == 0
    lanes = np.zeros((v.shape[0], 8), np.float32)
    for s in range(0, v.shape[1], 8):
        blk = v[:, s : s + 8]
        lanes = lanes + blk * blk
    total = lanes[:, 0]
    for k in range(1, 8):
        total = total + lanes[:, k]
    return np.sqrt(total)


def dora_expected(w: np.ndarray, a: np.ndarray, b: np.ndarray, m: np.ndarray, scale: float) -> np.ndarray:
    """PEFT DoraLinearVariant.merge_unsafe: (m / ||W + delta||_row) * (W + delta), in fp32, one rounding."""
    v = w.astype(np.float32) + exact_ba(a, b) * np.float32(scale)
    return ((m / torch_row_norm(v))[:, None] * v).astype(w.dtype)


def dora_adapter(rng: np.random.Generator, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    t = attn_adapter(rng, {})
    for mname in ATTN:
        w = base[f"{mname}.weight"].astype(np.float32)
        # PEFT initialises the magnitude to the row norm of W; a trained one drifts from it
        mag = np.linalg.norm(w, axis=1) * (1 + 0.1 * rng.standard_normal(w.shape[0]))
        t[f"{P}{mname}.lora_magnitude_vector"] = mag.astype(np.float32)
    return t


def test_dora_merge(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    base = base_tensors()
    t = dora_adapter(rng, base)
    d = write_adapter(tmp_path / "a", {"use_dora": True}, t)
    got = merge_all([d], base, rows_per_chunk=33)
    for mname in ATTN:
        want = dora_expected(base[f"{mname}.weight"], t[f"{P}{mname}.lora_A.weight"],
                             t[f"{P}{mname}.lora_B.weight"], t[f"{P}{mname}.lora_magnitude_vector"], 2.0)
        assert_bits_equal(got[f"{mname}.weight"], want)
    # magnitude vectors without use_dora, and use_dora without them, are errors
    d2 = write_adapter(tmp_path / "b", {"use_dora": False}, t)
    with pytest.raises(AdapterError, match="LORA-008"):
        open_adapter(d2)
    t.pop(f"{P}{ATTN[1]}.lora_magnitude_vector")
    d3 = write_adapter(tmp_path / "c", {"use_dora": True}, t)
    with pytest.raises(AdapterError, match="LORA-008") as e:
        open_adapter(d3)
    assert ATTN[1] in str(e.value)


@pytest.mark.parametrize("what", ["magnitude", "lora_A", "lora_B"])
def test_non_finite_adapter_tensors_are_errors(tmp_path: Path, what: str) -> None:
    """NaN/inf in lora_A, lora_B or a DoRA magnitude is LORA-014 naming the file and the key, not merged."""
    rng = np.random.default_rng(8)
    base = base_tensors()
    t = dora_adapter(rng, base)
    key = f"{P}{ATTN[2]}.lora_magnitude_vector" if what == "magnitude" else f"{P}{ATTN[2]}.{what}.weight"
    t[key] = t[key].astype(BF)  # bf16 adapter tensors are checked after the exact upcast
    t[key].reshape(-1)[3] = np.nan if what != "lora_B" else np.inf
    d = write_adapter(tmp_path / "a", {"use_dora": True}, t)
    with pytest.raises(NonFiniteAdapterError) as e:
        merge_all([d], base)
    msg = str(e.value)
    assert e.value.rule == "LORA-014" and e.value.tensor == key
    assert f"'{d / 'adapter_model.safetensors'}'" in msg and f"tensor '{key}'" in msg
    assert ("1 NaN and 0 infinite" if what != "lora_B" else "0 NaN and 1 infinite") in msg
    assert "the first at flat index 3" in msg


NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.11.mlp.down_proj", "lm_head", "model.embed_tokens",
         "transformer.h.3.attn.c_attn", "q_proj", "model.layers.0.self_attn.q_proj\n", "a.b.c"]


@pytest.mark.parametrize("pattern", [r".*\.(q|v)_proj", r"model\.layers\.\d+\..*", "q_proj", r".*proj$", "(?i)LM_HEAD",
                                     r"(a|b)\.c", r".*\.h\.\d\..*attn.*", "", r"\w+"])
def test_patterns_match_as_peft_with_re(pattern: str) -> None:
    """The regex package under a timeout gives the same answers as PEFT's own re calls."""
    import re

    composable = bool(pattern) and not pattern.startswith("(?")  # global flags only at the start (re.error)
    cfg = load_lora_config_obj({"target_modules": pattern, "rank_pattern": {pattern: 3} if composable else {},
                                "alpha_pattern": {pattern: 5} if composable else {},
                                "exclude_modules": None})
    for name in NAMES:
        assert cfg.is_targeted(name) == (re.fullmatch(pattern, name) is not None), name
        if composable:
            hit = re.match(rf"(.*\.)?({pattern})$", name) is not None
            assert cfg.rank_for(name) == (3 if hit else 8) and cfg.alpha_for(name) == (5 if hit else 16), name
    ex = load_lora_config_obj({"target_modules": ["q_proj", "down_proj", "c_attn"], "exclude_modules": pattern,
                               "layers_to_transform": [0, 3], "layers_pattern": ["layers", "h"]})
    for name in NAMES:
        want = not (pattern and re.fullmatch(pattern, name))
        if want:
            want = name.endswith((".q_proj", ".down_proj", ".c_attn")) or name in ("q_proj", "down_proj", "c_attn")
            if want and name not in ("q_proj",):
                m = next((m for lp in ("layers", "h")
                          if (m := re.match(rf"(?:^|.*?\.){lp}\.(?P<idx>\d+)\.", name)) is not None), None)
                want = m is not None and int(m.group("idx")) in (0, 3)
        assert ex.is_targeted(name) == want, name


def load_lora_config_obj(extra: dict) -> LoraConfig:
    return parse_lora_config({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **extra}, "a/adapter_config.json")


def test_pattern_time_limit_counts_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is per pattern over all module names: many slow-but-finishing matches end as LORA-013 too."""
    import formats.peft_config as peft_config

    monkeypatch.setattr(peft_config, "PATTERN_BUDGET", 0.3)
    cfg = load_lora_config_obj({"target_modules": r"(.|..)+\d\d\d"})
    with pytest.raises(PatternTimeoutError) as e:
        for _ in range(10_000):
            cfg.is_targeted("model.layers.0.self_attn.q_proj"[:20])
    assert e.value.rule == "LORA-013" and "config key 'target_modules'" in str(e.value)
    assert "a/adapter_config.json" in str(e.value)


def test_dora_fan_in_fan_out_normalises_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    base = gpt_base(rng)
    a, b = lora_pair(rng, 4, 192, 64)
    m = (rng.random(192) + 0.5).astype(np.float32)
    t = {f"{P}transformer.h.0.attn.c_attn.lora_A.weight": a, f"{P}transformer.h.0.attn.c_attn.lora_B.weight": b,
         f"{P}transformer.h.0.attn.c_attn.lora_magnitude_vector": m}
    d = write_adapter(tmp_path / "a", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"],
                                       "fan_in_fan_out": True, "use_dora": True}, t)
    got = merge_all([d], base, rows_per_chunk=5)  # whole-tensor merges ignore the chunking
    w = base["transformer.h.0.attn.c_attn.weight"]  # [in, out]
    v = w.astype(np.float32) + exact_ba(a, b).T * np.float32(2.0)
    norm = np.zeros(v.shape[1], np.float32)
    for row in v:  # torch reduces a transposed view down the stored rows, one by one
        norm = norm + row * row
    want = ((m / np.sqrt(norm))[None, :] * v).astype(BF)
    assert_bits_equal(got["transformer.h.0.attn.c_attn.weight"], want)


def test_embedding_lora_rounds_the_delta_first(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    base = base_tensors()
    t = attn_adapter(rng, {})
    ea = (rng.standard_normal((8, 1000)) * 0.05).astype(np.float32)  # lora_embedding_A [r, num_embeddings]
    eb = (rng.standard_normal((256, 8)) * 0.05).astype(np.float32)  # lora_embedding_B [dim, r]
    t[f"{P}model.embed_tokens.lora_embedding_A"] = ea
    t[f"{P}model.embed_tokens.lora_embedding_B"] = eb
    t[f"{P}model.embed_tokens.base_layer.weight"] = base["model.embed_tokens.weight"]
    d = write_adapter(tmp_path / "a", {"target_modules": ["q_proj", "v_proj", "embed_tokens"]}, t)
    got = merge_all([d], base, rows_per_chunk=100)
    delta = ((eb @ ea).T * np.float32(2.0)).astype(BF).astype(np.float32)
    want = (base["model.embed_tokens.weight"].astype(np.float32) + delta).astype(BF)
    assert_bits_equal(got["model.embed_tokens.weight"], want)


def test_adapters_apply_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    base = base_tensors()
    t1 = attn_adapter(rng, {})
    t2 = attn_adapter(rng, {}, modules=ATTN[:2])
    d1 = write_adapter(tmp_path / "a", {}, t1)
    d2 = write_adapter(tmp_path / "b", {"target_modules": ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"]},
                       t2)
    got = merge_all([d1, d2], base)
    m = ATTN[0]
    step1 = expected_linear(base[f"{m}.weight"], t1[f"{P}{m}.lora_A.weight"], t1[f"{P}{m}.lora_B.weight"], 2.0)
    step2 = expected_linear(step1, t2[f"{P}{m}.lora_A.weight"], t2[f"{P}{m}.lora_B.weight"], 2.0)
    assert_bits_equal(got[f"{m}.weight"], step2)


def test_bf16_adapter_weights_are_upcast_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    t = {k: v.astype(BF) for k, v in attn_adapter(rng, {}).items()}
    d = write_adapter(tmp_path / "a", {}, t)
    base = base_tensors()
    got = merge_all([d], base)
    m = ATTN[3]
    want = expected_linear(base[f"{m}.weight"], t[f"{P}{m}.lora_A.weight"].astype(np.float32),
                           t[f"{P}{m}.lora_B.weight"].astype(np.float32), 2.0)
    assert_bits_equal(got[f"{m}.weight"], want)


@pytest.mark.parametrize("shape", [(257, 300, 8), (65, 17, 64), (1, 40, 4), (130, 64, 16), (64, 5, 2)])
@pytest.mark.parametrize("transposed", [False, True])
def test_delta_rows_do_not_depend_on_chunking(shape: tuple[int, int, int], transposed: bool) -> None:
    rows, cols, r = shape
    rng = np.random.default_rng(rows * cols + r)
    if transposed:
        a, b = lora_pair(rng, r, cols, rows, std=1.0)
        full = exact_ba(a, b).T * np.float32(1.5)
    else:
        a, b = lora_pair(rng, r, rows, cols, std=1.0)
        full = exact_ba(a, b) * np.float32(1.5)
    for step in (1, 3, ROW_ALIGN, 100, rows):
        parts = [lora_delta_rows(a, b, 1.5, s, min(rows, s + step), transposed) for s in range(0, rows, step)]
        assert_bits_equal(np.concatenate(parts), np.ascontiguousarray(full))


@pytest.mark.parametrize("transposed", [False, True])
def test_large_delta_rows_do_not_depend_on_chunking(transposed: bool) -> None:
    """Any row range of a large delta gives the bits of the exact product (no BLAS call whose rounding
    could depend on the call's shape)."""
    rows, cols, r = 2304, 520, 8
    rng = np.random.default_rng(5)
    if transposed:
        a, b = lora_pair(rng, r, rows, cols, std=1.0)
        want = exact_ba(a, b).T
    else:
        a, b = lora_pair(rng, r, cols, rows, std=1.0)
        want = exact_ba(a, b)
    want = want * np.float32(0.75)
    for step in (1, 37, ROW_ALIGN, 1000, rows):
        parts = [lora_delta_rows(a, b, 0.75, s, min(rows, s + step), transposed) for s in range(0, rows, step)]
        assert_bits_equal(np.concatenate(parts), np.ascontiguousarray(want))


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("scale", [0.75, 1e37])
def test_linear_merge_in_pieces_equals_delta_then_add(out_dtype: str, scale: float) -> None:
    """The Linear merge works through each sgemm block in cache-sized pieces (and skips the overflow check
    when the adapter's bound allows): the bits of ``round(W + lora_delta_rows(...))`` for every chunking,
    past WHOLE_PRODUCT_ELEMENTS, and with a scale large enough that the bound does not hold (1e37: fp16
    overflows to inf, the delta stays finite, nothing is refused)."""
    from convert.lora.delta import TensorMerge, _delta_bounded
    from convert.lora.ops import MergeOp

    rows, cols, r = 300, 4000, 8
    rng = np.random.default_rng(9)
    a, b = lora_pair(rng, r, rows, cols, std=1.0)
    assert _delta_bounded(a, b, scale) == (scale < 1e30)
    dt = ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(dt)
    op = MergeOp(tensor="w", adapter="a", kind="lora", source="lora", layout="linear", shape=(rows, cols), rank=r,
                 alpha=r * scale, scale=scale, lora_A=object(), lora_B=object())  # type: ignore[arg-type]
    tm = TensorMerge("w", (rows, cols), [op])
    tm._cache.update({(0, "A"): a, (0, "B"): b})  # the adapter tensors as read (no file behind these)
    with np.errstate(over="ignore"):
        delta = lora_delta_rows(a, b, scale, 0, rows)
        want = (w.astype(np.float32) + delta).astype(dt)
    assert np.isfinite(delta).all()
    for step in (1, 37, ROW_ALIGN, 129, rows):
        got = np.concatenate([tm.merge_rows(w[s : s + step], s, min(rows, s + step), out_dtype)
                              for s in range(0, rows, step)])
        assert_bits_equal(got, want)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_lora_source_merges_in_place_in_runs_for_any_chunking(out_dtype: str) -> None:
    """LoraSource dequantizes the base into the output chunk itself and merges it there, runs of rows at a
    time on a grid from row 0 (``_run_rows``: 576 rows here): chunks that start and end inside runs give
    the bits of merging a separate base array, with and without a report."""
    from types import SimpleNamespace

    from convert.lora.apply import LoraSource
    from convert.lora.delta import TensorMerge
    from convert.lora.ops import MergeOp
    from convert.lora.report import MergeStats
    from convert.stream.sources import Source
    from formats.dtypes import BY_CODE

    rows, cols, r = 700, 4000, 8
    rng = np.random.default_rng(21)
    a, b = lora_pair(rng, r, rows, cols, std=1.0)
    dt = ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(dt)

    class Base(Source):  # the dequantized base, as a source writing into the chunk it is given
        name, kind, unit, in_nbytes = "w", "test base", 1, w.nbytes

        def produce(self, start: int, stop: int, dtype: object) -> np.ndarray:
            return w.reshape(-1)[start:stop].copy()

    record = SimpleNamespace(nbytes=a.nbytes, file=None)
    op = MergeOp(tensor="w", adapter="a", kind="lora", source="lora", layout="linear", shape=(rows, cols), rank=r,
                 alpha=r * 0.5, scale=0.5, lora_A=record, lora_B=record)  # type: ignore[arg-type]
    want = None
    for report in (False, True):
        tm = TensorMerge("w", (rows, cols), [op])
        tm._cache.update({(0, "A"): a, (0, "B"): b})  # the adapter tensors as read (no file behind these)
        if want is None:
            want = tm.merge_rows(w, 0, rows, out_dtype)
        src = LoraSource(Base(), tm, MergeStats() if report else None)
        assert src._run_rows() == 576
        dtype = BY_CODE[{"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[out_dtype]]
        for cuts in ([0, rows], [0, 100, 650, rows], [0, 575, 577, rows]):
            got = np.concatenate([src.produce(s * cols, e * cols, dtype) for s, e in itertools.pairwise(cuts)])
            assert_bits_equal(got.reshape(rows, cols), want)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("scale", "tiny", "folds"), [
    (2.0, False, True), (0.25, False, True), (-4.0, False, True), (1.0, False, True),
    (3.0, False, False),  # not a power of two: the delta is scaled after the sgemm
    (0.5, True, False),  # values whose products are subnormal: the fold would round differently
])
def test_power_of_two_scale_folded_into_lora_A_gives_the_same_bits(out_dtype: str, scale: float, tiny: bool,
                                                                    folds: bool) -> None:
    """A scale of +-2^p is multiplied into lora_A once (``_fold_scale``) instead of into every delta value:
    the bits of PEFT's order, ``round(W + (B @ A) * scale)``, over several sgemm blocks and chunkings; refused
    where a value of either order would be subnormal."""
    from convert.lora.delta import TensorMerge
    from convert.lora.ops import MergeOp

    rows, cols, r = 300, 4000, 16
    rng = np.random.default_rng(11)
    a, b = lora_pair(rng, r, rows, cols, std=1.0)
    if tiny:
        a, b = (a * np.float32(1e-25)).astype(np.float32), (b * np.float32(1e-14)).astype(np.float32)
    dt = ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
    w = (rng.standard_normal((rows, cols)) * (1e-37 if tiny else 0.02)).astype(np.float32).astype(dt)
    op = MergeOp(tensor="w", adapter="a", kind="lora", source="lora", layout="linear", shape=(rows, cols), rank=r,
                 alpha=r * scale, scale=scale, lora_A=object(), lora_B=object())  # type: ignore[arg-type]
    tm = TensorMerge("w", (rows, cols), [op])
    tm._cache.update({(0, "A"): a, (0, "B"): b})
    want = (w.astype(np.float32) + lora_delta_rows(a, b, scale, 0, rows)).astype(dt)
    for step in (37, ROW_ALIGN, rows):
        got = np.concatenate([tm.merge_rows(w[s : s + step], s, min(rows, s + step), out_dtype)
                              for s in range(0, rows, step)])
        assert_bits_equal(got, want)
    assert (tm._bounded[0][1] is not None) == folds


def test_delta_bound_holds_and_is_refused_past_float32() -> None:
    """_delta_bounded is an upper bound of |(B @ A) * scale| (checked on random adapters, signs mixed), and
    says no when the delta could overflow: then every chunk is checked (LORA-014 below)."""
    from convert.lora.delta import _DELTA_BOUND, _delta_bounded

    rng = np.random.default_rng(3)
    for _ in range(20):
        a, b = lora_pair(rng, 4, 50, 60, std=float(rng.uniform(0.01, 10)))
        bound = float(np.max(np.abs(b).astype(np.float64) @ np.abs(a).max(axis=1)))
        assert float(np.abs(b.astype(np.float64) @ a.astype(np.float64)).max()) <= bound
        assert _delta_bounded(a, b, 2.0) == (2 * bound < _DELTA_BOUND)
    a = np.full((2, 3), 3e19, np.float32)
    b = np.full((3, 2), 3e19, np.float32)  # each product 9e38 > float32's max: inf
    assert not _delta_bounded(a, b, 1.0)
    assert not _delta_bounded(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), math.inf)
    with np.errstate(over="ignore"):
        assert np.isinf(lora_delta_rows(a, b, 1.0, 0, 3)).all()


# ------------------------------------------------------------------------------------------ errors


def test_key_matching_no_base_tensor_names_the_key(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    t = attn_adapter(rng, {})
    a, b = lora_pair(rng, 8, 256, 256)
    t[f"{P}model.layers.5.self_attn.q_proj.lora_A.weight"] = a
    t[f"{P}model.layers.5.self_attn.q_proj.lora_B.weight"] = b
    d = write_adapter(tmp_path / "a", {}, t)
    with pytest.raises(AdapterError, match="LORA-007") as e:
        merge_all([d], base_tensors())
    msg = str(e.value)
    assert f"'{P}model.layers.5.self_attn.q_proj.lora_A.weight'" in msg
    assert "matches no tensor of the base model" in msg and "model.layers.5.self_attn.q_proj.weight" in msg


def test_targeted_module_without_weights_is_an_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    t = attn_adapter(rng, {}, modules=ATTN[:3])  # layer 1 v_proj has no weights
    d = write_adapter(tmp_path / "a", {}, t)
    with pytest.raises(AdapterError, match="LORA-008") as e:
        merge_all([d], base_tensors())
    assert "'model.layers.1.self_attn.v_proj'" in str(e.value)
    assert "targeted by the adapter config" in str(e.value)


def test_weights_for_an_untargeted_module_are_an_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(14)
    t = attn_adapter(rng, {})
    d = write_adapter(tmp_path / "a", {"target_modules": ["q_proj"], "exclude_modules": None}, t)
    with pytest.raises(AdapterError, match="LORA-009") as e:
        merge_all([d], base_tensors())
    assert "v_proj.lora_A.weight" in str(e.value)


def test_incomplete_pair_is_an_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(15)
    t = attn_adapter(rng, {})
    del t[f"{P}{ATTN[2]}.lora_B.weight"]
    d = write_adapter(tmp_path / "a", {}, t)
    with pytest.raises(AdapterError, match="LORA-008") as e:
        open_adapter(d)
    assert "lora_B.weight is missing" in str(e.value)


@pytest.mark.parametrize("key", [
    f"{P}model.layers.0.self_attn.q_proj.lora_A.default.weight",  # adapter name left in
    f"{P}model.layers.0.self_attn.q_proj.lora_E",  # AdaLoRA
    "model.layers.0.self_attn.q_proj.lora_A.weight",  # no prefix
    f"{P}model.layers.0.self_attn.q_proj.hada_w1_a",  # LoHa
])
def test_unknown_adapter_keys_are_errors(tmp_path: Path, key: str) -> None:
    rng = np.random.default_rng(16)
    t = attn_adapter(rng, {})
    t[key] = np.zeros((8, 256), np.float32)
    d = write_adapter(tmp_path / "a", {}, t)
    with pytest.raises(AdapterError, match="LORA-006") as e:
        open_adapter(d)
    assert f"'{key}'" in str(e.value)


def test_key_parsing_uses_exact_suffixes() -> None:
    k = parse_adapter_key(f"{P}model.layers.0.mlp.down_proj.lora_B.weight")
    assert (k.module, k.kind, k.base_tensor) == ("model.layers.0.mlp.down_proj", "lora_B",
                                                 "model.layers.0.mlp.down_proj.weight")
    k = parse_adapter_key(f"{P}model.embed_tokens.lora_embedding_A")
    assert (k.module, k.kind) == ("model.embed_tokens", "embedding_A")
    k = parse_adapter_key(f"{P}model.embed_tokens.base_layer.weight")
    assert (k.module, k.kind) == ("model.embed_tokens", "base_layer")
    # a module whose name ends in letters of a suffix is not stripped character-wise
    k = parse_adapter_key(f"{P}model.weight_proj.weight")
    assert (k.module, k.kind, k.base_tensor) == ("model.weight_proj", "full", "model.weight_proj.weight")


@pytest.mark.parametrize("key,value", [
    ("use_qalora", True), ("alora_invocation_tokens", [1, 2]), ("layer_replication", [[0, 1]]),
    ("trainable_token_indices", [5]), ("target_parameters", ["experts.w1"]), ("lora_bias", True),
    ("init_lora_weights", "pissa"), ("init_lora_weights", "olora"), ("init_lora_weights", "loftq"),
    ("some_future_config", {"k": 1}),
])
def test_config_keys_that_change_the_math_are_refused(tmp_path: Path, key: str, value: object) -> None:
    rng = np.random.default_rng(17)
    d = write_adapter(tmp_path / "a", {key: value}, attn_adapter(rng, {}))
    with pytest.raises(UnsupportedError, match="LORA-003") as e:
        open_adapter(d)
    assert f"config key '{key}'" in str(e.value)


def test_neutral_unknown_keys_are_accepted_and_listed(tmp_path: Path) -> None:
    rng = np.random.default_rng(18)
    d = write_adapter(tmp_path / "a", {"some_future_config": None, "use_qalora": False, "eva_config": None},
                      attn_adapter(rng, {}))
    with open_adapter(d) as ad:
        assert ("some_future_config", None) in ad.config.ignored


@pytest.mark.parametrize("config,rule,part", [
    ({"peft_type": "IA3"}, "LORA-002", "only LoRA adapters"),
    ({"r": 0}, "LORA-004", "config key 'r'"),
    ({"lora_alpha": "16"}, "LORA-004", "config key 'lora_alpha'"),
    ({"rank_pattern": {"q_proj": -1}}, "LORA-004", "config key 'rank_pattern'"),
    ({"target_modules": 5}, "LORA-004", "config key 'target_modules'"),
])
def test_bad_config_values(tmp_path: Path, config: dict, rule: str, part: str) -> None:
    d = write_adapter(tmp_path / "a", config, attn_adapter(np.random.default_rng(19), {}))
    with pytest.raises(AdapterError, match=rule) as e:
        open_adapter(d)
    assert part in str(e.value)


def test_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="LORA-001"):
        open_adapter(tmp_path / "empty")
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(LORA / "adapter/adapter_config.json", d / "adapter_config.json")
    with pytest.raises(AdapterError, match="LORA-005"):
        open_adapter(d)


def test_regex_targets_and_layers_to_transform() -> None:
    from formats.peft_config import parse_lora_config

    c = parse_lora_config({"peft_type": "LORA", "target_modules": r".*layers\.1\.self_attn\.(q|v)_proj"})
    assert [m for m in ATTN if c.is_targeted(m)] == ATTN[2:]
    c = parse_lora_config({"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0]})
    assert [m for m in ATTN if c.is_targeted(m)] == ATTN[:2]
    c = parse_lora_config({"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"],
                           "exclude_modules": ["model.layers.0.self_attn.q_proj"]})
    assert [m for m in ATTN if c.is_targeted(m)] == ATTN[1:]
    c = parse_lora_config({"peft_type": "LORA", "target_modules": ["q_proj", "lm_head"],
                           "modules_to_save": ["lm_head"]})
    assert not c.is_targeted("lm_head") and c.is_module_to_save("lm_head")


# ------------------------------------------------------------------------------------------ PEFT parity


@pytest.fixture(scope="module")
def peft_env():
    try:  # a broken torch install raises OSError, not ImportError
        import peft  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"torch + transformers + peft not usable: {exc}")
    return torch


def _peft_merge(torch, base_dir: Path, adapter_dir: Path, resize: int | None = None,
                cls: str = "AutoModelForCausalLM") -> dict[str, np.ndarray]:
    import transformers
    from peft import PeftModel

    model = getattr(transformers, cls).from_pretrained(str(base_dir), dtype=torch.bfloat16)
    if resize:
        model.resize_token_embeddings(resize, mean_resizing=False)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out = {}
    for k, v in merged.state_dict().items():
        out[k] = v.detach().view(torch.int16).numpy().view(BF) if v.dtype == torch.bfloat16 else v.numpy()
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama")
    shutil.copy(LORA / "merged_reference/config.json", d / "config.json")
    shutil.copy(BASE_FILE, d / "model.safetensors")
    return d


@pytest.mark.parametrize("variant", ["fixture", "rslora", "patterns", "dora", "modules_to_save", "resized",
                                     "embedding"])
def test_matches_peft(peft_env, llama_dir: Path, tmp_path: Path, variant: str) -> None:
    torch = peft_env
    rng = np.random.default_rng(20)
    base = base_tensors()
    resize = None
    if variant == "fixture":
        d = LORA / "adapter"
    elif variant == "rslora":
        d = write_adapter(tmp_path / "a", {"r": 16, "lora_alpha": 7, "use_rslora": True},
                          attn_adapter(rng, {m: 16 for m in ATTN}))
    elif variant == "patterns":
        ranks = {"model.layers.0.self_attn.q_proj": 4, "model.layers.0.self_attn.v_proj": 2,
                 "model.layers.1.self_attn.v_proj": 2}
        d = write_adapter(tmp_path / "a", {"rank_pattern": {"layers.0.self_attn.q_proj": 4, "v_proj": 2},
                                           "alpha_pattern": {r"layers\.1\..*q_proj": 3, "q_proj": 5}},
                          attn_adapter(rng, ranks))
    elif variant == "dora":
        d = write_adapter(tmp_path / "a", {"use_dora": True}, dora_adapter(rng, base))
    elif variant == "modules_to_save":
        t = attn_adapter(rng, {})
        t[f"{P}lm_head.weight"] = (rng.standard_normal((1000, 256)) * 0.02).astype(np.float32).astype(BF)
        d = write_adapter(tmp_path / "a", {"modules_to_save": ["lm_head"]}, t)
    elif variant == "resized":
        resize = 1010
        t = attn_adapter(rng, {})
        t[f"{P}model.embed_tokens.weight"] = (rng.standard_normal((1010, 256)) * 0.02).astype(BF)
        t[f"{P}lm_head.weight"] = (rng.standard_normal((1010, 256)) * 0.02).astype(BF)
        d = write_adapter(tmp_path / "a", {}, t)
    else:
        t = attn_adapter(rng, {})
        t[f"{P}model.embed_tokens.lora_embedding_A"] = (rng.standard_normal((8, 1000)) * 0.05).astype(np.float32)
        t[f"{P}model.embed_tokens.lora_embedding_B"] = (rng.standard_normal((256, 8)) * 0.05).astype(np.float32)
        t[f"{P}model.embed_tokens.base_layer.weight"] = base["model.embed_tokens.weight"]
        d = write_adapter(tmp_path / "a", {"target_modules": ["q_proj", "v_proj", "embed_tokens"]}, t)
    got = merge_all([d], base, rows_per_chunk=64)
    want = _peft_merge(torch, llama_dir, d, resize)
    assert sorted(got) == sorted(want)
    # B @ A is exact in float64 and rounded once (the same bits on any CPU); PEFT's sgemm accumulates in
    # float32 and rounds the delta to the other neighbour now and then: a bf16 value one ulp away, rarely (two
    # where W + delta cancels or an embedding's delta is rounded to bf16 before the add)
    mismatches = 0
    for k in want:
        g, w = bits(np.asarray(got[k])), bits(want[k])
        assert g.shape == w.shape, k
        diff = np.abs(g.astype(np.int32) - w.astype(np.int32))
        assert int(diff.max(initial=0)) <= 2, k
        mismatches += int(np.count_nonzero(diff))
    assert mismatches <= PEFT_MISMATCHES[variant], mismatches


#: bf16 values (of about 1.99 million) of each test_matches_peft variant away from PEFT's, times 4: the
#: counts measured here (docs/lora.md); a CPU whose sgemm rounds otherwise gives PEFT other bits.
PEFT_MISMATCHES = {k: 4 * v for k, v in {"fixture": 4, "rslora": 6, "patterns": 3, "dora": 3, "modules_to_save": 7,
                                         "resized": 7, "embedding": 10}.items()}


def test_fan_in_fan_out_matches_peft_gpt2(peft_env, tmp_path: Path) -> None:
    torch = peft_env
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "gpt2")
    base = read_safetensors(tmp_path / "gpt2/model.safetensors")
    rng = np.random.default_rng(21)
    a, b = lora_pair(rng, 8, 192, 64)
    t = {f"{P}transformer.h.0.attn.c_attn.lora_A.weight": a, f"{P}transformer.h.0.attn.c_attn.lora_B.weight": b}
    d = write_adapter(tmp_path / "a", {"target_modules": ["c_attn"], "fan_in_fan_out": True}, t)
    got = merge_all([d], base, rows_per_chunk=10)
    want = _peft_merge(torch, tmp_path / "gpt2", d, cls="GPT2LMHeadModel")
    name = "transformer.h.0.attn.c_attn.weight"
    assert_within_an_ulp(got[name], want[name], max_differing=4)  # measured here: 1 of 12,288
    assert_bits_equal(got[name], expected_linear(base[name], a, b, 2.0, fifo=True))
    assert not np.array_equal(bits(got[name]), bits(base[name]))


# ------------------------------------------------------------------------------------------ CLI


def _cli(args: list[str]) -> int:
    from convert.cli import main

    return main(args)


MODELS_DIR = FIXTURES / "models"


@pytest.mark.parametrize("model", ["llama_nf4_dq", "llama_nf4_dq_sharded", "llama_nf4_dq_qsbf16", "llama_nf4_dq_bin"])
@pytest.mark.parametrize("threads", [1, 2])
def test_cli_merge_is_bit_exact(tmp_path: Path, model: str, threads: int) -> None:
    out = tmp_path / "out"
    rc = _cli([str(MODELS_DIR / model), "--to", "bf16", "--merge-lora", str(LORA / "adapter"), "-o", str(out),
               "-q", "--threads", str(threads), "--max-memory", "64MiB"])
    assert rc == 0
    from tests.helpers.fixtures import assert_same_tensors, load_all

    assert_same_tensors(load_all(out), fixture_merge_reference())
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (LORA / "merged_reference/config.json").read_text())


@pytest.mark.parametrize("model", ["llama_nf4_dq", "llama_fp4_nodq", "llama_int8"])
@pytest.mark.parametrize("to,dtype", [("fp32", np.dtype(np.float32)), ("fp16", np.dtype(np.float16)),
                                      ("auto", BF)])
def test_cli_merge_composes_with_every_output_dtype(tmp_path: Path, to: str, dtype: np.dtype, model: str) -> None:
    from tests.helpers.fixtures import load_all

    src = str(MODELS_DIR / model)
    assert _cli([src, "--to", to, "-o", str(tmp_path / "plain"), "-q"]) == 0
    assert _cli([src, "--to", to, "--merge-lora", str(LORA / "adapter"), "-o", str(tmp_path / "merged"), "-q"]) == 0
    plain, merged = load_all(tmp_path / "plain"), load_all(tmp_path / "merged")
    ad = read_safetensors(LORA / "adapter/adapter_model.safetensors")
    for k, w in plain.items():
        m = k[: -len(".weight")]
        if m in ATTN:
            assert w.dtype == dtype
            want = expected_linear(w, ad[f"{P}{m}.lora_A.weight"], ad[f"{P}{m}.lora_B.weight"], 2.0)
        else:
            want = w
        assert_bits_equal(merged[k], want)


def test_cli_report_original_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = tmp_path / "merge.json"
    rc = _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"),
               "-o", str(tmp_path / "out"), "--report", str(rep), "--original",
               str(MODELS_DIR / "llama_orig_bf16"), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    data = json.loads(rep.read_text())
    assert summary["lora_merge"] == data
    rows = {r["tensor"]: r for r in data["tensors"]}
    assert sorted(rows) == sorted(f"{m}.weight" for m in ATTN)
    base = base_tensors()
    orig = read_safetensors(MODELS_DIR / "llama_orig_bf16/model.safetensors")
    for name, r in rows.items():
        assert (r["rank"], r["scale"], r["kind"]) == (8, 2.0, "lora")
        w = base[name].astype(np.float64)
        assert r["base_norm"] == pytest.approx(np.linalg.norm(w), rel=REPORT_REL)
        assert r["quant_error"] == pytest.approx(np.linalg.norm(orig[name].astype(np.float64) - w), rel=REPORT_REL)
        assert r["ratio"] == pytest.approx(r["delta_norm"] / r["base_norm"], rel=1e-12)


def test_merge_figures_only_when_a_report_is_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --report/--original/--json: no sum of squares is computed and no lora_merge figures are returned
    (same bytes); with --report the figures match the float64 reference within REPORT_REL."""
    import convert.lora.delta as lora_mod
    from convert.job import convert
    from convert.options import ConvertOptions
    from tests.helpers.fixtures import load_all

    calls = []
    real = lora_mod.sum_sq

    def counting(x: np.ndarray) -> float:
        calls.append(x.size)
        return real(x)

    monkeypatch.setattr(lora_mod, "sum_sq", counting)
    src = str(MODELS_DIR / "llama_nf4_dq")
    plain = convert(ConvertOptions(src=src, to="bf16", output=tmp_path / "plain", merge_lora=(LORA / "adapter",),
                                   threads=2, max_memory=64 << 20))
    assert calls == [] and "lora_merge" not in plain.details
    rep = tmp_path / "merge.json"
    with_report = convert(ConvertOptions(src=src, to="bf16", output=tmp_path / "rep", report=rep, threads=2,
                                         merge_lora=(LORA / "adapter",), max_memory=64 << 20))
    assert calls and with_report.details["lora_merge"] == json.loads(rep.read_text())
    a, b = load_all(tmp_path / "plain"), load_all(tmp_path / "rep")
    assert sorted(a) == sorted(b)
    for k in a:
        assert_bits_equal(a[k], b[k])
    ad = read_safetensors(LORA / "adapter/adapter_model.safetensors")
    for r in with_report.details["lora_merge"]["tensors"]:
        m = r["tensor"][: -len(".weight")]
        w = base_tensors()[r["tensor"]].astype(np.float64)
        delta = ad[f"{P}{m}.lora_B.weight"] @ ad[f"{P}{m}.lora_A.weight"] * np.float32(2.0)
        assert r["base_norm"] == pytest.approx(np.linalg.norm(w), rel=REPORT_REL)
        assert r["delta_norm"] == pytest.approx(np.linalg.norm(delta.astype(np.float64)), rel=REPORT_REL)


def test_sum_sq_float32_accumulation_within_report_precision() -> None:
    """4M values (a large chunk) of mixed magnitude: the float32 sum is within 1e-5 of float64's."""
    from convert.lora.report import sum_sq

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1 << 22) * np.exp(rng.uniform(-4, 4, 1 << 22))).astype(np.float32)
    want = float(np.square(x, dtype=np.float64).sum())
    assert sum_sq(x) == pytest.approx(want, rel=1e-5)
    assert sum_sq(x.astype(BF)) == pytest.approx(float(np.square(x.astype(BF).astype(np.float64)).sum()), rel=1e-5)


@pytest.mark.parametrize("to", ["nf4", "fp4", "gguf:q4_0", "bf16"])
@pytest.mark.parametrize("max_memory", ["64MiB", "1GiB"])
def test_cli_report_counts_each_element_once_whatever_the_passes(tmp_path: Path, to: str, max_memory: str) -> None:
    """--to nf4/fp4 read a nested layer twice (pre-pass, codes): the report still counts each row once."""
    rep = tmp_path / "merge.json"
    out = tmp_path / ("out.gguf" if to.startswith("gguf") else "out")
    extra = ["--requantize"] if to in ("nf4", "fp4") else []
    rc = _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", to, "--merge-lora", str(LORA / "adapter"), "-o", str(out),
               "--report", str(rep), "--original", str(MODELS_DIR / "llama_orig_bf16"), "-q", "--threads", "2",
               "--max-memory", max_memory, *extra])
    assert rc == 0
    rows = {r["tensor"]: r for r in json.loads(rep.read_text())["tensors"]}
    assert sorted(rows) == sorted(f"{m}.weight" for m in ATTN)
    base = base_tensors()
    if to == "gguf:q4_0":  # llama-quantize types merge into the exact float32 base (gguf_plan.FLOAT32_INPUT)
        assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "fp32", "-o", str(tmp_path / "base32"), "-q"]) == 0
        base = read_safetensors(tmp_path / "base32" / "model.safetensors")
    orig = read_safetensors(MODELS_DIR / "llama_orig_bf16/model.safetensors")
    ad = read_safetensors(LORA / "adapter/adapter_model.safetensors")
    for name, r in rows.items():
        w = base[name].astype(np.float64)
        m = name[: -len(".weight")]
        delta = 2.0 * (ad[f"{P}{m}.lora_B.weight"].astype(np.float64) @ ad[f"{P}{m}.lora_A.weight"].astype(np.float64))
        assert r["base_norm"] == pytest.approx(np.linalg.norm(w), rel=REPORT_REL)
        assert r["delta_norm"] == pytest.approx(np.linalg.norm(delta), rel=REPORT_REL)
        assert r["quant_error"] == pytest.approx(np.linalg.norm(orig[name].astype(np.float64) - w), rel=REPORT_REL)


def test_lora_source_counts_rows_once_over_uneven_passes() -> None:
    """Two passes with different chunkings (as a pre-pass and a codes pass may have): same figures as one."""
    from convert.lora.apply import LoraSource
    from convert.stream.plan import make_plan
    from formats.checkpoint import open_checkpoint
    from formats.dtypes import BY_CODE

    name = "model.layers.0.self_attn.q_proj.weight"
    ck = open_checkpoint(MODELS_DIR / "llama_nf4_dq")
    try:
        plan = make_plan(ck, "bf16")
        inner = {t.name: t.source for t in plan.tensors}[name]
        merge = plan_merge([open_adapter(LORA / "adapter")], {t.name: t.shape for t in plan.tensors})
        one, two = merge.new_stats(), merge.new_stats()
        src1 = LoraSource(inner, merge.get(name), one)
        src2 = LoraSource(inner, merge.get(name), two)
        cols = src1.cols
        bf16 = BY_CODE["BF16"]
        whole = src1.produce(0, src1.numel, bf16)
        parts = []
        for r0, r1 in [(0, 64), (64, 192), (192, 256)]:  # pass 1
            parts.append(src2.produce(r0 * cols, r1 * cols, bf16))
        again = [src2.produce(r0 * cols, r1 * cols, bf16) for r0, r1 in [(0, 128), (128, 256)]]  # pass 2
        assert_bits_equal(np.concatenate(parts), whole)
        assert_bits_equal(np.concatenate(again), whole)
        a = next(r for r in one.rows() if r["tensor"] == name)
        b = next(r for r in two.rows() if r["tensor"] == name)
        assert a["base_norm"] == pytest.approx(float(np.linalg.norm(base_tensors()[name].astype(np.float64))),
                                               rel=REPORT_REL)
        assert b["base_norm"] == pytest.approx(a["base_norm"], rel=REPORT_REL)
        assert b["delta_norm"] == pytest.approx(a["delta_norm"], rel=REPORT_REL)
        src3 = LoraSource(inner, merge.get(name), merge.new_stats())
        assert src3._claim(0, 64) == [(0, 64, True)]
        assert src3._claim(128, 192) == [(128, 192, True)]
        assert src3._claim(0, 256) == [(0, 64, False), (64, 128, True), (128, 192, False), (192, 256, True)]
        assert src3._counted == [(0, 256)]
        merge.close()
    finally:
        ck.close()


def _original_with(tmp_path: Path, change: dict[str, np.ndarray | None]) -> Path:
    """A copy of llama_orig_bf16 with tensors replaced (array) or renamed away (None)."""
    src = MODELS_DIR / "llama_orig_bf16"
    d = tmp_path / "orig"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    tensors = read_safetensors(src / "model.safetensors")
    for k, v in change.items():
        if v is None:
            tensors[f"other.{k}"] = tensors.pop(k)
        else:
            tensors[k] = v
    write_safetensors(d / "model.safetensors", tensors)
    return d


def test_cli_original_partly_mismatched_prints_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q0, v1 = f"{ATTN[0]}.weight", f"{ATTN[3]}.weight"
    orig = _original_with(tmp_path, {q0: None, v1: np.zeros((64, 256), BF)})
    rep = tmp_path / "merge.json"
    rc = _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"),
               "-o", str(tmp_path / "out"), "--report", str(rep), "--original", str(orig)])
    assert rc == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if ln.startswith("note: --original")]
    assert len(notes) == 1
    assert "2 of 4 merged tensors have no matching tensor" in notes[0] and q0 in notes[0]
    rows = {r["tensor"]: r for r in json.loads(rep.read_text())["tensors"]}
    assert rows[q0]["quant_error"] is None and rows[v1]["quant_error"] is None
    assert rows[f"{ATTN[1]}.weight"]["quant_error"] > 0


def test_cli_original_matching_nothing_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"),
               "-o", str(out), "--original", str(MODELS_DIR / "llama_int8"), "-q"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--original" in err and "matches none of the 4 merged tensors" in err
    assert "'model.layers.0.self_attn.q_proj.weight' is [256, 256] I8 there" in err
    assert not out.exists()
    orig = _original_with(tmp_path, {f"{m}.weight": None for m in ATTN})
    assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"),
                 "-o", str(out), "--original", str(orig), "-q"]) == 2
    assert "no tensor named 'model.layers.0.self_attn.q_proj.weight' there" in capsys.readouterr().err


def test_cli_prints_the_table_with_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The summary's table comes with --report (its figures are computed only then); without, none."""
    args = [str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter")]
    assert _cli([*args, "-o", str(tmp_path / "out"), "--report", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "|BA|*s" in err and "model.layers.1.self_attn.v_proj.weight" in err
    assert _cli([*args, "-o", str(tmp_path / "out2")]) == 0
    err = capsys.readouterr().err
    assert "|BA|*s" not in err and "merging 1 adapter(s)" in err


def test_cli_resized_vocabulary_updates_config(tmp_path: Path) -> None:
    rng = np.random.default_rng(22)
    t = attn_adapter(rng, {})
    emb = (rng.standard_normal((1010, 256)) * 0.02).astype(BF)
    t[f"{P}model.embed_tokens.weight"] = emb
    t[f"{P}lm_head.weight"] = emb[::-1].copy()
    d = write_adapter(tmp_path / "a", {}, t)
    out = tmp_path / "out"
    assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(d), "-o", str(out), "-q"]) == 0
    from tests.helpers.fixtures import load_all

    got = load_all(out)
    assert_bits_equal(got["model.embed_tokens.weight"], emb)
    assert_bits_equal(got["lm_head.weight"], emb[::-1].copy())
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1010


def test_cli_adapters_apply_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(23)
    t2 = attn_adapter(rng, {})
    d2 = write_adapter(tmp_path / "a2", {"r": 8, "lora_alpha": 4}, t2)
    out = tmp_path / "out"
    assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"),
                 "--merge-lora", str(d2), "-o", str(out), "-q"]) == 0
    from tests.helpers.fixtures import load_all

    got = load_all(out)
    ref = fixture_merge_reference()
    for m in ATTN:
        want = expected_linear(ref[f"{m}.weight"], t2[f"{P}{m}.lora_A.weight"], t2[f"{P}{m}.lora_B.weight"], 0.5)
        assert_bits_equal(got[f"{m}.weight"], want)


def test_cli_errors_leave_no_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(24)
    t = attn_adapter(rng, {})
    a, b = lora_pair(rng, 8, 256, 256)
    t[f"{P}model.layers.7.self_attn.q_proj.lora_A.weight"] = a
    t[f"{P}model.layers.7.self_attn.q_proj.lora_B.weight"] = b
    d = write_adapter(tmp_path / "a", {}, t)
    out = tmp_path / "out"
    assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(d), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "LORA-007" in err and f"'{P}model.layers.7.self_attn.q_proj.lora_A.weight'" in err
    assert not out.exists()
    assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--report", str(tmp_path / "r.json"),
                 "-o", str(out)]) == 2
    assert "--report needs --merge-lora" in capsys.readouterr().err
    assert not out.exists()


def test_cli_dry_run_shows_the_merge(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli([str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"),
                 "--dry-run"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "layers.0.self_attn.q_proj.weight" in ln)
    assert "dequant nf4" in line and "+ lora" in line


def test_adapter_model_bin(peft_env, tmp_path: Path) -> None:
    """PEFT's save_pretrained(safe_serialization=False) writes adapter_model.bin (a torch zip pickle)."""
    torch = peft_env
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(LORA / "adapter/adapter_config.json", d / "adapter_config.json")
    tensors = read_safetensors(LORA / "adapter/adapter_model.safetensors")
    torch.save({k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, d / "adapter_model.bin")
    base = base_tensors()
    got = merge_all([d], base)
    want = fixture_merge_reference()
    for k in want:
        assert_bits_equal(np.asarray(got[k]), want[k])


def test_fan_in_fan_out_dora_matches_peft_gpt2(peft_env, tmp_path: Path) -> None:
    torch = peft_env
    import transformers

    torch.manual_seed(1)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "gpt2")
    base = read_safetensors(tmp_path / "gpt2/model.safetensors")
    rng = np.random.default_rng(25)
    a, b = lora_pair(rng, 4, 192, 64)
    m = (rng.random(192) + 0.5).astype(np.float32)
    t = {f"{P}transformer.h.0.attn.c_attn.lora_A.weight": a, f"{P}transformer.h.0.attn.c_attn.lora_B.weight": b,
         f"{P}transformer.h.0.attn.c_attn.lora_magnitude_vector": m}
    d = write_adapter(tmp_path / "a", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"],
                                       "fan_in_fan_out": True, "use_dora": True}, t)
    got = merge_all([d], base)
    want = _peft_merge(torch, tmp_path / "gpt2", d, cls="GPT2LMHeadModel")
    name = "transformer.h.0.attn.c_attn.weight"
    assert_within_an_ulp(got[name], want[name], max_differing=4)  # measured here: 1 of 12,288


@pytest.mark.parametrize("n", [8, 256, 704, 4096, 4099, 9, 3])
def test_dora_norm_matches_torch(peft_env, n: int) -> None:
    from convert.lora.delta import dora_norm

    torch = peft_env
    v = (np.random.default_rng(n).standard_normal((100, n)) * 0.02).astype(np.float32)
    assert_bits_equal(dora_norm(v), torch.linalg.norm(torch.from_numpy(v), dim=1).numpy())
    w = np.ascontiguousarray(v.T)
    assert_bits_equal(dora_norm(w, columns=True), torch.linalg.norm(torch.from_numpy(w).T, dim=1).numpy())


def edited_adapter(tmp_path: Path, key_part: str, edit: Callable[[np.ndarray], np.ndarray]) -> Path:
    """A copy of the fixture adapter whose float32 tensors with ``key_part`` in their key are ``edit(values)``."""
    adapter = tmp_path / "adapter"
    shutil.copytree(LORA / "adapter", adapter)
    path = adapter / "adapter_model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), bytearray(raw[8 + n :])
    for key, entry in header.items():
        if key_part in key:
            b, e = entry["data_offsets"]
            data[b:e] = np.asarray(edit(np.frombuffer(bytes(data[b:e]), dtype="<f4")), dtype="<f4").tobytes()
    path.write_bytes(raw[: 8 + n] + bytes(data))
    return adapter


def test_a_delta_that_overflows_float32_is_refused(tmp_path: Path) -> None:
    """Finite lora_A/lora_B whose product overflows: LORA-014 naming the adapter file and tensor, not an
    all-inf weight written with exit 0."""
    import subprocess
    import sys

    adapter = edited_adapter(tmp_path, "layers.0.self_attn.q_proj", lambda v: np.full_like(v, 3e38))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "convert", str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16",
                        "--merge-lora", str(adapter), "-o", str(out)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "LORA-014 the LoRA delta (B @ A) * scale overflows float32" in r.stderr
    assert "adapter_model.safetensors'" in r.stderr and "model.layers.0.self_attn.q_proj.weight" in r.stderr
    assert not out.exists()


def test_a_scale_past_float32_is_refused(tmp_path: Path) -> None:
    """lora_alpha / r = 1e39 is inf as the float32 the delta is multiplied by: LORA-014 (exit 2, one line,
    no output), not a model of inf (the bound that skips the overflow check must not hold for it)."""
    import subprocess
    import sys

    adapter = tmp_path / "adapter"
    shutil.copytree(LORA / "adapter", adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 1e39 * cfg["r"]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "convert", str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16",
                        "--merge-lora", str(adapter), "-o", str(out)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "LORA-014 the LoRA delta (B @ A) * scale overflows float32" in r.stderr and "scale 1e+39" in r.stderr
    assert not out.exists()


def test_fp16_merge_counts_the_values_it_overflows(tmp_path: Path) -> None:
    """--to fp16 --merge-lora: merged values past float16's range are counted in the summary (fp16_overflow
    equals the inf written), as gguf:f16 counts them."""
    import subprocess
    import sys

    from tests.helpers.fixtures import read_safetensors

    # deltas of 1e4..1e6: finite in float32, past float16
    adapter = edited_adapter(tmp_path, "layers.0.self_attn.q_proj.lora_B", lambda v: v * np.float32(3e7))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "convert", str(MODELS_DIR / "llama_nf4_dq"), "--to", "fp16",
                        "--merge-lora", str(adapter), "-o", str(out), "--json"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    merged = read_safetensors(out / "model.safetensors")
    infs = sum(int(np.isinf(v.astype(np.float32)).sum()) for v in merged.values())
    assert infs > 100
    assert json.loads(r.stdout)["fp16_overflow"] == infs


def test_cli_merge_of_wide_rows_keeps_two_workers_under_a_small_cap(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A merged tensor's chunk unit is one row (the product's ROW_ALIGN-row blocks are fixed whatever the
    chunking), so a small cap keeps --threads 2 for 8192-wide rows (64 rows of them, 8 MiB of working
    memory a chunk, left room for one worker); the bytes are B @ A in ROW_ALIGN-row blocks as always."""
    rng = np.random.default_rng(31)
    rows, cols, r = 256, 8192, 4
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(BF)
    src = tmp_path / "m.safetensors"
    write_safetensors(src, {"model.layers.0.mlp.down_proj.weight": w})
    a, b = lora_pair(rng, r, rows, cols)
    ad = write_adapter(tmp_path / "ad", {"r": r, "lora_alpha": 8, "target_modules": ["down_proj"]},
                       {"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": a,
                        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": b})
    out = tmp_path / "o.safetensors"
    from convert.cli import main

    assert main([str(src), "--to", "bf16", "--merge-lora", str(ad), "-o", str(out), "--threads", "2",
                 "--max-memory", "64MiB", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert not [n for n in notes if "lowered" in n], notes
    got = read_safetensors(out)["model.layers.0.mlp.down_proj.weight"]
    delta = exact_ba(a, b) * np.float32(2.0)
    assert_bits_equal(got, (w.astype(np.float32) + delta).astype(BF))


def test_exact_product_is_the_ordered_sum() -> None:
    """exact_product's matmul-and-bound path gives the ordered float64 sum rounded once, also where the sum
    sits on a float32 rounding boundary (there it sums in order: 1 + 2^-24 is a tie, rounded to even)."""
    from convert.lora.delta import exact_product

    rng = np.random.default_rng(33)
    a = (rng.standard_normal((16, 300)) * 0.05).astype(np.float32)
    b = (rng.standard_normal((200, 16)) * 0.05).astype(np.float32)
    a[:, :40] = np.float32(2.0**-25)  # columns whose sums are ties or near-ties of float32
    b[:50] = 1.0
    b[50:60, 0], a[0, 40:60] = 1.0, 1.0  # the first term 1, then small ones: cancellations and ties
    b[60, :] = 0.0  # a zero row: +0.0 whatever the order
    b[61, 1::2] *= -1
    a[:, 40], b[50, :2] = 0.0, 1.0
    a[0, 40], a[1, 40] = 1.0, 2.0**-24  # S = 1 + 2^-24: a tie of float32, rounded to even
    want = exact_ba(a, b)
    assert want[50, 40] == 1.0 and want[60, 0] == 0.0
    for rows in (slice(0, 200), slice(37, 91)):
        assert_bits_equal(exact_product(a, b, rows), want[rows])
    assert_bits_equal(exact_product(a, b, slice(0, 300), transposed=True), np.ascontiguousarray(want.T))


def test_merge_working_copies_are_reserved_from_the_memory_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """What a tensor's merge holds beside the chunks (fp32 A, B and folded A, float64 right operand and its row
    maxima) is counted from the adapter's shapes, and the cap's chunks get what is left: a note when that is
    over a tenth of the cap, USE-001 when it is over half."""
    from convert.lora.delta import TensorMerge
    from convert.stream.pipeline import RunSettings

    adapter = open_adapter(LORA / "adapter")
    try:
        from convert.stream.plan import make_plan
        from formats.checkpoint import open_checkpoint

        with open_checkpoint(MODELS_DIR / "llama_nf4_dq") as ckpt:
            merge = plan_merge([adapter], {t.name: t.shape for t in make_plan(ckpt).tensors})
        assert len(merge.tensors) == 4  # q_proj and v_proj of both layers
        for tm in merge.tensors.values():
            op = tm.ops[0]
            r, cols = op.lora_A.shape
            out_rows = op.lora_B.shape[0]
            assert tm.held_nbytes() == r * (4 * cols + 4 * out_rows + 4 * cols + 8 * cols + 8)
    finally:
        adapter.close()

    seen: list[int] = []
    init = RunSettings.__init__

    def spy(self: RunSettings, *a: object, **k: object) -> None:
        init(self, *a, **k)
        seen.append(self.max_memory)

    monkeypatch.setattr(RunSettings, "__init__", spy)
    monkeypatch.setattr(TensorMerge, "held_nbytes", lambda self: 12 << 20)  # 3 tensors in flight at --threads 1
    args = [str(MODELS_DIR / "llama_nf4_dq"), "--to", "bf16", "--merge-lora", str(LORA / "adapter"), "--threads", "1"]
    assert _cli([*args, "-o", str(tmp_path / "a"), "--max-memory", "128MiB"]) == 0
    assert seen[-1] == (128 - 36) << 20
    assert ("note: the merges hold 36.00 MiB of adapter copies (the exact product's float64 operands) beside the "
            "chunks: chunks sized for the remaining 92.00 MiB") in capsys.readouterr().err
    for extra in ([], ["--dry-run"], ["--to", "nf4"]):  # refused before any work (nf4's pre-pass), dry run too
        assert _cli([*args, "-o", str(tmp_path / "b"), "--max-memory", "64MiB", *extra]) == 2
        assert capsys.readouterr().err == (
            "convert-bnb: error: USE-001 --max-memory is too small for this merge: the adapters' working copies of "
            "the tensors in flight, held beside the chunks, would take more than half of it (expected '>= 72.00 "
            "MiB', found '64.00 MiB'). Hint: raise --max-memory\n")
        assert not (tmp_path / "b").exists()
    # more threads than the copies allow: lowered (the 4 merged tensors in flight at 2 threads: 48 MiB > 90 / 2),
    # not refused
    args2 = [a if a != "1" else "2" for a in args]
    assert _cli([*args2, "-o", str(tmp_path / "c"), "--max-memory", "90MiB"]) == 0
    assert "note: --threads 2 lowered to 1" in capsys.readouterr().err
    assert seen[-1] == (90 - 36) << 20

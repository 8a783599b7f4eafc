"""Dequantization, bit for bit against files written by the real bitsandbytes 0.50.2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from convert.cli import main
from convert.dequant.kernels import dequantize_4bit, dequantize_nested_absmax, round_float32, unpack_4bit
from formats.bnb_layers import group_layers
from formats.checkpoint import open_checkpoint
from tests.helpers.fixtures import MODELS, PEER, REFERENCES, ROOT, SINGLE, assert_same_tensors, bits, load_all, manifest

SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
SINGLES = manifest()["single"]


@pytest.mark.parametrize("entry", SINGLES, ids=[e["name"] for e in SINGLES])
def test_single_fixture_bit_exact_through_cli(entry: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    q = SINGLE / f"{entry['name']}.q.safetensors"
    assert main([str(q), "--to", SHORT[entry["dtype"]], "-o", str(out), "-q"]) == 0
    got = load_all(out)
    want = load_all(SINGLE / f"{entry['name']}.dq.safetensors")
    assert list(got) == ["layer.weight"]
    assert got["layer.weight"].dtype == want["layer.weight"].dtype
    assert got["layer.weight"].shape == tuple(entry["shape"])
    assert np.count_nonzero(bits(got["layer.weight"]) != bits(want["layer.weight"])) == 0


@pytest.mark.parametrize("entry", [e for e in SINGLES if e["nested"]], ids=lambda e: e["name"])
def test_nested_absmax_matches_bnb(entry: dict) -> None:
    with open_checkpoint(SINGLE / f"{entry['name']}.q.safetensors") as ck:
        layers, _ = group_layers(ck.tensors)
        layer = layers["layer.weight"]
        st = layer.state
        got = dequantize_nested_absmax(
            layer.absmax.array(), layer.nested_absmax.array(), layer.nested_quant_map.array(),
            st.nested_blocksize, st.nested_offset, st.nested_dtype,
        )
    want = load_all(SINGLE / f"{entry['name']}.dq.safetensors")["layer.weight.absmax_resolved_f32"]
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("entry", [e for e in SINGLES if e.get("bnb_cpu_dispatch_value_mismatches_vs_generic")],
                         ids=lambda e: e["name"])
def test_differs_from_bnb_cpu_dispatch_where_that_is_wrong(entry: dict, tmp_path: Path) -> None:
    """Where bnb's own AVX512 CPU kernel is wrong (rows not a multiple of blocksize), we are not."""
    out = tmp_path / "o.safetensors"
    assert main([str(SINGLE / f"{entry['name']}.q.safetensors"), "--to", "auto", "-o", str(out), "-q"]) == 0
    dq = load_all(SINGLE / f"{entry['name']}.dq.safetensors")
    got = load_all(out)["layer.weight"]
    assert np.array_equal(bits(got), bits(dq["layer.weight"]))
    assert np.count_nonzero(bits(got) != bits(dq["layer.weight.bnb_cpu_dispatch"])) > 0


PEERS = sorted(p.name.split(".")[0] for p in PEER.glob("*.q.safetensors") if "int8" not in p.name)


@pytest.mark.parametrize("name", PEERS)
def test_peer_checkpoints_match_bnb_cuda_kernel(name: str, tmp_path: Path) -> None:
    """Real Hub weights dequantized by bnb's CUDA kernel: equal, except that CUDA writes -0.0 where
    the FP4 table (and bnb's generic kernel) has +0.0 -- the same value."""
    out = tmp_path / "o.safetensors"
    assert main([str(PEER / f"{name}.q.safetensors"), "--to", "bf16", "-o", str(out), "-q"]) == 0
    got = bits(load_all(out)["layer.weight"])
    want = bits(load_all(PEER / f"{name}.dq.safetensors")["layer.weight"])
    differ = got != want
    both_zero = ((got & 0x7FFF) == 0) & ((want & 0x7FFF) == 0)
    assert np.count_nonzero(differ & ~both_zero) == 0
    if name.endswith("nf4") or "nf4" in name:
        assert np.count_nonzero(differ) == 0


@pytest.mark.parametrize("model", ["llama_nf4_dq", "llama_fp4_nodq", "llama_nf4_dq_sharded", "llama_nf4_dq_qsbf16"])
def test_model_directory_bit_exact(model: str, tmp_out: Path) -> None:
    assert main([str(MODELS / model), "--to", "bf16", "-o", str(tmp_out), "-q"]) == 0
    assert_same_tensors(load_all(tmp_out), load_all(REFERENCES[model]))
    config = json.loads((tmp_out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config)
    assert config["dtype"] == "bfloat16"
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_out / name).read_bytes() == (MODELS / model / name).read_bytes()
    assert not (tmp_out / "reference").exists()


def test_thread_counts_give_identical_bytes(tmp_path: Path) -> None:
    outs = []
    for n in (1, 2, 3):
        out = tmp_path / f"t{n}"
        # a tiny memory cap forces many chunks per tensor
        assert main([str(MODELS / "llama_nf4_dq"), "--to", "fp16", "-o", str(out), "-q",
                     "--threads", str(n), "--max-memory", "64MiB"]) == 0
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1] == outs[2]


def test_sharded_output_and_index(tmp_out: Path) -> None:
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(tmp_out), "-q",
                 "--max-shard-size", "1MB"]) == 0
    index = json.loads((tmp_out / "model.safetensors.index.json").read_text())
    shards = sorted({v for v in index["weight_map"].values()})
    assert shards == sorted(p.name for p in tmp_out.glob("model-*.safetensors"))
    assert len(shards) > 1
    tensors = load_all(tmp_out)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    # total_parameters as transformers 5 writes it: the index transformers wrote for the same model
    written_by_transformers = json.loads((MODELS / "llama_nf4_dq_sharded/model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == written_by_transformers["metadata"]["total_parameters"]
    assert index["metadata"]["total_parameters"] == sum(t.size for t in tensors.values()) == 1987840
    assert_same_tensors(tensors, load_all(REFERENCES["llama_nf4_dq"]))


def test_to_fp32_and_auto(tmp_path: Path) -> None:
    ref = load_all(REFERENCES["llama_nf4_dq"])
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "fp32", "-o", str(tmp_path / "f32"), "-q"]) == 0
    got = load_all(tmp_path / "f32")
    for k, v in ref.items():
        assert got[k].dtype == np.float32
        # bf16 is exactly representable in fp32: rounding the fp32 result to bf16 gives the reference
        assert np.array_equal(bits(round_float32(got[k], "bfloat16")), bits(v)), k
    assert main([str(MODELS / "llama_nf4_dq"), "-o", str(tmp_path / "auto"), "-q"]) == 0
    assert_same_tensors(load_all(tmp_path / "auto"), ref)


def test_fp16_overflow_is_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bf16 tensor with values past float16's range: the summary counts them."""
    from formats.dtypes import BY_CODE
    from formats.safetensors import SafetensorsWriter

    src = tmp_path / "big.safetensors"
    x = np.array([1e5, -7e4, 1.0, 1e-9, 0.0, 3e-8], dtype=np.float32).astype(ml_dtypes.bfloat16)
    w = SafetensorsWriter(src, [("w", BY_CODE["BF16"], x.shape)])
    w.write(x)
    w.close()
    assert main([str(src), "--to", "fp16", "-o", str(tmp_path / "o.safetensors"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["fp16_overflow"] == 2
    assert summary["fp16_underflow"] == 1  # 1e-9 -> 0; 3e-8 stays a subnormal


@pytest.mark.parametrize("to", ["fp16", "bf16", "fp32"])
def test_runs_of_tiny_plain_tensors_are_cast_as_each_one_alone(tmp_path: Path, to: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Tiny plain tensors in a row are cast together (one cast, one write spanning them): every tensor's
    bytes equal its own cast (a zero-size tensor inside a run, a dtype change ending one), and the fp16 counts
    are those of the tensors one by one."""
    from formats.dtypes import BY_CODE
    from formats.safetensors import SafetensorsWriter

    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray] = {}
    for i in range(40):
        x = (rng.standard_normal(int(rng.integers(1, 300))) * 10.0 ** rng.integers(-9, 6)).astype(np.float32)
        x[0] = [1e5, -7e4, 1e-9, 3e-8][i % 4]  # fp16: overflow, overflow, flush to 0, subnormal
        tensors[f"t{i:02d}"] = x.astype(ml_dtypes.bfloat16) if i in (17, 18) else x
    tensors["t30"] = np.zeros(0, dtype=np.float32)
    src = tmp_path / "runs.safetensors"
    w = SafetensorsWriter(src, [(k, BY_CODE["BF16" if v.dtype == ml_dtypes.bfloat16 else "F32"], v.shape)
                                for k, v in tensors.items()])
    for v in tensors.values():
        w.write(v)
    w.close()
    out = tmp_path / "o.safetensors"
    assert main([str(src), "--to", to, "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    got = load_all(out)
    name = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[to]
    over = under = 0
    for k, v in tensors.items():
        x = v.astype(np.float32)
        want = round_float32(x, name)
        assert got[k].dtype == want.dtype and np.array_equal(bits(got[k]), bits(want)), k
        if to == "fp16":
            over += int(np.count_nonzero(np.isinf(want) & np.isfinite(x)))
            under += int(np.count_nonzero((want == 0) & (x != 0)))
    assert summary.get("fp16_overflow", 0) == over
    assert summary.get("fp16_underflow", 0) == under
    if to == "fp16":
        assert over >= 20 and under >= 10


def test_fp16_by_table_equals_rounding_every_fp32_value() -> None:
    """The fp16 kernel rounds each block's 16 products once and picks from them: the same bits, and
    the same overflow/underflow counts, as rounding every fp32 value (random codes, NF4 and FP4, every
    blocksize, odd lengths, partial last blocks, pieces, absmax from 1e-12 (flush to zero) to 1e7
    (overflow), zero absmax)."""
    from convert.dequant.kernels_f16 import count_f16_loss
    from formats.bnb import QUANT_TABLES

    rng = np.random.default_rng(7)
    seen = np.zeros(2, np.int64)
    for trial in range(240):
        bs = int(rng.choice([32, 64, 128, 256, 512, 1024, 2048, 4096]))
        n = int(rng.integers(1, 150_000)) if trial % 3 else int(rng.integers(1, 5)) * bs
        packed = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)
        absmax = (rng.random(-(-n // bs)) * 10.0 ** rng.uniform(-12, 7)).astype(np.float32)
        absmax[rng.random(absmax.size) < 0.05] = 0
        qm = QUANT_TABLES["nf4" if trial % 2 else "fp4"]
        got_stats, want_stats = np.zeros(2, np.int64), np.zeros(2, np.int64)
        got = dequantize_4bit(packed, absmax, qm, bs, n, "float16", stats=got_stats)
        x = dequantize_4bit(packed, absmax, qm, bs, n, "float32")
        want = round_float32(x, "float16")
        count_f16_loss(x, want, want_stats)
        assert np.array_equal(bits(got), bits(want)), (trial, bs, n)
        assert got_stats.tolist() == want_stats.tolist(), (trial, bs, n)
        seen += want_stats
    assert seen[0] > 1000 and seen[1] > 1000  # overflow and flush to zero were both exercised


def test_fp16_signed_route_and_tables_equal_numpy_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spans whose products are all in float16's normal range (and whose map has no -0.0) go by the
    signed-map route (kernels_f16.signed_quad_lut, kernels_f16.f16_bits_of_signed), the others by tables of
    NumPy's cast: both give the bits and the counts of rounding every fp32 product (NF4, FP4, a map
    with +0 and -0: tables only; lengths across TABLE_SPAN; absmax at the edges of the route's bounds,
    a zero and a negative absmax in one span only)."""
    from convert.dequant import kernels_f16
    from formats.bnb import QUANT_TABLES

    routes: list[bool] = []
    real = kernels_f16._signed_route
    monkeypatch.setattr(kernels_f16, "_signed_route", lambda a, q, high: routes.append(real(a, q, high)) or routes[-1])
    rng = np.random.default_rng(11)
    custom = rng.standard_normal(16).astype(np.float32)
    custom[[3, 12]] = [0.0, -0.0]
    span = kernels_f16.TABLE_SPAN
    for trial, (name, bs, n) in enumerate([("nf4", 64, 2 * span + 4160), ("fp4", 64, span + 64), ("nf4", 32, span // 2),
                                           ("custom", 128, span + 1000), ("fp4", 4096, 3 * span), ("nf4", 64, 77)]):
        qm = custom if name == "custom" else QUANT_TABLES[name]
        packed = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)
        nb = -(-n // bs)
        absmax = rng.uniform(0.02, 0.1, nb).astype(np.float32)  # (x 0.0052, FP4's least: normal)
        nonzero = np.abs(qm[qm != 0]).astype(np.float64)
        per_span = span // bs
        if nb > 2 * per_span:  # the bounds of the route, just inside (span 0) and just outside (span 1)
            absmax[5] = np.nextafter(np.float32(2.0**-14 / nonzero.min()), np.float32(1))  # inside, rounded up
            absmax[6] = np.float32(65503.0 / nonzero.max())
            absmax[per_span + 5] = np.nextafter(np.float32(2.0**-14 / nonzero.min()), np.float32(0))
            absmax[per_span + 6] = np.float32(65600.0 / nonzero.max())
        if nb > per_span and trial % 2:
            absmax[per_span] = 0.0 if trial == 1 else -0.04
        routes.clear()
        got_stats, want_stats = np.zeros(2, np.int64), np.zeros(2, np.int64)
        got = dequantize_4bit(packed, absmax, qm, bs, n, "float16", stats=got_stats)
        x = dequantize_4bit(packed, absmax, qm, bs, n, "float32")
        with np.errstate(over="ignore"):
            want = x.astype(np.float16)
        kernels_f16.count_f16_loss(x, want, want_stats)
        assert np.array_equal(bits(got), bits(want)), (name, bs, n)
        assert got_stats.tolist() == want_stats.tolist(), (name, bs, n)
        spans = -(-n // span)
        slow = 1 if nb > 2 * per_span or (nb > per_span and trial % 2) else 0
        assert len(routes) == spans, (name, bs, n, routes)
        assert sum(routes) == (0 if name == "custom" else spans - slow), (name, bs, n, routes)


def test_f16_integer_routes_equal_the_casts_on_sampled_patterns() -> None:
    """f16_bits_of_signed of x * 2^-112 (x > 0) or x * 2^-80 (x < 0) equals NumPy's float16 cast of x,
    and f16_bits_of_bf16 of those products' bfloat16 equals ml_dtypes' bfloat16 of x cast to float16,
    on sampled patterns of their domains, both signs, ties to even at bit 13 and bit 16 among them, and
    +0 (scripts/check_f16_cast.py --normal checks every pattern)."""
    from convert.dequant.kernels_f16 import bf16_to_f16, f16_bits_of_bf16, f16_bits_of_signed
    from convert.dequant.products import BF16

    rng = np.random.default_rng(13)

    def patterns(hi: int) -> npt.NDArray[np.uint32]:
        u = np.concatenate([rng.integers(0x38800000, hi, 400_000).astype(np.uint32),
                            (rng.integers(0x38800, hi >> 12, 4000).astype(np.uint32) << 12) | 0x1000,  # ties at 13
                            (rng.integers(0x3880, hi >> 16, 4000).astype(np.uint32) << 16) | 0x8000,  # ties at 16
                            (rng.integers(0x3880, hi >> 16, 4000).astype(np.uint32) << 16) | 0x7FFF,
                            np.array([0x38800000, hi - 1], np.uint32)])
        return np.concatenate([u, u | np.uint32(0x80000000)])

    def scaled(u: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
        x = u.view(np.float32)
        return np.where(x < 0, x * np.float32(2.0**-80), x * np.float32(2.0**-112)).astype(np.float32).view(np.uint32)

    u = patterns(0x477FE000)  # |x| < 65504
    got = f16_bits_of_signed(scaled(u), np.empty_like(u), np.empty(u.size, np.uint16))
    assert np.array_equal(got, u.view(np.float32).astype(np.float16).view(np.uint16))
    u = patterns(0x477F0000)  # |x| < 65280
    got = f16_bits_of_bf16(scaled(u).view(np.float32).astype(BF16).view(np.uint16), np.empty(u.size, np.uint16))
    assert np.array_equal(got, bf16_to_f16(u.view(np.float32).astype(BF16))[0].view(np.uint16))
    zero = np.zeros(1, np.uint32)
    assert f16_bits_of_signed(zero, np.empty_like(zero), np.empty(1, np.uint16)).tolist() == [0]
    assert f16_bits_of_bf16(np.zeros(1, np.uint16), np.empty(1, np.uint16)).tolist() == [0]


def test_f16_of_bf16_tables_equal_rounding_twice() -> None:
    """dequantize_4bit_f16_of_bf16 (GGUF F16 of a bf16 layer) gives the bits of bf16_to_f16 of the bf16
    kernel's output (NF4 and FP4, blocksizes 64..4096, several spans, absmax at the edges of the bounds
    where every bfloat16 is exact in float16); None as soon as one span is not provably so (a zero, a
    tiny or a huge absmax) or the map holds -0.0."""
    from convert.dequant.kernels_f16 import TABLE_SPAN, bf16_to_f16, dequantize_4bit_f16_of_bf16
    from formats.bnb import QUANT_TABLES

    rng = np.random.default_rng(12)
    for name, bs, spans in [("nf4", 64, 2.5), ("fp4", 64, 1.2), ("nf4", 128, 1), ("fp4", 4096, 3)]:
        qm = QUANT_TABLES[name]
        n = int(spans * TABLE_SPAN) // bs * bs + bs // 2
        nb = -(-n // bs)
        packed = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)
        absmax = rng.uniform(0.02, 0.2, nb).astype(np.float32)
        nonzero = np.abs(qm[qm != 0]).astype(np.float64)
        absmax[1] = np.nextafter(np.float32(2.0**-14 / nonzero.min()), np.float32(1))
        absmax[2] = np.nextafter(np.float32(65280.0 / nonzero.max()), np.float32(0))
        got = dequantize_4bit_f16_of_bf16(packed, absmax, qm, bs, n)
        want16 = bf16_to_f16(dequantize_4bit(packed, absmax, qm, bs, n, "bfloat16"))[0]
        assert got is not None and np.array_equal(bits(got), bits(want16)), (name, bs, n)
        for bad in (0.0, np.float32(2.0**-14 / nonzero.min()) * np.float32(0.99), 65280.0 / nonzero.max()):
            worse = absmax.copy()
            worse[-1] = bad  # in the last span only
            assert dequantize_4bit_f16_of_bf16(packed, worse, qm, bs, n) is None, (name, bs, bad)
    signed_zero = QUANT_TABLES["nf4"].copy()
    signed_zero[7] = -0.0  # its product is -0: the route would write +0
    packed = rng.integers(0, 256, 512, dtype=np.uint8)
    assert dequantize_4bit_f16_of_bf16(packed, np.full(16, 0.05, np.float32), signed_zero, 64, 1024) is None


def test_bf16_to_f16_equals_numpy_cast_on_every_pattern() -> None:
    """All 2^16 bfloat16 bit patterns (over three pieces, so pieces and the index of a rounded value past
    the first piece are exercised): the bits of NumPy's float32 -> float16 cast; the indices returned
    hold every value that float16 changes (or that is inf/NaN), and are the patterns outside the exact
    fast path (a biased exponent outside 113..142, but +-0)."""
    from convert.dequant.kernels_f16 import bf16_to_f16
    from convert.dequant.products import BF16, PIECE

    tiles = 3 * max(1, PIECE >> 16)  # (three pieces or more)
    x = np.tile(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16), tiles).view(BF16)
    got, rounded = bf16_to_f16(x)
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)
        want = x32.astype(np.float16)
        changed = ~(want.astype(np.float32) == x32)  # (NaN != NaN: NaN counts as changed)
    assert np.array_equal(bits(got), bits(want))
    assert np.isin(np.flatnonzero(changed | np.isinf(x32)), rounded).all()
    exponent = (x.view(np.uint16) >> 7) & 0xFF
    outside = ((exponent < 113) | (exponent > 142)) & (x.view(np.uint16) & 0x7FFF != 0)
    assert np.array_equal(rounded, np.flatnonzero(outside))
    assert rounded.size == tiles * 2 * (113 * 128 - 1 + 113 * 128)


def test_round_float32_equals_an_integer_round_to_nearest_even() -> None:
    """fp16 through NumPy's cast equals the integer rounding (F. Giesen's float_to_half_fast3_rtne, kept in
    scripts/check_f16_cast.py, which compares all 2^32 patterns) on random bit patterns, the edge of the
    fp16 range and the subnormals; bf16 equals ml_dtypes' cast."""
    spec = importlib.util.spec_from_file_location("check_f16_cast", ROOT / "scripts" / "check_f16_cast.py")
    assert spec is not None and spec.loader is not None
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    edge = np.arange(0x477FE000, 0x47800100, dtype=np.uint32).view(np.float32)  # around 65504..inf
    sub = np.arange(0x33000000, 0x38800010, 97, dtype=np.uint32).view(np.float32)  # fp16 subnormals
    x = np.concatenate([x, edge, -edge, sub, -sub])
    want = np.empty(x.size, dtype=np.uint16)
    ref._round_f16_bits(x.view(np.uint32), want)
    assert np.array_equal(bits(round_float32(x, "float16")), want)
    assert np.array_equal(bits(round_float32(x, "bfloat16")), bits(x.astype(ml_dtypes.bfloat16)))


def test_unpack_high_nibble_is_even_element() -> None:
    assert unpack_4bit(np.array([0xA5, 0x0F], dtype=np.uint8)).tolist() == [10, 5, 0, 15]
    assert unpack_4bit(np.array([0x12], dtype=np.uint8), 1).tolist() == [1]


def test_product_rounded_once_not_twice() -> None:
    """fp32(code) * fp32(absmax) rounded once; casting code and absmax to bf16 first differs."""
    from formats.bnb import NF4_TABLE

    rng = np.random.default_rng(1)
    absmax = rng.uniform(0.001, 0.1, 64).astype(np.float32)
    packed = rng.integers(0, 256, 64 * 32, dtype=np.uint8)
    got = dequantize_4bit(packed, absmax, NF4_TABLE, 64, 64 * 64, "bfloat16")
    codes = unpack_4bit(packed).reshape(64, 64)
    want = (NF4_TABLE[codes] * absmax[:, None]).astype(ml_dtypes.bfloat16).reshape(-1)
    assert np.array_equal(bits(got), bits(want))
    bf = ml_dtypes.bfloat16
    twice = (NF4_TABLE[codes].astype(bf).astype(np.float32) * absmax.astype(bf).astype(np.float32)[:, None])
    assert np.count_nonzero(bits(got) != bits(twice.astype(bf).reshape(-1))) > 100


def test_output_loads_in_transformers_with_reference_logits(tmp_out: Path) -> None:
    """Optional: where torch and transformers are installed, the output is a plain model whose weights, as
    transformers loads them, are bit-exact with the reference, and whose logits match the reference's
    `logits_dequantized` within the tolerance of a bf16 forward.

    Why not exact logits: the weights are what convert-bnb makes, and they are compared bit for bit. The
    logits are torch's bf16 forward on this machine's CPU: its GEMM kernels (AVX512, AMX, ...) sum in
    another order than the machine that made the reference, and every activation is rounded to bf16, so one
    different rounding (one bf16 ulp, 2**-8 relative) moves the logits by a few ulps. The tolerance is
    torch.testing's for bfloat16 (rtol 1.6e-2), plus 4 ulps at the logits' largest magnitude (2**-6 of it)
    for values near zero that come out of a cancellation.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(tmp_out), "-q"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_out), dtype=torch.bfloat16)
    assert getattr(model.config, "quantization_config", None) is None
    want_weights = load_all(REFERENCES["llama_nf4_dq"])
    loaded = model.state_dict()
    assert set(loaded) == set(want_weights)
    for name, want_w in want_weights.items():
        got_w = loaded[name].detach().contiguous().view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got_w.reshape(-1), bits(want_w).reshape(-1)), name  # exact: the converter's output
    ref = load_all(MODELS / "llama_nf4_dq/reference/logits.safetensors")
    ids = torch.from_numpy(ref["input_ids"].astype(np.int64))
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    want = ref["logits_dequantized"].astype(np.float32)
    assert logits.shape == want.shape
    atol = 2.0**-6 * float(np.abs(want).max())
    np.testing.assert_allclose(logits, want, rtol=1.6e-2, atol=atol)


@pytest.mark.parametrize("nested_dtype", ["float32", "bfloat16", "float16"])
def test_nested_absmax_in_pieces_equals_whole_formula(nested_dtype: str) -> None:
    """dequantize_nested_absmax works in pieces of whole nested blocks: same bits as the one-shot formula."""
    from convert.dequant.products import PIECE

    rng = np.random.default_rng(8)
    n = 3 * PIECE + 77
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    nested = (rng.random(-(-n // 256), dtype=np.float32) * 0.02).astype(np.float32)
    qmap = np.sort(rng.uniform(-1, 1, 256).astype(np.float32))
    off = 0.0473
    got = dequantize_nested_absmax(codes, nested, qmap, 256, off, nested_dtype)
    prod = qmap[codes] * np.repeat(nested, 256)[:n]
    o = np.float32(off)
    if nested_dtype == "float32":
        want = prod + o
    else:
        prod = round_float32(prod, nested_dtype).astype(np.float32)
        o = np.float32(round_float32(np.array([o], np.float32), nested_dtype).astype(np.float32)[0])
        want = round_float32(prod + o, nested_dtype).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scale", [1024.0, 2.0**20])
def test_f16_kernels_exact_for_a_quant_map_beyond_one(scale: float) -> None:
    """A quant_map with values beyond +-1 (NF4 and FP4 times 1024 and 2^20) and absmax just below and
    above 2^-14 (products in float16's normal range either way): both float16 kernels give the bits of
    the casts. The signed-map route scales absmax by 2^-112, exact only from absmax >= 2^-14 (smaller
    ones go by the tables, or give None for GGUF F16 of bf16)."""
    from convert.dequant.kernels_f16 import _signed_route, bf16_to_f16, dequantize_4bit_f16_of_bf16
    from convert.dequant.products import BF16
    from formats.bnb import QUANT_TABLES

    rng = np.random.default_rng(17)
    bs, n = 64, 64 * 300
    packed = rng.integers(0, 256, n // 2, dtype=np.uint8)
    for name in ("nf4", "fp4"):
        qm = (QUANT_TABLES[name] * np.float32(scale)).astype(np.float32)
        nonzero = np.abs(qm[qm != 0]).astype(np.float64)
        low = 2.0**-14 / nonzero.min()  # the least absmax whose products are all float16 normals
        for lo, hi in [(low * 1.0001, 2.0**-14 * 0.999), (2.0**-14, 2.0**-14 * 8)]:
            if lo >= hi or hi * nonzero.max() >= 65280:
                continue
            absmax = np.exp(rng.uniform(np.log(lo), np.log(hi), n // bs)).astype(np.float32)
            assert _signed_route(absmax, qm, 65504.0) == (hi <= 2.0**-14 * 8 and lo >= 2.0**-14), (name, lo)
            got = dequantize_4bit(packed, absmax, qm, bs, n, "float16")
            x = dequantize_4bit(packed, absmax, qm, bs, n, "float32")
            assert np.array_equal(bits(got), bits(x.astype(np.float16))), (name, scale, lo)
            g16 = dequantize_4bit_f16_of_bf16(packed, absmax, qm, bs, n)
            want16 = bf16_to_f16(x.astype(BF16))[0]
            assert (g16 is None) == (lo < 2.0**-14), (name, scale, lo)
            assert g16 is None or np.array_equal(bits(g16), bits(want16)), (name, scale, lo)

"""4-bit quantization byte-identical to bitsandbytes (convert/quant*.py, nested8.py, torch_reduce.py).

The reference files in fixtures/single were written by bitsandbytes 0.50.2 ``quantize_4bit`` on CPU
(torch 2.13, 2 threads); the expected values of torch's mean below were read off torch 2.13.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from convert.bnb4.absmax8 import double_quantize_absmax, dynamic_map_lut, quantize_blockwise_8bit
from convert.bnb4.encode import ABSMAX_FLOOR, CODECS, FP4_ORDER, blockwise_absmax, codec, iter_block_chunks
from convert.bnb4.layer import layer_tensors, quantize_layer
from convert.bnb4.report import quantization_report
from convert.bnb4.settings import QuantSettings
from convert.bnb4.torch_reduce import torch_mean_float32, torch_sum_float32
from convert.dequant.kernels import dequantize_4bit, dequantize_nested_absmax, unpack_4bit
from formats.bnb import DYNAMIC_MAP_SIGNED, FP4_TABLE, NF4_TABLE, QUANT_TABLES
from formats.errors import UnsupportedError, UsageError
from formats.safetensors import SafetensorsReader
from tests.helpers.fixtures import FIXTURES

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
SINGLE = MANIFEST["single"]
NESTED = [e for e in SINGLE if e["nested"]]


def _orig(entry: dict) -> np.ndarray:
    with SafetensorsReader(FIXTURES / "single" / f"{entry['name']}.orig.safetensors") as r:
        return np.array(r.array("layer.weight"))


def _settings(entry: dict, storage: str = "uint8") -> QuantSettings:
    return QuantSettings(entry["quant_type"], entry["blocksize"], entry["nested"], storage)


def _dequantize(arrays) -> np.ndarray:
    st = arrays.state
    absmax = arrays.absmax
    if st.nested:
        absmax = dequantize_nested_absmax(arrays.absmax, arrays.nested_absmax, DYNAMIC_MAP_SIGNED, 256,
                                          st.nested_offset)
    return dequantize_4bit(arrays.packed, absmax, QUANT_TABLES[st.quant_type], st.blocksize, st.numel,
                           st.dtype).reshape(st.shape)


# --- byte identity with the files bitsandbytes wrote ----------------------------------------------


@pytest.mark.parametrize("entry", SINGLE, ids=[e["name"] for e in SINGLE])
def test_requantized_equals_bnb_file(entry: dict) -> None:
    arrays = quantize_layer(_orig(entry), entry["dtype"], _settings(entry))
    ours = layer_tensors("layer.weight", arrays)
    with SafetensorsReader(FIXTURES / "single" / f"{entry['name']}.q.safetensors") as ref:
        assert sorted(ours) == sorted(ref.tensors)
        for name, arr in ours.items():
            info = ref.tensors[name]
            assert (info.dtype.numpy, info.shape) == (arr.dtype, arr.shape), name
            assert bytes(ref.raw(name)) == arr.tobytes(), name
    state_key = f"layer.weight.quant_state.bitsandbytes__{entry['quant_type']}"
    assert ours[state_key].tobytes().decode() == entry["quant_state_json"]
    assert arrays.packed.size == entry["packed_shape"][0]
    assert arrays.absmax.size == entry["n_absmax"]


@pytest.mark.parametrize("entry", SINGLE, ids=[e["name"] for e in SINGLE])
def test_block_aligned_chunks_give_the_same_bytes(entry: dict) -> None:
    x = _orig(entry).reshape(-1)
    bs = entry["blocksize"]
    whole_packed, whole_absmax = codec(entry["quant_type"]).quantize(x, bs)
    packed, absmax = [], []
    for a, b in iter_block_chunks(x.size, bs, 3 * bs):
        am = blockwise_absmax(x[a:b], bs)
        absmax.append(am)
        packed.append(codec(entry["quant_type"]).encode(x[a:b], am, bs))
    assert np.concatenate(packed).tobytes() == whole_packed.tobytes()
    assert np.concatenate(absmax).tobytes() == whole_absmax.tobytes()


def test_quant_storage_views_the_same_bytes() -> None:
    entry = next(e for e in SINGLE if e["name"] == "nf4_bs32_dq_bfloat16_37x51_normal")
    arrays = quantize_layer(_orig(entry), "bfloat16", _settings(entry))
    plain = layer_tensors("w", arrays)["w"]
    # 37*51 = 1887 elements -> 944 bytes: 472 bf16/f16 values, 236 f32 values, column vectors
    for storage, shape in (("bfloat16", (472, 1)), ("float16", (472, 1)), ("float32", (236, 1))):
        packed = layer_tensors("w", arrays, storage)["w"]
        assert packed.shape == shape
        assert packed.dtype.itemsize == {"bfloat16": 2, "float16": 2, "float32": 4}[storage]
        assert packed.tobytes() == plain.tobytes()


def test_quant_storage_refuses_a_partial_element() -> None:
    arrays = quantize_layer(np.ones(6, np.float32), "float32", QuantSettings("nf4", 64, False))
    with pytest.raises(UnsupportedError) as exc:  # 3 bytes cannot be viewed as bf16
        layer_tensors("w", arrays, "bfloat16")
    assert exc.value.rule == "QNT-005"
    assert exc.value.tensor == "w"
    assert "(expected 'ceil(n/2) a multiple of 2 bytes', found 3)" in str(exc.value)
    # 4 elements = 2 bytes = one bf16 value, which bnb accepts
    two = quantize_layer(np.ones(4, np.float32), "float32", QuantSettings("nf4", 64, False))
    assert layer_tensors("w", two, "bfloat16")["w"].shape == (1, 1)


# --- the numerics, piece by piece -----------------------------------------------------------------


def test_fp4_order_sorts_the_table() -> None:
    srt = FP4_TABLE[FP4_ORDER]
    assert np.all(np.diff(srt) >= 0)
    assert sorted(FP4_ORDER.tolist()) == list(range(16))
    mid, order = CODECS["nf4"].midpoints, CODECS["nf4"].order
    assert order.tolist() == list(range(16))
    assert mid.dtype == np.float32 and mid.size == 15
    assert mid[7] == np.float32(NF4_TABLE[8] / 2)


def test_ties_go_to_the_lower_code() -> None:
    mid = CODECS["nf4"].midpoints
    # a block whose max is 1.0 so that s == x exactly; every midpoint is a tie
    x = np.concatenate([[1.0], mid, np.zeros(64 - 16)]).astype(np.float32)
    codes = unpack_4bit(codec("nf4").quantize(x, 64)[0])
    assert codes[1:16].tolist() == list(range(15))
    # one ulp above each midpoint goes to the upper code
    x[1:16] = np.nextafter(mid, np.float32(2))
    codes = unpack_4bit(codec("nf4").quantize(x, 64)[0])
    assert codes[1:16].tolist() == list(range(1, 16))


def test_fp4_small_values_use_both_zero_codes() -> None:
    x = np.zeros(64, np.float32)
    x[0], x[1], x[2], x[3] = 1.0, 1e-4, -1e-4, 0.0
    codes = unpack_4bit(codec("fp4").quantize(x, 64)[0])
    assert codes[:4].tolist() == [3, 8, 0, 0]  # +1.0 is code 3; tiny positive -> 8, tiny negative -> 0
    assert FP4_TABLE[8] == 0 and FP4_TABLE[0] == 0


def test_zero_blocks_and_tail() -> None:
    x = np.zeros(64 * 2 + 5, np.float32)
    x[70] = 0.5
    packed, absmax = codec("nf4").quantize(x, 64)
    assert absmax.view(np.uint32).tolist() == [0, np.float32(0.5).view(np.uint32), 0x006CE3EE]
    assert absmax[2] == ABSMAX_FLOOR
    assert packed.size == 67
    assert packed[-1] == 0x77  # last real element and the pad are both code 7 (0.0)
    fp4_packed, _ = codec("fp4").quantize(x, 64)
    assert fp4_packed[-1] == 0x00


def test_odd_count_padding() -> None:
    for qt, pad in (("nf4", 7), ("fp4", 0)):
        packed, _ = codec(qt).quantize(np.array([0.5, -1.0, 0.25], np.float32), 64)
        assert packed.size == 2
        assert packed[1] & 0xF == pad


def test_tail_uses_true_division_full_blocks_the_reciprocal() -> None:
    # find a value whose scaled value differs between x * fp32(1/a) and x / a at a code boundary
    mid = CODECS["nf4"].midpoints
    a = np.float32(0.3)
    recip = np.float32(1) / a
    cand = (mid[:, None] * a * (1 + np.arange(-200, 201)[None, :] * 2.0**-23)).astype(np.float32).ravel()
    s_mul = np.clip(cand * recip, -1, 1)
    s_div = np.clip(cand / a, -1, 1)
    differ = np.searchsorted(mid, s_mul) != np.searchsorted(mid, s_div)
    assert differ.any()
    v = cand[differ][0]
    full = np.zeros(64, np.float32)
    full[0], full[1] = a, v
    tail = np.zeros(32, np.float32)
    tail[0], tail[1] = a, v
    code_full = unpack_4bit(codec("nf4").quantize(full, 64)[0])[1]
    code_tail = unpack_4bit(codec("nf4").quantize(np.concatenate([full, tail]), 64)[0])[65]
    assert code_full == np.searchsorted(mid, s_mul[differ][0])
    assert code_tail == np.searchsorted(mid, s_div[differ][0])
    assert code_full != code_tail


def test_non_finite_input_is_refused() -> None:
    x = np.zeros(200, np.float32)
    x[130] = np.nan
    with pytest.raises(UnsupportedError) as exc:
        codec("nf4").quantize(x, 64)
    assert exc.value.rule == "QNT-003"
    assert "found 'non-finite value in block 2'" in str(exc.value)


def test_bad_settings_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="QNT-002 blocksize must be a power of two"):
        QuantSettings("nf4", 48)
    with pytest.raises(UsageError, match="QNT-001"):
        QuantSettings("int4")
    with pytest.raises(UsageError, match="QNT-004"):
        QuantSettings(quant_storage="int8")


# --- torch.mean and the nested 8-bit kernel --------------------------------------------------------


def test_torch_mean_cascade_order() -> None:
    # 2**24 + 1 == 2**24 in fp32: where a big value enters the sum shows the summation order.
    big = np.float32(2.0**24)

    def probe(n: int, at: int) -> int:
        x = np.ones(n, np.float32)
        x[at] = big
        return int(torch_sum_float32(x) - big)

    # read off torch 2.13 (torch.tensor(x).sum()) on x86-64, AVX512 and AVX2 alike
    assert [probe(5, i) for i in range(5)] == [0, 4, 4, 4, 0]
    assert [probe(9, i) for i in range(9)] == [0, 4, 4, 4, 4, 8, 8, 8, 0]
    assert [probe(17, i) for i in range(17)] == [14, 16] * 8 + [16]


@pytest.mark.parametrize(
    ("threads", "bits"),
    # torch.from_numpy(x).sum() for x below, torch 2.13 with torch.set_num_threads(threads)
    [(1, 0x45795954), (2, 0x45795952), (3, 0x45795951), (4, 0x45795952)],
)
def test_torch_sum_thread_split(threads: int, bits: int) -> None:
    x = (np.abs(np.random.default_rng(23).standard_normal(100_003)) * 0.05).astype(np.float32)
    assert int(torch_sum_float32(x, num_threads=threads).view(np.uint32)) == bits
    mean = torch_mean_float32(x, num_threads=threads)
    assert mean == np.float32(np.float32(np.uint32(bits).view(np.float32)) / np.float32(100_003))


@pytest.mark.parametrize("entry", NESTED, ids=[e["name"] for e in NESTED])
def test_nested_offset_is_torch_mean(entry: dict) -> None:
    _, absmax = codec(entry["quant_type"]).quantize(_orig(entry), entry["blocksize"])
    want = json.loads(entry["quant_state_json"])["nested_offset"]
    assert float(torch_mean_float32(absmax)) == want


def test_numpy_mean_would_differ_on_two_fixtures() -> None:
    differ = []
    for entry in NESTED:
        _, absmax = codec(entry["quant_type"]).quantize(_orig(entry), entry["blocksize"])
        if np.float32(absmax.sum(dtype=np.float32) / np.float32(absmax.size)) != torch_mean_float32(absmax):
            differ.append(entry["name"])
    assert differ == ["nf4_bs128_dq_float32_64x256_zeroblocks", "fp4_bs256_dq_float32_3x40x72_normal"]


def test_dynamic_map_lut() -> None:
    lut = dynamic_map_lut()
    assert lut.shape == (65536,) and lut.dtype == np.uint8
    assert lut[0] == 0 and lut[-1] == 255
    assert np.all(np.diff(lut.astype(int)) >= 0)
    # 7 codes near zero are closer together than the 2/65535 grid and are never chosen
    assert np.unique(lut).size == 249
    assert set(range(256)) - set(np.unique(lut).tolist()) <= set(range(120, 136))


def test_8bit_index_is_not_fused() -> None:
    # h = fp32((t+1)/2) where fp32(h*65535)+0.5 truncates differently from the exact h*65535+0.5
    # and the two 16-bit indices land on different codes: bnb's kernel takes the unfused one.
    c = ((np.arange(1, 65536) - 0.5) / 65535).astype(np.float32)
    h = np.concatenate([np.nextafter(c, np.float32(0)), c, np.nextafter(c, np.float32(1))])
    unfused = (h * np.float32(65535) + np.float32(0.5)).astype(np.uint16)
    exact = np.floor(h.astype(np.float64) * 65535 + 0.5).astype(np.uint16)
    lut = dynamic_map_lut()
    t = (np.float32(2) * h - np.float32(1)).astype(np.float32)
    pick = (lut[unfused] != lut[exact]) & (((t + np.float32(1)) * np.float32(0.5)).astype(np.float32) == h)
    assert pick.sum() > 10
    v = np.concatenate([[np.float32(1.0)], t[pick][:255]]).astype(np.float32)
    codes, m = quantize_blockwise_8bit(v)
    assert m.tolist() == [1.0]
    assert codes[1:].tolist() == lut[unfused[pick][:255]].tolist()


def test_8bit_zero_block() -> None:
    codes, m = quantize_blockwise_8bit(np.zeros(300, np.float32))
    assert codes.tolist() == [0] * 300
    assert m.tolist() == [0.0, 0.0]


def test_double_quantize_roundtrips_within_8bit_error() -> None:
    absmax = np.abs(np.random.default_rng(3).standard_normal(1000)).astype(np.float32) * 0.05
    codes, nested, offset = double_quantize_absmax(absmax)
    assert codes.dtype == np.uint8 and nested.shape == (4,)
    back = dequantize_nested_absmax(codes, nested, DYNAMIC_MAP_SIGNED, 256, offset)
    assert np.max(np.abs(back - absmax)) < 0.02 * np.max(np.abs(absmax - offset))


# --- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", SINGLE, ids=[e["name"] for e in SINGLE])
def test_round_trip_is_stable(entry: dict) -> None:
    settings = _settings(entry)
    first = quantize_layer(_orig(entry), entry["dtype"], settings)
    y1 = _dequantize(first)
    second = quantize_layer(y1, entry["dtype"], settings)
    y2 = _dequantize(second)
    c1, c2 = unpack_4bit(first.packed), unpack_4bit(second.packed)
    changed = c1 != c2
    # codes never move, except FP4's two zeros: a tiny positive value (code 8, +0.0) comes back as 0.0
    assert set(zip(c1[changed].tolist(), c2[changed].tolist(), strict=True)) <= {(8, 0)}
    if entry["quant_type"] == "fp4":
        assert FP4_TABLE[c1].tobytes() == FP4_TABLE[c2].tobytes()
    if not entry["nested"]:
        # without double quantization the dequantized values are a fixed point, bit for bit
        assert y2.tobytes() == y1.tobytes()
    else:
        # the nested absmax is re-quantized: values move by at most one 8-bit step of absmax
        a1 = dequantize_nested_absmax(first.absmax, first.nested_absmax, DYNAMIC_MAP_SIGNED, 256,
                                      first.state.nested_offset)
        a2 = dequantize_nested_absmax(second.absmax, second.nested_absmax, DYNAMIC_MAP_SIGNED, 256,
                                      second.state.nested_offset)
        step = np.repeat(np.maximum(first.nested_absmax, second.nested_absmax), 256)[: a1.size] * 0.02
        assert np.all(np.abs(a2 - a1) <= step)


# --- the report ------------------------------------------------------------------------------------


def test_report_seed_figures_small() -> None:
    # the seed figures are for 4096x4096 (scripts/quantize_seed_figures.py: 0.0920, 4.127);
    # a 1024x1024 draw of N(0, 0.02) gives the same error to within 0.001
    x = (np.random.default_rng(0).standard_normal((1024, 1024)) * 0.02).astype(np.float32)
    arrays = quantize_layer(x, "float32", QuantSettings("nf4", 64, True))
    rep = quantization_report("w", x, arrays, max_elements=1 << 18)
    assert rep.rel_error == pytest.approx(0.092, abs=0.001)
    # 4 + 8/64 + 32/(64*256) exactly when n_blocks is a multiple of 256
    assert rep.bits_per_weight == 4 + 8 / 64 + 32 / (64 * 256)
    assert not rep.outlier and rep.outlier_blocks == 0
    plain = quantization_report("w", x, quantize_layer(x, "float32", QuantSettings("nf4", 64, False)))
    assert plain.bits_per_weight == 4.5
    assert plain.rel_error < rep.rel_error


def test_report_flags_outlier_blocks() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 256)) * 0.02).astype(np.float32)
    x[3, 5] = 2.0  # one block with a 40x absmax
    arrays = quantize_layer(x, "float32", QuantSettings("nf4", 64, False))
    rep = quantization_report("w", x, arrays)
    assert rep.outlier and rep.outlier_blocks == 1
    # in that block everything but the outlier is below half of NF4's smallest step (0.0796 * 2.0)
    assert rep.outlier_zero_share == pytest.approx(63 / 64, abs=1 / 64)
    assert rep.zero_share < 0.15
    assert rep.as_dict()["numel"] == 64 * 256


def test_report_chunked_equals_whole() -> None:
    x = (np.random.default_rng(2).standard_normal(10_000) * 0.02).astype(np.float32)
    arrays = quantize_layer(x, "float32", QuantSettings("fp4", 128, True))
    whole = quantization_report("w", x, arrays)
    chunked = quantization_report("w", lambda a, b: x[a:b], arrays, max_elements=1000)
    # float32 dots per piece: chunking moves the sums by float32 rounding only (documented: ~1e-6)
    assert chunked.rel_error == pytest.approx(whole.rel_error, rel=1e-6)
    assert chunked.zero_share == whole.zero_share
    err = x.astype(np.float64) - _dequantize(arrays).reshape(-1).astype(np.float64)
    exact = math.sqrt(float((err * err).sum()) / float((x.astype(np.float64) ** 2).sum()))
    assert whole.rel_error == pytest.approx(exact, rel=1e-6)


def test_report_on_a_sample_measures_the_fixed_grid_pieces() -> None:
    """sample=k measures the error and zero share on grid pieces 0, k, 2k, ... of the flat weight (the same
    pieces however it is chunked) and every outlier block wherever it is: the figures of those elements."""
    from convert.bnb4.report import ReportAccumulator, stored_nbytes
    from convert.dequant.products import PIECE

    rng = np.random.default_rng(3)
    n, bs, k = 9 * PIECE + 640, 64, 4
    x = (rng.standard_normal(n) * 0.02).astype(np.float32)
    x[5 * PIECE + 70] = 3.0  # an outlier block in an unsampled piece
    arrays = quantize_layer(x, "float32", QuantSettings("nf4", bs, False))
    y = _dequantize(arrays).reshape(-1).astype(np.float64)
    am = arrays.absmax_f32
    med = float(np.median(am))
    picked = np.zeros(n, bool)
    for g in range(0, n, k * PIECE):
        picked[g : g + PIECE] = True
    xs, ys = x[picked].astype(np.float64), y[picked]
    want_rel = math.sqrt(float(((xs - ys) ** 2).sum()) / float((xs * xs).sum()))
    want_zero = np.count_nonzero((xs != 0) & (ys == 0)) / np.count_nonzero(xs != 0)
    out_el = np.repeat(am > 10 * med, bs)[:n]
    want_out_zero = np.count_nonzero(out_el & (x != 0) & (y == 0)) / np.count_nonzero(out_el & (x != 0))
    for chunk in (n, 3 * PIECE + 64 * 5, 100 * bs):
        acc = ReportAccumulator("w", arrays.state, med, float(am.max()), sample=k)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            acc.add(a, x[a:b], arrays.packed[a // 2 : (b + 1) // 2], arrays.absmax[a // bs : -(-b // bs)],
                    am[a // bs : -(-b // bs)])
        rep = acc.result(stored_nbytes(arrays.state))
        assert rep.rel_error == pytest.approx(want_rel, rel=1e-6)
        assert rep.zero_share == want_zero
        assert rep.outlier_blocks == 1 and rep.outlier_zero_share == want_out_zero > 0.9
    exact = quantization_report("w", x, arrays)
    assert rep.rel_error == pytest.approx(exact.rel_error, rel=0.02)  # an estimate, close to the whole


# --- optional parity with torch and bitsandbytes themselves ----------------------------------------


def test_parity_torch_mean() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    for n in list(range(1, 300)) + [1000, 4097, 32767, 32768, 40_000, 131_073]:
        x = (np.abs(rng.standard_normal(n)) * 0.05).astype(np.float32)
        want = torch.from_numpy(x).mean().numpy()
        got = torch_mean_float32(x, num_threads=torch.get_num_threads())
        assert got.view(np.uint32) == want.view(np.uint32), n


def test_parity_bitsandbytes_quantize_4bit() -> None:
    torch = pytest.importorskip("torch")
    bnbf = pytest.importorskip("bitsandbytes.functional")
    threads = torch.get_num_threads()
    cases = [((300, 77), "nf4", 64, True), ((1001,), "fp4", 128, False), ((512, 130), "fp4", 32, True),
             ((2048, 1100), "nf4", 64, True), ((33,), "nf4", 4096, True)]
    for shape, qt, bs, nested in cases:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02
        packed, state = bnbf.quantize_4bit(t, blocksize=bs, compress_statistics=nested, quant_type=qt)
        ours = layer_tensors("w", quantize_layer(t.numpy(), "float32",
                                                 QuantSettings(qt, bs, nested, num_threads=threads)))
        assert ours["w"].tobytes() == packed.numpy().tobytes()
        for key, ref in state.as_dict(packed=True).items():
            assert ours[f"w.{key}"].tobytes() == ref.numpy().tobytes(), (shape, key)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bucket_tables_equal_the_search(quant_type: str) -> None:
    """The 20-bit bucket lookup gives searchsorted(midpoints, s, 'left') at every bucket edge, around
    every midpoint and on random values (the buckets holding a midpoint, searched, are few)."""
    from convert.bnb4.encode import _BUCKET_BITS, _SEARCH, _code_table, _pack_codes

    mid, order = CODECS[quant_type].midpoints, CODECS[quant_type].order
    table = _code_table(mid.tobytes())
    finite = (np.arange(table.size, dtype=np.uint32) >> (_BUCKET_BITS - 9) & 0xFF) != 0xFF
    assert 0 < np.count_nonzero(table[finite] == _SEARCH) <= 2 * mid.size
    low = 32 - _BUCKET_BITS
    h = np.arange(1 << _BUCKET_BITS, dtype=np.uint32)
    edges = np.concatenate([(h << low), (h << low) | ((1 << low) - 1), (h << low) | (1 << (low - 1))]).view(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(-2)), mid, np.nextafter(mid, np.float32(2))])
    rand = np.random.default_rng(0).uniform(-1, 1, 1 << 20).astype(np.float32)
    s = np.concatenate([edges[np.isfinite(edges)], near, rand])
    s = np.clip(s, -1, 1).astype(np.float32)[: s.size // 2 * 2]
    got = np.empty(s.size // 2, np.uint8)
    _pack_codes(s, mid, None if quant_type == "nf4" else order, got)
    codes = order[np.searchsorted(mid, s, side="left")]
    assert got.tolist() == ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8).tolist()



@pytest.mark.parametrize("n", [65_537, 1_000_003, 704_512])
def test_cascade_sum_in_pieces_equals_one_accumulate(n: int) -> None:
    """_multi_row_sum sums its level-0 groups a few at a time (no n-sized temporary): same bits."""
    from convert.bnb4.torch_reduce import _multi_row_sum

    rng = np.random.default_rng(n)
    rows = (np.abs(rng.standard_normal(n - n % 32)) * 0.05).astype(np.float32).reshape(-1, 4, 8)
    got = _multi_row_sum(rows)
    # the whole-array form the pieces replace
    size = rows.shape[0]
    level_power = max(4, (1 if size <= 2 else (size - 1).bit_length()) // 4)
    step = 1 << level_power
    n_full = size // step
    sums = np.add.accumulate(rows[: n_full * step].reshape((n_full, step, 4, 8)), axis=1,
                             dtype=np.float32)[:, -1] + np.float32(0)
    acc = np.zeros((4, 4, 8), dtype=np.float32)
    i = 0
    for c in range(n_full):
        acc[0] = sums[c]
        i += step
        for j in range(1, 4):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & ((step - 1) << (j * level_power)):
                break
    if i < size:
        acc[0] = np.add.accumulate(rows[i:], axis=0, dtype=np.float32)[-1] + np.float32(0)
    want = acc[0]
    for j in range(1, 4):
        want = want + acc[j]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("n", [1, 255, 256, 70_000, 704_513])
def test_nested_statistics_equal_double_quantize_absmax(n: int) -> None:
    from convert.bnb4.absmax8 import nested_statistics

    am = (np.random.default_rng(n).random(n, dtype=np.float32) * 0.05).astype(np.float32)
    _, nested, offset = double_quantize_absmax(am)
    got, got_offset = nested_statistics(am)
    assert got_offset == offset
    assert np.array_equal(got.view(np.uint32), nested.view(np.uint32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_blockwise_absmax_of_16_bit_patterns(dtype: str) -> None:
    """The 16-bit path (max of the sign-cleared bit patterns) equals max |x| in float32 on every finite
    pattern (subnormals, -0, the largest values), with a partial last block; inf and NaN raise QNT-003."""
    from convert.bnb4.encode import blockwise_absmax
    from convert.dequant.products import BF16
    from formats.errors import NonFiniteWeightError

    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float16)
    bits = np.random.default_rng(4).permutation(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    x = bits.view(dt)
    x = x[np.isfinite(x.astype(np.float32))][: 64 * 900 + 17]
    want = np.abs(x.astype(np.float32))
    full = want[: 64 * 900].reshape(900, 64).max(axis=1)
    got = blockwise_absmax(x, 64)
    assert np.array_equal(got[:900], full)
    assert got[900] == max(want[64 * 900 :].max(), np.float32(1e-38))
    for bad in (np.inf, np.nan):
        y = x.copy()
        y[5000] = bad
        with pytest.raises(NonFiniteWeightError, match="block 78"):
            blockwise_absmax(y, 64)

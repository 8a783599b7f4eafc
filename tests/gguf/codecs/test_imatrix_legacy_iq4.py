"""Importance-matrix encoding of Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS against ggml's C quantizers.

The oracle is ``ggml_quantize_chunk`` of the libggml-base.so llama-cpp-python 0.3.36 installs, with
``quant_weights`` (tests/helpers/ggml_oracle.py), which is what llama-quantize --imatrix calls: every
case compares the whole encoded array, byte for byte. Those tests skip without llama_cpp; the golden
hashes at the end (taken from the C oracle) run everywhere. Q8_0 takes the weights and ignores them,
as C does.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable

import gguf
import numpy as np
import pytest

import convert.gguf.codecs.iq4_nl as iq4_nl
import convert.gguf.codecs.iq4_xs as iq4_xs
import convert.gguf.codecs.legacy as legacy
import convert.gguf.codecs.legacy_imatrix as legacy_imatrix
from convert.gguf.codecs import CODECS
from tests.gguf.codecs.test_kquant_scale import _edge_blocks, _golden_input, _nonfinite
from tests.helpers.fixtures import REFERENCES, read_safetensors
from tests.helpers.ggml_oracle import GgmlOracle as Oracle
from tests.helpers.ggml_oracle import ggml_oracle

GT = gguf.GGMLQuantizationType
TYPES = [GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.IQ4_NL, GT.IQ4_XS]
IDS = [t.name for t in TYPES]


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return ggml_oracle()


def _check(oracle: Oracle, t: GT, x: np.ndarray, qw: np.ndarray, what: str = "") -> None:
    """Our bytes with ``qw`` equal C's; names the first differing block and its values when not."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    got = CODECS[t].quantize(x, qw)
    want = oracle.quantize(t, x, qw)
    assert got.dtype == np.uint8 and got.shape == want.shape
    if not np.array_equal(got, want):
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        bad = np.nonzero((got.reshape(-1, ts) != want.reshape(-1, ts)).any(axis=1))[0]
        pytest.fail(f"{t.name} {what}: {bad.size} blocks differ, first {bad[0]}: "
                    f"ours {got.reshape(-1, ts)[bad[0]].tolist()} C {want.reshape(-1, ts)[bad[0]].tolist()} "
                    f"x {x.reshape(-1, bs)[bad[0]].tolist()}")


def _lognormal(rng: np.random.Generator, n: int) -> np.ndarray:
    """An imatrix row like llama-imatrix's (mean squared activations): positive, spread over decades."""
    return np.exp(rng.standard_normal(n) * 1.5 - 2).astype(np.float32)


#: imatrix rows for n columns: zeros, tiny, huge, equal, and mixtures of them.
IMATRICES: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "lognormal": _lognormal,
    "all_zero": lambda rng, n: np.zeros(n, np.float32),
    "some_zero": lambda rng, n: np.where(rng.random(n) < 0.3, 0, _lognormal(rng, n)).astype(np.float32),
    "zero_blocks": lambda rng, n: np.where((np.arange(n) // 32) % 3 == 1, 0, _lognormal(rng, n)).astype(np.float32),
    "all_equal_1": lambda rng, n: np.ones(n, np.float32),
    "all_equal_7": lambda rng, n: np.full(n, 7.25, np.float32),
    "tiny": lambda rng, n: (_lognormal(rng, n) * np.float32(1e-30)).astype(np.float32),
    "subnormal": lambda rng, n: np.full(n, 1e-42, np.float32),
    "huge": lambda rng, n: (_lognormal(rng, n) * np.float32(1e30)).astype(np.float32),
    "overflowing": lambda rng, n: np.full(n, 3e38, np.float32),  # w = qw * sqrt(...) overflows to inf
    "one_hot": lambda rng, n: (np.arange(n) % 32 == 5).astype(np.float32) * np.float32(100),
    "wild": lambda rng, n: (rng.random(n) * 10.0 ** rng.uniform(-40, 38, n)).astype(np.float32),
}


def _sizes(t: GT) -> list[int]:
    return [256, 512, 4096] + ([32, 96, 288] if t == GT.IQ4_NL else [])


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_random_rows(oracle: Oracle, t: GT) -> None:
    """Normal and heavy-tailed rows of several lengths, a lognormal imatrix."""
    for n in _sizes(t):
        rng = np.random.default_rng(n)
        qw = _lognormal(rng, n)
        _check(oracle, t, rng.standard_normal((16, n), dtype=np.float32), qw, f"normal n={n}")
        x = (rng.standard_t(2, (16, n)) * 10.0 ** rng.uniform(-6, 3, (16, 1))).astype(np.float32)
        _check(oracle, t, x, qw, f"student-t n={n}")
        sparse = (rng.standard_normal((8, n)) * (rng.random((8, n)) < 0.1)).astype(np.float32)
        _check(oracle, t, sparse, qw, f"sparse n={n}")


@pytest.mark.parametrize("t", TYPES, ids=IDS)
@pytest.mark.parametrize("kind", sorted(IMATRICES))
def test_imatrix_kinds(oracle: Oracle, t: GT, kind: str) -> None:
    """imatrix rows holding zeros (everywhere, scattered, whole blocks), tiny, subnormal, huge, overflowing,
    equal and one-hot values, on normal rows and on the edge rows."""
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    qw = IMATRICES[kind](rng, 512)
    _check(oracle, t, rng.standard_normal((16, 512), dtype=np.float32), qw, kind)
    _check(oracle, t, _edge_blocks().reshape(-1, 512), qw, f"{kind} edge")


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_edge_blocks(oracle: Oracle, t: GT) -> None:
    """Each edge case (all zero, constant, one large value, tiny/subnormal values, x*x overflowing, ties,
    integer grids) alone in its row (the legacy types' sigma2 is the row's) and beside normal blocks."""
    rng = np.random.default_rng(5)
    edge = _edge_blocks()
    _check(oracle, t, edge, _lognormal(rng, 256), "alone")
    mixed = rng.standard_normal((edge.shape[0], 1024)).astype(np.float32)
    mixed[:, 256:512] = edge
    _check(oracle, t, mixed, _lognormal(rng, 1024), "beside normal blocks")
    blocks = []  # single blocks of one kind each, for the 32-wide types
    for v in (0.0, -0.0, 1.0, -3.0, 1e-20, 3.4e38, -3.4e38, 1e-45):
        for pos in (0, 13, 31):
            b = np.zeros(32, np.float32)
            b[pos] = v
            blocks.append(b)
        blocks.append(np.full(32, v, np.float32))
    zeros = np.zeros(32, np.float32)
    zeros[[1, 4, 9]] = -0.0
    blocks += [zeros, -zeros, np.array([1.0, -1.0] * 16, np.float32), np.array([-0.0, 2.0] * 16, np.float32),
               np.array([0.0, -2.0] * 16, np.float32), np.abs(rng.standard_normal(32)).astype(np.float32),
               -np.abs(rng.standard_normal(32)).astype(np.float32)]
    x = np.concatenate([np.stack(blocks), np.zeros((-len(blocks) % 8, 32), np.float32)]).reshape(-1, 256)
    _check(oracle, t, x, _lognormal(rng, 256), "single blocks")
    _check(oracle, t, x, np.ones(256, np.float32), "single blocks, equal weights")


def _signed_zero_blocks() -> tuple[np.ndarray, np.ndarray]:
    """One row of blocks whose weighted sums have only -0.0 terms (weight 0 on the negative values, -0.0 where
    the weight is not 0), and its imatrix row: C's sums from 0 give +0.0, make_qkx3_quants' ``sum_x`` (from its
    first term) -0.0, which reaches Q5_1's stored minimum as -0.0."""
    rng = np.random.default_rng(3)
    rows, qws = [], []
    for lead in (-1.0, -2.5, -3e-3, -7.0):
        b = np.full(32, -0.0, np.float32)
        b[0] = lead
        rows.append(b)
        qws.append(np.r_[0, np.ones(31)])
        b = -np.abs(rng.standard_normal(32)).astype(np.float32)
        b[1:6] = -0.0
        rows.append(b)
        qws.append(np.r_[0, np.ones(5), np.zeros(26)])
    for s in (1.0, 0.01, 50.0):
        b = (-np.abs(rng.standard_normal(32)) * s).astype(np.float32)
        b[[0, 5, 17]] = -0.0
        rows.append(b)
        qws.append(np.isin(np.arange(32), [0, 5, 17]) * (np.arange(32) % 4 + 1.0))
    return np.concatenate(rows).reshape(1, -1).astype(np.float32), np.concatenate(qws).astype(np.float32)


@pytest.mark.parametrize("t", TYPES[:5], ids=IDS[:5])
def test_signed_zero_sums(oracle: Oracle, t: GT) -> None:
    x, qw = _signed_zero_blocks()
    _check(oracle, t, x, qw)
    if t == GT.Q5_1:  # the case is real: C stores m = -0.0 (and d = +0.0) for some of these blocks
        m = oracle.quantize(t, x, qw).reshape(-1, 24)[:, :4].copy().view("<u2")
        assert ((m[:, 0] == 0) & (m[:, 1] == 0x8000)).any()


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_wild_magnitudes(oracle: Oracle, t: GT) -> None:
    """Every value its own magnitude (1e-40 .. 1e38, float32 overflow to inf in x*x and in sums), rows of
    one scale 1e-20 .. 1e20, and integer grids times powers of two (rounding ties)."""
    rng = np.random.default_rng(777)
    with np.errstate(over="ignore"):
        wild = (rng.standard_normal((64, 512)) * 10.0 ** rng.uniform(-40, 38, (64, 512))).astype(np.float32)
    scaled = (rng.standard_normal((64, 512)) * 10.0 ** rng.uniform(-20, 20, (64, 1))).astype(np.float32)
    grid = (rng.integers(-40, 40, (64, 512)) * 2.0 ** rng.integers(-20, 20, (64, 1))).astype(np.float32)
    for name, x in (("wild", wild), ("scaled", scaled), ("grid", grid)):
        _check(oracle, t, x, _lognormal(rng, 512), name)
        _check(oracle, t, x, IMATRICES["wild"](rng, 512), f"{name}, wild imatrix")


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_nonfinite(oracle: Oracle, t: GT) -> None:
    """NaN (payloads, signalling, both signs), +-inf and x*x overflow in rows: C's bytes, NaN signs of ``d``
    included (a legacy row's sigma2 is then NaN or inf: every block of the row goes through NaN/inf
    arithmetic; which NaN C's row sum ends on is its loop's, see ``legacy_imatrix._sum_nan``)."""
    rng = np.random.default_rng(21)
    _check(oracle, t, _nonfinite(rng), _lognormal(rng, 512), "kquant_scale's rows")
    x = rng.standard_normal((48, 512)).astype(np.float32)
    for r in range(48):
        k = int(rng.integers(1, 6))
        pos = rng.choice(512, k, replace=False)
        bits = rng.integers(1, 2**22, k) | 0x7F800000 | (rng.integers(0, 2, k) << 31) | (rng.integers(0, 2, k) << 22)
        kind = rng.integers(0, 3, k)
        x[r, pos] = np.where(kind == 0, bits.astype(np.uint32).view(np.float32), np.where(kind == 1, np.inf, -np.inf))
    x[::7, 64:96] = np.nan
    qw = _lognormal(rng, 512)
    qw[::11] = 0
    _check(oracle, t, x, qw, "random NaN payloads and infinities")


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_real_weights(oracle: Oracle, t: GT) -> None:
    """Every 2-D tensor of the fixture models' dequantized weights (bf16 -> float32), an imatrix from a
    lognormal draw and one from the squared column norms (activation-like: large where the weights are)."""
    for ref in sorted({REFERENCES[k] for k in ("llama_nf4_dq", "llama_fp4_nodq", "llama_int8")}):
        for name, w in sorted(read_safetensors(ref).items()):
            if w.ndim != 2 or w.shape[1] % CODECS[t].block_size():
                continue
            x = np.asarray(w, dtype=np.float32)
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            _check(oracle, t, x, _lognormal(rng, x.shape[1]), f"{ref.parent.parent.name} {name}")
            col = np.square(x, dtype=np.float32).mean(axis=0, dtype=np.float32)
            _check(oracle, t, x, col, f"{ref.parent.parent.name} {name}, column norms")


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_ragged_chunks(oracle: Oracle, t: GT, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks and pieces that cut rows anywhere (the block -> column and block -> row maps), one-block
    pieces (sums by the explicit loop), single rows and single blocks."""
    monkeypatch.setattr(legacy, "CHUNK_BLOCKS", 13)
    monkeypatch.setattr(legacy_imatrix, "WEIGHTED_BLOCKS", 5)
    monkeypatch.setattr(iq4_nl, "CHUNK_BLOCKS", 11)
    monkeypatch.setattr(iq4_xs, "CHUNK_BLOCKS", 3)
    rng = np.random.default_rng(31)
    x = (rng.standard_t(3, (7, 768)) * 0.02).astype(np.float32)
    qw = _lognormal(rng, 768)
    _check(oracle, t, x, qw, "ragged")
    _check(oracle, t, x[:1], qw, "one row")
    monkeypatch.setattr(legacy_imatrix, "WEIGHTED_BLOCKS", 1)
    _check(oracle, t, x[:2], qw, "one-block pieces")
    if t != GT.IQ4_XS:
        _check(oracle, t, x[:3, :32], qw[:32], "one block a row")
        _check(oracle, t, x[:1, :32], qw[:32], "one block")


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_leading_axes_and_no_rows(oracle: Oracle, t: GT) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 512), dtype=np.float32)
    qw = _lognormal(rng, 512)
    got = CODECS[t].quantize(x, qw)
    assert got.shape == (2, 3, 512 // CODECS[t].block_size() * CODECS[t].type_size())
    np.testing.assert_array_equal(got.reshape(6, -1), oracle.quantize(t, x.reshape(6, 512), qw))
    assert CODECS[t].quantize(np.zeros((0, 512), np.float32), qw).shape == (0, got.shape[-1])


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_weights_change_the_bytes(oracle: Oracle, t: GT) -> None:
    """The weighted path is not the unweighted one (C's bytes differ), and weights=None keeps C's
    unweighted bytes."""
    x = np.random.default_rng(6).standard_normal((8, 512), dtype=np.float32)
    qw = _lognormal(np.random.default_rng(7), 512)
    plain = CODECS[t].quantize(x)
    np.testing.assert_array_equal(plain, oracle.quantize(t, x))
    np.testing.assert_array_equal(CODECS[t].quantize(x, None), plain)
    assert not np.array_equal(CODECS[t].quantize(x, qw), plain)
    assert CODECS[t].uses_imatrix


def test_q8_0_ignores_weights(oracle: Oracle) -> None:
    x = np.random.default_rng(8).standard_normal((8, 512), dtype=np.float32)
    qw = _lognormal(np.random.default_rng(9), 512)
    got = CODECS[GT.Q8_0].quantize(x, qw)
    np.testing.assert_array_equal(got, oracle.quantize(GT.Q8_0, x, qw))
    np.testing.assert_array_equal(got, CODECS[GT.Q8_0].quantize(x))
    np.testing.assert_array_equal(CODECS[GT.Q8_0].quantize_measured(x, weights=qw).data, got)
    assert not CODECS[GT.Q8_0].uses_imatrix


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_bad_weights_shape(t: GT) -> None:
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(ValueError, match="importance matrix row of shape"):
        CODECS[t].quantize(x, np.ones(256, np.float32))
    with pytest.raises(ValueError, match="importance matrix row of shape"):
        CODECS[t].quantize(x, np.ones((2, 512), np.float32))
    with pytest.raises(ValueError, match="multiple of"):
        CODECS[t].quantize(np.zeros((2, 100), np.float32), np.ones(100, np.float32))


@pytest.mark.parametrize("t", [GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1], ids=lambda t: t.name)
def test_quantize_measured_with_weights(t: GT) -> None:
    """The legacy codecs' chunked quantize_measured takes the weights: the bytes of quantize, the error of
    decoding them, the same pieces when the tensor is split in two calls at a row (start), bf16 input
    widened chunk by chunk, and inf in an unmeasured piece seen."""
    import ml_dtypes

    rng = np.random.default_rng(14)
    x = (rng.standard_normal((legacy.SAMPLE_BLOCKS * 6 // 8 + 6, 256)) * 0.03).astype(np.float32)
    qw = _lognormal(rng, 256)
    want = CODECS[t].quantize(x, qw)
    full = CODECS[t].quantize_measured(x, weights=qw)
    np.testing.assert_array_equal(full.data, want)
    err = gguf.quants.dequantize(want, t).astype(np.float64) - x
    assert full.max_err == np.abs(err).max() and full.measured == x.size
    assert full.sq_err == pytest.approx(float((err * err).sum()), rel=1e-4)
    m = CODECS[t].quantize_measured(x, 4, weights=qw)
    a = CODECS[t].quantize_measured(x[:1001], 4, weights=qw)
    b = CODECS[t].quantize_measured(x[1001:], 4, start=1001 * 256, weights=qw)
    np.testing.assert_array_equal(np.concatenate([a.data, b.data]), want)
    assert a.measured + b.measured == m.measured and max(a.max_err, b.max_err) == m.max_err
    xb = x.astype(ml_dtypes.bfloat16)
    got = CODECS[t].quantize_measured(xb, weights=qw)
    ref = CODECS[t].quantize_measured(xb.astype(np.float32), weights=qw)
    np.testing.assert_array_equal(got.data, ref.data)
    assert got[1:] == ref[1:]
    x[legacy.SAMPLE_BLOCKS // 8 * 3 + 1, 40] = np.inf  # in piece 3, not measured with sample=4
    assert not np.isfinite(CODECS[t].quantize_measured(x, 4, weights=qw).sq_ref)


@pytest.mark.parametrize("t", [GT.IQ4_NL, GT.IQ4_XS], ids=lambda t: t.name)
def test_quantize_measured_with_weights_iq4(t: GT) -> None:
    x = np.random.default_rng(15).standard_normal((64, 512), dtype=np.float32)
    qw = _lognormal(np.random.default_rng(16), 512)
    m = CODECS[t].quantize_measured(x, weights=qw)
    np.testing.assert_array_equal(m.data, CODECS[t].quantize(x, qw))


# sha256 of the C oracle's output (ggml_quantize_chunk with quant_weights, libggml-base.so of llama-cpp-python
# 0.3.36), computed from the C library, not from our encoders, for _golden_input(seed) and _golden_imatrix(seed).
GOLDEN: dict[tuple[str, int], str] = {
    ("Q4_0", 0): "14ef0406d2b14199ed667cf6f27a1779d11063df227828f496a46ccae58e655c",
    ("Q4_0", 1): "14535acd65e531e0b4aa3d826dae6cacd45e4ee18b5c831e40adeb0c17dc7a93",
    ("Q4_0", 2): "b108d8b80fbb7ea7499cd1fc603e09e4388ae880b3bf72fb5f81903038880955",
    ("Q4_1", 0): "2887249766f86e550f8b90b7b54b30652f9c15a4b896973aa47335e81106b1fb",
    ("Q4_1", 1): "6ca4e85bdf9d8ea23c9659edfef1e65d14a7d3244021a7232d909247a8ef1dbc",
    ("Q4_1", 2): "f9bb35a1ba18a1870a9e452ac2e90d5fa272b1aafe9ea2469bac8a85af5607e0",
    ("Q5_0", 0): "3375c783630ce4e394a7e47b87e6264d8fc4b11a62282ede9e7e8bb40b7945d6",
    ("Q5_0", 1): "dec0da7872b3df89e47b5301827eb1e16b82633516086a807bd0f1995e8c4ca3",
    ("Q5_0", 2): "8bca12e3984e6e801fe06cc0b3fe774a0d922f4c3d712f4d6d913a5bc7a8a0f6",
    ("Q5_1", 0): "b7f0e7ba95160091c9471179d8edd752fcd688247bde8e9693a656b6efd35fe6",
    ("Q5_1", 1): "27a85c56db3ad9110a2abdb8abf78aaade2a9264fb267126b3319669000c6037",
    ("Q5_1", 2): "e25a29ed58b63f27c5181348fd4041b1e04d63024796b8cd32e62c808eff629b",
    ("IQ4_NL", 0): "5f45bf31090b8284e219ae37ebb79f9858b24aa30b319b5acbf822e08e8a22c4",
    ("IQ4_NL", 1): "0195f5d04bb5cea5ee58619b6bc19f425b84f108416f0cdc847cb52acad2e357",
    ("IQ4_NL", 2): "07db1d9d2f0b683dca72496f70c52e897d4d92afd27c33020ffeea8cebf83472",
    ("IQ4_XS", 0): "1429533df0ff0a2732283129b804fe9be3c0375e4c88a01b55b35c285dd33297",
    ("IQ4_XS", 1): "acced7b1fef58f4a6c4d5e00797aa9a7ea0d501712725fcd6302172c5e02f215",
    ("IQ4_XS", 2): "ce18b8a7486c88131e653fab8022ea6ae36e23652cb6ba7e842f1de36d5eb6c8",
}


def _golden_imatrix(seed: int) -> np.ndarray:
    """float32 (1024,) from integer arithmetic only: values 1/64 .. 1000/64 (exact), every 37th column 0."""
    j = np.arange(1024, dtype=np.uint64)
    k = ((j + np.uint64(seed * 131 + 7)) * np.uint64(2654435761)) % np.uint64(1000) + np.uint64(1)
    qw = k.astype(np.float32) / np.float32(64)
    qw[::37] = 0
    return qw


@pytest.mark.parametrize(("tname", "seed"), sorted(GOLDEN))
def test_golden_hashes(tname: str, seed: int) -> None:
    codec = CODECS[GT[tname]]
    got = hashlib.sha256(codec.quantize(_golden_input(seed), _golden_imatrix(seed)).tobytes()).hexdigest()
    assert got == GOLDEN[(tname, seed)]

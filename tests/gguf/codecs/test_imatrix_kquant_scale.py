"""Byte identity of the Q6_K / Q3_K encoders with an importance matrix (``weights``) with ggml's C
(``quantize_row_q6_K_impl`` / ``quantize_row_q3_K_impl``, reached through ``ggml_quantize_chunk`` with
``quant_weights``, as llama-quantize --imatrix calls it).

The oracle is libggml-base.so of llama-cpp-python 0.3.36 (tests/helpers/ggml_oracle.py); those tests
skip without llama_cpp. The golden hashes at the end (taken from the C oracle) run everywhere.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from convert.gguf.codecs import CODECS
from convert.gguf.codecs.base import Codec
from convert.gguf.codecs.kquant_scale import Q3_KCodec, Q6_KCodec
from tests.gguf.codecs.test_kquant_scale import _edge_blocks, _golden_input, _nonfinite
from tests.helpers.fixtures import REFERENCES, read_safetensors
from tests.helpers.ggml_oracle import GgmlOracle as Oracle
from tests.helpers.ggml_oracle import ggml_oracle

CODEC_LIST: list[type[Codec]] = [Q6_KCodec, Q3_KCodec]
IDS = [c.ggml_type.name for c in CODEC_LIST]


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return ggml_oracle()


def _check(oracle: Oracle, codec: type[Codec], x: np.ndarray, w: np.ndarray, what: str = "") -> None:
    """Our bytes equal C's for ``x`` (float32 ``(rows, n)``) with importance row ``w``; names the rows that differ."""
    got = codec.quantize(x, w)
    want = oracle.quantize(codec.ggml_type, x, w)
    assert got.shape == want.shape and got.dtype == np.uint8
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"{what}: rows {bad[:8]} of {x.shape[0]} differ"


def _imatrix_random(rng: np.random.Generator, n: int) -> np.ndarray:
    """Like llama-imatrix's output: per-column mean squared activations, log-normal over ~6 decades."""
    return np.exp(rng.normal(0, 2.5, n)).astype(np.float32)


def _imatrix_zeros(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random with a third of the columns zero, a whole sub-block zero and, past 256, a whole super-block."""
    w = _imatrix_random(rng, n)
    w[rng.random(n) < 0.33] = 0
    w[16:32] = 0
    if n > 256:
        w[256:512] = 0
    return w


IMATRIX: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "random": _imatrix_random,
    "zeros": _imatrix_zeros,
    "all_zero": lambda rng, n: np.zeros(n, np.float32),
    "ones": lambda rng, n: np.ones(n, np.float32),
    "equal": lambda rng, n: np.full(n, 0.37, np.float32),
    "tiny": lambda rng, n: (rng.random(n) * 1e-38).astype(np.float32),          # subnormals included
    "huge": lambda rng, n: (rng.random(n) * 3e38).astype(np.float32),           # w*x*l and sums overflow
    "mixed": lambda rng, n: (10.0 ** rng.uniform(-45, 38, n)).astype(np.float32),
    "int": lambda rng, n: rng.integers(0, 4, n).astype(np.float32),             # ties in the weighted sums
}

XCASES: dict[str, Callable[[np.random.Generator], np.ndarray]] = {
    "normal256": lambda rng: rng.standard_normal((64, 256), dtype=np.float32),
    "normal512": lambda rng: rng.standard_normal((32, 512), dtype=np.float32) * np.float32(0.02),
    "normal4096": lambda rng: rng.standard_normal((6, 4096), dtype=np.float32),
    "student_t2": lambda rng: (rng.standard_t(2, (16, 1024)) * 0.02).astype(np.float32),
    "sparse": lambda rng: (rng.standard_normal((16, 512)) * (rng.random((16, 512)) < 0.05)).astype(np.float32),
    "edge": lambda rng: _edge_blocks(),
    "nonfinite": _nonfinite,
}


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
@pytest.mark.parametrize("wcase", sorted(IMATRIX))
@pytest.mark.parametrize("xcase", sorted(XCASES))
def test_matches_c(oracle: Oracle, codec: type[Codec], xcase: str, wcase: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{xcase}/{wcase}".encode()))
    x = XCASES[xcase](rng)
    with np.errstate(over="ignore"):
        w = IMATRIX[wcase](rng, x.shape[1])
    _check(oracle, codec, x, w, f"{xcase}/{wcase}")


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_nonfinite_imatrix(oracle: Oracle, codec: type[Codec]) -> None:
    """inf and NaN in the importance row itself (llama-imatrix never writes them; C's arithmetic
    goes through them and so does ours)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 512), dtype=np.float32)
    w = _imatrix_random(rng, 512)
    w[3], w[40:56], w[300] = np.inf, np.nan, -np.inf
    _check(oracle, codec, x, w, "inf/nan imatrix")
    _check(oracle, codec, _nonfinite(rng), w, "inf/nan imatrix and x")


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_many_superblocks(oracle: Oracle, codec: type[Codec]) -> None:
    """4096 super-blocks of their own scale (1e-20 .. 1e20), shape and sparsity, 64 per row, under
    one importance row whose super-blocks differ too (the row's block index picks its weights)."""
    rng = np.random.default_rng(12345)
    nb = 4096
    scale = 10.0 ** rng.uniform(-20, 20, (nb, 1))
    kind = rng.integers(0, 4, (nb, 1))
    base = np.where(kind == 0, rng.standard_normal((nb, 256)),
                    np.where(kind == 1, rng.standard_t(1.5, (nb, 256)),
                             np.where(kind == 2, rng.uniform(-1, 1, (nb, 256)), rng.integers(-4, 5, (nb, 256)))))
    keep = rng.random((nb, 256)) >= rng.uniform(0, 0.9, (nb, 1))
    x = (base * scale * keep).astype(np.float32).reshape(64, -1)
    w = (_imatrix_random(rng, x.shape[1]).reshape(-1, 256) * 10.0 ** rng.uniform(-8, 8, (64, 1))).astype(np.float32)
    _check(oracle, codec, x, w.reshape(-1), "many")


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_wild_magnitudes(oracle: Oracle, codec: type[Codec]) -> None:
    """Every weight of its own magnitude (1e-40 .. 1e38, overflow to inf included) and integer grids
    times powers of two, under a mixed-magnitude importance row."""
    rng = np.random.default_rng(777)
    with np.errstate(over="ignore"):
        wild = (rng.standard_normal((512, 256)) * 10.0 ** rng.uniform(-40, 38, (512, 256))).astype(np.float32)
    grid = (rng.integers(-40, 40, (512, 256)) * 2.0 ** rng.integers(-20, 20, (512, 1))).astype(np.float32)
    x = np.concatenate([wild, grid]).reshape(64, -1)
    _check(oracle, codec, x, IMATRIX["mixed"](rng, x.shape[1]), "wild/mixed")
    _check(oracle, codec, x, _imatrix_random(rng, x.shape[1]), "wild/random")


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_real_weights(oracle: Oracle, codec: type[Codec]) -> None:
    """The fixture models' dequantized weights (bf16 -> float32), every 2-D tensor, with an importance
    row made from the tensor itself (its column mean of squares, like activations of that scale)
    and a random one."""
    rng = np.random.default_rng(11)
    checked = 0
    for path in sorted(set(REFERENCES.values())):
        for name, t in sorted(read_safetensors(path).items()):
            if t.ndim != 2 or t.shape[1] % 256:
                continue
            x = np.asarray(t, dtype=np.float32)
            own = np.mean(x.astype(np.float64) ** 2, axis=0).astype(np.float32)
            _check(oracle, codec, x, own, f"{path.parent.parent.name}/{name}")
            _check(oracle, codec, x, _imatrix_random(rng, x.shape[1]), f"{path.parent.parent.name}/{name}")
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_ragged_chunks(oracle: Oracle, codec: type[Codec], monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk sizes that are not a multiple of the row's super-blocks, and smaller than a row, give the
    same bytes (chunks are whole rows, so each row meets its own importance weights)."""
    import convert.gguf.codecs.kquant_scale as ks

    rng = np.random.default_rng(99)
    for chunk in (1, 3, 5):
        monkeypatch.setattr(ks, "CHUNK_BLOCKS", chunk)
        for n in (256, 512, 1024):
            x = (rng.standard_t(2, (7, n)) * 0.02).astype(np.float32)
            _check(oracle, codec, x, _imatrix_zeros(rng, n), f"chunk {chunk}, n {n}")


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_shapes_and_dtypes(oracle: Oracle, codec: type[Codec]) -> None:
    """(..., n) inputs keep their leading axes, a 1-D row is one row, no rows give no bytes, and
    bfloat16/float16 input encodes as its float32 widening."""
    rng = np.random.default_rng(4)
    w = _imatrix_random(rng, 512)
    ts = codec.type_size()
    assert codec.quantize(np.zeros((0, 512), np.float32), w).shape == (0, 2 * ts)
    x = rng.standard_normal((2, 3, 512), dtype=np.float32)
    got = codec.quantize(x, w)
    assert got.shape == (2, 3, 2 * ts)
    np.testing.assert_array_equal(got.reshape(6, -1), oracle.quantize(codec.ggml_type, x.reshape(6, 512), w))
    np.testing.assert_array_equal(codec.quantize(x[0, 0], w), got[0, 0])
    for dt in (ml_dtypes.bfloat16, np.float16):
        xd = x.reshape(6, 512).astype(dt)
        np.testing.assert_array_equal(codec.quantize(xd, w), codec.quantize(xd.astype(np.float32), w))


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_measured_with_weights(oracle: Oracle, codec: type[Codec]) -> None:
    """quantize_measured passes the importance row on: C's bytes, into ``out``, and the error they add."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 1024), dtype=np.float32)
    w = _imatrix_random(rng, 1024)
    out = np.empty((8, 4 * codec.type_size()), np.uint8)
    m = codec.quantize_measured(x, out=out, weights=w)
    want = oracle.quantize(codec.ggml_type, x, w)
    assert m.data is out
    np.testing.assert_array_equal(out, want)
    err = oracle.dequantize(codec.ggml_type, want) - x
    assert m.max_err == pytest.approx(float(np.abs(err).max()), rel=1e-6)
    assert m.sq_err == pytest.approx(float(np.square(err, dtype=np.float64).sum()), rel=1e-4)
    assert m.measured == x.size


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_weights_change_the_bytes(oracle: Oracle, codec: type[Codec]) -> None:
    """With weights the encoder is not the ref one (C: ``_impl`` rather than ``_ref``), and None keeps
    the ref bytes; the importance row lowers the weighted error it is meant to lower."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 1024), dtype=np.float32)
    w = np.where(rng.random(1024) < 0.1, 100.0, 0.01).astype(np.float32)
    plain = codec.quantize(x)
    np.testing.assert_array_equal(plain, oracle.quantize(codec.ggml_type, x))
    np.testing.assert_array_equal(codec.quantize(x, None), plain)
    weighted = codec.quantize(x, w)
    assert not np.array_equal(weighted, plain)

    def werr(q: np.ndarray) -> float:
        return float((w * (oracle.dequantize(codec.ggml_type, q) - x) ** 2).sum())

    assert werr(weighted) < werr(plain)


def test_uses_imatrix() -> None:
    assert Q6_KCodec.uses_imatrix and Q3_KCodec.uses_imatrix
    assert CODECS[Q6_KCodec.ggml_type] is Q6_KCodec and CODECS[Q3_KCodec.ggml_type] is Q3_KCodec


@pytest.mark.parametrize("codec", CODEC_LIST, ids=IDS)
def test_rejects_bad_shapes(codec: type[Codec]) -> None:
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(ValueError, match=r"importance weights of shape \(512,\), got \(256,\)"):
        codec.quantize(x, np.ones(256, np.float32))
    with pytest.raises(ValueError, match=r"importance weights of shape \(512,\), got \(2, 512\)"):
        codec.quantize(x, np.ones((2, 512), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        codec.quantize(np.zeros((2, 100), np.float32), np.ones(100, np.float32))


# sha256 of the C oracle's output (ggml_quantize_chunk with quant_weights, libggml-base.so of
# llama-cpp-python 0.3.36), computed from the C library, not from our encoders, for
# _golden_input(seed) and _golden_imatrix(seed).
GOLDEN: dict[tuple[str, int], str] = {
    ("Q6_K", 0): "08587fe1696f9ea4e9614f64c0c54b78f271150c549bec525a8efaa004c0989e",
    ("Q6_K", 1): "068bcaf906cccdd5e7fd34fafc6f48e46dfeb93c0cb16fae47cf7adfa3b12fe4",
    ("Q6_K", 2): "337b5fa6dabb1ed402d51426ce5012086f7518fc1791180372f62bd9baba8841",
    ("Q3_K", 0): "e1df454dd8356768aa9267f4422774fd1671a6dd2e01c330d54197e05234f71f",
    ("Q3_K", 1): "a82b0204a9b3d1775b3f1143be42b9d758167897c5f5e9b9a796e52e4e81f132",
    ("Q3_K", 2): "1d567a5df22fe9feb0886417887540142a1ba55e2443b43854be83a5f8f81b61",
}


def _golden_imatrix(seed: int) -> np.ndarray:
    """float32 (1024,) importance row from integer arithmetic only (an LCG; exact float32 ops), so the
    bytes do not depend on NumPy's random streams: 2**-12 .. 2**12 times (1 + k/64), a run of zeros."""
    i = np.arange(1024, dtype=np.uint64) + np.uint64(seed * 104729 + 3)
    state = i * np.uint64(2862933555777941757) + np.uint64(3037000493)
    state = state * np.uint64(2862933555777941757) + np.uint64(3037000493)
    k = ((state >> np.uint64(33)) & np.uint64(63)).astype(np.float32)
    e = ((state >> np.uint64(45)) % np.uint64(25)).astype(np.float32) - np.float32(12)
    w = (np.float32(1) + k / np.float32(64)) * np.float32(2) ** e
    w[100:140] = 0
    return w


@pytest.mark.parametrize(("tname", "seed"), sorted(GOLDEN))
def test_golden_hashes(tname: str, seed: int) -> None:
    codec = {c.ggml_type.name: c for c in CODEC_LIST}[tname]
    got = hashlib.sha256(codec.quantize(_golden_input(seed), _golden_imatrix(seed)).tobytes()).hexdigest()
    assert got == GOLDEN[(tname, seed)]

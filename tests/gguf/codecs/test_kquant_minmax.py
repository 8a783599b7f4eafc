"""Q4_K, Q5_K and Q2_K encoders (convert.gguf.codecs.kquant_minmax): byte identity with llama.cpp's C reference.

The oracle is the ``quantize_row_q{4,5,2}_K_ref`` / ``dequantize_row_q{4,5,2}_K`` exported by the
``libggml-base.so`` of llama-cpp-python (0.3.36, the revision the encoders pin), loaded with ctypes;
those tests skip without ``llama_cpp``. :func:`test_golden_hashes` runs without it: its sha256
constants were produced by the C oracle (see ``GOLDEN``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

from convert.gguf.codecs import CODECS, codec
from convert.gguf.codecs.base import Codec, nearest_int, nearest_int_bits
from convert.gguf.codecs.kquant_minmax import CHUNK_BLOCKS, Q2_KCodec, Q4_KCodec, Q5_KCodec
from tests.helpers.fixtures import REFERENCES, read_safetensors

GT = gguf.GGMLQuantizationType
TYPES: dict[str, type[Codec]] = {"q4_K": Q4_KCodec, "q5_K": Q5_KCodec, "q2_K": Q2_KCodec}
QK_K = 256


class _Oracle:
    """ctypes access to the C reference (de)quantizers of llama-cpp-python's libggml-base.so."""

    def __init__(self) -> None:
        pytest.importorskip("llama_cpp")
        spec = importlib.util.find_spec("llama_cpp")
        assert spec is not None and spec.origin is not None
        self.lib = ctypes.CDLL(str(Path(spec.origin).parent / "lib" / "libggml-base.so"))
        for name in TYPES:
            for fn in (f"quantize_row_{name}_ref", f"dequantize_row_{name}"):
                f = getattr(self.lib, fn)
                f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                f.restype = None

    def quantize(self, name: str, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        out = np.zeros((rows, n // QK_K * TYPES[name].type_size()), dtype=np.uint8)
        getattr(self.lib, f"quantize_row_{name}_ref")(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def dequantize(self, name: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        out = np.zeros(shape, dtype=np.float32)
        getattr(self.lib, f"dequantize_row_{name}")(data.ctypes.data, out.ctypes.data, out.size)
        return out


@pytest.fixture(scope="module")
def oracle() -> _Oracle:
    return _Oracle()


def assert_same_blocks(name: str, got: np.ndarray, want: np.ndarray, labels: list[str] | None = None) -> None:
    """Same shape and bytes; on a mismatch name the first bad super-blocks (and their labels)."""
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    size = TYPES[name].type_size()
    bad = np.flatnonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))
    if bad.size:
        which = [labels[i] for i in bad[:10]] if labels else bad[:10].tolist()
        first = got.reshape(-1, size)[bad[0]] != want.reshape(-1, size)[bad[0]]
        pytest.fail(f"{name}: {bad.size} of {got.size // size} super-blocks differ: {which}; "
                    f"first one at bytes {np.flatnonzero(first)[:16].tolist()}")


# ---------------------------------------------------------------------------------------------
# inputs


def _random_rows(kind: str, seed: int, shape: tuple[int, int] = (48, 1024)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32)
    if kind == "uniform":
        return rng.uniform(-1.0, 3.0, shape).astype(np.float32)
    if kind == "uniform_pos":
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if kind == "student_t1":
        return rng.standard_t(1.0, shape).astype(np.float32)
    if kind == "student_t3":
        return (rng.standard_t(3.0, shape) * 0.02).astype(np.float32)
    if kind == "row_scales":  # every row its own magnitude, 1e-12 .. 1e12
        return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-12, 12, (shape[0], 1))).astype(np.float32)
    if kind == "offset":  # weights around a non-zero mean (norm weights, biases)
        return (rng.standard_normal(shape) * 0.05 + rng.uniform(-2, 2, (shape[0], 1))).astype(np.float32)
    if kind == "sparse":
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0.0
        return x
    if kind == "levels":  # few distinct values: ties in min/max and exact halves
        return (rng.integers(-4, 5, shape) * 0.25).astype(np.float32)
    if kind == "grid_pow2":  # integer grids times powers of two: exact .5 ties in nearest_int
        return (rng.integers(-64, 64, shape) * 2.0 ** rng.integers(-10, 10, (shape[0], 1))).astype(np.float32)
    if kind == "bf16":  # bf16-rounded weights (what bitsandbytes checkpoints dequantize to)
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)
    raise ValueError(kind)


RANDOM_KINDS = ["normal", "uniform", "uniform_pos", "student_t1", "student_t3", "row_scales", "offset", "sparse",
                "levels", "grid_pow2", "bf16"]


def _edge_blocks(with_nonfinite: bool = False) -> tuple[list[str], np.ndarray]:
    """One super-block (256 values) per row, each a corner of the algorithm."""
    rng = np.random.default_rng(1234)
    blocks: dict[str, np.ndarray] = {}

    def const(v: float) -> np.ndarray:
        return np.full(256, v, dtype=np.float32)

    def normal(scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(256) * scale).astype(np.float32)

    blocks["zeros"] = const(0.0)
    blocks["negative_zeros"] = const(-0.0)
    for v in (1.5, -2.25, 1e-20, -3e38):
        blocks[f"const_{v}"] = const(v)
    for pos in (0, 1, 15, 16, 31, 32, 100, 255):
        for v in (1.0, -1.0, 7e-39, 1e30):
            b = const(0.0)
            b[pos] = v
            blocks[f"single_{pos}_{v}"] = b
    blocks["all_negative"] = -np.abs(normal()) - np.float32(0.5)
    blocks["all_positive"] = np.abs(normal()) + np.float32(0.5)
    blocks["all_negative_tiny"] = -np.abs(normal(1e-20))
    for s in (1e-14, 1e-15, 1e-16, 1e-20, 1e-30, 1e-37, 1e-38, 1e-40, 1e-44, 1e-45, 1e-3, 1e5, 1e10, 1e20, 1e30,
              1e36, 1e38):
        blocks[f"scale_{s}"] = normal(s)
        blocks[f"scale_pos_{s}"] = np.abs(normal(s))
    blocks["subnormals"] = (rng.integers(-50, 50, 256) * np.float32(1.4e-45)).astype(np.float32)
    blocks["mixed_elements"] = (rng.standard_normal(256) * 10.0 ** rng.integers(-30, 30, 256)).astype(np.float32)
    blocks["mixed_sub16"] = (rng.standard_normal((16, 16)) * 10.0 ** rng.integers(-20, 20, (16, 1))).astype(
        np.float32).ravel()
    blocks["mixed_sub32"] = (rng.standard_normal((8, 32)) * 10.0 ** rng.integers(-20, 20, (8, 1))).astype(
        np.float32).ravel()
    blocks["sub_offsets"] = (rng.standard_normal((8, 32)) + 100 * rng.standard_normal((8, 1))).astype(
        np.float32).ravel()
    b = const(1e-3)
    b[::32] = 1e4
    blocks["outliers"] = b
    blocks["small_ints"] = rng.integers(-3, 4, 256).astype(np.float32)
    blocks["narrow_offset"] = (rng.standard_normal(256) * 1e-3 - 1).astype(np.float32)
    b = normal(100.0)
    b[:32] = -1 + normal(1e-7)[:32]  # a nearly flat sub-block next to large ones: its scale rounds to 0
    blocks["near_flat"] = b
    b = normal()
    b[:32] = -1.0
    b[32:64] = -1 + np.float32(1e-7) * (np.arange(32) % 2)
    blocks["near_flat_two"] = b
    b = normal(1e5)
    b[:32] = -1e30
    blocks["huge_min"] = b
    b = normal()
    b[::2], b[1::2] = 3.4e38, -3.4e38  # max - min overflows to inf
    blocks["float_max_alternating"] = b
    if with_nonfinite:
        blocks["inf"] = const(np.inf)
        for pos, v in ((3, np.inf), (3, -np.inf), (0, np.nan), (7, np.nan)):
            b = normal()
            b[pos] = v
            blocks[f"{v}_at_{pos}"] = b
    return list(blocks), np.stack(list(blocks.values())).astype(np.float32)


def _many_superblocks(seed: int, n_blocks: int = 4099) -> np.ndarray:
    """``n_blocks`` super-blocks of mixed distributions, scales and offsets (not a multiple of the chunk)."""
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 4, (n_blocks, 1))
    x = np.where(kind == 0, rng.standard_normal((n_blocks, 256)),
                 np.where(kind == 1, rng.standard_t(2.0, (n_blocks, 256)),
                          np.where(kind == 2, rng.uniform(-1, 1, (n_blocks, 256)),
                                   rng.exponential(1.0, (n_blocks, 256)))))
    x = x * 10.0 ** rng.uniform(-8, 8, (n_blocks, 1)) + rng.standard_normal((n_blocks, 1)) * (kind == 3)
    return x.astype(np.float32)


def _real_weights() -> np.ndarray:
    """Every 256-wide-row tensor of the dequantized NF4 fixture model, as float32 super-blocks."""
    tensors = read_safetensors(REFERENCES["llama_nf4_dq"])
    rows = [v.astype(np.float32).reshape(-1, QK_K) for _, v in sorted(tensors.items()) if v.size % QK_K == 0]
    return np.concatenate(rows)


# ---------------------------------------------------------------------------------------------
# byte identity with the C reference


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_random_rows_match_c(oracle: _Oracle, name: str, kind: str) -> None:
    for seed in (0, 1):
        x = _random_rows(kind, seed)
        assert_same_blocks(name, TYPES[name].quantize(x), oracle.quantize(name, x))


@pytest.mark.parametrize("name", TYPES)
def test_edge_blocks_match_c(oracle: _Oracle, name: str) -> None:
    labels, x = _edge_blocks()
    assert_same_blocks(name, TYPES[name].quantize(x), oracle.quantize(name, x), labels)


@pytest.mark.parametrize("name", TYPES)
def test_nonfinite_blocks_match_c(oracle: _Oracle, name: str) -> None:
    """inf and (canonical) NaN inputs too: the C comparisons and nearest_int's bit trick are reproduced."""
    labels, x = _edge_blocks(with_nonfinite=True)
    with np.errstate(all="ignore"):
        want = oracle.quantize(name, x)
    assert_same_blocks(name, TYPES[name].quantize(x), want, labels)


@pytest.mark.parametrize("name", TYPES)
def test_many_superblocks_match_c(oracle: _Oracle, name: str) -> None:
    x = _many_superblocks(5)  # 4099 super-blocks in one row: several chunks and a partial one
    assert x.shape[0] > CHUNK_BLOCKS and x.shape[0] % CHUNK_BLOCKS
    x = x.reshape(1, -1)
    assert_same_blocks(name, TYPES[name].quantize(x), oracle.quantize(name, x))


@pytest.mark.parametrize("name", TYPES)
def test_real_weights_match_c(oracle: _Oracle, name: str) -> None:
    x = _real_weights()
    assert_same_blocks(name, TYPES[name].quantize(x), oracle.quantize(name, x))


@pytest.mark.parametrize("name", TYPES)
def test_multi_block_rows_match_c(oracle: _Oracle, name: str) -> None:
    """Rows of several super-blocks: the output row is the row's blocks in order."""
    x = _random_rows("student_t3", 9, (7, 1536))
    got = TYPES[name].quantize(x)
    assert got.shape == (7, 6 * TYPES[name].type_size())
    assert_same_blocks(name, got, oracle.quantize(name, x))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_c(oracle: _Oracle, name: str) -> None:
    """Our (gguf-py) decode of our bytes equals the C ``dequantize_row_*`` bit for bit."""
    x = np.concatenate([_random_rows("normal", 3, (16, 256)), _edge_blocks()[1], _real_weights()[:64]])
    data = TYPES[name].quantize(x)
    with np.errstate(all="ignore"):  # the huge edge blocks decode to inf/NaN, in C as well
        got = TYPES[name].dequantize(data)
    want = oracle.dequantize(name, data, x.shape)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# without the oracle

#: sha256 of the C oracle's ``quantize_row_*_ref`` output (bytes, row-major) for each golden input,
#: produced with llama-cpp-python 0.3.36's libggml-base.so (ggml 0.25.3, commit 0c1e570), NOT with
#: convert.gguf.codecs.kquant_minmax, so these check the encoders where llama_cpp is not installed.
GOLDEN: dict[tuple[str, str], str] = {
    ("q4_K", "normal_seed0"): "60dfba489daf02cffbfa06a0b0fe46a4c7a0401aa5d9065f88e85eb47f070f18",
    ("q4_K", "uniform_seed1"): "805facecffb4401512f796561332824fdeb84c4af82e9ae2567ffaa57db444f5",
    ("q4_K", "edge_blocks"): "65d7ec77ad30d887de3e368b289be37c4362fc334283dc73a196a91b6701f325",
    ("q4_K", "real_weights"): "18a369c5177d992d4796f60ba61cdca711ae4313824ceb8e8212629f0cb42efa",
    ("q5_K", "normal_seed0"): "898fdb7f8baa887c5f0fc5fd6c0ee76e5c72ac6087c9c69ed74658f4d5f23735",
    ("q5_K", "uniform_seed1"): "b6ffe0f0b69eafd813db2425366cc32fa6b6e6b715a55da099aeb996bb167f29",
    ("q5_K", "edge_blocks"): "b9a2dde961ff9c5b5d2e27a51659bbd82c25fee26c5a3ff5ffe7f6eceea324c5",
    ("q5_K", "real_weights"): "884cec8d59eb3d8492b72cd2eb10cd0c8c80f26d84451f3df499ef247cdf59f2",
    ("q2_K", "normal_seed0"): "b14d3ff69ff5ac712b2a118c1e9ac51d4ce368e7ff7cf56d78458c6e1d2c28b0",
    ("q2_K", "uniform_seed1"): "d7826d8ad6ad340940703d3afd2fc4d317443c44298d0f57e6993e21c7c01a2b",
    ("q2_K", "edge_blocks"): "5467d8f9c253e84831257aca478532799befca3108f712e2c3ed3b51f063caf0",
    ("q2_K", "real_weights"): "af81642959eab8476dcc68106a16257b1c67e6be1bf726134042a80052f680fc",
}


def _golden_inputs() -> dict[str, Callable[[], np.ndarray]]:
    return {
        "normal_seed0": lambda: np.random.default_rng(0).standard_normal((16, 1024), dtype=np.float32),
        "uniform_seed1": lambda: np.random.default_rng(1).random((16, 512), dtype=np.float32) * 4 - 1,
        "edge_blocks": lambda: _edge_blocks()[1],
        "real_weights": _real_weights,
    }


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("case", list(_golden_inputs()))
def test_golden_hashes(name: str, case: str) -> None:
    x = _golden_inputs()[case]()
    digest = hashlib.sha256(TYPES[name].quantize(x).tobytes()).hexdigest()
    assert digest == GOLDEN[(name, case)]


def test_codec_table() -> None:
    assert CODECS[GT.Q4_K] is Q4_KCodec and codec(GT.Q5_K) is Q5_KCodec and codec(GT.Q2_K) is Q2_KCodec
    assert [(c.block_size(), c.type_size()) for c in TYPES.values()] == [(256, 144), (256, 176), (256, 84)]


@pytest.mark.parametrize("name", TYPES)
def test_shapes_and_errors(name: str) -> None:
    c = TYPES[name]
    assert c.quantize(np.zeros((0, 512), dtype=np.float32)).shape == (0, 2 * c.type_size())
    x64 = _random_rows("normal", 4, (3, 256)).astype(np.float64)  # float64 is rounded to float32 first
    assert np.array_equal(c.quantize(x64), c.quantize(x64.astype(np.float32)))
    with pytest.raises(ValueError):
        c.quantize(np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(ValueError):
        c.quantize(np.float32(1.0))
    row = _random_rows("normal", 5, (1, 256))  # (..., n) as gguf-py's quantize: a 1-D row is one row
    assert np.array_equal(c.quantize(row[0]), c.quantize(row)[0])


def test_nearest_int_bits() -> None:
    """The C magic-number trick: round half to even in range, its own bit pattern outside."""
    x = np.concatenate([np.random.default_rng(2).uniform(-4194303, 4194303, 10000),
                        np.arange(-8, 8) + 0.5]).astype(np.float32)
    assert np.array_equal(nearest_int_bits(x), nearest_int(x))
    odd = np.array([np.inf, -np.inf, np.nan, 2.0**23, 1e30, -1e30], dtype=np.float32)
    with np.errstate(all="ignore"):
        want = [((np.float32(v) + np.float32(12582912.0)).view(np.int32) & 0x7FFFFF) - 0x400000 for v in odd]
    assert nearest_int_bits(odd).tolist() == [int(w) for w in want]
    assert nearest_int_bits(odd)[:3].tolist() == [-4194304, -4194304, 0]


@pytest.mark.parametrize("m", [1, 2, 3, 8, 17, 4096])
@pytest.mark.parametrize("n", [16, 32])
def test_seq_sum_is_sequential(n: int, m: int) -> None:
    """``_seq_sum`` (one ``np.add.reduce(axis=0)`` for ``m >= 2``) adds row after row in float32,
    as the C loops do: pairwise or reordered summation would differ on these magnitudes."""
    from convert.gguf.codecs.kquant_minmax import _seq_sum

    rng = np.random.default_rng(n * 1000 + m)
    a = (rng.standard_normal((n, m)) * 10.0 ** rng.integers(-7, 7, (n, m))).astype(np.float32)
    a[0, 0] = -0.0
    acc0, acc1 = np.float32(0.0) + a[0], a[0].copy()
    for row in a[1:]:
        acc0, acc1 = acc0 + row, acc1 + row
    assert np.array_equal(_seq_sum(a).view(np.uint32), acc0.view(np.uint32))
    assert np.array_equal(_seq_sum(a, first=True).view(np.uint32), acc1.view(np.uint32))

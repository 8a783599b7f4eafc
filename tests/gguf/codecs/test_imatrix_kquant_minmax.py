"""Q4_K, Q5_K and Q2_K with an importance matrix (convert.gguf.codecs.kquant_minmax): byte identity with
ggml's ``quantize_row_q{4,5,2}_K_impl``.

The oracle is ``ggml_quantize_chunk`` with ``quant_weights`` in llama-cpp-python 0.3.36's libggml-base.so
(:mod:`tests.helpers.ggml_oracle`), what llama-quantize --imatrix calls; those tests skip without
``llama_cpp``. :func:`test_golden_hashes` runs without it: its sha256 constants were produced by the C
oracle (see ``GOLDEN``). The inputs (random kinds, edge blocks, fixture weights) are the no-imatrix
tests' own (:mod:`tests.gguf.codecs.test_kquant_minmax`); here each also gets importance-matrix rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import gguf
import numpy as np
import pytest

from convert.gguf.codecs import codec
from convert.gguf.codecs.base import Codec
from convert.gguf.codecs.kquant_minmax import CHUNK_BLOCKS, Q2_KCodec, Q4_KCodec, Q5_KCodec, make_qp_quants
from tests.gguf.codecs.test_kquant_minmax import RANDOM_KINDS, _edge_blocks, _random_rows, assert_same_blocks
from tests.helpers.fixtures import REFERENCES, read_safetensors
from tests.helpers.ggml_oracle import GgmlOracle, ggml_oracle

GT = gguf.GGMLQuantizationType
TYPES: dict[str, type[Codec]] = {"q4_K": Q4_KCodec, "q5_K": Q5_KCodec, "q2_K": Q2_KCodec}
QK_K = 256


@pytest.fixture(scope="module")
def oracle() -> GgmlOracle:
    return ggml_oracle()


def _imatrix(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """An importance-matrix row (float32 ``(n,)``) of the given kind."""
    rng = np.random.default_rng(seed)
    base = rng.exponential(1.0, n)
    if kind == "activations":  # what llama-imatrix stores: mean squared activation per column
        act = rng.standard_normal((64, n)) * rng.lognormal(0.0, 1.5, n)
        return (act * act).mean(axis=0).astype(np.float32)
    if kind == "exponential":
        return base.astype(np.float32)
    if kind == "some_zeros":
        return np.where(rng.random(n) < 0.3, 0.0, base).astype(np.float32)
    if kind == "zero_spans":  # whole sub-blocks of 16 and of 32 without weight
        w = base.copy()
        w[16:32] = 0.0
        w[64:128] = 0.0
        w[n - 32 :] = 0.0
        return w.astype(np.float32)
    if kind == "all_zero":
        return np.zeros(n, dtype=np.float32)
    if kind == "one_nonzero":
        w = np.zeros(n, dtype=np.float32)
        w[n // 3] = 1.0
        return w
    if kind == "tiny":
        return (base * 1e-30).astype(np.float32)
    if kind == "subnormal":
        return (base * 1e-40).astype(np.float32)
    if kind == "huge":
        return (base * 1e30).astype(np.float32)
    if kind == "near_max":  # products with it overflow to inf
        return np.full(n, 3e38, dtype=np.float32)
    if kind == "mixed_magnitudes":
        return (base * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
    if kind == "negative":  # not what llama-imatrix writes, but ggml takes it: negative weights and scales
        return (-base).astype(np.float32)
    if kind == "mixed_sign":
        return (base * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    if kind == "all_equal":
        return np.ones(n, dtype=np.float32)
    if kind == "all_equal_odd":
        return np.full(n, 0.37, dtype=np.float32)
    raise ValueError(kind)


IMATRIX_KINDS = ["activations", "exponential", "some_zeros", "zero_spans", "all_zero", "one_nonzero", "tiny",
                 "subnormal", "huge", "near_max", "mixed_magnitudes", "negative", "mixed_sign", "all_equal",
                 "all_equal_odd"]


def _imatrix_edge_blocks(with_nonfinite: bool) -> tuple[list[str], np.ndarray]:
    """The no-imatrix edge blocks and corners of the imatrix path: ``sum x*x`` of a super-block near
    float32's limit (``2*sum_x2`` overflows while ``sum_x2`` does not), a NaN at the first value of a
    later sub-block (a NaN sub-block scale after larger ones: C's ``MAX`` keeps the values after it)."""
    labels, x = _edge_blocks(with_nonfinite)
    rng = np.random.default_rng(77)
    extra: dict[str, np.ndarray] = {}
    for s in (7e17, 1e18, 1.1e18, 1.5e18):
        extra[f"sum_x2_{s}"] = (rng.standard_normal(256) * s).astype(np.float32)
    if with_nonfinite:
        for start in (32, 128, 224, 240):
            b = (rng.standard_normal(256) * np.where(np.arange(256) < start, 10.0, 1.0)).astype(np.float32)
            b[start] = np.nan
            extra[f"nan_subblock_start_{start}"] = b
    return labels + list(extra), np.concatenate([x, np.stack(list(extra.values()))])


def _mixed_rows(n: int, seed: int) -> np.ndarray:
    """Three rows of each of the no-imatrix tests' random kinds, ``n`` wide."""
    return np.concatenate([_random_rows(kind, seed, (3, n)) for kind in RANDOM_KINDS])


def _real_tensors() -> list[tuple[str, np.ndarray]]:
    """The fixture model's dequantized 2-D tensors whose rows are whole super-blocks, as float32."""
    tensors = read_safetensors(REFERENCES["llama_nf4_dq"])
    return [(k, v.astype(np.float32)) for k, v in sorted(tensors.items()) if v.ndim == 2 and v.shape[1] % QK_K == 0]


# ---------------------------------------------------------------------------------------------
# byte identity with ggml_quantize_chunk(quant_weights)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", IMATRIX_KINDS)
def test_random_rows_match_c(oracle: GgmlOracle, name: str, kind: str) -> None:
    c = TYPES[name]
    for n in (256, 512, 4096):
        x = _mixed_rows(n, n)
        w = _imatrix(kind, n, seed=n + 1)
        with np.errstate(all="ignore"):
            want = oracle.quantize(c.ggml_type, x, w)
        assert_same_blocks(name, c.quantize(x, w), want)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_edge_blocks_match_c(oracle: GgmlOracle, name: str, nonfinite: bool) -> None:
    """The no-imatrix edge blocks (all-zero, constant, single outliers, tiny, huge, all-positive,
    all-negative, ...; with inf and NaN too) under every kind of imatrix row."""
    c = TYPES[name]
    labels, x = _imatrix_edge_blocks(nonfinite)
    for kind in IMATRIX_KINDS:
        w = _imatrix(kind, QK_K, seed=3)
        with np.errstate(all="ignore"):
            want = oracle.quantize(c.ggml_type, x, w)
        assert_same_blocks(name, c.quantize(x, w), want, [f"{label}/{kind}" for label in labels])


@pytest.mark.parametrize("name", TYPES)
def test_nan_payloads_match_c(oracle: GgmlOracle, name: str) -> None:
    """NaNs with payloads (a signalling one too) and infinities among normal values, and a NaN or
    infinite imatrix value: the C comparisons and nearest_int's bit trick on them."""
    c = TYPES[name]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    payload = np.array([0x7FC00005, 0xFFC0ABCD, 0x7F800001, 0x7FFFFFFF], dtype=np.uint32).view(np.float32)
    x[0, 260:264] = payload
    x[1, 3::37] = payload[np.arange(len(x[1, 3::37])) % 4]
    x[2, 300] = np.inf
    x[3, :16] = np.nan
    x[4, 40], x[4, 41] = 3e38, -3e38
    for w_odd in (None, np.nan, np.inf):
        w = _imatrix("activations", 512, seed=5)
        if w_odd is not None:
            w[[7, 100, 300]] = w_odd
        with np.errstate(all="ignore"):
            want = oracle.quantize(c.ggml_type, x, w)
        assert_same_blocks(name, c.quantize(x, w), want)


@pytest.mark.parametrize("name", TYPES)
def test_real_weights_match_c(oracle: GgmlOracle, name: str) -> None:
    """The fixture model's weights with an activation-like imatrix row per tensor."""
    c = TYPES[name]
    for i, (key, x) in enumerate(_real_tensors()):
        w = _imatrix("activations", x.shape[1], seed=i)
        assert_same_blocks(name, c.quantize(x, w), oracle.quantize(c.ggml_type, x, w), [key] * x.shape[0])


@pytest.mark.parametrize("name", TYPES)
def test_chunks_cut_rows_match_c(oracle: GgmlOracle, name: str) -> None:
    """Rows of 3 super-blocks over several chunks, whose edges fall inside rows: each super-block
    still takes the imatrix values of its place in the row (``quant_weights + QK_K*i``)."""
    c = TYPES[name]
    x = _random_rows("student_t3", 21, (401, 3 * QK_K))
    assert x.shape[0] * 3 > CHUNK_BLOCKS and CHUNK_BLOCKS % 3
    w = _imatrix("activations", 3 * QK_K, seed=22)
    w[:QK_K] *= 1e3  # the three super-blocks' imatrix values differ in scale: a misplaced one shows
    assert_same_blocks(name, c.quantize(x, w), oracle.quantize(c.ggml_type, x, w))


@pytest.mark.parametrize("name", TYPES)
def test_measured_and_none(oracle: GgmlOracle, name: str) -> None:
    """``quantize_measured(weights=)`` encodes with them; ``weights=None`` is the no-imatrix encoding
    (``quantize_row_*_ref``), not the imatrix one with unit weights."""
    c = TYPES[name]
    x = _random_rows("normal", 31, (16, 512))
    w = _imatrix("activations", 512, seed=32)
    data = c.quantize_measured(x, weights=w).data
    assert data is not None
    assert_same_blocks(name, data, oracle.quantize(c.ggml_type, x, w))
    assert_same_blocks(name, c.quantize(x, None), oracle.quantize(c.ggml_type, x))
    assert not np.array_equal(c.quantize(x, np.ones(512, np.float32)), c.quantize(x))


# ---------------------------------------------------------------------------------------------
# without the oracle


def test_codecs_use_imatrix() -> None:
    assert all(codec(t).uses_imatrix for t in (GT.Q2_K, GT.Q4_K, GT.Q5_K))


@pytest.mark.parametrize("name", TYPES)
def test_weights_shape_errors(name: str) -> None:
    c = TYPES[name]
    x = np.zeros((2, 512), dtype=np.float32)
    for bad in (np.ones(256, np.float32), np.ones((1, 512), np.float32), np.ones(513, np.float32)):
        with pytest.raises(ValueError, match="importance matrix row of shape"):
            c.quantize(x, bad)
    with pytest.raises(ValueError, match="multiple of 256"):
        c.quantize(np.zeros((2, 100), dtype=np.float32), np.ones(100, np.float32))
    row = _random_rows("normal", 5, (1, 512))  # a 1-D row is one row, as without weights
    w = _imatrix("exponential", 512)
    assert np.array_equal(c.quantize(row[0], w), c.quantize(row, w)[0])
    assert c.quantize(np.zeros((0, 512), np.float32), w).shape == (0, 2 * c.type_size())


def test_make_qp_quants_cases() -> None:
    """Hand-checked ``make_qp_quants`` columns: below GROUP_MAX_EPS, zero weights, one value."""
    x = np.array([[1e-16, 0.5, 2.0, 3.0], [0.0, 0.25, 2.0, 1.0]], dtype=np.float32)
    w = np.array([[1, 0, 1, 1], [1, 0, 1, 1]], dtype=np.float32)
    with np.errstate(all="ignore"):
        scale, lq = make_qp_quants(x, w, 15)
    # column 0: max < 1e-15 -> zeros; column 1: zero weights -> no sums -> scale 0 with the first
    # quants nearest_int(15/0.5 * x) clamped to 15; column 2: all 2.0 -> L 15, scale 2/15;
    # column 3: iscale 5 then the search: L (15, 5), scale = (45 + 5) / (225 + 25)
    assert lq.tolist() == [[0, 15, 15, 15], [0, 8, 15, 5]]
    assert scale.tolist() == [0.0, 0.0, np.float32(30.0) / np.float32(225.0), np.float32(50.0) / np.float32(250.0)]


#: sha256 of ``ggml_quantize_chunk(quant_weights)``'s output (bytes, row-major) for each golden input,
#: produced with llama-cpp-python 0.3.36's libggml-base.so (ggml 0.25.3, commit 0c1e570), NOT with
#: convert.gguf.codecs.kquant_minmax, so these check the encoders where llama_cpp is not installed.
GOLDEN: dict[tuple[str, str], str] = {
    ("q4_K", "normal_activations"): "877bd3535feb58055470a4236d9ca1793d5bcc6eb09316e488681f18904f8012",
    ("q4_K", "mixed_some_zeros"): "c17d5fb9d588fc7df190d54189390a35eeb95e28c6ccfa894fd109248ce97288",
    ("q4_K", "edge_blocks_exponential"): "6ae9e0a73f7c6353937901983a093fa16fb2ba274b51ca0cdb19fb1f18c0e885",
    ("q4_K", "real_q_proj"): "272ece13adef4d58203b9132407cb148f8271c97c23f6f82e9218d935f4aa004",
    ("q5_K", "normal_activations"): "bc5ba13a412249440a939e778a7903a4093628d71e2da2815d34ad5ff4b3a101",
    ("q5_K", "mixed_some_zeros"): "cfac8f44ce1342d09e902242182368a84a294acee965cf89d2cb815f182bbfe6",
    ("q5_K", "edge_blocks_exponential"): "a8c033b86300f63ed59096d2d8bd98f411f8043037a7db7b711ba69e10207217",
    ("q5_K", "real_q_proj"): "9e09a0f0effb40fd3d5a1d70287ea532b4afb2ac775446b03f46c52947405339",
    ("q2_K", "normal_activations"): "cbd99fd4a1c854ddbb989688fd9b626c739fcfec9b9e18abc834d6f190b064d6",
    ("q2_K", "mixed_some_zeros"): "f1c554e1a06180baac463ffab6d88858f921b4073c7504147e33867577ac5c4e",
    ("q2_K", "edge_blocks_exponential"): "a6faa937b7051c86f95bde3c1f8caac1d35a4349129de731a102eef602191965",
    ("q2_K", "real_q_proj"): "403a039e07eea430595f53d1653be33cb2e574cb5b342324e74023f63c46dad0",
}


def _golden_inputs() -> dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]]:
    return {
        "normal_activations": lambda: (np.random.default_rng(0).standard_normal((16, 1024), dtype=np.float32),
                                       _imatrix("activations", 1024, seed=1)),
        "mixed_some_zeros": lambda: (_mixed_rows(512, 2), _imatrix("some_zeros", 512, seed=3)),
        "edge_blocks_exponential": lambda: (_edge_blocks()[1], _imatrix("exponential", QK_K, seed=4)),
        "real_q_proj": lambda: (dict(_real_tensors())["model.layers.0.self_attn.q_proj.weight"],
                                _imatrix("activations", QK_K, seed=5)),
    }


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("case", list(_golden_inputs()))
def test_golden_hashes(name: str, case: str) -> None:
    x, w = _golden_inputs()[case]()
    digest = hashlib.sha256(TYPES[name].quantize(x, w).tobytes()).hexdigest()
    assert digest == GOLDEN[(name, case)]

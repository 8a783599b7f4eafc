"""Our legacy GGML encoders (:mod:`convert.gguf.codecs.legacy`) against gguf-py's, byte for byte.

gguf-py's ``gguf.quants.quantize`` reproduces llama.cpp's ``quantize_row_*_ref``; every case here
compares the whole encoded array with it (and ``dequantize`` bit for bit where we override it):
random data at scales 1e-30..1e30, heavy tails, all-zero blocks, one nonzero value, constructed
exact ties, 3.4e38, subnormals, negative zeros, many shapes. The rounding helper is checked
exhaustively on the float32 ranges where it could go wrong.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from convert.gguf.codecs import CODECS
from convert.gguf.codecs.base import round_half_away_abs_into
from convert.gguf.codecs.legacy import CHUNK_BLOCKS, SAMPLE_BLOCKS

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's own, on inf/NaN

GT = gguf.GGMLQuantizationType
TYPES = [GT.Q8_0, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1]


def np_roundf(v: np.ndarray) -> np.ndarray:
    return gguf.quants.np_roundf(v)


def _rha(v: np.ndarray) -> np.ndarray:
    """Q8_0's rounding: the magnitude's, with the value's sign."""
    return np.copysign(np.trunc(round_half_away_abs_into(np.abs(v))), v)


def test_round_half_away_exhaustive_binades() -> None:
    """Every float32 in [2**-3, 4) and its negation, and ±(0.5 - 2**-25), ±0, ±tiny."""
    lo, hi = int(np.float32(0.125).view(np.int32)), int(np.float32(4.0).view(np.int32))
    for start in range(lo, hi, 1 << 22):  # in slices: the whole range at once peaks above 1 GiB
        v = np.arange(start, min(hi, start + (1 << 22)), dtype=np.int32).view(np.float32)
        for s in (v, -v):
            assert np.array_equal(_rha(s), np_roundf(s))
    w = np.array([0.49999997, -0.49999997, 0.0, -0.0, 1e-45, -1e-45, 0.5, -0.5, 2.5, -2.5], dtype=np.float32)
    assert np.array_equal(_rha(w), np_roundf(w))


def test_round_half_away_ties_and_neighbours() -> None:
    """k + 0.5 and the floats next to it for every k < 2**22 (above, k + 0.5 is not a float32 or
    is an integer); and large values up to 3.4e38."""
    k = np.arange(0, 2**22, dtype=np.float32) + np.float32(0.5)
    for v in (k, np.nextafter(k, np.float32(0)), np.nextafter(k, np.float32(np.inf))):
        for s in (v, -v):
            assert np.array_equal(_rha(s), np_roundf(s))
    big = np.float32(2.0) ** np.arange(22, 128, dtype=np.float32)
    big = np.concatenate([big, np.nextafter(big, np.float32(0)), [np.finfo(np.float32).max]]).astype(np.float32)
    assert np.array_equal(_rha(big), np_roundf(big))


def _check(t: GT, x: np.ndarray) -> None:
    x = np.ascontiguousarray(x, dtype=np.float32)
    ref = gguf.quants.quantize(x, t)
    ours = CODECS[t].quantize(x)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    if not np.array_equal(ours, ref):
        bad = np.nonzero((ours != ref).reshape(-1, gguf.GGML_QUANT_SIZES[t][1]).any(axis=1))[0]
        blocks = x.reshape(-1, gguf.GGML_QUANT_SIZES[t][0])
        pytest.fail(f"{t.name}: {bad.size} blocks differ, first {bad[0]}: {blocks[bad[0]].tolist()}")
    back = CODECS[t].dequantize(ref)
    want = gguf.quants.dequantize(ref, t)
    assert back.shape == want.shape and np.array_equal(back.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-10, 1e-3, 1.0, 1e3, 1e10, 1e20, 1e30])
def test_random_normal_scales(t: GT, scale: float) -> None:
    rng = np.random.default_rng(int(np.log10(scale)) + 100)
    _check(t, rng.standard_normal((64, 256)) * scale)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_heavy_tails_and_mixed_scales(t: GT) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_cauchy((128, 512)) * 10.0 ** rng.uniform(-38, 38, (128, 1))
    x = np.clip(x, -3.4e38, 3.4e38)
    _check(t, x)
    # scales varying inside a row, block by block (includes blocks of subnormals)
    y = rng.standard_normal((256, 64)) * 10.0 ** rng.uniform(-45, 38, (256, 1))
    _check(t, y.reshape(64, 256))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_special_blocks(t: GT) -> None:
    rng = np.random.default_rng(2)
    blocks = []
    blocks.append(np.zeros(32))
    nz = np.zeros(32, dtype=np.float32)
    nz[::3] = -0.0
    blocks.append(nz)  # mixed ±0
    blocks.append(np.full(32, -0.0, dtype=np.float32))
    for pos in (0, 7, 31):
        for val in (1.0, -1.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 1e-38, 2e-39, 6e-39):
            b = np.zeros(32, dtype=np.float32)
            b[pos] = val
            blocks.append(b)
    blocks.append(np.full(32, 3.4028235e38, dtype=np.float32))
    blocks.append(np.array([3.4e38, -3.4e38] * 16, dtype=np.float32))
    blocks.append(np.linspace(-3.4e38, 3.4e38, 32, dtype=np.float32))
    # subnormals: whole blocks, and mixed with normals
    blocks.append((rng.standard_normal(32) * 1e-40).astype(np.float32))
    blocks.append((rng.integers(-2**23, 2**23, 32) * 2.0**-149).astype(np.float32))
    sub = (rng.standard_normal(32) * 1e-40).astype(np.float32)
    sub[5] = 1e-37
    blocks.append(sub)
    # d near the overflow of 1 / d: amax around 127 * 2**-128
    for amax in np.float32(127) * np.float32(2.0) ** np.arange(-131, -124, dtype=np.float32):
        b = (rng.uniform(-1, 1, 32) * amax).astype(np.float32)
        b[3] = amax
        blocks.append(b)
    # ties in both signs and equal magnitudes
    blocks.append(np.array([1.0, -1.0] * 16, dtype=np.float32))
    blocks.append(np.array([-2.0, 2.0] * 16, dtype=np.float32))
    _check(t, np.stack([np.asarray(b, dtype=np.float32) for b in blocks]))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_constructed_ties(t: GT) -> None:
    """Values landing exactly on k + 0.5 after the scaling: amax 127 gives d = 1.0 exactly (and
    amax 127 * 2**e gives a power of two), so x = k + 0.5 scales to itself."""
    rng = np.random.default_rng(3)
    rows = []
    for e in (-20, -3, 0, 5, 40):
        half = (rng.integers(-127, 127, (64, 32)) + 0.5).astype(np.float32)
        half[:, 0] = 127  # amax: d = 2**e exactly
        half[::2, 0] = -127
        rows.append(half * np.float32(2.0) ** e)
        near = np.nextafter(half, np.where(rng.random(half.shape) < 0.5, -np.inf, np.inf).astype(np.float32))
        near[:, 0] = 127
        rows.append(near * np.float32(2.0) ** e)
    _check(t, np.concatenate(rows).reshape(-1, 256))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (7, 96), (1, 4096), (2, 32 * (CHUNK_BLOCKS + 1)),
                                   (CHUNK_BLOCKS + 3, 32), (5, 3, 160)])
def test_shapes(t: GT, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    _check(t, rng.standard_normal(shape))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_bad_shape(t: GT) -> None:
    with pytest.raises(ValueError):
        CODECS[t].quantize(np.zeros((2, 33), dtype=np.float32))


@pytest.mark.parametrize("scale", [0.02, 1e-5, 3e4])
def test_bf16_chunk_to_f16_equals_the_general_encoder(scale: float) -> None:
    """gguf_encode's bf16 -> F16 path (exact values rebuilt by integer operations, only the rounded ones
    measured) writes the bytes of the codec's F16 and the same error figures as encode_chunk (scale
    1e-5: many float16 subnormals; 3e4: many overflow to inf, an infinite error as before)."""
    import ml_dtypes

    from convert.gguf.encode import _bf16_to_f16_chunk, encode_chunk

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((96, 320)) * scale).astype(ml_dtypes.bfloat16)
    x[0, :4] = [0.0, -0.0, 65280.0, -6.1035e-05]
    fast = _bf16_to_f16_chunk(x, 1, 0)
    assert fast is not None
    want = encode_chunk(GT.F16, x.astype(np.float32), True)
    assert np.array_equal(fast.data.reshape(-1), want.data.reshape(-1))
    assert fast.max_err == want.max_err
    assert fast.sq_err == pytest.approx(want.sq_err, rel=1e-5)
    assert fast.sq_ref == pytest.approx(want.sq_ref, rel=1e-5)
    x32 = x.astype(np.float32)
    with np.errstate(over="ignore"):
        y = np.abs(x32.astype(np.float16))
    counts = (int(np.count_nonzero(np.isinf(y))), int(np.count_nonzero((y == 0) & (x32 != 0))))
    assert fast.f16_loss == want.f16_loss == counts
    assert (counts[0] > 0) == (scale == 3e4) and (counts[1] > 0) == (scale == 1e-5)
    assert (fast.max_err > 0) == (scale != 0.02 or bool(np.any(np.abs(x.astype(np.float32)) < 6.1e-5)))
    # the summary's sample: the same bytes and error, the weight's sum of squares over the tensor's rows
    # 0, 8, 16, ... (this chunk starts at the tensor's row 3: its rows 5, 13, ...)
    sampled = _bf16_to_f16_chunk(x, 8, 3 * 320)
    assert sampled is not None and np.array_equal(sampled.data, fast.data)
    assert (sampled.max_err, sampled.sq_err, sampled.measured) == (fast.max_err, fast.sq_err, x.size)
    assert sampled.ref_measured == 12 * 320
    assert sampled.sq_ref == pytest.approx(float(np.sum(x32[5::8].astype(np.float64) ** 2)), rel=1e-5)


def test_f16_encoding_of_overflow_warns_nothing() -> None:
    """F16's overflow to inf is the IEEE result: no RuntimeWarning reaches the user (gguf-py's cast warned)."""
    import warnings

    from convert.gguf.encode import encode_chunk

    x = np.array([[1e5, 1.0] * 16, [np.inf, 2.0] * 16], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = encode_chunk(GT.F16, x, True, np.isfinite(x))
    assert c.max_err == np.inf and c.f16_loss == (16, 0)


def test_bf16_chunk_with_inf_takes_the_general_path() -> None:
    import ml_dtypes

    from convert.gguf.encode import _bf16_to_f16_chunk

    x = np.ones((2, 32), ml_dtypes.bfloat16)
    x[1, 3] = np.inf
    assert _bf16_to_f16_chunk(x, 1, 0) is None


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_quantize_measured_per_chunk_equals_decoding_the_whole(t: GT) -> None:
    """The legacy codecs measure each chunk while encoding it: the same bytes as quantize, and the
    error figures of decoding the whole result with gguf-py (more than one chunk, and a partial one)."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((CHUNK_BLOCKS // 16 + 3, 32 * 32)) * 0.03).astype(np.float32)
    x[1, :32] *= 1e4  # one block far larger than the rest
    x[2, 32:64] = rng.standard_normal(32) * 1e-39  # subnormal: 1 / d overflows, the reference encodes it
    data, max_err, sq_err, sq_ref, measured = CODECS[t].quantize_measured(x)
    assert np.array_equal(data, CODECS[t].quantize(x))
    err = gguf.quants.dequantize(data, t).astype(np.float64) - x
    assert max_err == np.abs(err).max()
    assert sq_err == pytest.approx(float((err * err).sum()), rel=1e-4)  # float32 dots: report precision
    assert sq_ref == pytest.approx(float(np.square(x, dtype=np.float64).sum()), rel=1e-4)
    assert measured == x.size


@pytest.mark.parametrize("t", TYPES + [GT.Q4_K], ids=lambda t: t.name)
def test_quantize_measured_on_a_sample(t: GT) -> None:
    """With sample=k the bytes do not change and the figures are those of the sampled pieces: the
    legacy codecs' pieces 0, k, 2k, ... of SAMPLE_BLOCKS blocks (two to an encoded chunk of CHUNK_BLOCKS),
    the base class's rows 0, k, 2k, ..."""
    assert CHUNK_BLOCKS == 2 * SAMPLE_BLOCKS
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((SAMPLE_BLOCKS * 6 // 8 + 6, 256)) * 0.03).astype(np.float32)  # 7 legacy pieces
    x[-1, :32] *= 1e3  # the largest error, in the last (partial, unmeasured) chunk and an unmeasured row
    full = CODECS[t].quantize_measured(x)
    m = CODECS[t].quantize_measured(x, 4)
    assert np.array_equal(m.data, full.data)
    flat, err = x.reshape(-1, 32), (gguf.quants.dequantize(full.data, t) - x).reshape(-1, 32)
    if t in TYPES:  # blocks of pieces 0 and 4 (the first halves of chunks 0 and 2)
        keep = (np.arange(flat.shape[0]) // SAMPLE_BLOCKS) % 4 == 0
    else:
        keep = np.repeat(np.arange(x.shape[0]) % 4 == 0, x.shape[1] // 32)
    assert m.measured == int(keep.sum()) * 32 < x.size
    assert m.max_err == np.abs(err[keep]).max() < full.max_err
    assert m.sq_err == pytest.approx(float(np.square(err[keep], dtype=np.float64).sum()), rel=1e-4)
    assert m.sq_ref == pytest.approx(float(np.square(flat[keep], dtype=np.float64).sum()), rel=1e-4)
    # split in two calls at row 1001 (start: the second part's place in the tensor; block 8008, in piece 1
    # of chunk 0): the same pieces
    a, b = CODECS[t].quantize_measured(x[:1001], 4), CODECS[t].quantize_measured(x[1001:], 4, start=1001 * 256)
    assert np.array_equal(np.concatenate([a.data, b.data]), full.data)
    assert a.measured + b.measured == m.measured and max(a.max_err, b.max_err) == m.max_err


@pytest.mark.parametrize("t", [GT.Q4_K, GT.Q6_K, GT.Q2_K], ids=lambda t: t.name)
def test_quantize_measured_of_rows_holding_no_sampled_row(t: GT) -> None:
    """A tensor's last chunk may hold fewer rows than the sample's step and none on its grid (rows 1017-1023
    of a 1024-row output.weight in 1/8): its bytes are encoded and it measures nothing (gguf-py's dequantize
    of the empty sample raised "cannot reshape array of size 0": an internal error for any GGUF K-quant)."""
    x = (np.random.default_rng(15).standard_normal((1024, 256)) * 0.03).astype(np.float32)
    m = CODECS[t].quantize_measured(x[1017:], 8, start=1017 * 256)
    assert np.array_equal(m.data, CODECS[t].quantize(x[1017:]))
    assert (m.max_err, m.sq_err, m.sq_ref, m.measured) == (0.0, 0.0, 0.0, 0)
    whole = CODECS[t].quantize_measured(x, 8)
    head = CODECS[t].quantize_measured(x[:1017], 8)
    assert (head.max_err, head.sq_err, head.measured) == (whole.max_err, whole.sq_err, whole.measured)


@pytest.mark.parametrize("piece", [1, 3], ids=["beside-a-measured-piece", "in-an-unmeasured-chunk"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=str)
@pytest.mark.parametrize("t", TYPES + [GT.Q4_K], ids=lambda t: t.name)
def test_quantize_measured_sees_inf_nan_outside_the_sample(t: GT, bad: float, piece: int) -> None:
    """inf/NaN in a piece the sample leaves out still make sq_ref non-finite (the caller then refuses
    the weight: GGUF-011): the legacy codecs see it in the blocks their fast path hands to gguf-py."""
    x = (np.random.default_rng(15).standard_normal((SAMPLE_BLOCKS * 6 // 8 + 6, 256)) * 0.03).astype(np.float32)
    x[SAMPLE_BLOCKS // 8 * piece + 1, 40] = bad  # row 1 of piece 1 or 3 (the second half of chunk 0 or 1)
    assert not math.isfinite(CODECS[t].quantize_measured(x, 4).sq_ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("t", TYPES + [GT.Q4_K], ids=lambda t: getattr(t, "name", t))
def test_quantize_measured_widens_16_bit_input_chunk_by_chunk(t: GT, dtype: str) -> None:
    """bf16/f16 rows go to quantize_measured as they are (each chunk widened in cache): the bytes and
    figures of the float32 values; with inf the sum of squares says so (the caller then checks)."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((CHUNK_BLOCKS // 16 + 3, 32 * 32)) * 0.03).astype(dt)
    want = CODECS[t].quantize_measured(x.astype(np.float32))
    got = CODECS[t].quantize_measured(x)
    assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]
    x[5, 7] = np.inf
    assert CODECS[t].quantize_measured(x).sq_ref == np.inf


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_q8_0_reads_every_16_bit_pattern(dtype: str) -> None:
    """Q8_0 encodes bf16/f16 chunks from their bits (magnitudes, signs): every one of the 65536 patterns
    (inf, NaN, subnormals, -0.0 among them), shuffled into blocks, gives gguf-py's bytes for the widened
    values, through quantize and quantize_measured (whose figures are the float32 input's)."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    pats = np.random.default_rng(16).permutation(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    x = pats.view(dt).reshape(-1, 256)
    wide = x.astype(np.float32)
    want = gguf.quants.quantize(wide, GT.Q8_0)
    assert np.array_equal(CODECS[GT.Q8_0].quantize(x), want)
    finite = x[np.isfinite(wide).all(axis=1)]
    got, ref = CODECS[GT.Q8_0].quantize_measured(finite), CODECS[GT.Q8_0].quantize_measured(finite.astype(np.float32))
    assert np.array_equal(got.data, gguf.quants.quantize(finite.astype(np.float32), GT.Q8_0))
    assert np.array_equal(np.array(got[1:]), np.array(ref[1:]), equal_nan=True) and got.measured == finite.size


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_q8_0_16_bit_ties_round_away_from_zero(dtype: str) -> None:
    """Blocks whose largest magnitude is 127 * 2**e hold the exact ties k + 0.5 (times 2**e) of 1 / d = 2**-e:
    each rounds away from zero, by sign, as gguf-py's np_roundf; -0.0 and 0.0 give 0."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    k = np.arange(0, 127, dtype=np.float32) + np.float32(0.5)
    ties = np.concatenate([k, -k, [0.0, -0.0]]).astype(np.float32)
    rows = []
    for e in (-12, -3, 0, 4):
        for part in np.array_split(ties, -(-ties.size // 31)):
            row = np.zeros(32, np.float32)
            row[0] = 127 * 2.0**e
            row[1 : 1 + part.size] = part * np.float32(2.0**e)
            rows.append(row)
    x = np.stack(rows).astype(dt)
    assert np.array_equal(x.astype(np.float32), np.stack(rows))  # every value exact in the 16-bit type
    data = CODECS[GT.Q8_0].quantize(x)
    assert np.array_equal(data, gguf.quants.quantize(x.astype(np.float32), GT.Q8_0))
    qs = data.reshape(-1, 34)[:, 2:].view(np.int8).astype(np.float32)
    want = np.copysign(np.floor(np.abs(np.stack(rows) / (np.stack(rows)[:, :1])) * 127 + 0.5), np.stack(rows))
    assert np.array_equal(qs, want)

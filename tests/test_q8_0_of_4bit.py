"""convert.q8_0_of_4bit: GGUF Q8_0 straight from bnb 4-bit codes equals Q8_0Codec (gguf-py's bytes) on the
bf16 dequantization, bytes and error figures, and declines what it cannot do exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from convert.kernels import dequantize_4bit
from convert.legacy_quants import CHUNK_BLOCKS, Q8_0Codec
from convert.q8_0_of_4bit import q8_0_of_4bit
from formats.bnb import QUANT_TABLES


def _layer(rng: np.random.Generator, blocksize: int, n: int, absmax_kind: str):
    """Random codes and absmax of ``n`` values (whole blocks)."""
    nb = -(-n // blocksize)
    codes = rng.integers(0, 16, nb * blocksize, dtype=np.uint8)
    if absmax_kind == "sparse":  # few distinct codes per block: the largest present varies block to block
        codes = np.where(rng.random(codes.size) < 0.9, np.uint8(7), codes).astype(np.uint8)
    packed = (codes[0::2] << 4 | codes[1::2]).astype(np.uint8)
    absmax = rng.uniform(0.01, 0.08, nb).astype(np.float32)
    if absmax_kind == "zeros":
        absmax[::3] = 0
    elif absmax_kind == "negative":  # (not written by bnb; the arithmetic is still the codec's)
        absmax[::2] *= -1
    elif absmax_kind == "extreme":
        absmax[::5] = 1e-30
        absmax[1::7] = 3e37
    return packed, absmax


CASES = [  # quant_type, blocksize, lead, n, start, sample, absmax
    ("nf4", 64, 0, 1 << 20, 0, 8, "uniform"),
    ("nf4", 64, 32, 11008 * 7, 11008 * 3, 8, "sparse"),
    ("fp4", 128, 64, 4096 * 70, 4096 * 5 + 64, 1, "uniform"),
    ("nf4", 32, 0, 32 * 999, 96, 2, "zeros"),
    ("nf4", 4096, 2048, 1 << 19, 2048, 3, "negative"),
    ("nf4", 64, 0, 9375 * 32, CHUNK_BLOCKS * 32 - 64, 1, "extreme"),
    ("fp4", 256, 0, 96, 0, 1, "sparse"),
]


@pytest.mark.parametrize(("quant_type", "blocksize", "lead", "n", "start", "sample", "absmax_kind"), CASES)
def test_equals_the_codec_on_the_bf16_dequantization(quant_type, blocksize, lead, n, start, sample, absmax_kind):
    rng = np.random.default_rng(blocksize + n)
    qm = QUANT_TABLES[quant_type]
    packed, absmax = _layer(rng, blocksize, lead + n, absmax_kind)
    x = dequantize_4bit(packed, absmax, qm, blocksize, lead + n, "bfloat16")[lead:]
    want = Q8_0Codec.quantize_measured(x.reshape(-1, 32), sample, start)
    got = q8_0_of_4bit(packed, absmax, qm, blocksize, lead, n, start, sample)
    assert got is not None
    assert got.data.shape == (n // 32, 34)
    assert np.array_equal(got.data.reshape(-1), want.data.reshape(-1))
    assert got.measured == want.measured
    assert got.measured == n if sample == 1 else got.measured < n or n <= CHUNK_BLOCKS * 32
    for g, w in zip(got[1:4], want[1:4], strict=True):  # max_err, sq_err, sq_ref: the same sums
        assert g == w or (math.isnan(g) and math.isnan(w))


def test_declines_what_it_cannot_give_exactly():
    rng = np.random.default_rng(0)
    qm = QUANT_TABLES["nf4"]
    packed, absmax = _layer(rng, 64, 4096, "uniform")
    assert q8_0_of_4bit(packed, absmax, qm, 64, 16, 4064) is None  # lead not a multiple of 32
    assert q8_0_of_4bit(packed, absmax, qm, 64, 0, 4016) is None  # n not a multiple of 32
    assert q8_0_of_4bit(packed, absmax, qm, 48, 0, 4080) is None  # Q8_0 blocks would straddle bnb blocks
    tiny = absmax.copy()
    tiny[7] = 2.0**-124  # d = max / 127 < 2^-128: 1 / d overflows, the codec hands the block to gguf-py
    assert q8_0_of_4bit(packed, tiny, qm, 64, 0, 4096) is None
    assert Q8_0Codec.quantize(dequantize_4bit(packed, tiny, qm, 64, 4096, "bfloat16").reshape(-1, 32)
                              .astype(np.float32)).shape == (128, 34)

"""Property tests (hypothesis) of the 4-bit quantizer: chunking and round trips."""

from __future__ import annotations

import numpy as np
import pytest

from convert.bnb4.encode import blockwise_absmax, codec, iter_block_chunks
from convert.bnb4.layer import quantize_layer
from convert.bnb4.settings import QuantSettings
from convert.dequant.kernels import dequantize_4bit
from formats.bnb import QUANT_TABLES

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _dequantize(arrays) -> np.ndarray:
    st_ = arrays.state
    return dequantize_4bit(arrays.packed, arrays.absmax, QUANT_TABLES[st_.quant_type], st_.blocksize, st_.numel,
                           st_.dtype)


@st.composite
def _tensors(draw: st.DrawFn) -> tuple[np.ndarray, int, str]:
    bs = draw(st.sampled_from([32, 64, 128]))
    n = draw(st.integers(1, 5 * bs + 7))
    scale = draw(st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 3e4]))
    seed = draw(st.integers(0, 2**32 - 1))
    x = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    zero_from = draw(st.integers(0, n))  # an all-zero stretch, often covering whole blocks
    x[zero_from : zero_from + draw(st.integers(0, 2 * bs))] = 0
    return x, bs, draw(st.sampled_from(["nf4", "fp4"]))


@settings(max_examples=60, deadline=None)
@given(_tensors(), st.integers(1, 4))
def test_property_chunks_equal_whole(case: tuple[np.ndarray, int, str], blocks_per_chunk: int) -> None:
    x, bs, qt = case
    packed, absmax = codec(qt).quantize(x, bs)
    parts_p, parts_a = [], []
    for a, b in iter_block_chunks(x.size, bs, blocks_per_chunk * bs):
        am = blockwise_absmax(x[a:b], bs)
        parts_a.append(am)
        parts_p.append(codec(qt).encode(x[a:b], am, bs))
    assert np.concatenate(parts_p).tobytes() == packed.tobytes()
    assert np.concatenate(parts_a).tobytes() == absmax.tobytes()


@settings(max_examples=60, deadline=None)
@given(_tensors())
def test_property_round_trip_is_a_fixed_point(case: tuple[np.ndarray, int, str]) -> None:
    x, bs, qt = case
    first = quantize_layer(x, "float32", QuantSettings(qt, bs, False))
    y1 = _dequantize(first)
    y2 = _dequantize(quantize_layer(y1, "float32", QuantSettings(qt, bs, False)))
    assert y2.tobytes() == y1.tobytes()

"""Dequantize a grouped layer with the library kernels (the tests' reference for a layer's values)."""

from __future__ import annotations

import numpy as np

from convert.dequant.kernels import dequantize_4bit, dequantize_int8, dequantize_nested_absmax
from formats.bnb import Int8Layer, QuantizedLayer


def dequant(layer: QuantizedLayer | Int8Layer, dtype: str) -> np.ndarray:
    """The layer dequantized to ``dtype`` in its logical shape."""
    if isinstance(layer, Int8Layer):
        return dequantize_int8(layer.weight.array(), layer.scb.array(), dtype)
    st = layer.state
    absmax = layer.absmax_flat()
    if st.nested:
        assert layer.nested_absmax is not None and layer.nested_quant_map is not None
        absmax = dequantize_nested_absmax(
            absmax, layer.nested_absmax.array(), layer.nested_quant_map.array(),
            st.nested_blocksize, st.nested_offset, st.nested_dtype,
        )
    else:
        absmax = absmax.astype(np.float32)
    out = dequantize_4bit(layer.packed.raw(), absmax, layer.quant_map.array(), st.blocksize, st.numel, dtype)
    return out.reshape(st.shape)


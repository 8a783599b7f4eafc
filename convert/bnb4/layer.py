"""One whole weight quantized in memory: bnb ``quantize_4bit`` and the tensors ``Linear4bit`` saves.

The reference path: the arrays of one layer in one call (:func:`quantize_layer`, matching
``bitsandbytes.functional.quantize_4bit(x, blocksize, compress_statistics=nested, quant_type,
quant_storage)``) and their names, order and stored dtypes on disk (:func:`layer_tensors`). The
tests and ``scripts/quantize_seed_figures.py`` use it; ``--to nf4|fp4`` streams the same bytes
under the memory cap instead (:mod:`convert.bnb4.plan`, from the slice functions of
:mod:`convert.bnb4.encode` and :mod:`convert.bnb4.absmax8`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from convert.bnb4.absmax8 import double_quantize_absmax
from convert.bnb4.encode import codec
from convert.bnb4.settings import QuantSettings, storage_dtype
from formats.bnb import DYNAMIC_MAP_SIGNED, QUANT_TABLES, QuantState, component_name, state_key

__all__ = ["QuantizedLayerArrays", "layer_tensors", "quantize_layer"]


@dataclass(frozen=True)
class QuantizedLayerArrays:
    """Every array of one quantized weight, before naming.

    Attributes:
        state: its :class:`QuantState` (``nested_offset`` filled in when nested).
        packed: ``uint8[ceil(n/2)]`` packed codes.
        absmax: ``float32[n_blocks]`` (not nested) or ``uint8[n_blocks]`` codes (nested).
        absmax_f32: ``float32[n_blocks]`` absmax before double quantization.
        nested_absmax: ``float32[ceil(n_blocks/256)]`` or None.
    """

    state: QuantState
    packed: npt.NDArray[np.uint8]
    absmax: np.ndarray
    absmax_f32: npt.NDArray[np.float32]
    nested_absmax: npt.NDArray[np.float32] | None


def quantize_layer(x: np.ndarray, dtype: str, settings: QuantSettings) -> QuantizedLayerArrays:
    """Quantize one whole weight in memory (the streaming pipeline uses the slice functions instead).

    Matches ``bitsandbytes.functional.quantize_4bit(x, blocksize, compress_statistics=nested,
    quant_type, quant_storage)``.

    Args:
        x: the weight, ``float16|bfloat16|float32`` of any shape.
        dtype: torch name of the weight's dtype (``"bfloat16"``), written into the QuantState.
        settings: quant type, blocksize, nesting.

    Returns:
        the arrays; see :func:`layer_tensors` for their names and stored dtypes.

    Raises:
        UnsupportedError: QNT-003, x holds NaN or infinity.
    """
    packed, absmax = codec(settings.quant_type).quantize(x, settings.blocksize)
    shape = tuple(int(d) for d in np.shape(x))
    if settings.nested:
        codes, nested, offset = double_quantize_absmax(absmax, num_threads=settings.num_threads)
        return QuantizedLayerArrays(settings.state(shape, dtype, offset), packed, codes, absmax, nested)
    return QuantizedLayerArrays(settings.state(shape, dtype), packed, absmax, absmax, None)


def layer_tensors(
    weight_name: str, arrays: QuantizedLayerArrays, quant_storage: str = "uint8"
) -> dict[str, np.ndarray]:
    """The tensors bnb saves for one 4-bit weight, named and shaped as on disk.

    Matches ``Linear4bit._save_to_state_dict`` + ``QuantState.as_dict(packed=True)``, in that order:
    ``P.weight`` (``[ceil(n/2), 1]`` uint8, or the same bytes viewed as ``quant_storage``),
    ``P.weight.absmax``, ``P.weight.quant_map`` (``float32[16]``), when nested
    ``P.weight.nested_absmax`` and ``P.weight.nested_quant_map`` (``float32[256]``), and
    ``P.weight.quant_state.bitsandbytes__<type>`` (``uint8[len]``, the JSON).

    Args:
        weight_name: ``P.weight``.
        arrays: from :func:`quantize_layer` (or assembled by the streaming pipeline).
        quant_storage: ``uint8``, ``bfloat16``, ``float16`` or ``float32``.

    Returns:
        name -> array (bfloat16 arrays use ml_dtypes).

    Raises:
        UnsupportedError: QNT-005, the packed bytes do not fill whole ``quant_storage`` elements.
    """
    st = arrays.state
    settings_shape = QuantSettings(st.quant_type, st.blocksize, st.nested, quant_storage).storage_shape(
        st.numel, weight_name)
    packed = arrays.packed.reshape(-1).view(storage_dtype(quant_storage)).reshape(settings_shape)
    parts: dict[str, np.ndarray] = {"absmax": arrays.absmax, "quant_map": QUANT_TABLES[st.quant_type].copy()}
    if st.nested:
        assert arrays.nested_absmax is not None
        parts["nested_absmax"] = arrays.nested_absmax
        parts["nested_quant_map"] = DYNAMIC_MAP_SIGNED.copy()
    parts[state_key(st.quant_type)] = np.frombuffer(st.to_json().encode("utf-8"), dtype=np.uint8).copy()
    return {weight_name: packed} | {component_name(weight_name, c): a for c, a in parts.items()}

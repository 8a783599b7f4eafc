"""The planned tensors of one 4-bit weight, and the :class:`~convert.stream.sources.Source` of each.

A quantized weight ``P.weight`` becomes the tensors ``Linear4bit`` saves, in this order
(``_save_to_state_dict`` + ``QuantState.as_dict(packed=True)``; the in-memory reference is
:func:`convert.bnb4.layer.layer_tensors`): ``P.weight`` (packed codes viewed as ``quant_storage``,
``[ceil(n/2) / itemsize, 1]``), ``P.weight.absmax`` (``float32[n_blocks]``, or ``uint8[n_blocks]``
codes when nested), ``P.weight.quant_map`` (``float32[16]``), when nested ``P.weight.nested_absmax``
(``float32[ceil(n_blocks/256)]``) and ``P.weight.nested_quant_map`` (``float32[256]``), and
``P.weight.quant_state.bitsandbytes__<type>`` (``uint8[len]``, the QuantState JSON).

:func:`job_tensors` plans them from a :class:`~convert.bnb4.passes.LayerJob` (each source produces
from the job's passes and tells it when its tensor is written). A bnb input layer that already has the
asked settings is copied unchanged instead (:func:`requantize_reason`, :func:`passthrough_tensors`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from convert.bnb4.absmax8 import NESTED_BLOCKSIZE
from convert.bnb4.passes import LayerJob
from convert.bnb4.settings import QuantSettings
from convert.stream.plan import PlannedTensor
from convert.stream.sources import Dequant4Source, Source
from formats.bnb import DYNAMIC_MAP_SIGNED, QUANT_TABLES, component_name, state_key
from formats.dtypes import BY_CODE, BY_NAME, DType

__all__ = ["job_tensors", "passthrough_tensors", "requantize_reason"]

_U8 = BY_CODE["U8"]
_F32 = BY_CODE["F32"]


# --- a quantized weight -------------------------------------------------------------------------


class _JobSource(Source):
    """Base of the sources of one layer's output tensors."""

    def __init__(self, job: LayerJob, name: str, numel: int, unit: int, kind: str) -> None:
        super().__init__()
        self.job = job
        self.name = name
        self.numel = numel
        self.unit = unit
        self.kind = kind
        job.tensors_left += 1

    def reads(self) -> list[Source]:
        return [self.job.input.source]

    def finish(self) -> None:
        self.job.done_one()


class _PackedSource(_JobSource):
    def __init__(self, job: LayerJob, name: str, storage: DType) -> None:
        item = storage.itemsize
        layer = job.input
        nbytes = -(-layer.n // 2)
        super().__init__(job, name, nbytes // item, max(1, layer.align // (2 * item)),
                         f"quantize {job.settings.quant_type} bs{layer.blocksize}"
                         + (" nested" if job.settings.nested else "") + f" <- {layer.source.kind}")
        self.item = item
        self.in_nbytes = layer.source.in_nbytes
        self.max_chunk = layer.piece // (2 * item)  # one piece of the input a chunk: every worker gets some

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        b0, b1 = start * self.item, stop * self.item
        return self.job.encode(2 * b0, min(self.job.input.n, 2 * b1))

    def release(self, start: int, stop: int) -> None:  # the reads released their pages already
        pass


class _AbsmaxSource(_JobSource):
    def __init__(self, job: LayerJob, name: str) -> None:
        super().__init__(job, name, job.input.n_blocks, max(1, job.input.align // job.input.blocksize),
                         "absmax (8-bit codes)" if job.settings.nested else "absmax")
        self.barrier = job.settings.nested  # nested: made from the codes recorded while the weight was written

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        if self.job.settings.nested:
            return self.job.absmax_codes(start, stop)
        if start == 0 and stop == self.numel:  # the usual single chunk: one pass, cached for the codes
            return self.job.absmax.full()
        return self.job.absmax.blocks(start, stop)


class _NestedAbsmaxSource(_JobSource):
    def __init__(self, job: LayerJob, name: str, numel: int) -> None:
        super().__init__(job, name, numel, 1, "nested absmax")

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        return self.job.absmax.nested_statistics()[0][start:stop]


class _StateSource(_JobSource):
    def __init__(self, job: LayerJob, name: str, numel: int) -> None:
        super().__init__(job, name, numel, 1, "quant_state JSON")

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        text = self.job.state().to_json().encode("utf-8")
        return np.frombuffer(text, dtype=np.uint8)[start:stop].copy()


class _ConstSource(_JobSource):
    def __init__(self, job: LayerJob, name: str, values: npt.NDArray[np.float32], kind: str) -> None:
        super().__init__(job, name, values.size, 1, kind)
        self.values = values

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        return self.values[start:stop].copy()


def job_tensors(job: LayerJob, settings: QuantSettings, json_len: int | None) -> list[PlannedTensor]:
    """The planned tensors of one quantized weight, in ``Linear4bit``'s order.

    Args:
        job: the weight's passes.
        settings: the quantization settings.
        json_len: bytes of its QuantState JSON; None when not nested (known without pass 1).

    Returns:
        ``P.weight``, ``.absmax``, ``.quant_map``, [``.nested_absmax``, ``.nested_quant_map``], ``.quant_state...``.
    """
    name = job.name
    n, n_blocks = job.input.n, job.input.n_blocks
    storage = BY_NAME[settings.quant_storage]
    out = [
        PlannedTensor(name, storage, settings.storage_shape(n, name), _PackedSource(job, name, storage), n),
        PlannedTensor(component_name(name, "absmax"), _U8 if settings.nested else _F32, (n_blocks,),
                      _AbsmaxSource(job, component_name(name, "absmax")), 0),
        PlannedTensor(component_name(name, "quant_map"), _F32, (16,),
                      _ConstSource(job, component_name(name, "quant_map"), QUANT_TABLES[settings.quant_type],
                                   "quant_map"), 0),
    ]
    if settings.nested:
        nn = -(-n_blocks // NESTED_BLOCKSIZE)
        out.append(PlannedTensor(component_name(name, "nested_absmax"), _F32, (nn,),
                                 _NestedAbsmaxSource(job, component_name(name, "nested_absmax"), nn), 0))
        out.append(PlannedTensor(component_name(name, "nested_quant_map"), _F32, (256,),
                                 _ConstSource(job, component_name(name, "nested_quant_map"), DYNAMIC_MAP_SIGNED,
                                              "nested_quant_map"), 0))
    if json_len is None:  # not nested: the JSON is known now
        json_len = len(settings.state(job.input.shape, job.input.dtype.name).to_json().encode("utf-8"))
    key = component_name(name, state_key(settings.quant_type))
    out.append(PlannedTensor(key, _U8, (json_len,), _StateSource(job, key, json_len), 0))
    return out


# --- a bnb layer copied unchanged ---------------------------------------------------------------


class _CopySource(Source):
    """Bytes of an input tensor, unchanged (a pass-through bnb layer)."""

    def __init__(self, record: Any, name: str, out: DType) -> None:
        super().__init__()
        self.record = record
        self.name = name
        self.out = out
        self.numel = record.nbytes // out.itemsize
        self.in_nbytes = record.nbytes
        self.kind = "copy (bnb layer already in these settings)"

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        it = self.out.itemsize
        return np.array(self.record.raw(start * it, stop * it))

    def release(self, start: int, stop: int) -> None:
        it = self.out.itemsize
        self.record.release(start * it, stop * it)


class _ArraySource(Source):
    def __init__(self, values: np.ndarray, kind: str) -> None:
        super().__init__()
        self.values = values
        self.numel = values.size
        self.kind = kind

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        return np.array(self.values[start:stop])


def requantize_reason(src: Source, settings: QuantSettings) -> str | None:
    """Why a planned bnb 4-bit layer cannot be copied unchanged and is re-quantized, or None when it is stored
    exactly as these settings would store it (bnb's own layout: F32 absmax, or U8 codes with an F32
    ``nested_absmax`` in blocks of 256 and float32 nested steps).

    A source that is not a bnb 4-bit layer has no reason (it is quantized, not re-quantized): ``"not a bnb
    4-bit layer"``. The reasons are phrased for the run's note ("N layers re-quantized: REASON").
    """
    if not isinstance(src, Dequant4Source):
        return "not a bnb 4-bit layer"
    layer, st = src.layer, src.layer.state
    have = (st.quant_type, st.blocksize, st.nested)
    want = (settings.quant_type, settings.blocksize, settings.nested)
    if have != want:
        def spell(q: tuple[str, int, bool]) -> str:
            return f"{q[0]} blocksize {q[1]}{' nested' if q[2] else ''}"
        return f"stored as {spell(have)}, asked {spell(want)}"
    if layer.absmax.dtype.code != ("U8" if st.nested else "F32") or len(layer.absmax.shape) != 1:
        form = layer.absmax.dtype.code + (" 2-D" if len(layer.absmax.shape) != 1 else "")
        return (f"absmax stored as {form}, as a file saved after a bnb CPU forward holds it (bnb writes it 1-D "
                + ("U8" if st.nested else "F32") + ")")
    if st.nested and ((st.nested_dtype or "float32") != "float32"
                      or (layer.nested_absmax is not None and layer.nested_absmax.dtype.code != "F32")):
        return ("nested absmax in bfloat16/float16 (nested_dtype), as a file saved after a bnb CPU forward holds "
                "it (bnb writes float32)")
    if st.nested and st.nested_blocksize != NESTED_BLOCKSIZE:
        return f"nested blocksize {st.nested_blocksize} (bnb writes {NESTED_BLOCKSIZE})"
    return None


def passthrough_tensors(t: PlannedTensor, src: Dequant4Source, settings: QuantSettings) -> list[PlannedTensor]:
    """The planned tensors of a bnb layer copied unchanged (its bytes; the packed codes under ``quant_storage``).

    Raises:
        NonFiniteAbsmaxError: BNB-012, the layer's absmax is not finite (as when it is dequantized: copying
            it would write a layer that no reader, this one included, accepts).
    """
    src.check_absmax()
    layer, st = src.layer, src.layer.state
    storage = BY_NAME[settings.quant_storage]
    shape = settings.storage_shape(st.numel, t.name)
    out = [PlannedTensor(t.name, storage, shape, _CopySource(layer.packed, t.name, storage), st.numel)]
    out.append(PlannedTensor(component_name(t.name, "absmax"), layer.absmax.dtype, (st.n_blocks,),
                             _CopySource(layer.absmax, component_name(t.name, "absmax"), layer.absmax.dtype), 0))
    const: list[tuple[str, npt.NDArray[Any]]] = [("quant_map", QUANT_TABLES[st.quant_type])]
    if st.nested:
        assert layer.nested_absmax is not None
        out.append(PlannedTensor(component_name(t.name, "nested_absmax"), _F32, (st.n_nested_blocks,),
                                 _CopySource(layer.nested_absmax, component_name(t.name, "nested_absmax"), _F32), 0))
        const.append(("nested_quant_map", DYNAMIC_MAP_SIGNED))
    text = np.frombuffer(st.to_json().encode("utf-8"), dtype=np.uint8)
    const.append((state_key(st.quant_type), text))
    for suffix, values in const:
        dt = _U8 if values.dtype == np.uint8 else _F32
        out.append(PlannedTensor(component_name(t.name, suffix), dt, (values.size,), _ArraySource(values, suffix), 0))
    return out

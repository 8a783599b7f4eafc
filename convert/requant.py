"""``--to nf4|fp4``: write a model as bitsandbytes 4-bit, byte-identical to what bitsandbytes writes.

The input is anything the dequantization plan reads (a float model or file, a bnb 4-bit or 8-bit
checkpoint) after every plan hook (``--merge-lora``): each planned float tensor is a
:class:`~convert.plan.Source` of its values. This module replaces the tensors transformers would
quantize with the tensors ``Linear4bit`` saves (:func:`convert.quantize.layer_tensors`), and adds
``quantization_config`` to ``config.json`` as transformers writes it.

Which tensors (header-only rules that equal transformers' ``replace_with_bnb_linear`` on standard
models, since no model class is built):

- 2-D float ``<module>.weight`` tensors (Linear / Conv1D weights), and every layer that is already
  4-bit or 8-bit in the input;
- not embeddings (a name part containing ``embed``, or ``wte``, ``wpe``, ``shared``), not the
  output head (``lm_head``, ``embed_out``, ``score``, ``classifier``, ``qa_outputs`` outside the
  blocks: transformers' ``get_keys_to_not_convert``), never norms (1-D) or biases;
- not modules matching ``--skip-modules`` (transformers' ``should_convert_module`` matching: a
  regex from the start up to a module boundary, or a suffix); these and the head go into
  ``llm_int8_skip_modules`` (null when nothing was asked, as transformers writes it);
- ``--include`` forces a tensor (e.g. the 1-D or 3-D tensor of a single-tensor file).

Streaming under the memory cap: a layer's tensors are produced from its source in block-aligned
pieces. Double quantization needs the mean of the whole layer's absmax before its QuantState JSON
(whose length is in the header) can be written, so a pre-pass reads every nested layer once and
keeps only its nested statistics (``nested_absmax``, offset, absmax median and max), then drops the
input's caches and pages; the codes are made in a second pass, which records the 8-bit absmax
codes (1 byte a block) for the layer's absmax tensor, so a nested layer is read exactly twice. A
non-nested layer's fp32 absmax is kept while the layer is written if it fits a share of
``--max-memory``, otherwise recomputed. Tensors are written in the order the
``safetensors`` library writes them (dtype, then name), so a single-file output is byte-identical
to transformers' ``save_pretrained`` of the same quantized model.

A bnb input whose layer already has the asked settings is passed through unchanged (no drift from
re-quantizing nested absmax) unless ``--requantize`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from formats.bnb import DYNAMIC_MAP_SIGNED, QUANT_TABLES, Int8Layer, QuantizedLayer, QuantState
from formats.dtypes import BY_CODE, BY_NAME, DType
from formats.errors import UnsupportedError, UsageError

from . import cli
from .plan import Dequant4Source, Plan, PlannedTensor, Source, make_plan, shard_tensors
from .quantize import (
    NESTED_BLOCKSIZE,
    QUANT_STORAGES,
    TORCH_NUM_THREADS,
    QuantReport,
    QuantSettings,
    ReportAccumulator,
    blockwise_absmax,
    encode_4bit,
    encode_8bit,
    nested_statistics,
    quantize_bounds,
    resolve_nested,
    stored_nbytes,
)

__all__ = [
    "SAFETENSORS_DTYPE_ORDER",
    "QuantPlanInfo",
    "add_arguments",
    "check_arguments",
    "make_quant_plan",
    "matches_module",
    "quantization_config",
    "run",
    "safetensors_order_key",
    "should_quantize",
]

#: dtype codes in the order the safetensors library writes tensors (``Dtype`` compared descending),
#: then by name; read off safetensors 0.8 ``save``.
SAFETENSORS_DTYPE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                           "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_HEADS = ("lm_head", "embed_out", "score", "classifier", "qa_outputs")
_EMBED_EXACT = ("wte", "wpe", "shared")
#: Elements released either side of each piece read: 2 MiB at 4 bits per element. A fault maps the
#: whole page-cache folio around it (64 KiB of fault-around, and up to 2 MiB with the large folios of
#: recent kernels, e.g. ext4 on Linux 6.16+), which re-maps pages of pieces released already.
_RELEASE_MARGIN = 1 << 22
_U8 = BY_CODE["U8"]
_F32 = BY_CODE["F32"]


def safetensors_order_key(name: str, dtype: DType) -> tuple[int, str]:
    """Sort key giving the tensor order of safetensors' ``save_file`` (and so of transformers)."""
    try:
        rank = SAFETENSORS_DTYPE_ORDER.index(dtype.code)
    except ValueError:
        rank = len(SAFETENSORS_DTYPE_ORDER)
    return rank, name


def matches_module(full_name: str, pattern: str) -> bool:
    """transformers' ``should_convert_module`` test for one pattern (True = the pattern matches).

    A regex matched from the start up to a module boundary (``layer.1`` matches ``layer.1.attn``,
    not ``layer.11.attn``), or a plain suffix (``fc1`` matches ``model.layers.3.fc1``).
    """
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    try:
        if re.match(rf"(?:{pattern}){boundary}", full_name):
            return True
    except re.error:
        pass
    return full_name.endswith(pattern)


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _is_embedding(module: str) -> bool:
    return any("embed" in part or part in _EMBED_EXACT for part in module.split("."))


def _is_head(module: str) -> bool:
    parts = module.split(".")
    return parts[-1] in _HEADS and not any(p.isdigit() for p in parts)


def should_quantize(
    name: str, shape: Sequence[int], dtype: DType, *, was_quantized: bool = False,
    skip: Sequence[str] = (), include: Sequence[str] = (),
) -> tuple[bool, str]:
    """Whether a planned tensor becomes a 4-bit layer, and why (for the plan listing).

    Args:
        name: the tensor name.
        shape: its shape in elements.
        dtype: its (float) dtype in the plan.
        was_quantized: the input holds it as a bnb 4-bit or 8-bit layer.
        skip: ``--skip-modules`` patterns.
        include: ``--include`` patterns (win over every other rule).

    Returns:
        (quantize?, reason).
    """
    module = _module(name)
    if any(matches_module(name, p) or matches_module(module, p) for p in include):
        return (True, "--include") if dtype.is_float else (False, "not a float tensor")
    if any(matches_module(module, p) for p in skip):
        return False, "--skip-modules"
    if not dtype.is_float:
        return False, "not a float tensor"
    if was_quantized:
        if _is_head(module):
            return False, "output head"
        return True, "4-bit/8-bit in the input"
    if not name.endswith(".weight") or len(shape) != 2:
        return False, "not a 2-D weight"
    if _is_embedding(module):
        return False, "embedding"
    if _is_head(module):
        return False, "output head"
    return True, "Linear weight"


def quantization_config(settings: QuantSettings, compute_dtype: str,
                        skip_modules: list[str] | None) -> dict[str, Any]:
    """The ``quantization_config`` block transformers 5 writes for these settings (BitsAndBytesConfig)."""
    return {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": settings.quant_storage,
        "bnb_4bit_quant_type": settings.quant_type,
        "bnb_4bit_use_double_quant": settings.nested,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }


# --- sources -----------------------------------------------------------------------------------


class _Budget:
    """Bytes of cached absmax allowed across layers (a share of --max-memory)."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.left += n


class _LayerJob:
    """One weight being quantized: reads its source in pieces, caches what is small."""

    def __init__(self, t: PlannedTensor, settings: QuantSettings, piece: int, budget: _Budget,
                 report: bool, outlier_factor: float) -> None:
        self.name = t.name
        self.inner = t.source
        self.natural = t.dtype
        self.settings = settings
        self.shape = tuple(int(d) for d in t.shape)
        self.n = math.prod(self.shape)
        self.bs = settings.blocksize
        self.align = math.lcm(self.bs, max(1, int(getattr(self.inner, "unit", 1) or 1)))
        self.piece = max(self.align, (piece // self.align) * self.align)
        self.n_blocks = -(-self.n // self.bs)
        self.bounds = quantize_bounds(settings.quant_type)
        self.budget = budget
        self.want_report = report
        self.outlier_factor = outlier_factor
        self.tensors_left = 0
        self.report: QuantReport | None = None
        self._absmax: npt.NDArray[np.float32] | None = None
        self._cached = 0
        self._nested: tuple[npt.NDArray[np.float32], float] | None = None
        self._median_max: tuple[float, float] | None = None
        self._acc: ReportAccumulator | None = None
        self._codes: npt.NDArray[np.uint8] | None = None  # nested absmax codes, filled by encode
        self._codes_have: npt.NDArray[np.bool_] | None = None  # which blocks of _codes are filled
        self._codes_full = False
        self._lock = threading.RLock()

    # reading
    def read(self, a: int, b: int) -> np.ndarray:
        """Elements [a, b) of the flat weight in its natural dtype (a on an aligned boundary)."""
        x = np.asarray(self.inner.produce(a, b, self.natural)).reshape(-1)
        # release a margin too: the kernel maps pages around each fault ("fault-around", 64 KiB),
        # which re-maps pages of the previous piece that were released already
        self.inner.release(max(0, a - _RELEASE_MARGIN), min(self.n, b + _RELEASE_MARGIN))
        if x.dtype != self.natural.numpy:  # a copying source hands out raw bytes
            x = x.view(self.natural.numpy)
        return x

    def _absmax_of(self, x: np.ndarray, start: int) -> npt.NDArray[np.float32]:
        """blockwise_absmax of elements starting at ``start``, errors naming this tensor and file."""
        try:
            return blockwise_absmax(x, self.bs)
        except UnsupportedError as exc:
            am = np.abs(np.asarray(x, dtype=np.float32))
            bad = start // self.bs + int(np.flatnonzero(~np.isfinite(am))[0]) // self.bs
            raise UnsupportedError(exc.reason, path=_source_file(self.inner), tensor=self.name, rule=exc.rule,
                                   expected=exc.expected, found=f"non-finite value in block {bad}",
                                   hint=exc.hint) from None

    def _pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        return [(s, min(b, s + self.piece)) for s in range(a, b, self.piece)]

    def absmax_blocks(self, ba: int, bb: int) -> npt.NDArray[np.float32]:
        """fp32 absmax of blocks [ba, bb) (cached, or recomputed from the source)."""
        cached = self._absmax
        if cached is not None:
            return cached[ba:bb]
        a, b = ba * self.bs, min(self.n, bb * self.bs)
        out = np.empty(max(0, bb - ba), dtype=np.float32)  # filled in place: no list of parts to join
        for s, e in self._pieces(a, b):
            k = s // self.bs - ba
            am = self._absmax_of(self.read(s, e), s)
            out[k : k + am.size] = am
        return out

    def full_absmax(self) -> npt.NDArray[np.float32]:
        """The whole layer's fp32 absmax (a full pass), cached while the budget allows.

        Nested layers are never cached: their stored absmax codes are recorded by :meth:`encode`.
        """
        with self._lock:
            if self._absmax is not None:
                return self._absmax
            am = self.absmax_blocks(0, self.n_blocks)
            self._stats_of(am)
            if not self.settings.nested and self.budget.take(am.nbytes):
                self._absmax = am
                self._cached = am.nbytes
            return am

    def _stats_of(self, am: npt.NDArray[np.float32], scratch: bool = False) -> None:
        """Keep what later passes need of a full absmax: nested statistics, median and max.

        ``scratch``: am is not needed afterwards (the median may reorder it instead of copying).
        """
        if self.settings.nested and self._nested is None:
            self._nested = nested_statistics(am, num_threads=self.settings.num_threads)
        if self._median_max is None and am.size:
            top = float(am.max())
            self._median_max = (float(np.median(am, overwrite_input=scratch)), top)

    def prepass(self) -> None:
        """Pass 1 of a nested layer: its nested statistics and absmax median/max, nothing else kept.

        The input's caches and pages are dropped afterwards (``Source.finish``), so a pre-pass over
        every layer holds no more than the layers being read.
        """
        with self._lock:
            if self._nested is not None and (self._median_max is not None or not self.want_report):
                return
            self._stats_of(self.absmax_blocks(0, self.n_blocks), scratch=True)
        self.inner.finish()

    def nested(self) -> tuple[npt.NDArray[np.float32], float]:
        """(nested_absmax, nested_offset), computed from a full pass once."""
        with self._lock:
            if self._nested is None:
                self._stats_of(self.full_absmax())
            assert self._nested is not None
            return self._nested

    def state(self) -> QuantState:
        offset = self.nested()[1] if self.settings.nested else None
        return self.settings.state(self.shape, self.natural.name, offset)

    def absmax_codes(self, ba: int, bb: int) -> npt.NDArray[np.uint8]:
        """The stored 8-bit absmax codes of blocks [ba, bb) (recorded by :meth:`encode`, or recomputed)."""
        nested_absmax, offset = self.nested()
        with self._lock:
            if self._codes is not None and not self._codes_full and self._codes_have is not None:
                self._codes_full = bool(self._codes_have.all())
                if self._codes_full:
                    self._codes_have = None
            if self._codes is not None and self._codes_full:
                return self._codes[ba:bb].copy()
        am = self.absmax_blocks(ba, bb)
        scale = nested_absmax[np.arange(ba, bb) // NESTED_BLOCKSIZE]
        return encode_8bit(am - np.float32(offset), scale)

    def _accumulator(self) -> ReportAccumulator | None:
        if not self.want_report:
            return None
        with self._lock:
            if self._acc is None:
                if self._median_max is None:
                    self.full_absmax()
                assert self._median_max is not None
                self._acc = ReportAccumulator(self.name, self.state(), *self._median_max,
                                              outlier_factor=self.outlier_factor)
            return self._acc

    def encode(self, a: int, b: int) -> npt.NDArray[np.uint8]:
        """Packed codes of elements [a, b) (pass 2), adding to the report."""
        acc = self._accumulator()
        out = []
        for s, e in self._pieces(a, b):
            x = self.read(s, e)
            am = self._absmax_of(x, s)
            packed = encode_4bit(x, am, self.bs, self.settings.quant_type, self.bounds)
            out.append(packed)
            codes = self._record_codes(s, am) if self.settings.nested else None
            if acc is not None:
                acc.add(s, np.asarray(x).reshape(-1), self._dequantize(packed, am, s, e, codes), am)
            del x
        return np.concatenate(out) if len(out) != 1 else out[0]

    def _record_codes(self, s: int, am: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """The 8-bit absmax codes of the blocks from element s, kept for the absmax tensor (1 byte a block)."""
        nested_absmax, offset = self.nested()
        ba = s // self.bs
        scale = nested_absmax[np.arange(ba, ba + am.size) // NESTED_BLOCKSIZE]
        codes = encode_8bit(am - np.float32(offset), scale)
        with self._lock:
            if self._codes is None:
                self._codes = np.empty(self.n_blocks, dtype=np.uint8)
                self._codes_have = np.zeros(self.n_blocks, dtype=np.bool_)
                self._codes_full = False
            self._codes[ba : ba + codes.size] = codes
            if self._codes_have is not None:
                self._codes_have[ba : ba + codes.size] = True
        return codes

    def _dequantize(self, packed: npt.NDArray[np.uint8], am: npt.NDArray[np.float32], s: int,
                    e: int, codes: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.float32]:
        from .kernels import dequantize_4bit

        if self.settings.nested:
            nested_absmax, offset = self.nested()
            ba = s // self.bs
            scale = nested_absmax[np.arange(ba, ba + am.size) // NESTED_BLOCKSIZE]
            if codes is None:
                codes = encode_8bit(am - np.float32(offset), scale)
            am = resolve_nested(codes, scale, offset)
        return dequantize_4bit(packed, am, QUANT_TABLES[self.settings.quant_type], self.bs, e - s, "float32")

    def done_one(self) -> None:
        """One of this layer's output tensors is written; the last one frees everything."""
        with self._lock:
            self.tensors_left -= 1
            if self.tensors_left > 0:
                return
            if self._acc is not None:
                self.report = self._acc.result(stored_nbytes(self.state()))
            if self._absmax is not None:
                self._absmax = None
                self.budget.give(self._cached)
                self._cached = 0
            self._codes = self._codes_have = None
            self._codes_full = False
        self.inner.finish()


def _source_file(src: Any) -> str | None:
    """The input file behind a source, when it has one (for error messages)."""
    for _ in range(4):
        for attr in ("record", "layer"):
            obj = getattr(src, attr, None)
            rec = getattr(obj, "packed", obj) if attr == "layer" else obj
            if rec is not None and hasattr(rec, "file"):
                return str(rec.file)
        src = getattr(src, "inner", None)
        if src is None:
            break
    return None


class _JobSource(Source):
    """Base of the sources of one layer's output tensors."""

    def __init__(self, job: _LayerJob, name: str, numel: int, unit: int, kind: str) -> None:
        super().__init__()
        self.job = job
        self.name = name
        self.numel = numel
        self.unit = unit
        self.kind = kind
        job.tensors_left += 1

    def finish(self) -> None:
        self.job.done_one()


class _PackedSource(_JobSource):
    def __init__(self, job: _LayerJob, name: str, storage: DType) -> None:
        item = storage.itemsize
        nbytes = -(-job.n // 2)
        super().__init__(job, name, nbytes // item, max(1, job.align // (2 * item)),
                         f"quantize {job.settings.quant_type} bs{job.bs}"
                         + (" nested" if job.settings.nested else "") + f" <- {job.inner.kind}")
        self.item = item
        self.in_nbytes = job.inner.in_nbytes

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        b0, b1 = start * self.item, stop * self.item
        return self.job.encode(2 * b0, min(self.job.n, 2 * b1))

    def release(self, start: int, stop: int) -> None:  # the reads released their pages already
        pass


class _AbsmaxSource(_JobSource):
    barrier = True  # nested: made from the codes recorded while the layer's weight was written

    def __init__(self, job: _LayerJob, name: str) -> None:
        super().__init__(job, name, job.n_blocks, max(1, job.align // job.bs),
                         "absmax (8-bit codes)" if job.settings.nested else "absmax")

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        if self.job.settings.nested:
            return self.job.absmax_codes(start, stop)
        if start == 0 and stop == self.numel:  # the usual single chunk: one pass, cached for the codes
            return self.job.full_absmax()
        return self.job.absmax_blocks(start, stop)


class _NestedAbsmaxSource(_JobSource):
    def __init__(self, job: _LayerJob, name: str, numel: int) -> None:
        super().__init__(job, name, numel, 1, "nested absmax")

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        return self.job.nested()[0][start:stop]


class _StateSource(_JobSource):
    def __init__(self, job: _LayerJob, name: str, numel: int) -> None:
        super().__init__(job, name, numel, 1, "quant_state JSON")

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        text = self.job.state().to_json().encode("utf-8")
        return np.frombuffer(text, dtype=np.uint8)[start:stop].copy()


class _ConstSource(_JobSource):
    def __init__(self, job: _LayerJob, name: str, values: npt.NDArray[np.float32], kind: str) -> None:
        super().__init__(job, name, values.size, 1, kind)
        self.values = values

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        return self.values[start:stop].copy()


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


# --- planning ------------------------------------------------------------------------------------


@dataclass
class QuantPlanInfo:
    """What :func:`make_quant_plan` decided, besides the plan itself.

    Attributes:
        jobs: the layers to quantize (their reports fill in as they are written).
        passthrough: weights copied unchanged from a bnb input.
        kept: tensors left as they are, with the reason.
        skip_modules: the ``llm_int8_skip_modules`` written to config.json (None = null).
    """

    jobs: list[_LayerJob] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    skip_modules: list[str] | None = None


def _passthrough_ok(src: Source, settings: QuantSettings) -> bool:
    if not isinstance(src, Dequant4Source):
        return False
    layer, st = src.layer, src.layer.state
    if (st.quant_type, st.blocksize, st.nested) != (settings.quant_type, settings.blocksize, settings.nested):
        return False
    if st.nested and (st.nested_blocksize != NESTED_BLOCKSIZE or (st.nested_dtype or "float32") != "float32"):
        return False
    if layer.absmax.dtype.code != ("U8" if st.nested else "F32") or len(layer.absmax.shape) != 1:
        return False
    if st.nested and (layer.nested_absmax is None or layer.nested_absmax.dtype.code != "F32"):
        return False
    return True


def _passthrough_tensors(t: PlannedTensor, src: Dequant4Source, settings: QuantSettings) -> list[PlannedTensor]:
    layer, st = src.layer, src.layer.state
    storage = BY_NAME[settings.quant_storage]
    shape = settings.storage_shape(st.numel, t.name)
    out = [PlannedTensor(t.name, storage, shape, _CopySource(layer.packed, t.name, storage))]
    out.append(PlannedTensor(f"{t.name}.absmax", layer.absmax.dtype, (st.n_blocks,),
                             _CopySource(layer.absmax, f"{t.name}.absmax", layer.absmax.dtype)))
    const: list[tuple[str, npt.NDArray[Any]]] = [("quant_map", QUANT_TABLES[st.quant_type])]
    if st.nested:
        assert layer.nested_absmax is not None
        out.append(PlannedTensor(f"{t.name}.nested_absmax", _F32, (st.n_nested_blocks,),
                                 _CopySource(layer.nested_absmax, f"{t.name}.nested_absmax", _F32)))
        const.append(("nested_quant_map", DYNAMIC_MAP_SIGNED))
    text = np.frombuffer(st.to_json().encode("utf-8"), dtype=np.uint8)
    const.append((f"quant_state.bitsandbytes__{st.quant_type}", text))
    for suffix, values in const:
        dt = _U8 if values.dtype == np.uint8 else _F32
        out.append(PlannedTensor(f"{t.name}.{suffix}", dt, (values.size,), _ArraySource(values, suffix)))
    return out


class _ArraySource(Source):
    def __init__(self, values: np.ndarray, kind: str) -> None:
        super().__init__()
        self.values = values
        self.numel = values.size
        self.kind = kind

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        return np.array(self.values[start:stop])


def _job_tensors(job: _LayerJob, settings: QuantSettings, json_len: int | None) -> list[PlannedTensor]:
    name = job.name
    storage = BY_NAME[settings.quant_storage]
    out = [
        PlannedTensor(name, storage, settings.storage_shape(job.n, name), _PackedSource(job, name, storage)),
        PlannedTensor(f"{name}.absmax", _U8 if settings.nested else _F32, (job.n_blocks,),
                      _AbsmaxSource(job, f"{name}.absmax")),
        PlannedTensor(f"{name}.quant_map", _F32, (16,),
                      _ConstSource(job, f"{name}.quant_map", QUANT_TABLES[settings.quant_type], "quant_map")),
    ]
    if settings.nested:
        nn = -(-job.n_blocks // NESTED_BLOCKSIZE)
        out.append(PlannedTensor(f"{name}.nested_absmax", _F32, (nn,),
                                 _NestedAbsmaxSource(job, f"{name}.nested_absmax", nn)))
        out.append(PlannedTensor(f"{name}.nested_quant_map", _F32, (256,),
                                 _ConstSource(job, f"{name}.nested_quant_map", DYNAMIC_MAP_SIGNED,
                                              "nested_quant_map")))
    if json_len is None:  # not nested: the JSON is known now
        json_len = len(settings.state(job.shape, job.natural.name).to_json().encode("utf-8"))
    key = f"{name}.quant_state.bitsandbytes__{settings.quant_type}"
    out.append(PlannedTensor(key, _U8, (json_len,), _StateSource(job, key, json_len)))
    return out


def make_quant_plan(
    plan: Plan,
    settings: QuantSettings,
    *,
    skip: Sequence[str] = (),
    include: Sequence[str] = (),
    max_memory: int = 1 << 30,
    threads: int = 1,
    max_shard_size: int = 5 * 10**9,
    requantize: bool = False,
    report: bool = True,
    outlier_factor: float = 10.0,
    prepass: bool = True,
    piece_elements: int | None = None,
    cache_bytes: int | None = None,
) -> tuple[Plan, QuantPlanInfo]:
    """Turn a dequantization plan (``--to auto`` + hooks) into a 4-bit plan.

    Args:
        plan: from :func:`convert.plan.make_plan` with ``to="auto"``, after the plan hooks.
        settings: quant type, blocksize, nesting, storage.
        skip: ``--skip-modules`` patterns.
        include: ``--include`` patterns.
        max_memory: the memory cap in bytes (sizes the pieces and the absmax cache).
        threads: worker threads of the pre-pass.
        max_shard_size: largest shard of a directory output, in bytes.
        requantize: re-quantize bnb layers even when they already have these settings.
        report: collect a :class:`~convert.quantize.QuantReport` per quantized weight.
        outlier_factor: the report's outlier threshold, in layer medians of absmax.
        prepass: read each nested layer once now, so its QuantState JSON length is known (needed
            before writing; ``False`` for ``--dry-run``, which then shows an estimated length).
        piece_elements: elements read from a source at a time (default: from ``max_memory``).
        cache_bytes: bytes of fp32 absmax kept between passes (default: ``max_memory / 8``).

    Returns:
        (the new plan, a :class:`QuantPlanInfo`).

    Raises:
        UnsupportedError: QNT-005, a weight whose packed bytes do not fill ``quant_storage``
            elements; QNT-003, a weight with NaN or infinity (found in the pre-pass or while writing).
    """
    from .pipeline import chunk_elements

    info = QuantPlanInfo()
    old_qc = _input_quantization_config(plan)
    skip = list(dict.fromkeys([*skip, *(old_qc.get("llm_int8_skip_modules") or [])]))
    if piece_elements is None:
        piece_elements = chunk_elements(settings.blocksize, max_memory, max(1, threads)) // 2
    piece = max(settings.blocksize, piece_elements)
    budget = _Budget(max(0, max_memory // 8 if cache_bytes is None else cache_bytes))
    grouped: list[list[PlannedTensor]] = []
    heads_kept: list[str] = []
    for t in plan.tensors:
        was_q = isinstance(getattr(t.source, "layer", None), (QuantizedLayer, Int8Layer))
        ok, why = should_quantize(t.name, t.shape, t.dtype, was_quantized=was_q, skip=skip, include=include)
        if not ok:
            info.kept[t.name] = why
            if why == "output head" and t.name.endswith(".weight"):
                heads_kept.append(_module(t.name))
            grouped.append([t])
            continue
        if not requantize and _passthrough_ok(t.source, settings):
            assert isinstance(t.source, Dequant4Source)
            info.passthrough.append(t.name)
            grouped.append(_passthrough_tensors(t, t.source, settings))
            continue
        settings.storage_shape(math.prod(t.shape), t.name)  # QNT-005 before any work
        job = _LayerJob(t, settings, piece, budget, report, outlier_factor)
        info.jobs.append(job)
        grouped.append([])  # filled after the pre-pass
    nested_jobs = [j for j in info.jobs if settings.nested]
    if prepass and nested_jobs:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(lambda j: j.prepass(), nested_jobs))
    jobs = iter(info.jobs)
    for i, group in enumerate(grouped):
        if group:
            continue
        job = next(jobs)
        json_len = None
        if settings.nested:
            if prepass:
                json_len = len(job.state().to_json().encode("utf-8"))
            else:  # estimate for the plan listing: the offset's repr is 17-22 characters
                json_len = len(settings.state(job.shape, job.natural.name, 0.0).to_json()) + 17
        grouped[i] = _job_tensors(job, settings, json_len)
        if settings.nested and not prepass:
            grouped[i][-1].source.kind = "quant_state JSON (length estimated: the offset is not read yet)"

    tensors: list[PlannedTensor] = [t for g in grouped for t in g]
    if plan.checkpoint.is_dir:
        shards = shard_tensors(tensors, max_shard_size)
    else:
        shards = [list(range(len(tensors)))]
    for shard in shards:
        shard.sort(key=lambda k: safetensors_order_key(tensors[k].name, tensors[k].dtype))
    new = Plan(checkpoint=plan.checkpoint, to=settings.quant_type, tensors=tensors, shards=shards,
               config=plan.config, notes=list(plan.notes))
    user_skip = list(dict.fromkeys(skip))
    # transformers leaves the head out only while llm_int8_skip_modules is null: once patterns are
    # given (or the head is quantized on request), the list must name every kept head itself
    included_heads = sorted({_module(t.name) for t in plan.tensors
                             if _is_head(_module(t.name)) and t.name not in info.kept})
    if user_skip or included_heads:
        info.skip_modules = sorted(set(user_skip) | set(heads_kept))
    if new.config is not None:
        cfg = dict(new.config)
        compute = old_qc.get("bnb_4bit_compute_dtype") or _compute_dtype(cfg, info.jobs, plan)
        cfg["quantization_config"] = quantization_config(settings, compute, info.skip_modules)
        new.config = cfg
    return new, info


def _input_quantization_config(plan: Plan) -> dict[str, Any]:
    """The input's bnb ``quantization_config`` (its skip list and compute dtype carry over), or {}."""
    cfg = plan.checkpoint.config
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "bitsandbytes":
        return {}
    out: dict[str, Any] = {}
    skip = qc.get("llm_int8_skip_modules")
    if isinstance(skip, list) and all(isinstance(x, str) for x in skip):
        out["llm_int8_skip_modules"] = skip
    compute = qc.get("bnb_4bit_compute_dtype")
    if isinstance(compute, str) and compute.replace("torch.", "") in ("bfloat16", "float16", "float32"):
        out["bnb_4bit_compute_dtype"] = compute.replace("torch.", "")
    return out


def _compute_dtype(cfg: dict[str, Any], jobs: list[_LayerJob], plan: Plan) -> str:
    for key in ("dtype", "torch_dtype"):
        v = cfg.get(key)
        if isinstance(v, str) and v.replace("torch.", "") in ("bfloat16", "float16", "float32"):
            return v.replace("torch.", "")
    names = {j.natural.name for j in jobs}
    return names.pop() if len(names) == 1 else "float32"


# --- command line ----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--to nf4|fp4`` options (a :data:`convert.cli.PARSER_HOOKS` entry)."""
    g = p.add_argument_group("4-bit output (--to nf4 | fp4)")
    g.add_argument("--blocksize", type=int, default=None, choices=[32, 64, 128, 256, 512, 1024, 2048, 4096],
                   metavar="N", help="elements per absmax block, 32..4096 (default: 64, as transformers)")
    g.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                   help="8-bit quantize absmax (bnb_4bit_use_double_quant; default: on)")
    g.add_argument("--quant-storage", default=None, choices=list(QUANT_STORAGES),
                   help="dtype the packed bytes are stored as (bnb_4bit_quant_storage; default: uint8)")
    g.add_argument("--skip-modules", action="append", default=[], metavar="PATTERN",
                   help="keep matching modules unquantized (transformers llm_int8_skip_modules matching; "
                   "repeat or comma-separate)")
    g.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="quantize matching tensors whatever the rules say (e.g. a 1-D tensor of a test file)")
    g.add_argument("--requantize", action="store_true",
                   help="re-quantize bnb layers even when they already have the asked settings")
    g.add_argument("--quant-report", type=Path, metavar="FILE",
                   help="write the per-tensor quantization report (relative error, bits/weight, outlier "
                   "blocks) as JSON")
    g.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="reproduce torch.mean as with this many torch threads, for layers with 32768+ "
                   f"blocks (bnb's nested offset on CPU; default: {TORCH_NUM_THREADS})")


_OPTIONS = ("blocksize", "double_quant", "quant_storage", "skip_modules", "include", "requantize", "quant_report",
            "torch_threads")


def check_arguments(args: argparse.Namespace) -> None:
    """CHECK_HOOK: the 4-bit options mean nothing for other targets; refuse them rather than ignore them.

    Raises:
        UsageError: a 4-bit option with ``--to`` other than nf4/fp4, or ``--torch-threads`` below 1.
    """
    if getattr(args, "to", None) in ("nf4", "fp4"):
        if args.torch_threads is not None and args.torch_threads < 1:
            raise UsageError("--torch-threads must be at least 1", found=args.torch_threads)
        return
    for opt in _OPTIONS:
        value = getattr(args, opt, None)
        if value is not None and value != [] and not (opt == "requantize" and value is False):
            flag = "--no-double-quant" if value is False else "--" + opt.replace("_", "-")
            raise UsageError(f"{flag} needs --to nf4 or --to fp4", expected="--to nf4|fp4",
                             found=f"--to {getattr(args, 'to', None)}")


def _patterns(values: list[str]) -> list[str]:
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def run(args: argparse.Namespace, checkpoint: Any) -> dict[str, Any] | None:
    """Runner of ``--to nf4`` / ``--to fp4`` (a :data:`convert.cli.EXTRA_TARGETS` entry).

    Returns:
        the run summary (``None`` after ``--dry-run``, which prints the plan).
    """
    from .pipeline import run_plan
    from .plan import default_output

    check_arguments(args)
    settings = QuantSettings(
        args.to,
        64 if args.blocksize is None else args.blocksize,
        True if args.double_quant is None else args.double_quant,
        args.quant_storage or "uint8",
        num_threads=TORCH_NUM_THREADS if args.torch_threads is None else args.torch_threads,
    )
    threads = max(1, args.threads or os.cpu_count() or 1)
    plan = make_plan(checkpoint, "auto", max_shard_size=args.max_shard_size)
    for hook in cli.PLAN_HOOKS:
        plan = hook(args, plan)
    qplan, info = make_quant_plan(
        plan, settings, skip=_patterns(args.skip_modules), include=_patterns(args.include),
        max_memory=args.max_memory, threads=threads, max_shard_size=args.max_shard_size,
        requantize=args.requantize, report=not args.dry_run, prepass=not args.dry_run,
    )
    qplan.notes.append(
        f"{len(info.jobs)} weights quantized to {settings.quant_type} (blocksize {settings.blocksize}, "
        f"double quant {'on' if settings.nested else 'off'}, storage {settings.quant_storage})"
        + (f", {len(info.passthrough)} copied unchanged" if info.passthrough else "")
    )
    if args.dry_run:
        print(json.dumps(qplan.to_dict(), indent=2) if args.json else qplan.describe())
        return None
    out = args.output or default_output(Path(checkpoint.source), settings.quant_type)
    summary = run_plan(qplan, out, threads=args.threads, max_memory=args.max_memory, overwrite=args.overwrite,
                       progress=not args.quiet and not args.json and sys.stderr.isatty(),
                       verify=args.verify).to_dict()
    reports = [j.report.as_dict() for j in info.jobs if j.report is not None]
    summary["quantized"] = len(info.jobs)
    summary["passthrough"] = len(info.passthrough)
    summary["report"] = reports
    if reports:
        errs = [float(j.report.rel_error) for j in info.jobs if j.report is not None]
        done = [j.report for j in info.jobs if j.report is not None]
        flagged = sorted((r for r in done if r.outlier), key=lambda r: -r.outlier_zero_share)
        summary["notes"].append(f"relative error: mean {np.mean(errs):.4f}, max {max(errs):.4f}; "
                                f"{len(flagged)} of {len(reports)} layers have outlier blocks "
                                f"(absmax > 10x the layer median)")
        if flagged:
            worst = ", ".join(f"{r.name} ({r.outlier_blocks} blocks, {100 * r.outlier_zero_share:.0f}% "
                              f"of their weights -> 0)" for r in flagged[:3])
            summary["notes"].append(f"most affected: {worst}"
                                    + ("; all layers in --quant-report" if args.quant_report is None else ""))
    if args.quant_report is not None:
        args.quant_report.write_text(json.dumps(reports, indent=2) + "\n")
    for result_hook in cli.RESULT_HOOKS:  # e.g. the --merge-lora report, keyed by the hooked plan
        result_hook(args, plan, summary)
    return summary


run.merges_lora = True  # type: ignore[attr-defined]  # --merge-lora composes: its hook runs first


cli.PARSER_HOOKS.append(add_arguments)
cli.CHECK_HOOKS.append(check_arguments)
cli.EXTRA_TARGETS["nf4"] = run
cli.EXTRA_TARGETS["fp4"] = run

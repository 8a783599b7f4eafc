"""From an opened checkpoint and options to an ordered list of output tensors, before any data is read.

A :class:`Plan` names every output tensor (name, dtype, shape, bytes) with the :class:`Source` that
produces it, groups them into shards, and carries the edited ``config.json``. ``--dry-run`` prints
it; :mod:`convert.stream.pipeline` runs it.

A :class:`Source` produces a tensor's flat elements ``[start, stop)`` in the output dtype. Chunk
boundaries must be multiples of ``Source.unit`` (a 4-bit layer's blocksize), so every chunk starts on
a block and a byte boundary. Sources read their input through zero-copy views and release consumed
pages with :meth:`Source.release`.
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from convert.dequant import kernels, kernels_f16
from convert.options import FLOAT_TARGETS
from convert.units import format_bytes
from formats.bnb import QUANT_TABLES, Int8Layer, QuantizedLayer, TensorLike, is_int8_config
from formats.bnb_layers import group_layers
from formats.checkpoint import Checkpoint, TensorRecord, gc_paused
from formats.dtypes import BY_NAME, DType, float_dtype_name
from formats.errors import NonFiniteAbsmaxError, UnsupportedError, UsageError
from formats.writeback import bytes_of

__all__ = [
    "CastSource",
    "Codes4",
    "Dequant4Source",
    "Int8Source",
    "Plan",
    "PlannedTensor",
    "Source",
    "make_plan",
    "shard_tensors",
    "strip_quantization_config",
]



class Codes4(NamedTuple):
    """Elements [start, stop) of a bnb 4-bit layer as stored (:meth:`Source.codes_4bit`; ``start`` on a
    block, as every chunk boundary is).

    Attributes:
        packed: ``uint8[ceil(n / 2)]`` the packed codes (high nibble = even element).
        absmax: ``float32[ceil(n / blocksize)]`` their resolved absmax (finite).
        quant_map: ``float32[16]``.
        blocksize: elements per absmax.
    """

    packed: npt.NDArray[np.uint8]
    absmax: npt.NDArray[np.float32]
    quant_map: npt.NDArray[np.float32]
    blocksize: int


class Source:
    """Produces one output tensor in chunks.

    Attributes:
        name: the output tensor name.
        numel: number of elements.
        unit: chunk boundaries (in elements) must be multiples of this.
        in_nbytes: bytes of input this source reads.
        kind: a short label for the plan ("dequant nf4", "cast", "copy", ...).
        stats: ``int64[2]`` fp16 overflow / flush-to-zero counts, added to by :meth:`produce`.
    """

    name: str
    numel: int
    unit: int = 1
    in_nbytes: int = 0
    kind: str = ""
    #: True when :meth:`produce` relies on every earlier tensor of the file being written first (e.g. an
    #: absmax tensor made from codes recorded while its weight was written): the pipeline's writing thread
    #: makes its chunks when their turn to be written comes (the workers go on with later tensors).
    barrier: bool = False
    #: Most elements per chunk, or 0 for the pipeline's sizing alone (:func:`convert.stream.pipeline.chunk_elements`,
    #: which counts output elements): set by a source whose chunk reads more than one input element per
    #: output element (a 4-bit weight: two per byte), so a tensor still splits into chunks for every thread.
    max_chunk: int = 0
    #: True when :meth:`produce_into` makes the values in the memory it is given (a kernel's output), so
    #: the pipeline has chunks made in memory placed for the writer (no copy); a source whose values would
    #: only be copied there is written from what :meth:`produce` returns, through the writer's buffers
    #: (fresh memory for the copy costs page faults that the writer's reused buffers do not).
    writes_in_place: bool = False

    def __init__(self) -> None:
        self.stats = np.zeros(2, dtype=np.int64)
        self._lock = threading.Lock()

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:  # pragma: no cover - abstract
        """Elements [start, stop) of the flat tensor as ``dtype.numpy[stop - start]``."""
        raise NotImplementedError

    def produce_into(self, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        """:meth:`produce` into ``out`` (C-contiguous ``dtype.numpy[stop - start]``, e.g. memory placed for
        the writer): here a copy of the bytes :meth:`produce` returns (a copying source's raw bytes, too); a
        source whose kernel writes in place overrides it."""
        np.copyto(out.reshape(-1).view(np.uint8), bytes_of(self.produce(start, stop, dtype)))

    def codes_4bit(self, start: int, stop: int) -> Codes4 | None:
        """The 4-bit codes and absmax behind elements [start, stop) (``start`` a multiple of ``unit``) when
        this source is a bnb 4-bit layer dequantized as it is (for an encoder that works from the codes:
        GGUF F16 of its bfloat16 values); None for every other source."""
        return None

    def release(self, start: int, stop: int) -> None:
        """Elements [start, stop) are written: drop their input pages."""

    def finish(self) -> None:
        """The whole tensor is written: drop caches and any input pages still held."""

    def inputs(self) -> list[TensorLike] | None:
        """The input tensors :meth:`produce` reads (so a low-disk run knows which input files a tensor
        needs and when a file is no longer needed), or None when this source cannot say."""
        return None

    def _add_stats(self, local: npt.NDArray[np.int64]) -> None:
        if local.any():
            with self._lock:
                self.stats += local




class Dequant4Source(Source):
    """A bitsandbytes 4-bit layer, dequantized (bnb-format.md §2)."""

    writes_in_place = True

    def __init__(self, layer: QuantizedLayer) -> None:
        super().__init__()
        self.layer = layer
        st = layer.state
        self.name = layer.name
        self.numel = st.numel
        self.unit = st.blocksize
        self.in_nbytes = sum(
            t.nbytes for t in (layer.packed, layer.absmax, layer.quant_map, layer.nested_absmax,
                               layer.nested_quant_map) if t is not None
        )
        self.kind = f"dequant {st.quant_type} bs{st.blocksize}" + (" nested" if st.nested else "")
        self._absmax: npt.NDArray[np.float32] | None = None
        # the layer's quant_map equals its quant_type's table bit for bit (BNB-005, checked in formats.bnb_layers)
        self._quant_map = QUANT_TABLES[st.quant_type]

    def absmax(self) -> npt.NDArray[np.float32]:
        """The resolved fp32 absmax, ``float32[n_blocks]`` (nested quantization undone), cached.

        Raises:
            NonFiniteAbsmaxError: BNB-012 when a value is not finite (inf or NaN).
        """
        with self._lock:
            if self._absmax is None:
                self._absmax = self._resolve()
            return self._absmax

    def check_absmax(self) -> None:
        """Check the resolved absmax without keeping it (a layer copied unchanged to an NF4/FP4 output: its
        bytes are never dequantized, and a cached absmax would hold 1/16 of the layer's size for the run).

        Raises:
            NonFiniteAbsmaxError: BNB-012 when a value is not finite (inf or NaN).
        """
        with self._lock:
            if self._absmax is None:
                self._resolve()

    def _resolve(self) -> npt.NDArray[np.float32]:
        layer, st = self.layer, self.layer.state
        src = layer.absmax  # the stored tensor named when a value is not finite
        if st.nested:
            assert layer.nested_absmax is not None and layer.nested_quant_map is not None
            assert st.nested_blocksize is not None and st.nested_offset is not None
            nested = np.asarray(layer.nested_absmax.array(), dtype=np.float32).reshape(-1)
            absmax = kernels.dequantize_nested_absmax(
                layer.absmax_flat(),
                nested,
                layer.nested_quant_map.array().reshape(-1),
                st.nested_blocksize,
                st.nested_offset,
                st.nested_dtype or "float32",
            )
        else:
            absmax = np.ascontiguousarray(layer.absmax_flat(), dtype=np.float32)  # F16/BF16: exact
        finite = np.isfinite(absmax)
        if not finite.all():
            j = int(np.argmin(finite))
            if st.nested and not np.isfinite(nested[j // st.nested_blocksize]):
                src = layer.nested_absmax  # (it spoils its whole nested block)
            raise NonFiniteAbsmaxError(
                "absmax must be finite", path=src.file, tensor=src.name,
                expected="finite values",
                found=f"{absmax[j]} at block {j} ({int((~finite).sum())} of {absmax.size} not finite)",
                hint="the layer's scales are damaged; this weight cannot be recovered from the file",
            )
        return absmax

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        out = np.empty(stop - start, dtype=dtype.numpy)
        self.produce_into(start, stop, dtype, out)
        return out

    def produce_into(self, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        st = self.layer.state
        packed = self.layer.packed.raw(start // 2, (stop + 1) // 2)
        absmax = self.absmax()[start // st.blocksize : -(-stop // st.blocksize)]
        local = np.zeros(2, dtype=np.int64) if dtype.name == "float16" else None
        kernels.dequantize_4bit(packed, absmax, self._quant_map, st.blocksize, stop - start, dtype.numpy, out=out,
                                stats=local)
        if local is not None:
            self._add_stats(local)

    def codes_4bit(self, start: int, stop: int) -> Codes4:
        st = self.layer.state
        packed = self.layer.packed.raw(start // 2, (stop + 1) // 2)
        absmax = self.absmax()[start // st.blocksize : -(-stop // st.blocksize)]
        return Codes4(packed, absmax, self._quant_map, st.blocksize)

    def release(self, start: int, stop: int) -> None:
        self.layer.packed.release(start // 2, stop // 2)

    def inputs(self) -> list[TensorLike] | None:
        layer = self.layer
        return [t for t in (layer.packed, layer.absmax, layer.quant_map, layer.nested_absmax,
                            layer.nested_quant_map) if t is not None]

    def finish(self) -> None:
        with self._lock:
            self._absmax = None
        layer = self.layer
        for t in (layer.packed, layer.absmax, layer.nested_absmax):
            if t is not None:
                t.release()


class CastSource(Source):
    """A plain (not quantized) tensor, copied or cast to a float output dtype (one rounding)."""

    def __init__(self, record: TensorRecord, out_dtype: DType) -> None:
        super().__init__()
        self.record = record
        self.name = record.name
        self.numel = record.numel
        self.in_nbytes = record.nbytes
        self.kind = "copy" if out_dtype.code == record.dtype.code else f"cast {record.dtype.name}->{out_dtype.name}"

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        item = self.record.dtype.itemsize
        return _cast(self.record.raw(start * item, stop * item), self.record.dtype, dtype, self)

    def release(self, start: int, stop: int) -> None:
        item = self.record.dtype.itemsize
        self.record.release(start * item, stop * item)

    def inputs(self) -> list[TensorLike] | None:
        return [self.record]


def cast_run(sources: list[CastSource], dtype: DType) -> np.ndarray:
    """The elements of several plain tensors of one input dtype, one after the other, as ``dtype``:
    one concatenation and one cast for what would be a cast per tensor (10^4-10^5 tiny tensors).

    Args:
        sources: plain tensors of the same input dtype, in output order.
        dtype: their output dtype.

    Returns:
        ``dtype.numpy[sum of numel]``, each value rounded once as :meth:`CastSource.produce` does; fp16
        overflow and underflow counts are added to the first source's stats.
    """
    first = sources[0]
    return _cast(np.concatenate([s.record.raw() for s in sources]), first.record.dtype, dtype, first)


def _cast(raw: npt.NDArray[np.uint8], stored: DType, dtype: DType, counts: Source) -> np.ndarray:
    """Stored elements (``raw`` bytes of ``stored``) as ``dtype``: a view when the dtypes are the same,
    else widened to fp32 (exact) and rounded once (bf16 -> fp16: :func:`convert.dequant.kernels_f16.bf16_to_f16`, the
    same bits); fp16 overflow/underflow counts go to ``counts``."""
    if dtype.code == stored.code:  # a read-only view of the stored elements: no copy
        return raw.view(dtype.numpy)
    flat = raw.view(stored.numpy)
    if stored.name == "bfloat16" and dtype.name == "float16":  # only the few values not exact can be lost
        local = np.zeros(2, dtype=np.int64)
        out, rounded = kernels_f16.bf16_to_f16(flat, stats=local)
        if rounded.size:
            counts._add_stats(local)
        return out
    out = kernels.round_float32(flat, dtype.name)
    if dtype.name == "float16":
        local = np.zeros(2, dtype=np.int64)
        kernels_f16.count_f16_loss(flat.astype(np.float32, copy=False), out, local)
        counts._add_stats(local)
    return out


@dataclass(slots=True)
class PlannedTensor:
    """One output tensor (never changed once made: a merge or re-quantization makes new ones).

    Attributes:
        name: output name.
        dtype: output dtype row.
        shape: output shape, in elements.
        source: what produces its elements.
        parameters: the model parameters it stands for, as transformers' ``num_parameters()`` counts
            them (a packed 4-bit weight: its unpacked elements; a QuantState companion: 0); None: ``numel``.
        numel: elements (a Python int), from ``shape``.
        nbytes: output bytes, ``numel * dtype.itemsize``.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    source: Source
    parameters: int | None = None
    numel: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * self.dtype.itemsize


@dataclass
class Plan:
    """Everything a conversion will write, known before any tensor data is read.

    Attributes:
        checkpoint: the opened input.
        to: the ``--to`` value.
        tensors: output tensors in write order.
        shards: the output files as lists of indices into ``tensors`` (one file for a file input).
        config: the output ``config.json`` (None when the input has none).
        notes: things the user should know (per-run warnings), as text.
    """

    checkpoint: Checkpoint
    to: str
    tensors: list[PlannedTensor]
    shards: list[list[int]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def out_nbytes(self) -> int:
        """Bytes of tensor data to write."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_parameters(self) -> int:
        """Model parameters written, as transformers' ``num_parameters()`` counts them (the index's
        ``metadata.total_parameters``)."""
        return sum(t.numel if t.parameters is None else t.parameters for t in self.tensors)

    @property
    def in_nbytes(self) -> int:
        """Bytes of tensor data to read."""
        return sum(t.source.in_nbytes for t in self.tensors)

    def shard_names(self) -> list[str]:
        """Output file names, transformers style (``model.safetensors`` or ``model-0000i-of-0000n``)."""
        n = len(self.shards)
        if n <= 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``--dry-run --json``)."""
        names = self.shard_names() if self.checkpoint.is_dir else ["(the output file)"]
        return {
            "source": str(self.checkpoint.source),
            "to": self.to,
            "in_bytes": self.in_nbytes,
            "out_bytes": self.out_nbytes,
            "files": [
                {
                    "file": names[i],
                    "bytes": sum(self.tensors[j].nbytes for j in shard),
                    "tensors": [
                        {
                            "name": self.tensors[j].name,
                            "dtype": self.tensors[j].dtype.name,
                            "shape": list(self.tensors[j].shape),
                            "bytes": self.tensors[j].nbytes,
                            "how": self.tensors[j].source.kind,
                        }
                        for j in shard
                    ],
                }
                for i, shard in enumerate(self.shards)
            ],
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """A human-readable table of the plan (``--dry-run``)."""
        d = self.to_dict()
        lines = [f"{d['source']} -> --to {self.to}: {len(self.tensors)} tensors, "
                 f"{format_bytes(d['in_bytes'])} in, {format_bytes(d['out_bytes'])} out"]
        for f in d["files"]:
            lines.append(f"  {f['file']}  ({format_bytes(f['bytes'])})")
            for t in f["tensors"]:
                lines.append(f"    {t['name']:<60} {t['dtype']:<9} {str(t['shape']):<16} {t['how']}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)



def strip_quantization_config(config: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """A copy of a transformers config without any ``quantization_config`` (nested configs too).

    Args:
        config: the input ``config.json`` object.
        dtype: when given, the ``dtype`` / ``torch_dtype`` fields are set to it (where present; a
            top-level ``dtype`` is added when neither is).

    Returns:
        the edited copy (the input is not modified).
    """

    def walk(obj: Any, top: bool) -> Any:
        if isinstance(obj, dict):
            out = {k: walk(v, False) for k, v in obj.items() if k != "quantization_config"}
            if dtype is not None:
                present = [k for k in ("dtype", "torch_dtype") if k in out]
                for k in present:
                    out[k] = dtype
                if top and not present:
                    out["dtype"] = dtype
            return out
        if isinstance(obj, list):
            return [walk(v, False) for v in obj]
        return copy.deepcopy(obj)

    return walk(config, True)


def _output_dtype(to: str, natural: DType) -> DType:
    want = FLOAT_TARGETS[to]
    if want is None or not natural.is_float:
        return natural
    return BY_NAME[want]


#: The float dtypes models are ordinarily stored in: a cast between them is what ``--to`` asks for and
#: needs no note. A tensor stored in another float dtype (float8, float64) is named when cast.
_COMMON_FLOATS = ("bfloat16", "float16", "float32")


def _cast_notes(checkpoint: Checkpoint, tensors: list[PlannedTensor]) -> list[str]:
    """One note per uncommon source dtype whose tensors ``--to`` casts (e.g. the float8 text encoders of a
    diffusion checkpoint under ``--to bf16``): how many, which, whether exactly, and how to keep them."""
    cast: dict[tuple[str, str], list[str]] = {}
    for t in tensors:
        if isinstance(t.source, CastSource):
            stored = t.source.record.dtype
            if stored.name not in _COMMON_FLOATS and stored != t.dtype:
                cast.setdefault((stored.name, t.dtype.name), []).append(t.name)
    notes = []
    for (src, out), names in sorted(cast.items()):
        # every float8 value is a bfloat16/float16/float32 value; wider types round
        how = "exactly (every value fits)" if BY_NAME[src].itemsize == 1 else "rounding each value once"
        shown = ", ".join(names[:3]) + (f", ... ({len(names) - 3} more)" if len(names) > 3 else "")
        notes.append(f"{len(names)} tensor{'s' * (len(names) != 1)} stored as {src} cast to {out}, {how}: {shown} "
                     "(--to auto keeps them as stored)")
    return notes


def make_plan(
    checkpoint: Checkpoint,
    to: str = "auto",
    max_shard_size: int = 5 * 10**9,
) -> Plan:
    """Plan the dequantization of a checkpoint to safetensors.

    Args:
        checkpoint: the opened input.
        to: ``auto`` (each tensor keeps its QuantState dtype / own dtype), ``bf16``, ``fp16``, ``fp32``.
        max_shard_size: largest output shard in bytes (directory outputs), as transformers.

    Returns:
        the :class:`Plan`.

    Raises:
        UsageError: an unknown ``to``.
        NoWeightsError: CKPT-005, the checkpoint holds no tensor.
        BnbLayerError: a layer breaks a BNB rule.
        UnsupportedError: a layer kind without a kernel.
    """
    if to not in FLOAT_TARGETS:
        raise UsageError(f"unknown --to value '{to}'", expected=sorted(FLOAT_TARGETS), found=to)
    with gc_paused():
        return _make_plan(checkpoint, to, max_shard_size)


def _make_plan(checkpoint: Checkpoint, to: str, max_shard_size: int) -> Plan:
    checkpoint.require_tensors()
    layers, plain = group_layers(checkpoint.tensors, checkpoint.values,
                                 int8_model=is_int8_config(checkpoint.config))
    tensors: list[PlannedTensor] = []
    q_dtypes: set[str] = set()
    int8_layers = any(isinstance(layer, Int8Layer) for layer in layers.values())
    int8_natural = _int8_natural(checkpoint, plain) if int8_layers else BY_NAME["float16"]
    plain_names = set(plain)  # a list lookup per tensor made planning quadratic in the tensor count
    for name, rec in checkpoint.tensors.items():
        layer = layers.get(name)
        if isinstance(layer, QuantizedLayer):
            natural = BY_NAME[layer.state.dtype]
            q_dtypes.add(natural.name)
            out = _output_dtype(to, natural)
            tensors.append(PlannedTensor(name, out, layer.state.shape, Dequant4Source(layer)))
        elif isinstance(layer, Int8Layer):
            q_dtypes.add(int8_natural.name)
            tensors.append(_int8_tensor(layer, to, int8_natural))
        elif name in plain_names:
            out = _output_dtype(to, rec.dtype)
            tensors.append(PlannedTensor(name, out, rec.shape, CastSource(rec, out)))
    plan = Plan(checkpoint, to, tensors, notes=_layer_notes(layers) + _cast_notes(checkpoint, tensors))
    if checkpoint.is_dir:
        plan.shards = shard_tensors(tensors, max_shard_size)
    else:
        plan.shards = [list(range(len(tensors)))]
    if checkpoint.config is not None:
        out_dtype = FLOAT_TARGETS[to] or (q_dtypes.pop() if len(q_dtypes) == 1 else None)
        plan.config = strip_quantization_config(checkpoint.config, out_dtype)
    return plan


def _layer_notes(layers: dict[str, QuantizedLayer | Int8Layer]) -> list[str]:
    """The layers' warnings (legacy QuantState, BF16 / transposed absmax, ...), one note per kind."""
    seen: dict[str, list[str]] = {}
    for name, layer in layers.items():
        for w in getattr(layer, "warnings", ()):
            seen.setdefault(w, []).append(name)
    return [f"{w} ({len(names)} layer{'s' * (len(names) > 1)}, e.g. {names[0]})" for w, names in seen.items()]


def _int8_natural(checkpoint: Checkpoint, plain: list[str]) -> DType:
    """The dtype an LLM.int8 weight had before quantization: config ``dtype`` / ``torch_dtype``, else
    the dtype most plain (not quantized) float elements have, else float16."""
    cfg = checkpoint.config or {}
    for key in ("dtype", "torch_dtype"):
        name = float_dtype_name(cfg.get(key))
        if name is not None:
            return BY_NAME[name]
    counts: dict[str, int] = {}
    for rec in (checkpoint.tensors[n] for n in plain):
        if rec.dtype.name in ("bfloat16", "float16", "float32"):
            counts[rec.dtype.name] = counts.get(rec.dtype.name, 0) + rec.numel
    return BY_NAME[max(counts, key=lambda k: counts[k])] if counts else BY_NAME["float16"]


class Int8Source(Source):
    """An LLM.int8 layer (row format), dequantized (bnb-format.md §4); chunks are whole rows."""

    def __init__(self, layer: Int8Layer) -> None:
        super().__init__()
        self.layer = layer
        self.name = layer.name
        rows, cols = layer.shape
        self.numel = rows * cols
        self.unit = max(cols, 1)
        self.in_nbytes = layer.weight.nbytes + layer.scb.nbytes
        self.kind = "dequant int8 row"
        self._scb: npt.NDArray[np.float32] | None = None

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        cols = self.unit
        if self._scb is None:
            scb = np.array(self.layer.scb.array(), dtype=np.float32).reshape(-1)
            if not np.isfinite(scb).all():
                j = int(np.argmin(np.isfinite(scb)))
                raise NonFiniteAbsmaxError(
                    "SCB must be finite", path=self.layer.scb.file, tensor=self.layer.scb.name,
                    expected="finite values", found=f"{scb[j]} at row {j}",
                )
            self._scb = scb
        w = self.layer.weight.raw(start, stop).view(np.int8).reshape(-1, cols)
        scb = self._scb[start // cols : stop // cols]
        if dtype.name != "float16":
            return kernels.dequantize_int8(w, scb, dtype.numpy).reshape(-1)
        x = kernels.dequantize_int8(w, scb, "float32").reshape(-1)
        out = kernels.round_float32(x, "float16")
        local = np.zeros(2, dtype=np.int64)
        kernels_f16.count_f16_loss(x, out, local)
        self._add_stats(local)
        return out

    def release(self, start: int, stop: int) -> None:
        self.layer.weight.release(start, stop)

    def finish(self) -> None:
        self._scb = None
        self.layer.weight.release()

    def inputs(self) -> list[TensorLike] | None:
        return [self.layer.weight, self.layer.scb]


def _int8_source(layer: Int8Layer, to: str, natural: DType) -> PlannedTensor:
    return PlannedTensor(layer.name, _output_dtype(to, natural), layer.shape, Int8Source(layer))


def _int8_tensor(layer: Int8Layer, to: str, natural: DType) -> PlannedTensor:
    """Hook for LLM.int8 layers (bnb-format.md §4)."""
    if INT8_SOURCE is None:
        raise UnsupportedError(
            "LLM.int8 layers are not supported yet", path=layer.weight.file, tensor=layer.name,
        )
    return INT8_SOURCE(layer, to, natural)


#: Factory ``(Int8Layer, to, natural dtype) -> PlannedTensor`` for 8-bit layers.
INT8_SOURCE: Any = _int8_source


def shard_tensors(tensors: list[PlannedTensor], max_shard_size: int) -> list[list[int]]:
    """Split like transformers: start a new shard when the next tensor would pass the limit."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += t.nbytes
    return shards

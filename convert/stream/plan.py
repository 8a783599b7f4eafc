"""From an opened checkpoint and options to an ordered list of output tensors, before any data is read.

A :class:`Plan` names every output tensor (name, dtype, shape, bytes) with the
:class:`~convert.stream.sources.Source` that produces it, groups them into shards, and carries the
edited ``config.json``. ``--dry-run`` prints it; a target's job writes it
(:mod:`convert.stream.safetensors_job`, :mod:`convert.gguf.encode`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from convert.options import FLOAT_TARGETS
from convert.stream.sources import CastSource, Dequant4Source, Int8Source, Source
from convert.units import format_bytes
from formats.bnb import Int8Layer, QuantizedLayer, is_int8_config
from formats.bnb_layers import group_layers
from formats.checkpoint import Checkpoint, gc_paused
from formats.dtypes import BY_NAME, DType, float_dtype_name
from formats.errors import UsageError

__all__ = [
    "Plan",
    "PlannedTensor",
    "bnb_cpu_notes",
    "make_plan",
    "shard_tensors",
    "strip_quantization_config",
]


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
        dequant_notes: those of ``notes`` that hold only for a dequantized output (nothing was
            quantized; bnb's CPU kernel disagrees): a re-quantizing target (``--to nf4``) drops them.
    """

    checkpoint: Checkpoint
    to: str
    tensors: list[PlannedTensor]
    shards: list[list[int]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    dequant_notes: list[str] = field(default_factory=list)

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
            tensors.append(PlannedTensor(layer.name, _output_dtype(to, int8_natural), layer.shape, Int8Source(layer)))
        elif name in plain_names:
            out = _output_dtype(to, rec.dtype)
            tensors.append(PlannedTensor(name, out, rec.shape, CastSource(rec, out)))
    dequant = ([] if layers else [NOTHING_QUANTIZED]) + bnb_cpu_notes(
        [(name, layer.state.shape, layer.state.blocksize) for name, layer in layers.items()
         if isinstance(layer, QuantizedLayer)])
    notes = dequant[:1] + _layer_notes(layers) + dequant[1:] + _cast_notes(checkpoint, tensors)
    plan = Plan(checkpoint, to, tensors, notes=notes, dequant_notes=dequant)
    if checkpoint.is_dir:
        plan.shards = shard_tensors(tensors, max_shard_size)
    else:
        plan.shards = [list(range(len(tensors)))]
    if checkpoint.config is not None:
        out_dtype = FLOAT_TARGETS[to] or (q_dtypes.pop() if len(q_dtypes) == 1 else None)
        plan.config = strip_quantization_config(checkpoint.config, out_dtype)
    return plan


#: The note of a checkpoint without a bitsandbytes layer (a 16-bit model given by mistake, say).
NOTHING_QUANTIZED = ("no bitsandbytes-quantized layer in the input (no 4-bit QuantState, no int8 SCB): nothing is "
                     "dequantized, every tensor is copied or cast to the target's dtype")


def _layer_notes(layers: dict[str, QuantizedLayer | Int8Layer]) -> list[str]:
    """The layers' warnings (legacy QuantState, BF16 / transposed absmax, ...), one note per kind."""
    seen: dict[str, list[str]] = {}
    for name, layer in layers.items():
        for w in getattr(layer, "warnings", ()):
            seen.setdefault(w, []).append(name)
    return [f"{w} ({len(names)} layer{'s' * (len(names) > 1)}, e.g. {names[0]})" for w, names in seen.items()]


def bnb_cpu_notes(layers: Sequence[tuple[str, Sequence[int], int]], written: bool = False) -> list[str]:
    """One note when 4-bit layers (name, shape, blocksize) have several rows whose length is not a multiple
    of their blocksize: bnb's own CPU kernel (AVX512 machines; transformers' ``model.dequantize()`` and
    forward there) indexes absmax per row and gets them wrong (bnb-format.md section 2). ``written``: the
    layers are this run's 4-bit output (bnb on such a CPU will compute them wrongly), else its input (bnb
    there disagrees with this dequantized output, which is what bnb's generic and CUDA kernels compute)."""
    odd = [(name, shape, bs) for name, shape, bs in layers if _rows_straddle_blocks(shape, bs)]
    if not odd:
        return []
    name, shape, bs = odd[0]
    head = (f"{len(odd)} 4-bit layer{'s' * (len(odd) > 1)} with rows not a multiple of the blocksize (e.g. {name}: "
            f"rows of {shape[-1]}, blocksize {bs}): bitsandbytes' CPU kernel on AVX512 machines (and transformers' "
            "model.dequantize() there) ")
    if written:
        return [head + "computes them wrongly from this file (bnb's generic and CUDA kernels read it right)"]
    return [head + "computes them wrongly, so it will disagree with this output, which equals bnb's generic and "
            "CUDA kernels"]


def _rows_straddle_blocks(shape: Sequence[int], blocksize: int) -> bool:
    """Whether a weight has more than one row and rows whose length is not a multiple of ``blocksize`` (a
    block then spans two rows, which per-row absmax indexing gets wrong; one row is one flat run)."""
    return len(shape) >= 2 and math.prod(shape[:-1]) > 1 and shape[-1] % blocksize != 0


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

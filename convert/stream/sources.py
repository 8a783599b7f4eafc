"""What produces each output tensor: a :class:`Source` makes a tensor's flat elements ``[start, stop)`` in
the output dtype, chunk by chunk.

- :class:`Dequant4Source`: a bitsandbytes 4-bit layer, dequantized (bnb-format.md section 2);
- :class:`Int8Source`: an LLM.int8 layer, dequantized by rows (section 4);
- :class:`CastSource`: a stored tensor, copied or cast (:func:`cast_run` casts runs of tiny ones at once);
- :class:`ArraySource`: values made in memory (a GGUF file's generated tensors);
- sources of other folders: a LoRA merge (:class:`convert.lora.apply.LoraSource`), the 4-bit tensors
  of a re-quantized layer (:mod:`convert.bnb4.sources`).

Chunk boundaries must be multiples of :attr:`Source.unit` (a 4-bit layer's blocksize), so every chunk
starts on a block and a byte boundary. Sources read their input through zero-copy views and release
consumed pages with :meth:`Source.release`. The plan that holds them is :mod:`convert.stream.plan`'s;
its writers read them (:mod:`convert.stream.safetensors_job`, :mod:`convert.gguf.encode`).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from convert.dequant import kernels, kernels_f16
from formats.bnb import QUANT_TABLES, Int8Layer, QuantizedLayer, TensorLike
from formats.checkpoint import TensorRecord
from formats.dtypes import BY_NAME, DType
from formats.errors import NonFiniteAbsmaxError
from formats.writeback import bytes_of

if TYPE_CHECKING:
    from convert.stream.shared import _Link

__all__ = ["ArraySource", "CastSource", "Codes4", "Dequant4Source", "Int8Source", "Source", "StackSource", "cast_run"]

_F32 = BY_NAME["float32"]


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
    #: A run of several targets: the shared blocks this source reads its values from
    #: (:mod:`convert.stream.shared`; set on the sources that dequantize), else None.
    shared: _Link | None = None
    #: Elements of one row of the weight (a 2-D layer's columns), or 0 when not known: a run of several targets cuts
    #: its shared blocks on whole rows where rows are whole units (:mod:`convert.stream.shared`).
    row_elements: int = 0

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

    def produce_view(self, start: int, stop: int, dtype: DType, at: int = 0) -> np.ndarray | None:
        """Elements [start, stop) as ``dtype.numpy[stop - start]`` without a copy, where they are in memory
        already: in a run of several targets, a range inside one shared block held in ``dtype``
        (:mod:`convert.stream.shared`; the caller must not write into it; a block made for it lies at ``at``
        modulo :data:`formats.writeback.ALIGN`, the file offset it goes to); else None
        (:meth:`produce_into` makes them)."""
        return None if self.shared is None else self.shared.view(self, start, stop, dtype, at)

    def view_grid(self) -> int:
        """Elements of the pieces :meth:`produce_view` hands out whole (from the tensor's start: the shared
        block grid of a run of several targets), or 0 when it hands out none."""
        return 0 if self.shared is None else self.shared.grid(self)

    def codes_4bit(self, start: int, stop: int) -> Codes4 | None:
        """The 4-bit codes and absmax behind elements [start, stop) (``start`` a multiple of ``unit``) when
        this source is a bnb 4-bit layer dequantized as it is (for an encoder that works from the codes:
        GGUF F16 of its bfloat16 values); None for every other source."""
        return None

    def reads(self) -> list[Source]:
        """The sources this one reads its values from (a merge's base, a stack's slices): a run of several
        targets finds the dequantizing sources under each output tensor through them
        (:func:`convert.stream.shared.shared_leaves`)."""
        return []

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
        self.row_elements = st.numel // st.shape[0] if len(st.shape) >= 2 and st.shape[0] else 0
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
        if self.shared is not None:
            self.shared.read(self, start, stop, dtype, out)
        else:
            self.dequant_into(start, stop, dtype, out)

    def exact_into(self, start: int, stop: int, out: npt.NDArray[np.float32]) -> None:
        """The exact float32 products of elements [start, stop) into ``out`` (``float32[stop - start]``): what
        :meth:`dequant_into` rounds to any dtype (a run of several targets shares them)."""
        self.dequant_into(start, stop, _F32, out)

    def dequant_into(self, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        """Elements [start, stop) dequantized by the kernel into ``out`` (as ``dtype``), float16 losses counted."""
        st = self.layer.state
        packed = self.layer.packed.raw(start // 2, (stop + 1) // 2)
        absmax = self.absmax()[start // st.blocksize : -(-stop // st.blocksize)]
        local = np.zeros(2, dtype=np.int64) if dtype.name == "float16" else None
        kernels.dequantize_4bit(packed, absmax, self._quant_map, st.blocksize, stop - start, dtype.numpy, out=out,
                                stats=local)
        if local is not None:
            self._add_stats(local)

    def codes_4bit(self, start: int, stop: int) -> Codes4 | None:
        if self.shared is not None:  # (its values come from the shared blocks, not from the codes again)
            return None
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


class ArraySource(Source):
    """Values made in memory (a GGUF file's generated tensors, ``rope_freqs.weight``): read as they are.

    Args:
        name: the tensor's name.
        array: its values, any shape (read flat); nothing may change them while the source is read.
    """

    def __init__(self, name: str, array: np.ndarray) -> None:
        super().__init__()
        self.name = name
        self.array = array.reshape(-1)
        self.numel = self.array.size
        self.kind = "generated"

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        part = self.array[start:stop]
        return part if part.dtype == dtype.numpy else part.astype(dtype.numpy)


class StackSource(Source):
    """Slices of other sources, one after the other: a MoE tensor ``[experts, rows, cols]`` made from its
    experts' weights (GGUF's ``ffn_*_exps``) or from rows of a fused parameter, read slice by slice, so no
    more than a chunk of it is ever in memory.

    Args:
        name: the tensor's name.
        parts: (source, first element, element past the last), in order, each of the same length and
            starting on a multiple of its source's ``unit``.

    Raises:
        ValueError: no parts, or parts of different lengths (the planner checks both first).
    """

    def __init__(self, name: str, parts: list[tuple[Source, int, int]]) -> None:
        super().__init__()
        if not parts or len({stop - start for _, start, stop in parts}) != 1:
            raise ValueError(f"{name}: parts of one length needed, got {[b - a for _, a, b in parts]}")
        self.name = name
        self.parts = parts
        self.per = parts[0][2] - parts[0][1]
        self.numel = self.per * len(parts)
        unit = math.lcm(*(p.unit for p, _, _ in parts))
        self.unit = unit if self.per % unit == 0 else self.per  # chunks split at part boundaries on a unit
        self.sources = list({id(p): p for p, _, _ in parts}.values())  # each source once
        sources = self.sources
        self.in_nbytes = sum(p.in_nbytes for p in sources)
        self.kind = f"{len(parts)} slices of {parts[0][0].kind}"
        self.barrier = any(p.barrier for p in sources)
        self.max_chunk = max(p.max_chunk for p in sources)
        self.writes_in_place = all(p.writes_in_place for p in sources)

    def _pieces(self, start: int, stop: int) -> list[tuple[Source, int, int, int]]:
        """(source, its start, its stop, offset in [start, stop)) covering elements [start, stop)."""
        out = []
        at = start
        while at < stop:
            k, off = divmod(at, self.per)
            end = min(stop, (k + 1) * self.per)
            src, first, _ = self.parts[k]
            out.append((src, first + off, first + off + end - at, at - start))
            at = end
        return out

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        got = [src.produce(a, b, dtype) for src, a, b, _ in self._pieces(start, stop)]
        return got[0] if len(got) == 1 else np.concatenate(got)

    def produce_into(self, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        flat = out.reshape(-1)
        for src, a, b, at in self._pieces(start, stop):
            src.produce_into(a, b, dtype, flat[at : at + b - a])

    def reads(self) -> list[Source]:
        return list(self.sources)

    def codes_4bit(self, start: int, stop: int) -> Codes4 | None:
        pieces = self._pieces(start, stop)
        if len(pieces) != 1:
            return None
        src, a, b, _ = pieces[0]
        return src.codes_4bit(a, b)

    def release(self, start: int, stop: int) -> None:
        for src, a, b, _ in self._pieces(start, stop):
            src.release(a, b)

    def finish(self) -> None:
        for src in self.sources:
            src.finish()

    def inputs(self) -> list[TensorLike] | None:
        got = [p.inputs() for p in self.sources]
        return None if any(g is None for g in got) else [t for g in got if g is not None for t in g]


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


class Int8Source(Source):
    """An LLM.int8 layer (row format), dequantized (bnb-format.md §4); chunks are whole rows."""

    def __init__(self, layer: Int8Layer) -> None:
        super().__init__()
        self.layer = layer
        self.name = layer.name
        rows, cols = layer.shape
        self.numel = rows * cols
        self.unit = self.row_elements = max(cols, 1)
        self.in_nbytes = layer.weight.nbytes + layer.scb.nbytes
        self.kind = "dequant int8 row"
        self._scb: npt.NDArray[np.float32] | None = None

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        if self.shared is None:
            return self._dequant(start, stop, dtype)
        out = np.empty(stop - start, dtype=dtype.numpy)
        self.shared.read(self, start, stop, dtype, out)
        return out

    def exact_into(self, start: int, stop: int, out: npt.NDArray[np.float32]) -> None:
        """The float32 values of elements [start, stop) (whole rows) into ``out``, before the output dtype's
        rounding (a run of several targets shares them)."""
        out[...] = self._dequant(start, stop, _F32)

    def dequant_into(self, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        """Elements [start, stop) dequantized into ``out`` (as ``dtype``), float16 losses counted."""
        out[...] = self._dequant(start, stop, dtype)

    def _dequant(self, start: int, stop: int, dtype: DType) -> np.ndarray:
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

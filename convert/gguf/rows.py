"""A planned tensor's rows, read from its stream source for the GGUF writer (:mod:`convert.gguf.encode`).

The GGUF writer converts a tensor in chunks of whole rows (whole heads for Llama's permuted q/k); the
stream sources (:mod:`convert.stream.sources`) make flat elements in block-aligned pieces.
:class:`RowReader` makes rows from pieces, in the run's placed memory, and releases the input pages it
consumed; a bfloat16 tensor written as F16 comes as float16 straight from its 4-bit codes where that
is exact.
"""

from __future__ import annotations

import gguf
import numpy as np
import numpy.typing as npt

from convert.dequant import kernels_f16
from convert.gguf.plan import GGUFPlan
from convert.stream import pipeline
from convert.stream.plan import PlannedTensor
from convert.stream.sources import Source
from formats.writeback import PlacedMemory

__all__ = ["RowReader", "f16_only", "rows_per_unit"]

GT = gguf.GGMLQuantizationType


class RowReader:
    """Rows of a planned tensor, read from its stream source for the GGUF writer's chunks.

    Args:
        max_memory: the memory cap: sources are read in pieces of :func:`convert.stream.pipeline.chunk_elements`.
        threads: the worker threads reading at once (sizes the pieces).
        memory: where the rows are made.
        as_f16: the tensors written as F16 alone (:func:`f16_only`): their bfloat16 rows may be made as
            float16 from the 4-bit codes directly.
    """

    def __init__(self, max_memory: int, threads: int, memory: PlacedMemory, as_f16: frozenset[str] = frozenset()
                 ) -> None:
        self.max_memory, self.threads, self.memory, self.as_f16 = max_memory, threads, memory, as_f16

    def rows(self, t: PlannedTensor, r0: int, r1: int, place: int | None = None) -> np.ndarray:
        """Rows [r0, r1) of ``t`` as ``(r1 - r0, *t.shape[1:])``: the source's flat elements, block-aligned,
        read in pieces, input pages released as they are consumed (the rows returned are an array of their
        own, never a view of released pages; in a run of several targets, rows inside one shared block are a
        read-only view of it: :meth:`~convert.stream.sources.Source.produce_view`). Called by the writer's
        worker threads (the parallelism is across row chunks, so this never waits on the pool).

        A bfloat16 tensor written as F16 comes as float16 where the source's 4-bit codes give it exactly
        (:func:`convert.dequant.kernels_f16.dequantize_4bit_f16_of_bf16`: the writer stores those bits,
        whose error against the bf16 weight is 0), else as bfloat16 (the writer rounds and measures). Rows
        are made in the reader's memory, placed so that element ``r0 * cols`` lies at file offset ``place``
        modulo 4096 when given (rows already in the GGUF type, bf16 -> BF16, then go to the disk without a
        copy).
        """
        src = t.source
        cols = t.numel // t.shape[0] if t.shape and t.shape[0] else 1
        piece = pipeline.chunk_elements(src.unit, self.max_memory, self.threads)
        start, stop = r0 * cols, r1 * cols
        a0 = start // src.unit * src.unit
        a1 = min(t.numel, -(-stop // src.unit) * src.unit)
        bounds = list(range(a0, a1, piece)) + [a1]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        flat = None
        if t.name in self.as_f16 and t.dtype.name == "bfloat16":
            flat = self._f16(src, a0, spans, None if place is None else place - (start - a0) * 2)
        if flat is None:  # (a run of several targets: rows inside one shared block, read from it without a copy)
            flat = src.produce_view(a0, a1, t.dtype)
        if flat is None and src.writes_in_place:  # (not all exact: every span as bf16, one dtype for the rows)
            at = 0 if place is None else place - (start - a0) * t.dtype.itemsize  # (the rows' bytes as they are)
            flat = self.memory.empty((a1 - a0) * t.dtype.itemsize, at).view(t.dtype.numpy)
            for s, e in spans:
                src.produce_into(s, e, t.dtype, flat[s - a0 : e - a0])
        elif flat is None:
            parts = [src.produce(s, e, t.dtype) for s, e in spans]
            flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if not flat.flags.writeable:
                # a read-only view of the input file (a source that does not cast): the caller reads it after
                # the release below, which would map those pages again, for good (RSS growing to the file size)
                flat = flat.copy()
        for s, e in spans:
            src.release(s, e)
        return flat[start - a0 : stop - a0].reshape(r1 - r0, *t.shape[1:])

    def _f16(self, src: Source, a0: int, spans: list[tuple[int, int]], place: int | None
             ) -> npt.NDArray[np.float16] | None:
        """The float16 of elements [a0, a1), span by span, from the 4-bit codes, placed so element ``a0`` lies
        at ``place``; None when a span is not a 4-bit layer or not exact in float16."""
        flat = self.memory.empty((spans[-1][1] - a0) * 2, 0 if place is None else place).view(np.float16)
        for s, e in spans:
            c = src.codes_4bit(s, e)
            if c is None or kernels_f16.dequantize_4bit_f16_of_bf16(c.packed, c.absmax, c.quant_map, c.blocksize,
                                                                     e - s, out=flat[s - a0 : e - a0]) is None:
                return None
        return flat


def f16_only(plan: GGUFPlan) -> frozenset[str]:
    """The sources written only as F16, without an offset (their rows may come as float16)."""
    f16 = {g.source for g in plan.tensors if g.ggml_type == GT.F16 and not g.offset and g.source is not None}
    return frozenset(f16 - {g.source for g in plan.tensors if g.ggml_type != GT.F16 or g.offset})


def rows_per_unit(t: PlannedTensor) -> int:
    """Rows in one chunk unit of the tensor's source, when the unit is whole rows (a LoRA merge)."""
    cols = t.numel // t.shape[0] if t.shape and t.shape[0] else 1
    unit = t.source.unit
    return unit // cols if cols and unit >= cols and unit % cols == 0 else 1

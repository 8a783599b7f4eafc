"""Encoding a planned GGUF file's tensors: float weights -> GGML types, streamed in row chunks.

:func:`write_gguf` writes a :class:`convert.gguf.plan.GGUFPlan` through the container writer
(:class:`formats.gguf.GGUFFileWriter`), reading each planned tensor's rows from its stream source
(:class:`convert.stream.sources.Source`) only when its chunk's turn comes. Per chunk of rows
(matching llama.cpp's ``convert_hf_to_gguf.py`` ``ModelBase.prepare_tensors`` + gguf-py
``gguf.quants.quantize``, which works row by row, so chunking changes no byte):

1. the values become float32, except an unchanged bf16 -> BF16 or f16 -> F16 tensor, whose stored
   bits are written as they are;
2. the architecture's transforms (:mod:`convert.gguf.arch`): Llama's q/k rows in
   ``LlamaModel.permute`` order (:func:`convert.gguf.arch.permutation`; chunks hold whole heads),
   Gemma's ``+1`` on norms, in float32;
3. the tensor's GGML type's codec (:func:`convert.gguf.codecs.codec`) encodes them;
4. the added error is measured by decoding the result again (the codec's ``dequantize``): zero for
   F32, one rounding for F16/BF16, a second quantization for Q types (:class:`TensorReport`); for
   the Q types on all of it, or on one piece in ``sample`` of a fixed grid over the tensor (the
   summary's figures: the CLI asks for :data:`convert.options.SUMMARY_SAMPLE` unless ``--json``
   wants the exact ones); the same pieces whatever the chunk size and thread count.

Chunks are converted by ``threads`` workers of a thread pool and written in order by the one chunk
loop of every writer (:func:`convert.stream.pipeline.ordered_chunks`), so the bytes do not depend on
the thread count or the chunk size; at most ``2 * threads`` chunks are in flight (made, being made or
queued: a worker finds the next chunk waiting while the oldest is still being made), the chunks of
consecutive tensors in one stream (no worker idles at a tensor's end). Steps 3-4 of the types whose encoder
searches (the K-quants and IQ4_NL, tens of NumPy passes per value) run in ``processes`` worker processes when asked
(:func:`encoder_processes`): NumPy releases the GIL only inside each call, and the searches make
many small calls, so two threads give them 1.4x where two processes give them nearly 2x. A chunk is
sent to a process as float32 (pickled, 4 bytes a weight) and comes back encoded, with its error; how
those processes start, take signals and stop is :mod:`convert.gguf.encoder_pool`'s.

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-002  every planned GGML type has a codec in this build (:func:`check_encoders`,
          :class:`GgufTypeError`; raised before the file is opened)
GGUF-007  a source array has the planned shape and a float dtype (:class:`GgufSourceError`)
GGUF-008  each tensor's encoded bytes match the plan (from :class:`formats.gguf.GGUFFileWriter`)
GGUF-011  a weight quantized to a block type (Q8_0, Q4_K, ...) holds no inf or NaN, which llama.cpp
          refuses to quantize (:class:`GgufNonFiniteError`); F32/F16/BF16 keep them as they are,
          as ``convert_hf_to_gguf.py`` does, and the error report leaves them out
========  ======================================================================================
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from convert.dequant.kernels_f16 import bf16_to_f16, count_f16_loss
from convert.dequant.products import BF16, PIECE
from convert.gguf import encoder_pool
from convert.gguf.arch import permutation
from convert.gguf.codecs import CODECS, codec
from convert.gguf.codecs.base import abs_max, sum_squares
from convert.gguf.plan import GGUFPlan, GGUFTensor
from convert.gguf.rows import RowReader, f16_only, rows_per_unit
from convert.output import user_path
from convert.stream.pipeline import Chunk, ordered_chunks
from convert.stream.plan import PlannedTensor
from convert.stream.sources import ArraySource, StackSource
from formats.dtypes import BY_CODE
from formats.errors import GgufNonFiniteError, GgufSourceError, GgufTypeError
from formats.gguf import FileLayout, GGUFFileWriter, GGUFSplitWriter
from formats.writeback import IN_PLACE_WRITES, PlacedMemory

__all__ = ["TensorReport", "check_encoders", "chunks_held", "encode_chunk", "encoder_processes",
           "write_gguf"]

GT = gguf.GGMLQuantizationType
_F32_DTYPE = BY_CODE["F32"]


@dataclass(frozen=True)
class TensorReport:
    """What writing one tensor did to its values.

    The error is the GGUF value (decoded back to float32) minus the float32 weight given (after the
    architecture's transforms), over all elements, or over the sample :func:`write_gguf` was asked
    for (``sample``; the F16 over/underflow counts are always over all elements).

    Attributes:
        name: the GGUF name.
        source: the Hugging Face name (None for generated tensors).
        ggml_type: the type written.
        shape: rows first.
        nbytes: bytes written (padding excluded).
        max_abs_error: largest absolute error.
        rms_error: root mean square of the error.
        rel_rms_error: rms_error / root mean square of the weight (0 for an all-zero weight).
        fp16_overflow: F16 only: finite values that became inf.
        fp16_underflow: F16 only: non-zero values that became 0.
        measured: elements the three error figures cover (the product of ``shape`` unless sampled).
    """

    name: str
    source: str | None
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    max_abs_error: float
    rms_error: float
    rel_rms_error: float
    fp16_overflow: int = 0
    fp16_underflow: int = 0
    measured: int = 0
    ref_measured: int | None = None

    @property
    def sampled(self) -> bool:
        """The error figures cover a sample, not every element."""
        return self.measured < math.prod(self.shape)

    @property
    def ref_sampled(self) -> bool:
        """rel_rms_error's denominator (the weight's RMS) covers a sample (bf16 -> F16 without --json)."""
        return self.ref_measured is not None and self.ref_measured < self.measured


#: Source dtypes whose values the GGML type holds exactly.
_SAME_FLOAT = {"bfloat16": GT.BF16, "float16": GT.F16}
#: Types that store inf and NaN as they are (the others are block quantizations llama.cpp refuses them for).
_FLOAT_TYPES = frozenset({GT.F32, GT.F16, GT.BF16})
#: Types whose encoder searches per block (tens of NumPy passes per value): worth a worker process.
SEARCH_TYPES = frozenset({GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_NL, GT.IQ4_XS})
#: Weights of :data:`SEARCH_TYPES` below which no worker process is started (each costs about 0.5 s
#: to start and 40 MB to hold NumPy and gguf; 16 M weights take 2-4 s to encode).
PROCESS_MIN_ELEMENTS = 1 << 24


@dataclass
class _Chunk:
    data: np.ndarray
    max_err: float
    sq_err: float
    sq_ref: float
    measured: int  # the elements max_err, sq_err and sq_ref cover (all of the chunk unless sampled)
    f16_loss: tuple[int, int] = (0, 0)  # F16: (overflowed to inf, non-zero flushed to 0)
    ref_measured: int | None = None  # the elements sq_ref covers when not the same (bf16 -> F16: a sample)
    own: bool = False  # data is memory of its own, never a view of a caller's array: given up to the writer


def _convert_chunk(
    t: GGUFTensor, x_in: np.ndarray, perm: npt.NDArray[np.intp] | None, exact: bool, path: str, row0: int,
    procs: ProcessPoolExecutor | None, sample: int, place: int | None, memory: PlacedMemory,
    weights: npt.NDArray[np.float32] | None = None,
) -> _Chunk:
    """Rows ``row0 ...`` of one tensor (2-D, in GGUF row order): float32, the architecture's transforms,
    encode, measure the added error (of a block type: on one piece in ``sample`` of the tensor; float
    types every value, bf16 -> F16 the weight's own sum of squares on the sample) (:func:`encode_chunk`,
    in ``procs`` for :data:`SEARCH_TYPES`). ``place``: the file offset of the chunk's bytes; the bytes
    made here (not in a process) lie at that offset modulo 4096 (:func:`_placed`), so the writer sends
    them to the disk without a copy; taken from ``memory``. ``weights``: the rows' importance matrix row
    (float32 ``(cols,)``; all rows of a chunk belong to one expert) or None."""
    start = row0 * (x_in.shape[-1] if x_in.ndim else 1)  # the chunk's first value in the tensor: the sample's grid
    ref_sample = sample
    if t.ggml_type in _FLOAT_TYPES:
        sample = 1
    if not (np.issubdtype(x_in.dtype, np.floating) or x_in.dtype.name == "bfloat16"):
        raise GgufSourceError(
            "source array is not a float array",
            path=path,
            tensor=t.source,
            expected="a float dtype",
            found=str(x_in.dtype),
            action="write",
        )
    if not t.offset and _SAME_FLOAT.get(x_in.dtype.name) == t.ggml_type:
        # already in the output type (bf16 -> BF16, f16 -> F16): the stored bits, nothing to measure
        if perm is None:
            same = np.ascontiguousarray(x_in)  # (placed by the row reader when it could)
        else:
            dest = _placed(x_in.nbytes, place, x_in.dtype, memory)
            same = np.take(x_in, perm, axis=0, out=None if dest is None else dest.reshape(x_in.shape))
        return _Chunk(same.reshape(-1).view(np.uint8), 0.0, 0.0, 0.0, same.size)  # error 0 everywhere
    if x_in.dtype == BF16 and t.ggml_type == GT.F16 and not t.offset:
        fast = _bf16_to_f16_chunk(np.ascontiguousarray(x_in if perm is None else x_in[perm]), ref_sample, start,
                                  _placed(x_in.size * 2, place, np.float16, memory))
        if fast is not None:
            return fast
    if not t.offset and not exact and t.ggml_type not in _FLOAT_TYPES and (procs is None or
                                                                           not _searches(t.ggml_type, weights)):
        # widened, summed, encoded and measured chunk by chunk in cache by the codec; inf/NaN: checked below
        block, type_size = gguf.GGML_QUANT_SIZES[t.ggml_type]
        fused = encode_chunk(t.ggml_type, x_in if perm is None else x_in[perm], True, None, sample, start,
                             _placed(x_in.size // block * type_size, place, np.uint8, memory), weights)
        if math.isfinite(fused.sq_ref):
            return fused
    x = np.ascontiguousarray(x_in if perm is None else x_in[perm], dtype=np.float32)
    if t.offset:
        x = x + np.float32(t.offset)  # never in place: x may be the caller's array
    encoded = _encode(t.ggml_type, x, not exact, sample, start, procs, weights)
    if math.isfinite(encoded.sq_ref):  # (a non-finite sum: some value is inf/NaN)
        return encoded
    finite = np.isfinite(x)
    all_finite = bool(finite.all())
    if not all_finite and t.ggml_type not in _FLOAT_TYPES:
        row, col = divmod(int(np.argmin(finite.reshape(-1))), x.shape[-1] if x.ndim else 1)
        raise GgufNonFiniteError(
            f"weight holds {x.reshape(-1)[row * x.shape[-1] + col]} and cannot be quantized to "
            f"{t.ggml_type.name}",
            path=user_path(Path(path)),
            tensor=t.source,
            expected="finite values",
            found=f"{int(x.size - np.count_nonzero(finite))} non-finite in rows {row0}..{row0 + len(x) - 1}, "
                  f"the first at row {row0 + row}, column {col} of {t.name}",
            action="write",
        )
    # a float type keeping inf/NaN as they are: no error to measure there
    return encode_chunk(t.ggml_type, x, not exact, finite, weights=weights)


def _placed(nbytes: int, place: int | None, dtype: npt.DTypeLike, memory: PlacedMemory) -> np.ndarray | None:
    """Flat ``dtype`` memory of ``nbytes`` from ``memory`` lying at file offset ``place`` modulo 4096
    (:meth:`formats.writeback.PlacedMemory.empty`), or None for ``place`` None (any memory will do)."""
    return None if place is None else memory.empty(nbytes, place).view(dtype)


def _bf16_to_f16_chunk(x: np.ndarray, sample: int, start: int, out: np.ndarray | None = None) -> _Chunk | None:
    """A bf16 chunk ``(rows, ...)`` to F16 by :func:`convert.dequant.kernels_f16.bf16_to_f16`, with the figures of
    :func:`encode_chunk`; None when the chunk holds inf or NaN (the general path leaves them out of the
    error). The error is measured on every value (only the few values ``bf16_to_f16`` rounds can
    differ); the weight's sum of squares, the relative error's denominator, on the tensor's rows
    ``0, sample, 2 * sample, ...`` (``start``: the flat index of the chunk's first value; ``sample`` 1:
    every row), since summing every value costs as much as the conversion itself. ``out``: optional flat
    float16 destination of ``x``'s size."""
    flat = x.reshape(-1)
    loss = np.zeros(2, np.int64)
    y, rounded = bf16_to_f16(flat, out=out, stats=loss)  # inf/NaN are among the values not exact in F16
    with np.errstate(over="ignore", invalid="ignore"):
        wide = flat[rounded].astype(np.float32)
        if not np.isfinite(wide).all():
            return None
        err = y[rounded].astype(np.float32) - wide
    rows = flat.reshape(-1, x.shape[-1] if x.ndim > 1 else flat.size or 1)
    if sample > 1:
        rows = rows[-(start // rows.shape[1]) % sample :: sample]
    sq_ref, step = 0.0, max(1, PIECE // rows.shape[1])
    for r in range(0, len(rows), step):  # float32 pieces in cache, no chunk-sized temporary
        sq_ref += sum_squares(rows[r : r + step].astype(np.float32))
    return _Chunk(y.view(np.uint8), abs_max(err), sum_squares(err), sq_ref, flat.size, (int(loss[0]), int(loss[1])),
                  rows.size)


def _encode(ggml_type: gguf.GGMLQuantizationType, x: npt.NDArray[np.float32], measure: bool, sample: int,
            start: int, procs: ProcessPoolExecutor | None, weights: npt.NDArray[np.float32] | None) -> _Chunk:
    """:func:`encode_chunk` of finite ``x``, in ``procs`` for :data:`SEARCH_TYPES` and importance rows."""
    if procs is not None and _searches(ggml_type, weights):
        return encoder_pool.call(procs, encode_chunk, ggml_type, x, measure, None, sample, start, None, weights)
    return encode_chunk(ggml_type, x, measure, None, sample, start, None, weights)


def encode_chunk(ggml_type: gguf.GGMLQuantizationType, x: npt.NDArray[np.float32], measure: bool,
                 finite: npt.NDArray[np.bool_] | None = None, sample: int = 1, start: int = 0,
                 out: npt.NDArray[np.uint8] | None = None, weights: npt.NDArray[np.float32] | None = None) -> _Chunk:
    """Encode float32 rows ``(rows, cols)`` to ``ggml_type`` and measure the added error.

    A pure function of its arguments (it runs in a worker process too).

    Args:
        ggml_type: the GGML type (a codec of :data:`convert.gguf.codecs.CODECS`).
        x: ``(rows, cols)``, in GGUF row order, the architecture's transforms applied: float32, or
            bfloat16/float16 (widened exactly; chunk by chunk by a codec that encodes in chunks).
        measure: decode the result again and measure the error (False for F32: none).
        finite: where ``x`` is finite (None: everywhere); inf/NaN are left out of the error.
        sample: with ``measure`` and ``finite`` None, measure one piece of the tensor in this many
            (:meth:`convert.gguf.codecs.base.Codec.quantize_measured`); 1: all of ``x``.
        start: the flat index of ``x``'s first value in its tensor (places ``x`` on the sample's grid).
        out: optional flat uint8 memory of the encoded size to encode into, with ``measure`` and
            ``finite`` None (:meth:`convert.gguf.codecs.base.Codec.quantize_measured`); elsewhere unused.
        weights: the importance matrix row of ``x``'s rows (float32 ``(cols,)``) or None
            (:meth:`convert.gguf.codecs.base.Codec.quantize`).

    Returns:
        the encoded bytes (``uint8[rows, row bytes]``), the largest absolute error, the sums of
        squared errors and of squared weights, and the count of elements those cover. With
        ``measure``, ``finite`` None and inf/NaN in ``x``: no bytes and a sum of squared weights
        that is not finite (the caller checks ``x`` itself).
    """
    coder = codec(ggml_type)
    max_err = sq_err = 0.0
    sq_ref: float | None = None
    with np.errstate(invalid="ignore", over="ignore"):  # F16's overflow to inf is the IEEE result (as gguf-py's)
        if not (measure and x.size):
            x = np.asarray(x, dtype=np.float32)
            data = coder.quantize(x, weights)
            counted = x.size
        elif finite is None:
            m = coder.quantize_measured(x, sample, start, None if out is None else out.reshape(x.shape[0], -1),
                                        weights)
            if m.data is None or not math.isfinite(m.sq_ref):  # inf/NaN in x: the caller checks x itself
                return _Chunk(np.empty(0, np.uint8), math.nan, math.nan, m.sq_ref, m.measured)
            data, max_err, sq_err, sq_ref, counted = m
        else:  # a float type keeping inf/NaN: they are left out of the error
            data = coder.quantize(x, weights)
            err = coder.dequantize(data).reshape(x.shape)
            err -= x
            err[~finite] = 0
            max_err = abs_max(err)
            sq_err = sum_squares(err)
            counted = x.size
    if sq_ref is None:
        sq_ref = sum_squares(x if finite is None else np.where(finite, x, 0))
    loss = np.zeros(2, np.int64)
    if ggml_type == GT.F16:
        count_f16_loss(np.asarray(x, dtype=np.float32), data.view(np.float16).reshape(x.shape), loss)
    return _Chunk(data, max_err, sq_err, sq_ref, counted, (int(loss[0]), int(loss[1])))


def _searches(ggml_type: gguf.GGMLQuantizationType, weights: npt.NDArray[np.float32] | None) -> bool:
    """Whether a chunk's encoder searches per block: a :data:`SEARCH_TYPES` type, or a type that uses the
    importance rows it is given (Q4_0 ... Q5_1 search for their scale with them)."""
    return ggml_type in SEARCH_TYPES or (weights is not None and codec(ggml_type).uses_imatrix)


def encoder_processes(tensors: Iterable[GGUFTensor], threads: int, importance: Container[str] = ()) -> int:
    """How many worker processes :func:`write_gguf` encodes a file's ``tensors`` with: ``threads`` when
    there are two or more and at least :data:`PROCESS_MIN_ELEMENTS` weights go to :data:`SEARCH_TYPES` or have
    importance rows (``importance``: their GGUF names),
    else 0 (the threads encode)."""
    heavy = sum(t.numel for t in tensors if t.ggml_type in SEARCH_TYPES or t.name in importance)
    return threads if threads > 1 and heavy >= PROCESS_MIN_ELEMENTS else 0


def chunks_held(workers: int) -> int:
    """The most chunks :func:`write_gguf` holds at once with ``workers`` threads or processes: ``2 * workers``
    made, being made or queued, and :data:`formats.writeback.IN_PLACE_WRITES` being written in place
    (a caller sizing chunks under a memory cap divides by this)."""
    return 2 * max(1, workers) + IN_PLACE_WRITES


def check_encoders(plan: GGUFPlan) -> None:
    """Every GGML type the plan uses has a codec (:data:`convert.gguf.codecs.CODECS`).

    Planning chooses types without encoders (llama-quantize's mixes need the K-quant codecs); a
    build without one of them refuses before anything is written, instead of failing mid-file.

    Raises:
        GgufTypeError: GGUF-002, naming the types without a codec and the tensors needing them.
    """
    missing = sorted({t.ggml_type.name for t in plan.tensors if t.ggml_type not in CODECS})
    if missing:
        first = next(t.name for t in plan.tensors if t.ggml_type.name == missing[0])
        raise GgufTypeError(
            f"GGUF type {plan.output_type} needs {', '.join(missing)}, which this build cannot encode",
            tensor=first,
            expected=f"types with an encoder: {', '.join(t.name for t in CODECS)}",
            found=", ".join(missing),
        )


def write_gguf(
    plan: GGUFPlan,
    path: str | os.PathLike[str],
    tensors: Mapping[str, PlannedTensor],
    *,
    chunk_elements: int = 1 << 20,
    threads: int = 1,
    max_memory: int = 1 << 30,
    processes: int | None = None,
    progress: Callable[[int], None] | None = None,
    sample: int = 1,
    memory: PlacedMemory | None = None,
    parts: Sequence[tuple[Path, FileLayout]] | None = None,
) -> list[TensorReport]:
    """Write the planned GGUF file, streaming each tensor by row chunks from its stream source.

    Header, key/value pairs and tensor infos, then the tensor data chunk by chunk, go through
    :class:`formats.gguf.GGUFFileWriter` (gguf-py's ``GGUFWriter`` with 32-byte padding). Each planned
    tensor's rows are read from its :class:`~convert.stream.sources.Source` (:func:`_read_rows`) when its
    chunk's turn comes, converted by ``threads`` workers and written in order
    (:func:`convert.stream.pipeline.ordered_chunks`), so the bytes do not depend on the thread count or
    the chunk size; at most ``2 * threads`` chunks are in flight.

    Args:
        plan: from :func:`convert.gguf.plan.plan_gguf`.
        path: the file to create or overwrite (the caller picks a temporary name and renames it
            after :func:`formats.gguf.verify_gguf`).
        tensors: Hugging Face name -> the planned tensor (its source gives the values); generated
            tensors (``plan.generated``) are added here.
        chunk_elements: elements converted per chunk (rounded to whole rows, and to whole heads
            for permuted q/k).
        threads: worker threads converting chunks.
        max_memory: the memory cap in bytes: a source is read in pieces of
            :func:`convert.stream.pipeline.chunk_elements` for it.
        processes: worker processes encoding :data:`SEARCH_TYPES` chunks (0: the threads encode);
            None: :func:`encoder_processes`.
        progress: called with the bytes written after each chunk.
        sample: measure each tensor's error on one piece in this many (1: exact; the bytes written
            never depend on it): :meth:`convert.gguf.codecs.base.Codec.quantize_measured`.
        memory: where chunks of memory their own are made (rows read and bytes encoded); None: a
            :class:`formats.writeback.PlacedMemory` of this call.
        parts: write the file as these parts instead of ``path``: ``(path, layout)`` of each, in order
            (:func:`convert.gguf.split.plan_split`, :class:`formats.gguf.GGUFSplitWriter`), or None.

    Returns:
        One :class:`TensorReport` per tensor, in file order.

    Raises:
        GgufTypeError: GGUF-002 (a planned type has no codec: :func:`check_encoders`).
        GgufSourceError: GGUF-007 (a source has another shape or a non-float dtype).
        GgufVerificationError: GGUF-008 (a tensor's encoded bytes differ from the plan).
        KeyError: a planned tensor has no source.
    """
    check_encoders(plan)
    spath = os.fspath(path)
    sources = {**tensors, **{name: PlannedTensor(name, _F32_DTYPE, tuple(a.shape), ArraySource(name, a))
                             for name, a in plan.generated.items()},
               **{t.source: _stacked(t, tensors, spath) for t in plan.tensors if t.parts and t.source is not None},
               **{t.source: _as_rows(tensors[t.source], t) for t in plan.tensors
                  if len(t.shape) > 2 and not t.parts and t.source in tensors}}
    reports: list[TensorReport] = []
    n_procs = encoder_processes(plan.tensors, threads, plan.importance) if processes is None else processes
    workers = max(threads, n_procs)
    if memory is None:
        memory = PlacedMemory(keep=chunks_held(workers))
    reader = RowReader(max_memory, threads, memory, f16_only(plan))
    with (GGUFSplitWriter(parts) if parts else GGUFFileWriter(spath, plan)) as out:
        pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 else None
        procs = encoder_pool.start(n_procs) if n_procs else None
        try:
            chunks = _file_chunks(plan, sources, reader, chunk_elements, procs, spath, sample, out)
            # (against ``workers``: q8_0 0.90x the wall time, f16 0.87x)
            for (src, fig), c in ordered_chunks(chunks, pool, 2 * workers):
                if c is None:  # the tensor's end: its report, and its source's pages dropped
                    out.end_tensor()
                    reports.append(fig.report())
                    src.finish()
                    continue
                out.write(c.data, in_place=c.own)
                fig.add(c)
                if progress is not None:
                    progress(c.data.nbytes)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            if procs is not None:
                encoder_pool.stop(procs)
    return reports


def _stacked(t: GGUFTensor, tensors: Mapping[str, PlannedTensor], path: str) -> PlannedTensor:
    """The planned tensor of a tensor made of slices of its sources (MoE experts stacked, rows of a fused
    parameter, a qkv's third, a patch embedding's temporal slice): :class:`convert.stream.sources.StackSource`,
    in the writer's rows (:func:`_row_shape`), read slice by slice, in the
    sources' dtype, or float32 (exact) when they differ (an expert stored F16 among BF16 ones).

    Raises:
        GgufSourceError: GGUF-007, a source that is not a float tensor, or a slice that does not start on
            its source's chunk unit (a 4-bit block).
    """
    parts = [(tensors[name], start, stop) for name, start, stop in t.parts]
    for p, start, _ in parts:
        if not p.dtype.is_float or start % p.source.unit:
            raise GgufSourceError(
                "an expert weight is not a float tensor, or its slice does not start on a block of its source",
                path=path,
                tensor=p.name,
                expected=f"a float tensor, slices starting on a multiple of {p.source.unit}",
                found=f"{p.dtype.numpy}, a slice from element {start}",
                action="write",
            )
    dtypes = {p.dtype.code for p, _, _ in parts}
    dtype = parts[0][0].dtype if len(dtypes) == 1 else _F32_DTYPE
    assert t.source is not None
    return PlannedTensor(t.source, dtype, _row_shape(t.shape),
                         StackSource(t.source, [(p.source, start, stop) for p, start, stop in parts]))


def _row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the writer chunks a tensor by: as it is up to two dimensions, else ``[numel / cols, cols]``
    (rows across a 3-D expert stack or a 4-D patch embedding; never permuted)."""
    return shape if len(shape) <= 2 else (math.prod(shape) // shape[-1], shape[-1])


def _as_rows(src: PlannedTensor, t: GGUFTensor) -> PlannedTensor:
    """A tensor of more than two dimensions (a fused 3-D expert parameter written as it is) as the rows the
    writer chunks (:func:`_row_shape`), of the same source."""
    return PlannedTensor(src.name, src.dtype, _row_shape(t.shape), src.source, src.parameters)


def _file_chunks(plan: GGUFPlan, sources: Mapping[str, PlannedTensor], reader: RowReader, chunk_elements: int,
                 procs: ProcessPoolExecutor | None, path: str, sample: int, out: GGUFFileWriter | GGUFSplitWriter
                 ) -> Iterator[Chunk]:
    """Every tensor's row chunks in file order (:func:`_chunk_tasks`), each tensor followed by a marker of its
    end; keyed ``(the planned tensor's source, the tensor's running figures)``."""
    for i, t in enumerate(plan.tensors):
        src = sources[t.source if t.source is not None else t.name]
        fig = _Figures(t)
        for task in _chunk_tasks(t, src, reader, chunk_elements, procs, path, sample, out.offset(i), plan.importance):
            yield Chunk((src.source, fig), task)
        yield Chunk((src.source, fig))


class _Figures:
    """The running error figures of one tensor being written (its chunks' :class:`_Chunk` sums)."""

    def __init__(self, t: GGUFTensor) -> None:
        self.t = t
        self.max_err = self.sq_err = self.sq_ref = 0.0
        self.measured = self.ref_measured = self.over = self.under = 0

    def add(self, c: _Chunk) -> None:
        self.max_err = max(self.max_err, c.max_err)
        self.sq_err += c.sq_err
        self.sq_ref += c.sq_ref
        self.measured += c.measured
        self.ref_measured += c.measured if c.ref_measured is None else c.ref_measured
        self.over += c.f16_loss[0]
        self.under += c.f16_loss[1]

    def report(self) -> TensorReport:
        t = self.t
        rms_err = math.sqrt(self.sq_err / max(self.measured, 1))
        rms_ref = math.sqrt(self.sq_ref / max(self.ref_measured, 1))
        return TensorReport(t.name, t.source, t.ggml_type, t.shape, t.nbytes, self.max_err, rms_err,
                            rms_err / rms_ref if rms_ref else 0.0, self.over, self.under, self.measured,
                            self.ref_measured)


def _chunk_tasks(
    t: GGUFTensor,
    src: PlannedTensor,
    reader: RowReader,
    chunk_elements: int,
    procs: ProcessPoolExecutor | None,
    path: str,
    sample: int,
    at: int,
    plan_importance: Mapping[str, npt.NDArray[np.float32]],
) -> Iterator[Callable[[], _Chunk]]:
    """The row chunks of one tensor, in order, each a task a worker runs: read the rows
    (:meth:`RowReader.rows`), convert them (:func:`_convert_chunk`), their bytes placed for the file
    offset they go to (``at``: the tensor's) in the reader's memory. A tensor with importance rows
    (``plan_importance``, for a codec that uses them) is cut at its experts' boundaries.

    Raises:
        GgufSourceError: GGUF-007, a source of another size (at once) or rows of another shape (when the
            task runs).
    """
    rows = _row_shape(t.shape)[0] if t.shape else 1
    cols = t.numel // rows if rows else 0
    if src.numel != t.numel:
        raise GgufSourceError(
            "source array does not match the plan",
            path=path,
            tensor=t.source,
            expected=f"float {list(t.shape)}",
            found=f"{src.dtype.numpy} {list(src.shape)}",
            action="write",
        )
    perm = permutation(rows, t.permute_heads) if t.permute_heads else None
    align = rows // t.permute_heads if t.permute_heads else 1
    row_align = rows_per_unit(src)
    if row_align > 1:
        align = math.lcm(align, row_align)
    step = max(1, chunk_elements // max(cols, 1))
    step = -(-step // align) * align
    grid = src.source.view_grid()  # a run of several targets: chunks of whole shared blocks are read without a copy
    if grid and cols and grid % cols == 0 and (grid // cols) % align == 0 and step >= grid // cols:
        step = grid // cols
    importance = plan_importance.get(t.name) if codec(t.ggml_type).uses_imatrix else None
    # with an importance matrix, a chunk holds rows of one expert only (each has its own row of weights)
    per_expert = rows // len(importance) if importance is not None else rows
    exact = t.ggml_type == GT.F32
    block, type_size = gguf.GGML_QUANT_SIZES[t.ggml_type]
    row_bytes = cols // block * type_size

    def task(r0: int, r1: int) -> _Chunk:
        place = at + r0 * row_bytes  # where the chunk's bytes go (the rows are an array of their own)
        x = reader.rows(src, r0, r1, place if perm is None else None)
        if tuple(x.shape) != (r1 - r0, *t.shape[1:]) and x.size != (r1 - r0) * cols:
            raise GgufSourceError(
                "source rows do not match the plan",
                path=path,
                tensor=t.source,
                expected=f"{r1 - r0} x {cols} values",
                found=f"{x.dtype} {list(x.shape)}",
                action="write",
            )
        x = x.reshape(r1 - r0, cols)
        c = _convert_chunk(t, x, None if perm is None else perm[r0:r1] - r0, exact, path, r0, procs, sample, place,
                           reader.memory, None if importance is None else importance[r0 // per_expert])
        return replace(c, own=True)

    for e0 in range(0, rows, per_expert or 1):
        e1 = min(rows, e0 + (per_expert or 1))
        for r0 in range(e0, e1, step):
            yield functools.partial(task, r0, min(e1, r0 + step))

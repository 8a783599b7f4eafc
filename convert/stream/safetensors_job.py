"""Writing a :class:`~convert.stream.plan.Plan` as safetensors (``--to auto|bf16|fp16|fp32``, and the
re-quantized plan of ``--to nf4|fp4``): :class:`SafetensorsJob`.

How the bytes are written (into a staging path that :class:`convert.output.OutputClaim` owns and
later commits; naming, pre-flight, claims and renames are not done here):

1. Each output file's header first (from the plan), then each tensor in block-aligned chunks.
   Chunks are computed by ``threads`` workers (NumPy releases the GIL) and written in order, so the
   bytes are the same for every thread count; a barrier source's chunks (made from what earlier tensors
   left, e.g. a nested absmax) are made by the writing thread when their turn comes. Consumed input
   pages are released (``madvise``), so the resident set stays near ``max_memory`` whatever the model
   size.
2. Each finished file is fsynced in the background while the next is written; with a
   :class:`~convert.output.ShardLedger` (resumable runs) each one is recorded once it is on disk,
   and a recorded file still intact is not written again.
3. :func:`verify_plan` re-opens every written file and checks its header against the plan.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from convert.output import ShardLedger
from convert.stream.pipeline import InputLifetime, RunSettings, chunk_size, placed_memory, ranges
from convert.stream.plan import CastSource, Plan, PlannedTensor, Source, cast_run
from formats.checkpoint import gc_paused
from formats.dtypes import DType
from formats.errors import VerificationError
from formats.safetensors import SafetensorsReader, SafetensorsWriter, build_header
from formats.writeback import PlacedMemory

__all__ = ["SafetensorsJob", "output_files", "verify_plan", "write_directory_files", "write_plan"]


#: Tensors of at most this many elements are made in the writing thread (a worker round trip costs more).
_INLINE_ELEMENTS = 4096


#: Most elements in one run of tiny plain tensors cast and written together.
_RUN_ELEMENTS = 1 << 16


def output_files(plan: Plan, path: Path) -> list[Path]:
    """The files a plan writes under ``path``: the shards of a directory output, or ``path`` itself."""
    return [path / n for n in plan.shard_names()] if plan.checkpoint.is_dir else [path]


def write_plan(plan: Plan, path: Path, run: RunSettings, ledger: ShardLedger | None = None) -> tuple[int, int]:
    """Write a plan's tensors to ``path`` (an existing directory for a directory output, else a file).

    Args:
        plan: from :func:`convert.stream.plan.make_plan` (and the merges / re-quantization applied to it).
        path: the staging path.
        run: threads, memory cap, progress.
        ledger: finished shards of a resumable run (directory outputs), or None.

    Returns:
        ``(files written, files reused)``.

    Raises:
        ConvertBnbError: any input rule broken while streaming (e.g. BNB-012).
    """
    files = output_files(plan, path)
    bar = run.bar(plan.out_nbytes)
    written = reused = 0
    try:
        if ledger is not None:
            ledger.keep_only([f.name for f in files])
        with ThreadPoolExecutor(max_workers=run.threads) as pool, ThreadPoolExecutor(max_workers=1) as syncer:
            memory = placed_memory(run.threads)
            synced: list[Future[None]] = []
            for file, shard in zip(files, plan.shards, strict=True):
                if ledger is not None and ledger.reusable(file.name):
                    reused += 1
                    if bar is not None:
                        bar.update(sum(plan.tensors[i].nbytes for i in shard))
                    if run.inputs is not None:
                        for i in shard:
                            run.inputs.done(plan.tensors[i])
                    continue
                _write_shard(plan, shard, file, pool, memory, run, bar)
                written += 1
                if ledger is not None:  # on disk before it is recorded as finished
                    _fsync(file)
                    ledger.record(file.name)
                else:
                    synced.append(syncer.submit(_fsync, file))  # overlaps with writing the next shard
            for fut in synced:
                fut.result()
    finally:
        if bar is not None:
            bar.close()
    if plan.checkpoint.is_dir:
        write_directory_files(plan, path)
    return written, reused


def _write_shard(plan: Plan, shard: list[int], path: Path, pool: ThreadPoolExecutor, memory: PlacedMemory,
                 run: RunSettings, bar: Any) -> None:
    """Write one output file: chunks of all its tensors flow through the pool as one stream (so the
    workers never wait for a tensor boundary), up to ``2 * threads`` in flight, written in order; a
    source that writes in place makes its chunks in ``memory``.
    The file is closed without fsync; :func:`_fsync` runs in the background and is awaited before
    verifying."""
    tensors = [plan.tensors[i] for i in shard]
    with gc_paused():
        writer = SafetensorsWriter(path, *_shard_header(plan, shard))
    try:
        # (tensor, start, stop, a worker's future or the data itself), in file order
        pending: deque[tuple[PlannedTensor, int, int, Any]] = deque()
        k = 0
        while k < len(tensors):
            t = tensors[k]
            k += 1
            if run.inputs is not None and not run.inputs.ready(t):
                while pending:  # earlier tensors done first: the input files they alone read are deleted
                    _drain_one(pending, writer, bar, run.inputs)
                run.inputs.need(t)
            if t.source.barrier and t.numel:
                # made by this thread when its turn to be written comes (every earlier chunk is written then),
                # so the workers go on with the next tensors meanwhile instead of waiting for a drain
                for s, e in ranges(t, chunk_size(t, run)):
                    pending.append((t, s, e, _InOrder(t.source, s, e, t.dtype)))
                    while len(pending) > 2 * run.threads:
                        _drain_one(pending, writer, bar, run.inputs)
                continue
            if t.numel <= _INLINE_ELEMENTS:
                # a tiny tensor costs more to hand to a worker than to make: made here, still written in order
                # (not with an InputLifetime: it is told of each tensor, and a run could cross input files)
                end = _small_cast_run(tensors, k - 1) if run.inputs is None else k
                if end > k:  # tiny plain tensors in a row: one cast, one write spanning them
                    last = tensors[end - 1]
                    data = cast_run([u.source for u in tensors[k - 1 : end]], t.dtype)  # type: ignore[misc]
                    pending.append((last, last.numel, last.numel, data))  # (release of an empty range: none)
                    k = end
                elif t.numel:
                    pending.append((t, 0, t.numel, t.source.produce(0, t.numel, t.dtype)))
                else:
                    pending.append((t, 0, 0, np.empty(0, dtype=t.dtype.numpy)))
                while len(pending) > 2 * run.threads:
                    _drain_one(pending, writer, bar, run.inputs)
                continue
            at = writer.offset(k - 1)
            for s, e in ranges(t, chunk_size(t, run)):
                if t.source.writes_in_place:  # made where the writer sends it from (no copy)
                    task = pool.submit(_produce_placed, memory, t.source, s, e, t.dtype, at + s * t.dtype.itemsize)
                else:  # (copied into the writer's buffers, reused: fresh memory would cost page faults)
                    task = pool.submit(t.source.produce, s, e, t.dtype)
                pending.append((t, s, e, task))
                while len(pending) > 2 * run.threads:
                    _drain_one(pending, writer, bar, run.inputs)
        while pending:
            _drain_one(pending, writer, bar, run.inputs)
        writer.close(fsync=False)
    except BaseException:
        writer.abort()
        raise


def _produce_placed(memory: PlacedMemory, source: Source, start: int, stop: int, dtype: DType,
                    offset: int) -> np.ndarray:
    """Elements [start, stop) of ``source`` in ``memory`` placed for file offset ``offset``
    (:meth:`formats.writeback.PlacedMemory.empty`): the writer sends them to the disk without a copy."""
    out = memory.empty((stop - start) * dtype.itemsize, offset).view(dtype.numpy)
    source.produce_into(start, stop, dtype, out)
    return out


class _InOrder:
    """A chunk of a barrier source (:attr:`convert.stream.plan.Source.barrier`), made by the writing thread once
    every chunk before it is written (:func:`_drain_one` calls :meth:`result` when its turn comes)."""

    def __init__(self, source: Any, start: int, stop: int, dtype: DType) -> None:
        self.source, self.start, self.stop, self.dtype = source, start, stop, dtype

    def result(self) -> np.ndarray:
        return self.source.produce(self.start, self.stop, self.dtype)


def _small_cast_run(tensors: list[PlannedTensor], k: int) -> int:
    """The end of the run of tiny plain casts from ``tensors[k]``: consecutive tensors of at most
    :data:`_INLINE_ELEMENTS` elements (zero-size ones too), each a :class:`CastSource` with the same
    input and output dtypes, :data:`_RUN_ELEMENTS` elements in all at most (``k + 1`` when ``tensors[k]``
    starts none)."""
    first = tensors[k]
    end = k + 1
    if type(first.source) is not CastSource:
        return end
    code, in_code = first.dtype.code, first.source.record.dtype.code
    total = first.numel
    while end < len(tensors):
        u = tensors[end]
        total += u.numel
        if (type(u.source) is not CastSource or u.numel > _INLINE_ELEMENTS or total > _RUN_ELEMENTS
                or u.dtype.code != code or u.source.record.dtype.code != in_code):
            break
        end += 1
    return end


def _fsync(path: Path) -> None:
    """Flush a closed file's data to disk (any descriptor of the file will do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drain_one(pending: deque[tuple[PlannedTensor, int, int, Any]], writer: SafetensorsWriter,
               bar: Any, inputs: InputLifetime | None) -> None:
    t, s, e, fut = pending.popleft()
    data = fut.result() if isinstance(fut, (Future, _InOrder)) else fut
    writer.write(data, in_place=isinstance(fut, Future) and t.source.writes_in_place)  # (placed, its own)
    t.source.release(s, e)
    if bar is not None:
        bar.update(data.nbytes)
    del data, fut  # a zero-copy chunk is a view of its input file, which ``inputs.done`` may unmap
    if e == t.numel:
        t.source.finish()
        if inputs is not None:
            inputs.done(t)


def verify_plan(plan: Plan, path: Path) -> None:
    """Re-open every file written for ``plan`` under ``path`` and check its header against the plan.

    Raises:
        VerificationError: a file does not read back, or its tensor names, dtypes or shapes differ (OUT-003).
    """
    for file, shard in zip(output_files(plan, path), plan.shards, strict=True):
        with gc_paused():
            _verify_file(plan, shard, file)


def _shard_header(plan: Plan, shard: list[int]) -> tuple[list[tuple[str, DType, tuple[int, ...]]], dict[str, str]]:
    """The (name, dtype, shape) entries and ``__metadata__`` of one output file's header."""
    return [(plan.tensors[i].name, plan.tensors[i].dtype, plan.tensors[i].shape) for i in shard], {"format": "pt"}


def _verify_file(plan: Plan, shard: list[int], path: Path) -> None:
    """The file's header bytes and size equal what the plan writes (a byte compare: no parse of
    10^5 entries); on any difference the file is parsed to name the tensor that differs."""
    entries, metadata = _shard_header(plan, shard)
    header, spans = build_header(entries, metadata)
    try:
        with open(path, "rb") as f:
            same = f.read(len(header)) == header and os.fstat(f.fileno()).st_size == len(header) + (
                spans[-1][2] if spans else 0)
    except OSError:
        same = False
    if same:
        return
    try:
        reader = SafetensorsReader(path)
    except Exception as exc:  # noqa: BLE001 - any failure to re-read is a verification failure
        raise VerificationError(f"the written file does not read back ({exc})", path=path, action="verify") from None
    with reader:
        want = {plan.tensors[i].name: plan.tensors[i] for i in shard}
        if set(reader.tensors) != set(want):
            raise VerificationError("written tensor names differ from the plan", path=path, action="verify",
                                    expected=sorted(want), found=sorted(reader.tensors))
        for name, info in reader.tensors.items():
            t = want[name]
            if info.dtype != t.dtype or info.shape != tuple(t.shape):
                raise VerificationError(
                    "written header differs from the plan", path=path, tensor=name, action="verify",
                    expected=f"{t.dtype.code} {list(t.shape)}", found=f"{info.dtype.code} {list(info.shape)}",
                )
        raise VerificationError("written header or size differs from the plan", path=path, action="verify",
                                expected=f"{len(header)} header bytes as planned", found="other bytes")


def write_directory_files(plan: Plan, tmp: Path) -> None:
    """Write a directory output's index (when sharded), edited config.json and copied small files into ``tmp``."""
    names = plan.shard_names()
    if len(names) > 1:
        weight_map = {plan.tensors[i].name: names[k] for k, shard in enumerate(plan.shards) for i in shard}
        # as transformers' save_pretrained writes it (sort_keys, indent 2)
        index = {"metadata": {"total_parameters": plan.total_parameters, "total_size": plan.out_nbytes},
                 "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for extra in plan.checkpoint.extra_files:
        if extra.name == "config.json" and plan.config is not None:
            continue
        shutil.copyfile(extra, tmp / extra.name)  # (the bytes only: the output's mode follows the umask)
    if plan.config is not None:
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")


class SafetensorsJob:
    """A :class:`~convert.stream.plan.Plan` written as safetensors (a :class:`convert.targets.TargetJob`):
    ``--to auto|bf16|fp16|fp32``, and the re-quantized plan of ``--to nf4|fp4``
    (:class:`convert.bnb4.target.Bnb4Job`).

    Args:
        plan: the plan to write.
    """

    file_suffix = ".safetensors"

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.is_dir = plan.checkpoint.is_dir
        self.out_nbytes = plan.out_nbytes
        self.tensors = len(plan.tensors)
        self.elements = sum(t.numel for t in plan.tensors)
        self.in_nbytes = plan.in_nbytes

    def plan_dict(self) -> dict[str, Any]:
        return self.plan.to_dict()

    def describe(self) -> str:
        return self.plan.describe()

    def write(self, staging: Path, run: RunSettings, ledger: ShardLedger | None) -> tuple[int, int]:
        return write_plan(self.plan, staging, run, ledger)

    def verify(self, staging: Path) -> None:
        verify_plan(self.plan, staging)

    def notes(self) -> list[str]:
        return list(self.plan.notes)

    def details(self) -> dict[str, Any]:
        return {}

    def fp16_counts(self) -> tuple[int, int]:
        over = sum(int(t.source.stats[0]) for t in self.plan.tensors)
        under = sum(int(t.source.stats[1]) for t in self.plan.tensors)
        return over, under

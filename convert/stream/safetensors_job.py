"""Writing a :class:`~convert.stream.plan.Plan` as safetensors (``--to auto|bf16|fp16|fp32``, and the
re-quantized plan of ``--to nf4|fp4``): :class:`SafetensorsJob`.

How the bytes are written (into a staging path that :class:`convert.output.OutputClaim` owns and
later commits; naming, pre-flight, claims and renames are not done here):

1. Each output file's header first (from the plan), then each tensor in block-aligned chunks.
   Chunks are computed by ``threads`` workers (NumPy releases the GIL) and written in order, so the
   bytes are the same for every thread count (in a run of several targets, a weight's chunks are the
   shared blocks themselves, written from where they lie: :func:`_produce_shared`); a barrier source's
   chunks (made from what earlier tensors left, e.g. a nested absmax) are made by the writing thread when
   their turn comes. Consumed input
   pages are released (``madvise``), so the resident set stays near ``max_memory`` whatever the model
   size.
2. Each finished file is fsynced in the background while the next is written; with a
   :class:`~convert.output.ShardLedger` (resumable runs) each one is recorded once it is on disk,
   and a recorded file still intact is not written again.
3. :func:`verify_plan` re-opens every written file and checks its header against the plan.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from convert.output import ShardLedger
from convert.output_names import GgufNaming
from convert.stream.pipeline import FENCE, Chunk, RunSettings, chunk_size, ordered_chunks, placed_memory, ranges
from convert.stream.plan import Plan, PlannedTensor
from convert.stream.sources import CastSource, Source, cast_run
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
    """Write one output file: its chunks (:func:`_shard_chunks`) through :func:`convert.stream.pipeline.ordered_chunks`,
    up to ``2 * threads`` in flight, written in order; the input pages of each chunk are released once it is
    written. The file is closed without fsync; :func:`_fsync` runs in the background and is awaited before
    verifying."""
    tensors = [plan.tensors[i] for i in shard]
    with gc_paused():
        writer = SafetensorsWriter(path, *_shard_header(plan, shard))
    try:
        for (t, s, e, in_place), data in ordered_chunks(_shard_chunks(tensors, writer, memory, run), pool,
                                                        2 * run.threads):
            writer.write(data, in_place=in_place)  # (placed in memory of its own: sent without a copy)
            t.source.release(s, e)
            if bar is not None:
                bar.update(data.nbytes)
            del data  # a zero-copy chunk is a view of its input file, which ``inputs.done`` may unmap
            if e == t.numel:
                t.source.finish()
                if run.inputs is not None:
                    run.inputs.done(t)
        writer.close(fsync=False)
    except BaseException:
        writer.abort()
        raise


def _shard_chunks(tensors: list[PlannedTensor], writer: SafetensorsWriter, memory: PlacedMemory,
                  run: RunSettings) -> Iterator[Chunk]:
    """The chunks of one file's tensors in file order, keyed ``(tensor, start, stop, written in place)``.

    A tensor's chunks are made by the workers: a source that writes in place makes them in ``memory``,
    placed where the writer sends them from (no copy); others are copied into the writer's reused
    buffers (fresh memory would cost page faults). A barrier source's chunks are made by the writing
    thread when their turn comes, so the workers go on with the next tensors meanwhile. A tiny tensor
    costs more to hand to a worker than to make: it is made here (a run of tiny plain casts: one cast, one
    write spanning them). With an :class:`~convert.stream.pipeline.InputLifetime`, the tensors before one
    whose input files are not on disk are written first (:data:`~convert.stream.pipeline.FENCE`): the files
    they alone read are deleted before the next is fetched.
    """
    k = 0
    while k < len(tensors):
        t = tensors[k]
        k += 1
        if run.inputs is not None and not run.inputs.ready(t):
            yield FENCE
            run.inputs.need(t)
        if t.source.barrier and t.numel:
            for s, e in ranges(t, chunk_size(t, run)):
                yield Chunk((t, s, e, False), functools.partial(t.source.produce, s, e, t.dtype), in_order=True)
            continue
        if t.numel <= _INLINE_ELEMENTS:
            # (not a run with an InputLifetime: it is told of each tensor, and a run could cross input files)
            end = _small_cast_run(tensors, k - 1) if run.inputs is None else k
            # (no local name holds the data: a zero-copy view of an input file must die once it is written)
            if end > k:
                last = tensors[end - 1]
                yield Chunk((last, last.numel, last.numel, False),  # (release of an empty range: none)
                            data=cast_run([u.source for u in tensors[k - 1 : end]], t.dtype))  # type: ignore[misc]
                k = end
            else:
                yield Chunk((t, 0, t.numel, False), data=t.source.produce(0, t.numel, t.dtype) if t.numel
                            else np.empty(0, dtype=t.dtype.numpy))
            continue
        at = writer.offset(k - 1)
        chunk = chunk_size(t, run)
        grid = t.source.view_grid()  # a run of several targets: chunks of whole shared blocks, written from them
        if grid and grid <= chunk:
            for s, e in ranges(t, grid):
                yield Chunk((t, s, e, True), functools.partial(_produce_shared, memory, t.source, s, e, t.dtype,
                                                               at + s * t.dtype.itemsize))
            continue
        for s, e in ranges(t, chunk):
            if t.source.writes_in_place:
                yield Chunk((t, s, e, True), functools.partial(_produce_placed, memory, t.source, s, e, t.dtype,
                                                               at + s * t.dtype.itemsize))
            else:
                yield Chunk((t, s, e, False), functools.partial(t.source.produce, s, e, t.dtype))


def _produce_placed(memory: PlacedMemory, source: Source, start: int, stop: int, dtype: DType,
                    offset: int) -> np.ndarray:
    """Elements [start, stop) of ``source`` in ``memory`` placed for file offset ``offset``
    (:meth:`formats.writeback.PlacedMemory.empty`): the writer sends them to the disk without a copy."""
    out = memory.empty((stop - start) * dtype.itemsize, offset).view(dtype.numpy)
    source.produce_into(start, stop, dtype, out)
    return out


def _produce_shared(memory: PlacedMemory, source: Source, start: int, stop: int, dtype: DType,
                    offset: int) -> np.ndarray:
    """Elements [start, stop) of ``source`` as the shared block holding them in ``dtype`` (a run of several
    targets: :meth:`~convert.stream.sources.Source.produce_view`, made placed for file offset ``offset`` when this
    target makes it, so the writer sends it to the disk without a copy), else made in ``memory``
    (:func:`_produce_placed`)."""
    view = source.produce_view(start, stop, dtype, offset)
    return view if view is not None else _produce_placed(memory, source, start, stop, dtype, offset)


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


def _directory_texts(plan: Plan) -> dict[str, str]:
    """The JSON files a directory output gets written (not copied): the index when sharded, and the edited
    config.json, by name, as transformers' ``save_pretrained`` writes them (sort_keys, indent 2)."""
    out: dict[str, str] = {}
    names = plan.shard_names()
    if len(names) > 1:
        weight_map = {plan.tensors[i].name: names[k] for k, shard in enumerate(plan.shards) for i in shard}
        index = {"metadata": {"total_parameters": plan.total_parameters, "total_size": plan.out_nbytes},
                 "weight_map": weight_map}
        out["model.safetensors.index.json"] = json.dumps(index, indent=2, sort_keys=True) + "\n"
    if plan.config is not None:
        out["config.json"] = json.dumps(plan.config, indent=2, sort_keys=True) + "\n"
    return out


def _copied_files(plan: Plan) -> list[Path]:
    """The input's small files a directory output gets a copy of (config.json is written, when edited)."""
    return [f for f in plan.checkpoint.extra_files if not (f.name == "config.json" and plan.config is not None)]


def disk_nbytes(plan: Plan) -> int:
    """Bytes of every file the plan's output holds: each weight file's header and data, and for a directory
    the index, config.json and the copied files.

    Raises:
        OSError: a file to copy cannot be stat'ed.
    """
    n = 0
    for shard in plan.shards:
        entries, metadata = _shard_header(plan, shard)
        n += len(build_header(entries, metadata)[0]) + sum(plan.tensors[i].nbytes for i in shard)
    if plan.checkpoint.is_dir:
        n += sum(len(text.encode("utf-8")) for text in _directory_texts(plan).values())
        n += sum(f.stat().st_size for f in _copied_files(plan))
    return n


def write_directory_files(plan: Plan, tmp: Path) -> None:
    """Write a directory output's index (when sharded), edited config.json and copied small files into ``tmp``."""
    for extra in _copied_files(plan):
        shutil.copyfile(extra, tmp / extra.name)  # (the bytes only: the output's mode follows the umask)
    for name, text in _directory_texts(plan).items():
        (tmp / name).write_text(text)


class SafetensorsJob:
    """A :class:`~convert.stream.plan.Plan` written as safetensors (a :class:`convert.targets.TargetJob`):
    ``--to auto|bf16|fp16|fp32``, and the re-quantized plan of ``--to nf4|fp4``
    (:class:`convert.bnb4.target.Bnb4Job`).

    Args:
        plan: the plan to write.
    """

    file_suffix = ".safetensors"
    naming: GgufNaming | None = None  # (named by the input: convert.output_names.default_output)
    #: (:attr:`convert.targets.TargetJob.work_per_weight`: the unit; bf16 on the bench model: 1.15 s of CPU beyond
    #: the start for 0.61 G weights, one thread)
    work_per_weight = 1.0

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.is_dir = plan.checkpoint.is_dir
        self.out_nbytes = plan.out_nbytes
        self.disk_nbytes = disk_nbytes(plan)
        self.tensors = len(plan.tensors)
        self.elements = sum(t.numel for t in plan.tensors)
        self.in_nbytes = plan.in_nbytes

    def plan_dict(self) -> dict[str, Any]:
        return self.plan.to_dict()

    def describe(self) -> str:
        return self.plan.describe()

    def output_parts(self, out: Path) -> list[Path] | None:
        return None  # (one file, or a directory)

    def other_layouts(self, out: Path, parts: list[Path] | None) -> list[Path]:
        return []  # (one layout: the file or the directory)

    def sources(self) -> list[Source]:
        return [t.source for t in self.plan.tensors]

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

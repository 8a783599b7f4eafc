"""Running a :class:`~convert.plan.Plan`: chunked, threaded, bounded in memory, verify-then-rename.

How a run goes:

1. Pre-flight: refuse an existing output (unless ``overwrite``), remove stale temporaries left by
   a killed run (named ``.<output name>.convert-bnb-tmp-<pid>``, removed only when that pid is gone),
   and check free disk space against the planned bytes.
2. Write everything under the temporary name in the output's directory: each shard's header first
   (from the plan), then each tensor in block-aligned chunks. Chunks are computed by ``threads``
   workers (NumPy releases the GIL) and written in order, so the bytes are the same for every
   thread count. Consumed input pages are released (``madvise``), so the resident set stays near
   ``max_memory`` whatever the model size.
3. Verify: re-open every written file and check its header against the plan.
4. Rename the temporary into place. On any error, or SIGINT/SIGTERM (the CLI turns SIGTERM into
   KeyboardInterrupt), the temporary is removed; the input is opened read-only throughout.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import (
    DiskSpaceError,
    OutputExistsError,
    OutputInsideInputError,
    OutputKindError,
    UsageError,
    VerificationError,
)
from formats.safetensors import SafetensorsReader, SafetensorsWriter

from .plan import Plan, PlannedTensor

__all__ = [
    "Summary", "TMP_MARK", "check_output_kind", "chunk_elements", "cleanup_stale", "peak_rss_bytes", "remove_path",
    "run_plan", "temp_path", "write_directory_files",
]

TMP_MARK = ".convert-bnb-tmp-"
#: Bytes of working memory per element in flight (fp32 value + output + temporaries).
_BYTES_PER_ELEMENT = 16
#: Memory left for the interpreter, NumPy and the libraries, out of ``max_memory``.
_BASELINE = 96 * 1024 * 1024


@dataclass
class Summary:
    """What a run did (the CLI prints it; ``--json`` prints it as JSON).

    Attributes:
        output: the final output path.
        tensors: tensors written.
        elements: elements written.
        bytes_in: tensor bytes read.
        bytes_out: bytes written (headers included).
        seconds: wall time of the run.
        gelem_per_s: elements written per second, in billions.
        peak_rss_bytes: the process's peak resident set (bytes).
        fp16_overflow: values that became inf when rounded to float16.
        fp16_underflow: non-zero values that became 0 when rounded to float16.
        removed_stale: stale temporaries removed before the run.
        notes: plan notes.
    """

    output: str
    tensors: int = 0
    elements: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    gelem_per_s: float = 0.0
    peak_rss_bytes: int = 0
    fp16_overflow: int = 0
    fp16_underflow: int = 0
    removed_stale: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes (Linux ``ru_maxrss`` is in KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def temp_path(out: Path) -> Path:
    """The temporary name a run writes ``out`` under: ``.<name>.convert-bnb-tmp-<pid>`` beside it."""
    return out.with_name(f".{out.name}{TMP_MARK}{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(out: Path) -> list[str]:
    """Remove temporaries of ``out`` left by runs that were killed (their pid no longer exists).

    Returns:
        the removed paths.
    """
    removed: list[str] = []
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return removed
    prefix = f".{out.name}{TMP_MARK}"
    for p in parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        try:
            pid = int(p.name[len(prefix):])
        except ValueError:
            continue
        if pid != os.getpid() and _pid_alive(pid):
            continue
        remove_path(p)
        removed.append(str(p))
    return removed


def remove_path(p: Path) -> None:
    """Remove a file or a directory tree (a temporary); a missing path is fine."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def check_output_kind(out: Path, is_dir: bool, suffix: str = ".safetensors") -> None:
    """Refuse an output path of the wrong kind before anything is written.

    Args:
        out: the output path.
        is_dir: whether the output will be a directory (a model directory input).
        suffix: the file suffix a single-file output has.

    Raises:
        OutputKindError: a directory output named ``*<suffix>``, or an existing path of the other kind.
    """
    if is_dir and out.suffix.lower() == suffix:
        raise OutputKindError(
            f"a model directory converts to a directory, but -o names a '{suffix}' file", path=out, action="write",
            hint=f"give -o a directory name (without '{suffix}'), or convert one weight file instead",
        )
    if out.exists() and out.is_dir() != is_dir:
        want, have = ("a directory", "a file") if is_dir else ("a file", "a directory")
        raise OutputKindError(
            "the output exists and is of the other kind; --overwrite never replaces one with the other",
            path=out, action="write", expected=want, found=have,
        )


def chunk_elements(unit: int, max_memory: int, threads: int) -> int:
    """Elements per chunk: a multiple of ``unit`` such that all chunks in flight fit ``max_memory``.

    Args:
        unit: required alignment in elements (a layer's blocksize, or 1).
        max_memory: the memory cap in bytes.
        threads: worker threads (2 * threads + 1 chunks can be in flight).
    """
    budget = max(max_memory - _BASELINE, 16 * 1024 * 1024)
    n = budget // ((2 * threads + 1) * _BYTES_PER_ELEMENT)
    n = min(n, 1 << 24)
    return max(unit, (n // unit) * unit)


def _ranges(t: PlannedTensor, chunk: int) -> Iterator[tuple[int, int]]:
    n = t.numel
    for s in range(0, n, chunk):
        yield s, min(n, s + chunk)


def run_plan(
    plan: Plan,
    out: Path,
    *,
    threads: int | None = None,
    max_memory: int = 1 << 30,
    overwrite: bool = False,
    progress: bool = False,
    verify: bool = True,
    write_extra: Callable[[Path], None] | None = None,
) -> Summary:
    """Write a plan's output to ``out`` (a file for a file input, else a directory).

    Args:
        plan: from :func:`convert.plan.make_plan`.
        out: the output path.
        threads: worker threads (default: all cores).
        max_memory: the working-memory cap in bytes.
        overwrite: replace an existing output.
        progress: show a tqdm bar (bytes written) on stderr.
        verify: re-open and check every written file before renaming (on by default).
        write_extra: called with the temporary directory to add more files (directory outputs).

    Returns:
        a :class:`Summary`.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is false.
        DiskSpaceError: not enough free space for the planned bytes.
        VerificationError: a written file does not match the plan.
        ConvertBnbError: any input rule broken while streaming (e.g. BNB-012).
    """
    t0 = time.perf_counter()
    threads = max(1, threads or os.cpu_count() or 1)
    if max_memory < 64 * 1024 * 1024:
        raise UsageError("--max-memory is too small", expected=">= 64MiB", found=max_memory)
    out = Path(out)
    summary = Summary(output=str(out), notes=list(plan.notes))
    check_output_kind(out, plan.checkpoint.is_dir)
    if out.exists() and not overwrite:
        raise OutputExistsError(
            "output exists", path=out, action="write", hint="pass --overwrite to replace it, or choose -o"
        )
    src = plan.checkpoint.source.resolve()
    if out.resolve() == src or src in out.resolve().parents:
        raise OutputInsideInputError("output must not be the input or inside it", path=out, action="write",
                                     hint="choose an output path outside the input with -o")
    out.parent.mkdir(parents=True, exist_ok=True)
    summary.removed_stale = cleanup_stale(out)
    need = plan.out_nbytes + 1024 * 1024
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise DiskSpaceError(
            "not enough free disk space for the output", path=out.parent, action="write",
            expected=f">= {need} bytes free", found=f"{free} bytes free",
            hint="free some space or write elsewhere with -o",
        )

    tmp = temp_path(out)
    bar = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.out_nbytes, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=out.name, file=sys.stderr, leave=False)
        files: list[Path]
        if plan.checkpoint.is_dir:
            tmp.mkdir()
            files = [tmp / n for n in plan.shard_names()]
        else:
            files = [tmp]
        with ThreadPoolExecutor(max_workers=threads) as pool, ThreadPoolExecutor(max_workers=1) as syncer:
            synced = []
            for path, shard in zip(files, plan.shards, strict=True):
                _write_shard(plan, shard, path, pool, threads, max_memory, bar, summary)
                synced.append(syncer.submit(_fsync, path))  # overlaps with writing the next shard
            for fut in synced:
                fut.result()
        if verify:
            for path, shard in zip(files, plan.shards, strict=True):
                _verify(plan, shard, path)
        if plan.checkpoint.is_dir:
            write_directory_files(plan, tmp)
            if write_extra is not None:
                write_extra(tmp)
        summary.bytes_out = sum(p.stat().st_size for p in files)
        if out.exists():  # overwrite: move the old output aside, then swap
            old = out.with_name(f".{out.name}{TMP_MARK}old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            remove_path(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        remove_path(tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
    for t in plan.tensors:
        summary.fp16_overflow += int(t.source.stats[0])
        summary.fp16_underflow += int(t.source.stats[1])
    summary.tensors = len(plan.tensors)
    summary.elements = sum(t.numel for t in plan.tensors)
    summary.bytes_in = plan.in_nbytes
    summary.seconds = time.perf_counter() - t0
    summary.gelem_per_s = summary.elements / summary.seconds / 1e9 if summary.seconds > 0 else 0.0
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary


def _write_shard(
    plan: Plan,
    shard: list[int],
    path: Path,
    pool: ThreadPoolExecutor,
    threads: int,
    max_memory: int,
    bar: Any,
    summary: Summary,
) -> None:
    """Write one output file: chunks of all its tensors flow through the pool as one stream (so the
    workers never wait for a tensor boundary), up to ``2 * threads`` in flight, written in order.
    The file is closed without fsync; :func:`_fsync` runs in the background and is awaited before
    verifying."""
    tensors = [plan.tensors[i] for i in shard]
    writer = SafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    try:
        pending: deque[tuple[PlannedTensor, int, int, Future[Any]]] = deque()
        for t in tensors:
            while t.source.barrier and pending:
                _drain_one(pending, writer, bar)
            chunk = chunk_elements(t.source.unit, max_memory, threads)
            for s, e in _ranges(t, chunk):
                pending.append((t, s, e, pool.submit(t.source.produce, s, e, t.dtype)))
                while len(pending) > 2 * threads:
                    _drain_one(pending, writer, bar)
            if t.numel == 0:
                pending.append((t, 0, 0, _done(np.empty(0, dtype=t.dtype.numpy))))
        while pending:
            _drain_one(pending, writer, bar)
        writer.close(fsync=False)
    except BaseException:
        writer.abort()
        raise


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _fsync(path: Path) -> None:
    """Flush a closed file's data to disk (any descriptor of the file will do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drain_one(pending: deque[tuple[PlannedTensor, int, int, Future[Any]]], writer: SafetensorsWriter,
               bar: Any) -> None:
    t, s, e, fut = pending.popleft()
    data = fut.result()
    writer.write(data)
    t.source.release(s, e)
    if e == t.numel:
        t.source.finish()
    if bar is not None:
        bar.update(data.nbytes)


def _verify(plan: Plan, shard: list[int], path: Path) -> None:
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


def write_directory_files(plan: Plan, tmp: Path) -> None:
    """Write a directory output's index (when sharded), edited config.json and copied small files into ``tmp``."""
    names = plan.shard_names()
    if len(names) > 1:
        weight_map = {plan.tensors[i].name: names[k] for k, shard in enumerate(plan.shards) for i in shard}
        index = {"metadata": {"total_size": plan.out_nbytes}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for extra in plan.checkpoint.extra_files:
        if extra.name == "config.json" and plan.config is not None:
            continue
        shutil.copy2(extra, tmp / extra.name)
    if plan.config is not None:
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")

"""One job of ``convert-bnb batch``, in its worker: :func:`execute_job` on a job's ``SPEC.json``.

Where it runs is the executor's choice (:mod:`convert.batch.run`: a local worker process started as
``python -c worker_main SPEC.json``; :mod:`convert.batch.ray_executor`: a Ray task). :func:`run_job`
resolves the source, compares the job's key with its state file, runs :func:`convert.job.convert` with
the job's options and records what was done (:class:`JobResult`); :func:`execute_job` turns every
failure into the result. The job's progress goes to a small file the batch process reads
(:func:`progress_path`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from convert import signals
from convert.batch.card import push_output, set_outputs
from convert.batch.jobs import Job, job_options
from convert.batch.state import (
    PARTIAL_FILES,
    STATE_DIR,
    STATE_VERSION,
    check_complete,
    check_replaceable,
    file_manifest_matches,
    installed_manifest,
    load_state,
    save_state,
    state_path,
)
from convert.hub.card import source_license
from convert.hub.publish import quant_summary
from convert.job import convert
from convert.options import Target
from convert.output import PARTIAL_MARK, write_json
from convert.run.result import ConvertResult
from convert.run.single import job_key
from convert.run.source import resolve_source
from convert.stream.pipeline import peak_rss_bytes
from formats.errors import ConvertBnbError, HubUploadError, TargetsFailedError
from formats.mapping import changed_input

__all__ = ["JobResult", "execute_job", "failed_result", "interrupted_message", "progress_path", "read_progress",
           "run_job", "worker_main"]


@dataclass
class JobResult:
    """What happened to one job.

    Attributes:
        name: the job's output name.
        src: its source (repo id or path).
        status: ``converted``, ``skipped`` (already done), ``upload-failed`` (converted or done before, kept,
            but ``--push-to-hub`` failed: HUB-003; a re-run uploads it), ``failed``, or ``interrupted`` (the
            batch was stopped while the job ran; ``error`` says what was kept for the next run).
        output: the output path.
        mmproj: the ``--mmproj`` output path, or None.
        commit: the resolved source commit (Hub), or None.
        shards_written: shards written by this run.
        shards_reused: finished shards kept from an earlier run.
        bytes_out: bytes of the output (all files, the ``--mmproj`` file too).
        verified: the conversion re-read its output before committing it (False with ``--no-verify``).
        seconds: wall time of the job.
        peak_rss_bytes: the worker's peak resident set.
        error: the error line when failed.
        error_class: the error's class name when failed (``OutputBusyError``, ...).
        rule: the error's rule when failed (``OUT-004``, ...).
        pushed: the Hub repo pushed to (this run or before), or None; a job of several targets: the repo of
            each output, joined by ``, ``.
        notes: the conversion's notes (first its float16 line, when it has one).
    """

    name: str
    src: str
    status: str
    output: str = ""
    commit: str | None = None
    shards_written: int = 0
    shards_reused: int = 0
    bytes_out: int = 0
    verified: bool = False
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    error: str | None = None
    error_class: str | None = None
    rule: str | None = None
    pushed: str | None = None
    notes: list[str] = field(default_factory=list)
    mmproj: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def run_job(spec: dict[str, Any]) -> JobResult:
    """Run one job of a batch (in the worker process): resolve, :func:`convert.job.convert`, verify, push.

    Args:
        spec: the job (``job``: :class:`Job` fields) and the batch settings (``out_dir``,
            ``max_memory`` and ``threads`` for this worker, ``verify``, ``overwrite``, ``push_to_hub``,
            ``private``).

    Returns:
        the :class:`JobResult` (also recorded in the state file).

    Raises:
        ConvertBnbError: any failure of the job (recorded in the state file first): the conversion's
            own errors, JobSettingsChangedError (BATCH-005), ForeignFilesError (BATCH-006).
    """

    t0 = time.perf_counter()
    job = Job(**spec["job"])
    out_dir = Path(spec["out_dir"])
    work = out_dir / STATE_DIR
    work.mkdir(parents=True, exist_ok=True)
    state_file = state_path(out_dir, job.name)
    final = out_dir / job.name
    state = load_state(state_file)
    outputs = [(out_dir / name, field) for name, field in job.outputs()]  # the text model's first
    result = JobResult(job.name, job.src, "failed", str(final),
                       mmproj=str(out_dir / job.mmproj) if job.mmproj else None)
    members: list[tuple[Target, ConvertResult]] | None = None  # a job of several targets' outputs, once planned
    try:
        source = resolve_source(job.src, job.revision, to=job.to.name, output=final)
        commit = source.hub.commit if source.hub is not None else None
        result.commit = commit
        options = job_options(job, spec, revision=commit)  # the commit the key names is the one converted
        key = job_key(options, source)
        done_state = state.get("status") == "done"
        recorded = {f: (state.get(f) or {}) if done_state else {} for _, f in outputs}
        # what the last conversion committed, maybe unrecorded
        installed = {f: installed_manifest(state_file, f) for _, f in outputs}

        def in_place(manifests: dict[str, dict[str, Any]]) -> bool:
            return all(path.exists() and file_manifest_matches(path, manifests[f]) for path, f in outputs)

        if state.get("key") == key and in_place(recorded):
            result.status = "skipped"
        elif state.get("key") == key and not done_state and in_place(installed):
            # an earlier worker committed this output and died before recording it: record it now
            for path, f in outputs:
                check_complete(path, installed[f])
            state.update(status="done", error=None, **installed)
            save_state(state_file, state)
            result.status = "skipped"
            result.notes = ["the output was committed by an earlier run that stopped before recording it"]
        else:
            if spec.get("push_to_hub") and job.to.family == "multi":  # (each output's repo, before the work)
                members = set_outputs(job, options, source, spec["push_to_hub"])
            overwrite = check_replaceable(outputs, state, state_file, key, bool(spec.get("overwrite")))
            same = state.get("key") == key  # (the same key makes the same bytes: what was pushed stays pushed)
            pushed = {k: state[k] for k in ("pushed", "pushed_outputs") if same and k in state}
            state = {"version": STATE_VERSION, "key": key, "job": job.to_dict(), "status": "running", **pushed}
            save_state(state_file, state)
            done = convert(replace(options, overwrite=overwrite,
                                   on_progress=_progress_writer(progress_path(out_dir, job.name))))
            written = {"files": done.files, "mmproj_files": done.details.get("mmproj", {}).get("files", {}),
                       "modelfile_files": done.details.get("modelfile", {}).get("files", {})}
            for path, f in outputs:
                check_complete(path, written[f])
                state[f] = written[f]
            result.status = "converted"
            result.shards_written, result.shards_reused = done.shards_written, done.shards_reused
            result.verified = done.verified
            result.notes = [line for line in [done.fp16_line()] if line] + done.notes
            state.update(status="done", error=None)
            if source.hub is not None:
                state["source"] = {"repo": source.hub.repo_id, "revision": source.hub.revision,
                                   "commit": source.hub.commit}
            save_state(state_file, state)
        result.bytes_out = sum(r["bytes"] for _, f in outputs for r in state.get(f, {}).values())
        if spec.get("push_to_hub"):
            try:
                lic = source_license(source.path if source.path.is_dir() else None,
                                     source.hub.repo_id if source.hub is not None else None, commit)
                if members is None and job.to.family == "multi":  # (a skipped job: not planned above)
                    members = set_outputs(job, options, source)
                result.pushed = push_output(job, out_dir, state, state_file, spec, commit,
                                            quant_summary(source.path), lic, members)
            except HubUploadError as exc:  # the conversion is done and kept: its own outcome, not a failed job
                result.status, result.error_class, result.rule = "upload-failed", type(exc).__name__, exc.rule
                result.error = f"converted, upload failed: {exc}"
    except BaseException as exc:
        if state.get("status") != "done":  # a failed push leaves a finished conversion done
            state["status"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        if isinstance(exc, TargetsFailedError) and exc.result is not None:  # the complete outputs are the batch's
            state[PARTIAL_FILES] = exc.result.files
        state["error"] = interrupted_message(out_dir, job.name) if isinstance(exc, KeyboardInterrupt) else (
            str(exc) or type(exc).__name__)
        if state.get("version"):
            save_state(state_file, state)
        raise
    finally:
        result.seconds = time.perf_counter() - t0
        result.peak_rss_bytes = peak_rss_bytes()
    return result


def progress_path(out_dir: Path, name: str) -> Path:
    """Where a job's worker records its progress: ``{"done": bytes written, "total": bytes to write}``."""
    return out_dir / STATE_DIR / f"{name}.progress"


def _progress_writer(path: Path, every: float = 0.5) -> Callable[[int, int], None]:
    """A ``ConvertOptions.on_progress`` that writes the progress to ``path`` (atomically), at most every
    ``every`` seconds, and always when the output is complete."""

    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < every:
            return
        last[0] = now
        try:
            write_json(path, {"done": done, "total": total})
        except OSError:  # progress is a courtesy: never fail a conversion for it
            pass

    return report


def read_progress(path: Path) -> tuple[int, int] | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return int(d["done"]), int(d["total"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def interrupted_message(out_dir: Path, name: str) -> str:
    """What an interrupted job leaves, truthfully: the finished shards kept for the next run (a directory
    output's staging), or nothing (a one-file output is written again whole)."""

    partial = out_dir / f".{name}{PARTIAL_MARK}"
    if (out_dir / name).exists() and not partial.exists():
        return ("interrupted with an output in place; the next run checks it against the job's manifest and "
                "records it as done if it is complete, else converts the job again")
    if partial.is_dir():
        return (f"interrupted; its finished shards are kept in {partial} and reused when the batch is run "
                "again")
    return "interrupted; nothing of it was kept (run the batch again to convert it)"


def _die_with_parent(parent: int) -> None:
    """Ask Linux to send this worker SIGTERM when the batch process dies (``PR_SET_PDEATHSIG``), so a
    killed batch never leaves a worker writing on; exit at once when the parent is already gone."""

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the output claim still guards
        return
    if os.getppid() != parent:
        os._exit(130)


def worker_main(argv: list[str]) -> int:
    """Entry point of a local worker process: ``SPEC.json``. Prints the result as one JSON line on stdout.

    Exit codes: those of :func:`execute_job`; 130 also when the batch process died.
    """

    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    signals.install()  # SIGTERM (the batch stopping it) ends the job as SIGINT does
    signals.on_bus_error(lambda: _report_bus_error(spec))
    _die_with_parent(int(spec["parent_pid"]))
    data, code = execute_job(spec)
    signals.settle()  # the job is over: a late signal no longer kills the worker while it reports
    print(json.dumps(data))
    return code


def _report_bus_error(spec: dict[str, Any]) -> None:
    """SIGBUS in a worker (an input cut shorter while it was read): the job's result line, as a named
    failure (CKPT-012), before the worker exits with code 2."""
    exc = changed_input()
    print(f"convert-bnb batch: job {spec['job']['name']}: {exc}", file=sys.stderr, flush=True)
    print(json.dumps(failed_result(exc)), flush=True)


def execute_job(spec: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Run one job as a worker does (a local worker process, or a Ray task): :func:`run_job`, with every
    failure turned into the job's result. Messages for the job's log go to ``sys.stderr``.

    Args:
        spec: what ``DIR/.convert-bnb/NAME.spec.json`` holds (see :func:`run_job`).

    Returns:
        the result (:class:`JobResult` fields, as JSON data) and the exit code: 0 done, 2 the job failed
        on its input (error in the state file), 1 internal error, 130 interrupted (``KeyboardInterrupt``:
        SIGTERM in a local worker, ``ray.cancel`` in a Ray task).
    """
    try:
        result = run_job(spec)
    except ConvertBnbError as exc:
        return failed_result(exc), 2
    except KeyboardInterrupt:
        job = spec["job"]
        message = interrupted_message(Path(spec["out_dir"]), job["name"])
        print(f"convert-bnb batch: job {job['name']}: {message}", file=sys.stderr)  # the job's log says so too
        return {"status": "interrupted", "error": message}, 130
    except Exception as exc:  # noqa: BLE001 - reported as this job's failure; the batch goes on

        traceback.print_exc()
        return {"status": "failed", "error": f"internal error: {type(exc).__name__}: {exc}",
                "error_class": type(exc).__name__}, 1
    return result.to_dict(), 0


def failed_result(exc: ConvertBnbError) -> dict[str, Any]:
    """A job's result for a named failure: ``status`` failed, the error line, its class and rule."""
    return {"status": "failed", "error": str(exc), "error_class": type(exc).__name__, "rule": exc.rule}

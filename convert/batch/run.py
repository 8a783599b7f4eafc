"""``convert-bnb batch JOBS --out-dir DIR``: many conversions, resumable, failures isolated.

This module runs a batch (the parent process and its executors; one job in its worker is
:mod:`convert.batch.worker`); its command line and summary table are
:mod:`convert.batch.cli`; the JOBS file is read by
:mod:`convert.batch.jobs`, the per-job state is kept by :mod:`convert.batch.state`, the model card,
the push and the dry-run plan are in :mod:`convert.batch.card`.

JOBS file
    One job per line, ``SRC[@REVISION] [--to T] [--revision R] [--max-shard-size S] [--name NAME]
    [--mmproj [MMNAME]] [--modelfile [MFNAME]]`` (SRC a Hub repo id ``org/name`` or a local path; ``#``
    comments, blank lines skipped), or a JSON or YAML list of such lines or of objects ``{"src", "revision",
    "to", "max_shard_size", "name", "mmproj", "modelfile"}``; ``--mmproj`` also writes a GGUF job's vision
    projector to ``DIR/MMNAME`` (default ``mmproj-NAME``), a second output of the job, and ``--modelfile`` an
    Ollama Modelfile to ``DIR/MFNAME`` (default NAME with ``.Modelfile`` for ``.gguf``), the last one.
    Options a job leaves out come from the command line; NAME defaults to the name a single
    conversion would give the output. Rules, all checked before any job runs, each error naming the
    file and line: BATCH-001 the file reads and parses (``BatchFileError``), BATCH-002 every item has
    a source (``BatchJobError``), BATCH-003 per-job options are known and valid
    (``BatchOptionError``), BATCH-004 no two jobs share an output name (``BatchNameClashError``).
    See :mod:`convert.batch.jobs`.

Layout under DIR
    ``DIR/NAME``                         a finished output (a directory, or a file for a single-file source)
    ``DIR/MMNAME``                       a GGUF job's vision projector (``--mmproj``), committed after NAME
    ``DIR/MFNAME``                       a GGUF job's Ollama Modelfile (``--modelfile``), committed last
    ``DIR/.NAME.convert-bnb-partial``    the job's staging: for a directory output a folder kept between
                                         runs with the ledger of its finished shards
                                         (:class:`convert.output.ShardLedger`); for a single-file output a
                                         file, removed when the run fails
    ``DIR/.NAME.convert-bnb-lock``       the output's claim, held with ``flock`` by the worker writing it
    ``DIR/.NAME.convert-bnb-old-PID``    an old output set aside while ``--overwrite`` installs the new one
    ``DIR/.convert-bnb/NAME.json``       the job's state file (:mod:`convert.batch.state`), and beside it
                                         ``NAME.files.json`` (``NAME.mmproj_files.json``,
                                         ``NAME.modelfile_files.json``): the manifest
                                         each output's conversion wrote before its commit
    ``DIR/.convert-bnb/NAME.spec.json``  what the worker was asked to do
    ``DIR/.convert-bnb/NAME.log``        the worker's stderr
    ``DIR/.convert-bnb/lock``            held with ``flock`` while a batch runs: one batch per DIR at a time

Running
    :func:`run_batch` (the parent) checks the settings (``--max-memory`` split over ``--jobs`` leaves
    each worker at least 64 MiB; DIR is a directory, not a job's input or inside it), takes
    ``DIR/.convert-bnb/lock``, and starts one worker process per job, ``--jobs N`` at a time, each with
    ``max_memory // N`` and its share of the threads; one job's crash cannot stop the others. A worker
    (:func:`convert.batch.worker.worker_main`) asks Linux to SIGTERM it when the parent dies (``PR_SET_PDEATHSIG``),
    so a killed batch never leaves a worker writing on; SIGTERM stops it with exit code 130. It runs
    :func:`convert.batch.worker.run_job`: resolve SRC (Hub repos through :mod:`convert.hub.download`, honouring the HF
    cache and offline mode) to a commit, compare the job's key with the state file, and run
    :func:`convert.job.convert` with the job's :class:`~convert.options.ConvertOptions`
    (:func:`convert.batch.jobs.job_options`: resumable, with a file manifest), which claims the output,
    writes and verifies each shard and commits the output atomically (:mod:`convert.output`). The
    worker prints its :class:`convert.batch.worker.JobResult` as one JSON line
    (:func:`convert.batch.worker.execute_job` turns every failure into
    the result); the parent prints a summary table and exits with :data:`EXIT_JOBS_FAILED` when any job
    failed. Interrupting the parent terminates its workers.

Executors
    Where jobs run is a :class:`Workers`: ``--executor local`` (:class:`LocalWorkers`, the worker
    processes above) or ``--executor ray`` (:class:`convert.batch.ray_executor.RayWorkers`: each job a Ray task
    on a cluster, ``--ray-address``; DIR on a file system every node sees). Both run
    :func:`convert.batch.worker.execute_job` on the job's ``SPEC.json`` and write the same files, state and results,
    so a batch started on one executor resumes on the other. See docs/many-machines.md.

Done
    A job is marked ``done`` in its state file only after :func:`convert.job.convert` has returned and
    :func:`convert.batch.state.check_complete` has found the installed output complete: exactly the
    files of the conversion's manifest, at their sizes, and every shard its index names. The state
    then records every file's size and sha256. Until then the state says ``running``, and on an
    error ``failed`` with the error.

Resuming
    The state's ``key`` is :func:`convert.run.single.job_key` (source and resolved commit, ``--to``,
    ``--max-shard-size``, converter version, ...). A re-run skips a job whose state is ``done`` with
    the same key and whose output holds exactly the recorded files with their recorded sizes and
    sha256. Otherwise the job runs again: a directory output resumes from its
    ``.NAME.convert-bnb-partial/`` staging, keeping every shard the ledger records for the same key
    with its recorded size and sha256 and writing only the rest; a single-file output (one
    ``.safetensors`` file, ``--to gguf``) is written again whole. An existing output of a done job
    whose files were damaged or removed is redone with the same key.

BATCH-005 (``JobSettingsChangedError``)
    An output this batch finished with another key (another commit, target, shard size or converter
    version) is not replaced unless ``--overwrite`` is given; the job fails and the output is kept.

BATCH-006 (``ForeignFilesError``)
    Files the batch did not write are never deleted: when the job's output exists and holds files its
    ``done`` state does not record (any file at all when the job has no ``done`` record, or a symlink
    in place of the output), the job fails before anything is removed, even with ``--overwrite``.

Pushing
    ``--push-to-hub ORG`` creates ``ORG/NAME`` (``exist_ok``, ``--private``) after a job is done and
    uploads the output in one commit with a model card (``README.md``) recording the source repo and
    commit, the settings and the converter version. The push is recorded in the state file; a re-run
    does not push a job again once pushed to the same repo with the same key. A job of several targets pushes
    each output of its folder to ``ORG/<its name>``, with its own card, each push recorded on its own. A failed
    push is the job's own outcome, ``upload-failed`` (HUB-003, exit 3): the conversion stays done and kept, and a re-run
    uploads it without converting again. ``--dry-run`` converts nothing and prints each job's plan,
    the card and the upload plan; it makes :func:`check_batch` and, for each job it would convert, the
    worker's BATCH-005/006 check and ``check``'s rules on the input, and exits with
    :data:`EXIT_JOBS_FAILED` when a job would fail. See :mod:`convert.batch.card`.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from convert.batch.jobs import Job
from convert.batch.ray_executor import RayWorkers
from convert.batch.state import (
    STATE_DIR,
)
from convert.batch.worker import JobResult, interrupted_message, progress_path, read_progress
from convert.options import MIN_MEMORY
from convert.stream.pipeline import min_memory
from convert.units import format_bytes, format_short_of
from formats.errors import (
    OutputInsideInputError,
    OutputKindError,
    UsageError,
)

__all__ = [
    "EXECUTORS",
    "EXIT_JOBS_FAILED",
    "BatchProgress",
    "LocalWorkers",
    "Workers",
    "check_batch",
    "check_executor",
    "run_batch",
]

#: Exit code of ``convert-bnb batch`` when at least one job failed.
EXIT_JOBS_FAILED = 3


# ---------------------------------------------------------------- one job (runs in the worker process)


@dataclass
class BatchProgress:
    """Where a running batch is: shown while jobs run (``convert-bnb batch`` without ``--quiet``/``--json``).

    Attributes:
        jobs: jobs in the batch.
        finished: jobs finished (converted, skipped or failed).
        running: per running job, (bytes written, bytes to write), or None before its writing starts.
    """

    jobs: int
    finished: int
    running: dict[str, tuple[int, int] | None]

    def line(self) -> str:
        """One line: overall, then each running job's share written."""
        parts = []
        for name, p in sorted(self.running.items()):
            if p is None or p[1] <= 0:
                parts.append(f"{name} planning")
            else:
                parts.append(f"{name} {100 * p[0] // p[1]}% ({format_bytes(p[0])} of {format_bytes(p[1])})")
        return f"[{self.finished}/{self.jobs} jobs done] " + ("; ".join(parts) if parts else "")


# ---------------------------------------------------------------- the batch (parent process)

_WORKER = "import sys; from convert.batch.worker import worker_main; sys.exit(worker_main(sys.argv[1:]))"


#: The executors of ``convert-bnb batch --executor``: worker processes on this machine, or Ray tasks.
EXECUTORS = ("local", "ray")


class Workers(Protocol):
    """Where a batch's jobs run: :class:`LocalWorkers` (processes on this machine) or
    :class:`convert.batch.ray_executor.RayWorkers` (Ray tasks on a cluster). Both run
    :func:`convert.batch.worker.execute_job` on the
    job's ``SPEC.json`` and give back its result: the outputs, state files and results are the same."""

    def job_threads(self, threads: int | None, n_jobs: int, job_memory: int) -> int:
        """Threads of each job, from the batch's ``--threads`` (None: all cores) split over ``n_jobs``.

        Raises:
            UsageError: a job with these threads and ``job_memory`` bytes fits no machine.
        """
        ...

    def run(self, spec_path: Path, log_path: Path) -> tuple[dict[str, Any], int]:
        """Run the job ``spec_path`` describes, its messages appended to ``log_path``; blocks until it
        ends. Returns its result (:class:`convert.batch.worker.JobResult` fields, JSON data) and exit code
        (as :func:`convert.batch.worker.execute_job`)."""
        ...

    def stop(self) -> None:
        """Interrupt every running job (it records itself as interrupted); returns at once."""
        ...

    def close(self) -> None:
        """Release what the workers hold (a Ray connection this batch made)."""
        ...


class LocalWorkers:
    """One worker process per job on this machine: ``python -c worker_main SPEC.json`` (see the module
    docstring: it dies with the batch, SIGTERM interrupts it)."""

    def __init__(self) -> None:

        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    def job_threads(self, threads: int | None, n_jobs: int, job_memory: int) -> int:
        """This machine's cores (or ``threads``) split over ``n_jobs``, at least 1."""
        return max(1, (threads or os.cpu_count() or 1) // n_jobs)

    def run(self, spec_path: Path, log_path: Path) -> tuple[dict[str, Any], int]:
        """Start the worker process, wait for it, read its result line (its stderr goes to ``log_path``)."""

        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(spec_path)], stdout=subprocess.PIPE,
                                    stderr=log, env=_worker_env())
            with self._lock:
                self._procs.add(proc)
            try:
                stdout, _ = proc.communicate()
            finally:
                with self._lock:
                    self._procs.discard(proc)
        line = stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        try:
            return json.loads(line[0]), proc.returncode
        except json.JSONDecodeError:
            return {"status": "failed", "error": f"worker exited with code {proc.returncode}"}, proc.returncode

    def stop(self) -> None:
        """SIGTERM every worker process."""
        with self._lock:
            for p in self._procs:
                p.terminate()

    def close(self) -> None:
        """Nothing to release."""


def check_executor(executor: str, ray_address: str | None) -> None:
    """Check ``--executor`` and ``--ray-address``.

    Raises:
        UsageError: an unknown executor, or a Ray address without ``--executor ray``.
    """
    if executor not in EXECUTORS:
        raise UsageError("unknown --executor", expected=", ".join(EXECUTORS), found=executor)
    if ray_address is not None and executor != "ray":
        raise UsageError("--ray-address needs --executor ray", found=f"--executor {executor}",
                         hint="add --executor ray, or drop --ray-address")


def check_batch(jobs: list[Job], out_dir: Path, n_jobs: int, max_memory: int) -> None:
    """The checks :func:`run_batch` makes before any job runs (``--dry-run`` makes them too).

    Args:
        jobs: from :func:`parse_jobs`.
        out_dir: the batch's ``--out-dir``.
        n_jobs: ``--jobs``.
        max_memory: ``--max-memory`` in bytes.

    Raises:
        UsageError: ``n_jobs`` < 1, or ``max_memory // n_jobs`` below the pipeline's minimum (a job of several
            targets: :func:`convert.stream.pipeline.min_memory`).
        OutputKindError: USE-003, ``out_dir`` (or the nearest of its parents that exists) is a file.
        OutputInsideInputError: ``out_dir`` is a job's input or inside it.
    """
    if n_jobs < 1:
        raise UsageError("--jobs must be at least 1", found=n_jobs)
    per_memory = max_memory // min(n_jobs, max(1, len(jobs)))  # (no more jobs run at once than there are)
    if per_memory < MIN_MEMORY:
        raise UsageError(f"--max-memory split over --jobs leaves a worker less than {format_bytes(MIN_MEMORY)}",
                         expected=f">= {format_bytes(MIN_MEMORY)} per job",
                         found=f"{format_short_of(per_memory, MIN_MEMORY)} per job",
                         hint="raise --max-memory or lower --jobs")
    for job in jobs:  # a job of several targets keeps to more (:func:`convert.stream.pipeline.min_memory`)
        least = min_memory(len(job.to.targets))
        if per_memory < least:
            raise UsageError(f"--max-memory split over --jobs leaves job {job.name} ({job.where}) less than its "
                             f"{len(job.to.targets)} targets keep to", expected=f">= {format_bytes(least)} per job",
                             found=f"{format_short_of(per_memory, least)} per job",
                             hint="raise --max-memory, lower --jobs, or split the job's targets")
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():  # the out dir, or the nearest of its parents that exists, is a file
        raise OutputKindError("--out-dir must be a directory" + ("" if existing == out_dir else " (or go under one)"),
                              path=existing, action="write", expected="a directory", found="a file")
    resolved = out_dir.resolve()
    for job in jobs:
        local = Path(job.src)
        if local.exists() and (resolved == local.resolve() or local.resolve() in resolved.parents):
            raise OutputInsideInputError("--out-dir must not be a job's input or inside it", path=out_dir,
                                         action="write", hint=f"job {job.where} reads '{job.src}'")


def run_batch(
    jobs: list[Job],
    out_dir: Path,
    *,
    n_jobs: int = 1,
    max_memory: int = 1 << 30,
    threads: int | None = None,
    verify: bool = True,
    overwrite: bool = False,
    push_to_hub: str | None = None,
    private: bool = False,
    on_done: Callable[[JobResult], None] | None = None,
    on_progress: Callable[[BatchProgress], None] | None = None,
    progress_interval: float = 2.0,
    executor: str = "local",
    ray_address: str | None = None,
) -> list[JobResult]:
    """Run every job in worker processes (or Ray tasks), ``n_jobs`` at a time, within one memory budget.

    Args:
        jobs: from :func:`parse_jobs`.
        out_dir: where outputs, state files and logs go (with ``executor="ray"``: a path every node sees).
        n_jobs: jobs running at a time.
        max_memory: the memory budget of the whole batch in bytes; each job gets ``max_memory // n_jobs``.
        threads: threads of the whole batch (default: all cores of this machine, or of the Ray cluster),
            split between the jobs.
        verify: re-read each written shard before renaming it into place.
        overwrite: redo jobs whose output was made with other settings (never removing files the
            batch did not write).
        push_to_hub: an organisation (or user) to push each output to, or None.
        private: create pushed repos as private.
        on_done: called with each job's result as it finishes.
        on_progress: called every ``progress_interval`` seconds while jobs run, with the
            :class:`BatchProgress` (jobs finished, each running job's bytes written).
        progress_interval: seconds between ``on_progress`` calls.
        executor: ``local`` (worker processes on this machine) or ``ray`` (Ray tasks, see
            :mod:`convert.batch.ray_executor`).
        ray_address: with ``executor="ray"``, the cluster to connect to (``ray.init(address=...)``;
            None: ``RAY_ADDRESS``, a cluster started on this machine, or a new local one).

    Returns:
        one :class:`convert.batch.worker.JobResult` per job, in job order.

    Raises:
        UsageError: :func:`check_batch` (``--jobs``, ``--max-memory``, ``--out-dir``) refuses the settings,
            another batch is running with the same ``out_dir``, a bad executor or Ray address
            (:func:`check_executor`), Ray is not installed, or a job fits no node of the Ray cluster.
    """
    check_executor(executor, ray_address)
    check_batch(jobs, out_dir, n_jobs, max_memory)
    n_jobs = min(n_jobs, max(1, len(jobs)))  # --jobs 100 for 2 jobs: 2 run at once, each with half the budget
    per_memory = max_memory // n_jobs
    out_dir = out_dir.absolute()  # the same path for every worker, whatever its working directory
    if executor == "ray":

        workers: Workers = RayWorkers(ray_address)
    else:
        workers = LocalWorkers()
    try:
        per_threads = workers.job_threads(threads, n_jobs, per_memory)
        work = out_dir / STATE_DIR
        work.mkdir(parents=True, exist_ok=True)
        lock = _lock_out_dir(work)
        try:
            spec = {"out_dir": str(out_dir), "max_memory": per_memory, "threads": per_threads, "verify": verify,
                    "overwrite": overwrite, "push_to_hub": push_to_hub, "private": private,
                    "parent_pid": os.getpid()}
            return _run_jobs(jobs, out_dir, work, n_jobs, spec, workers, on_done, on_progress, progress_interval)
        finally:
            if lock is not None:
                lock.close()
    finally:
        workers.close()


def _lock_out_dir(work: Path) -> Any:
    """Hold ``OUT/.convert-bnb/lock`` for the run: two batches never write the same out dir at once.

    Raises:
        UsageError: another batch holds the lock.
    """
    f = open(work / "lock", "a+")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError("another convert-bnb batch is running with this --out-dir", path=work.parent,
                         action="write", hint="wait for it to finish, or use another --out-dir") from None
    return f


def _run_jobs(jobs: list[Job], out_dir: Path, work: Path, n_jobs: int, settings: dict[str, Any], workers: Workers,
              on_done: Callable[[JobResult], None] | None,
              on_progress: Callable[[BatchProgress], None] | None = None,
              progress_interval: float = 2.0) -> list[JobResult]:
    lock = threading.Lock()
    stopping = threading.Event()  # the batch is being interrupted: a worker's end is not its job's failure
    running: set[str] = set()
    finished = [0]

    def one(job: Job) -> JobResult:
        spec = {"job": job.to_dict(), **settings}
        spec_path = work / f"{job.name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
        progress_path(out_dir, job.name).unlink(missing_ok=True)
        log_path = work / f"{job.name}.log"
        log_path.write_bytes(b"")
        with lock:
            running.add(job.name)
        try:
            data, returncode = workers.run(spec_path, log_path)
        finally:
            with lock:
                running.discard(job.name)
        progress_path(out_dir, job.name).unlink(missing_ok=True)
        if stopping.is_set() and data.get("status") != "converted":
            data = {"status": "interrupted", "error": data.get("error") if data.get("status") == "interrupted"
                    else interrupted_message(out_dir, job.name)}
        elif returncode != 0 and data.get("status") not in ("failed", "interrupted"):
            data = {"status": "failed", "error": f"worker exited with code {returncode}"}
        if data.get("status") == "failed" and not data.get("rule") and log_path.stat().st_size:
            data["error"] = f"{data.get('error')}; see {log_path}"  # only a log with something in it
        keep = {k: v for k, v in data.items() if k in JobResult.__dataclass_fields__}
        keep.setdefault("name", job.name)
        keep.setdefault("src", job.src)
        keep.setdefault("output", str(out_dir / job.name))
        res = JobResult(**keep)
        with lock:
            finished[0] += 1
        if on_done is not None:
            on_done(res)
        return res

    def watch() -> None:
        while not done_watching.wait(progress_interval):
            with lock:
                names, n_finished = sorted(running), finished[0]
            if names and on_progress is not None:
                on_progress(BatchProgress(len(jobs), n_finished,
                                          {n: read_progress(progress_path(out_dir, n)) for n in names}))

    done_watching = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True) if on_progress is not None else None
    if watcher is not None:
        watcher.start()
    results: dict[str, JobResult] = {}
    pool = ThreadPoolExecutor(max_workers=n_jobs)
    futures: dict[Future[JobResult], Job] = {}
    try:
        futures.update({pool.submit(one, j): j for j in jobs})
        for fut in as_completed(futures):
            results[futures[fut].name] = fut.result()
    except BaseException:
        stopping.set()
        for f in futures:
            f.cancel()
        workers.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        done_watching.set()
    pool.shutdown(wait=True)
    return [results[j.name] for j in jobs]


def _worker_env() -> dict[str, str]:
    """The worker's environment: ours, with this package importable (the worker runs ``-c``)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the convert package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env

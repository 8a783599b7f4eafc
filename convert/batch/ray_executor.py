"""``convert-bnb batch --executor ray``: each job a Ray task on a cluster (``pip install 'convert-bnb[ray]'``).

The batch process (the Ray driver) does what it does with local workers (:func:`convert.batch.run.run_batch`:
checks, the out-dir lock, ``SPEC.json`` and the log per job, the results); only the place a job runs
changes. A job is one Ray task running :func:`run_task`, which runs :func:`convert.batch.worker.execute_job` on
the job's ``SPEC.json``, exactly as a local worker process does: the outputs, state files and results
are the same, and a batch started on one executor resumes on the other. Hence ``--out-dir`` must be a
path every node sees (a shared file system, mounted at the same path).

Each task asks Ray for ``num_cpus`` = the job's threads and ``memory`` = the job's ``--max-memory``
share plus :data:`WORKER_OVERHEAD`, in bytes (Ray places it on a node with both free). Ray reuses its
worker processes from task to task (starting one costs seconds); each task starts the process's peak
resident set again, so a job's ``peak_rss_bytes`` is its own (Linux). A task whose worker process or
node dies is run again, up to :data:`RETRIES` times: the commit protocol of :mod:`convert.output` makes
that safe (the output appears only complete; a directory output resumes from the shards its staging
ledger recorded; a stale single-file staging is removed before writing again). A job that fails on
its input (a named error) is a result, not retried. Interrupting the batch cancels the tasks
(``ray.cancel``: the job records itself as interrupted).

Every node must run the same convert-bnb version (a task on another version fails with USE-001), and
takes its environment (``HF_TOKEN``, ``HF_HOME``, offline mode) from where ``ray start`` ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from convert import BLAS_THREADS, __version__
from convert.batch.worker import execute_job, failed_result
from convert.stream.pipeline import reset_peak_rss
from convert.units import format_bytes
from formats.errors import UsageError

__all__ = ["RETRIES", "WORKER_OVERHEAD", "RayWorkers", "import_ray", "run_task"]

#: How many times Ray runs a job again after its worker process or node died (not after a failed job).
RETRIES = 3
#: Memory a Ray worker process holds beyond a local worker's (the Ray runtime; measured 65-110 MiB by
#: scripts/bench_ray.py), added to each task's ``memory`` request.
WORKER_OVERHEAD = 128 << 20
#: The command that installs the executor's dependency, as error messages name it.
INSTALL = "pip install 'convert-bnb[ray]'"


def task_options(spec: dict[str, Any]) -> dict[str, Any]:
    """Ray's options for a job's task: its threads as ``num_cpus``, its ``max_memory`` + :data:`WORKER_OVERHEAD`
    as ``memory``, and OpenBLAS's thread count in the worker's environment: this process's (one unless the
    user set it, :data:`convert.BLAS_THREADS`). A Ray worker would otherwise take ``OMP_NUM_THREADS``, which
    Ray sets to ``num_cpus``: BLAS threads on top of the job's, and LoRA products whose bits differ from a
    local run's."""
    name, default = BLAS_THREADS
    return {"num_cpus": spec["threads"], "memory": spec["max_memory"] + WORKER_OVERHEAD,
            "runtime_env": {"env_vars": {name: os.environ.get(name, default)}}}


def run_task(spec_path: str, log_path: str, version: str) -> tuple[dict[str, Any], int]:
    """The Ray task of one job: :func:`convert.batch.worker.execute_job` on ``SPEC.json``, its messages
    appended to the job's log (as a local worker's stderr is).

    Args:
        spec_path: the job's ``DIR/.convert-bnb/NAME.spec.json`` (absolute, on the shared file system).
        log_path: the job's ``DIR/.convert-bnb/NAME.log``.
        version: the batch process's convert-bnb version.

    Returns:
        the job's result and exit code, as :func:`convert.batch.worker.execute_job`; a failed result with
        USE-001 when this node runs another convert-bnb version (its outputs would carry another key).
    """
    reset_peak_rss()  # this worker process may have run other jobs before
    with open(log_path, "a", encoding="utf-8") as log, contextlib.redirect_stderr(log):
        if version != __version__:
            other = UsageError("this Ray node runs another convert-bnb version than the batch", expected=version,
                               found=__version__, hint="install the same convert-bnb on every node")
            return failed_result(other), 2
        spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
        return execute_job(spec)


#: Seconds to wait for a TCP answer from a HOST:PORT cluster address before ``ray.init`` (which retries
#: an address where nothing listens for minutes).
CONNECT_TIMEOUT = 5.0


def _check_reachable(address: str | None) -> None:
    """A ``HOST:PORT`` address (the GCS of ``ray start --head``) must accept a TCP connection.

    ``auto``, ``local``, ``ray://`` addresses and None are left to Ray.

    Raises:
        UsageError: nothing answers at ``HOST:PORT`` within :data:`CONNECT_TIMEOUT` seconds.
    """
    if not address or "://" in address or address in ("auto", "local"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError("--ray-address must be HOST:PORT, auto, or ray://HOST:PORT", found=address)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise UsageError("no Ray cluster answers at --ray-address", found=f"{address} ({exc.strerror or exc})",
                         hint="start one with `ray start --head`, or check the address") from None


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        UsageError: Ray is not installed (the message names ``pip install 'convert-bnb[ray]'``).
    """
    try:
        # (optional: the [ray] extra)
        import ray
    except ImportError:
        raise UsageError(f"--executor ray needs Ray: {INSTALL}", found="no module named 'ray'") from None
    return ray


class RayWorkers:
    """Jobs as Ray tasks (:class:`convert.batch.run.Workers`).

    Args:
        address: the cluster (``ray.init(address=...)``: ``auto``, ``HOST:PORT``, ``ray://HOST:PORT``), or
            None: ``RAY_ADDRESS``, else a cluster started on this machine, else a new local one (Ray's
            own rules). When Ray is already initialised in this process, that connection is used.

    Raises:
        UsageError: Ray is not installed, or no cluster answers at ``address``.
    """

    def __init__(self, address: str | None) -> None:
        ray = import_ray()
        self._ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            _check_reachable(address)
            try:
                ray.init(address=address, log_to_driver=False, logging_level="warning")
            except ConnectionError as exc:
                raise UsageError("no Ray cluster answers at --ray-address", found=address or "(default)",
                                 hint="start one with `ray start --head`, or check the address") from exc
            except ValueError as exc:  # e.g. a ray:// address without the Ray Client's packages
                raise UsageError(f"Ray cannot connect to --ray-address: {exc}", found=address,
                                 hint="a ray://HOST:PORT address needs pip install 'ray[client]'") from exc
        self._nodes: list[dict[str, float]] = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        self._task = ray.remote(max_retries=RETRIES, retry_exceptions=False)(run_task)
        self._refs: set[Any] = set()
        self._lock = threading.Lock()
        # Ray's driver prints the cluster's messages (a worker died, ...) on stdout: while the batch runs
        # they go to stderr, so that stdout holds only the batch's own output (--json)
        self._quiet_stdout = contextlib.redirect_stdout(sys.stderr)
        self._quiet_stdout.__enter__()

    def job_threads(self, threads: int | None, n_jobs: int, job_memory: int) -> int:
        """The cluster's CPUs (or ``threads``) split over ``n_jobs``; without ``threads``, at most the
        largest node's CPUs.

        Raises:
            UsageError: no node has the job's threads (CPUs) and ``job_memory`` + :data:`WORKER_OVERHEAD`
                bytes.
        """
        total = int(sum(n.get("CPU", 0) for n in self._nodes))
        per = max(1, (threads or total) // n_jobs)
        if threads is None:
            per = max(1, min(per, int(max((n.get("CPU", 0) for n in self._nodes), default=1))))
        memory = job_memory + WORKER_OVERHEAD
        if not any(n.get("CPU", 0) >= per and n.get("memory", 0) >= memory for n in self._nodes):
            nodes = [f"{int(n.get('CPU', 0))} CPUs, {format_bytes(int(n.get('memory', 0)))}" for n in self._nodes]
            raise UsageError("a job needs more than any node of the Ray cluster has",
                             expected=f"a node with {per} CPUs and {format_bytes(memory)} memory",
                             found=nodes[:8], hint="lower --threads or --max-memory, or raise --jobs")
        return per

    def run(self, spec_path: Path, log_path: Path) -> tuple[dict[str, Any], int]:
        """Submit the job's task (its spec's threads as ``num_cpus``, its ``max_memory`` +
        :data:`WORKER_OVERHEAD` as ``memory``) and wait for its result."""
        ray = self._ray
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        ref = self._task.options(**task_options(spec)).remote(
            str(spec_path.absolute()), str(log_path.absolute()), __version__)
        with self._lock:
            self._refs.add(ref)
        try:
            data, code = ray.get(ref)
            return data, code
        except ray.exceptions.TaskCancelledError:  # by stop(), or from outside the batch
            return {"status": "failed", "error": "the job's Ray task was cancelled"}, 130
        except ray.exceptions.RayError as exc:  # the worker or node died RETRIES + 1 times, or Ray failed
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            return {"status": "failed", "error": f"Ray task failed ({type(exc).__name__}, {RETRIES + 1} attempts "
                    f"at most): {first.strip()}"}, 1
        finally:
            with self._lock:
                self._refs.discard(ref)

    def stop(self) -> None:
        """``ray.cancel`` every task: a running job gets ``KeyboardInterrupt`` and records itself as
        interrupted; a waiting one never starts."""
        with self._lock:
            refs = list(self._refs)
        for ref in refs:
            self._ray.cancel(ref)

    def close(self) -> None:
        """Disconnect from Ray when this batch connected (a local cluster it started stops); stdout is
        the batch's again."""
        try:
            if self._owns:
                self._ray.shutdown()
        finally:
            self._quiet_stdout.__exit__(None, None, None)

"""``convert-bnb batch --executor ray`` on a real two-node Ray cluster on this machine: the same outputs,
state files and results as the local executor; a worker killed mid-job is retried; resume across
executors."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from convert.batch.jobs import parse_jobs
from convert.batch.run import run_batch
from convert.cli import main
from tests.helpers.batch import broken_model, kill_batch_at_pause
from tests.helpers.fixtures import HARNESS, MODELS, ROOT
from tests.helpers.hubcache import offline_env

ray = pytest.importorskip("ray")

#: Fields of a result that differ between two runs of the same job (time, memory, where).
VOLATILE = ("seconds", "peak_rss_bytes", "output")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, local_started: Future[Any]) -> Iterator[tuple[str, Path]]:
    """Two Ray nodes (1 CPU each) on this machine; their workers run the test harness: job ``killed``
    holds after its 2nd shard, once, writing its pid to the marker returned. (Started after the local
    reference run, which goes on meanwhile.)"""
    from ray.cluster_utils import Cluster

    marker = tmp_path_factory.mktemp("ray") / "killed.pid"
    path = os.pathsep.join(p for p in (str(HARNESS), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "CONVERT_BNB_TEST_PAUSE": f"killed:2:{marker}", "HF_HUB_OFFLINE": "1"}
    with mock.patch.dict(os.environ, env):  # the nodes' (and so their workers') environment
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
        c.add_node(num_cpus=1, object_store_memory=80 << 20)
    try:
        c.wait_for_nodes()
        yield c.address, marker
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded directory output, a sharded input to fp16, a one-file output, and a broken input."""
    d = tmp_path_factory.mktemp("jobs")
    broken = broken_model(d / "broken_src")
    path = d / "jobs.txt"
    path.write_text(f"{MODELS / 'llama_nf4_dq'} --max-shard-size 1MB --name a\n"
                    f"{MODELS / 'llama_nf4_dq_sharded'} --to fp16 --max-shard-size 1MB --name c\n"
                    f"{MODELS / 'llama_fp4_nodq' / 'model.safetensors'} --to fp32\n"
                    f"{broken} --name broken\n")
    return path


def batch(jobs: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    """``convert-bnb batch JOBS --out-dir OUT --json EXTRA`` in this process: exit code, results by name."""
    capsys.readouterr()
    code = main(["batch", str(jobs), "--out-dir", str(out), "--max-memory", "256MiB", "--jobs", "2", "--json",
                 *extra])
    return code, {r["name"]: r for r in json.loads(capsys.readouterr().out)}


def ray_args(cluster: tuple[str, Path]) -> tuple[str, ...]:
    return ("--executor", "ray", "--ray-address", cluster[0])


def digests(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out`` except the batch's own folder."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and ".convert-bnb" not in p.relative_to(out).parts}


def records(out: Path) -> dict[str, Any]:
    """The batch's own folder: every state, spec, manifest and log file (the spec without its out dir and
    parent pid; the lock file's name only)."""
    got: dict[str, Any] = {}
    for p in sorted((out / ".convert-bnb").iterdir()):
        if p.name.endswith(".json"):
            data = json.loads(p.read_text())
            if p.name.endswith(".spec.json"):
                assert data.pop("out_dir") == str(out)
                data.pop("parent_pid")
            got[p.name] = data
        else:
            got[p.name] = p.read_text() if p.name.endswith(".log") else None
    return got


def stable(results: dict[str, Any]) -> dict[str, Any]:
    """Results without what differs between two runs of the same jobs (time, memory, out dir)."""
    return {n: {k: v for k, v in r.items() if k not in VOLATILE} for n, r in results.items()}


@pytest.fixture(scope="module")
def local_started(jobs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[tuple[Path, Any]]]:
    """The jobs run by the local executor (the reference), started in a thread while the cluster starts."""
    out = tmp_path_factory.mktemp("local") / "out"
    defaults = argparse.Namespace(to="auto", max_shard_size=5 * 10**9)  # the CLI's

    def run() -> tuple[Path, dict[str, Any]]:
        results = run_batch(parse_jobs(jobs, defaults), out, n_jobs=2, max_memory=256 << 20)
        return out, {r.name: r.to_dict() for r in results}

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run)


@pytest.fixture(scope="module")
def local_run(local_started: Future[tuple[Path, Any]]) -> tuple[Path, dict[str, Any]]:
    """The local executor's out dir and results by name."""
    return local_started.result()


def test_ray_writes_what_local_writes(cluster: tuple[str, Path], jobs: Path, local_run: tuple[Path, dict[str, Any]],
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = local_run[0]
    out = tmp_path / "out"
    code, res = batch(jobs, out, capsys, *ray_args(cluster))
    assert code == 3
    assert {n: r["status"] for n, r in res.items()} == {
        "a": "converted", "c": "converted", "model-fp32.safetensors": "converted", "broken": "failed"}
    # the bad input is a named failure, in the results and the state file, not a lost worker
    assert (res["broken"]["rule"], res["broken"]["error_class"]) == ("BNB-009", "QuantStateJsonError")
    assert json.loads((out / ".convert-bnb" / "broken.json").read_text())["status"] == "failed"
    assert stable(res) == stable(local_run[1])
    assert digests(out) == digests(local) and len(digests(out)) > 10
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in local.iterdir())
    assert records(out) == records(local)
    # the local executor resumes what Ray finished: nothing to do but the broken job
    code, on_local = batch(jobs, out, capsys)
    assert code == 3
    assert {n: r["status"] for n, r in on_local.items()} == {
        "a": "skipped", "c": "skipped", "model-fp32.safetensors": "skipped", "broken": "failed"}
    assert {n: r["bytes_out"] for n, r in on_local.items()} == {n: r["bytes_out"] for n, r in res.items()}
    assert digests(out) == digests(local)


def test_killed_worker_is_retried(cluster: tuple[str, Path], local_run: tuple[Path, dict[str, Any]], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL of the worker process running job ``killed`` after its 2nd shard: Ray runs the task again,
    which keeps the 2 recorded shards and writes the rest; the output equals the local one."""
    local = local_run[0]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --max-shard-size 1MB --name killed\n")
    marker = cluster[1]
    killed: list[int] = []

    def kill() -> None:
        deadline = time.monotonic() + 120  # a guard against hanging, not a timing assertion
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.append(int(marker.read_text()))
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    code, res = batch(jobs, tmp_path / "out", capsys, *ray_args(cluster))
    killer.join(5)
    assert killed and code == 0, res
    r = res["killed"]
    assert (r["status"], r["shards_reused"], r["shards_written"]) == ("converted", 2, 3)
    assert digests(tmp_path / "out" / "killed") == digests(local / "a")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".convert-bnb", "killed"]  # no staging left


def test_local_interrupted_then_resumed_on_ray(cluster: tuple[str, Path], local_run: tuple[Path, dict[str, Any]],
                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local batch killed after 2 shards of job c; the Ray batch keeps them and finishes c."""
    local = local_run[0]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq_sharded'} --to fp16 --max-shard-size 1MB --name c\n")
    out = tmp_path / "out"
    kill_batch_at_pause(jobs, out, offline_env(tmp_path), "c", 2, tmp_path / "c.paused")
    assert json.loads((out / ".convert-bnb" / "c.json").read_text())["status"] == "interrupted"
    code, res = batch(jobs, out, capsys, *ray_args(cluster))
    assert code == 0
    assert (res["c"]["status"], res["c"]["shards_reused"]) == ("converted", 2)
    assert digests(out) == {k: v for k, v in digests(local).items() if k.startswith("c/")}


def test_usage_errors(cluster: tuple[str, Path], tmp_path: Path, jobs: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    # 2 threads per job: no node has 2 CPUs (Ray would wait for one forever)
    assert main(["batch", str(jobs), "--out-dir", out, "--threads", "2", *ray_args(cluster)]) == 2
    assert "USE-001 a job needs more than any node of the Ray cluster has" in capsys.readouterr().err
    assert main(["batch", str(jobs), "--out-dir", out, "--ray-address", "auto"]) == 2
    assert "--ray-address needs --executor ray" in capsys.readouterr().err
    with mock.patch.dict("sys.modules", {"ray": None}):  # as if Ray were not installed
        assert main(["batch", str(jobs), "--out-dir", out, "--executor", "ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'convert-bnb[ray]'" in err[0], err
    assert not Path(out).exists()


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "USE-001 no Ray cluster answers at --ray-address (found '127.0.0.1:1"),  # nothing listens
    ("no-port", "USE-001 --ray-address must be HOST:PORT, auto, or ray://HOST:PORT"),
])
def test_an_address_without_a_cluster_is_a_usage_error_at_once(tmp_path: Path, jobs: Path, address: str,
                                                                message: str) -> None:
    """In a fresh process (this one may hold the test cluster's connection): Ray itself would retry an
    address where nothing listens for minutes."""
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "convert", "batch", str(jobs), "--out-dir", str(out), "--executor",
                           "ray", "--ray-address", address], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], proc.stderr
    assert not out.exists()


def test_a_node_on_another_version_fails_the_job(tmp_path: Path) -> None:
    """The task checks the batch's convert-bnb version before anything is written (its key would differ)."""
    from convert.batch.ray_executor import run_task

    spec, log = tmp_path / "j.spec.json", tmp_path / "j.log"
    data, code = run_task(str(spec), str(log), "0.0.0-elsewhere")
    assert (code, data["status"], data["rule"]) == (2, "failed", "USE-001")
    assert "another convert-bnb version" in data["error"] and not spec.exists()


def test_a_task_runs_with_one_blas_thread(cluster: tuple[str, Path], tmp_path: Path) -> None:
    """A job's Ray task gets OpenBLAS's thread count of this process (one unless set), not Ray's
    OMP_NUM_THREADS (= the task's CPUs), which OpenBLAS would take: BLAS threads on top of the job's, and
    merge products whose bits differ from a local run's."""
    from convert.batch.ray_executor import RayWorkers, task_options

    workers = RayWorkers(cluster[0])  # (connects this process, as a batch does)
    try:
        def env() -> tuple[str | None, str | None]:
            return os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS")

        options = task_options({"threads": 1, "max_memory": 64 << 20})
        with mock.patch.dict(os.environ, {"OPENBLAS_NUM_THREADS": "1"}):
            assert ray.get(ray.remote(env).options(**options).remote(), timeout=120)[0] == "1"
        with mock.patch.dict(os.environ, {"OPENBLAS_NUM_THREADS": "3"}):  # the user's choice goes along
            assert ray.get(ray.remote(env).options(**task_options({"threads": 1, "max_memory": 64 << 20}))
                           .remote(), timeout=120)[0] == "3"
    finally:
        workers.close()

#!/usr/bin/env python3
"""Benchmark: the same batch of N jobs on the local executor and on a two-node Ray cluster on this machine.

    python scripts/bench_ray.py [--n 8] [--model tests/fixtures/models/llama_nf4_dq] [--to bf16]
    python scripts/bench.py make --packed-gb 0.1 --dir bench-data/100m      # a bigger model, then:
    python scripts/bench_ray.py --n 4 --model bench-data/100m

Each job converts MODEL (under its own name). The local batch runs ``--jobs 2`` worker processes; the
Ray batch runs ``--executor ray --jobs 2`` against a ``ray.cluster_utils.Cluster`` of two nodes with
one CPU each (both on this machine: what it measures is the executor's overhead, not more cores).
Both run as ``convert-bnb batch`` subprocesses, so the Ray time includes connecting to the cluster
(starting the cluster is not timed). Checks that both wrote the same bytes, then prints one JSON
line: wall seconds of each, their ratio, and the median job seconds and peak RSS of each, for
docs/many-machines.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def batch(jobs: Path, out: Path, *extra: str) -> tuple[float, list[dict[str, object]]]:
    """``convert-bnb batch`` in a subprocess: wall seconds and the results (--json)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "convert", "batch", str(jobs), "--out-dir", str(out), "--jobs", "2",
                        "--max-memory", "1GiB", "--json", *extra], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"batch failed ({r.returncode}): {r.stderr}")
    return seconds, json.loads(r.stdout)


def digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and ".convert-bnb" not in p.parts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8, help="jobs in the batch (default: 8)")
    p.add_argument("--model", type=Path, default=ROOT / "tests/fixtures/models/llama_nf4_dq")
    p.add_argument("--to", default="bf16")
    args = p.parse_args()

    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        d = Path(tmp)
        jobs = d / "jobs.txt"
        jobs.write_text("".join(f"{args.model.resolve()} --to {args.to} --name job{i}\n" for i in range(args.n)))
        local_s, local = batch(jobs, d / "local")
        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the nodes' workers import this checkout
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
        cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        try:
            cluster.wait_for_nodes()
            ray_s, on_ray = batch(jobs, d / "ray", "--executor", "ray", "--ray-address", cluster.address)
        finally:
            cluster.shutdown()
        assert digests(d / "ray") == digests(d / "local"), "the executors wrote different bytes"

        def median(results: list[dict[str, object]], key: str) -> float:
            return statistics.median(float(r[key]) for r in results)  # type: ignore[arg-type]

        print(json.dumps({
            "jobs": args.n, "model": str(args.model), "to": args.to, "cpus": os.cpu_count(),
            "local_s": round(local_s, 2), "ray_s": round(ray_s, 2), "ray_over_local": round(ray_s / local_s, 2),
            "job_s_median": {"local": round(median(local, "seconds"), 2), "ray": round(median(on_ray, "seconds"), 2)},
            "peak_rss_mib_median": {"local": round(median(local, "peak_rss_bytes") / 2**20),
                                    "ray": round(median(on_ray, "peak_rss_bytes") / 2**20)},
            "output_mib_per_job": round(float(local[0]["bytes_out"]) / 2**20, 1),  # type: ignore[arg-type]
        }))


if __name__ == "__main__":
    main()

"""``convert-bnb batch``'s command line: its arguments, the run (or ``--dry-run`` plan) and the summary
table printed at the end. The batch itself, its rules and its files are :mod:`convert.batch.run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from convert.batch.card import plan_batch
from convert.batch.jobs import parse_jobs
from convert.batch.run import EXECUTORS, EXIT_JOBS_FAILED, BatchProgress, check_batch, check_executor, run_batch
from convert.batch.worker import JobResult
from convert.hub.repo import check_owner, check_repo_id, output_repo_id
from convert.options import target_arg
from convert.units import format_bytes, parse_size
from formats.errors import UsageError

__all__ = ["DESCRIPTION", "INTERRUPTED_TAIL", "add_arguments", "run_command", "summary_table"]

#: What an interrupted batch leaves, as the command line says it.
INTERRUPTED_TAIL = ("finished jobs are kept, and so are the finished shards of unfinished directory outputs "
                    "(OUT/.NAME.convert-bnb-partial); run the same command again to resume")


def summary_table(results: list[JobResult]) -> str:
    """The table printed at the end of a batch: one row per job, then the totals."""
    head = ("job", "status", "shards new/kept", "output", "time", "detail")
    rows = []
    for r in results:
        detail = r.error or (f"pushed to {r.pushed}" if r.pushed else "")
        if r.commit and not r.error:
            detail = (f"@{r.commit[:10]} " + detail).strip()
        rows.append((r.name, r.status, f"{r.shards_written}/{r.shards_reused}",
                     format_bytes(r.bytes_out) if r.bytes_out else "-", f"{r.seconds:.1f}s", detail))
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head) - 1)]
    lines = []
    for row in [head, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" of {len(results)} jobs")
    return "\n".join(line.rstrip() for line in lines)


DESCRIPTION = ("Convert many checkpoints (Hub repos or paths) listed in JOBS into --out-dir: parallel worker processes "
               "within one memory budget, resumable per shard, failures isolated, a summary table at the end "
               f"(exit {EXIT_JOBS_FAILED} if any job failed); optional --push-to-hub.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``convert-bnb batch``."""

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = """\
examples:
  convert-bnb batch jobs.txt --out-dir out/ --to bf16 --jobs 2 --max-memory 4GiB
  convert-bnb batch jobs.txt --out-dir out/ --push-to-hub my-org --dry-run   card + upload plan, no work
  convert-bnb batch jobs.txt --out-dir /shared/out --executor ray --ray-address auto   on a Ray cluster

jobs.txt:
  # one job per line; options override the command line's
  unsloth/llama-3-8b-bnb-4bit
  unsloth/mistral-7b-bnb-4bit@main --to fp16 --max-shard-size 2GB
  ./local-model-bnb-4bit --name local-bf16
  unsloth/gemma-3-4b-it-bnb-4bit --to gguf:q4_k_m --mmproj     also its vision projector, mmproj-NAME
  unsloth/Qwen3-8B-bnb-4bit --to gguf:q8_0 --modelfile          also an Ollama Modelfile beside it

Re-running the same command skips finished jobs and finished shards (state in OUT/.convert-bnb/).
"""
    p.add_argument("jobs_file", metavar="JOBS",
                   help="text file (one 'SRC[@REVISION] [--to T] [--max-shard-size S] [--name N] [--mmproj [MMNAME]] "
                   "[--modelfile [MFNAME]]' per line, # comments) or a JSON/YAML list")
    p.add_argument("--out-dir", type=Path, required=True, help="where the outputs and the state files go")
    p.add_argument("--jobs", type=int, default=1, help="conversions running at a time (default: 1)")
    p.add_argument("--to", default="auto", metavar="TARGET", type=target_arg,
                   help="default target of the jobs (default: auto)")
    p.add_argument("--max-memory", type=parse_size, default=parse_size("1GiB"),
                   help="memory budget of the whole batch, split over --jobs (default: 1GiB)")
    p.add_argument("--threads", type=int, default=None, help="threads of the whole batch (default: all cores)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="default largest output shard (default: 5GB)")
    p.add_argument("--push-to-hub", metavar="ORG", default=None,
                   help="create ORG/NAME repos and upload each output with a model card (a job of several --to "
                   "targets: each output of its folder to ORG/<its name>)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create private repos")
    p.add_argument("--dry-run", action="store_true",
                   help="convert nothing: print each job's plan (and with --push-to-hub the card and upload plan); "
                   "a job a run would fail (its input as `check --to TARGET` finds it, or BATCH-005/006 on its "
                   f"output) is planned 'fail' with the rule, and the exit code is {EXIT_JOBS_FAILED}")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip re-reading written shards")
    p.add_argument("--overwrite", action="store_true",
                   help="redo jobs whose output was made with other settings (files the batch did not write are "
                   "never removed)")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="where jobs run: worker processes on this machine (local, the default), or Ray tasks on a "
                   "cluster (ray; needs pip install 'convert-bnb[ray]' and an --out-dir every node sees)")
    p.add_argument("--ray-address", metavar="ADDR", default=None,
                   help="with --executor ray: the cluster (ray.init address, e.g. auto or HOST:6379; default: "
                   "RAY_ADDRESS, a cluster started on this machine, or a new local one)")


def _print_plan(plan: list[dict[str, Any]]) -> None:
    """Print a ``--dry-run`` plan (:func:`convert.batch.card.plan_batch`): a line per job with its action (a
    failing job's error names its rule), then any further problem of its input, its upload plan and card (a job
    of several targets: each output's)."""
    for e in plan:
        print(f"{e['name']}: {e['src']}" + (f"@{e['commit']}" if e.get("commit") else "")
              + f" --to {e['to']}" + "".join(f" {o}" for o in e.get("options", [])) + f" -> {e['output']}"
              + (f" + {e['mmproj']}" if "mmproj" in e else "")
              + (f" + {e['modelfile']}" if "modelfile" in e else "")
              + f": {e['action']}"
              + (f" ({e['error']})" if "error" in e else ""))
        for line in e.get("problems", [])[1:]:
            print(f"  also: {line}")
        if "upload" in e:
            _print_push(e["upload"], e["card"], "  ")
        for o in e.get("outputs", []):  # a job of several targets: each output to a repo of its own
            print(f"  output {o['name']} (--to {o['to']}):")
            _print_push(o["upload"], o["card"], "    ")
        if "push" in e:
            print(f"  push: {e['push']}")


def _print_push(up: dict[str, Any], card: str, indent: str) -> None:
    """Print an upload plan and its card, indented by ``indent``."""
    how = "one commit" if up["method"] == "commit" else "the resumable folder upload, message"
    print(f"{indent}upload: create {up['create_repo']['repo_id']} (private={up['create_repo']['private']}, "
          f"exist_ok), {how} '{up['commit']['commit_message']}':")
    for op in up["commit"]["operations"]:
        size = f"{op['bytes']:>14,d} B" if op["bytes"] is not None else "(after conversion)"
        print(f"{indent}  {op['path_in_repo']:<40} {size:>16}  <- {op['from']}")
    print(f"{indent}model card:")
    print(f"{indent}  " + card.replace("\n", f"\n{indent}  ").rstrip())


def run_command(args: argparse.Namespace) -> int:
    """``convert-bnb batch``: run (or ``--dry-run``: plan) the jobs; exit 3 if any failed (or, planned, would
    fail)."""
    check_executor(args.executor, args.ray_address)
    jobs = parse_jobs(args.jobs_file, args)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1", found=args.threads)
    if args.push_to_hub is not None:  # (the owner, then each job's repo: what the Hub would refuse after the work)
        check_owner(args.push_to_hub)
        for job in jobs:
            if job.to.family != "multi":
                repo = output_repo_id(args.push_to_hub, job.name)
                check_repo_id(repo, repo, f"ORG/<the job's name> (job {job.where})")
    out_dir: Path = args.out_dir
    if args.dry_run:
        check_batch(jobs, out_dir, args.jobs, args.max_memory)
        plan = plan_batch(jobs, out_dir, args.push_to_hub, args.private, overwrite=args.overwrite)
        failing = [e for e in plan if e["action"] == "fail"]
        if args.json:
            print(json.dumps(plan, indent=2))
        elif args.quiet:  # only what would fail, one line each, as -q prints a run's failed jobs
            for e in failing:
                print(f"convert-bnb batch: job {e['name']} would fail: {e['error']}", file=sys.stderr)
        else:
            _print_plan(plan)
        return EXIT_JOBS_FAILED if failing else 0
    show = not args.quiet and not args.json
    finished = [0]

    def job_done(r: JobResult) -> None:
        finished[0] += 1
        if show:
            print(f"[{r.status}] {r.name}" + (f": {r.error}" if r.error else "")
                  + f" ({finished[0]} of {len(jobs)} jobs done)", file=sys.stderr, flush=True)
            for n in r.notes:  # what a single conversion prints under its summary
                print(f"  note: {n}", file=sys.stderr, flush=True)

    def progress(p: BatchProgress) -> None:
        print(p.line(), file=sys.stderr, flush=True)

    results = run_batch(jobs, out_dir, n_jobs=args.jobs, max_memory=args.max_memory, threads=args.threads,
                        verify=args.verify, overwrite=args.overwrite, push_to_hub=args.push_to_hub,
                        private=args.private, on_done=job_done, on_progress=progress if show else None,
                        progress_interval=2.0 if sys.stderr.isatty() else 10.0, executor=args.executor,
                        ray_address=args.ray_address)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    elif not args.quiet:
        print(summary_table(results))
    else:  # -q: still one line per failed job, with its rule, as `check -q` prints problems
        for r in results:
            if r.status in FAILED:
                print(f"convert-bnb batch: job {r.name} {r.status}: {r.error}", file=sys.stderr)
    return EXIT_JOBS_FAILED if any(r.status in FAILED for r in results) else 0


#: The job statuses that make the batch exit with EXIT_JOBS_FAILED.
FAILED = ("failed", "upload-failed")

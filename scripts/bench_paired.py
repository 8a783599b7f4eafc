#!/usr/bin/env python3
"""Paired timings of two commands: A, B, A, B, ... with the ratio A/B taken pair by pair, so that a
comparison holds while a shared machine's speed drifts (the figures of docs/performance.md marked
"paired").

    python scripts/bench_paired.py -n 3 --clean /tmp/o --warm bench-data/b08 \\
        --a "python -m convert bench-data/b08 --to fp16 -o /tmp/o --max-memory 512MiB" \\
        --b "python -m convert bench-data/b08 --to bf16 -o /tmp/o --max-memory 512MiB"

Each run is measured as a whole process by ``bench_suite.measured`` (wall seconds; CPU seconds, user +
system of it and its children, from ``wait4``; its own peak RSS). ``--clean`` paths are removed after
every run and ``--warm`` paths read into the page cache before it, neither inside the timing. Commands
run in the project's root (``python -m convert`` is this checkout; ``sh -c 'cd OTHER && ...'`` times
another). One
uncounted warm-up pair first (``--warmup``). Prints, for A, B and A/B: the median, minimum and maximum of
wall, CPU and peak RSS; ``--json`` adds one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import compile_project, warm  # noqa: E402
from bench_suite import measured  # noqa: E402

FIGURES = ("wall_s", "cpu_s", "peak_rss_mib")


def run_pairs(a: list[str], b: list[str], n: int, warmup: int, clean: list[Path], warm_paths: list[Path],
              log: bool) -> list[tuple[dict[str, float], dict[str, float]]]:
    """``warmup`` uncounted pairs, then ``n`` counted ones; each run's :func:`bench_suite.measured` figures."""
    pairs = []
    for i in range(warmup + n):
        pair = []
        for label, cmd in (("A", a), ("B", b)):
            for p in warm_paths:
                warm(p)
            fig = measured(cmd)
            for p in clean:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            if log:
                print(json.dumps({"run": label, "pair": i - warmup, **fig}), flush=True)
            pair.append(fig)
        if i >= warmup:
            pairs.append((pair[0], pair[1]))
    return pairs


def summary(pairs: list[tuple[dict[str, float], dict[str, float]]]) -> str:
    """A Markdown table: median (min-max) of A, B and the pair ratios A/B for each figure."""
    def cell(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    lines = ["| figure | A | B | A/B |", "|---|---|---|---|"]
    for f in FIGURES:
        va, vb = [p[0][f] for p in pairs], [p[1][f] for p in pairs]
        ratios = [x / y for x, y in zip(va, vb, strict=True) if y]
        lines.append(f"| {f} | {cell(va, 2)} | {cell(vb, 2)} | {cell(ratios, 3) if ratios else '-'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="command A, one string split as a shell splits words")
    ap.add_argument("--b", required=True, help="command B (the baseline of the ratio)")
    ap.add_argument("-n", type=int, default=3, help="counted pairs (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted pairs first (default 1)")
    ap.add_argument("--clean", type=Path, action="append", default=[], help="removed after every run")
    ap.add_argument("--warm", type=Path, action="append", default=[], help="read before every run")
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    args = ap.parse_args()
    compile_project()
    pairs = run_pairs(shlex.split(args.a), shlex.split(args.b), args.n, args.warmup, args.clean, args.warm,
                      args.json)
    print(summary(pairs))


if __name__ == "__main__":
    main()

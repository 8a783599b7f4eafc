#!/usr/bin/env python3
"""Every output path side by side with its floor, at several memory caps: JSON lines, a Markdown table
for docs/performance.md and (with matplotlib, ``pip install -e '.[bench]'``) a PNG plot.

    python scripts/bench.py make --packed-gb 0.2 --dir bench-data/b02                 # one 7B-shaped block
    python scripts/bench.py make-lora --model bench-data/b02 --dir bench-data/b02-r16 --rank 16
    python scripts/bench_suite.py --dir bench-data/b02 --lora bench-data/b02-r16 --plot docs/performance-paths.png

For each cap of ``--caps`` (default 128MiB, 512MiB, 1GiB), in one round: ``cp`` + ``sync`` of the bf16
output (the disk's floor), then one ``convert-bnb`` run per path in a subprocess: ``--to bf16``, ``fp16``,
``gguf:f16``, ``gguf:q8_0``, ``gguf:q4_k_m``, bf16 with ``--merge-lora`` (when ``--lora`` is given) and
``--to nf4`` from the bf16 output. Before each run its input is read once (``bench.warm``), so every path,
the bf16 baseline included, starts with its input in the page cache (the writer drops the pages of
what it writes, and other work evicts the rest: a cold baseline made every ratio look better). Each run:
wall seconds, CPU seconds (user + system of the process and
its children, from ``wait4``) and peak RSS (the largest of the process and its children). Ratios are
against the bf16 run and the ``cp`` floor of the same round and cap; the 2-core machine this runs on is
often shared, so the CPU seconds are printed beside the wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench import compile_project, cp_floor, run_measured, warm  # noqa: E402

#: (label, convert-bnb arguments after SRC; "{bf16}" is the bf16 output of the same round).
PATHS: list[tuple[str, list[str]]] = [
    ("bf16", ["--to", "bf16"]),
    ("fp16", ["--to", "fp16"]),
    ("gguf:f16", ["--to", "gguf:f16"]),
    ("gguf:q8_0", ["--to", "gguf:q8_0"]),
    ("gguf:q4_k_m", ["--to", "gguf:q4_k_m"]),
    ("bf16 + merge-lora", ["--to", "bf16", "--merge-lora", "{lora}"]),
    ("bf16 -> nf4", ["--to", "nf4"]),  # from the bf16 output
]


def measured(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; its wall seconds, CPU seconds (user + system of it and its children) and peak RSS in MiB
    (the largest of it and its children), its own figures (``bench.run_measured``: not this process's
    peak, which Linux would otherwise carry into the child's)."""
    t = time.perf_counter()
    code, _out, err, rss, cpu = run_measured(cmd, cwd=ROOT)
    wall = time.perf_counter() - t
    if code != 0:
        print(err[-2000:], file=sys.stderr)
        raise SystemExit(1)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mib": round(rss / (1 << 20), 1)}


def run_round(src: Path, lora: Path | None, cap: str, threads: int, work: Path,
              labels: set[str]) -> list[dict[str, object]]:
    """Every path of ``labels`` (and bf16) once at ``cap``; the bf16 output is kept for the floor and the
    nf4 input."""
    rows: list[dict[str, object]] = []
    bf16_out = work / "bf16"
    for label, args in PATHS:
        if ("{lora}" in args and lora is None) or (label != "bf16" and label not in labels):
            continue
        out = work / label.replace(" ", "").replace(":", "-").replace(">", "")
        source = bf16_out if label.endswith("nf4") else src
        argv = [a.replace("{lora}", str(lora)) for a in args]
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        subprocess.run(["sync"], check=True)
        warm(source)
        if lora is not None and "{lora}" in args:
            warm(lora)
        res = measured([sys.executable, "-m", "convert", str(source), *argv, "-o", str(out), "--max-memory", cap,
                        "--threads", str(threads), "--quiet"])
        rows.append({"path": label, "cap": cap, **res})
        if label == "bf16":
            rows[-1]["cp_sync_s"] = cp_floor(out, work / "cp-floor.tmp")
        elif out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
    base = next(r for r in rows if r["path"] == "bf16")
    for r in rows:
        r["wall_vs_bf16"] = round(float(r["wall_s"]) / float(base["wall_s"]), 2)  # type: ignore[arg-type]
        r["cpu_vs_bf16"] = round(float(r["cpu_s"]) / float(base["cpu_s"]), 2)  # type: ignore[arg-type]
    base["bf16_vs_cp"] = round(float(base["wall_s"]) / float(base["cp_sync_s"]), 2)  # type: ignore[arg-type]
    shutil.rmtree(bf16_out)
    return rows


def table(rows: list[dict[str, object]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| path | cap | wall s | CPU s | peak RSS MiB | wall / bf16 | CPU / bf16 | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f"cp + sync {r['cp_sync_s']} s, bf16 / cp {r['bf16_vs_cp']}" if "cp_sync_s" in r else ""
        lines.append(f"| {r['path']} | {r['cap']} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_mib']} | "
                     f"{r['wall_vs_bf16']} | {r['cpu_vs_bf16']} | {note} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """Wall seconds and peak RSS per path and cap, side by side (matplotlib: the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    caps = list(dict.fromkeys(str(r["cap"]) for r in rows))
    paths = list(dict.fromkeys(str(r["path"]) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(caps)
    for i, cap in enumerate(caps):
        by = {str(r["path"]): r for r in rows if r["cap"] == cap}
        xs = [k + i * width for k in range(len(paths))]
        axes[0].bar(xs, [float(by[p]["wall_s"]) if p in by else 0 for p in paths], width,  # type: ignore[arg-type]
                    label=f"--max-memory {cap}")
        axes[1].bar(xs, [float(by[p]["peak_rss_mib"]) if p in by else 0 for p in paths], width,  # type: ignore[arg-type]
                    label=f"--max-memory {cap}")
        axes[1].axhline(_mib(cap) + 100, color=f"C{i}", linestyle=":", linewidth=1)
        floor = next((r for r in rows if r["cap"] == cap and "cp_sync_s" in r), None)
        if floor is not None:
            axes[0].axhline(float(floor["cp_sync_s"]), color=f"C{i}", linestyle=":", linewidth=1)  # type: ignore[arg-type]
    for ax, title in zip(axes, ("wall seconds (dotted: cp + sync of the bf16 output)",
                                "peak RSS, MiB (dotted: cap + 100 MiB)"), strict=True):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(paths))], paths, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)


def _mib(cap: str) -> float:
    units = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}
    for u, f in units.items():
        if cap.endswith(u):
            return float(cap[: -len(u)]) * f
    return float(cap) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="a bnb model from `scripts/bench.py make`")
    ap.add_argument("--lora", type=Path, help="an adapter from `scripts/bench.py make-lora` (rank 16)")
    ap.add_argument("--caps", default="128MiB,512MiB,1GiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default=",".join(label for label, _ in PATHS),
                    help="comma-separated labels of the paths to run (bf16 always runs: it is the baseline)")
    ap.add_argument("--plot", type=Path, help="write a PNG of wall time and peak RSS per path")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON lines to this file")
    a = ap.parse_args()
    compile_project()
    work = a.dir.parent / f"{a.dir.name}-suite"
    work.mkdir(exist_ok=True)
    rows: list[dict[str, object]] = []
    for cap in a.caps.split(","):
        for r in run_round(a.dir.resolve(), a.lora.resolve() if a.lora else None, cap, a.threads, work,
                           set(a.paths.split(","))):
            print(json.dumps(r), flush=True)
            rows.append(r)
    shutil.rmtree(work)
    if a.json:
        a.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

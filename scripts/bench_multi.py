#!/usr/bin/env python3
"""Benchmark: several targets in one run (``--to bf16,gguf:q8_0,nf4``) against the same targets as separate runs,
and against the usual route (transformers + llama.cpp) for bf16, Q4_K_M and Q8_0 (docs/performance.md, issue 41).

The model is ``scripts/bench.py make``'s (7B-shaped layers: 4096x4096 q/k/v/o, 11008x4096 gate/up, 4096x11008 down,
NF4 with double quantization). Each command below is one process, to be timed whole and paired
(``scripts/bench_paired.py``: A, B, A, B, ... and the ratio pair by pair):

    python scripts/bench.py make --packed-gb 0.3 --dir bench-data/b3
    # A: one run of three targets; B: the three as separate runs (this script, one process running them in turn)
    python scripts/bench_paired.py -n 3 --warm bench-data/b3 --clean /tmp/set --clean /tmp/sep \\
        --a "python -m convert bench-data/b3 --to bf16,gguf:q8_0,nf4 -o /tmp/set --max-memory 1GiB --threads 2 -q" \\
        --b "python scripts/bench_multi.py separate --src bench-data/b3 --to bf16,gguf:q8_0,nf4 -o /tmp/sep \\
             --max-memory 1GiB --threads 2"
    # B: the usual route to bf16 + Q4_K_M + Q8_0 (transformers' dequantize + save_pretrained, llama.cpp's
    # convert_hf_to_gguf.py to BF16, llama-quantize twice); A: the same three outputs in one run
    python scripts/bench_paired.py -n 2 --warm bench-data/b3 --clean /tmp/set --clean /tmp/usual \\
        --a "python -m convert bench-data/b3 --to bf16,gguf:q4_k_m,gguf:q8_0 -o /tmp/set --max-memory 1GiB \\
             --threads 2 -q" \\
        --b "python scripts/bench_multi.py usual --src bench-data/b3 -o /tmp/usual --threads 2"
    # every output of one run byte for byte its separate run's
    python scripts/bench_multi.py check --src bench-data/b3 --to bf16,gguf:q8_0,nf4 --work /tmp/check

``separate`` runs ``python -m convert SRC --to T`` for each target in turn, each into ``-o``'s folder under its
default name (a model directory's: the one run's too); its peak RSS (the largest of its children's) is the
largest single run's. ``usual`` needs torch, transformers and bitsandbytes, llama.cpp's source (``--llama-src`` or
``LLAMA_CPP_SRC``: its convert_hf_to_gguf.py with its own gguf-py) and ``llama-quantize`` (``--llama-bin`` or
``LLAMA_CPP_BIN``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: transformers' route to a bf16 model: load the bnb checkpoint on the CPU, dequantize, save.
_HF = """
import sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cpu")
model.dequantize().save_pretrained(sys.argv[2])
"""


def _convert(src: Path, to: str, out: Path | str, extra: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "convert", str(src), "--to", to, "-o", str(out), "-q", *extra],
                   cwd=ROOT, check=True)


def separate(src: Path, to: str, out: Path, extra: list[str]) -> None:
    """Each target of ``to`` converted by a run of its own, in turn, into ``out`` under its default name (what the
    one run names it too: ``SRC-bf16``, a GGUF by llama.cpp's convention through ``-o DIR/``)."""
    out.mkdir(parents=True, exist_ok=True)
    for target in to.split(","):
        _convert(src, target, f"{out}/" if target.startswith("gguf") else out / f"{src.name}-{target}", extra)


def usual(src: Path, out: Path, threads: int, llama_src: Path, llama_bin: Path) -> None:
    """bf16, Q4_K_M and Q8_0 as people make them today: transformers dequantizes and saves the bf16 model,
    convert_hf_to_gguf.py writes a BF16 GGUF of it, llama-quantize makes Q4_K_M and Q8_0 of that (the BF16 GGUF
    removed: a means, not an output)."""
    out.mkdir(parents=True, exist_ok=True)
    bf16 = out / "bf16"
    subprocess.run([sys.executable, "-c", _HF, str(src), str(bf16), str(threads)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for f in src.iterdir():  # the tokenizer and small files save_pretrained does not write
        if f.is_file() and not f.name.endswith(".safetensors") and not (bf16 / f.name).exists():
            shutil.copy(f, bf16 / f.name)
    whole = out / "model-BF16.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_src / "gguf-py")}
    subprocess.run([sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(bf16), "--outtype", "bf16",
                    "--outfile", str(whole)], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    for kind in ("Q4_K_M", "Q8_0"):
        subprocess.run([str(llama_bin / "llama-quantize"), str(whole), str(out / f"model-{kind}.gguf"), kind,
                        str(threads)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    whole.unlink()


def _tree(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def check(src: Path, to: str, work: Path, extra: list[str]) -> None:
    """One run of ``to`` and its separate runs: every output the same bytes (one JSON line per output)."""
    if work.exists():
        shutil.rmtree(work)
    _convert(src, to, work / "set", extra)
    separate(src, to, work / "sep", extra)
    names = sorted(p.name for p in (work / "set").iterdir())
    if names != sorted(p.name for p in (work / "sep").iterdir()):
        raise SystemExit(f"other outputs: {names}")
    for name in names:
        same = _tree(work / "set" / name) == _tree(work / "sep" / name)
        print(json.dumps({"output": name, "identical": same}))
        if not same:
            raise SystemExit(1)
    shutil.rmtree(work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("separate", "check"):
        p = sub.add_parser(name)
        p.add_argument("--src", type=Path, required=True)
        p.add_argument("--to", required=True, help="the targets, comma-separated")
        if name == "separate":
            p.add_argument("-o", type=Path, required=True, help="the folder of the outputs")
        else:
            p.add_argument("--work", type=Path, required=True, help="a scratch folder (removed)")
        p.add_argument("--max-memory", default="1GiB")
        p.add_argument("--threads", type=int, default=2)
    p = sub.add_parser("usual")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("-o", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-src", type=Path, default=os.environ.get("LLAMA_CPP_SRC"),
                   help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)")
    p.add_argument("--llama-bin", type=Path, default=os.environ.get("LLAMA_CPP_BIN"),
                   help="the folder of llama-quantize")
    args = ap.parse_args()
    if args.cmd == "usual":
        if args.llama_src is None or args.llama_bin is None:
            ap.error("usual needs --llama-src and --llama-bin (or LLAMA_CPP_SRC and LLAMA_CPP_BIN)")
        usual(args.src, args.o, args.threads, args.llama_src, args.llama_bin)
        return
    extra = ["--max-memory", args.max_memory, "--threads", str(args.threads)]
    if args.cmd == "separate":
        separate(args.src, args.to, args.o, extra)
    else:
        check(args.src, args.to, args.work, extra)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Benchmark ``--to nf4``: synthesize a bf16 model of 7B-shaped blocks and quantize it under a memory cap.

    python scripts/bench_quantize.py make --layers 2 --dir bench-data/bf16-2l
    python scripts/bench_quantize.py run --dir bench-data/bf16-2l --max-memory 256MiB [--threads 2]

``make`` writes ``model.safetensors`` (embeddings, norms, q/k/v/o 4096x4096, gate/up 11008x4096,
down 4096x11008 per layer, N(0, 0.02) in bf16) and a Llama ``config.json``. ``run`` converts it in a
subprocess (so the peak RSS is the conversion's own) and prints one JSON line: seconds, weights
quantized per second, peak RSS, output size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import SHAPES  # noqa: E402  (the same 7B-shaped layers as scripts/bench.py)

from formats.dtypes import BY_CODE  # noqa: E402
from formats.safetensors import SafetensorsWriter  # noqa: E402

VOCAB = 32000


def make(layers: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bf16 = BY_CODE["BF16"]
    entries: list[tuple[str, object, tuple[int, ...]]] = [("model.embed_tokens.weight", bf16, (VOCAB, 4096))]
    for i in range(layers):
        for mod, shape in SHAPES.items():
            entries.append((f"model.layers.{i}.{mod}.weight", bf16, shape))
        entries.append((f"model.layers.{i}.input_layernorm.weight", bf16, (4096,)))
        entries.append((f"model.layers.{i}.post_attention_layernorm.weight", bf16, (4096,)))
    entries += [("model.norm.weight", bf16, (4096,)), ("lm_head.weight", bf16, (VOCAB, 4096))]
    rng = np.random.default_rng(0)
    w = SafetensorsWriter(out / "model.safetensors", entries, {"format": "pt"})  # type: ignore[arg-type]
    for name, _, shape in entries:
        n = int(np.prod(shape))
        for s in range(0, n, 1 << 24):
            m = min(n, s + (1 << 24)) - s
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                w.write(np.ones(m, ml_dtypes.bfloat16))
            else:
                w.write((rng.standard_normal(m, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16))
    w.close()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
           "num_hidden_layers": layers, "vocab_size": VOCAB, "dtype": "bfloat16", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def run(src: Path, max_memory: str, threads: int | None, to: str) -> dict[str, object]:
    out = src.with_name(src.name + f"-{to}")
    cmd = [sys.executable, "-m", "convert", str(src), "--to", to, "-o", str(out), "--overwrite",
           "--max-memory", max_memory, "--json", "--quant-report", str(src.with_name(src.name + "-report.json"))]
    if threads:
        cmd += ["--threads", str(threads)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    secs = time.perf_counter() - t0
    summary = json.loads(res.stdout)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    weights = sum(r["numel"] for r in summary["report"])
    return {"to": to, "max_memory": max_memory, "threads": threads, "seconds": round(secs, 2),
            "weights_quantized": weights, "mweights_per_s": round(weights / secs / 1e6, 1),
            "peak_rss_mib": round(rss / 2**20, 1), "out_bytes": summary["bytes_out"],
            "mean_rel_error": round(float(np.mean([r["rel_error"] for r in summary["report"]])), 5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--dir", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--max-memory", default="256MiB")
    r.add_argument("--threads", type=int)
    r.add_argument("--to", default="nf4", choices=["nf4", "fp4"])
    a = ap.parse_args(argv)
    if a.cmd == "make":
        make(a.layers, a.dir)
    else:
        print(json.dumps(run(a.dir, a.max_memory, a.threads, a.to)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

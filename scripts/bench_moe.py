#!/usr/bin/env python3
"""Benchmark GGUF of a Mixture-of-Experts checkpoint: a synthetic Mixtral-shaped model of about 2 GB.

    python scripts/bench_moe.py make --dir bench-data/moe            # bf16, then as transformers + bnb save it
    python scripts/bench_moe.py run --dir bench-data/moe/nf4 --max-memory 512MiB [--to gguf:q4_k_m]

``make`` writes ``DIR/bf16`` (Mixtral layout: 8 experts per layer with per-expert ``w1``/``w2``/``w3``,
hidden 1024, expert rows 3584, 12 layers, N(0, 0.02) in bf16; the 1000-token tokenizer of the test
fixtures) and converts it with ``--to nf4`` into ``DIR/nf4``: attention 4-bit, experts and router bf16,
byte for byte what transformers + bitsandbytes save (tests/bnb4/test_moe.py). ``run`` converts ``DIR/nf4``
in a subprocess (the peak RSS is the conversion's own: its largest process, the K-quant encoder workers
included) and, as the baseline of the same run, copies the input (``cp -r``); it prints one JSON line:
seconds of both and their ratio, the peak RSS against the cap, the output size.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from convert.units import parse_size  # noqa: E402
from formats.dtypes import BY_CODE  # noqa: E402
from formats.safetensors import SafetensorsWriter  # noqa: E402

TOKENIZER_FROM = ROOT / "tests" / "fixtures" / "models" / "llama_nf4_dq"
VOCAB, HIDDEN, FF, EXPERTS, HEADS, KV_HEADS = 1000, 1024, 3584, 8, 8, 2


def make(out: Path, layers: int) -> None:
    """``out/bf16`` (the synthetic model) and ``out/nf4`` (its ``--to nf4``)."""
    bf16_dir = out / "bf16"
    bf16_dir.mkdir(parents=True, exist_ok=True)
    bf16 = BY_CODE["BF16"]
    kv = HIDDEN // HEADS * KV_HEADS
    entries: list[tuple[str, object, tuple[int, ...]]] = [("model.embed_tokens.weight", bf16, (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}"
        entries += [(f"{p}.self_attn.q_proj.weight", bf16, (HIDDEN, HIDDEN)),
                    (f"{p}.self_attn.k_proj.weight", bf16, (kv, HIDDEN)),
                    (f"{p}.self_attn.v_proj.weight", bf16, (kv, HIDDEN)),
                    (f"{p}.self_attn.o_proj.weight", bf16, (HIDDEN, HIDDEN)),
                    (f"{p}.block_sparse_moe.gate.weight", bf16, (EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            entries += [(f"{p}.block_sparse_moe.experts.{e}.w1.weight", bf16, (FF, HIDDEN)),
                        (f"{p}.block_sparse_moe.experts.{e}.w2.weight", bf16, (HIDDEN, FF)),
                        (f"{p}.block_sparse_moe.experts.{e}.w3.weight", bf16, (FF, HIDDEN))]
        entries += [(f"{p}.input_layernorm.weight", bf16, (HIDDEN,)),
                    (f"{p}.post_attention_layernorm.weight", bf16, (HIDDEN,))]
    entries += [("model.norm.weight", bf16, (HIDDEN,)), ("lm_head.weight", bf16, (VOCAB, HIDDEN))]
    rng = np.random.default_rng(0)
    w = SafetensorsWriter(bf16_dir / "model.safetensors", entries, {"format": "pt"})  # type: ignore[arg-type]
    for name, _, shape in entries:
        n = int(np.prod(shape))
        for s in range(0, n, 1 << 24):
            m = min(n, s + (1 << 24)) - s
            if name.endswith("norm.weight"):
                w.write(np.ones(m, ml_dtypes.bfloat16))
            else:
                w.write((rng.standard_normal(m, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16))
    w.close()
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
           "intermediate_size": FF, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "num_hidden_layers": layers, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
           "vocab_size": VOCAB, "dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
           "max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (bf16_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.model", "tokenizer_config.json", "tokenizer.json"):
        shutil.copy(TOKENIZER_FROM / f, bf16_dir / f)
    subprocess.run([sys.executable, "-m", "convert", str(bf16_dir), "--to", "nf4", "-o", str(out / "nf4"),
                    "--overwrite", "-q"], cwd=ROOT, check=True)


def _peak_child_rss() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def run(src: Path, max_memory: str, threads: int | None, to: str) -> dict[str, object]:
    """Copy ``src`` (the baseline), then convert it; the peak RSS is measured on the conversion alone (it
    is the first child large enough to set the maximum: ``cp`` stays a few MiB)."""
    copy = src.with_name(src.name + "-copy")
    shutil.rmtree(copy, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
    cp_secs = time.perf_counter() - t0
    shutil.rmtree(copy)
    out = src.with_name(src.name + "-" + to.replace(":", "-") + ".gguf")
    cmd = [sys.executable, "-m", "convert", str(src), "--to", to, "-o", str(out), "--overwrite",
           "--max-memory", max_memory, "-q"]
    if threads:
        cmd += ["--threads", str(threads)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    secs = time.perf_counter() - t0
    rss = _peak_child_rss()
    cap = parse_size(max_memory)
    in_bytes = sum(p.stat().st_size for p in src.iterdir() if p.suffix == ".safetensors")
    return {"to": to, "max_memory": max_memory, "threads": threads, "in_bytes": in_bytes,
            "out_bytes": out.stat().st_size, "seconds": round(secs, 1), "cp_seconds": round(cp_secs, 2),
            "ratio_to_cp": round(secs / cp_secs, 1), "peak_rss_mib": round(rss / 2**20, 1),
            "peak_over_cap_mib": round((rss - cap) / 2**20, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--dir", type=Path, required=True)
    m.add_argument("--layers", type=int, default=12)
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--max-memory", default="512MiB")
    r.add_argument("--threads", type=int)
    r.add_argument("--to", default="gguf:q4_k_m")
    a = ap.parse_args(argv)
    if a.cmd == "make":
        make(a.dir, a.layers)
    else:
        print(json.dumps(run(a.dir, a.max_memory, a.threads, a.to)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

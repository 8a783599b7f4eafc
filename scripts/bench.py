#!/usr/bin/env python3
"""Benchmark: synthesize a large, structurally valid bnb checkpoint and convert it.

The synthetic model is 7B-shaped: blocks of q/k/v/o 4096x4096 and gate/up 11008x4096, down
4096x11008, NF4 with double quantization (blocksize 64, nested blocksize 256, the real dynamic map),
realistic absmax (0.03..0.07 around a 0.05 offset), as many blocks as fit the size asked for.

    python scripts/bench.py kernel                       # the kernel alone, in memory
    python scripts/bench.py pages --mib 32               # fresh pages against reused memory, ns a byte
    python scripts/bench.py make --packed-gb 2 --dir bench-data/2g
    python scripts/bench.py convert --dir bench-data/2g --max-memory 512MiB [--to bf16] [--cp]
    python scripts/bench.py make-lora --model bench-data/2g --dir bench-data/2g-lora64 --rank 64
    python scripts/bench.py convert --dir bench-data/2g --max-memory 512MiB --merge-lora bench-data/2g-lora64
    python scripts/bench.py tensors --tensors 100000 --dir bench-data/many   # many small tensors: planning cost
    python scripts/bench.py convert --dir bench-data/2g --to gguf:q4_k_m --max-memory 512MiB --threads 2
    python scripts/bench.py llama-quantize --dir bench-data/2g --type q4_k_m --threads 2   # llama.cpp's side

`convert` runs `convert-bnb` in a subprocess (so peak RSS is the conversion's own), prints G elements/s,
GB/s written and peak RSS, and with --cp also times `cp` + `sync` of a file of the output's size on the
same disk (the physical floor). Results are printed as JSON lines, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from convert.dequant.kernels import dequantize_4bit  # noqa: E402
from formats.bnb import DYNAMIC_MAP_SIGNED, NF4_TABLE, QuantState  # noqa: E402
from formats.dtypes import BY_CODE  # noqa: E402
from formats.safetensors import SafetensorsWriter  # noqa: E402
from formats.writeback import PlacedMemory  # noqa: E402

SHAPES = {
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (4096, 4096),
    "self_attn.v_proj": (4096, 4096),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (11008, 4096),
    "mlp.up_proj": (11008, 4096),
    "mlp.down_proj": (4096, 11008),
}
BS, NBS = 64, 256
HIDDEN, VOCAB = 4096, 1024


def layer_entries(prefix: str, shape: tuple[int, int]) -> tuple[list, QuantState]:
    n = shape[0] * shape[1]
    nb = -(-n // BS)
    st = QuantState("nf4", BS, "bfloat16", shape, True, NBS, "float32", float(np.float32(0.05)))
    js = st.to_json().encode()
    u8, f32 = BY_CODE["U8"], BY_CODE["F32"]
    entries = [
        (f"{prefix}.weight", u8, (n // 2, 1)),
        (f"{prefix}.weight.absmax", u8, (nb,)),
        (f"{prefix}.weight.nested_absmax", f32, (-(-nb // NBS),)),
        (f"{prefix}.weight.nested_quant_map", f32, (256,)),
        (f"{prefix}.weight.quant_map", f32, (16,)),
        (f"{prefix}.weight.quant_state.bitsandbytes__nf4", u8, (len(js),)),
    ]
    return entries, st


def make(packed_gb: float, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    per_block = sum(r * c for r, c in SHAPES.values()) // 2
    n_blocks = max(1, int(packed_gb * 1e9 // per_block))
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, 1 << 24, dtype=np.uint8)  # 16 MiB of random codes, reused with shifts
    entries, states = [], {}
    for b in range(n_blocks):
        for k, shape in SHAPES.items():
            e, st = layer_entries(f"model.layers.{b}.{k}", shape)
            entries += e
            states[e[0][0]] = st
    bf16 = BY_CODE["BF16"]
    entries += [("model.embed_tokens.weight", bf16, (VOCAB, HIDDEN)), ("lm_head.weight", bf16, (VOCAB, HIDDEN)),
                ("model.norm.weight", bf16, (HIDDEN,))]
    entries += [(f"model.layers.{b}.{k}.weight", bf16, (HIDDEN,)) for b in range(n_blocks)
                for k in ("input_layernorm", "post_attention_layernorm")]
    path = out_dir / "model.safetensors"
    if path.exists():
        path.unlink()
    w = SafetensorsWriter(path, entries, {"format": "pt"})
    shift = 0
    for name, _dt, shape in entries:
        n = int(np.prod(shape))
        if "norm" in name or "embed" in name or "lm_head" in name:
            w.write((rng.standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16))
        elif name.endswith(".weight"):
            left = n
            while left:
                take = min(left, pool.size - shift)
                w.write(pool[shift:shift + take])
                left -= take
                shift = (shift + 4099) % (pool.size // 2)
        elif name.endswith(".absmax"):
            w.write(rng.integers(96, 160, n, dtype=np.uint8))  # codes near the middle of the map
        elif name.endswith(".nested_absmax"):
            w.write(np.full(n, 0.02, np.float32))
        elif name.endswith(".nested_quant_map"):
            w.write(DYNAMIC_MAP_SIGNED)
        elif name.endswith(".quant_map"):
            w.write(NF4_TABLE)
        else:
            base = name[: name.index(".quant_state")]
            w.write(np.frombuffer(states[base].to_json().encode(), np.uint8))
    w.close(fsync=False)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
        "hidden_size": HIDDEN, "intermediate_size": 11008, "num_hidden_layers": n_blocks,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
        },
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    # a SentencePiece vocabulary, so `--to gguf` has a tokenizer to write (padded to VOCAB ids)
    shutil.copy(ROOT / "tests/fixtures/models/llama_nf4_dq/tokenizer.model", out_dir / "tokenizer.model")
    packed = sum(int(np.prod(s)) for n, d, s in entries if n.endswith(".weight") and d.code == "U8")
    print(json.dumps({"made": str(out_dir), "blocks": n_blocks, "packed_bytes": packed,
                      "file_bytes": path.stat().st_size, "elements": packed * 2}))


def make_lora(model_dir: Path, out_dir: Path, rank: int) -> None:
    """A PEFT LoRA adapter of rank ``rank`` on every linear layer of a `make` model (fp32 A and B)."""
    n_blocks = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    out_dir.mkdir(parents=True, exist_ok=True)
    f32 = BY_CODE["F32"]
    entries = []
    for b in range(n_blocks):
        for k, (rows, cols) in SHAPES.items():
            p = f"base_model.model.model.layers.{b}.{k}"
            entries += [(f"{p}.lora_A.weight", f32, (rank, cols)), (f"{p}.lora_B.weight", f32, (rows, rank))]
    path = out_dir / "adapter_model.safetensors"
    if path.exists():
        path.unlink()
    rng = np.random.default_rng(1)
    pool = (rng.standard_normal(1 << 22) * 0.01).astype(np.float32)
    w = SafetensorsWriter(path, entries, {"format": "pt"})
    for _name, _dt, (r, c) in entries:
        left = r * c
        while left:
            take = min(left, pool.size)
            w.write(pool[:take])
            left -= take
    w.close(fsync=False)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(
        k.split(".")[-1] for k in SHAPES), "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    print(json.dumps({"made": str(out_dir), "rank": rank, "blocks": n_blocks, "bytes": path.stat().st_size}))


def kernel(n_elem: int, threads: int, dtype: str = "bfloat16") -> dict:
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, n_elem // 2, dtype=np.uint8)
    absmax = rng.uniform(0.03, 0.07, n_elem // BS).astype(np.float32)
    out = np.empty(n_elem, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    chunk = 1 << 22

    def work(s: int) -> None:
        e = min(n_elem, s + chunk)
        dequantize_4bit(packed[s // 2:e // 2], absmax[s // BS:e // BS], NF4_TABLE, BS, e - s, dtype,
                        out=out[s:e])

    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        if threads == 1:
            for s in range(0, n_elem, chunk):
                work(s)
        else:
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(work, range(0, n_elem, chunk)))
        best = min(best, time.perf_counter() - t)
    return {"bench": "kernel", "dtype": dtype, "elements": n_elem, "threads": threads, "seconds": round(best, 4),
            "gelem_per_s": round(n_elem / best / 1e9, 3)}


def bnb_kernel(n_elem: int, threads: int, dtype: str = "bfloat16") -> dict | None:
    """bitsandbytes' own CPU ``dequantize_4bit`` on the same data as :func:`kernel` (torch threads =
    ``threads``), best of 3; None where torch or bitsandbytes is not installed."""
    try:
        import bitsandbytes.functional as bnbf
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    packed = torch.from_numpy(rng.integers(0, 256, n_elem // 2, dtype=np.uint8)).reshape(-1, 1)
    absmax = torch.from_numpy(rng.uniform(0.03, 0.07, n_elem // BS).astype(np.float32))
    state = bnbf.QuantState(absmax=absmax, shape=torch.Size([n_elem]), code=bnbf.get_4bit_type("nf4", device="cpu"),
                            blocksize=BS, quant_type="nf4", dtype=getattr(torch, dtype))
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        bnbf.dequantize_4bit(packed, state)
        best = min(best, time.perf_counter() - t)
    return {"bench": "kernel-bitsandbytes", "dtype": dtype, "elements": n_elem, "threads": threads,
            "seconds": round(best, 4), "gelem_per_s": round(n_elem / best / 1e9, 3)}


#: Runs argv[3:] with its stdout and stderr in the files argv[1] and argv[2], and prints its exit code,
#: peak RSS and CPU seconds (its own and its children's: RUSAGE_CHILDREN) as JSON. A small fresh process:
#: Linux keeps the spawning process's peak in a child's ``ru_maxrss`` across exec, so a command started
#: by this (big) bench process would report at least this process's peak.
_MEASURE = """
import json, resource, subprocess, sys
with open(sys.argv[1], "wb") as out, open(sys.argv[2], "wb") as err:
    rc = subprocess.run(sys.argv[3:], stdout=out, stderr=err).returncode
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "rss": u.ru_maxrss * 1024, "cpu": u.ru_utime + u.ru_stime}))
"""


def run_measured(cmd: list[str], cwd: Path | None = None) -> tuple[int, str, str, int, float]:
    """Run a command; return (exit code, stdout, stderr, its own peak RSS in bytes, its CPU seconds), the
    figures of the command and its children alone (through :data:`_MEASURE`)."""
    import tempfile

    with tempfile.NamedTemporaryFile() as out, tempfile.NamedTemporaryFile() as err:
        r = subprocess.run([sys.executable, "-c", _MEASURE, out.name, err.name, *cmd], cwd=cwd,
                           capture_output=True, text=True, check=True)
        figures = json.loads(r.stdout)
        return (figures["rc"], Path(out.name).read_text(errors="replace"), Path(err.name).read_text(errors="replace"),
                figures["rss"], figures["cpu"])


def compile_project() -> None:
    """Byte-compile ``convert`` and ``formats`` first, as ``pip install`` does for an installed package:
    without it an editable install under ``PYTHONDONTWRITEBYTECODE=1`` (set on this machine) compiles
    every module at every start, about 0.35 s of each run."""
    import compileall

    for pkg in ("convert", "formats"):
        compileall.compile_dir(ROOT / pkg, quiet=1)


def warm(src: Path) -> None:
    """Read every file under ``src`` (or ``src`` itself) once, into the page cache."""
    for f in [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass


def cp_floor(out: Path, scratch: Path) -> float:
    """The floor: seconds of `cp` + `sync` of the output's own bytes on the same disk, one file at a
    time (each copy removed before the next, so a 32 GB output needs one shard of extra space). Each
    file is read once first (:func:`warm`): the conversion's writer drops the pages it wrote, and a
    `cp` reading them back from the disk would time a read the conversion does not do."""
    total = 0.0
    for f in sorted(out.glob("*.safetensors")) if out.is_dir() else [out]:
        warm(f)
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        subprocess.run(["cp", str(f), str(scratch)], check=True)
        subprocess.run(["sync"], check=True)
        total += time.perf_counter() - t
        scratch.unlink()
    return round(total, 2)


def convert(src_dir: Path, max_memory: str, to: str, do_cp: bool, threads: int | None, keep: bool,
            merge_lora: Path | None = None) -> None:
    out = src_dir.parent / f"{src_dir.name}-out-{to.replace(':', '-')}"
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    cmd = [sys.executable, "-m", "convert", str(src_dir), "--to", to, "-o", str(out), "--max-memory", max_memory,
           "--json"] + (["--threads", str(threads)] if threads else []) + (
               ["--merge-lora", str(merge_lora)] if merge_lora else [])
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    code, stdout, stderr, child_rss, _cpu = run_measured(cmd, cwd=ROOT)
    wall = time.perf_counter() - t
    if code != 0:
        print(stderr, file=sys.stderr)
        raise SystemExit(code)
    summary = json.loads(stdout)
    out_bytes = summary["bytes_out"]
    res = {"bench": "convert" + ("+lora" if merge_lora else ""), "to": to, "max_memory": max_memory,
           "wall_s": round(wall, 2),
           "elements": summary["elements"], "gelem_per_s": round(summary["elements"] / wall / 1e9, 3),
           "gb_per_s_written": round(out_bytes / wall / 1e9, 3), "out_bytes": out_bytes,
           "peak_rss_mib": round(max(child_rss, summary["peak_rss_bytes"]) / 2**20, 1)}
    if do_cp:
        cp_s = cp_floor(out, src_dir.parent / "cp-floor.tmp")
        res.update({"cp_sync_s": cp_s, "ratio_to_cp": round(wall / cp_s, 2)})
    if not keep:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    print(json.dumps(res))


_LLAMA_QUANTIZE = """
import ctypes, sys, llama_cpp
from gguf import LlamaFileType
p = llama_cpp.llama_model_quantize_default_params()
p.nthread = int(sys.argv[4])
p.ftype = int(LlamaFileType["MOSTLY_" + sys.argv[3].upper()])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def llama_quantize(src_dir: Path, out_type: str, threads: int, max_memory: str) -> None:
    """llama.cpp's quantizer on our f32 GGUF of the model (``llama_cpp.llama_model_quantize``, the code of
    ``llama-quantize``), timed alone in a subprocess; then our ``--to gguf:TYPE`` output (from `convert`
    with --keep, if present) is compared with it tensor by tensor."""
    import gguf

    f32 = src_dir.parent / f"{src_dir.name}-out-gguf-f32"
    if not f32.exists():
        cmd = [sys.executable, "-m", "convert", str(src_dir), "--to", "gguf:f32", "-o", str(f32), "--quiet",
               "--max-memory", max_memory]
        subprocess.run(cmd, check=True, cwd=ROOT)
    out = src_dir.parent / f"{src_dir.name}-llama-{out_type}.gguf"
    out.unlink(missing_ok=True)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    code, _stdout, stderr, rss, _cpu = run_measured([sys.executable, "-c", _LLAMA_QUANTIZE, str(f32), str(out),
                                                     out_type, str(threads)])
    wall = time.perf_counter() - t
    if code != 0:
        print(stderr[-3000:], file=sys.stderr)
        raise SystemExit(code)
    res: dict[str, object] = {"bench": "llama_model_quantize", "type": out_type, "threads": threads,
                              "wall_s": round(wall, 2), "out_bytes": out.stat().st_size,
                              "peak_rss_mib": round(rss / 2**20, 1)}
    ours = src_dir.parent / f"{src_dir.name}-out-gguf-{out_type}"
    if ours.exists():
        theirs = {t.name: t for t in gguf.GGUFReader(out).tensors}
        same = sum(1 for t in gguf.GGUFReader(ours).tensors
                   if t.name in theirs and t.tensor_type == theirs[t.name].tensor_type
                   and np.array_equal(t.data.view(np.uint8), theirs[t.name].data.view(np.uint8)))
        res["identical_tensors"] = f"{same} of {len(theirs)}"
    out.unlink()
    print(json.dumps(res))


_HF_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cpu")
model = model.dequantize()
model.save_pretrained(sys.argv[2])
"""


def hf_baseline(src_dir: Path, threads: int) -> None:
    """What users run today: transformers from_pretrained -> model.dequantize() -> save_pretrained."""
    out = src_dir.parent / f"{src_dir.name}-out-hf"
    if out.exists():
        shutil.rmtree(out)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    code, _stdout, stderr, rss, _cpu = run_measured([sys.executable, "-c", _HF_SCRIPT, str(src_dir), str(out),
                                                     str(threads)])
    wall = time.perf_counter() - t
    if code != 0:
        print(stderr[-3000:], file=sys.stderr)
        raise SystemExit(code)
    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(json.dumps({"bench": "transformers", "wall_s": round(wall, 2), "out_bytes": out_bytes,
                      "peak_rss_mib": round(rss / 2**20, 1)}))
    shutil.rmtree(out)


def make_many(n: int, path: Path, zero_size: bool, share_4bit: float) -> None:
    """A valid safetensors file of ``n`` tiny tensors: F32 [4] (or [0]) plain tensors, and a share of them as
    the 5 tensors of tiny NF4 layers (4x32, blocksize 64), so grouping and planning see both kinds."""
    import struct

    n_layers = int(n * share_4bit) // 5
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    off = 0

    def add(name: str, code: str, shape: list[int], raw: bytes) -> None:
        nonlocal off
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)

    qmap = NF4_TABLE.astype("<f4").tobytes()
    state = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [4, 32]}).encode()
    for i in range(n_layers):
        w = f"model.layers.{i}.mlp.down_proj.weight"
        add(w, "U8", [64, 1], bytes(range(64)))
        add(f"{w}.absmax", "F32", [2], np.array([0.05, 0.04], "<f4").tobytes())
        add(f"{w}.quant_map", "F32", [16], qmap)
        add(f"{w}.quant_state.bitsandbytes__nf4", "U8", [len(state)], state)
    plain = np.arange(4, dtype="<f4").tobytes()
    for i in range(n - 4 * n_layers):
        add(f"model.extra.{i}.weight", "F32", [0] if zero_size else [4], b"" if zero_size else plain)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def many_tensors(n: int, out_dir: Path, zero_size: bool, share_4bit: float, threads: int,
                 do_convert: bool = True) -> None:
    """Time opening, planning and converting a file of ``n`` tiny tensors (in this process)."""
    from convert.job import convert as run
    from convert.options import ConvertOptions
    from convert.stream.plan import make_plan
    from formats.checkpoint import open_checkpoint

    src = out_dir / f"many-{n}{'-zero' if zero_size else ''}.safetensors"
    t = time.perf_counter()
    make_many(n, src, zero_size, share_4bit)
    made = time.perf_counter() - t
    t, c = time.perf_counter(), time.process_time()
    ckpt = open_checkpoint(src)
    opened, opened_cpu = time.perf_counter() - t, time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    plan = make_plan(ckpt, "bf16")
    planned, planned_cpu = time.perf_counter() - t, time.process_time() - c
    n_out = len(plan.tensors)
    ckpt.close()
    out = out_dir / f"many-{n}-out.safetensors"
    if out.exists():
        out.unlink()
    converted = converted_cpu = None
    if do_convert:
        t, c = time.perf_counter(), time.process_time()
        run(ConvertOptions(str(src), to="bf16", output=out, threads=threads, max_memory=512 << 20))
        converted, converted_cpu = round(time.perf_counter() - t, 2), round(time.process_time() - c, 2)
        out.unlink()
    # wall seconds, and the process's CPU seconds (all threads): the figure to read on a shared machine
    print(json.dumps({"bench": "tensors", "tensors": n, "zero_size": zero_size, "layers_4bit": int(n * share_4bit) // 5,
                      "out_tensors": n_out, "make_s": round(made, 2), "open_s": round(opened, 2),
                      "open_cpu_s": round(opened_cpu, 2), "plan_s": round(planned, 2),
                      "plan_cpu_s": round(planned_cpu, 2), "convert_s": converted, "convert_cpu_s": converted_cpu,
                      "file_mib": round(src.stat().st_size / 2**20, 1)}))
    src.unlink()


def pages(mib: int, rounds: int) -> dict:
    """ns a byte to write a chunk of ``mib`` MiB (the bf16 kernel's store: a uint16 copy) into fresh
    memory (``np.empty`` each time, as :func:`formats.writeback.aligned_empty`), into one array written
    before, and into :class:`formats.writeback.PlacedMemory` (the pipeline's chunks); best of ``rounds``
    rounds of 10 chunks, one thread."""
    n = mib << 20
    src = np.ones(n // 2, np.uint16)
    kept = np.empty(n, np.uint8)
    memory = PlacedMemory(keep=2)

    def fresh() -> None:
        np.empty(n, np.uint8).view(np.uint16)[:] = src

    def reused() -> None:
        kept.view(np.uint16)[:] = src

    def placed() -> None:
        memory.empty(n, 0).view(np.uint16)[:] = src

    best = {}
    for _ in range(rounds):
        for name, fn in (("fresh", fresh), ("reused", reused), ("placed_memory", placed)):
            t = time.perf_counter()
            for _ in range(10):
                fn()
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / (10 * n) * 1e9)
    return {"bench": "pages", "chunk_mib": mib, **{f"{k}_ns_per_byte": round(v, 3) for k, v in best.items()}}


def main() -> None:
    compile_project()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="a synthetic 7B-shaped NF4 checkpoint of about --packed-gb GB of packed codes")
    m.add_argument("--packed-gb", type=float, required=True)
    m.add_argument("--dir", type=Path, required=True)
    k = sub.add_parser("kernel", help="the 4-bit dequantization kernel alone, in memory, 1 and 2 threads")
    k.add_argument("--elements", type=int, default=1 << 27)
    c = sub.add_parser("convert", help="convert-bnb on a `make` model in a subprocess: G elements/s, GB/s, peak RSS")
    c.add_argument("--dir", type=Path, required=True)
    c.add_argument("--max-memory", default="512MiB")
    c.add_argument("--to", default="bf16")
    c.add_argument("--threads", type=int)
    c.add_argument("--cp", action="store_true")
    c.add_argument("--keep", action="store_true")
    c.add_argument("--merge-lora", type=Path, help="an adapter from `make-lora`, merged during the conversion")
    ml = sub.add_parser("make-lora", help="a synthetic rank-R LoRA adapter on every linear layer of a `make` model")
    ml.add_argument("--model", type=Path, required=True)
    ml.add_argument("--dir", type=Path, required=True)
    ml.add_argument("--rank", type=int, default=64)
    mt = sub.add_parser("tensors", help="a file of many tiny tensors: time open, plan and convert")
    mt.add_argument("--tensors", type=int, default=100_000)
    mt.add_argument("--dir", type=Path, default=ROOT / "bench-data")
    mt.add_argument("--zero-size", action="store_true", help="plain tensors of shape [0]")
    mt.add_argument("--share-4bit", type=float, default=0.5, help="share of the tensors in tiny NF4 layers")
    mt.add_argument("--threads", type=int, default=2)
    mt.add_argument("--no-convert", action="store_true", help="time open and plan only")
    lq = sub.add_parser("llama-quantize", help="time llama.cpp's quantizer on our f32 GGUF of a `make` model")
    lq.add_argument("--dir", type=Path, required=True)
    lq.add_argument("--type", default="q4_k_m")
    lq.add_argument("--threads", type=int, default=2)
    lq.add_argument("--max-memory", default="512MiB")
    pg = sub.add_parser("pages", help="writing a chunk into fresh, reused and PlacedMemory memory, ns a byte")
    pg.add_argument("--mib", type=int, default=32)
    pg.add_argument("--rounds", type=int, default=5)
    h = sub.add_parser("transformers", help="time transformers from_pretrained -> dequantize -> save_pretrained")
    h.add_argument("--dir", type=Path, required=True)
    h.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.packed_gb, a.dir)
    elif a.cmd == "kernel":
        for dt in ("bfloat16", "float16", "float32"):
            for th in (1, 2):
                print(json.dumps(kernel(a.elements, th, dt)))
                theirs = bnb_kernel(a.elements, th, dt)
                if theirs is not None:
                    print(json.dumps(theirs))
    elif a.cmd == "pages":
        print(json.dumps(pages(a.mib, a.rounds)))
    elif a.cmd == "transformers":
        hf_baseline(a.dir, a.threads)
    elif a.cmd == "tensors":
        many_tensors(a.tensors, a.dir, a.zero_size, a.share_4bit, a.threads, not a.no_convert)
    elif a.cmd == "llama-quantize":
        llama_quantize(a.dir, a.type, a.threads, a.max_memory)
    elif a.cmd == "make-lora":
        make_lora(a.model, a.dir, a.rank)
    else:
        convert(a.dir, a.max_memory, a.to, a.cp, a.threads, a.keep, a.merge_lora)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

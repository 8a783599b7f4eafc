"""Record everything the ``convert-bnb`` command line does on a fixed set of commands, to prove a refactor
changed nothing observable.

The script runs a FIXED list of commands (every ``--to`` target, every input kind of ``tests/fixtures``,
LoRA merges, re-quantization options, sharding, ``--dry-run``/``--json``, ``inspect``, ``check``,
``batch`` and a set of bad inputs) as ``python -m convert ...`` with the code of one source tree, and
writes one JSON record: per command its arguments, exit code, stdout, stderr, and every file it
created, changed or removed (relative path, size, sha256). Run-dependent values are masked before they
are recorded (seconds, G elements/s, peak RSS, MiB/s, pids in temporary names and state files, the
``timings``/``seconds``/``gelem_per_s``/``peak_rss_bytes`` values of ``--json`` output, the batch
summary's time column, a running batch's 10-second progress line); nothing deterministic is (hashes,
counts, notes, error messages). ``batch --jobs 2`` is recorded only with ``-q`` and ``--json``: which
job finishes first varies, and with it the order of the per-job lines on stderr.

Use it around a restructuring of the package::

    # on the old tree (e.g. a worktree of the commit before the change)
    git worktree add ../base HEAD
    python scripts/behaviour_snapshot.py record before.json --tree ../base
    # on the new tree (default: the repository this script lives in)
    python scripts/behaviour_snapshot.py record after.json
    # every difference, by command and field; exit 1 if any, 0 if none
    python scripts/behaviour_snapshot.py compare before.json after.json

How the runs are kept comparable:

- the fixtures are copied from ``TREE/tests/fixtures`` into the fixed scratch directory
  ``$TMPDIR/convert-bnb-snapshot/in`` (wiped at the start of each record), and every output goes under
  ``$TMPDIR/convert-bnb-snapshot/runs/NAME`` (the command's working directory), so absolute paths in
  messages are the same on both runs; two records cannot run at once (a lock beside that directory);
- the subprocess gets ``PYTHONPATH=TREE`` and the script asserts once, before any command, that
  ``convert`` and ``formats`` are imported from TREE (an editable install of another checkout must not
  shadow it: its finder comes after ``PYTHONPATH`` on ``sys.meta_path``); bytecode goes to a cache
  outside the tree (``PYTHONPYCACHEPREFIX``), so recording never writes into TREE;
- ``OPENBLAS_NUM_THREADS=1``, ``HF_HUB_OFFLINE=1``, ``HF_HOME`` in the scratch directory,
  ``PYTHONHASHSEED=0``, ``COLUMNS=80``, ``LC_ALL=C.UTF-8``, ``TZ=UTC``; ``--threads 2`` and a fixed
  ``--max-memory`` where they apply.

A record runs 202 commands in about 70 s on 2 cores.
"""

from __future__ import annotations

import argparse
import difflib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The fixed scratch directory: inputs, outputs, HF_HOME. Wiped at the start of every record.
ROOT = Path(tempfile.gettempdir()) / "convert-bnb-snapshot"
IN = ROOT / "in"
RUNS = ROOT / "runs"
HF_HOME = ROOT / "hf"
WORK = ROOT / "work"
#: Held while a record runs: two records would wipe each other's scratch directory.
LOCK = Path(tempfile.gettempdir()) / "convert-bnb-snapshot.lock"
#: Bytecode cache, outside ROOT (kept between records) and outside the tree (never written into).
PYCACHE = Path(tempfile.gettempdir()) / "convert-bnb-snapshot-pycache"

M = IN / "models"
LLAMA = M / "llama_nf4_dq"
ORIG = M / "llama_orig_bf16"
ADAPTER = IN / "lora" / "adapter"
SINGLE = IN / "single"
FLUX = IN / "diffusion" / "flux_tiny_nf4.safetensors"
FLUX_BF16 = IN / "diffusion" / "flux_tiny_bf16.safetensors"
BAD = IN / "bad"

#: The usual settings of a conversion: deterministic threads and memory cap.
RUN = ["--threads", "2", "--max-memory", "256MiB"]
TIMEOUT = 300.0
RECORD_VERSION = 1

# ----------------------------------------------------------------------------------------- masks

#: Keys of ``--json`` output (and of batch state files) whose values change from run to run.
VOLATILE_KEYS = ("seconds", "gelem_per_s", "peak_rss_bytes", "parent_pid", "pid")
#: Keys whose whole object holds run-dependent numbers.
VOLATILE_OBJECTS = ("timings",)

_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_SIZE = r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)"

#: (name, pattern, replacement) applied to stdout, stderr and state files, in this order.
TEXT_MASKS: list[tuple[str, re.Pattern[str], str]] = [
    ("json-volatile-key", re.compile(r'("(?:' + "|".join(VOLATILE_KEYS) + r')":\s*)' + _NUM), r'\1"<masked>"'),
    ("json-timings-object", re.compile(r'("(?:' + "|".join(VOLATILE_OBJECTS) + r')":\s*)\{[^{}]*\}'),
     r'\1"<masked>"'),
    ("seconds", re.compile(r"\b\d+\.\d+ s\b"), "<SEC> s"),
    ("gelem-per-s", re.compile(r"\b\d+(?:\.\d+)? G elements/s"), "<RATE> G elements/s"),
    ("peak-rss", re.compile(r"peak RSS " + _SIZE), "peak RSS <RSS>"),
    ("bytes-per-s", re.compile(r"\b" + _SIZE + r"/s\b"), "<RATE>/s"),
    ("tmp-pid", re.compile(r"(\.convert-bnb-(?:tmp|old)-|\.tmp-)\d+"), r"\1<PID>"),
    ("shards-dir-pid", re.compile(r"(\.convert-bnb-shards-)\d+-\w+"), r"\1<PID>"),
    # a running batch's progress line, printed every 10 s (when a batch happens to run that long)
    ("batch-progress-line", re.compile(r"^\[\d+/\d+ jobs done\] .*\n", re.MULTILINE), ""),
]

#: The batch summary table (``convert/batch_cli.py summary_table``): its time column, whose width
#: follows the times, is masked whole.
_TABLE_HEAD = re.compile(r"^(job +status +shards new/kept +output +)time( +)detail$")
_TABLE_END = re.compile(r"^(?:\d+ \w+(?:, )?)+ of \d+ jobs$")
_TABLE_TIME = re.compile(r"^(.*?  )\d+\.\ds(?:$| +)")


def mask_batch_table(text: str) -> str:
    """The batch summary with its time column replaced by ``<T>`` (the other columns as printed)."""
    out: list[str] = []
    in_table = False
    for line in text.split("\n"):
        head = _TABLE_HEAD.match(line)
        if head:
            in_table = True
            out.append(head.group(1) + "<T>  detail")
            continue
        if in_table and _TABLE_END.match(line):
            in_table = False
        elif in_table:
            line = _TABLE_TIME.sub(lambda m: m.group(1) + "<T>  ", line).rstrip()
        out.append(line)
    return "\n".join(out)


def mask_text(text: str, hits: set[str] | None = None) -> str:
    """``text`` with every run-dependent value replaced by a placeholder; the names of the masks that
    changed something are added to ``hits``."""
    for name, pattern, repl in TEXT_MASKS:
        text, n = pattern.subn(repl, text)
        if n and hits is not None:
            hits.add(name)
    masked = mask_batch_table(text)
    if masked != text and hits is not None:
        hits.add("batch-table-time")
    return masked


MASK_NAMES = [name for name, _p, _r in TEXT_MASKS] + ["batch-table-time"]

# ----------------------------------------------------------------------------------------- files


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_lock(path: Path) -> bool:
    """A lock file (``.NAME.convert-bnb-lock``, the batch's ``.convert-bnb/lock``): listed, never hashed."""
    return path.name == "lock" or path.name.endswith("-lock") or path.name.endswith(".lock")


def is_state(rel: str) -> bool:
    """A batch state file (``OUT/.convert-bnb/...``): its content holds pids, so it is hashed masked."""
    return "/.convert-bnb/" in f"/{rel}"


def describe(path: Path, rel: str) -> dict[str, Any]:
    """What is recorded of one entry: type, and for a regular file its size and sha256 (of the masked
    content for a batch state file; nothing for a lock file)."""
    if path.is_symlink():
        return {"type": "symlink", "target": os.readlink(path)}
    if path.is_dir():
        return {"type": "dir"}
    if not path.is_file():
        return {"type": "other"}
    if is_lock(path):
        return {"type": "lock"}
    if is_state(rel):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return {"type": "file", "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        masked = mask_text(text).encode("utf-8")
        return {"type": "file", "masked": masked != raw, "size": len(masked),
                "sha256": hashlib.sha256(masked).hexdigest()}
    return {"type": "file", "size": path.stat().st_size, "sha256": sha256_file(path)}


def walk(top: Path) -> Iterator[tuple[str, Path]]:
    """Every entry under ``top`` (hidden ones too), as (relative path, path), sorted."""
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        d = Path(dirpath)
        for name in sorted([*dirnames, *filenames]):
            p = d / name
            yield p.relative_to(top).as_posix(), p


def snapshot(top: Path) -> dict[str, dict[str, Any]]:
    """``describe`` of every entry under ``top``."""
    return {rel: describe(p, rel) for rel, p in walk(top)} if top.exists() else {}


def quick_listing(top: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime_ns) of every entry under ``top``: what tells whether a command touched it."""
    out: dict[str, tuple[int, int, int]] = {}
    for rel, p in walk(top):
        st = p.lstat()
        out[rel] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def diff_snapshots(before: dict[str, Any], after: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Entries new or changed in ``after`` (with their description), and paths gone."""
    produced = [{"path": rel, **d} for rel, d in after.items() if before.get(rel) != d]
    removed = sorted(rel for rel in before if rel not in after)
    return produced, removed


# -------------------------------------------------------------------------------------- commands

Setup = Callable[[Path], None]


@dataclass
class Cmd:
    """One recorded command: ``python -m convert ARGS`` in ``runs/NAME`` after ``setup(runs/NAME)``."""

    name: str
    args: list[str]
    setup: list[Setup] = field(default_factory=list)
    #: commands run (not compared as commands of their own) before this one, in its directory
    pre: list[list[str]] = field(default_factory=list)


def copy(src: Path, dst_name: str) -> Setup:
    def run(cwd: Path) -> None:
        if src.is_dir():
            shutil.copytree(src, cwd / dst_name)
        else:
            (cwd / dst_name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, cwd / dst_name)
    return run


def write(name: str, content: str | bytes) -> Setup:
    def run(cwd: Path) -> None:
        p = cwd / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")
    return run


def mkdir(name: str) -> Setup:
    def run(cwd: Path) -> None:
        (cwd / name).mkdir(parents=True, exist_ok=True)
    return run


def make_bad_inputs() -> None:
    """Broken inputs, made the same way on every run, under ``in/bad``."""
    BAD.mkdir(parents=True)
    raw = (LLAMA / "model.safetensors").read_bytes()
    (BAD / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    header_len = int.from_bytes(raw[:8], "little")
    (BAD / "header_only.safetensors").write_bytes(raw[: 8 + header_len])
    (BAD / "garbage.safetensors").write_bytes(bytes(range(256)) * 64)
    (BAD / "empty.safetensors").write_bytes(b"")
    (BAD / "not_json_header.safetensors").write_bytes((64).to_bytes(8, "little") + b"{" * 64)
    # a raw pickle that calls os.system: refused by name (PT-003), never run
    (BAD / "evil.bin").write_bytes(b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    (BAD / "empty_dir").mkdir()
    (BAD / "adapter_empty").mkdir()
    shutil.copytree(ADAPTER, BAD / "adapter_bad_json")
    (BAD / "adapter_bad_json" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8,', "utf-8")
    shutil.copytree(ADAPTER, BAD / "adapter_no_weights")
    (BAD / "adapter_no_weights" / "adapter_model.safetensors").unlink()
    shutil.copytree(ADAPTER, BAD / "adapter_bad_rank")
    cfg = json.loads((ADAPTER / "adapter_config.json").read_text("utf-8"))
    cfg["r"] = 0
    (BAD / "adapter_bad_rank" / "adapter_config.json").write_text(json.dumps(cfg, indent=2), "utf-8")
    shutil.copytree(LLAMA, BAD / "llama_no_config")
    (BAD / "llama_no_config" / "config.json").unlink()
    shutil.copytree(LLAMA, BAD / "llama_bad_config")
    (BAD / "llama_bad_config" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ', "utf-8")


def jobs_text(*lines: str) -> str:
    return "".join(f"{line}\n" for line in lines)


def commands() -> list[Cmd]:
    """The fixed command set. Names are the key of a record: keep them stable."""
    cmds: list[Cmd] = []

    def add(name: str, *args: str | Path, setup: list[Setup] | None = None,
            pre: list[list[str]] | None = None) -> None:
        cmds.append(Cmd(name, [str(a) for a in args], setup or [], pre or []))

    # ---- help and version
    add("help", "--help")
    add("help-batch", "batch", "--help")
    add("help-check", "check", "--help")
    add("help-inspect", "inspect", "--help")
    add("version", "--version")

    # ---- every --to on a directory (llama nf4 + double quant)
    for to in ("auto", "bf16", "fp16", "fp32"):
        add(f"dir-to-{to}", LLAMA, "--to", to, "-o", "out", *RUN)
    add("dir-to-nf4", LLAMA, "--to", "nf4", "-o", "out", *RUN)
    add("dir-to-fp4", LLAMA, "--to", "fp4", "-o", "out", *RUN)
    gguf_types = ("gguf", "gguf:f32", "gguf:f16", "gguf:bf16", "gguf:q8_0", "gguf:q4_0", "gguf:q4_1",
                  "gguf:q5_0", "gguf:q5_1", "gguf:q2_k", "gguf:q3_k_s", "gguf:q3_k_m", "gguf:q3_k_l",
                  "gguf:q4_k_s", "gguf:q4_k_m", "gguf:q5_k_s", "gguf:q5_k_m", "gguf:q6_k")
    for to in gguf_types:
        add(f"dir-to-{to.replace(':', '-')}", LLAMA, "--to", to, "-o", "out.gguf", *RUN)
    add("dir-to-BF16-upper", LLAMA, "--to", "BF16", "-o", "out", *RUN)
    add("dir-to-gguf-Q4_K_M-upper", LLAMA, "--to", "gguf:Q4_K_M", "-o", "out.gguf", *RUN)
    add("dir-to-gguf-q8_0-quiet", LLAMA, "--to", "gguf:q8_0", "-o", "out.gguf", "-q", *RUN)

    # ---- GGUF on the other architectures
    for arch, to in (("qwen3", "gguf:f16"), ("qwen3", "gguf:q4_k_m"), ("gemma3", "gguf:q8_0"),
                     ("gemma3", "gguf:q4_k_m"), ("gemma2", "gguf:f16"), ("phi3", "gguf:q8_0"),
                     ("phi3", "gguf:q4_k_m"), ("mistral_hd", "gguf:q4_0"), ("mistral_hd", "gguf:q6_k")):
        add(f"{arch}-to-{to.replace(':', '-')}", M / f"{arch}_nf4_dq", "--to", to, "-o", "out.gguf", *RUN)
    add("fp4-to-gguf-q8_0", M / "llama_fp4_nodq", "--to", "gguf:q8_0", "-o", "out.gguf", *RUN)
    add("int8-to-gguf-f16", M / "llama_int8", "--to", "gguf:f16", "-o", "out.gguf", *RUN)
    add("sharded-to-gguf-q5_k_m", M / "llama_nf4_dq_sharded", "--to", "gguf:q5_k_m", "-o", "out.gguf", *RUN)
    add("orig-bf16-to-gguf-q4_k_m", ORIG, "--to", "gguf:q4_k_m", "-o", "out.gguf", *RUN)

    # ---- other inputs
    add("sharded-to-bf16", M / "llama_nf4_dq_sharded", "--to", "bf16", "-o", "out", *RUN)
    add("sharded-to-auto", M / "llama_nf4_dq_sharded", "-o", "out", *RUN)
    add("bin-to-bf16", M / "llama_nf4_dq_bin", "--to", "bf16", "-o", "out", *RUN)
    add("bin-to-fp32", M / "llama_nf4_dq_bin", "--to", "fp32", "-o", "out", *RUN)
    add("int8-to-auto", M / "llama_int8", "-o", "out", *RUN)
    add("int8-to-fp16", M / "llama_int8", "--to", "fp16", "-o", "out", *RUN)
    add("fp4-to-auto", M / "llama_fp4_nodq", "-o", "out", *RUN)
    add("fp4-to-fp32", M / "llama_fp4_nodq", "--to", "fp32", "-o", "out", *RUN)
    add("qsbf16-to-bf16", M / "llama_nf4_dq_qsbf16", "--to", "bf16", "-o", "out", *RUN)
    add("orig-bf16-to-fp16", ORIG, "--to", "fp16", "-o", "out", *RUN)
    add("file-to-bf16", SINGLE / "nf4_bs64_dq_float16_3x40x72_outliers.q.safetensors", "--to", "bf16",
        "-o", "out.safetensors", *RUN)
    add("file-to-auto", SINGLE / "fp4_bs128_dq_float16_37x51_mixed.q.safetensors", "-o", "out.safetensors", *RUN)
    add("file-to-fp16-edge", SINGLE / "edge_nf4_zeroblocks_bs64_nodq_bfloat16_202.q.safetensors", "--to", "fp16",
        "-o", "out.safetensors", *RUN)
    add("file-to-fp32-bs4096", SINGLE / "nf4_bs4096_dq_float16_37x51_mixed.q.safetensors", "--to", "fp32",
        "-o", "out.safetensors", *RUN)
    add("file-pt-to-auto", SINGLE / "nf4_bs32_dq_bfloat16_37x51_normal.q.pt", "-o", "out.safetensors", *RUN)
    add("file-peer-int8", IN / "peer" / "llama_1b_int8.q.safetensors", "--to", "bf16", "-o", "out.safetensors",
        *RUN)
    add("file-default-name", "model-bnb-4bit.safetensors", "--to", "fp16", *RUN,
        setup=[copy(SINGLE / "nf4_bs32_dq_bfloat16_37x51_normal.q.safetensors", "model-bnb-4bit.safetensors")])
    add("file-into-dir", SINGLE / "nf4_bs32_dq_bfloat16_37x51_normal.q.safetensors", "--to", "bf16",
        "-o", "outdir/", *RUN, setup=[mkdir("outdir")])
    add("dir-default-name", "model-bnb-4bit", "--to", "bf16", *RUN, setup=[copy(LLAMA, "model-bnb-4bit")])
    add("dir-gguf-default-name", "model-bnb-4bit", "--to", "gguf:q8_0", *RUN, setup=[copy(LLAMA, "model-bnb-4bit")])
    add("dir-gguf-into-dir", LLAMA, "--to", "gguf:q4_0", "-o", "outdir/", *RUN, setup=[mkdir("outdir")])

    # ---- diffusion single file
    add("flux-auto", FLUX, "-o", "out.safetensors", *RUN)
    add("flux-bf16", FLUX, "--to", "bf16", "-o", "out.safetensors", *RUN)
    add("flux-fp32-json", FLUX, "--to", "fp32", "-o", "out.safetensors", "--json", *RUN)
    add("flux-bf16-to-nf4", FLUX_BF16, "--to", "nf4", "-o", "out.safetensors", *RUN)
    add("flux-inspect", "inspect", FLUX)
    add("flux-check", "check", FLUX)

    # ---- LoRA merge
    add("merge-bf16", LLAMA, "--to", "bf16", "--merge-lora", ADAPTER, "-o", "out", *RUN)
    add("merge-report", LLAMA, "--to", "bf16", "--merge-lora", ADAPTER, "--report", "merge.json", "-o", "out", *RUN)
    add("merge-report-original", LLAMA, "--to", "bf16", "--merge-lora", ADAPTER, "--report", "merge.json",
        "--original", ORIG, "-o", "out", *RUN)
    add("merge-twice-fp32", LLAMA, "--to", "fp32", "--merge-lora", ADAPTER, "--merge-lora", ADAPTER, "-o", "out",
        *RUN)
    add("merge-json", LLAMA, "--to", "bf16", "--merge-lora", ADAPTER, "-o", "out", "--json", *RUN)
    add("merge-gguf-q8_0", LLAMA, "--to", "gguf:q8_0", "--merge-lora", ADAPTER, "-o", "out.gguf", *RUN)
    add("merge-nf4", LLAMA, "--to", "nf4", "--merge-lora", ADAPTER, "-o", "out", *RUN)
    add("merge-gemma3-bf16", M / "gemma3_nf4_dq", "--to", "bf16", "--merge-lora", ADAPTER, "-o", "out", *RUN)
    add("merge-dry-run", LLAMA, "--to", "bf16", "--merge-lora", ADAPTER, "--dry-run", *RUN)

    # ---- re-quantization to NF4/FP4
    add("orig-to-nf4", ORIG, "--to", "nf4", "-o", "out", *RUN)
    add("orig-to-fp4-nodq-bs128", ORIG, "--to", "fp4", "--no-double-quant", "--blocksize", "128", "-o", "out", *RUN)
    add("orig-to-nf4-bs128-nodq", ORIG, "--to", "nf4", "--blocksize", "128", "--no-double-quant", "-o", "out", *RUN)
    add("orig-to-nf4-skip-modules", ORIG, "--to", "nf4", "--skip-modules", "down_proj,self_attn.o_proj",
        "-o", "out", *RUN)
    add("orig-to-nf4-qsbf16-report", ORIG, "--to", "nf4", "--quant-storage", "bfloat16", "--quant-report",
        "report.json", "-o", "out", *RUN)
    add("orig-to-nf4-double-quant-bs32", ORIG, "--to", "nf4", "--double-quant", "--blocksize", "32",
        "--torch-threads", "1", "-o", "out", *RUN)
    add("nf4-to-nf4-copy", LLAMA, "--to", "nf4", "-o", "out", *RUN)
    add("nf4-to-nf4-requantize", LLAMA, "--to", "nf4", "--requantize", "-o", "out", *RUN)
    add("nf4-to-fp4-qstorage-f32", LLAMA, "--to", "fp4", "--quant-storage", "float32", "-o", "out", *RUN)
    add("orig-to-nf4-json", ORIG, "--to", "nf4", "-o", "out", "--json", *RUN)
    add("file-orig-to-nf4-include", SINGLE / "edge_nf4_3elem_bs64_nodq_float32_3.orig.safetensors", "--to", "nf4",
        "--include", "layer.weight", "--no-double-quant", "-o", "out.safetensors", *RUN)

    # ---- sharding
    add("shard-bf16-1MB", LLAMA, "--to", "bf16", "--max-shard-size", "1MB", "-o", "out", *RUN)
    add("shard-fp32-3MiB", LLAMA, "--to", "fp32", "--max-shard-size", "3MiB", "-o", "out", *RUN)
    add("shard-nf4-500KB", ORIG, "--to", "nf4", "--max-shard-size", "500KB", "-o", "out", *RUN)
    add("shard-sharded-to-fp16-json", M / "llama_nf4_dq_sharded", "--to", "fp16", "--max-shard-size", "2MB",
        "-o", "out", "--json", *RUN)

    # ---- dry runs, json, misc options
    for to in ("bf16", "gguf:q4_k_m", "gguf:q8_0"):
        add(f"dry-run-{to.replace(':', '-')}", LLAMA, "--to", to, "--dry-run", *RUN)
        add(f"dry-run-json-{to.replace(':', '-')}", LLAMA, "--to", to, "--dry-run", "--json", *RUN)
    add("dry-run-orig-nf4", ORIG, "--to", "nf4", "--dry-run", *RUN)
    add("dry-run-json-orig-nf4", ORIG, "--to", "nf4", "--dry-run", "--json", *RUN)
    add("dry-run-sharded-1MB", M / "llama_nf4_dq_sharded", "--to", "fp32", "--max-shard-size", "1MB", "--dry-run",
        *RUN)
    add("json-bf16", LLAMA, "--to", "bf16", "-o", "out", "--json", *RUN)
    add("json-fp16-int8", M / "llama_int8", "--to", "fp16", "-o", "out", "--json", *RUN)
    add("json-gguf-q8_0", LLAMA, "--to", "gguf:q8_0", "-o", "out.gguf", "--json", *RUN)
    add("json-gguf-q4_k_m-gemma3", M / "gemma3_nf4_dq", "--to", "gguf:q4_k_m", "-o", "out.gguf", "--json", *RUN)
    add("quiet-bf16", LLAMA, "--to", "bf16", "-o", "out", "-q", *RUN)
    add("no-verify-bf16", LLAMA, "--to", "bf16", "-o", "out", "--no-verify", *RUN)
    add("debug-fp16", LLAMA, "--to", "fp16", "-o", "out", "--debug", *RUN)
    add("threads-1", LLAMA, "--to", "bf16", "-o", "out", "--threads", "1", "--max-memory", "256MiB")
    add("threads-lowered", LLAMA, "--to", "bf16", "-o", "out", "--threads", "64", "--max-memory", "64MiB")
    add("overwrite-dir", LLAMA, "--to", "bf16", "-o", "out", "--overwrite", *RUN, setup=[copy(ORIG, "out")])
    add("overwrite-gguf", LLAMA, "--to", "gguf:q8_0", "-o", "out.gguf", "--overwrite", *RUN,
        setup=[write("out.gguf", b"old file")])

    # ---- inspect and check
    add("inspect", "inspect", LLAMA)
    add("inspect-json", "inspect", LLAMA, "--json")
    add("inspect-stats", "inspect", LLAMA, "--stats")
    add("inspect-stats-json", "inspect", LLAMA, "--stats", "--json")
    add("inspect-stats-factors", "inspect", M / "llama_fp4_nodq", "--stats", "--outlier-factor", "2",
        "--flag-ratio", "3")
    add("inspect-sharded-shard-size", "inspect", M / "llama_nf4_dq_sharded", "--max-shard-size", "1MB")
    add("inspect-int8-json", "inspect", M / "llama_int8", "--json")
    add("inspect-qsbf16", "inspect", M / "llama_nf4_dq_qsbf16")
    add("inspect-file", "inspect", SINGLE / "fp4_bs256_dq_float32_3x40x72_normal.q.safetensors", "--stats")
    add("inspect-orig-bf16", "inspect", ORIG)
    add("check", "check", LLAMA)
    add("check-json", "check", LLAMA, "--json")
    add("check-gguf-q4_k_m", "check", LLAMA, "--to", "gguf:q4_k_m")
    add("check-gguf-q4_k_m-json-phi3", "check", M / "phi3_nf4_dq", "--to", "gguf:q4_k_m", "--json")
    add("check-quiet", "check", LLAMA, "-q")
    add("check-int8", "check", M / "llama_int8")
    add("check-sharded", "check", M / "llama_nf4_dq_sharded")
    add("check-bin", "check", M / "llama_nf4_dq_bin")
    add("check-truncated", "check", BAD / "truncated.safetensors")
    add("check-truncated-json", "check", BAD / "truncated.safetensors", "--json")
    add("check-garbage", "check", BAD / "garbage.safetensors")
    add("check-flux-gguf", "check", FLUX, "--to", "gguf:q8_0")
    add("check-no-config-gguf", "check", BAD / "llama_no_config", "--to", "gguf")

    # ---- batch
    jobs = jobs_text(
        "# three jobs",
        f"{LLAMA} --to bf16 --name a",
        f"{M / 'qwen3_nf4_dq'} --to gguf:q8_0",
        f"{M / 'llama_fp4_nodq'} --max-shard-size 1MB --name c",
    )
    add("batch", "batch", "jobs.txt", "--out-dir", "bout", *RUN, setup=[write("jobs.txt", jobs)])
    add("batch-json", "batch", "jobs.txt", "--out-dir", "bout", "--json", *RUN, setup=[write("jobs.txt", jobs)])
    add("batch-quiet-to-fp16", "batch", "jobs.txt", "--out-dir", "bout", "--to", "fp16", "-q", *RUN,
        setup=[write("jobs.txt", jobs)])
    add("batch-dry-run", "batch", "jobs.txt", "--out-dir", "bout", "--dry-run", *RUN,
        setup=[write("jobs.txt", jobs)])
    add("batch-dry-run-json", "batch", "jobs.txt", "--out-dir", "bout", "--dry-run", "--json", *RUN,
        setup=[write("jobs.txt", jobs)])
    add("batch-dry-run-push", "batch", "jobs.txt", "--out-dir", "bout", "--dry-run", "--push-to-hub", "my-org",
        *RUN, setup=[write("jobs.txt", jobs)])
    add("batch-rerun", "batch", "jobs.txt", "--out-dir", "bout", *RUN, setup=[write("jobs.txt", jobs)],
        pre=[["batch", "jobs.txt", "--out-dir", "bout", "-q", *RUN]])
    add("batch-changed-settings", "batch", "jobs.txt", "--out-dir", "bout", "--to", "fp16", *RUN,
        setup=[write("jobs.txt", jobs_text(f"{LLAMA} --name a"))],
        pre=[["batch", "jobs.txt", "--out-dir", "bout", "-q", *RUN]])
    add("batch-changed-settings-overwrite", "batch", "jobs.txt", "--out-dir", "bout", "--to", "fp16", "--overwrite",
        *RUN, setup=[write("jobs.txt", jobs_text(f"{LLAMA} --name a"))],
        pre=[["batch", "jobs.txt", "--out-dir", "bout", "-q", *RUN]])
    add("batch-json-jobs-file", "batch", "jobs.json", "--out-dir", "bout", *RUN, setup=[write("jobs.json", json.dumps(
        [f"{M / 'llama_int8'} --to bf16", {"src": str(LLAMA), "to": "gguf:q4_0", "name": "llama.gguf"}], indent=2))])
    add("batch-yaml-jobs-file", "batch", "jobs.yaml", "--out-dir", "bout", *RUN, setup=[write("jobs.yaml", (
        f"- {M / 'llama_nf4_dq_sharded'} --to fp32\n- src: {LLAMA}\n  to: nf4\n  name: renf4\n"))])
    add("batch-a-job-fails", "batch", "jobs.txt", "--out-dir", "bout", *RUN, setup=[write("jobs.txt", jobs_text(
        f"{LLAMA} --name ok", f"{IN / 'missing_model'} --name missing", f"{BAD / 'truncated.safetensors'}"))])
    add("batch-a-job-fails-json", "batch", "jobs.txt", "--out-dir", "bout", "--json", *RUN,
        setup=[write("jobs.txt", jobs_text(f"{LLAMA} --name ok", f"{FLUX} --to gguf --name flux"))])
    # --jobs 2: which job finishes first varies, so only the quiet and --json forms (job order) are recorded
    add("batch-jobs-2", "batch", "jobs.txt", "--out-dir", "bout", "--jobs", "2", "-q", *RUN,
        setup=[write("jobs.txt", jobs)])
    add("batch-jobs-2-json", "batch", "jobs.txt", "--out-dir", "bout", "--jobs", "2", "--json", *RUN,
        setup=[write("jobs.txt", jobs)])

    # ---- bad inputs
    add("bad-src-missing", IN / "does" / "not" / "exist", "--to", "bf16", "-o", "out", *RUN)
    add("bad-src-missing-json", IN / "does" / "not" / "exist", "--to", "bf16", "-o", "out", "--json", *RUN)
    add("bad-to-gguf-q9", LLAMA, "--to", "gguf:q9", "-o", "out", *RUN)
    add("bad-to-bf17", LLAMA, "--to", "bf17", "-o", "out", *RUN)
    add("bad-truncated", BAD / "truncated.safetensors", "--to", "bf16", "-o", "out.safetensors", *RUN)
    add("bad-header-only", BAD / "header_only.safetensors", "--to", "bf16", "-o", "out.safetensors", *RUN)
    add("bad-garbage", BAD / "garbage.safetensors", "--to", "bf16", "-o", "out.safetensors", *RUN)
    add("bad-garbage-json", BAD / "garbage.safetensors", "-o", "out.safetensors", "--json", *RUN)
    add("bad-empty-file", BAD / "empty.safetensors", "-o", "out.safetensors", *RUN)
    add("bad-header-not-json", BAD / "not_json_header.safetensors", "-o", "out.safetensors", *RUN)
    add("bad-evil-pickle", BAD / "evil.bin", "-o", "out.safetensors", *RUN)
    add("bad-empty-dir", BAD / "empty_dir", "-o", "out", *RUN)
    add("bad-output-exists", LLAMA, "--to", "bf16", "-o", "out", *RUN, setup=[copy(ORIG, "out")])
    add("bad-output-exists-file", LLAMA, "--to", "gguf", "-o", "out.gguf", *RUN, setup=[write("out.gguf", b"x")])
    add("bad-overwrite-subdirs", LLAMA, "--to", "bf16", "-o", "out", "--overwrite", *RUN,
        setup=[copy(ORIG, "out"), mkdir("out/sub")])
    add("bad-overwrite-cwd", LLAMA, "--to", "bf16", "-o", "./", "--overwrite", *RUN)
    add("bad-overwrite-cwd-by-name", LLAMA, "--to", "bf16", "-o", "../bad-overwrite-cwd-by-name", "--overwrite",
        *RUN, setup=[write("config.json", "{}")])
    add("bad-max-memory-small", LLAMA, "--to", "bf16", "-o", "out", "--threads", "2", "--max-memory", "1MiB")
    add("bad-max-memory-syntax", LLAMA, "--to", "bf16", "-o", "out", "--threads", "2", "--max-memory", "lots")
    add("bad-max-shard-size", LLAMA, "--to", "bf16", "-o", "out", "--max-shard-size", "5XB", *RUN)
    add("bad-threads-0", LLAMA, "--to", "bf16", "-o", "out", "--threads", "0", "--max-memory", "256MiB")
    add("bad-report-without-merge", LLAMA, "--to", "bf16", "-o", "out", "--report", "merge.json", *RUN)
    add("bad-original-without-merge", LLAMA, "--to", "bf16", "-o", "out", "--original", ORIG, *RUN)
    add("bad-o-dot", LLAMA, "--to", "bf16", "-o", ".", *RUN)
    add("bad-adapter-missing", LLAMA, "--to", "bf16", "--merge-lora", IN / "no_adapter", "-o", "out", *RUN)
    add("bad-adapter-empty", LLAMA, "--to", "bf16", "--merge-lora", BAD / "adapter_empty", "-o", "out", *RUN)
    add("bad-adapter-json", LLAMA, "--to", "bf16", "--merge-lora", BAD / "adapter_bad_json", "-o", "out", *RUN)
    add("bad-adapter-no-weights", LLAMA, "--to", "bf16", "--merge-lora", BAD / "adapter_no_weights", "-o", "out",
        *RUN)
    add("bad-adapter-rank-0", LLAMA, "--to", "bf16", "--merge-lora", BAD / "adapter_bad_rank", "-o", "out", *RUN)
    add("bad-adapter-shape-mistral_hd", M / "mistral_hd_nf4_dq", "--to", "bf16", "--merge-lora", ADAPTER,
        "-o", "out", *RUN)
    add("bad-adapter-keys-phi3", M / "phi3_nf4_dq", "--to", "bf16", "--merge-lora", ADAPTER, "-o", "out", *RUN)
    add("bad-blocksize", ORIG, "--to", "nf4", "--blocksize", "31", "-o", "out", *RUN)
    add("bad-quant-option-for-bf16", LLAMA, "--to", "bf16", "--blocksize", "128", "-o", "out", *RUN)
    add("bad-gguf-flux", FLUX, "--to", "gguf", "-o", "out.gguf", *RUN)
    add("bad-gguf-no-config", BAD / "llama_no_config", "--to", "gguf:q8_0", "-o", "out.gguf", *RUN)
    add("bad-gguf-bad-config", BAD / "llama_bad_config", "--to", "gguf:q8_0", "-o", "out.gguf", *RUN)
    add("bad-hub-offline", "nobody/nothing-bnb-4bit", "--to", "bf16", *RUN)
    add("bad-inspect-missing", "inspect", IN / "does" / "not" / "exist")
    add("bad-inspect-garbage-json", "inspect", BAD / "garbage.safetensors", "--json")
    add("bad-check-to-bf17", "check", LLAMA, "--to", "bf17")
    add("bad-batch-jobs-line", "batch", "jobs.txt", "--out-dir", "bout", *RUN,
        setup=[write("jobs.txt", jobs_text(f"{LLAMA} --name a", f"{LLAMA} --frobnicate"))])
    add("bad-batch-jobs-to", "batch", "jobs.txt", "--out-dir", "bout", *RUN,
        setup=[write("jobs.txt", jobs_text(f"{LLAMA} --to gguf:q9"))])
    add("bad-batch-jobs-duplicate-name", "batch", "jobs.txt", "--out-dir", "bout", *RUN,
        setup=[write("jobs.txt", jobs_text(f"{LLAMA} --name a", f"{M / 'llama_int8'} --name a"))])
    add("bad-batch-jobs-json", "batch", "jobs.json", "--out-dir", "bout", *RUN,
        setup=[write("jobs.json", '[{"src": "x", "colour": "red"}]')])
    add("bad-batch-jobs-missing", "batch", "nope.txt", "--out-dir", "bout", *RUN)
    add("bad-batch-no-out-dir", "batch", "jobs.txt", *RUN, setup=[write("jobs.txt", jobs)])
    add("bad-no-args")
    add("bad-unknown-option", LLAMA, "--frobnicate")
    return cmds


# ------------------------------------------------------------------------------------------ record


def child_env(tree: Path) -> dict[str, str]:
    """The environment of every command: ours without any PYTHON*/HF_* setting, then the fixed ones."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "HF_", "HUGGINGFACE_", "RAY_", "TQDM_", "LC_"))}
    env.update({
        "PYTHONPATH": str(tree),
        "PYTHONPYCACHEPREFIX": str(PYCACHE / hashlib.sha256(str(tree).encode()).hexdigest()[:16]),
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONNOUSERSITE": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(HF_HOME),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "COLUMNS": "80",
        "LC_ALL": "C.UTF-8",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
    })
    return env


def assert_imports_from(tree: Path, env: dict[str, str]) -> list[str]:
    """The packages the commands will import, checked to come from ``tree`` (not from an editable
    install of another checkout); returns their ``__file__``."""
    names = ["convert"] + (["formats"] if (tree / "formats").is_dir() else [])
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    print(importlib.import_module(n).__file__)"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=WORK, env=env, capture_output=True,
                          text=True, timeout=120)
    files = proc.stdout.split()
    root = tree.resolve()
    if proc.returncode != 0 or len(files) != len(names) or not all(
            Path(f).resolve().is_relative_to(root) for f in files):
        raise SystemExit(f"behaviour_snapshot: with PYTHONPATH={tree}, {names} import from {files} "
                         f"(not all inside {root}); exit {proc.returncode}: {proc.stderr.strip()}")
    return files


def run_convert(args: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``python -m convert ARGS`` and return its exit code and masked stdout/stderr."""
    try:
        proc = subprocess.run([sys.executable, "-m", "convert", *args], cwd=cwd, env=env, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=TIMEOUT)
        code: int | str = proc.returncode
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        out, err = exc.stdout or b"", exc.stderr or b""
    hits: set[str] = set()
    stdout = mask_text(out.decode("utf-8", "replace"), hits)
    stderr = mask_text(err.decode("utf-8", "replace"), hits)
    return {"exit_code": code, "stdout": stdout, "stderr": stderr, "masks_hit": sorted(hits)}


def prepare_inputs(tree: Path) -> list[dict[str, Any]]:
    """Wipe ROOT, copy TREE's fixtures to ``in/``, make the bad inputs; returns the inputs' listing."""
    fixtures = tree / "tests" / "fixtures"
    if not fixtures.is_dir():
        raise SystemExit(f"behaviour_snapshot: no fixtures at {fixtures}")
    if ROOT.exists():
        shutil.rmtree(ROOT)
    for d in (RUNS, HF_HOME, WORK):
        d.mkdir(parents=True)
    shutil.copytree(fixtures, IN, symlinks=True)
    make_bad_inputs()
    return [{"path": rel, **d} for rel, d in snapshot(IN).items()]


def record(out: Path, tree: Path, only: list[str] | None = None) -> int:
    """Run every command on ``tree`` and write the record to ``out``."""
    tree = tree.resolve()
    t_start = time.perf_counter()
    with open(LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SystemExit(f"behaviour_snapshot: another record is running ({LOCK} is held)") from None
        inputs = prepare_inputs(tree)
        env = child_env(tree)
        imported = assert_imports_from(tree, env)
        print(f"recording {tree} (convert from {imported[0]}) into {out}", file=sys.stderr)
        cmds = commands()
        names = [c.name for c in cmds]
        if len(set(names)) != len(names):
            raise SystemExit("behaviour_snapshot: duplicate command names")
        if only:
            cmds = [c for c in cmds if c.name in only]
        results: list[dict[str, Any]] = []
        for i, cmd in enumerate(cmds, 1):
            cwd = RUNS / cmd.name
            cwd.mkdir()
            for step in cmd.setup:
                step(cwd)
            pre = [{"args": a, **run_convert(a, cwd, env)} for a in cmd.pre]
            before = snapshot(cwd)
            inputs_before = quick_listing(IN)
            t0 = time.perf_counter()
            res = run_convert(cmd.args, cwd, env)
            seconds = time.perf_counter() - t0
            produced, removed = diff_snapshots(before, snapshot(cwd))
            inputs_after = quick_listing(IN)
            touched = sorted(rel for rel in set(inputs_before) | set(inputs_after)
                             if inputs_before.get(rel) != inputs_after.get(rel))
            results.append({"name": cmd.name, "argv": ["python", "-m", "convert", *cmd.args], "cwd": str(cwd),
                            "pre": pre, **res, "files": produced, "removed": removed,
                            "inputs_touched": touched, "seconds": round(seconds, 3)})
            print(f"[{i}/{len(cmds)}] {cmd.name}: exit {res['exit_code']}, {len(produced)} entries, "
                  f"{seconds:.1f} s", file=sys.stderr)
        total = time.perf_counter() - t_start
        rec = {"record_version": RECORD_VERSION, "tree": str(tree), "imported": imported,
               "python": sys.version, "executable": sys.executable, "root": str(ROOT), "masks": MASK_NAMES,
               "seconds": round(total, 1), "inputs": inputs, "commands": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"recorded {len(results)} commands in {total:.1f} s: {out}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------- compare

#: Fields of a command that are compared (``seconds``, ``cwd`` are not: ``cwd`` follows the name).
COMPARED = ("argv", "pre", "exit_code", "stdout", "stderr", "masks_hit", "files", "removed", "inputs_touched")


def _show(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.splitlines()
    return json.dumps(value, indent=1, sort_keys=True).splitlines()


def _diff(a: Any, b: Any, limit: int = 60) -> str:
    lines = list(difflib.unified_diff(_show(a), _show(b), "A", "B", lineterm="", n=1))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more diff lines)"]
    return "\n".join("    " + line for line in lines)


def compare(a_path: Path, b_path: Path) -> int:
    """Print every difference between two records; 1 if any, else 0."""
    a = json.loads(a_path.read_text(encoding="utf-8"))
    b = json.loads(b_path.read_text(encoding="utf-8"))
    problems = 0

    def report(where: str, what: str, x: Any, y: Any) -> None:
        nonlocal problems
        problems += 1
        print(f"DIFF {where}: {what}\n{_diff(x, y)}")

    for key in ("record_version", "root", "masks", "inputs"):
        if a.get(key) != b.get(key):
            report("(record)", key, a.get(key), b.get(key))
    ca = {c["name"]: c for c in a["commands"]}
    cb = {c["name"]: c for c in b["commands"]}
    for name in ca.keys() - cb.keys():
        problems += 1
        print(f"DIFF {name}: only in {a_path}")
    for name in cb.keys() - ca.keys():
        problems += 1
        print(f"DIFF {name}: only in {b_path}")
    common = [n for n in ca if n in cb]
    for name in common:
        for f in COMPARED:
            if ca[name].get(f) != cb[name].get(f):
                report(name, f, ca[name].get(f), cb[name].get(f))
    verdict = "identical" if problems == 0 else f"{problems} difference(s)"
    print(f"compared {len(common)} commands ({a_path}: {a.get('tree')}, {b_path}: {b.get('tree')}): {verdict}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="run the fixed commands on a tree and write the record")
    r.add_argument("out", type=Path, metavar="OUT.json")
    r.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent,
                   help="source tree whose convert package is run (default: this script's repository)")
    r.add_argument("--only", action="append", metavar="NAME", help="record only these commands (debugging)")
    c = sub.add_parser("compare", help="compare two records; exit 1 on any difference")
    c.add_argument("a", type=Path, metavar="A.json")
    c.add_argument("b", type=Path, metavar="B.json")
    args = p.parse_args(argv)
    if args.command == "record":
        return record(args.out, args.tree, args.only)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())

"""``convert-bnb SRC --to gguf[:TYPE] [-o model.gguf]``: the pipeline's dequantized tensors, written as GGUF.

The safetensors plan (:func:`convert.plan.make_plan` with ``--to auto``: each tensor in the dtype
bitsandbytes dequantizes it to) is built first and the CLI's plan hooks run on it (so ``--merge-lora``
composes); its sources then feed :func:`formats.gguf.write_gguf` by row ranges, each rounded once to
the GGUF type. As the safetensors pipeline: pre-flight checks, a temporary file beside the output,
verification by re-reading (``--no-verify`` skips it), then a rename.

Registered with the CLI as extra ``--to`` targets: ``gguf`` (F16) and ``gguf:f32`` ... ``gguf:q5_1``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from formats.checkpoint import Checkpoint
from formats.errors import CheckpointError, DiskSpaceError, OutputExistsError, OutputInsideInputError, UsageError
from formats.gguf import OUTPUT_TYPES, GGUFPlan, SourceTensor, TensorReport, parse_output_type, plan_gguf
from formats.gguf import verify_gguf as _verify_gguf
from formats.gguf import write_gguf as _write_gguf

from . import cli
from .pipeline import Summary, chunk_elements, cleanup_stale, peak_rss_bytes, remove_path, temp_path
from .plan import Plan, PlannedTensor, make_plan

__all__ = ["GGUF_TARGETS", "default_gguf_output", "plan_for_gguf", "run_gguf"]

#: ``--to`` values handled here.
GGUF_TARGETS = ["gguf"] + [f"gguf:{t}" for t in OUTPUT_TYPES]
#: Largest GGUF chunk (elements): float32 copy, encoding, decoded copy and error, about 20 bytes each.
_GGUF_BYTES_PER_ELEMENT = 24


def default_gguf_output(src: Path, to: str) -> Path:
    """``./model-bnb-4bit --to gguf:q8_0`` -> ``./model-bnb-4bit-gguf-q8_0.gguf`` (as for Hub repos)."""
    return src.with_name(f"{src.name if src.is_dir() else src.stem}-{to.replace(':', '-')}.gguf")


def _row_reader(t: PlannedTensor, max_memory: int, threads: int) -> Callable[[int, int], np.ndarray]:
    """rows(r0, r1) for a pipeline tensor: its Source's flat elements, block-aligned, in pieces of the
    pipeline's chunk size, input pages released as they are consumed. Called by the GGUF writer's
    worker threads (the parallelism is across row chunks, so this never waits on the pool)."""
    src = t.source
    cols = t.numel // t.shape[0] if t.shape and t.shape[0] else 1
    piece = chunk_elements(src.unit, max_memory, threads)

    def rows(r0: int, r1: int) -> np.ndarray:
        start, stop = r0 * cols, r1 * cols
        a0 = start // src.unit * src.unit
        a1 = min(t.numel, -(-stop // src.unit) * src.unit)
        bounds = list(range(a0, a1, piece)) + [a1]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        parts = [src.produce(s, e, t.dtype) for s, e in spans]
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
        for s, e in spans:
            src.release(s, e)
        return flat[start - a0 : stop - a0].reshape(r1 - r0, *t.shape[1:])

    return rows


def _rows_per_unit(t: PlannedTensor) -> int:
    """Rows in one chunk unit of the tensor's source, when the unit is whole rows (a LoRA merge)."""
    cols = t.numel // t.shape[0] if t.shape and t.shape[0] else 1
    unit = t.source.unit
    return unit // cols if cols and unit >= cols and unit % cols == 0 else 1


def _model_name(args: argparse.Namespace, ckpt: Checkpoint) -> str:
    """``general.name``: the directory's name, or the repo id for a Hub SRC (as llama.cpp names it)."""
    if Path(args.src).exists():
        return ckpt.source.resolve().name
    return str(args.src).split("@", 1)[0]


def plan_for_gguf(args: argparse.Namespace, ckpt: Checkpoint, out_type: str) -> tuple[Plan, GGUFPlan]:
    """The pipeline plan (``--to auto`` + the CLI's plan hooks) and the GGUF plan made from it.

    Raises:
        CheckpointError: SRC is not a model directory with config.json.
        UnsupportedError: GGUF-001..006 (from :func:`formats.gguf.plan_gguf`).
    """
    if not ckpt.is_dir or ckpt.config is None:
        raise CheckpointError(
            "GGUF output needs the model's config.json and tokenizer",
            path=ckpt.source,
            rule="GGUF-004",
            expected="a model directory",
            found="a lone weight file" if not ckpt.is_dir else "no config.json",
            hint="give the model directory (config.json, tokenizer files and weights)",
        )
    plan = make_plan(ckpt, "auto")
    for hook in cli.PLAN_HOOKS:
        plan = hook(args, plan)
    gplan = plan_gguf(
        plan.config or ckpt.config,  # the hooks may edit it (a LoRA-resized vocab_size)
        [(t.name, t.shape) for t in plan.tensors],
        ckpt.source,
        out_type,
        model_name=_model_name(args, ckpt),
        config_path=str(ckpt.source / "config.json"),
    )
    return plan, gplan


def _error_notes(out_type: str, reports: list[TensorReport]) -> list[str]:
    changed = [r for r in reports if r.max_abs_error > 0]
    if not changed:
        return [f"gguf {out_type}: every tensor equals the float weight (dequantized, merged) exactly"]
    worst = sorted(changed, key=lambda r: r.rel_rms_error, reverse=True)
    notes = [
        f"gguf {out_type}: {len(changed)} of {len(reports)} tensors differ from the dequantized weight "
        f"(rounding to {out_type}); relative RMS error per tensor up to {worst[0].rel_rms_error:.3g}, "
        "worst tensors below (all in --json)"
    ]
    for r in worst[:5]:
        notes.append(
            f"  {r.name:<28} {r.ggml_type.name:<5} rel RMS {r.rel_rms_error:.3g}, "
            f"RMS {r.rms_error:.3g}, max abs {r.max_abs_error:.3g}"
        )
    return notes


def run_gguf(args: argparse.Namespace, ckpt: Checkpoint) -> dict[str, Any] | None:
    """The ``--to gguf[:TYPE]`` job. Returns the summary dict, or None after printing a ``--dry-run``.

    Raises:
        OutputExistsError, DiskSpaceError, UsageError, CheckpointError, UnsupportedError,
        VerificationError: as the safetensors pipeline, plus the GGUF-xxx rules.
    """
    t0 = time.perf_counter()
    _, _, spec = args.to.partition(":")
    out_type = parse_output_type(spec or None)
    threads = max(1, args.threads or os.cpu_count() or 1)
    max_memory = args.max_memory
    if max_memory < 64 * 1024 * 1024:
        raise UsageError("--max-memory is too small", expected=">= 64MiB", found=max_memory)
    plan, gplan = plan_for_gguf(args, ckpt, out_type)
    src = Path(args.src)
    out = Path(args.output) if args.output else default_gguf_output(src, args.to)
    if args.dry_run:
        if args.json:
            print(
                json.dumps(
                    {
                        "source": str(ckpt.source),
                        "to": args.to,
                        "output": str(out),
                        "out_bytes": gplan.nbytes,
                        "metadata_keys": sorted(gplan.metadata),
                        "tensors": [
                            {
                                "name": t.name,
                                "source": t.source,
                                "type": t.ggml_type.name,
                                "shape": list(t.shape),
                                "bytes": t.nbytes,
                                "note": t.fallback,
                            }
                            for t in gplan.tensors
                        ],
                    },
                    indent=2,
                )
            )
        else:
            print(
                f"{ckpt.source} -> {out} (GGUF {gplan.arch.name}, {out_type}): {len(gplan.tensors)} tensors, "
                f"{gplan.nbytes} bytes of tensor data, {len(gplan.metadata)} metadata keys"
            )
            print("\n".join("  " + line for line in gplan.describe()))
        return None
    if out.exists() and not args.overwrite:
        raise OutputExistsError(
            "output exists", path=out, action="write", hint="pass --overwrite to replace it, or choose -o"
        )
    if out.is_dir():
        raise UsageError(
            "GGUF output is one file, and -o names a directory",
            path=out,
            action="write",
            hint="give a file name such as model.gguf",
        )
    if ckpt.source.resolve() in out.resolve().parents:
        raise OutputInsideInputError("output must not be the input or inside it", path=out, action="write")
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = Summary(output=str(out), notes=list(plan.notes))
    summary.removed_stale = cleanup_stale(out)
    need = gplan.nbytes + 64 * 1024 * 1024
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise DiskSpaceError(
            "not enough free disk space for the output",
            path=out.parent,
            action="write",
            expected=f">= {need} bytes free",
            found=f"{free} bytes free",
        )
    by_name = {t.name: t for t in plan.tensors}
    tmp = temp_path(out)
    bar = None
    try:
        if not args.quiet and not args.json and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(
                total=gplan.nbytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=out.name,
                file=sys.stderr,
                leave=False,
            )
        records = [
            SourceTensor(
                name,
                t.shape,
                rows=_row_reader(t, max_memory, threads),
                done=t.source.finish,
                row_align=_rows_per_unit(t),
            )
            for name, t in by_name.items()
        ]
        budget = max(max_memory - 96 * 1024 * 1024, 16 * 1024 * 1024)
        gchunk = max(1 << 16, min(1 << 22, budget // ((threads + 2) * _GGUF_BYTES_PER_ELEMENT)))
        reports = _write_gguf(
            gplan,
            tmp,
            records,
            chunk_elements=gchunk,
            threads=threads,
            progress=bar.update if bar is not None else None,
        )
        if args.verify:
            _verify_gguf(tmp, gplan)
        summary.bytes_out = tmp.stat().st_size
        os.replace(tmp, out)  # with --overwrite, the rename replaces the old file atomically
    except BaseException:
        remove_path(tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
    summary.tensors = len(gplan.tensors)
    summary.elements = sum(t.numel for t in gplan.tensors)
    summary.bytes_in = sum(by_name[t.source].source.in_nbytes for t in gplan.tensors if t.source in by_name)
    summary.seconds = time.perf_counter() - t0
    summary.gelem_per_s = summary.elements / summary.seconds / 1e9 if summary.seconds > 0 else 0.0
    summary.peak_rss_bytes = peak_rss_bytes()
    summary.notes += [f"{t.name}: {t.fallback}" for t in gplan.tensors if t.fallback and len(t.shape) > 1]
    summary.notes += _error_notes(out_type, reports)
    result = summary.to_dict()
    result["gguf"] = {
        "architecture": gplan.arch.name,
        "type": out_type,
        "tensors": [
            {
                "name": r.name,
                "source": r.source,
                "type": r.ggml_type.name,
                "shape": list(r.shape),
                "bytes": r.nbytes,
                "max_abs_error": r.max_abs_error,
                "rms_error": r.rms_error,
                "rel_rms_error": r.rel_rms_error,
            }
            for r in reports
        ],
    }
    for hook in cli.RESULT_HOOKS:  # e.g. the --merge-lora report
        hook(args, plan, result)
    return result


#: The CLI's plan hooks run on the plan here (convert.lora_cli checks this before --merge-lora).
run_gguf.merges_lora = True  # type: ignore[attr-defined]
for _target in GGUF_TARGETS:
    cli.EXTRA_TARGETS[_target] = run_gguf

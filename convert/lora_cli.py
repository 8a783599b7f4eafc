"""``--merge-lora ADAPTER`` (repeatable), ``--report merge.json`` and ``--original BASE16`` for the CLI.

Registered through the CLI's hooks (``PARSER_HOOKS``, ``PLAN_HOOKS``, ``RESULT_HOOKS``): after the
dequantization plan is made, every planned tensor an adapter touches gets its source wrapped in a
:class:`LoraSource`, which produces whole rows: it asks the wrapped source for the dequantized base
rows (in the output dtype), merges them with :meth:`convert.lora.TensorMerge.merge_rows` and hands the
merged rows on. The chunk unit becomes a multiple of both the layer's blocksize and
``ROW_ALIGN`` rows, so the pipeline's memory cap and threading apply to the merge unchanged.

A tensor whose rows the adapter resizes (a resized vocabulary) is taken from the adapter, its new
shape goes into the plan, and ``vocab_size`` in the output ``config.json`` is updated.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from formats.checkpoint import Checkpoint, open_checkpoint
from formats.dtypes import DType
from formats.errors import AdapterError, UsageError
from formats.peft import open_adapter

from . import cli
from .lora import ROW_ALIGN, MergePlan, MergeStats, TensorMerge, format_table, plan_merge
from .plan import Plan, PlannedTensor, Source

__all__ = ["LoraSource", "add_arguments", "apply_to_plan", "check_arguments", "report"]


class LoraSource(Source):
    """A planned tensor with one or more adapters merged in, produced in whole-row chunks.

    Args:
        inner: the source of the dequantized (or cast) base tensor.
        merge: the tensor's :class:`~convert.lora.TensorMerge`.
        stats: the run's shared report accumulator.
        original: the tensor in the original 16-bit model (for the quantization error), or None.
    """

    def __init__(self, inner: Source, merge: TensorMerge, stats: MergeStats, original: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.merge = merge
        self.name = inner.name
        self.shared_stats = stats
        self.original = original
        self.cols = math.prod(merge.shape[1:]) if len(merge.shape) > 1 else 1
        self.numel = math.prod(merge.shape)
        row_unit = self.cols * (ROW_ALIGN if len(merge.shape) > 1 else 1)
        self.unit = self.numel if merge.whole_tensor else math.lcm(inner.unit, row_unit)
        adapter_bytes = sum(
            r.nbytes for op in merge.ops for r in (op.lora_A, op.lora_B, op.magnitude, op.replacement) if r is not None
        )
        self.in_nbytes = (inner.in_nbytes if merge.needs_base else 0) + adapter_bytes
        kinds = "+".join(dict.fromkeys(op.kind if op.kind != "replace" else op.source for op in merge.ops))
        self.kind = (f"{inner.kind} + {kinds}" if merge.needs_base else f"{kinds} (from the adapter)")
        self.stats = inner.stats  # fp16 overflow counts of the base pass through
        self._stats_lock = threading.Lock()

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        if start % self.cols or stop % self.cols:
            raise AdapterError("merge chunks must hold whole rows", tensor=self.name, rule="LORA-010",
                               expected=f"multiples of {self.cols}", found=[start, stop])
        r0, r1 = start // self.cols, stop // self.cols
        base = None
        if self.merge.needs_base:
            base = self.inner.produce(start, stop, dtype).reshape((r1 - r0, *self.merge.base_shape[1:]))
        orig = None
        if self.original is not None:
            orig = self.original.array()[r0:r1]
        local = MergeStats()
        out = self.merge.merge_rows(base, r0, r1, dtype.numpy, local, orig)
        with self._stats_lock:
            self.shared_stats.add(local)
        return out.reshape(-1)

    def release(self, start: int, stop: int) -> None:
        if self.merge.needs_base:
            self.inner.release(start, stop)
        if self.original is not None:
            item = self.original.dtype.itemsize
            self.original.release(start * item, stop * item)

    def finish(self) -> None:
        self.inner.finish()
        self.merge.release()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--merge-lora``, ``--report`` and ``--original`` to the main parser."""
    g = p.add_argument_group("LoRA merge")
    g.add_argument("--merge-lora", action="append", default=[], metavar="ADAPTER", type=Path,
                   help="merge a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) "
                   "into the dequantized weights; repeatable, applied in order")
    g.add_argument("--report", type=Path, metavar="JSON",
                   help="write the per-tensor merge report (||B A|| scale, ||W||, ratio, quantization error)")
    g.add_argument("--original", type=Path, metavar="BASE16",
                   help="the 16-bit model before quantization: adds ||W16 - dequant(W4)|| to the report")


def check_arguments(args: argparse.Namespace) -> None:
    """CHECK_HOOK: refuse option combinations the merge cannot honour (never ignore --merge-lora).

    Raises:
        UsageError: ``--report`` / ``--original`` without ``--merge-lora``; ``--merge-lora`` with a
            ``--to`` target whose writer does not merge adapters (its runner lacks ``merges_lora = True``).
    """
    if not getattr(args, "merge_lora", None):
        for opt in ("report", "original"):
            if getattr(args, opt, None) is not None:
                raise UsageError(f"--{opt} needs --merge-lora")
        return
    runner = cli.EXTRA_TARGETS.get(args.to)
    if runner is not None and not getattr(runner, "merges_lora", False):
        raise UsageError(f"--merge-lora is not supported with --to {args.to} yet", found=args.to,
                         expected="--to auto, bf16, fp16 or fp32")
    for p in args.merge_lora:
        if not Path(p).exists():
            raise UsageError("adapter does not exist", path=p, hint="give a PEFT adapter directory")


_RUNS: dict[int, tuple[MergePlan, MergeStats, Checkpoint | None]] = {}


def apply_to_plan(args: argparse.Namespace, plan: Plan) -> Plan:
    """PLAN_HOOK: wrap the sources of every tensor the adapters touch (no-op without ``--merge-lora``).

    Raises:
        UsageError: ``--report`` / ``--original`` without ``--merge-lora``, or a non-float output tensor.
        AdapterError, UnsupportedError: the adapters do not fit the model (LORA-xxx).
    """
    adapters_paths: list[Path] = list(getattr(args, "merge_lora", None) or [])
    if not adapters_paths:
        return plan
    adapters = []
    try:
        for p in adapters_paths:
            adapters.append(open_adapter(p))
        merge = plan_merge(adapters, {t.name: t.shape for t in plan.tensors})
    except BaseException:
        for ad in adapters:
            ad.close()
        raise
    stats = merge.new_stats()
    original = open_checkpoint(args.original) if args.original is not None else None
    for i, t in enumerate(plan.tensors):
        tm = merge.get(t.name)
        if tm is None:
            continue
        if not t.dtype.is_float:
            raise UsageError("an adapter touches a tensor that is not floating point", tensor=t.name,
                             found=t.dtype.code)
        orig = None
        if original is not None and tm.needs_base and any(op.kind != "replace" for op in tm.ops):
            rec = original.tensors.get(t.name)
            if rec is None or rec.shape != tuple(tm.base_shape) or not rec.dtype.is_float:
                stats.notes.append(f"--original has no matching '{t.name}': no quantization error for it")
            else:
                orig = rec
        src = LoraSource(t.source, tm, stats, orig)
        plan.tensors[i] = PlannedTensor(t.name, t.dtype, tm.shape, src)
    if merge.shape_changes and plan.config is not None:
        _update_vocab(plan, merge)
    for name, (a, b) in merge.shape_changes.items():
        plan.notes.append(f"{name}: shape {list(a)} -> {list(b)}, taken from the adapter (resized vocabulary)")
    plan.notes.extend(f"LoRA: {n}" for n in stats.notes)
    plan.notes.append(
        f"merging {len(adapters)} adapter(s) into {len(merge.tensors)} tensor(s): "
        + ", ".join(str(p) for p in adapters_paths)
    )
    _RUNS[id(plan)] = (merge, stats, original)
    return plan


def _update_vocab(plan: Plan, merge: MergePlan) -> None:
    assert plan.config is not None
    for _name, (a, b) in merge.shape_changes.items():
        for cfg in (plan.config, plan.config.get("text_config")):
            if isinstance(cfg, dict) and cfg.get("vocab_size") == a[0] and a[0] != b[0]:
                cfg["vocab_size"] = b[0]
                plan.notes.append(f"config.json: vocab_size {a[0]} -> {b[0]}")


def report(args: argparse.Namespace, plan: Plan, summary: dict[str, Any]) -> None:
    """RESULT_HOOK: write ``--report``, add the report to the summary, print the short table."""
    run = _RUNS.pop(id(plan), None)
    if run is None:
        return
    merge, stats, original = run
    data = stats.to_json()
    data["adapters"] = [str(ad.path) for ad in merge.adapters]
    summary["lora_merge"] = data
    if args.report is not None:
        args.report.write_text(json.dumps(data, indent=2) + "\n")
    if not args.quiet and not args.json:
        print(format_table(stats, limit=40), file=sys.stderr)
    merge.close()
    if original is not None:
        original.close()


cli.PARSER_HOOKS.append(add_arguments)
cli.CHECK_HOOKS.append(check_arguments)
cli.PLAN_HOOKS.append(apply_to_plan)
cli.RESULT_HOOKS.append(report)

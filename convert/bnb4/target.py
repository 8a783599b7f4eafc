"""``--to nf4|fp4``: the dequantized (and merged) plan re-quantized in bitsandbytes' layout, written as
safetensors (:class:`Bnb4Job`).

Which tensors are quantized, and how, is :func:`convert.bnb4.plan.make_quant_plan`'s; the quantized plan
is written by :class:`convert.stream.safetensors_job.SafetensorsJob`, like every safetensors output. This
module adds what a 4-bit output reports: the notes of the summary and the per-weight quantization report
(``--quant-report``, ``--json``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from convert.bnb4.plan import QuantPlanInfo, make_quant_plan
from convert.bnb4.report import QuantReport
from convert.bnb4.settings import QuantSettings
from convert.bnb4.torch_reduce import TORCH_NUM_THREADS
from convert.options import SUMMARY_SAMPLE, ConvertOptions
from convert.stream.plan import Plan
from convert.stream.safetensors_job import SafetensorsJob

__all__ = ["Bnb4Job"]


def _patterns(values: tuple[str, ...]) -> list[str]:
    """``--skip-modules a,b --skip-modules c`` -> ``["a", "b", "c"]``."""
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


class Bnb4Job(SafetensorsJob):
    """The 4-bit writer of one conversion (a :class:`convert.targets.TargetJob`).

    The pre-pass over nested layers (their QuantState JSON length must be known before writing) runs
    here, except for ``--dry-run``.

    Args:
        plan: the dequantization plan (``to="auto"``, merges applied).
        options: the conversion's options (``to`` of the bnb4 family, ``quant``, ``max_memory``,
            ``threads``, ``max_shard_size``, ``dry_run``, ``merge_report``).
        model_name: unused (the 4-bit output names no model).

    Raises:
        QuantStorageSizeError: QNT-005; NonFiniteWeightError: QNT-003 (from the pre-pass).
    """

    #: (:attr:`convert.targets.TargetJob.work_per_weight`: nf4 -> fp4 of the bench model, one thread, 5.9 s of CPU
    #: beyond the start against bf16's 1.15; a layer copied as it is reads no shared block and counts nothing)
    work_per_weight = 5.0

    def __init__(self, plan: Plan, options: ConvertOptions, model_name: str = "") -> None:
        q = options.quant
        assert options.to.quant_type is not None
        settings = QuantSettings(
            options.to.quant_type,
            64 if q.blocksize is None else q.blocksize,
            True if q.double_quant is None else q.double_quant,
            q.quant_storage or "uint8",
            num_threads=TORCH_NUM_THREADS if q.torch_threads is None else q.torch_threads,
        )
        # exact figures for --quant-report and --json; the summary's alone from one piece in SUMMARY_SAMPLE
        self.sample = 1 if q.quant_report is not None or options.merge_report else SUMMARY_SAMPLE
        self.quant_report = q.quant_report
        qplan, self.info = make_quant_plan(
            plan, settings, skip=_patterns(q.skip_modules), include=_patterns(q.include),
            max_memory=options.max_memory, threads=options.worker_threads,
            max_shard_size=options.max_shard_size, requantize=q.requantize, report=not options.dry_run,
            report_sample=self.sample, prepass=not options.dry_run,
        )
        qplan.notes += _plan_notes(settings, self.info)
        super().__init__(qplan)
        self.elements = sum(t.numel for t in plan.tensors)  # the dequantized model's values, not packed bytes

    def _reports(self) -> list[QuantReport]:
        return [j.report for j in self.info.jobs if j.report is not None]

    def details(self) -> dict[str, Any]:
        rows = [r.as_dict() for r in self._reports()]
        if self.quant_report is not None:
            self.quant_report.write_text(json.dumps(rows, indent=2) + "\n")
        return {"quantized": len(self.info.jobs), "passthrough": len(self.info.passthrough), "report": rows}

    def notes(self) -> list[str]:
        done = self._reports()
        if not done:
            return super().notes()
        errs = [float(r.rel_error) for r in done]
        flagged = sorted((r for r in done if r.outlier), key=lambda r: -r.outlier_zero_share)
        where = f" (on a 1/{self.sample} sample of each weight)" if self.sample > 1 else ""
        out = [f"relative error{where}: mean {np.mean(errs):.4f}, max {max(errs):.4f}; {len(flagged)} of {len(done)} "
               "layers have outlier blocks (absmax > 10x the layer median)"]
        if flagged:
            worst = ", ".join(f"{r.name} ({r.outlier_blocks} blocks, {100 * r.outlier_zero_share:.0f}% "
                              f"of their weights -> 0)" for r in flagged[:3])
            out.append(f"most affected: {worst}" + ("; all layers in --quant-report or --json" if self.sample > 1
                                                    else ""))
        return super().notes() + out


def _plan_notes(settings: QuantSettings, info: QuantPlanInfo) -> list[str]:
    """What the quantized plan will do: the weights quantized and copied, and patterns that matched nothing."""
    notes = [
        f"{len(info.jobs)} weights quantized to {settings.quant_type} (blocksize {settings.blocksize}, "
        f"double quant {'on' if settings.nested else 'off'}, storage {settings.quant_storage})"
        + (f", {len(info.passthrough)} copied unchanged" if info.passthrough else "")
    ]
    for option, missed in info.unmatched.items():
        notes.append(f"{option} {', '.join(repr(p) for p in missed)}: no module of the input matches "
                     "(a module name, a suffix of one, or a regular expression matched from the start)")
    return notes

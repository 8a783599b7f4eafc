"""What ``--to`` can be: a static table from each target to the writer that makes it.

=========================  ===============================  ==========================================
``--to``                    dequantize the input to           writer (prepared from the plan)
=========================  ===============================  ==========================================
auto, bf16, fp16, fp32     the same value                    :class:`SafetensorsJob` (safetensors file
                                                             or sharded model directory)
nf4, fp4                   auto (each QuantState's dtype)    :func:`prepare_bnb4`: re-quantized in
                                                             bnb's layout, written as safetensors
gguf, gguf:TYPE            auto                              :class:`convert.gguf.target.GgufJob`
=========================  ===============================  ==========================================

Every writer is a :class:`TargetJob`: it knows its output's kind and size before anything is
written (for the output claim's pre-flight), describes its plan (``--dry-run``), writes into the
staging path it is given, verifies what it wrote, and reports what it did. The output protocol
(naming, claim, commit) is :mod:`convert.output`'s, the same for all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from convert.output import ShardLedger
from convert.stream.pipeline import RunSettings, verify_plan, write_plan
from convert.stream.plan import TARGETS as FLOAT_TARGETS
from convert.stream.plan import Plan
from formats.errors import UsageError

if TYPE_CHECKING:
    from convert.job import ConvertOptions

__all__ = [
    "TARGETS", "RunSettings", "SafetensorsJob", "Target", "TargetJob", "normalize_target", "prepare_bnb4", "target_for",
]


class TargetJob(Protocol):
    """A prepared writer of one target."""

    #: whether the output is a directory (else one file), and the suffix of a file output
    is_dir: bool
    file_suffix: str
    #: planned bytes of the output, tensors written, values converted (the model's, in its dequantized
    #: shapes), tensor bytes read
    out_nbytes: int
    tensors: int
    elements: int
    in_nbytes: int

    def plan_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``--dry-run --json``)."""

    def describe(self) -> str:
        """The plan as a table (``--dry-run``)."""

    def write(self, staging: Path, run: RunSettings, ledger: ShardLedger | None) -> tuple[int, int]:
        """Write the output into ``staging``; ``(files written, files reused from the ledger)``."""

    def verify(self, staging: Path) -> None:
        """Re-read what was written; raise VerificationError (OUT-003) or GgufVerificationError."""

    def notes(self) -> list[str]:
        """Things the user should know, after writing."""

    def details(self) -> dict[str, Any]:
        """Target-specific results for ``--json``."""

    def fp16_counts(self) -> tuple[int, int]:
        """Values that overflowed to inf / flushed to zero when rounded to float16."""


class SafetensorsJob:
    """A :class:`~convert.stream.plan.Plan` written as safetensors (``--to auto|bf16|fp16|fp32``, and the
    re-quantized plan of ``--to nf4|fp4``).

    Args:
        plan: the plan to write.
        extra_details: called after writing for target-specific results (the 4-bit report).
        extra_notes: called after writing for notes beyond the plan's.
        elements: the values converted (default: the plan's elements; the re-quantized plan gives the
            dequantized model's, not its packed bytes').
    """

    file_suffix = ".safetensors"

    def __init__(self, plan: Plan, extra_details: Callable[[], dict[str, Any]] | None = None,
                 extra_notes: Callable[[], list[str]] | None = None, elements: int | None = None) -> None:
        self.plan = plan
        self.is_dir = plan.checkpoint.is_dir
        self.out_nbytes = plan.out_nbytes
        self.tensors = len(plan.tensors)
        self.elements = sum(t.numel for t in plan.tensors) if elements is None else elements
        self.in_nbytes = plan.in_nbytes
        self._extra_details = extra_details
        self._extra_notes = extra_notes

    def plan_dict(self) -> dict[str, Any]:
        return self.plan.to_dict()

    def describe(self) -> str:
        return self.plan.describe()

    def write(self, staging: Path, run: RunSettings, ledger: ShardLedger | None) -> tuple[int, int]:
        return write_plan(self.plan, staging, run, ledger)

    def verify(self, staging: Path) -> None:
        verify_plan(self.plan, staging)

    def notes(self) -> list[str]:
        return list(self.plan.notes) + (self._extra_notes() if self._extra_notes else [])

    def details(self) -> dict[str, Any]:
        return self._extra_details() if self._extra_details else {}

    def fp16_counts(self) -> tuple[int, int]:
        over = sum(int(t.source.stats[0]) for t in self.plan.tensors)
        under = sum(int(t.source.stats[1]) for t in self.plan.tensors)
        return over, under


def prepare_safetensors(plan: Plan, options: ConvertOptions, model_name: str) -> TargetJob:
    """``--to auto|bf16|fp16|fp32``: the dequantization plan as it is."""
    return SafetensorsJob(plan)


def _patterns(values: tuple[str, ...]) -> list[str]:
    """``--skip-modules a,b --skip-modules c`` -> ``["a", "b", "c"]``."""
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def prepare_bnb4(plan: Plan, options: ConvertOptions, model_name: str) -> TargetJob:
    """``--to nf4|fp4``: the dequantized (and merged) plan re-quantized in bitsandbytes' layout.

    The pre-pass over nested layers (their QuantState JSON length must be known before writing)
    runs here, except for ``--dry-run``. The per-weight quantization report goes into the result
    and, with ``quant_report``, to that file.
    """
    import os

    from convert.bnb4.plan import make_quant_plan
    from convert.bnb4.report import SUMMARY_SAMPLE
    from convert.bnb4.settings import QuantSettings
    from convert.bnb4.torch_reduce import TORCH_NUM_THREADS

    q = options.quant
    settings = QuantSettings(
        options.to,
        64 if q.blocksize is None else q.blocksize,
        True if q.double_quant is None else q.double_quant,
        q.quant_storage or "uint8",
        num_threads=TORCH_NUM_THREADS if q.torch_threads is None else q.torch_threads,
    )
    # exact figures for --quant-report and --json; the summary's alone from one piece in SUMMARY_SAMPLE
    sample = 1 if q.quant_report is not None or options.merge_report else SUMMARY_SAMPLE
    qplan, info = make_quant_plan(
        plan, settings, skip=_patterns(q.skip_modules), include=_patterns(q.include),
        max_memory=options.max_memory, threads=max(1, options.threads or os.cpu_count() or 1),
        max_shard_size=options.max_shard_size, requantize=q.requantize, report=not options.dry_run,
        report_sample=sample,
        prepass=not options.dry_run,
    )
    qplan.notes.append(
        f"{len(info.jobs)} weights quantized to {settings.quant_type} (blocksize {settings.blocksize}, "
        f"double quant {'on' if settings.nested else 'off'}, storage {settings.quant_storage})"
        + (f", {len(info.passthrough)} copied unchanged" if info.passthrough else "")
    )
    for option, missed in info.unmatched.items():
        qplan.notes.append(f"{option} {', '.join(repr(p) for p in missed)}: no module of the input matches "
                           "(a module name, a suffix of one, or a regular expression matched from the start)")

    def reports() -> list[Any]:
        return [j.report for j in info.jobs if j.report is not None]

    def details() -> dict[str, Any]:
        rows = [r.as_dict() for r in reports()]
        if q.quant_report is not None:
            q.quant_report.write_text(json.dumps(rows, indent=2) + "\n")
        return {"quantized": len(info.jobs), "passthrough": len(info.passthrough), "report": rows}

    def notes() -> list[str]:
        done = reports()
        if not done:
            return []
        errs = [float(r.rel_error) for r in done]
        flagged = sorted((r for r in done if r.outlier), key=lambda r: -r.outlier_zero_share)
        where = f" (on a 1/{sample} sample of each weight)" if sample > 1 else ""
        out = [f"relative error{where}: mean {np.mean(errs):.4f}, max {max(errs):.4f}; {len(flagged)} of {len(done)} "
               "layers have outlier blocks (absmax > 10x the layer median)"]
        if flagged:
            worst = ", ".join(f"{r.name} ({r.outlier_blocks} blocks, {100 * r.outlier_zero_share:.0f}% "
                              f"of their weights -> 0)" for r in flagged[:3])
            out.append(f"most affected: {worst}" + ("; all layers in --quant-report or --json" if sample > 1
                                                    else ""))
        return out

    return SafetensorsJob(qplan, details, notes, elements=sum(t.numel for t in plan.tensors))


def prepare_gguf(plan: Plan, options: ConvertOptions, model_name: str) -> TargetJob:
    """``--to gguf[:TYPE]``: see :mod:`convert.gguf.target`."""
    from convert.bnb4.report import SUMMARY_SAMPLE
    from convert.gguf.encode import check_encoders
    from convert.gguf.target import GgufJob

    # exact error figures for --json; the summary's alone from one piece in SUMMARY_SAMPLE
    job = GgufJob(plan, options.to, model_name, sample=1 if options.merge_report else SUMMARY_SAMPLE)
    if not options.dry_run:
        check_encoders(job.gplan)  # GGUF-002 before any output is claimed (a mix needs K-quant codecs)
    return job


@dataclass(frozen=True)
class Target:
    """One row of :data:`TARGETS`.

    Attributes:
        dequantize_to: ``--to`` value -> the ``to`` of :func:`convert.stream.plan.make_plan` that feeds the
            writer.
        prepare: ``(plan, options, model name) -> TargetJob``.
    """

    dequantize_to: Callable[[str], str]
    prepare: Callable[[Plan, ConvertOptions, str], TargetJob]


def _gguf_input(to: str) -> str:
    """``fp32`` for the GGUF types llama.cpp makes from an f32 file (see
    :data:`convert.gguf.plan.FLOAT32_INPUT`), else each tensor's own dtype (``auto``)."""
    from convert.gguf.plan import FLOAT32_INPUT, parse_output_type

    return "fp32" if parse_output_type(to.partition(":")[2] or None) in FLOAT32_INPUT else "auto"


def _gguf_types() -> list[str]:
    from convert.gguf.target import OUTPUT_TYPES

    return list(OUTPUT_TYPES)


#: Every target family; :func:`target_for` maps a ``--to`` value to its row.
TARGETS: dict[str, Target] = {
    **{name: Target(lambda to: to, prepare_safetensors) for name in FLOAT_TARGETS},
    "nf4": Target(lambda to: "auto", prepare_bnb4),
    "fp4": Target(lambda to: "auto", prepare_bnb4),
    "gguf": Target(_gguf_input, prepare_gguf),
}


def target_names() -> list[str]:
    """Every accepted ``--to`` value, for ``--help`` and error messages (in lower case;
    :func:`normalize_target` accepts any case, as llama.cpp spells its types: ``gguf:Q4_K_M``)."""
    return list(TARGETS) + [f"gguf:{t}" for t in _gguf_types()]


def normalize_target(to: str) -> str:
    """A ``--to`` value in lower case, as every target is named (``GGUF:Q4_K_M`` -> ``gguf:q4_k_m``,
    ``BF16`` -> ``bf16``). The ``--to`` type of every command, applied before its choices are checked."""
    return to.strip().lower()


def target_for(to: str) -> str:
    """The :data:`TARGETS` row of a ``--to`` value (``gguf:q8_0`` -> ``gguf``).

    Raises:
        UsageError: an unknown value (USE-001), listing the accepted ones.
        GgufTypeError: ``gguf:TYPE`` with a type that is not written (GGUF-002).
    """
    if to in TARGETS:
        return to
    family, sep, spec = to.partition(":")
    if sep and family == "gguf":
        from convert.gguf.target import parse_output_type

        parse_output_type(spec)  # GgufTypeError (GGUF-002) for a type we do not write
        return family
    raise UsageError(f"unknown --to value '{to}'", expected=target_names(), found=to)

"""``convert-bnb check SRC``: validate a file, a model directory or a PEFT LoRA adapter, write nothing, report
every problem.

Conversion stops at the first broken rule; ``check`` goes on past every problem it can step over
(a missing shard, a damaged tensor entry, a broken layer) so one run lists them all. It runs the
same rules as a conversion -- the container (ST-xxx), the directory (CKPT-xxx) and every layer
(BNB-xxx, including BNB-012: the absmax of every 4-bit layer is resolved and checked for inf/NaN)
-- so a clean ``check`` means the conversion will not fail on its input.

With ``--to TARGET`` the target's own planning runs too, from the headers, config.json and tokenizer
(for ``gguf[:TYPE]``: the architecture, every hyperparameter and RoPE key the GGUF writer reads, the
tokenizer, GGUF-001..006), so a clean ``check --to TARGET`` means ``--to TARGET`` will not fail on
its input either. Without it, ``check`` asks what every target needs (``--to auto``).

Exit code 0 when clean, 2 when a problem was found; ``--json`` prints the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convert.options import AUTO, DEFAULT_MIX, ConvertOptions, MixOptions, Target, target_for
from convert.run.adapter import base_model, check_adapter_options
from convert.run.several import auto_twin
from convert.run.source import resolve_source
from convert.stream.plan import make_plan
from convert.stream.sources import Dequant4Source
from convert.targets import ADAPTER_JOB, TARGETS
from formats.bnb import Int8Layer, QuantizedLayer, is_int8_config
from formats.bnb_layers import group_layers
from formats.checkpoint import Checkpoint, open_checkpoint
from formats.errors import ConvertBnbError, NonFiniteAbsmaxError
from formats.peft import is_adapter_dir, open_adapter

__all__ = ["CheckReport", "check_source"]


@dataclass
class CheckReport:
    """What ``check`` found.

    Attributes:
        source: the path checked.
        problems: every problem found, in the order found.
        files: weight files read without a problem of their own (container rules).
        tensors: tensors whose header entries are valid and whose bytes are in the file (a truncated
            file's readers leave out the tensors past its end).
        layers_4bit: 4-bit layers that passed every BNB rule.
        layers_int8: LLM.int8 layers that passed.
        plain: tensors that are not part of a bnb layer.
        notes: what is unusual but accepted (e.g. a BF16 absmax written by bnb's CPU path).
    """

    source: str
    problems: list[ConvertBnbError] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    layers_4bit: int = 0
    layers_int8: int = 0
    plain: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready report (``--json``)."""
        return {
            "source": self.source,
            "ok": self.ok,
            "files": self.files,
            "tensors": self.tensors,
            "layers_4bit": self.layers_4bit,
            "layers_int8": self.layers_int8,
            "plain": self.plain,
            "problems": [p.to_dict() for p in self.problems],
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """One line per problem, then a summary line."""
        lines = [str(p) for p in self.problems] + [f"note: {n}" for n in self.notes]
        counts = (f"{self.files} file{'s' * (self.files != 1)}, {self.tensors} tensors, "
                  f"{self.layers_4bit} 4-bit layers, {self.layers_int8} int8 layers, {self.plain} plain tensors")
        if self.ok:
            lines.append(f"{self.source}: OK ({counts})")
        else:
            n = len(self.problems)
            lines.append(f"{self.source}: {n} problem{'s' * (n != 1)} (valid: {counts})")
        return "\n".join(lines)


def check_source(path: str | os.PathLike[str], to: Target | str = AUTO, model_name: str | None = None,
                 base: str | None = None, mix: MixOptions = DEFAULT_MIX) -> CheckReport:
    """Run every input rule on a file or directory and collect all problems; nothing is written.

    Args:
        path: a weight file or a model directory.
        to: the target (a ``--to`` string is parsed here); when the input is clean, the target's planning
            runs too (its first problem is reported, or the ``--to`` value's own).
        model_name: the model's id for the target (GGUF: what ``general.*`` is made of with the
            directory, :mod:`convert.gguf.general`; a Hub repo's id; default the directory's name).
        base: for a PEFT LoRA adapter directory: its base model (``--base``; default the adapter config's),
            whose config.json plans the GGUF adapter with ``to`` ``gguf[:TYPE]`` (:func:`_check_adapter`).
        mix: llama-quantize's options for a ``gguf:TYPE`` of its types (the importance matrix is read and
            matched against the plan, as the conversion does).

    Returns:
        the :class:`CheckReport` (``report.ok`` is True when clean).

    Raises:
        Nothing of ours: every :class:`~formats.errors.ConvertBnbError` is collected in the report.
    """
    report = CheckReport(os.fspath(path))
    problems = report.problems
    try:
        target: Target | ConvertBnbError = to if isinstance(to, Target) else target_for(to)
    except ConvertBnbError as exc:  # reported where the target's planning would be
        target = exc
    if is_adapter_dir(path):
        _check_adapter(report, path, target, base, model_name)
        return report
    try:
        ckpt = open_checkpoint(path, problems)
    except ConvertBnbError as exc:
        problems.append(exc)
        return report
    with ckpt:
        damaged = len(problems)
        # files that broke a container rule: some of their tensors may be missing from the map
        broken = {p.path for p in problems if (p.rule or "").startswith(("ST-", "PT-"))}
        report.files = sum(1 for f in ckpt.files if os.fspath(f) not in broken)
        report.tensors = len(ckpt.tensors)
        if not problems:
            try:
                ckpt.require_tensors()
                if not (isinstance(target, Target) and all(t.family == "gguf" for t in target.targets)):
                    # (GGUF-006 checks it for GGUF)
                    ckpt.check_config()
            except ConvertBnbError as exc:
                problems.append(exc)
        try:
            layers, plain = group_layers(ckpt.tensors, ckpt.values, problems,
                                         int8_model=is_int8_config(ckpt.config))
        except ConvertBnbError as exc:  # pragma: no cover - group_layers collects
            problems.append(exc)
            return report
        if broken:
            # a component whose weight sat in the damaged part of a file is a follow-on, not a cause
            # (and a weight in a damaged file whose QuantState was cut off with it)
            orphans = [p for p in problems[damaged:] if p.rule == "BNB-010" and p.path in broken]
            cut = [p for p in problems[damaged:] if p.rule == "BNB-011" and p.path in broken]
            if orphans or cut:
                problems[:] = [p for p in problems if p not in orphans and p not in cut]
            if orphans:
                report.notes.append(f"{len(orphans)} QuantState components whose weight is in a damaged file "
                                    "were not checked")
            if cut:
                report.notes.append(f"{len(cut)} 4-bit weights in a damaged file whose QuantState is missing from "
                                    "it were not checked")
        report.plain = len(plain)
        for layer in layers.values():
            if isinstance(layer, QuantizedLayer):
                try:
                    Dequant4Source(layer).absmax()  # BNB-012, after undoing double quantization
                except ConvertBnbError as exc:
                    problems.append(exc)
                    continue
                report.layers_4bit += 1
            elif isinstance(layer, Int8Layer):
                scb = np.asarray(layer.scb.array(), dtype=np.float32).reshape(-1)
                finite = np.isfinite(scb)
                if not finite.all():  # BNB-012, as the conversion checks it
                    j = int(np.argmin(finite))
                    problems.append(NonFiniteAbsmaxError(
                        "SCB must be finite", path=layer.scb.file, tensor=layer.scb.name,
                        expected="finite values", found=f"{scb[j]} at row {j}",
                    ))
                    continue
                report.layers_int8 += 1
        seen: set[str] = set()
        for layer in layers.values():
            for w in getattr(layer, "warnings", ()):
                if w not in seen:
                    seen.add(w)
                    report.notes.append(f"{w} (e.g. {layer.name})")
        if not problems and (not isinstance(target, Target) or target != AUTO):
            _check_target(ckpt, target, model_name, problems, mix)
    return report


def _check_target(ckpt: Checkpoint, target: Target | ConvertBnbError, model_name: str | None,
                  problems: list[ConvertBnbError], mix: MixOptions = DEFAULT_MIX) -> None:
    """Plan the target (each of several) as the conversion would (no data is read); the first problem of each
    (or the problem of the ``--to`` value itself) joins ``problems``."""
    if not isinstance(target, Target):
        problems.append(target)
        return
    try:
        twin = auto_twin(ckpt, target)  # (auto beside the float target it comes to: refused as a run refuses it)
    except ConvertBnbError:
        twin = None  # (the targets' own planning below reports it)
    if twin is not None:
        problems.append(twin)
    for one in target.targets:
        try:
            options = ConvertOptions(src=str(ckpt.source), to=one, mix=mix if one.llama_quantize else DEFAULT_MIX)
            plan = make_plan(ckpt, one.dequantize_to)
            TARGETS[one.family](plan, options, model_name or ckpt.source.resolve().name)
        except ConvertBnbError as exc:
            problems.append(exc)


def _check_adapter(report: CheckReport, path: str | os.PathLike[str], target: Target | ConvertBnbError,
                   base: str | None, model_name: str | None = None) -> None:
    """A PEFT LoRA adapter directory: its rules (LORA-001..013), and with ``--to gguf[:TYPE]`` its GGUF adapter
    planned against its base's config.json (:func:`convert.run.adapter.base_model`) and every value read (LORA-014), as
    the conversion would; the first problem joins the report."""
    try:
        if not isinstance(target, Target):
            raise target
        options = ConvertOptions(src=os.fspath(path), to=target, base=base, dry_run=True)
        if target != AUTO:
            check_adapter_options(options)
        with open_adapter(path) as adapter:
            report.files, report.tensors = 1, len(adapter.tensors)
            report.plain = report.tensors
            if target.family == "gguf":
                job = ADAPTER_JOB(adapter, base_model(base, adapter), options, model_name)
                for t in job.plan.tensors:
                    t.source.produce(0, t.numel, t.dtype)  # LORA-014, as when it is written
    except ConvertBnbError as exc:
        report.problems.append(exc)


DESCRIPTION = ("Validate a .safetensors file or a model directory against every rule (docs/errors.md) without "
               "writing anything, and report every problem found. Exit 0 when clean, 2 otherwise.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``convert-bnb check``."""
    p.add_argument("src", metavar="SRC", help="a .safetensors / .bin / .pt file, a model directory or a Hub repo "
                   "id org/name")
    p.add_argument("--revision", default=None, help="with a Hub repo id: branch, tag or commit sha")
    p.add_argument("--to", default="auto", metavar="TARGET",
                   help="also plan this target from the headers, config.json and tokenizer (e.g. gguf:q8_0): "
                   "a clean check then means --to TARGET will not fail on the input")
    p.add_argument("--base", default=None, metavar="MODEL",
                   help="with a PEFT LoRA adapter directory as SRC and --to gguf[:TYPE]: its base model (a directory "
                   "or Hub repo id; default: the adapter config's base_model_name_or_path)")


def run_command(args: argparse.Namespace) -> int:
    """``convert-bnb check``: print the report; exit 0 when clean, 2 otherwise.

    ``--json`` prints the report as JSON; ``--quiet`` prints nothing when clean and only the problems,
    one line each on stderr, otherwise (no notes, no summary).
    """

    try:
        src = resolve_source(args.src, args.revision)  # a Hub repo id is fetched into the HF cache
        report = check_source(src.path, args.to, src.hub.repo_id if src.hub is not None else None, args.base)
    except ConvertBnbError as exc:
        report = CheckReport(str(args.src), [exc])
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif args.quiet:
        for p in report.problems:
            print(p, file=sys.stderr)
    else:
        print(report.describe())
    return 0 if report.ok else 2

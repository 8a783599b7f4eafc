"""What writes each ``--to`` target: a static table from a target's family to its job.

==========  ===========================  ====================================================
family      ``--to``                     job (prepared from the dequantization plan)
==========  ===========================  ====================================================
float       auto, bf16, fp16, fp32       :class:`convert.stream.safetensors_job.SafetensorsJob`
                                         (a safetensors file or a sharded model directory)
bnb4        nf4, fp4                     :class:`convert.bnb4.target.Bnb4Job`: re-quantized in
                                         bnb's layout, written as safetensors
gguf        gguf, gguf:TYPE              :class:`convert.gguf.target.GgufJob` (and with ``--mmproj``
                                         :class:`convert.gguf.target.MmprojJob`, the second file; with
                                         ``--modelfile`` :class:`convert.gguf.modelfile.ModelfileJob`,
                                         an Ollama Modelfile, the last one)
==========  ===========================  ====================================================

A PEFT LoRA adapter directory as SRC with ``--to gguf[:TYPE]`` is written by
:class:`convert.gguf.adapter.GgufAdapterJob` (:data:`ADAPTER_JOB`: the GGUF LoRA adapter llama.cpp loads),
made from the adapter and its base model's config instead of a dequantization plan.

The ``--to`` value itself is parsed once, where it enters, into a :class:`convert.options.Target`
(:func:`convert.options.target_for`). Every job is a :class:`TargetJob`: it knows its output's kind and
size before anything is written (for the output claim's pre-flight), describes its plan (``--dry-run``),
writes into the staging path it is given, verifies what it wrote, and reports what it did. The output
protocol (naming, claim, commit) is :mod:`convert.output`'s, the same for all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from convert.bnb4.target import Bnb4Job
from convert.gguf.adapter import BaseModel, GgufAdapterJob, lora_modules
from convert.gguf.modelfile import ModelfileJob, check_name, plan_modelfile
from convert.gguf.target import GgufJob, MmprojJob
from convert.options import ConvertOptions
from convert.output import ShardLedger
from convert.output_names import GgufNaming
from convert.stream.pipeline import RunSettings
from convert.stream.plan import Plan
from convert.stream.safetensors_job import SafetensorsJob
from convert.stream.sources import Source

__all__ = ["ADAPTER_JOB", "TARGETS", "BaseModel", "MmprojJob", "ModelfileJob", "TargetJob", "check_adapter_alone",
           "check_modelfile_name", "plan_modelfile"]

#: ``--modelfile``'s name check (:func:`convert.gguf.modelfile.check_name`), for the options check before any I/O.
check_modelfile_name = check_name

#: What :data:`ADAPTER_JOB` refuses of an adapter alone, before its base is known
#: (:func:`convert.gguf.adapter.lora_modules`: LORA-015, a DoRA magnitude, a modules_to_save module, a full
#: tensor), for ``inspect``'s report of an adapter.
check_adapter_alone = lora_modules


class TargetJob(Protocol):
    """A prepared writer of one target."""

    #: whether the output is a directory (else one file), and the suffix of a file output
    is_dir: bool
    file_suffix: str
    #: a GGUF file's default name parts, known once planned (:func:`convert.output_names.default_output`), or None
    naming: GgufNaming | None
    #: planned bytes of the output, tensors written, values converted (the model's, in its dequantized
    #: shapes), tensor bytes read
    out_nbytes: int
    #: bytes of every file the output will hold (tensor data, headers, index, config, copied files): what
    #: the disk pre-flight asks for
    disk_nbytes: int
    tensors: int
    elements: int
    in_nbytes: int
    #: CPU the writer spends per weight, relative to a float output's (dequantize, write), one thread: a run of
    #: several targets shares out its threads by it (:func:`convert.stream.shared.allot_threads`)
    work_per_weight: float

    def plan_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``--dry-run --json``)."""

    def describe(self) -> str:
        """The plan as a table (``--dry-run``)."""

    def output_parts(self, out: Path) -> list[Path] | None:
        """The files of an output written as several files beside ``out`` (a split GGUF:
        ``OUT-00001-of-0000N.gguf`` ..., in order), committed together; None for one file or a directory.
        Called once the output path is known, before :meth:`write` and the plan's text."""

    def other_layouts(self, out: Path, parts: list[Path] | None) -> list[Path]:
        """The existing files of the same output in another layout beside ``out`` (``parts``: this output's files,
        :meth:`output_parts`): a GGUF split into another number of parts, or not split. They count as the output
        existing (OUT-001 without ``--overwrite``) and an ``--overwrite`` commit removes them."""

    def sources(self) -> list[Source]:
        """The stream sources the output is made from (a run of several targets shares what they dequantize:
        :mod:`convert.stream.shared`)."""

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


def _float_job(plan: Plan, options: ConvertOptions, model_name: str) -> TargetJob:
    """``--to auto|bf16|fp16|fp32``: the dequantization plan written as it is."""
    return SafetensorsJob(plan)


#: :attr:`convert.options.Target.family` -> ``(plan, options, model name) -> TargetJob``.
TARGETS: dict[str, Callable[[Plan, ConvertOptions, str], TargetJob]] = {
    "float": _float_job,
    "bnb4": Bnb4Job,
    "gguf": GgufJob,
}

#: ``--to gguf[:TYPE]`` of a PEFT LoRA adapter: ``(adapter, base model, options, adapter's name) -> TargetJob``.
ADAPTER_JOB = GgufAdapterJob

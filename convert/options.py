"""What a conversion is asked to do: plain records, no I/O.

- :class:`Target`: a ``--to`` value, parsed once by :func:`target_for` where it enters (the command
  line, a batch JOBS line, or :class:`ConvertOptions` given a string) and passed on as the record;
  which job writes each :attr:`Target.family` is :data:`convert.targets.TARGETS`'.
- :class:`ConvertOptions` (with :class:`QuantOptions`, the ``--to nf4|fp4`` settings): one
  conversion, the argument of :func:`convert.job.convert`.

The ``--to`` values (any letter case; llama.cpp's spelling ``gguf:Q4_K_M`` works too):

=========================  ======  ===============================================  ====================
``--to``                   family  dequantized to first (:attr:`Target.dequantize_to`)  written as
=========================  ======  ===============================================  ====================
auto, bf16, fp16, fp32     float   the same value                                   safetensors
nf4, fp4                   bnb4    auto (each QuantState's dtype)                   safetensors, bnb's
                                                                                    4-bit layout
gguf (F16), gguf:TYPE      gguf    fp32 for the types made from exact float32       GGUF
                                   (:data:`convert.gguf.types.FLOAT32_INPUT`), else
                                   auto
T1,T2,...                  multi   each member as it is alone                        each member's output,
                                                                                    in one folder
=========================  ======  ===============================================  ====================

Several targets, comma-separated (``--to bf16,gguf:q4_k_m,gguf:q8_0,nf4``), make one :class:`Target` of family
``multi`` whose :attr:`Target.members` are the single targets in the order given: one run reads and dequantizes
each weight once for all of them (:func:`convert.run.several.convert_set`).
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import gguf

from convert.gguf.types import (
    DEFAULT_MIX,
    DEFAULT_OUTPUT_TYPE,
    FILE_TYPES,
    FLOAT32_INPUT,
    OUTPUT_TYPES,
    SPLIT_INT_MAX,
    SPLIT_UNITS,
    MixOptions,
    parse_mix_options,
    parse_output_type,
    parse_split_size,
)
from formats.errors import ConvertBnbError, UsageError

__all__ = ["AUTO", "ConvertOptions", "DEFAULT_MIX", "FLOAT_TARGETS", "MIN_MEMORY", "MixOptions", "QuantOptions",
           "SUMMARY_SAMPLE", "Target", "add_mix_arguments", "check_split_options", "mix_from_args",
           "parse_mix_options", "target_arg", "target_for", "target_names"]

#: ``--to`` values of the float output and the dtype each one casts to (None: each tensor's own).
FLOAT_TARGETS: dict[str, str | None] = {"auto": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: ``--to`` values of the bitsandbytes 4-bit output (each is its quant type).
BNB4_TARGETS = ("nf4", "fp4")

#: Without exact figures asked for (``--json``, ``--quant-report``), a target's error figures are measured
#: on one piece of each weight in this many (the summary's figures).
SUMMARY_SAMPLE = 8


@dataclass(frozen=True)
class Target:
    """A parsed ``--to`` value.

    Attributes:
        name: the value in lower case, as outputs and reports name it (``bf16``, ``nf4``, ``gguf``,
            ``gguf:q4_k_m``).
        family: ``float``, ``bnb4`` or ``gguf``: the row of :data:`convert.targets.TARGETS` that writes it.
        dequantize_to: the float target the input is dequantized to first (a key of :data:`FLOAT_TARGETS`).
        gguf_type: the GGUF output type (a key of :data:`convert.gguf.types.OUTPUT_TYPES`; ``f16`` for a
            bare ``gguf``), or None.
        quant_type: ``nf4`` or ``fp4`` for the bnb4 family, else None.
        members: the family ``multi``: the single targets of a comma-separated ``--to``, in the order given
            (two or more, no two naming the same output); else empty.
    """

    name: str
    family: Literal["float", "bnb4", "gguf", "multi"]
    dequantize_to: str
    gguf_type: str | None = None
    quant_type: str | None = None
    members: tuple[Target, ...] = ()

    @property
    def targets(self) -> tuple[Target, ...]:
        """The single targets this value asks for: its :attr:`members`, or itself."""
        return self.members or (self,)

    @property
    def gguf_file_type(self) -> gguf.LlamaFileType | None:
        """The GGUF output's ``general.file_type`` (:data:`convert.gguf.types.OUTPUT_TYPES`), or None."""
        return OUTPUT_TYPES[self.gguf_type][1] if self.gguf_type is not None else None

    @property
    def llama_quantize(self) -> bool:
        """A llama-quantize file type (:data:`convert.gguf.types.FILE_TYPES`): its per-tensor options apply."""
        return self.gguf_type in FILE_TYPES

    @property
    def needs_imatrix(self) -> bool:
        """A llama-quantize type it refuses without an importance matrix (``gguf:q2_k_s``)."""
        ft = FILE_TYPES.get(self.gguf_type or "")
        return ft is not None and ft.needs_imatrix

    def __str__(self) -> str:
        return self.name


def target_names() -> list[str]:
    """Every accepted ``--to`` value, for ``--help`` and error messages (lower case; :func:`target_for`
    accepts any case, as llama.cpp spells its types: ``gguf:Q4_K_M``)."""
    return [*FLOAT_TARGETS, *BNB4_TARGETS, "gguf", *(f"gguf:{t}" for t in OUTPUT_TYPES)]


def target_for(text: str) -> Target:
    """Parse a ``--to`` value (any letter case, surrounding blanks ignored): one target, or several
    comma-separated (a :class:`Target` of family ``multi``).

    Raises:
        UsageError: an unknown value (USE-001), listing the accepted ones; an empty member of a list, or two
            members naming the same output (``gguf`` and ``gguf:f16``), USE-001.
        GgufTypeError: ``gguf:TYPE`` with a type that is not written (GGUF-002).
    """
    if "," in text:
        return _target_set(text)
    name = text.strip().lower()
    if name in FLOAT_TARGETS:
        return Target(name, "float", name)
    if name in BNB4_TARGETS:
        return Target(name, "bnb4", "auto", quant_type=name)
    family, sep, spec = name.partition(":")
    if family == "gguf" and (spec or not sep):
        gguf_type = parse_output_type(spec) if sep else DEFAULT_OUTPUT_TYPE  # GGUF-002 for a type not written
        return Target(name, "gguf", "fp32" if gguf_type in FLOAT32_INPUT else "auto", gguf_type=gguf_type)
    close = difflib.get_close_matches(name, target_names(), n=1, cutoff=0.6)
    raise UsageError(f"unknown --to value '{name}'", expected=target_names(), found=name,
                     hint=f"did you mean '{close[0]}'?" if close else None)


def _target_set(text: str) -> Target:
    """Several comma-separated targets as one :class:`Target` of family ``multi`` (see :func:`target_for`)."""
    members: list[Target] = []
    seen: dict[tuple[str, str], str] = {}
    for part in text.split(","):
        if not part.strip():
            raise UsageError("--to lists an empty target", expected="targets separated by single commas, e.g. "
                             "bf16,gguf:q8_0,nf4", found=text.strip())
        t = target_for(part)
        key = ("gguf", t.gguf_type or "") if t.family == "gguf" else (t.family, t.name)
        if key in seen:
            same = "" if seen[key] == t.name else f" ({seen[key]} and {t.name} write the same output)"
            raise UsageError(f"--to names the target {t.name} twice{same}", expected="each target once",
                             found=text.strip().lower())
        seen[key] = t.name
        members.append(t)
    return Target(",".join(t.name for t in members), "multi", "auto", members=tuple(members))


def target_arg(text: str) -> Target:
    """:func:`target_for` as the ``--to`` type of an argparse command line.

    Raises:
        argparse.ArgumentTypeError: not a ``--to`` value (argparse makes it a usage error naming ``--to``
            and listing the choices).
    """
    try:
        return target_for(text)
    except ConvertBnbError as exc:
        if "," in text and exc.reason.startswith("--to "):  # a list's own rule: an empty member, one given twice
            raise argparse.ArgumentTypeError(f"{exc.reason} (found {text.strip().lower()!r})") from None
        choices = ", ".join(map(repr, target_names()))
        close = f"; {exc.hint}" if exc.hint else ""
        bad = _bad_member(text) if "," in text else text.strip().lower()
        raise argparse.ArgumentTypeError(
            f"invalid choice: {bad!r}{close} (choose from {choices}; several: comma-separated)") from None


def _bad_member(text: str) -> str:
    """The first member of a comma-separated ``--to`` that :func:`target_for` refuses, whole and as a single
    ``--to`` names it (``gguf:q9_9``, not the type alone), or the whole list when none is refused alone."""
    for part in text.split(","):
        try:
            target_for(part)
        except ConvertBnbError:
            return part.strip().lower()
    return text.strip().lower()


#: ``--to auto``: each quantized tensor in its QuantState dtype, the others as they are.
AUTO = target_for("auto")


#: The smallest ``max_memory`` the pipeline can keep to.
MIN_MEMORY = 64 * 1024 * 1024


@dataclass(frozen=True)
class QuantOptions:
    """Settings of ``--to nf4|fp4`` (None: the default, as transformers' ``BitsAndBytesConfig``).

    Attributes:
        blocksize: elements per absmax block, 32..4096 (default 64).
        double_quant: 8-bit quantize absmax (default on).
        quant_storage: dtype the packed bytes are stored as (default uint8).
        skip_modules: modules kept unquantized (transformers ``llm_int8_skip_modules`` matching).
        include: tensors quantized whatever the selection rules say.
        requantize: re-quantize bnb layers that already have the asked settings.
        quant_report: where to write the per-tensor quantization report (JSON), or None.
        torch_threads: reproduce ``torch.mean`` as with this many torch threads (nested absmax of
            32768+ blocks).
    """

    blocksize: int | None = None
    double_quant: bool | None = None
    quant_storage: str | None = None
    skip_modules: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    requantize: bool = False
    quant_report: Path | None = None
    torch_threads: int | None = None

    def given(self) -> list[str]:
        """The command-line flags of the settings that differ from the defaults."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value not in (None, (), False):
                out.append("--no-double-quant" if value is False else "--" + f.name.replace("_", "-"))
            elif f.name == "double_quant" and value is False:
                out.append("--no-double-quant")
        return out


@dataclass(frozen=True)
class ConvertOptions:
    """One conversion, as asked.

    Attributes:
        src: a ``.safetensors`` / ``.bin`` / ``.pt`` file, a model directory, or a Hub repo id
            ``org/name`` (``org/name@rev``).
        to: the target (:class:`Target`); a ``--to`` string (``auto``, ``bf16``, ``fp16``, ``fp32``, ``nf4``,
            ``fp4``, ``gguf``, ``gguf:TYPE``, any letter case) is parsed here, once, by :func:`target_for`.
        output: the output path (None: :func:`convert.output_names.default_output`); a str ending in a path
            separator names the directory a one-file output goes into (:func:`convert.output_names.output_path`).
        revision: with a Hub repo id: branch, tag or commit sha.
        max_memory: the working-memory cap in bytes (>= 64 MiB).
        threads: worker threads (None: all cores).
        max_shard_size: largest output shard in bytes (directory outputs).
        merge_lora: PEFT LoRA adapter directories merged in, in order.
        report: with ``merge_lora``: where to write the merge report (JSON), or None.
        original: with ``merge_lora``: the 16-bit model before quantization (adds the quantization
            error to the report), or None.
        merge_report: with ``merge_lora``: compute the merge report's figures (``details["lora_merge"]``)
            even without ``report`` or ``original`` (the CLI sets it for ``--json``); without any of the
            three no figures are computed and ``lora_merge`` is absent. With ``--to nf4|fp4`` it also
            makes the quantization report's error figures exact (else measured on a sample:
            :data:`SUMMARY_SAMPLE`).
        quant: the ``--to nf4|fp4`` settings.
        mix: with ``--to gguf:TYPE`` of a llama-quantize type (:data:`convert.gguf.types.FILE_TYPES`):
            llama-quantize's per-tensor options (``--tensor-type``, ``--output-tensor-type``,
            ``--token-embedding-type``, ``--pure``, ``--leave-output-tensor``).
        dry_run: plan only; write nothing.
        overwrite: replace an existing output.
        verify: re-read the output before committing it.
        progress: show progress bars on stderr.
        resume_key: make the run resumable (finished shards of a killed run with the same key are kept;
            batch jobs), or None.
        manifest: list every output file with its size and sha256 in the result, and write that list
            to this JSON file before the output is committed (so whoever asked can tell its own complete
            output from someone else's files even when the run dies right after the commit), or None.
        mmproj: with ``--to gguf*``: also write the vision projector GGUF (llama.cpp's ``--mmproj`` file,
            :mod:`convert.gguf.mmproj`) to this path, committed on its own after the text model; a directory
            (or a str ending in a path separator) puts it there under its default name.
        mmproj_manifest: with ``mmproj``: write the vision projector's file list to this JSON file before
            it is committed, as ``manifest`` for the text model, or None.
        split_max_size: with ``--to gguf*``: write the GGUF as the parts ``llama-gguf-split --split
            --split-max-size`` makes, each part's tensor data at most this many bytes
            (:mod:`convert.gguf.split`); a string is llama-gguf-split's ``N(M|G)``, parsed here
            (:func:`convert.gguf.types.parse_split_size`), or None.
        split_max_tensors: with ``--to gguf*``: the same with at most this many tensors a part
            (``--split-max-tensors``), or None.
        metadata: with ``--to gguf*``: a JSON file of ``general.*`` values that override those taken from
            config.json, the model card and the name (llama.cpp's converter's ``--metadata``:
            :mod:`convert.gguf.general`), or None.
        modelfile: with ``--to gguf*``: also write an Ollama Modelfile under this plain file name beside the GGUF
            (``--modelfile``: ``Modelfile``; :mod:`convert.gguf.modelfile`), committed on its own after the GGUF
            (and its ``mmproj`` file), or None.
        modelfile_manifest: with ``modelfile``: write the Modelfile's file list to this JSON file before it is
            committed, as ``manifest`` for the GGUF, or None.
        base: with a PEFT LoRA adapter directory as ``src`` (``--to gguf*``: its GGUF LoRA adapter,
            :mod:`convert.gguf.adapter`): the base model, a local directory or a Hub repo id ``org/name[@rev]``
            whose config.json alone is read; None: the adapter config's ``base_model_name_or_path``.
        list_files: list every output file with its size and sha256 in the result (``--json``) without
            writing a manifest file.
        on_progress: called with (bytes written, bytes to write) while the output is written (batch
            workers report progress through it), or None.
        low_disk: with a Hub repo id: download one shard at a time into a staging folder beside the
            output and delete each once converted, instead of the whole repo into the cache first (also
            chosen by itself when only that fits the disk; ``--to auto|bf16|fp16|fp32`` only).
        processes: GGUF K-quants may be encoded in spawned worker processes
            (:func:`convert.gguf.encode.encoder_processes`). Spawned processes import the ``__main__``
            module again, so a script that sets this must guard its entry point with
            ``if __name__ == "__main__":``; the command line sets it.
    """

    src: str
    to: Target = AUTO
    output: str | Path | None = None
    revision: str | None = None
    max_memory: int = 1 << 30
    threads: int | None = None
    max_shard_size: int = 5 * 10**9
    merge_lora: tuple[Path, ...] = ()
    report: Path | None = None
    original: Path | None = None
    merge_report: bool = False
    quant: QuantOptions = field(default_factory=QuantOptions)
    mix: MixOptions = DEFAULT_MIX
    dry_run: bool = False
    overwrite: bool = False
    verify: bool = True
    progress: bool = False
    resume_key: dict[str, Any] | None = None
    manifest: Path | None = None
    list_files: bool = False
    on_progress: Callable[[int, int], None] | None = None
    low_disk: bool = False
    processes: bool = False
    mmproj: str | Path | None = None
    mmproj_manifest: Path | None = None
    split_max_size: int | None = None
    split_max_tensors: int | None = None
    metadata: Path | None = None
    modelfile: str | None = None
    modelfile_manifest: Path | None = None
    base: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.to, str):  # a library caller's --to string: parsed where it enters
            object.__setattr__(self, "to", target_for(self.to))
        if isinstance(self.split_max_size, str):  # llama-gguf-split's N(M|G), parsed where it enters
            object.__setattr__(self, "split_max_size", parse_split_size(self.split_max_size))

    @property
    def worker_threads(self) -> int:
        """The worker threads asked for: :attr:`threads`, or this machine's cores when None (at least 1)."""
        return max(1, self.threads or os.cpu_count() or 1)


def add_mix_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """llama-quantize's per-tensor and importance-matrix options (:class:`~convert.gguf.types.MixOptions`), for the
    command line and a batch JOBS line alike (:func:`mix_from_args` parses what they give)."""
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="tensors whose GGUF name matches the regular expression PATTERN get GGML type TYPE "
                   "(e.g. attn_v=q8_0); repeatable, the first match wins")
    p.add_argument("--output-tensor-type", metavar="TYPE", default=None, help="output.weight's GGML type")
    p.add_argument("--token-embedding-type", metavar="TYPE", default=None, help="token_embd.weight's GGML type")
    p.add_argument("--pure", action="store_true",
                   help="no mix: every quantized tensor gets the type's default (Q4_K for q4_k_m)")
    p.add_argument("--leave-output-tensor", action="store_true", help="keep output.weight unquantized (F32)")
    p.add_argument("--imatrix", metavar="FILE", default=None,
                   help="quantize with this importance matrix (llama-imatrix's imatrix.gguf or legacy .dat)")
    p.add_argument("--include-weights", action="append", default=[], metavar="NAME",
                   help="use the importance matrix only for tensors whose name contains NAME; repeatable")
    p.add_argument("--exclude-weights", action="append", default=[], metavar="NAME",
                   help="do not use the importance matrix for tensors whose name contains NAME; repeatable")


def mix_from_args(ns: argparse.Namespace) -> MixOptions:
    """The options :func:`add_mix_arguments` defined, parsed (:func:`~convert.gguf.types.parse_mix_options`).

    Raises:
        UsageError: USE-001. GgufTypeError: GGUF-002.
    """
    return parse_mix_options(ns.tensor_type, ns.output_tensor_type, ns.token_embedding_type, ns.pure,
                             ns.leave_output_tensor, ns.imatrix, ns.include_weights, ns.exclude_weights)


def check_split_options(options: ConvertOptions) -> None:
    """The split options against the target and each other, before anything is read.

    Raises:
        UsageError: USE-001: a split option without ``--to gguf[:TYPE]``; both options (llama-gguf-split
            takes one); ``split_max_tensors`` or ``split_max_size`` not a positive integer (up to 2**31 - 1
            tensors).
    """
    given = [f for f, v in (("--split-max-size", options.split_max_size),
                            ("--split-max-tensors", options.split_max_tensors)) if v is not None]
    if not given:
        return
    if options.to.family != "gguf":
        raise UsageError(f"{given[0]} splits a GGUF output and needs --to gguf[:TYPE]", expected="--to gguf...",
                         found=f"--to {options.to.name}")
    if len(given) == 2:
        raise UsageError("give either --split-max-size or --split-max-tensors, not both (as llama-gguf-split)",
                         found="both")
    value = options.split_max_size if options.split_max_size is not None else options.split_max_tensors
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= (
            SPLIT_INT_MAX if options.split_max_tensors is not None else SPLIT_INT_MAX * SPLIT_UNITS["G"]):
        raise UsageError(f"{given[0]} must be a positive whole number", found=repr(value)[:40],
                         expected=f"a number of tensors from 1 to {SPLIT_INT_MAX} (a 32-bit integer, as "
                         "llama-gguf-split reads it)" if options.split_max_tensors is not None
                         else "a size such as 2G or 500M")

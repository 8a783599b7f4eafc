"""``convert(ConvertOptions) -> ConvertResult``: one conversion, readable top to bottom.

The command line (:mod:`convert.cli`), batch workers (:mod:`convert.batch.worker`) and library users all
call :func:`convert`; there is no other path to an output. The steps:

1. check the options against each other (:func:`check_options`; usage errors before any I/O);
2. resolve the source: a local path, or a Hub repo id fetched into the HF cache (:mod:`convert.hub.download`),
   or read in place: headers only for ``dry_run``, one shard at a time for ``low_disk``
   (:mod:`convert.hub.shards`, whose :class:`~convert.hub.shards.ShardLifetime` the pipeline tells
   when each tensor is about to be made and when it is written); a PEFT LoRA adapter (a local directory, or a
   Hub repo holding ``adapter_config.json``) becomes its GGUF LoRA adapter instead (:func:`_convert_adapter`);
3. open the checkpoint (:func:`formats.checkpoint.open_checkpoint`) and plan the dequantization
   (:func:`convert.stream.plan.make_plan`): every output tensor with the source that produces it;
4. merge LoRA adapters into the plan (:func:`convert.lora.apply.apply_lora`), when asked;
5. prepare the target's writer from the static table :data:`convert.targets.TARGETS`
   (safetensors float, bnb 4-bit, GGUF); ``dry_run`` stops here with the plan;
6. claim the output, write into staging, verify, commit (:class:`convert.output.OutputClaim`);
7. return what was done (:class:`ConvertResult`).

Errors are the :mod:`formats.errors` classes, raised where each rule is checked; nothing here
prints or exits.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from convert import __version__
from convert.hub.download import HubSource, WeightMode, resolve_config, resolve_repo
from convert.hub.repo import is_repo_id, parse_repo_spec
from convert.hub.shards import HubShards, ShardLifetime
from convert.lora.apply import LoraRun, apply_lora
from convert.options import (
    DEFAULT_MIX,
    FLOAT_TARGETS,
    MIN_MEMORY,
    ConvertOptions,
    QuantOptions,
    check_split_options,
)
from convert.output import (
    GgufNaming,
    InterruptedAfterCommit,
    OutputClaim,
    default_output,
    default_set_output,
    gguf_file_name,
    output_path,
    set_output_path,
    sha256_file,
    write_json,
)
from convert.stream.pipeline import RunSettings, max_threads, peak_rss_bytes, share_memory
from convert.stream.plan import Plan, make_plan
from convert.stream.shared import Consumer, SharedProducts
from convert.targets import (
    ADAPTER_JOB,
    TARGETS,
    BaseModel,
    MmprojJob,
    ModelfileJob,
    TargetJob,
    check_modelfile_name,
    plan_modelfile,
)
from convert.units import format_bytes
from formats.checkpoint import Checkpoint, open_checkpoint, path_kind
from formats.errors import (
    ConvertBnbError,
    DiskSpaceError,
    ImatrixRequiredError,
    OutputBusyError,
    OutputExistsError,
    OutputInsideInputError,
    OutputKindError,
    OverwriteRefusedError,
    SourceNotFoundError,
    TargetsFailedError,
    UsageError,
)
from formats.mapping import check_inputs
from formats.peft import Adapter, is_adapter_dir, open_adapter

__all__ = ["ConvertResult", "ResolvedSource", "base_model", "check_adapter_options", "check_options", "convert",
           "job_key", "member_options", "plan_set", "resolve_source"]

@dataclass
class ConvertResult:
    """What a conversion did (``--json`` prints :meth:`to_dict`).

    Attributes:
        source: what was read: the input's absolute path, or ``org/name@commit`` for a Hub repo.
        commit: the Hub commit the input was read at, or None for a local path.
        to: the target.
        output: the output path.
        dry_run: the plan (``dry_run``: nothing was written), else None.
        plan_text: the plan as a table, with ``dry_run``.
        output_exists: with ``dry_run``: whether the output path exists already.
        tensors: tensors written.
        elements: values converted: the model's, in its dequantized shapes (a packed 4-bit output's
            weights, not its bytes).
        bytes_in: tensor bytes read.
        bytes_out: bytes written (all files).
        seconds: wall time.
        gelem_per_s: ``elements`` per second, in billions.
        peak_rss_bytes: the process's peak resident set (bytes).
        fp16_overflow: values that became inf when rounded to float16.
        fp16_underflow: non-zero values that became 0 when rounded to float16.
        shards_written: output files written by this run; shards_reused: kept from a killed run.
        verified: the output was re-read and checked before it was committed (False with ``verify=False``).
        removed_stale: what the output claim recovered from dead runs.
        files: with ``manifest`` or ``list_files``: ``{path relative to output: {"bytes", "sha256"}}`` of
            the output (a file output: its own name).
        timings: seconds per step: ``plan`` (open, plan, merge, prepare), ``write``, ``verify``,
            ``commit`` (manifest and install), ``total``.
        notes: things the user should know.
        details: target-specific results (``gguf``, ``quantized``, ``report``, ``lora_merge``).
        outputs: a run of several targets: each target's result, in ``--to`` order (``output`` is then their
            folder); else empty.
        error: the result of a target of such a run that failed: ``{"error": class, "rule", "message"}``, else None.
    """

    source: str
    to: str
    output: str
    commit: str | None = None
    dry_run: dict[str, Any] | None = None
    plan_text: str = ""
    output_exists: bool = False
    tensors: int = 0
    elements: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    gelem_per_s: float = 0.0
    peak_rss_bytes: int = 0
    fp16_overflow: int = 0
    fp16_underflow: int = 0
    shards_written: int = 0
    shards_reused: int = 0
    verified: bool = False
    removed_stale: list[str] = field(default_factory=list)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    outputs: list[ConvertResult] = field(default_factory=list)
    error: dict[str, Any] | None = None

    def fp16_line(self) -> str | None:
        """The summary's float16 line (values that overflowed to inf, non-zero values flushed to zero),
        or None when neither happened."""
        if not (self.fp16_overflow or self.fp16_underflow):
            return None
        return (f"float16: {self.fp16_overflow} values overflowed to inf, {self.fp16_underflow} non-zero values "
                "flushed to zero")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``--json``): ``ok``, the converter's version, the fields, with ``details``
        flattened in (a dry run gives the plan)."""
        if self.error is not None:
            return {"ok": False, "to": self.to, "output": self.output, **self.error}
        if self.dry_run is not None:
            return {**self.dry_run, "output": self.output, "output_exists": self.output_exists,
                    **({"outputs": [o.to_dict() for o in self.outputs]} if self.outputs else {})}
        d: dict[str, Any] = {"ok": all(o.error is None for o in self.outputs),
                             "converter": f"convert-bnb {__version__}"}
        d.update({f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "outputs"})
        for k in ("dry_run", "plan_text", "output_exists", "details", "error"):
            d.pop(k)
        d.update(self.details)
        if self.outputs:
            d["outputs"] = [o.to_dict() for o in self.outputs]
        return d


def _absolute(path: Path) -> str:
    """``path`` made absolute with its symlinks resolved as far as they go: a symlink loop or a dangling link
    stays as it is (Path.resolve raises RuntimeError on a loop; opening SRC names it, CKPT-011/CKPT-010)."""
    return os.path.realpath(path)


@dataclass(frozen=True)
class ResolvedSource:
    """The input, as a local path.

    Attributes:
        path: the file or directory to open (a Hub snapshot directory for a repo).
        hub: the resolved repo (id, revision, commit), or None for a local path.
    """

    path: Path
    hub: HubSource | None = None

    @property
    def ref(self) -> str:
        """What was read, for people and ``--json``: the absolute path, or ``org/name@commit``."""
        return f"{self.hub.repo_id}@{self.hub.commit}" if self.hub is not None else _absolute(self.path)

    @property
    def label(self) -> str:
        """What identifies the input for resuming: the absolute path, or the repo id."""
        return self.hub.repo_id if self.hub is not None else _absolute(self.path)

    @property
    def is_adapter(self) -> bool:
        """Whether the input is a PEFT LoRA adapter (:func:`formats.peft.is_adapter_dir`; a Hub repo: what its
        listing said, :attr:`convert.hub.download.HubSource.adapter`), not a model."""
        return self.hub.adapter if self.hub is not None else is_adapter_dir(self.path)

    @property
    def low_disk_shards(self) -> HubShards | None:
        """A low-disk run's input shards (fetched one at a time into a staging folder), else None."""
        return self.hub.shards if self.hub is not None and self.hub.staging is not None else None

    def model_name(self, local: Path) -> str:
        """The model's (or adapter's) name, as llama.cpp's ``general.name`` takes it: the repo id, or the name of
        ``local`` (the folder or file opened)."""
        return self.hub.repo_id if self.hub is not None else local.resolve().name

    def notes(self) -> list[str]:
        """What the user should know about where the input came from (a Hub repo: its commit, the bytes
        downloaded, a cached snapshot used offline, a low-disk run)."""
        if self.hub is None:
            return []
        note = f"source: Hub repo {self.hub.repo_id}@{self.hub.commit}"
        if self.hub.downloaded_bytes:
            note += f" ({self.hub.downloaded_bytes} bytes downloaded)"
        return [note] + [n for n in (self.hub.fallback, self.hub.low_disk) if n is not None]

    def open(self) -> Checkpoint:
        """Open the checkpoint (a Hub repo's weights read in place through its shards, when they are)."""
        shards = self.hub.shards if self.hub is not None else None
        return open_checkpoint(self.path, remote=shards.open if shards is not None else None)

    def close(self) -> None:
        """Remove a low-disk run's staging folder (nothing for other sources)."""
        if self.hub is not None:
            self.hub.close()


def check_options(options: ConvertOptions) -> None:
    """Refuse option values and combinations that cannot be honoured, before anything is read.

    Raises:
        UsageError: ``low_disk`` with a target other than auto/bf16/fp16/fp32; a ``mix`` option without
            a llama-quantize type; ``mmproj``, ``metadata`` or ``modelfile`` without a GGUF target; a
            ``modelfile`` name that is not a plain file name;
            ``threads`` or ``max_shard_size`` below 1; ``max_memory``
            below 64 MiB; ``report``/``original`` without ``merge_lora``; a missing adapter
            directory; a 4-bit option with a target other than nf4/fp4; ``torch_threads`` below 1;
            a ``report`` / ``quant_report`` path that names a directory, sits in a missing directory or
            cannot be written (checked now: the report is written after the whole output); a GGUF split
            option without a GGUF target, both of them, or a value below 1
            (:func:`convert.options.check_split_options`); ``base`` with a local SRC that is not an adapter
            (a Hub repo is checked once its listing is known: :func:`_check_base_repo`).
        ImatrixRequiredError: IMX-004, a llama-quantize type that needs an importance matrix without ``--imatrix``.
    """
    check_split_options(options)
    if options.mix.flags() and not options.to.llama_quantize:
        raise UsageError(f"{options.mix.flags()[0].split()[0]} needs --to gguf:TYPE of a llama-quantize type",
                         expected="gguf:q4_0 ... gguf:q6_k", found=f"--to {options.to.name}",
                         hint="f32/f16/bf16/q8_0 are written as llama.cpp's converter writes them, with no "
                              "per-tensor choice")
    if options.to.needs_imatrix and options.mix.imatrix is None:
        raise ImatrixRequiredError(f"gguf:{options.to.gguf_type} needs an importance matrix (llama-quantize refuses it "
                                   "without one)", expected="--imatrix FILE", found="no --imatrix")
    for flag, value in (("--mmproj", options.mmproj), ("--metadata", options.metadata),
                        ("--modelfile", options.modelfile)):
        if value is not None and options.to.family != "gguf":
            raise UsageError(f"{flag} needs --to gguf[:TYPE]", expected="--to gguf...", found=f"--to {options.to.name}")
    if options.modelfile is not None:
        check_modelfile_name(options.modelfile)
    if options.threads is not None and options.threads < 1:
        raise UsageError("--threads must be at least 1", found=options.threads)
    if options.max_shard_size < 1:
        raise UsageError("--max-shard-size must be at least 1 byte", found=options.max_shard_size)
    if options.max_memory < MIN_MEMORY:
        raise UsageError("--max-memory is too small", expected=f">= {format_bytes(MIN_MEMORY)}",
                         found=format_bytes(options.max_memory))
    if not options.merge_lora:
        for flag, value in (("--report", options.report), ("--original", options.original)):
            if value is not None:
                raise UsageError(f"{flag} needs --merge-lora")
    for p in options.merge_lora:
        if not Path(p).exists():
            raise UsageError("adapter does not exist", path=p, hint="give a PEFT adapter directory")
    if options.to.family == "bnb4":
        if options.quant.torch_threads is not None and options.quant.torch_threads < 1:
            raise UsageError("--torch-threads must be at least 1", found=options.quant.torch_threads)
    elif options.quant.given():
        raise UsageError(f"{options.quant.given()[0]} needs --to nf4 or --to fp4", expected="--to nf4|fp4",
                         found=f"--to {options.to}")
    for flag, value in (("--report", options.report), ("--quant-report", options.quant.quant_report)):
        if value is not None:
            _check_report_path(flag, Path(value))
    if options.base is not None and os.path.lexists(options.src) and not is_adapter_dir(options.src):
        raise _base_without_adapter(options)  # (a Hub repo is known to be a model once it is resolved)
    if options.low_disk and options.to.family != "float":
        raise UsageError("--low-disk works with --to auto, bf16, fp16 or fp32", found=f"--to {options.to}",
                         hint="convert without --low-disk (the whole repo is downloaded into the cache first)")


def _base_without_adapter(options: ConvertOptions) -> UsageError:
    """USE-001: ``--base`` with a model as SRC (a local one, or a Hub repo once resolved)."""
    return UsageError("--base applies to a PEFT LoRA adapter as SRC (its GGUF LoRA adapter)",
                      path=options.src, expected="a directory or Hub repo with adapter_config.json and adapter weights",
                      hint="to merge an adapter into a model, give the model as SRC with --merge-lora ADAPTER")


def _src_repo_spec(src: str) -> tuple[str | None, str | None]:
    """SRC as ``(repo, revision)`` when it is no local path (:func:`convert.hub.repo.parse_repo_spec`), else
    ``(None, None)``."""
    return parse_repo_spec(src) if not os.path.lexists(src) else (None, None)


def _check_base_repo(options: ConvertOptions, repo: str | None, revision: str | None) -> None:
    """``--base`` with a Hub repo id as SRC: USE-001 when the repo is a model, known from its listing before anything
    is downloaded (:func:`convert.hub.download.resolve_repo` with ``download=False``; offline, from the cache).

    Raises:
        UsageError: USE-001 (:func:`_base_without_adapter`). HubError, NoWeightsError: as resolving the repo.
    """
    if options.base is None or repo is None or not is_repo_id(repo):
        return
    if not resolve_repo(repo, options.revision or revision, download=False, progress=False).adapter:
        raise _base_without_adapter(options)


def _adapter_one_target(options: ConvertOptions) -> UsageError:
    """USE-001: several ``--to`` targets with a PEFT LoRA adapter as SRC (a local one, or a Hub repo once resolved):
    a usage error's plain line (no path: nothing failed to be read)."""
    return UsageError("SRC is a PEFT LoRA adapter: it becomes one GGUF LoRA adapter, one --to target",
                      expected="--to gguf[:TYPE]", found=f"--to {options.to.name}")


def _check_report_path(flag: str, path: Path) -> None:
    """A report is written after the whole output: refuse a path it could not be written to, now."""
    kind = path_kind(path)
    if kind == "directory":
        raise UsageError(f"{flag} names a directory; give the report's file name", path=path, action="write",
                         expected="a file path", found="a directory")
    if kind not in ("file", "missing"):
        raise UsageError(f"{flag} is not a regular file", path=path, action="write", expected="a file path",
                         found=kind)
    parent = path.parent
    parent_kind = path_kind(parent)
    if parent_kind != "directory":
        raise UsageError(f"{flag}: the report's directory does not exist", path=path, action="write",
                         expected=f"an existing directory '{parent}'",
                         found="none" if parent_kind == "missing" else parent_kind)
    if not os.access(parent, os.W_OK | os.X_OK) or (kind == "file" and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} cannot be written (permission denied)", path=path, action="write",
                         hint="choose a report path in a directory you can write")


def resolve_source(src: str, revision: str | None = None, *, to: str = "auto", output: Path | None = None,
                   progress: bool = False, weights: WeightMode = "download") -> ResolvedSource:
    """A local path as it is; a Hub repo id (``org/name``, ``org/name@rev``) fetched into the HF cache or
    read in place (``weights``).

    Args:
        src: the SRC argument.
        revision: ``--revision`` (wins over ``@rev`` in SRC); only for repo ids.
        to: the target, for the Hub disk pre-flight's output estimate.
        output: the output path, for the Hub disk pre-flight (and a low-disk staging folder beside it).
        progress: show huggingface_hub's progress bars.
        weights: how a Hub repo's weights are made readable (:data:`convert.hub.download.WeightMode`).

    Returns:
        the :class:`ResolvedSource`; :meth:`ResolvedSource.close` it when done.

    Raises:
        UsageError: ``revision`` with a local path; ``weights="low-disk"`` with a local path.
        SourceNotFoundError: no such path, and not a repo id (CKPT-010).
        HubError, DiskSpaceError, NoWeightsError, NoAdapterWeightsError: from
            :func:`convert.hub.download.resolve_repo` (a repo that is neither a model nor an adapter: CKPT-005; an
            adapter's config without its weights: LORA-005).
    """
    if os.path.lexists(src):  # a symlink loop or a dangling link is local too (open_checkpoint says which)
        if revision:
            raise UsageError("--revision applies to a Hub repo id, but SRC is a local path", found=src)
        if weights == "low-disk":
            raise UsageError("--low-disk applies to a Hub repo id, but SRC is a local path", found=src)
        return ResolvedSource(Path(src))
    repo, rev = parse_repo_spec(src)
    if not is_repo_id(repo):
        raise SourceNotFoundError("SRC does not exist", path=src,
                                  hint="give a .safetensors file, a model directory or a Hub repo id org/name")
    hub = resolve_repo(repo, revision or rev, out=output, to=to, progress=progress, weights=weights)
    return ResolvedSource(hub.path, hub)


def _digest(path: str) -> str | None:
    try:
        return sha256_file(Path(path))
    except OSError:
        return None


def job_key(options: ConvertOptions, source: ResolvedSource) -> dict[str, Any]:
    """What must be equal for finished work of an earlier run to be reused: the source (and commit),
    every setting that changes the bytes written, and the converter version. JSON data (it is stored in
    state files and compared with what is read back)."""
    return json.loads(json.dumps({
        "source": source.label,
        "commit": source.hub.commit if source.hub is not None else None,
        "to": options.to.name,
        "max_shard_size": options.max_shard_size,
        "merge_lora": [os.path.realpath(p) for p in options.merge_lora],  # (a symlink loop stays a path)
        # a LoRA adapter's base model (its config.json names the tensors): a folder by its real path, a repo as given
        **({"base": os.path.realpath(options.base) if os.path.lexists(options.base) else options.base}
           if options.base is not None else {}),
        **({"metadata": os.path.realpath(options.metadata)} if options.metadata is not None else {}),
        # llama-quantize's per-tensor options, when given (a key without them stays as earlier runs stored it)
        **({"mix": options.mix.flags()} if options.mix.flags() else {}),
        # the importance matrix's bytes, not only its name (None: unreadable; the run refuses it later)
        **({"imatrix_sha256": _digest(options.mix.imatrix)} if options.mix.imatrix is not None else {}),
        "quant": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options.quant).items()
                  if k != "quant_report"},
        "converter": f"convert-bnb {__version__}",
        **({"mmproj": Path(options.mmproj).name} if options.mmproj is not None else {}),
        **({"modelfile": options.modelfile} if options.modelfile is not None else {}),
    }))


def convert(options: ConvertOptions) -> ConvertResult:
    """Run one conversion (see the module docstring for the steps).

    Args:
        options: what to convert, to what, where, and how.

    Returns:
        the :class:`ConvertResult`.

    Raises:
        ConvertBnbError: a usage error, an input rule broken (file, tensor and rule named), an
            output rule (OUT-xxx, USE-002/003); OSError from the file system.
    """
    committed: list[Path] = []
    try:
        return _convert(options, committed)
    except KeyboardInterrupt as exc:
        if committed and not isinstance(exc, InterruptedAfterCommit):  # the output is in place and complete
            raise InterruptedAfterCommit(committed[0]) from exc
        raise


def _convert(options: ConvertOptions, committed: list[Path]) -> ConvertResult:
    """:func:`convert`; appends the output path to ``committed`` once it is renamed into place."""
    t0 = time.perf_counter()
    if options.to.family == "multi":  # several targets from one read: each as it would be alone, in one folder
        return _convert_set(options, committed, t0)
    # 1. the options against each other, and the output path as far as it is known before reading
    check_options(options)
    if is_adapter_dir(options.src):
        return _convert_adapter(options, ResolvedSource(Path(options.src)), committed, t0)
    repo, rev = _src_repo_spec(options.src)
    if repo is not None and not is_repo_id(repo):  # resolve_source names the missing SRC
        default = out = Path(options.output or options.src)
    else:
        default = default_output(None if repo else Path(options.src), options.to, repo, options.revision or rev)
        out = output_path(options.output, default, is_dir=True)  # -o checked now; a file output's name below
    # 2. the source, local or fetched from the Hub (weights read as the target needs them)
    weights: WeightMode = ("headers" if options.dry_run else "low-disk" if options.low_disk
                           else "auto" if options.to.family == "float" else "download")
    _check_base_repo(options, repo, rev)
    source = resolve_source(options.src, options.revision, to=options.to.name, output=out, progress=options.progress,
                            weights=weights)
    try:
        if source.is_adapter:  # a Hub repo that holds a PEFT LoRA adapter: its GGUF LoRA adapter
            return _convert_adapter(options, source, committed, t0)
        if options.base is not None:
            raise _base_without_adapter(options)
        return _convert_source(options, source, default, out, committed, t0)
    finally:
        source.close()


def _convert_source(options: ConvertOptions, source: ResolvedSource, default: Path, out: Path,
                    committed: list[Path], t0: float, folder: Path | None = None,
                    share: Consumer | None = None, on_checked: Callable[[], None] | None = None) -> ConvertResult:
    """Steps 3-7 of :func:`convert`, once the source is resolved (the caller removes its staging folder).

    A target of a run of several (:func:`_convert_set`): its output named as alone but in ``folder``, its
    dequantized weights read through ``share`` once every target is planned, and ``on_checked`` called once its
    output is claimed and checked, before it is written (:class:`_OutputGate`)."""
    result = ConvertResult(source=source.ref, to=options.to.name, output=str(out),
                           commit=source.hub.commit if source.hub else None)
    with source.open() as ckpt:
        # 3. the dequantization plan (config.json against the weights first: a GGUF target checks it by its
        # own rules, GGUF-006); 4. the LoRA adapters merged into it
        if options.to.family != "gguf":
            ckpt.check_config()
        plan = make_plan(ckpt, options.to.dequantize_to, max_shard_size=options.max_shard_size)
        want_stats = options.merge_report or options.report is not None or options.original is not None
        lora = apply_lora(plan, options.merge_lora, options.original, want_stats) if options.merge_lora else None
        try:
            _merge_threads(options, lora, 1)  # USE-001 before any work, in a dry run too
            plan.notes += source.notes()
            # 5. the target's job, from the static table; a dry run stops with its plan
            job = TARGETS[options.to.family](plan, options, source.model_name(ckpt.source))
            if job.naming is not None:  # a GGUF file is named by llama.cpp's convention from its general.* keys
                default = _named_default(options, source, job.naming)
                default = default if folder is None else folder / default.name
            out = output_path(options.output, default, is_dir=job.is_dir)
            parts = job.output_parts(out)  # a split GGUF: its files, the first one standing for the output
            out = parts[0] if parts else out
            result.output = str(out)
            mmproj = MmprojJob(plan, options, source.model_name(ckpt.source)) if options.mmproj is not None else None
            mm_out = _mmproj_output(options, out, mmproj.naming if mmproj is not None else None,
                                    source.hub.revision if source.hub is not None else None)
            modelfile = plan_modelfile(options, job.gplan, ckpt.source, out, parts,
                                       mm_out if mmproj is not None else None) if options.modelfile else None
            if options.dry_run:
                result.dry_run, result.plan_text = job.plan_dict(), job.describe()
                result.output_exists = any(p.exists() for p in parts or [out])
                if mmproj is not None:
                    result.dry_run["mmproj"] = {**mmproj.plan_dict(), "output": str(mm_out)}
                    result.plan_text += f"\n{mmproj.describe()}\n  mmproj output: {mm_out}"
                if modelfile is not None:
                    exists = os.path.lexists(modelfile.path)
                    result.dry_run["modelfile"] = {**modelfile.plan_dict(), "exists": exists}
                    result.plan_text += f"\n{modelfile.describe()}" + (
                        "\n  Modelfile exists: --overwrite needed" if exists and not options.overwrite else "")
                return result
            # 6. claim the output, write it into staging, verify, commit
            if share is not None:  # (every target planned before the first shared block is made)
                share.link(job.sources(), options.to.dequantize_to)
                share.ready()
            run, notes = _run_settings(options, plan, source, out.name, lora)
            result.timings["plan"] = time.perf_counter() - t0
            _write_output(job, options, source, ckpt.source, out, run, result, committed, parts, on_checked)
            if mmproj is not None:
                notes += _write_mmproj(mmproj, options, source, ckpt.source, mm_out, run, result, committed)
            if modelfile is not None:
                notes += _write_modelfile(modelfile, options, source, ckpt.source, run, result, committed)
            notes += _low_disk_report(source, result)
            if lora is not None:
                _merge_report(lora, options, result)
        finally:
            if lora is not None:
                lora.close()
    # 7. what was done
    return _done(result, job, notes, t0)


def _done(result: ConvertResult, job: TargetJob, notes: list[str], t0: float) -> ConvertResult:
    """Step 7: the job's figures, notes and details into ``result``, with the total time and the peak RSS."""
    result.notes = notes + job.notes()
    result.details.update(job.details())
    result.tensors, result.elements, result.bytes_in = job.tensors, job.elements, job.in_nbytes
    result.fp16_overflow, result.fp16_underflow = job.fp16_counts()
    result.seconds = result.timings["total"] = time.perf_counter() - t0
    result.gelem_per_s = result.elements / result.seconds / 1e9 if result.seconds > 0 else 0.0
    result.peak_rss_bytes = peak_rss_bytes()
    return result


#: Options of a model conversion that mean nothing for a LoRA adapter as SRC (its GGUF adapter is one file made
#: from the adapter alone). ``--revision`` is a Hub adapter's, never a local one's.
_MODEL_ONLY = (("--merge-lora", "merge_lora"), ("--mmproj", "mmproj"), ("--low-disk", "low_disk"),
               ("--split-max-size", "split_max_size"), ("--split-max-tensors", "split_max_tensors"),
               ("--modelfile", "modelfile"))


def check_adapter_options(options: ConvertOptions, *, hub: bool = False) -> None:
    """Refuse what a LoRA adapter as SRC cannot be converted with: a target other than GGUF, an option of a model
    conversion (:data:`_MODEL_ONLY`), ``--revision`` with a local adapter directory.

    Args:
        options: the run's options (``src`` the adapter).
        hub: the adapter is a Hub repo (``--revision`` is its revision).

    Raises:
        UsageError: USE-001.
    """
    src = Path(options.src)
    if options.revision and not hub:
        raise UsageError("--revision applies to a Hub repo id, but SRC is a local adapter directory", path=src,
                         found=f"--revision {options.revision}")
    if options.to.family != "gguf":
        raise UsageError("SRC is a PEFT LoRA adapter: it becomes a GGUF LoRA adapter (--to gguf[:f32|f16|bf16|q8_0])",
                         path=src, expected="--to gguf[:TYPE]", found=f"--to {options.to.name}",
                         hint="to merge it into a model instead, give the model as SRC with --merge-lora ADAPTER")
    for flag, attr in _MODEL_ONLY:
        if getattr(options, attr):
            raise UsageError(f"{flag} does not apply to a LoRA adapter as SRC", path=src, found=flag,
                             hint="a GGUF LoRA adapter is one file made from the adapter and its base's config.json")


def _convert_adapter(options: ConvertOptions, source: ResolvedSource, committed: list[Path], t0: float
                     ) -> ConvertResult:
    """A PEFT LoRA adapter as SRC, a directory or a Hub repo's snapshot (``source``, resolved): its GGUF LoRA adapter
    (:mod:`convert.gguf.adapter`), planned from the adapter and its base model's config.json (:func:`base_model`),
    named by llama.cpp's convention (the ``general.*`` name: the folder's, or the repo id as for a Hub model) next to
    a local SRC or in the working directory for a Hub repo (:func:`convert.output.default_output`), written,
    verified and committed as every output. A Hub adapter's weights may be read in place (a dry run).

    Raises:
        UsageError: USE-001, a target other than GGUF, or an option of a model conversion (:data:`_MODEL_ONLY`).
        AdapterError, UnsupportedError, HubError: the adapter, its base, or what a GGUF adapter cannot hold.
    """
    hub = source.hub
    check_adapter_options(options, hub=hub is not None)
    shards = hub.shards if hub is not None else None
    with open_adapter(source.path, remote=shards.open if shards is not None else None) as adapter:
        base = base_model(options.base, adapter, progress=options.progress)
        job = ADAPTER_JOB(adapter, base, options, source.model_name(source.path))
        job.plan.notes += source.notes()
        out = output_path(options.output, _named_default(options, source, job.naming), is_dir=False)
        result = ConvertResult(source=source.ref, to=options.to.name, output=str(out),
                               commit=hub.commit if hub is not None else None)
        if options.dry_run:
            result.dry_run, result.plan_text = job.plan_dict(), job.describe()
            result.output_exists = out.exists()
            return result
        threads = max(1, options.threads or os.cpu_count() or 1)
        run = RunSettings(threads=threads, max_memory=options.max_memory, progress=options.progress, label=out.name,
                          on_progress=options.on_progress, processes=options.processes)
        result.timings["plan"] = time.perf_counter() - t0
        _write_output(job, options, source, source.path, out, run, result, committed)
        return _done(result, job, [], t0)


def base_model(spec: str | None, adapter: Adapter, *, progress: bool = False) -> BaseModel:
    """The base model of a LoRA adapter, for its GGUF adapter: ``spec`` (``--base``), or the adapter config's
    ``base_model_name_or_path``; a local directory (as it is given, from the working directory), or else a Hub repo
    id ``org/name[@rev]`` whose config.json alone is fetched (:func:`convert.hub.download.resolve_config`).

    Raises:
        UsageError: USE-001, no base named, a directory without config.json, a name that is neither.
        ConfigJsonError: CKPT-007. HubError: HUB-001.
    """
    given = "--base" if spec is not None else "the adapter config's base_model_name_or_path"
    spec = spec if spec is not None else adapter.config.base_model
    hint = "give --base with the base model's directory or Hub repo id (only its config.json is read)"
    if spec is None:
        raise UsageError("the adapter config names no base model", path=adapter.config.path,
                         expected="base_model_name_or_path, or --base", found=None, hint=hint)
    if os.path.lexists(spec):
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise UsageError(f"the base model ({given}) has no config.json", path=path,
                             expected="a model directory with config.json", found=path_kind(path), hint=hint)
        return BaseModel.read(path, path.resolve().name, _absolute(path))
    repo, rev = parse_repo_spec(spec)
    if not is_repo_id(repo):
        raise UsageError(f"the base model ({given}) is neither a local directory nor a Hub repo id", found=spec,
                         expected="a model directory or org/name", hint=hint)
    hub = resolve_config(repo, rev, progress=progress)
    if not (hub.path / "config.json").is_file():
        raise UsageError(f"the base model's Hub repo ({given}) has no config.json", path=f"{repo}@{hub.commit}",
                         expected="a model repo with config.json", found="none", hint=hint)
    return BaseModel.read(hub.path, repo, f"{repo}@{hub.commit}")


def _merge_threads(options: ConvertOptions, lora: LoraRun | None, threads: int) -> int:
    """The most worker threads, at most ``threads``, for which what the merges of the tensors in flight
    hold (one tensor per chunk in flight: :meth:`convert.lora.apply.LoraRun.held_nbytes`) takes at most
    half of ``max_memory``; ``threads`` without a merge.

    Raises:
        UsageError: USE-001, not even one thread's fits (checked right after the adapters are planned,
            before any work and in a dry run too).
    """
    if lora is None:
        return threads
    while threads > 1 and 2 * lora.held_nbytes(2 * threads + 1) > options.max_memory:
        threads -= 1
    need = 2 * lora.held_nbytes(3)
    if need > options.max_memory:
        raise UsageError("--max-memory is too small for this merge: the adapters' working copies of the tensors "
                         "in flight, held beside the chunks, would take more than half of it",
                         expected=f">= {format_bytes(need)}", found=format_bytes(options.max_memory),
                         hint="raise --max-memory")
    return threads


def _run_settings(options: ConvertOptions, plan: Plan, source: ResolvedSource, label: str, lora: LoraRun | None
                  ) -> tuple[RunSettings, list[str]]:
    """How the job writes: threads (lowered, with a note, where their chunks, or the merges' working
    copies, would not fit ``max_memory``: :func:`_merge_threads`), the cap for the chunks (``max_memory``
    less what the merges of the tensors in flight hold beside them), progress, and a low-disk run's shard
    lifetime."""
    notes = []
    asked = max(1, options.threads or os.cpu_count() or 1)
    threads = _merge_threads(options, lora, asked)
    reserved = lora.held_nbytes(2 * threads + 1) if lora is not None else 0
    max_memory = options.max_memory - reserved
    threads = min(threads, max_threads(max_memory, max((t.source.unit for t in plan.tensors), default=1)))
    if threads < asked:
        notes.append(f"--threads {asked} lowered to {threads}: more threads' chunks would not fit "
                     f"--max-memory {format_bytes(options.max_memory)}")
        reserved = lora.held_nbytes(2 * threads + 1) if lora is not None else 0
        max_memory = options.max_memory - reserved
    if reserved * 10 > options.max_memory:
        notes.append(f"the merges hold {format_bytes(reserved)} of adapter copies (the exact product's float64 "
                     f"operands) beside the chunks: chunks sized for the remaining {format_bytes(max_memory)}")
    shards = source.low_disk_shards
    run = RunSettings(threads=threads, max_memory=max_memory, progress=options.progress, label=label,
                      on_progress=options.on_progress, inputs=ShardLifetime(plan, shards) if shards else None,
                      processes=options.processes)
    return run, notes


def _write_output(job: TargetJob, options: ConvertOptions, source: ResolvedSource, input_path: Path, out: Path,
                  run: RunSettings, result: ConvertResult, committed: list[Path], parts: list[Path] | None = None,
                  on_checked: Callable[[], None] | None = None) -> None:
    """Claim ``out`` (with ``parts``: the files of a split output, ``out`` the first), write the job into its
    staging path, verify, list the files, commit; the figures go into ``result`` (timings, bytes out, files,
    shards written and reused, what the claim recovered). ``on_checked``: the claim's
    (:class:`convert.output.OutputClaim`), called once the output is checked, before anything is written."""
    timings = result.timings
    resume_key = None if options.resume_key is None else {**options.resume_key, "job": job_key(options, source)}
    with OutputClaim(out, is_dir=job.is_dir, nbytes=job.disk_nbytes, inputs=[input_path],
                     overwrite=options.overwrite, resume_key=resume_key, file_suffix=job.file_suffix,
                     parts=parts, on_checked=on_checked) as claim:
        try:
            t = time.perf_counter()
            result.shards_written, result.shards_reused = job.write(claim.staging, run, claim.ledger)
            timings["write"] = time.perf_counter() - t
            if options.verify:
                t = time.perf_counter()
                job.verify(claim.staging)
                timings["verify"] = time.perf_counter() - t
                result.verified = True
        except OSError as exc:
            raise _write_error(exc, out, job.disk_nbytes) from None
        t = time.perf_counter()
        result.bytes_out = _size(claim.staging)
        if options.manifest is not None or options.list_files:
            result.files = claim.manifest()
        if options.manifest is not None:
            write_json(options.manifest, result.files)
        check_inputs()  # CKPT-012: an input rewritten in place after its last read is not committed
        claim.commit()
        committed.append(claim.final)
        timings["commit"] = time.perf_counter() - t
    result.removed_stale = claim.recovered


def _named_default(options: ConvertOptions, source: ResolvedSource, naming: GgufNaming | None) -> Path:
    """:func:`convert.output.default_output` of this run's source, with a GGUF job's ``naming`` (None: the
    name known before the input was read)."""
    hub = source.hub
    return default_output(None if hub is not None else Path(options.src), options.to,
                          hub.repo_id if hub is not None else None, hub.revision if hub is not None else None,
                          naming=naming)


def _mmproj_output(options: ConvertOptions, out: Path, naming: GgufNaming | None, revision: str | None) -> Path:
    """The ``--mmproj`` path, checked against the text model's output before anything is written: a file
    path, or a directory (an existing one, or a path ending in a separator; ``.`` for the working directory)
    that the file goes into under its default name (``mmproj-`` + llama.cpp's naming convention:
    :func:`convert.output.gguf_file_name`).

    Args:
        options: ``mmproj`` and ``overwrite``/``dry_run``.
        out: the text model's output.
        naming: the vision projector job's name parts.
        revision: a Hub revision asked for (in the default name's version part), or None.

    Raises:
        UsageError: USE-001, the same path as the text model's output, or an empty path.
        OutputExistsError: OUT-001, it exists and ``--overwrite`` was not given.
    """
    if options.mmproj is None:
        return out
    text = os.fspath(options.mmproj)
    mm_out = Path(text)
    if not text.strip():
        raise UsageError("--mmproj names no file; give a file name such as mmproj.gguf, or a directory",
                         expected="a file or directory path", found="an empty path")
    if text.endswith(("/", os.sep)) or mm_out.is_dir():
        assert naming is not None  # (the vision projector's job is planned whenever mmproj is given)
        mm_out = mm_out / gguf_file_name(naming, revision)
    if os.path.abspath(mm_out) == os.path.abspath(out):
        raise UsageError("--mmproj names the text model's output", expected="another file than -o",
                         found=str(mm_out))
    if os.path.lexists(mm_out) and not options.overwrite and not options.dry_run:
        raise OutputExistsError("output exists", path=mm_out, action="write",
                                hint="pass --overwrite to replace it, or choose another --mmproj path")
    return mm_out


def _write_mmproj(job: TargetJob, options: ConvertOptions, source: ResolvedSource, input_path: Path, out: Path,
                  run: RunSettings, result: ConvertResult, committed: list[Path]) -> list[str]:
    """Write, verify and commit the vision projector after the text model (its own all-or-nothing output);
    its figures (and with ``mmproj_manifest`` or ``list_files`` its files) go into
    ``result.details["mmproj"]``; returns its note."""
    mm = ConvertResult(source=result.source, to=result.to, output=str(out), commit=result.commit)
    _write_output(job, replace(options, manifest=options.mmproj_manifest), source, input_path, out, run, mm,
                  committed)
    result.details["mmproj"] = {"output": str(out), "bytes_out": mm.bytes_out, "tensors": job.tensors,
                                "verified": mm.verified, **({"files": mm.files} if mm.files else {})}
    return [f"mmproj: {out} ({job.tensors} tensors, {format_bytes(mm.bytes_out)})"]


def _write_modelfile(job: ModelfileJob, options: ConvertOptions, source: ResolvedSource, input_path: Path,
                     run: RunSettings, result: ConvertResult, committed: list[Path]) -> list[str]:
    """Write, verify and commit the Modelfile after the GGUF (its own all-or-nothing output); its path, template
    (and with ``modelfile_manifest`` or ``list_files`` its files) go into ``result.details["modelfile"]``;
    returns its notes."""
    mf = ConvertResult(source=result.source, to=result.to, output=str(job.path), commit=result.commit)
    _write_output(job, replace(options, manifest=options.modelfile_manifest), source, input_path, job.path, run, mf,
                  committed)
    result.details["modelfile"] = {**job.details()["modelfile"], "bytes_out": mf.bytes_out, "verified": mf.verified,
                                   **({"files": mf.files} if mf.files else {})}
    return [f"Modelfile: {job.path} ({format_bytes(mf.bytes_out)})", *job.notes()]


def _low_disk_report(source: ResolvedSource, result: ConvertResult) -> list[str]:
    """A low-disk run's shard events into ``result.details``, and its note."""
    shards = source.low_disk_shards
    if shards is None:
        return []
    result.details["low_disk"] = {"peak_input_bytes": shards.peak_bytes, "shards": [list(e) for e in shards.events]}
    return [f"low-disk: {sum(e[0] == 'fetch' for e in shards.events)} input shards fetched one at a time, at most "
            f"{shards.peak_bytes} bytes of them on disk at once"]


def _merge_report(lora: LoraRun, options: ConvertOptions, result: ConvertResult) -> None:
    """The merge report's figures into ``result.details["lora_merge"]`` (written to ``--report`` too)."""
    try:
        merge_report = lora.report(options.report)
        if merge_report is not None:
            result.details["lora_merge"] = merge_report
    except OSError as exc:
        if options.report is None:
            raise
        raise _write_error(exc, Path(options.report), 0) from None


def _write_error(exc: OSError, out: Path, nbytes: int) -> OSError:
    """An OS error while writing, named after the output: a full disk is OUT-002; any other error
    without a file name (a failed ``write()``) gets the output path, so the message says where."""
    if isinstance(exc, ConvertBnbError):
        return exc
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError("the disk filled up while the output was written", path=out, action="write",
                              expected=f"room for {nbytes} bytes" if nbytes else None,
                              found=f"{exc.strerror} (errno {exc.errno})",
                              hint="free disk space, or write the output to another disk with -o")
    if exc.filename is None:
        exc.filename = os.fspath(out)
    return exc


def _size(path: Path) -> int:
    """Bytes of the output: a file, or every file of a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


# ------------------------------------------------------------------------------------- several targets

def member_options(options: ConvertOptions) -> tuple[list[ConvertOptions], int]:
    """Each target of a run of several (``options.to.members``) as the options of its single run: the options
    that apply to it, its share of ``max_memory`` (:func:`convert.stream.pipeline.share_memory`), no progress
    bar; each checked as :func:`check_options` checks a single run. ``--report`` and ``--original`` go to the
    first target, ``--quant-report`` to the first nf4/fp4 one (each target's figures are in its ``--json``).

    Returns:
        the options per target, in ``--to`` order, and the bytes of the shared blocks.

    Raises:
        UsageError: USE-001: an option that no target takes (4-bit settings without nf4/fp4, llama-quantize's
            options without one of its types, ``--metadata`` or a split without a GGUF target), ``--mmproj`` or
            ``--low-disk`` (one target only), ``max_memory`` below 64 MiB, and what :func:`check_options`
            refuses for a target.
    """
    members = options.to.targets
    families = {t.family for t in members}
    ggufs = [t for t in members if t.family == "gguf"]
    if is_adapter_dir(options.src):
        raise _adapter_one_target(options)
    for flag, given, one_gguf in (("--mmproj", options.mmproj is not None, True),
                                  ("--modelfile", options.modelfile is not None, True),
                                  ("--low-disk", options.low_disk, False)):
        if given and not (one_gguf and len(ggufs) == 1):
            one = " (or one GGUF target among several)" if one_gguf else ""
            raise UsageError(f"{flag} works with one --to target{one}", found=f"--to {options.to.name}",
                             hint=f"run the target that needs {flag} on its own")
    if options.max_memory < MIN_MEMORY:
        raise UsageError("--max-memory is too small", expected=f">= {format_bytes(MIN_MEMORY)}",
                         found=format_bytes(options.max_memory))
    needs = [(options.mix.flags()[0].split()[0] if options.mix.flags() else None,
              any(t.llama_quantize for t in members), "a gguf:TYPE of llama-quantize's types (gguf:q4_0 ... q6_k)"),
             (options.quant.given()[0] if options.quant.given() else None, "bnb4" in families, "nf4 or fp4"),
             ("--metadata" if options.metadata is not None else None, "gguf" in families, "a gguf[:TYPE] target"),
             ("--split-max-size" if options.split_max_size is not None else
              "--split-max-tensors" if options.split_max_tensors is not None else None, "gguf" in families,
              "a gguf[:TYPE] target")]
    for flag, taken, what in needs:
        if flag is not None and not taken:
            raise UsageError(f"{flag} needs {what} among the --to targets", found=f"--to {options.to.name}")
    each, shared = share_memory(options.max_memory, len(members))
    first_bnb4 = next((t for t in members if t.family == "bnb4"), None)
    subs = []
    for i, t in enumerate(members):
        gguf = t.family == "gguf"
        quant = options.quant if t is first_bnb4 else replace(options.quant, quant_report=None)
        sub = replace(options, to=t, output=None, max_memory=each, manifest=None, progress=False,
                      list_files=options.list_files or options.manifest is not None,
                      mmproj=options.mmproj if gguf else None, modelfile=options.modelfile if gguf else None,
                      mmproj_manifest=options.mmproj_manifest if gguf else None,
                      modelfile_manifest=options.modelfile_manifest if gguf else None,
                      mix=options.mix if t.llama_quantize else DEFAULT_MIX,
                      quant=quant if t.family == "bnb4" else QuantOptions(),
                      metadata=options.metadata if gguf else None,
                      split_max_size=options.split_max_size if gguf else None,
                      split_max_tensors=options.split_max_tensors if gguf else None,
                      report=options.report if i == 0 else None, original=options.original if i == 0 else None)
        check_options(sub)
        subs.append(sub)
    return subs, shared


def _convert_set(options: ConvertOptions, committed: list[Path], t0: float) -> ConvertResult:
    """A run of several targets (``--to bf16,gguf:q8_0,nf4``): each target's output exactly as its single run
    writes it, named as alone, in one folder (``-o``, or :func:`convert.output.default_set_output`); the
    source resolved once; every target planned first, then all written at once, each by its own writer in a
    thread of its own, reading each dequantized weight from the blocks the first target to need them made
    (:class:`convert.stream.shared.SharedProducts`), and committed on its own.

    Every target's output is claimed and checked before any target writes (:class:`_OutputGate`).

    Raises:
        OutputExistsError, OutputBusyError, OverwriteRefusedError, DiskSpaceError, OutputKindError,
            OutputInsideInputError: OUT-001, OUT-004, OUT-005, OUT-002, USE-003, USE-002: an output refused before
            anything was written (an existing one without ``overwrite``, another run's lock, ...: what a single
            run checks); nothing is converted or written (:func:`_refused_set`).
        TargetsFailedError: OUT-006, some targets failed (each with its own error in ``failures``); the
            others' outputs are committed and complete. When every target failed with one and the same
            error (a broken input), that error instead, as a single run raises it.
        UsageError: from :func:`member_options`, or ``-o`` naming a file (:func:`convert.output.set_output_path`).
    """
    subs, shared = member_options(options)
    folder = _set_folder(options)
    weights: WeightMode = ("headers" if options.dry_run
                           else "auto" if all(t.family == "float" for t in options.to.targets) else "download")
    _check_base_repo(options, *_src_repo_spec(options.src))
    if _auto_beside_float(options):  # from the headers alone (a Hub repo's read in place): before any download
        probe = resolve_source(options.src, options.revision, to=options.to.name, output=folder, weights="headers")
        try:
            if not probe.is_adapter:
                _check_auto_twin(options, probe)
        finally:
            probe.close()
    source = resolve_source(options.src, options.revision, to=options.to.name, output=folder,
                            progress=options.progress, weights=weights)
    try:
        if source.is_adapter:  # a Hub repo that holds an adapter
            raise _adapter_one_target(options)
        if options.base is not None:
            raise _base_without_adapter(options)
        return _run_set(options, subs, shared, source, folder, committed, t0)
    finally:
        source.close()


def _auto_beside_float(options: ConvertOptions) -> bool:
    """Whether a run of several targets asks for ``auto`` and another float target (bf16, fp16, fp32), which may
    write the same output (:func:`_check_auto_twin`)."""
    floats = [t.name for t in options.to.targets if t.family == "float"]
    return "auto" in floats and len(floats) > 1


def _check_auto_twin(options: ConvertOptions, source: ResolvedSource) -> None:
    """Refuse ``auto`` beside a float target that writes the same output for this input, as a ``--to`` naming one
    target twice is refused (:func:`convert.options.target_for`): ``auto`` resolved from the headers (every tensor's
    dtype in the plan of each, and the config.json each writes), before any weight is read or anything written.

    An input that cannot be planned is left to the run, whose targets report its error as a single run does.

    Raises:
        UsageError: USE-001, ``auto`` and a float target of the list write the same tensors and config.json.
    """
    others = [t.name for t in options.to.targets if t.family == "float" and t.name != "auto"]
    twin = None
    try:
        with source.open() as ckpt:
            auto = _plan_outline(make_plan(ckpt, "auto", max_shard_size=options.max_shard_size))
            twin = next((name for name in others
                         if _plan_outline(make_plan(ckpt, name, max_shard_size=options.max_shard_size)) == auto), None)
    except (ConvertBnbError, OSError):
        return
    if twin is not None:
        raise UsageError(f"--to names the target {twin} twice (auto and {twin} write the same output: every tensor of "
                         f"this input is {FLOAT_TARGETS[twin]} in auto)", expected="each target once",
                         found=options.to.name, hint=f"drop auto or {twin}")


def _plan_outline(plan: Plan) -> tuple[Any, ...]:
    """What a float output's bytes follow from: each tensor's name, dtype and shape, the shards, the config.json."""
    return ([(t.name, t.dtype.name, tuple(t.shape)) for t in plan.tensors], plan.shards,
            json.dumps(plan.config, sort_keys=True))


def _set_folder(options: ConvertOptions) -> Path:
    """The folder of a run of several targets: ``-o``, or :func:`convert.output.default_set_output` of SRC (a SRC
    that is neither a path nor a repo id: itself, for :func:`resolve_source` to name it)."""
    repo, rev = _src_repo_spec(options.src)
    if repo is not None and not is_repo_id(repo):  # resolve_source names the missing SRC
        return Path(options.output or options.src)
    return set_output_path(options.output, default_set_output(None if repo else Path(options.src), repo,
                                                              options.revision or rev))


def plan_set(options: ConvertOptions, source: ResolvedSource) -> ConvertResult:
    """The dry run of a run of several targets from a source its caller resolved already (a batch job's
    Hub snapshot in the cache, or its local path): only headers are read, nothing is downloaded or written.

    Args:
        options: the run (``to`` of several targets); its ``revision`` is the one :func:`convert` would resolve
            the source at, so the outputs are named as that run names them (a Hub repo's revision is part of
            the names: :func:`convert.output.default_output`).
        source: the source, resolved at any revision of the same commit.

    Returns:
        the dry run's result: each target's planned result in ``outputs`` (``output``: its path in the folder).

    Raises:
        UsageError: as :func:`member_options`.
        TargetsFailedError: OUT-006, some targets cannot be planned; the input's own error when none can.
    """
    options = replace(options, dry_run=True, progress=False)
    subs, shared = member_options(options)
    if _auto_beside_float(options) and not source.is_adapter:
        _check_auto_twin(options, source)
    if source.hub is not None and source.hub.revision != options.revision:  # (the names carry the revision)
        source = replace(source, hub=replace(source.hub, revision=options.revision))
    return _run_set(options, subs, shared, source, _set_folder(options), [], time.perf_counter())


def _run_set(options: ConvertOptions, subs: list[ConvertOptions], shared: int, source: ResolvedSource,
             folder: Path, committed: list[Path], t0: float) -> ConvertResult:
    """:func:`_convert_set` once the source is resolved."""
    hub = source.hub
    defaults = [folder / default_output(None if hub else Path(options.src), sub.to, hub.repo_id if hub else None,
                                        hub.revision if hub else None).name for sub in subs]
    existed = os.path.lexists(folder)  # (each output's claim makes the folder, after its own checks)
    products = SharedProducts(shared, len(subs))
    gate = _OutputGate(len(subs))
    try:
        if options.dry_run:
            outcomes = [_attempt(sub, source, d, committed, t0, folder, None)
                        for sub, d in zip(subs, defaults, strict=True)]
        else:
            outcomes = _write_set(subs, defaults, source, folder, products, gate, committed, t0,
                                  options.on_progress)
    finally:
        if not existed and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # (every target failed, or the run was stopped before a commit: nothing left behind)
    if gate.refused:  # an output refused before any was written: the run is refused, as a single run would be
        raise _refused_set(subs, gate.refused)
    result = _set_result(options, subs, defaults, outcomes, source, folder, products, shared, t0)
    if options.manifest is not None and not options.dry_run:  # (what was committed: a batch's record of its own)
        write_json(options.manifest, result.files)
    internal = next((o for o in outcomes if isinstance(o, BaseException)
                     and not isinstance(o, (ConvertBnbError, OSError, MemoryError))), None)
    if internal is not None:
        raise internal
    failures = [(sub.to.name, o) for sub, o in zip(subs, outcomes, strict=True) if isinstance(o, BaseException)]
    if failures and len(failures) == len(subs) and len({(type(e), str(e)) for _, e in failures}) == 1:
        raise failures[0][1]  # one error for all: a broken input, as a single run reports it
    if failures:
        done = len(subs) - len(failures)
        raise TargetsFailedError(
            f"{len(failures)} of {len(subs)} targets failed: "
            + ", ".join(f"{t} ({getattr(e, 'rule', None) or type(e).__name__})" for t, e in failures)
            + (f"; the {done} other output{'s are' if done > 1 else ' is'} complete" if done else ""),
            path=folder, action="write", failures=failures, result=result)
    return result


def _attempt(sub: ConvertOptions, source: ResolvedSource, default: Path, committed: list[Path], t0: float,
             folder: Path, share: Consumer | None, gate: tuple[_OutputGate, int] | None = None
             ) -> ConvertResult | BaseException:
    """One target of a set (:func:`_convert_source`): its result, or the exception that ended it. With ``gate``
    (the run's :class:`_OutputGate` and this target's index) its output is written only once every target's is
    checked."""
    try:
        on_checked = functools.partial(gate[0].checked, gate[1]) if gate is not None else None
        return _convert_source(sub, source, default, default, committed, t0, folder, share, on_checked)
    except BaseException as exc:  # noqa: BLE001 - each target's own outcome; the run reports them all
        if gate is not None:
            gate[0].failed(gate[1], exc)
        return exc
    finally:
        if share is not None:
            share.withdraw()


#: What refuses an output before it is written (:class:`convert.output.OutputClaim`'s checks, and an existing
#: ``--mmproj`` or ``--modelfile`` file, found while the target is planned): one of them refuses every target of
#: a run of several (:class:`_OutputGate`).
_OUTPUT_REFUSALS: tuple[type[ConvertBnbError], ...] = (
    OutputExistsError, OutputBusyError, OutputKindError, OutputInsideInputError, OverwriteRefusedError,
    DiskSpaceError)


class _RefusedWithOthers(Exception):
    """A target of a set whose output passed its checks, stopped before writing because another target's output
    was refused (:class:`_OutputGate`); never raised out of :func:`convert`."""


class _OutputGate:
    """Every output of a run of several targets checked before any is written.

    Each target plans, then claims and checks its output (:class:`convert.output.OutputClaim`, up to its staging:
    the kind, the input, another run's lock OUT-004, an existing output OUT-001, OUT-005, the disk OUT-002) and
    waits in :meth:`checked` until every other target has done so or has failed. When an output was refused
    (:data:`_OUTPUT_REFUSALS`, there or while its target was planned), every target stops before writing and
    :attr:`refused` holds each refusal; a target that failed otherwise (an input rule) leaves the others to go on,
    as before.
    """

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._n = n
        self._arrived: set[int] = set()
        self._cancelled = False
        #: target index -> the error that refused its output, before any output was written
        self.refused: dict[int, ConvertBnbError] = {}

    def checked(self, i: int) -> None:
        """Target ``i``'s output is claimed and checked: wait until every target's is, or has failed.

        Raises:
            _RefusedWithOthers: another target's output was refused (this one is not written).
            KeyboardInterrupt: the run was stopped (:meth:`cancel`).
        """
        with self._cond:
            self._arrived.add(i)
            self._cond.notify_all()
            while len(self._arrived) < self._n:
                if self._cancelled:
                    raise KeyboardInterrupt("stopped")
                self._cond.wait()
            if self.refused:
                raise _RefusedWithOthers(f"{len(self.refused)} other output(s) refused")

    def failed(self, i: int, exc: BaseException) -> None:
        """Target ``i`` ended by ``exc``; before its output was checked, it arrives here (refused, when ``exc``
        is one of :data:`_OUTPUT_REFUSALS`); after, nothing changes (every output was checked by then)."""
        with self._cond:
            if i in self._arrived:
                return
            self._arrived.add(i)
            if isinstance(exc, _OUTPUT_REFUSALS):
                self.refused[i] = exc
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop the run: a target waiting in :meth:`checked` raises ``KeyboardInterrupt``."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()


def _refused_set(subs: list[ConvertOptions], refused: dict[int, ConvertBnbError]) -> ConvertBnbError:
    """The one error of a run of several targets whose outputs were refused before any was written: the first
    refused target's (its class and rule, path and hint), naming its target and the other outputs refused."""
    order = sorted(refused)
    first = refused[order[0]]
    also = ", ".join(f"{Path(refused[i].path).name if refused[i].path else subs[i].to.name} ({refused[i].rule})"
                     for i in order[1:])
    reason = (f"{first.reason} (--to {subs[order[0]].to.name}{f'; also refused: {also}' if also else ''}); nothing "
              f"converted: every output of the {len(subs)} targets is checked before any is written")
    return type(first)(reason, path=first.path, tensor=first.tensor, expected=first.expected, found=first.found,
                       hint=first.hint, action=first.action)


def _write_set(subs: list[ConvertOptions], defaults: list[Path], source: ResolvedSource, folder: Path,
               products: SharedProducts, gate: _OutputGate, committed: list[Path], t0: float,
               on_progress: Callable[[int, int], None] | None) -> list[ConvertResult | BaseException]:
    """Every target of a set planned, written, verified and committed, each in a thread of its own, reading
    through ``products``, none written before every output is checked (``gate``); the outcome of each. An
    interrupt (in the calling thread, the main one) cancels them all: each stops at its next chunk, leaves no
    temporary behind, and the interrupt is raised here."""
    consumers = [products.consumer() for _ in subs]
    outcomes: list[ConvertResult | BaseException] = [KeyboardInterrupt()] * len(subs)
    progress = _SetProgress(len(subs), products, on_progress)

    def run(i: int) -> None:
        sub = replace(subs[i], on_progress=progress.reporter(i))
        outcomes[i] = _attempt(sub, source, defaults[i], committed, t0, folder, consumers[i], (gate, i))

    threads = [threading.Thread(target=run, args=(i,), name=f"convert-bnb --to {sub.to.name}")
               for i, sub in enumerate(subs)]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.25)
    except KeyboardInterrupt:
        products.cancel()
        gate.cancel()
        for th in threads:
            th.join()
        raise
    return outcomes


class _SetProgress:
    """The progress of a set's writers, summed for the caller's ``on_progress``; each writer's reporter raises
    ``KeyboardInterrupt`` once the run is cancelled (so every writer stops at its next chunk)."""

    def __init__(self, n: int, products: SharedProducts, forward: Callable[[int, int], None] | None) -> None:
        self.done, self.total = [0] * n, [0] * n
        self.products, self.forward = products, forward
        self._lock = threading.Lock()

    def reporter(self, i: int) -> Callable[[int, int], None]:
        def report(done: int, total: int) -> None:
            if self.products.cancelled:
                raise KeyboardInterrupt("stopped")
            if self.forward is not None:
                with self._lock:
                    self.done[i], self.total[i] = done, total
                    self.forward(sum(self.done), sum(self.total))
        return report


def _set_result(options: ConvertOptions, subs: list[ConvertOptions], defaults: list[Path],
                outcomes: list[ConvertResult | BaseException], source: ResolvedSource, folder: Path,
                products: SharedProducts, shared: int, t0: float) -> ConvertResult:
    """The result of a set: every target's (a failed one with its error), and the run's totals."""
    result = ConvertResult(source=source.ref, to=options.to.name, output=str(folder),
                           commit=source.hub.commit if source.hub else None)
    for sub, default, o in zip(subs, defaults, outcomes, strict=True):
        if isinstance(o, ConvertResult):
            result.outputs.append(o)
        else:
            result.outputs.append(ConvertResult(
                source=result.source, to=sub.to.name, output=str(default), commit=result.commit,
                error={"error": type(o).__name__, "rule": getattr(o, "rule", None),
                       "message": str(o).replace("\n", " ")}))
    done = [o for o in result.outputs if o.error is None]
    if options.dry_run:
        result.dry_run = {"source": result.source, "to": result.to, "ok": len(done) == len(result.outputs)}
        result.output_exists = folder.exists()
        result.plan_text = "\n".join(
            f"{o.plan_text}\n  output: {o.output}" + (" (exists: --overwrite needed)" if o.output_exists else "")
            for o in done)
        return result
    result.tensors = sum(o.tensors for o in done)
    result.elements = max((o.elements for o in done), default=0)
    result.bytes_in = max((o.bytes_in for o in done), default=0)
    result.bytes_out = sum(o.bytes_out for o in done)
    result.fp16_overflow = sum(o.fp16_overflow for o in done)
    result.fp16_underflow = sum(o.fp16_underflow for o in done)
    result.shards_written = sum(o.shards_written for o in done)
    result.shards_reused = sum(o.shards_reused for o in done)
    result.verified = bool(done) and all(o.verified for o in done)
    for o in done:  # every file in the folder, relative to it (an output's, its vision projector's and Modelfile's)
        extras = [o.details.get(k) for k in ("mmproj", "modelfile")]
        for path, files in [(Path(o.output), o.files)] + [(Path(d["output"]), d.get("files", {})) for d in extras if d]:
            if path.parent == folder:
                result.files.update({(f"{path.name}/{k}" if path.is_dir() else k): v for k, v in files.items()})
    result.details["shared"] = {"budget_bytes": shared, "peak_bytes": products.peak, "blocks_made": products.made,
                                "values_shared": products.hits, "blocks_dropped": products.dropped}
    result.notes = [f"{len(subs)} targets from one read: {products.made} blocks of dequantized weights made once "
                    f"and shared, at most {format_bytes(products.peak)} of them held (of "
                    f"{format_bytes(shared)})" + (f"; {products.dropped} dropped for room and made again"
                                                  if products.dropped else "")]
    result.seconds = result.timings["total"] = time.perf_counter() - t0
    result.gelem_per_s = result.elements / result.seconds / 1e9 if result.seconds > 0 else 0.0
    result.peak_rss_bytes = peak_rss_bytes()
    return result

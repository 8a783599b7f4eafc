"""One target's run once its source is resolved: steps 3-7 of :func:`convert.job.convert`
(:func:`convert_source`: the plan, the LoRA merge, the target's job, the output claimed, written, verified and
committed, with its ``--mmproj`` and ``--modelfile`` outputs, and what was done), the options checked before any
I/O (:func:`check_options`), and the key that says when an earlier run's work may be reused (:func:`job_key`).

Errors are the :mod:`formats.errors` classes, raised where each rule is checked; nothing here prints or exits.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from convert import __version__
from convert.hub.download import resolve_repo
from convert.hub.repo import is_repo_id
from convert.hub.shards import ShardLifetime
from convert.lora.apply import LoraRun, apply_lora
from convert.options import MIN_MEMORY, ConvertOptions, check_split_options
from convert.output import OutputClaim, sha256_file, write_json
from convert.output_names import GgufNaming, default_output, gguf_file_name, output_path
from convert.run.result import ConvertResult
from convert.run.source import ResolvedSource
from convert.stream.pipeline import RunSettings, max_threads, peak_rss_bytes
from convert.stream.plan import Plan, make_plan
from convert.stream.shared import Consumer
from convert.targets import TARGETS, MmprojJob, ModelfileJob, TargetJob, check_modelfile_name, plan_modelfile
from convert.units import format_bytes, format_short_of
from formats.checkpoint import path_kind
from formats.errors import ConvertBnbError, DiskSpaceError, ImatrixRequiredError, OutputExistsError, UsageError
from formats.mapping import check_inputs
from formats.peft import is_adapter_dir

__all__ = ["base_without_adapter", "check_base_repo", "check_options", "convert_source", "done", "job_key",
           "named_default", "write_output"]


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
            (a Hub repo is checked once its listing is known: :func:`check_base_repo`).
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
                         found=format_short_of(options.max_memory, MIN_MEMORY))
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
        raise base_without_adapter(options)  # (a Hub repo is known to be a model once it is resolved)
    if options.low_disk and options.to.family != "float":
        raise UsageError("--low-disk works with --to auto, bf16, fp16 or fp32", found=f"--to {options.to}",
                         hint="convert without --low-disk (the whole repo is downloaded into the cache first)")


def base_without_adapter(options: ConvertOptions) -> UsageError:
    """USE-001: ``--base`` with a model as SRC (a local one, or a Hub repo once resolved)."""
    return UsageError("--base applies to a PEFT LoRA adapter as SRC (its GGUF LoRA adapter)",
                      path=options.src, expected="a directory or Hub repo with adapter_config.json and adapter weights",
                      hint="to merge an adapter into a model, give the model as SRC with --merge-lora ADAPTER")


def check_base_repo(options: ConvertOptions, repo: str | None, revision: str | None) -> None:
    """``--base`` with a Hub repo id as SRC: USE-001 when the repo is a model, known from its listing before anything
    is downloaded (:func:`convert.hub.download.resolve_repo` with ``download=False``; offline, from the cache).

    Raises:
        UsageError: USE-001 (:func:`base_without_adapter`). HubError, NoWeightsError: as resolving the repo.
    """
    if options.base is None or repo is None or not is_repo_id(repo):
        return
    if not resolve_repo(repo, options.revision or revision, download=False, progress=False).adapter:
        raise base_without_adapter(options)


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


def convert_source(options: ConvertOptions, source: ResolvedSource, default: Path, out: Path,
                   committed: list[Path], t0: float, folder: Path | None = None,
                   share: Consumer | None = None, on_checked: Callable[[], None] | None = None) -> ConvertResult:
    """Steps 3-7 of :func:`convert.job.convert`, once the source is resolved (the caller removes its staging
    folder).

    A target of a run of several (:func:`convert.run.several.convert_set`): its output named as alone but in
    ``folder``, its dequantized weights read through ``share`` once every target is planned, and ``on_checked``
    called once its output is claimed and checked, before it is written
    (:class:`convert.run.several._OutputGate`)."""
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
                default = named_default(options, source, job.naming)
                default = default if folder is None else folder / default.name
            out = output_path(options.output, default, is_dir=job.is_dir)
            parts = job.output_parts(out)  # a split GGUF: its files, the first one standing for the output
            others = job.other_layouts(out, parts)  # (the output split otherwise, or not split: it exists)
            out = parts[0] if parts else out
            result.output = str(out)
            mmproj = MmprojJob(plan, options, source.model_name(ckpt.source)) if options.mmproj is not None else None
            mm_out = _mmproj_output(options, out, mmproj.naming if mmproj is not None else None,
                                    source.hub.revision if source.hub is not None else None)
            modelfile = plan_modelfile(options, job.gplan, ckpt.source, out, parts,
                                       mm_out if mmproj is not None else None) if options.modelfile else None
            if options.dry_run:
                result.dry_run, result.plan_text = job.plan_dict(), job.describe()
                result.output_exists = bool(others) or any(p.exists() for p in parts or [out])
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
            threads = options.worker_threads
            if share is not None:  # (every target planned before the first shared block is made)
                share.link(job.sources(), options.to.dequantize_to, job.work_per_weight)
                threads = share.ready()  # (its share of the run's threads)
            run, notes = _run_settings(options, plan, source, out.name, lora, threads)
            result.timings["plan"] = time.perf_counter() - t0
            write_output(job, options, source, ckpt.source, out, run, result, committed, parts, on_checked, others)
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
    return done(result, job, notes, t0)


def done(result: ConvertResult, job: TargetJob, notes: list[str], t0: float) -> ConvertResult:
    """Step 7: the job's figures, notes and details into ``result``, with the total time and the peak RSS."""
    result.notes = notes + job.notes()
    result.details.update(job.details())
    result.tensors, result.elements, result.bytes_in = job.tensors, job.elements, job.in_nbytes
    result.fp16_overflow, result.fp16_underflow = job.fp16_counts()
    result.seconds = result.timings["total"] = time.perf_counter() - t0
    result.gelem_per_s = result.elements / result.seconds / 1e9 if result.seconds > 0 else 0.0
    result.peak_rss_bytes = peak_rss_bytes()
    return result


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
                         expected=f">= {format_bytes(need)}", found=format_short_of(options.max_memory, need),
                         hint="raise --max-memory")
    return threads


def _run_settings(options: ConvertOptions, plan: Plan, source: ResolvedSource, label: str, lora: LoraRun | None,
                  asked: int) -> tuple[RunSettings, list[str]]:
    """How the job writes: ``asked`` threads (lowered, with a note, where their chunks, or the merges' working
    copies, would not fit ``max_memory``: :func:`_merge_threads`), the cap for the chunks (``max_memory``
    less what the merges of the tensors in flight hold beside them), progress, and a low-disk run's shard
    lifetime."""
    notes = []
    threads = _merge_threads(options, lora, asked)
    reserved = lora.held_nbytes(2 * threads + 1) if lora is not None else 0
    max_memory = options.max_memory - reserved
    threads = min(threads, max_threads(max_memory, max((t.source.unit for t in plan.tensors), default=1)))
    if threads < asked:
        given = f"--threads {asked}" if asked == options.worker_threads else (
            f"{asked} threads (this target's share of --threads {options.worker_threads})")
        notes.append(f"{given} lowered to {threads}: more threads' chunks would not fit "
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


def write_output(job: TargetJob, options: ConvertOptions, source: ResolvedSource, input_path: Path, out: Path,
                 run: RunSettings, result: ConvertResult, committed: list[Path], parts: list[Path] | None = None,
                 on_checked: Callable[[], None] | None = None, others: list[Path] | None = None) -> None:
    """Claim ``out`` (with ``parts``: the files of a split output, ``out`` the first), write the job into its
    staging path, verify, list the files, commit; the figures go into ``result`` (timings, bytes out, files,
    shards written and reused, what the claim recovered). ``on_checked``: the claim's
    (:class:`convert.output.OutputClaim`), called once the output is checked, before anything is written;
    ``others``: the output's files in another layout (:meth:`convert.targets.TargetJob.other_layouts`)."""
    timings = result.timings
    resume_key = None if options.resume_key is None else {**options.resume_key, "job": job_key(options, source)}
    with OutputClaim(out, is_dir=job.is_dir, nbytes=job.disk_nbytes, inputs=[input_path],
                     overwrite=options.overwrite, resume_key=resume_key, file_suffix=job.file_suffix,
                     parts=parts, on_checked=on_checked, others=others) as claim:
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


def named_default(options: ConvertOptions, source: ResolvedSource, naming: GgufNaming | None) -> Path:
    """:func:`convert.output_names.default_output` of this run's source, with a GGUF job's ``naming`` (None: the
    name known before the input was read)."""
    hub = source.hub
    return default_output(None if hub is not None else Path(options.src), options.to,
                          hub.repo_id if hub is not None else None, hub.revision if hub is not None else None,
                          naming=naming)


def _mmproj_output(options: ConvertOptions, out: Path, naming: GgufNaming | None, revision: str | None) -> Path:
    """The ``--mmproj`` path, checked against the text model's output before anything is written: a file
    path, or a directory (an existing one, or a path ending in a separator; ``.`` for the working directory)
    that the file goes into under its default name (``mmproj-`` + llama.cpp's naming convention:
    :func:`convert.output_names.gguf_file_name`).

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
    write_output(job, replace(options, manifest=options.mmproj_manifest), source, input_path, out, run, mm,
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
    write_output(job, replace(options, manifest=options.modelfile_manifest), source, input_path, job.path, run, mf,
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

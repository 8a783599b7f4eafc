"""``convert-bnb SRC --to T -o OUT --push-to-hub ORG/NAME``: one conversion, then its upload with a model card.

:func:`publish` runs :func:`convert.job.convert`, records the finished output, and uploads it
(:func:`convert.hub.upload.upload`) with its card (:func:`convert.hub.card.model_card`):

- the record ``.NAME.convert-bnb-push.json`` beside the output (written atomically) holds the run's key
  (:func:`convert.run.single.job_key`: source and commit, every setting that changes the bytes, the converter
  version), the output's files with their sizes and sha256, what the card says of the source (its
  quantization, its card's license) and the figures the run measured, and, once uploaded, ``pushed``
  (repo, branch, key, Hub commit);
- a run that finds its output in place (OUT-001, or any time with ``--overwrite``) with a record of the same key
  whose files are all there with their recorded sizes and sha256 does not convert again: it uploads that
  output (the same command after a failed upload only uploads), or nothing when the record says it was
  pushed to the same repo and branch with the same key. An output without such a record is refused as before
  (OUT-001: it may be someone else's).
- an upload that fails (offline, no token, 401/403, the network down) is HUB-003: the output stays, recorded,
  and the command exits 2; run it again (the same ``--push-to-hub``) to upload only: its hint names the record.
- a commit of another output at the same path (``--overwrite``, by a run with or without ``--push-to-hub``)
  removes the record of the output it replaces (:class:`convert.output.OutputClaim`); a run that pushes then
  writes its own.

A run of several targets (``--to bf16,gguf:q8_0 --push-to-hub ORG``) takes an organisation or user, as ``batch
--push-to-hub ORG`` does: each output goes to its own repo ``ORG/NAME`` (:func:`convert.hub.repo.output_repo_name`:
the output's name without its extension; one quantization a repo, as gguf-my-repo names them), with its own
card and record. Outputs an earlier run of the same settings finished and recorded are kept; the others are made
in one run of those targets; then each is uploaded unless its record says it was pushed there. Every output is
tried: one HUB-003 names every repo not pushed (:func:`convert.hub.upload.push_refused`).

A run killed between the output's commit and the record's write leaves an output without a record: the next
run refuses it (OUT-001) like any other existing output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from convert import __version__
from convert.hub.card import CardSource, model_card, published_command, source_license
from convert.hub.download import HubSource
from convert.hub.repo import check_owner, check_repo_id, output_repo_id, parse_repo_spec
from convert.hub.upload import (
    LARGE_UPLOAD,
    PushOptions,
    build_upload_plan,
    local_file,
    push_refused,
    repo_files,
    upload,
    upload_folder_path,
)
from convert.inspection import InspectOptions, inspect_checkpoint
from convert.job import convert
from convert.options import ConvertOptions, Target
from convert.output import RECORD_MARK, InterruptedAfterCommit, sha256_file, write_json
from convert.run.result import ConvertResult
from convert.run.several import member_options, set_plan_text
from convert.run.single import job_key
from convert.run.source import ResolvedSource
from convert.units import format_bytes, parse_size
from formats.checkpoint import open_checkpoint
from formats.errors import ConvertBnbError, HubUploadError, OutputExistsError, TargetsFailedError, UsageError
from formats.peft_config import ADAPTER_CONFIG

__all__ = ["RECORD_MARK", "add_push_arguments", "card_figures", "check_push", "commit_message",
           "planned_outputs", "publish", "push_from_args", "quant_summary", "record_path"]

#: The ``version`` of the records this module reads and writes.
RECORD_VERSION = 1


def add_push_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--push-to-hub REPO`` on the command line of one conversion."""
    g = p.add_argument_group("Hub upload")
    g.add_argument("--push-to-hub", metavar="REPO", default=None,
                   help="after the output is complete, upload it with a model card to the Hub repo REPO (org/name; "
                   "created if missing); a failed upload keeps the output and the same command uploads it later "
                   "without converting again")
    g.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    g.add_argument("--push-revision", metavar="BRANCH", default=None,
                   help="with --push-to-hub: the branch of REPO to push to, created from the default branch when "
                   "missing (default: the default branch; --revision is the SOURCE's revision)")
    g.add_argument("--push-large-size", metavar="SIZE", type=parse_size, default=None,
                   help="with --push-to-hub: outputs larger than SIZE go up with huggingface_hub's resumable folder "
                   "upload (upload_folder: several commits with hf_xet), smaller ones in one commit (default: "
                   f"{_size_text(LARGE_UPLOAD)})")


def _size_text(n: int) -> str:
    """A size as the options take it: ``5GB`` for a whole number of decimal gigabytes, else binary units."""
    return f"{n // 10**9}GB" if n and n % 10**9 == 0 else format_bytes(n)


def push_from_args(args: argparse.Namespace) -> PushOptions | None:
    """The ``--push-to-hub`` options of a parsed command line (:func:`add_push_arguments`), or None without it.

    Raises:
        UsageError: USE-001, ``--private``, ``--push-revision`` or ``--push-large-size`` without
            ``--push-to-hub``.
    """
    if args.push_to_hub is None:
        for flag, value in (("--private", args.private), ("--push-revision", args.push_revision),
                            ("--push-large-size", args.push_large_size)):
            if value not in (None, False):
                raise UsageError(f"{flag} needs --push-to-hub REPO")
        return None
    large = LARGE_UPLOAD if args.push_large_size is None else args.push_large_size
    return PushOptions(args.push_to_hub, args.private, args.push_revision, large)


def check_push(push: PushOptions, several: bool = False) -> None:
    """Refuse a target that cannot be pushed to, before anything is converted.

    Args:
        push: where to push.
        several: a run of several targets (``push.repo_id`` is then an organisation or user).

    Raises:
        UsageError: USE-001, the repo is not ``org/name`` (with ``several``: not an organisation or user name),
            or the branch is empty or holds blanks.
    """
    if several and "/" in push.repo_id:
        raise UsageError("--push-to-hub with several --to targets takes an organisation or user: each output goes "
                         "to a repo of its own, ORG/<its name>", expected="org", found=push.repo_id,
                         hint="give the owner only (my-org), or push one target with --push-to-hub org/name")
    if several:
        check_owner(push.repo_id)
    else:
        check_repo_id(push.repo_id, push.repo_id, "org/name")
    if push.revision is not None and (not push.revision.strip() or any(c.isspace() for c in push.revision)):
        raise UsageError("--push-revision needs a branch name", expected="a name without blanks",
                         found=repr(push.revision))


def record_path(out: Path) -> Path:
    """The record of output ``out`` (see the module docstring): ``.NAME.convert-bnb-push.json`` beside it."""
    return out.with_name(f".{out.name}{RECORD_MARK}")


def publish(options: ConvertOptions, push: PushOptions, argv: Sequence[str] | None = None) -> ConvertResult:
    """Convert (or find the output an earlier run of the same key finished), then push it with its card.

    Args:
        options: the conversion.
        push: where to push.
        argv: the command line's arguments (for the card's command: :func:`convert.hub.card.published_command`),
            or None (the card gives ``convert-bnb SRC --to T``).

    Returns:
        the conversion's :class:`~convert.run.result.ConvertResult` (of the earlier run's output when it was kept:
        no tensors counted, a note saying so) with ``details["push"]``: ``repo``, ``revision``, ``private``,
        ``method`` (``commit``, ``large-folder``, or ``none`` when already pushed), ``commit`` (the Hub's),
        ``files``, ``bytes``, ``converted`` (False: an earlier run's output) and ``uploaded``. A dry run's
        plan gets ``push``: the upload plan and the card (files and figures after the conversion).

    Raises:
        UsageError: USE-001, a bad ``push``.
        HubUploadError: HUB-003, the upload failed; the output is complete, in place and recorded.
        ConvertBnbError, OSError: as :func:`convert.job.convert`.
    """
    several = options.to.family == "multi"
    check_push(push, several)
    if several:
        return _publish_set(options, push, argv)
    if options.dry_run:
        result = convert(options)
        result.plan_text += "\n  push: " + _plan_push(result, options, push, argv)
        return result
    result, record = _convert_or_keep(options)
    out = Path(result.output)
    converted = record is None
    if record is None:
        record = _new_record(options, result)
        write_json(record_path(out), record)
    try:
        return _push(result, record, options, push, argv, converted, _retry_hint([out]))
    except KeyboardInterrupt as exc:  # the output is complete and in place: say so
        if isinstance(exc, InterruptedAfterCommit):
            raise
        raise InterruptedAfterCommit(out) from exc


def _publish_set(options: ConvertOptions, push: PushOptions, argv: Sequence[str] | None) -> ConvertResult:
    """:func:`publish` of a run of several targets: each output to ``ORG/NAME`` (see the module docstring).

    Returns:
        the run's result, each output's with its ``details["push"]`` (a dry run: its plan's ``push``); an
        output an earlier run made is kept (no tensors counted, a note saying so).

    Raises:
        UsageError: as :func:`convert.run.several.member_options`.
        TargetsFailedError: OUT-006, some targets failed; the complete outputs are recorded, not uploaded (the
            same command uploads them once the others are made).
        HubUploadError: HUB-003, some uploads failed (every output is tried), naming each repo not pushed; every
            output is complete and recorded, those uploaded stay pushed, and the same command uploads the rest.
    """
    subs = member_options(options)[0]
    planned = convert(replace(options, dry_run=True, progress=False))
    pushes = [replace(push, repo_id=output_repo_id(push.repo_id, Path(o.output).name)) for o in planned.outputs]
    for p in pushes:  # (an output's name the Hub refuses: before anything is converted)
        check_repo_id(p.repo_id, p.repo_id, "ORG/<the output's name>")
    if options.dry_run:
        lines = [f"\n  push {Path(o.output).name}: " + _plan_push(o, sub, p, argv)
                 for sub, o, p in zip(subs, planned.outputs, pushes, strict=True) if o.error is None]
        planned.plan_text = set_plan_text(planned, options.overwrite) + "".join(lines)  # (kept: no --overwrite)
        return planned
    kept = [_kept_at(sub, o) if o.error is None else None for sub, o in zip(subs, planned.outputs, strict=True)]
    outputs: list[ConvertResult | None] = [k[0] if k is not None else None for k in kept]
    records = [k[1] if k is not None else None for k in kept]
    todo = [i for i, k in enumerate(kept) if k is None]
    result = ConvertResult(source=planned.source, to=options.to.name, output=planned.output, commit=planned.commit)
    failed: TargetsFailedError | None = None
    if todo:
        members = tuple(subs[i].to for i in todo)
        rest = replace(options, to=Target(",".join(t.name for t in members), "multi", "auto", members=members),
                       list_files=True)
        try:
            result = convert(rest)
        except TargetsFailedError as exc:
            failed, result = exc, exc.result
        for i, made in zip(todo, result.outputs, strict=True):
            outputs[i] = made
            if made.error is None:
                records[i] = _new_record(subs[i], made)
                write_json(record_path(Path(made.output)), records[i])
        result.to = options.to.name
    if len(todo) < len(subs):
        result.notes.append(f"{len(subs) - len(todo)} of {len(subs)} outputs made by an earlier run with the same "
                            "settings: kept, not converted again")
    result.outputs = [o for o in outputs if o is not None]
    if failed is not None:
        raise failed
    refused: list[tuple[Path, HubUploadError]] = []
    for i, (sub, out, record) in enumerate(zip(subs, outputs, records, strict=True)):
        assert out is not None and record is not None
        try:
            _push(out, record, sub, pushes[i], argv, i in todo, _retry_hint([Path(out.output)]))
        except HubUploadError as exc:  # the others are tried too: the error names every repo not pushed
            refused.append((Path(out.output), exc))
        except KeyboardInterrupt as exc:  # every output is complete and in place: say so
            if isinstance(exc, InterruptedAfterCommit):
                raise
            raise InterruptedAfterCommit(Path(out.output)) from exc
    if refused:
        pushed = [p.repo_id for p, o in zip(pushes, outputs, strict=True)
                  if o is not None and all(Path(o.output) != path for path, _ in refused)]
        hint = _retry_hint([path for path, _ in refused])
        raise push_refused([r for _, exc in refused for r in exc.refused],
                           hint + (f" ({', '.join(pushed)} pushed)" if pushed else ""))
    return result


def _retry_hint(outs: list[Path]) -> str:
    """The hint of a refused push (HUB-003): the outputs are kept and recorded (the records named), and the same
    command, with the same ``--push-to-hub``, only uploads them."""
    records = [record_path(o) for o in outs]
    if len(outs) == 1:
        kept, it = f"the output is kept ({outs[0]}) and recorded in '{records[0]}'", "it"
    else:
        kept, it = ("the outputs are kept and recorded in " + ", ".join(f"'{r.name}'" for r in records)
                    + f" (in '{records[0].parent}')", "them")
    return f"{kept}: run the same command again, with the same --push-to-hub, to upload {it} only (no conversion)"


def _convert_or_keep(options: ConvertOptions) -> tuple[ConvertResult, dict[str, Any] | None]:
    """The conversion's result and None, or, when the output is in place and recorded with this run's key, a
    result standing for it and its record (with ``--overwrite`` too: the bytes would be the same)."""
    if not options.overwrite:
        try:
            return convert(replace(options, list_files=True)), None
        except OutputExistsError:
            kept = _kept_output(options)
            if kept is None:
                raise
            return kept
    kept = _kept_output(options)
    return kept if kept is not None else (convert(replace(options, list_files=True)), None)


def _kept_output(options: ConvertOptions) -> tuple[ConvertResult, dict[str, Any]] | None:
    """An earlier run's output of this run's key, complete and in place, with its record; else None.

    The output's path is the one the run would write (a dry run plans it: nothing is downloaded or written).
    """
    return _kept_at(options, convert(replace(options, dry_run=True, progress=False)))


def _kept_at(options: ConvertOptions, planned: ConvertResult, hashes: bool = True
             ) -> tuple[ConvertResult, dict[str, Any]] | None:
    """:func:`_kept_output` of the output a dry run of ``options`` planned; ``hashes`` False: the files' sizes
    checked, not their sha256 (a dry run's wording reads no output whole)."""
    out = Path(planned.output)
    record = _load_record(record_path(out))
    if record is None or record.get("key") != _key(options, planned):
        return None
    outputs = [(out, record.get("files")), *_extra_outputs(planned.dry_run, record)]
    if not all(_in_place(path, files, hashes) for path, files in outputs):
        return None
    result = ConvertResult(source=planned.source, to=planned.to, output=str(out), commit=planned.commit,
                           files=record["files"], verified=bool(record.get("verified")))
    result.bytes_out = sum(r["bytes"] for _, files in outputs for r in (files or {}).values())
    result.notes = [f"{out} was made by an earlier run with the same settings (its record "
                    f"{record_path(out).name} and files match): kept, not converted again"]
    for key, files in _EXTRAS:
        if (planned.dry_run or {}).get(key):
            result.details[key] = {"output": planned.dry_run[key]["output"], "files": record[files]}
    return result, record


#: The outputs a run writes besides the model, each with its own manifest in the record: (the result's
#: ``details`` / dry-run plan key, the record key of its files).
_EXTRAS = (("mmproj", "mmproj_files"), ("modelfile", "modelfile_files"))


def _extra_outputs(details: dict[str, Any] | None, record: dict[str, Any]) -> list[tuple[Path, Any]]:
    """The ``--mmproj`` and ``--modelfile`` files of a run (from its result's ``details`` or its dry-run plan),
    each with its manifest as ``record`` holds it."""
    return [(Path(details[k]["output"]), record.get(f)) for k, f in _EXTRAS
            if isinstance((details or {}).get(k), dict) and details[k].get("output")]


def _load_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path``, or None (none, unreadable, another version)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == RECORD_VERSION else None


def _in_place(out: Path, files: Any, hashes: bool = True) -> bool:
    """Whether every recorded file of output ``out`` is there with its recorded size and (``hashes``) sha256."""
    if not isinstance(files, dict) or not files:
        return False
    for rel, rec in files.items():
        path = local_file(out, rel)
        try:
            if not path.is_file() or path.stat().st_size != rec.get("bytes") or (
                    hashes and sha256_file(path) != rec.get("sha256")):
                return False
        except (OSError, AttributeError):
            return False
    return True


def _key(options: ConvertOptions, result: ConvertResult) -> dict[str, Any]:
    """:func:`convert.run.single.job_key` of a run, from its result (the source it read and the commit)."""
    if result.commit is None:
        return job_key(options, ResolvedSource(Path(result.source)))
    repo = result.source.rpartition("@")[0]
    return job_key(options, ResolvedSource(Path("."), HubSource(repo, options.revision, result.commit, Path("."))))


def _new_record(options: ConvertOptions, result: ConvertResult) -> dict[str, Any]:
    """The record of an output just converted (see the module docstring)."""
    source = _card_source(options, result)
    record: dict[str, Any] = {
        "version": RECORD_VERSION, "key": _key(options, result), "output": Path(result.output).name,
        "files": result.files, "verified": result.verified,
        "source": {"repo": source.repo_id, "name": source.name, "revision": source.revision, "commit": source.commit},
        "quantization": list(source.quantization), "license": source.license, "figures": card_figures(result),
        "merged": [Path(p).name for p in options.merge_lora],
    }
    for key, files in _EXTRAS:
        if result.details.get(key) is not None:
            record[files] = result.details[key].get("files", {})
    adapter = result.details.get("gguf", {}).get("adapter")
    if adapter is not None:
        record["adapter"] = _card_adapter(adapter)
    return record


def _card_adapter(info: dict[str, Any]) -> dict[str, Any]:
    """What a GGUF LoRA adapter's card needs of its job's ``adapter`` details (no local path: the base by its
    folder's name or repo id)."""
    return {"base_name": info.get("base_name"), "base_repo": info.get("base_repo"),
            "scale_notes": list(info.get("scale_notes") or [])}


def _card_source(options: ConvertOptions, result: ConvertResult) -> CardSource:
    """What the card says of the source: repo, revision, commit (or a local source's name), the quantized
    layers and the source card's license, read from the local source or the Hub snapshot in the cache (no
    download: a low-disk run's snapshot is not there, and its card then names neither)."""
    if result.commit is None:
        path = Path(result.source)
        return CardSource(None, path.name, quantization=tuple(quant_summary(path)),
                          license=source_license(path if path.is_dir() else None))
    repo, rev = parse_repo_spec(options.src)
    snapshot = _cached_snapshot(repo, result.commit)
    quant = tuple(quant_summary(snapshot)) if snapshot is not None else ()
    return CardSource(repo, repo, options.revision or rev, result.commit, quant,
                      source_license(snapshot, repo, result.commit))


def _cached_snapshot(repo: str, commit: str) -> Path | None:
    """The snapshot folder of ``repo`` at ``commit`` in the HF cache, when the files a card reads are there."""
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import try_to_load_from_cache

    for name in ("config.json", "README.md", "model.safetensors.index.json", "model.safetensors", ADAPTER_CONFIG):
        found = try_to_load_from_cache(repo, name, revision=commit)
        if isinstance(found, str):
            return Path(found).parent
    return None


def quant_summary(src: Path) -> list[str]:
    """One line per group of quantized layers in the source (headers only); none when it cannot be read."""
    try:
        with open_checkpoint(src) as ckpt:
            rep = inspect_checkpoint(ckpt, InspectOptions())
    except (ConvertBnbError, OSError):
        return []
    lines = []
    for g in rep["quantized"]:
        nested = f", nested (blocksize {g['nested_blocksize']}, {g['nested_dtype']})" if g["nested"] else ""
        lines.append(f"{g['quant_type']}, blocksize {g['blocksize']}{nested}, dtype {g['dtype']}, "
                     f"storage {g['storage']}: {g['layers']} layers")
    for g in rep["int8"]:
        lines.append(f"LLM.int8 ({g['weight_dtype']} weight, {g['scale_dtype']} scale): {g['layers']} layers")
    return lines


def card_figures(result: ConvertResult) -> list[str]:
    """What a run measured, one line each, for the card: whether the output was re-read and checked before it
    was committed, what was written, float16 overflows, and per target the error figures (GGUF: the types
    and the relative RMS error of its tensors against the dequantized weights, or a GGUF LoRA adapter's against
    the adapter's values; NF4/FP4: the relative error
    line of the run's notes)."""
    lines = [("re-read and checked (headers, sizes, tensors) before it was committed" if result.verified
              else "not re-read before it was committed (--no-verify)"),
             f"{result.tensors} tensors, {result.elements} values, {result.bytes_out} bytes written"]
    if result.fp16_line():
        lines.append(str(result.fp16_line()))
    gg = result.details.get("gguf")
    if gg:
        counts = ", ".join(f"{n} x{k}" for n, k in sorted(gg.get("type_counts", {}).items()))
        lines.append(f"GGML types: {counts}")
        errs = [(t["rel_rms_error"], t["name"]) for t in gg.get("tensors", [])
                if isinstance(t.get("rel_rms_error"), float) and math.isfinite(t["rel_rms_error"])]
        if errs:
            worst = max(errs)
            what = "the adapter's lora_A/lora_B values" if gg.get("adapter") else "the dequantized weights"
            lines.append(f"relative RMS error against {what}: mean "
                         f"{sum(e for e, _ in errs) / len(errs):.6f}, max {worst[0]:.6f} ({worst[1]})")
    lines += [n for n in result.notes if n.startswith("relative error")]
    return lines


def _push(result: ConvertResult, record: dict[str, Any], options: ConvertOptions, push: PushOptions,
          argv: Sequence[str] | None, converted: bool, hint: str) -> ConvertResult:
    """Upload the recorded output (unless the record says it was pushed there with this key), record the push,
    and put what was done into ``result.details["push"]``.

    Raises:
        HubUploadError: HUB-003, the upload failed (with ``hint``: how to retry); the output and its record stay.
    """
    out = Path(result.output)
    target = {"repo": push.repo_id, "revision": push.revision, "key": record["key"]}
    outputs = [(out, record["files"]), *_extra_outputs(result.details, record)]
    done = {"repo": push.repo_id, "revision": push.revision, "private": push.private, "converted": converted,
            "files": sum(len(repo_files(f)) for _, f in outputs) + 1}
    pushed = record.get("pushed")
    if isinstance(pushed, dict) and {k: pushed.get(k) for k in target} == target:
        result.details["push"] = {**done, "method": "none", "commit": pushed.get("commit"), "bytes": 0,
                                  "uploaded": False}
        return result
    card = _card(record, options, push, argv, outputs)
    plan = build_upload_plan(push, outputs, card, _message(record, options))
    commit = upload(plan, card, upload_folder_path(out), progress=options.progress, hint=hint)
    record["pushed"] = {**target, "commit": commit, "method": plan["method"]}
    write_json(record_path(out), record)
    result.details["push"] = {**done, "method": plan["method"], "commit": commit, "bytes": plan["bytes"],
                              "uploaded": True}
    return result


def _card(record: dict[str, Any], options: ConvertOptions, push: PushOptions, argv: Sequence[str] | None,
          outputs: list[tuple[Path, dict[str, dict[str, Any]] | None]]) -> str:
    """The card of a recorded output (:func:`convert.hub.card.model_card`)."""
    src = record["source"]
    source = CardSource(src["repo"], src["name"], src["revision"], src["commit"], tuple(record["quantization"]),
                        record["license"])
    files = {rel: rec for _, f in outputs for rel, rec in repo_files(f).items()}
    return model_card(push.repo_id.split("/", 1)[1], options.to, source, files, command=_command(options, argv),
                      figures=record["figures"], merged=record["merged"], adapter=record.get("adapter"))


def _command(options: ConvertOptions, argv: Sequence[str] | None) -> str:
    """The card's command: the command line given (local paths by their last component), or without one
    ``convert-bnb SRC --to T``."""
    if argv is not None:
        return published_command(argv)
    return published_command([options.src, "--to", options.to.name])


def _message(record: dict[str, Any], options: ConvertOptions) -> str:
    """The commit message of a single run's push (:func:`commit_message`)."""
    return commit_message(record["source"]["name"], options.to)


def commit_message(source_name: str, to: object) -> str:
    """The commit message of a push: the converter, the source's name (a repo id, or a local source's own name:
    a pushed commit must not publish this machine's paths) and the target."""
    return f"convert-bnb {__version__}: {source_name} --to {to}"


def _plan_push(result: ConvertResult, options: ConvertOptions, push: PushOptions, argv: Sequence[str] | None) -> str:
    """A dry run's push plan, into its plan (``push``: the upload plan and the card, whose files and figures
    are known after the conversion); returns what the plan text says of it."""
    assert result.dry_run is not None
    repo, rev = parse_repo_spec(options.src) if result.commit is not None else (None, None)
    src_path = Path(result.source)
    source = (CardSource(repo, repo, options.revision or rev, result.commit) if repo is not None else
              CardSource(None, src_path.name, license=source_license(src_path if src_path.is_dir() else None)))
    record = {"source": {"repo": source.repo_id, "name": source.name, "revision": source.revision,
                         "commit": source.commit}, "quantization": [], "license": source.license,
              "figures": ["(measured by the conversion)"], "merged": [Path(p).name for p in options.merge_lora]}
    if result.dry_run.get("adapter") is not None:
        record["adapter"] = _card_adapter(result.dry_run["adapter"])
    outputs = planned_outputs(result)
    card = _card(record, options, push, argv, outputs)
    plan = build_upload_plan(push, outputs, card, _message(record, options))
    kept = not options.overwrite and _kept_at(options, result, hashes=False) is not None
    result.dry_run["push"] = {**plan, "card": card, "kept": kept}
    branch = f"branch {push.revision}" if push.revision is not None else "the default branch"
    how = ("the resumable folder upload" if plan["method"] == "large-folder" else "one commit")
    when = ("without converting: the output in place is an earlier run's with these settings (its record "
            f"{record_path(Path(result.output)).name} and files match)" if kept else "after the conversion")
    return (f"{push.repo_id} ({branch}{', private' if push.private else ''}) {when}, in {how} (outputs over "
            f"{_size_text(push.large_size)} go up resumably)")


#: The sha256 of a planned file, known once it is written.
_LATER = "(after conversion)"


def planned_outputs(result: ConvertResult) -> list[tuple[Path, dict[str, dict[str, Any]]]]:
    """A dry run's outputs with their planned manifests, as the upload would take them: the model's files with
    their planned bytes (a float or NF4/FP4 output: each shard's tensor data, the index as 0 bytes, a local
    source directory's other files as they are; a GGUF: its tensor data, per part when split), the
    ``--mmproj`` file's tensor data and the ``--modelfile`` text's exact bytes and sha256. Sizes leave out
    the headers, which are known once written; the sha256 of every file but the Modelfile is
    ``(after conversion)``. (A single run's push plan, and ``batch --dry-run``'s for each output of a job of
    several targets.)"""
    plan = result.dry_run or {}
    out = Path(result.output)
    files: dict[str, dict[str, Any]]
    if plan.get("parts"):
        files = {p["file"]: {"bytes": p["bytes"], "sha256": _LATER} for p in plan["parts"]}
    elif plan.get("files") and out.suffix.lower() != ".safetensors":
        files = {f["file"]: {"bytes": f["bytes"], "sha256": _LATER} for f in plan["files"]}
        if len(files) > 1:
            files["model.safetensors.index.json"] = {"bytes": 0, "sha256": _LATER}
        src = Path(result.source)
        if result.commit is None and src.is_dir():
            try:
                with open_checkpoint(src) as ckpt:
                    extras = list(ckpt.extra_files)
            except (ConvertBnbError, OSError):
                extras = []
            files.update({e.name: {"bytes": e.stat().st_size, "sha256": _LATER} for e in extras})
    else:
        files = {out.name: {"bytes": plan.get("out_bytes"), "sha256": _LATER}}
    outputs = [(out, files)]
    mm = plan.get("mmproj")
    if mm:
        outputs.append((Path(mm["output"]), {Path(mm["output"]).name: {"bytes": mm.get("out_bytes"),
                                                                         "sha256": _LATER}}))
    mf = plan.get("modelfile")
    if mf:
        data = str(mf.get("text", "")).encode("utf-8")
        outputs.append((Path(mf["output"]), {Path(mf["output"]).name: {
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}))
    return outputs

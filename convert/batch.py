"""``convert-bnb batch JOBS --out-dir DIR``: many conversions, resumable, failures isolated.

JOBS file
    A text file with one job per line: ``SRC[@REVISION] [--to T] [--revision R] [--max-shard-size S]
    [--name NAME]``, where SRC is a Hub repo id (``org/name``) or a local path; ``#`` starts a
    comment; blank lines are skipped. Or a JSON list (``.json``, or text starting with ``[``) -- or a
    YAML list (``.yaml``/``.yml``, when PyYAML is installed) -- whose items are such lines or objects
    ``{"src": ..., "revision": ..., "to": ..., "max_shard_size": ..., "name": ...}`` (``repo`` is
    accepted for ``src``). Options left out come from the command line. Rules, each a
    :class:`~formats.errors.UsageError` naming the file and line:

    =========  ====================================================================================
    BATCH-001  the file reads and parses (text, JSON or YAML list)
    BATCH-002  every item is a job line or an object with ``src`` (or ``repo``)
    BATCH-003  per-job options are known and valid
    BATCH-004  no two jobs write the same output name (set ``--name``)
    =========  ====================================================================================

Layout under DIR
    ``DIR/NAME/`` is a finished output (``NAME`` defaults to ``<repo name>-<to>``, as the main job);
    ``DIR/.convert-bnb/NAME.json`` the job's state file, ``NAME.partial/`` its unfinished output,
    ``NAME.log`` the worker's stderr, ``NAME.spec.json`` what the worker was asked to do, and
    ``lock`` (held with ``flock`` while a batch runs: one batch per DIR at a time).

Running
    Each job runs in its own worker process (``--jobs N`` at a time; one job's crash cannot stop
    the others), with ``--max-memory`` split evenly between the N workers, and the threads too.
    A worker resolves SRC (Hub repos through :mod:`convert.hub`, honouring the HF cache and
    offline mode), plans, and writes the output shard by shard into ``NAME.partial/``: each shard
    with :func:`convert.pipeline.run_plan` (verify-then-rename), then its size and sha256 go into
    the state file. At the end the index, config and small files are added and ``NAME.partial`` is
    renamed to ``NAME``; the state records every file's size and sha256 and ``status: done``.

Resuming
    The state's ``key`` is (source, resolved commit, ``--to``, ``--max-shard-size``, converter
    version). A re-run skips a job whose state is ``done`` with the same key and whose files still
    have the recorded sizes and sha256; for an unfinished job it keeps every shard in
    ``NAME.partial/`` whose size and sha256 match the state, and writes only the rest. A different
    key starts the job over. Targets registered by other modules (``--to gguf``, ...) resume per
    job, not per shard.

Pushing
    ``--push-to-hub ORG`` creates ``ORG/NAME`` (``exist_ok``) and uploads the output in one commit
    with a model card (``README.md``) recording the source repo and commit, the settings and the
    converter version. A re-run does not push a job again once pushed with the same key.
    ``--dry-run`` converts nothing and prints each job's plan, the card and the upload plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formats.errors import (
    ConvertBnbError,
    ForeignFilesError,
    JobSettingsChangedError,
    OutputInsideInputError,
    OutputKindError,
    UsageError,
    VerificationError,
)

from . import __version__
from .job import job_key
from .output import recorded_shards, sha256_file
from .units import format_bytes, parse_size

if TYPE_CHECKING:  # the rest is imported where used: this module loads at CLI start-up
    import subprocess
    from concurrent.futures import Future

__all__ = [
    "STATE_DIR",
    "Job",
    "JobResult",
    "build_upload_plan",
    "job_key",
    "model_card",
    "parse_jobs",
    "run_batch",
    "run_job",
    "sha256_file",
]

STATE_DIR = ".convert-bnb"
#: Exit code of ``convert-bnb batch`` when at least one job failed.
EXIT_JOBS_FAILED = 3
_STATE_VERSION = 1


@dataclass
class Job:
    """One conversion of a batch.

    Attributes:
        src: a Hub repo id ``org/name`` or a local path.
        revision: branch, tag or commit (Hub only), or None (the default branch).
        to: the ``--to`` target.
        max_shard_size: largest output shard in bytes.
        name: the output name under the batch's out dir (also the pushed repo's name).
        where: ``FILE:LINE`` (or ``FILE[i]``) the job came from, for messages.
    """

    src: str
    revision: str | None
    to: str
    max_shard_size: int
    name: str
    where: str = ""

    @property
    def is_repo(self) -> bool:
        """Whether SRC is a Hub repo id (not an existing local path)."""
        from .hub import is_repo_id

        return is_repo_id(self.src)


# ---------------------------------------------------------------- JOBS file

def _targets() -> list[str]:
    from .targets import target_names

    return target_names()


def _job_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(prog="job", add_help=False, exit_on_error=False)
    p.add_argument("src")
    p.add_argument("--to")
    p.add_argument("--revision")
    p.add_argument("--max-shard-size", type=parse_size)
    p.add_argument("--name")
    return p


def _default_name(src: str, to: str) -> str:
    from .hub import is_repo_id, parse_repo_spec
    from .output import default_output

    repo, _ = parse_repo_spec(src)
    return default_output(Path(src), to, repo if is_repo_id(repo) else None).name


def _make_job(fields: dict[str, Any], defaults: argparse.Namespace, where: str, path: Path) -> Job:
    from .hub import parse_repo_spec

    def bad(msg: str, **kw: Any) -> UsageError:
        return UsageError(f"{where}: {msg}", path=path, rule="BATCH-003", **kw)

    src = fields.get("src")
    if not isinstance(src, str) or not src.strip():
        raise UsageError(f"{where}: a job needs a source (repo id or path)", path=path, rule="BATCH-002",
                         found=fields)
    src, rev_in_src = parse_repo_spec(src.strip())
    if os.path.exists(src):  # a local path: absolute, so every worker reads the same one
        src = os.path.abspath(src)
    revision = fields.get("revision") or rev_in_src
    if revision is not None and not isinstance(revision, str):
        raise bad("revision must be a string", found=revision)
    to = fields.get("to") or defaults.to
    if to not in _targets():
        raise bad(f"unknown --to value '{to}'", expected=_targets(), found=to)
    mss = fields.get("max_shard_size")
    if mss is None:
        mss = defaults.max_shard_size
    elif isinstance(mss, str):
        try:
            mss = parse_size(mss)
        except argparse.ArgumentTypeError as exc:
            raise bad(str(exc)) from None
    if not isinstance(mss, int) or isinstance(mss, bool) or mss <= 0:
        raise bad("max_shard_size must be a positive size", found=mss)
    name = fields.get("name") or _default_name(src, to)
    if not isinstance(name, str) or "/" in name or name.startswith(".") or name in ("", ".."):
        raise bad("name must be a plain directory name", found=name)
    unknown = sorted(set(fields) - {"src", "revision", "to", "max_shard_size", "name"})
    if unknown:
        raise bad("unknown job fields", expected=["src", "revision", "to", "max_shard_size", "name"], found=unknown)
    return Job(src, revision, to, int(mss), name, where)


def _parse_line(text: str, defaults: argparse.Namespace, where: str, path: Path) -> Job | None:
    import shlex

    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}", path=path, rule="BATCH-001") from None
    if not tokens:
        return None
    try:
        ns, rest = _job_parser().parse_known_args(tokens)
    except (argparse.ArgumentError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"{where}: {exc}", path=path, rule="BATCH-003") from None
    if rest:
        raise UsageError(f"{where}: unknown job options", path=path, rule="BATCH-003",
                         expected="--to, --revision, --max-shard-size, --name", found=rest)
    fields = {k: v for k, v in vars(ns).items() if v is not None}
    return _make_job(fields, defaults, where, path)


def parse_jobs(path: str | os.PathLike[str], defaults: argparse.Namespace) -> list[Job]:
    """Read a JOBS file (text lines, a JSON list or a YAML list).

    Args:
        path: the JOBS file.
        defaults: an object with ``to`` and ``max_shard_size`` (bytes) for jobs that leave them out.

    Returns:
        the jobs, in file order.

    Raises:
        UsageError: BATCH-001 .. BATCH-004 (see the module docstring), naming file and line.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the JOBS file ({exc})", path=p, rule="BATCH-001") from None
    items: list[Any] | None = None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise UsageError("a YAML JOBS file needs PyYAML, which is not installed", path=p, rule="BATCH-001",
                             hint="write the list as JSON, or one job per line") from None
        try:
            items = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UsageError(f"the JOBS file is not valid YAML ({exc})", path=p, rule="BATCH-001") from None
    elif p.suffix.lower() == ".json" or text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"the JOBS file is not valid JSON ({exc})", path=p, rule="BATCH-001") from None
    jobs: list[Job] = []
    if items is not None:
        if not isinstance(items, list):
            raise UsageError("the JOBS file must hold a list", path=p, rule="BATCH-001",
                             found=type(items).__name__)
        for i, item in enumerate(items):
            where = f"{p.name}[{i}]"
            if isinstance(item, str):
                job = _parse_line(item, defaults, where, p)
            elif isinstance(item, dict):
                fields = dict(item)
                if "repo" in fields and "src" not in fields:
                    fields["src"] = fields.pop("repo")
                job = _make_job(fields, defaults, where, p)
            else:
                raise UsageError(f"{where}: a job must be a string or an object", path=p, rule="BATCH-002",
                                 found=type(item).__name__)
            if job is not None:
                jobs.append(job)
    else:
        for n, line in enumerate(text.splitlines(), 1):
            job = _parse_line(line, defaults, f"{p.name}:{n}", p)
            if job is not None:
                jobs.append(job)
    seen: dict[str, str] = {}
    for job in jobs:
        if job.name in seen:
            raise UsageError(f"{job.where}: output name '{job.name}' is also written by {seen[job.name]}",
                             path=p, rule="BATCH-004", hint="give one of them --name")
        seen[job.name] = job.where
    if not jobs:
        raise UsageError("the JOBS file lists no jobs", path=p, rule="BATCH-001",
                         expected="one job per line, or a non-empty list", found="none")
    return jobs


# ---------------------------------------------------------------- state and files

def _matches(path: Path, rec: dict[str, Any]) -> bool:
    """Whether a file has the recorded size and sha256 (size first: cheap)."""
    try:
        if not path.is_file() or path.stat().st_size != rec.get("bytes"):
            return False
    except OSError:
        return False
    return sha256_file(path) == rec.get("sha256")


def _load_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) and state.get("version") == _STATE_VERSION else {}


def _save_state(path: Path, state: dict[str, Any]) -> None:
    """Write the state atomically (a killed run leaves the old or the new state, never half of one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _present(root: Path) -> set[str]:
    """Relative names of every file of an output (a file: its own name)."""
    if root.is_file():
        return {root.name}
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def file_manifest_matches(root: Path, files: dict[str, dict[str, Any]]) -> bool:
    """Whether ``root`` holds exactly the recorded files with their recorded sizes and sha256."""
    if not files or _present(root) != set(files):
        return False
    return all(_matches(root if root.is_file() else root / rel, rec) for rel, rec in files.items())


def check_complete(root: Path, files: dict[str, dict[str, Any]]) -> None:
    """Refuse to call an output done unless it is complete: exactly the recorded files, at their
    recorded sizes, and every shard its index names.

    Raises:
        VerificationError: a file missing, extra or of another size, or a shard of the index missing (OUT-003).
    """
    present = _present(root)
    if present != set(files):
        raise VerificationError("the installed output differs from what was written", path=root, action="verify",
                                expected=sorted(files), found=sorted(present))
    for rel, rec in files.items():
        size = (root if root.is_file() else root / rel).stat().st_size
        if size != rec["bytes"]:
            raise VerificationError("an installed file has another size than was written", path=root / rel,
                                    action="verify", expected=rec["bytes"], found=size)
    if root.is_dir() and "model.safetensors.index.json" in files:
        index = json.loads((root / "model.safetensors.index.json").read_text(encoding="utf-8"))
        missing = sorted(set(index.get("weight_map", {}).values()) - present)
        if missing:
            raise VerificationError("the index names shards that are not there", path=root, action="verify",
                                    found=missing)


def _foreign_files(root: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Files under an existing output that the job's state does not record (the user's)."""
    if not (root.exists() or root.is_symlink()):
        return []
    if root.is_symlink():
        return [root.name]
    return sorted(_present(root) - set(files))


# ---------------------------------------------------------------- one job (runs in the worker process)

@dataclass
class JobResult:
    """What happened to one job.

    Attributes:
        name: the job's output name.
        src: its source (repo id or path).
        status: ``converted``, ``skipped`` (already done), ``failed``, or ``planned`` (dry run).
        output: the output path.
        commit: the resolved source commit (Hub), or None.
        shards_written: shards written by this run.
        shards_reused: finished shards kept from an earlier run.
        bytes_out: bytes of the output (all files).
        seconds: wall time of the job.
        peak_rss_bytes: the worker's peak resident set.
        error: the error line when failed.
        error_class: the error's class name when failed (``OutputBusyError``, ...).
        rule: the error's rule when failed (``OUT-004``, ...).
        pushed: the Hub repo pushed to (this run or before), or None.
        notes: the conversion's notes.
    """

    name: str
    src: str
    status: str
    output: str = ""
    commit: str | None = None
    shards_written: int = 0
    shards_reused: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    error: str | None = None
    error_class: str | None = None
    rule: str | None = None
    pushed: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def job_options(job: Job, spec: dict[str, Any], *, revision: str | None = None, overwrite: bool = False) -> Any:
    """The :class:`~convert.job.ConvertOptions` of one job: exactly what ``convert-bnb SRC --to ...
    -o OUT/NAME`` would use, resumable."""
    from .job import ConvertOptions

    return ConvertOptions(src=job.src, to=job.to, output=Path(spec["out_dir"]) / job.name,
                          revision=revision or job.revision, max_memory=spec["max_memory"], threads=spec["threads"],
                          max_shard_size=job.max_shard_size, verify=spec.get("verify", True), overwrite=overwrite,
                          resume_key={"batch": job.name}, manifest=True)


def run_job(spec: dict[str, Any]) -> JobResult:
    """Run one job of a batch (in the worker process): resolve, :func:`convert.job.convert`, verify, push.

    Args:
        spec: the job (``job``: :class:`Job` fields) and the batch settings (``out_dir``,
            ``max_memory`` and ``threads`` for this worker, ``verify``, ``overwrite``, ``push_to_hub``,
            ``private``).

    Returns:
        the :class:`JobResult` (also recorded in the state file).

    Raises:
        ConvertBnbError: any failure of the job (recorded in the state file first): the conversion's
            own errors, JobSettingsChangedError (BATCH-005), ForeignFilesError (BATCH-006).
    """
    from .job import convert, resolve_source
    from .pipeline import peak_rss_bytes

    t0 = time.perf_counter()
    job = Job(**spec["job"])
    out_dir = Path(spec["out_dir"])
    work = out_dir / STATE_DIR
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / f"{job.name}.json"
    final = out_dir / job.name
    state = _load_state(state_path)
    result = JobResult(job.name, job.src, "failed", str(final))
    try:
        source = resolve_source(job.src, job.revision, to=job.to, output=final)
        commit = source.hub.commit if source.hub is not None else None
        result.commit = commit
        options = job_options(job, spec, revision=commit)  # the commit the key names is the one converted
        key = job_key(options, source)
        recorded = state.get("files") or {}
        if (state.get("key") == key and state.get("status") == "done" and final.exists()
                and file_manifest_matches(final, recorded)):
            result.status = "skipped"
        else:
            overwrite = False
            if final.exists() or final.is_symlink():
                foreign = _foreign_files(final, recorded if state.get("status") == "done" else {})
                if foreign:
                    raise ForeignFilesError(
                        "the job's output holds files this batch did not write; redoing the job would remove them",
                        path=final, action="write", found=foreign[:5],
                        hint="move them out of the folder, or give the job another --name")
                if state.get("key") != key and not spec.get("overwrite"):
                    raise JobSettingsChangedError(
                        "the job's output was made with other settings", path=final, action="write",
                        expected=_key_text(key), found=_key_text(state.get("key")),
                        hint="pass --overwrite to redo it with the new settings, or give the job another --name")
                overwrite = True
            pushed = state.get("pushed") if state.get("key") == key else None
            state = {"version": _STATE_VERSION, "key": key, "job": asdict(job), "status": "running"}
            if pushed:
                state["pushed"] = pushed
            _save_state(state_path, state)
            done = convert(replace(options, overwrite=overwrite))
            check_complete(final, done.files)
            result.status = "converted"
            result.shards_written, result.shards_reused = done.shards_written, done.shards_reused
            result.notes = done.notes
            state.update(status="done", files=done.files, error=None)
            if source.hub is not None:
                state["source"] = {"repo": source.hub.repo_id, "revision": source.hub.revision,
                                   "commit": source.hub.commit}
            _save_state(state_path, state)
        result.bytes_out = sum(f["bytes"] for f in state.get("files", {}).values())
        if spec.get("push_to_hub"):
            result.pushed = _push(job, final, state, state_path, spec, commit, _quant_summary(source.path))
    except BaseException as exc:
        if state.get("status") != "done":  # a failed push leaves a finished conversion done
            state["status"] = "failed"
        state["error"] = str(exc) or type(exc).__name__
        if state.get("version"):
            _save_state(state_path, state)
        raise
    finally:
        result.seconds = time.perf_counter() - t0
        result.peak_rss_bytes = peak_rss_bytes()
    return result


def _key_text(key: Any) -> str:
    """A job key in one line for messages: the settings that differ from run to run."""
    if not isinstance(key, dict):
        return "no record"
    parts = [f"{k}={key[k]}" for k in ("commit", "to", "max_shard_size", "converter") if key.get(k) is not None]
    return ", ".join(parts)


# ---------------------------------------------------------------- model card and push

def _quant_summary(src: Path) -> list[str]:
    """One line per group of quantized layers in the source (headers only)."""
    from formats.checkpoint import open_checkpoint

    from .inspection import InspectOptions, inspect_checkpoint

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


def model_card(job: Job, commit: str | None, files: dict[str, dict[str, Any]],
               quantization: Iterable[str] = ()) -> str:
    """The model card (``README.md``) pushed with an output.

    Args:
        job: the job (source, revision, target, shard size).
        commit: the source commit the output was made from (None for a local source).
        files: the output's manifest ``{path: {"bytes", "sha256"}}``.
        quantization: lines describing the source's quantized layers.

    Returns:
        the card text: YAML front matter (``base_model``, tags) and a body naming the source repo and
        commit, the settings, the converter version and every file with its size and sha256.
    """
    target = {"auto": "each tensor's original dtype"}.get(job.to, job.to)
    # a local source is named by its folder only: a pushed card must not publish this machine's paths
    shown = job.src if job.is_repo else Path(job.src).name
    lines = ["---"]
    if job.is_repo:
        lines += [f"base_model: {job.src}"]
    lines += ["tags:", "- convert-bnb", "- bitsandbytes-dequantized", "library_name: transformers", "---", "",
              f"# {job.name}", ""]
    src = f"[{job.src}](https://huggingface.co/{job.src})" if job.is_repo else f"`{shown}`"
    lines += [f"{src} converted from its bitsandbytes quantization to {target} with "
              f"convert-bnb {__version__} (bit-exact with bitsandbytes' own dequantization).", ""]
    lines += ["## Source", "", f"- repo: {job.src}" if job.is_repo else f"- path: {shown}"]
    if job.is_repo:
        lines += [f"- revision: {job.revision or 'main (default branch)'}", f"- commit: {commit}"]
    for q in quantization:
        lines.append(f"- quantization: {q}")
    lines += ["", "## Settings", "", "| setting | value |", "|---|---|", f"| --to | {job.to} |",
              f"| --max-shard-size | {job.max_shard_size} bytes |", f"| converter | convert-bnb {__version__} |", ""]
    cmd = f"convert-bnb {shown}" + (f" --revision {commit}" if commit else "")
    cmd += f" --to {job.to} --max-shard-size {job.max_shard_size}"
    lines += ["Reproduce with:", "", "```", cmd, "```", ""]
    lines += ["## Files", "", "| file | bytes | sha256 |", "|---|---:|---|"]
    for rel, rec in sorted(files.items()):
        lines.append(f"| {rel} | {rec['bytes']} | {rec['sha256']} |")
    lines.append("")
    return "\n".join(lines)


def build_upload_plan(org: str, job: Job, out: Path, files: dict[str, dict[str, Any]] | None,
                      card: str, private: bool) -> dict[str, Any]:
    """What ``--push-to-hub`` does for one job: the repo to create and the files of the one commit."""
    ops: list[dict[str, Any]] = []
    for rel, rec in sorted((files or {}).items()):
        ops.append({"path_in_repo": rel, "bytes": rec["bytes"], "from": str(out / rel) if out.is_dir() else str(out)})
    ops.append({"path_in_repo": "README.md", "bytes": len(card.encode("utf-8")), "from": "model card"})
    return {
        "create_repo": {"repo_id": f"{org}/{job.name}", "repo_type": "model", "private": private, "exist_ok": True},
        "commit": {"repo_id": f"{org}/{job.name}", "operations": ops,
                   "commit_message": f"convert-bnb {__version__}: {job.src} --to {job.to}"},
    }


def _push(job: Job, final: Path, state: dict[str, Any], state_path: Path, spec: dict[str, Any],
          commit: str | None, quantization: list[str]) -> str:
    org = spec["push_to_hub"]
    target = f"{org}/{job.name}"
    pushed = state.get("pushed")
    if isinstance(pushed, dict) and pushed.get("repo") == target and pushed.get("key") == state.get("key"):
        return target
    from huggingface_hub import CommitOperationAdd, HfApi

    files = state.get("files", {})
    card = model_card(job, commit, files, quantization)
    plan = build_upload_plan(org, job, final, files, card, bool(spec.get("private")))
    ops = [CommitOperationAdd(path_in_repo=o["path_in_repo"], path_or_fileobj=o["from"])
           for o in plan["commit"]["operations"] if o["from"] != "model card"]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    api = HfApi()
    try:
        api.create_repo(**plan["create_repo"])
        info = api.create_commit(target, ops, commit_message=plan["commit"]["commit_message"])
    except Exception as exc:
        if type(exc).__module__.startswith("huggingface_hub"):
            from formats.errors import HubError

            raise HubError(f"cannot push to '{target}' ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                           action="push", hint="check HF_TOKEN has write access to the organisation") from None
        raise
    state["pushed"] = {"repo": target, "key": state.get("key"), "commit": getattr(info, "oid", None)}
    _save_state(state_path, state)
    return target


# ---------------------------------------------------------------- the batch (parent process)

_WORKER = "import sys; from convert.batch import worker_main; sys.exit(worker_main(sys.argv[1:]))"


def _worker_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _die_with_parent(parent: int) -> None:
    """Ask Linux to send this worker SIGTERM when the batch process dies (``PR_SET_PDEATHSIG``), so a
    killed batch never leaves a worker writing on; exit at once when the parent is already gone."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the output claim still guards
        return
    if os.getppid() != parent:
        os._exit(130)


def worker_main(argv: list[str]) -> int:
    """Entry point of a worker process: ``SPEC.json``. Prints the result as one JSON line on stdout.

    Exit codes: 0 done, 2 the job failed on its input (error in the state file), 1 internal error,
    130 interrupted (SIGTERM, or the batch process died).
    """
    import signal

    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    signal.signal(signal.SIGTERM, _worker_sigterm)
    _die_with_parent(int(spec["parent_pid"]))
    try:
        result = run_job(spec)
    except ConvertBnbError as exc:
        print(json.dumps({"status": "failed", "error": str(exc), "error_class": type(exc).__name__,
                          "rule": exc.rule}))
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - reported as this job's failure; the batch goes on
        import traceback

        traceback.print_exc()
        print(json.dumps({"status": "failed", "error": f"internal error: {type(exc).__name__}: {exc}",
                          "error_class": type(exc).__name__}))
        return 1
    print(json.dumps(result.to_dict()))
    return 0


def run_batch(
    jobs: list[Job],
    out_dir: Path,
    *,
    n_jobs: int = 1,
    max_memory: int = 1 << 30,
    threads: int | None = None,
    verify: bool = True,
    overwrite: bool = False,
    push_to_hub: str | None = None,
    private: bool = False,
    on_done: Callable[[JobResult], None] | None = None,
) -> list[JobResult]:
    """Run every job in worker processes, ``n_jobs`` at a time, within one memory budget.

    Args:
        jobs: from :func:`parse_jobs`.
        out_dir: where outputs, state files and logs go.
        n_jobs: worker processes at a time.
        max_memory: the memory budget of the whole batch in bytes; each worker gets ``max_memory // n_jobs``.
        threads: threads of the whole batch (default: all cores), split between the workers.
        verify: re-read each written shard before renaming it into place.
        overwrite: redo jobs whose output was made with other settings (never removing files the
            batch did not write).
        push_to_hub: an organisation (or user) to push each output to, or None.
        private: create pushed repos as private.
        on_done: called with each job's result as it finishes.

    Returns:
        one :class:`JobResult` per job, in job order.

    Raises:
        UsageError: ``max_memory // n_jobs`` is below the pipeline's 64 MiB minimum, ``n_jobs`` < 1, or
            another batch is running with the same ``out_dir``.
    """
    if n_jobs < 1:
        raise UsageError("--jobs must be at least 1", found=n_jobs)
    per_memory = max_memory // n_jobs
    if per_memory < 64 * 1024 * 1024:
        raise UsageError("--max-memory split over --jobs leaves a worker less than 64MiB",
                         expected=">= 64MiB per job", found=f"{per_memory} bytes per job",
                         hint="raise --max-memory or lower --jobs")
    per_threads = max(1, (threads or os.cpu_count() or 1) // n_jobs)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputKindError("--out-dir must be a directory", path=out_dir, action="write",
                              expected="a directory", found="a file")
    resolved = out_dir.resolve()
    for job in jobs:
        local = Path(job.src)
        if local.exists() and (resolved == local.resolve() or local.resolve() in resolved.parents):
            raise OutputInsideInputError("--out-dir must not be a job's input or inside it", path=out_dir,
                                         action="write", hint=f"job {job.where} reads '{job.src}'")
    work = out_dir / STATE_DIR
    work.mkdir(parents=True, exist_ok=True)
    lock = _lock_out_dir(work)
    try:
        spec = {"out_dir": str(out_dir), "max_memory": per_memory, "threads": per_threads, "verify": verify,
                "overwrite": overwrite, "push_to_hub": push_to_hub, "private": private, "parent_pid": os.getpid()}
        return _run_jobs(jobs, out_dir, work, n_jobs, spec, on_done)
    finally:
        if lock is not None:
            lock.close()


def _lock_out_dir(work: Path) -> Any:
    """Hold ``OUT/.convert-bnb/lock`` for the run: two batches never write the same out dir at once.

    Raises:
        UsageError: another batch holds the lock.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        return None
    f = open(work / "lock", "a+")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError("another convert-bnb batch is running with this --out-dir", path=work.parent,
                         action="write", hint="wait for it to finish, or use another --out-dir") from None
    return f


def _run_jobs(jobs: list[Job], out_dir: Path, work: Path, n_jobs: int, settings: dict[str, Any],
              on_done: Callable[[JobResult], None] | None) -> list[JobResult]:
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed

    procs: set[subprocess.Popen[bytes]] = set()
    lock = threading.Lock()

    def one(job: Job) -> JobResult:
        spec = {"job": asdict(job), **settings}
        spec_path = work / f"{job.name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
        with open(work / f"{job.name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(spec_path)], stdout=subprocess.PIPE,
                                    stderr=log, env=_worker_env())
            with lock:
                procs.add(proc)
            try:
                stdout, _ = proc.communicate()
            finally:
                with lock:
                    procs.discard(proc)
        line = stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        try:
            data = json.loads(line[0])
        except json.JSONDecodeError:
            data = {"status": "failed",
                    "error": f"worker exited with code {proc.returncode}; see {work / (job.name + '.log')}"}
        if proc.returncode != 0 and data.get("status") != "failed":
            data = {"status": "failed", "error": f"worker exited with code {proc.returncode}"}
        keep = {k: v for k, v in data.items() if k in JobResult.__dataclass_fields__}
        keep.setdefault("name", job.name)
        keep.setdefault("src", job.src)
        keep.setdefault("output", str(out_dir / job.name))
        res = JobResult(**keep)
        if on_done is not None:
            on_done(res)
        return res

    results: dict[str, JobResult] = {}
    pool = ThreadPoolExecutor(max_workers=n_jobs)
    futures: dict[Future[JobResult], Job] = {}
    try:
        futures.update({pool.submit(one, j): j for j in jobs})
        for fut in as_completed(futures):
            results[futures[fut].name] = fut.result()
    except BaseException:
        for f in futures:
            f.cancel()
        with lock:
            for p in procs:
                p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return [results[j.name] for j in jobs]


def _worker_env() -> dict[str, str]:
    """The worker's environment: ours, with this package importable (the worker runs ``-c``)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def plan_batch(jobs: list[Job], out_dir: Path, push_to_hub: str | None, private: bool) -> list[dict[str, Any]]:
    """``--dry-run``: for each job, its source and commit, what a run would do, and the card and upload plan.

    Nothing is downloaded or written: a Hub repo is resolved to its commit (from the cache when
    offline), its files are listed from the snapshot when it is cached, else from a finished output.

    Raises:
        HubError: a repo cannot be resolved.
    """
    out: list[dict[str, Any]] = []
    for job in jobs:
        entry: dict[str, Any] = {"name": job.name, "src": job.src, "revision": job.revision, "to": job.to,
                                 "max_shard_size": job.max_shard_size, "output": str(out_dir / job.name)}
        try:
            source = _resolve_without_download(job)
        except ConvertBnbError as exc:
            entry.update(action="fail", error=str(exc))
            out.append(entry)
            continue
        src = source.path
        commit = source.hub.commit if source.hub is not None else None
        entry["commit"] = commit
        state = _load_state(out_dir / STATE_DIR / f"{job.name}.json")
        final = out_dir / job.name
        options = job_options(job, {"out_dir": str(out_dir), "max_memory": 1 << 30, "threads": 1}, revision=commit)
        key = job_key(options, source)
        files: dict[str, dict[str, Any]] | None = None
        if state.get("key") == key and state.get("status") == "done" and final.exists():
            entry["action"] = "skip (already converted)"
            files = state.get("files")
        else:
            done = len(recorded_shards(final, {**(options.resume_key or {}), "job": key}))
            entry["action"] = "convert" + (f" (resume: {done} shard(s) done)" if done else "")
            files = _planned_files(src, job)
        if push_to_hub:
            quant = _quant_summary(src) if src.exists() else []
            card = model_card(job, commit, files or {}, quant)
            entry["card"] = card
            entry["upload"] = build_upload_plan(push_to_hub, job, final, files, card, private)
        out.append(entry)
    return out


def _resolve_without_download(job: Job) -> Any:
    """The job's source as a :class:`~convert.job.ResolvedSource`; a Hub repo resolved to its commit only."""
    from .hub import resolve_repo
    from .job import ResolvedSource, resolve_source

    if not job.is_repo:
        return resolve_source(job.src, job.revision)
    hub = resolve_repo(job.src, job.revision, download=False, progress=False)
    return ResolvedSource(hub.path, hub)


def _planned_files(src: Path, job: Job) -> dict[str, dict[str, Any]] | None:
    """Output files a conversion would write, with tensor-data bytes (sha256 unknown yet), when SRC is local."""
    if not src.exists():
        return None
    from formats.checkpoint import open_checkpoint

    from .plan import TARGETS, make_plan

    if job.to not in TARGETS:
        return None
    try:
        with open_checkpoint(src) as ckpt:
            plan = make_plan(ckpt, job.to, max_shard_size=job.max_shard_size)
            names = plan.shard_names() if ckpt.is_dir else [job.name]
            files = {n: {"bytes": sum(plan.tensors[i].nbytes for i in s), "sha256": "(after conversion)"}
                     for n, s in zip(names, plan.shards, strict=True)}
            if ckpt.is_dir:
                for extra in ckpt.extra_files:
                    files[extra.name] = {"bytes": extra.stat().st_size, "sha256": "(after conversion)"}
                if len(names) > 1:
                    files["model.safetensors.index.json"] = {"bytes": 0, "sha256": "(after conversion)"}
            return files
    except ConvertBnbError:
        return None


# ---------------------------------------------------------------- CLI


def summary_table(results: list[JobResult]) -> str:
    """The table printed at the end of a batch: one row per job, then the totals."""
    head = ("job", "status", "shards new/kept", "output", "time", "detail")
    rows = []
    for r in results:
        detail = r.error or (f"pushed to {r.pushed}" if r.pushed else "")
        if r.commit and not r.error:
            detail = (f"@{r.commit[:10]} " + detail).strip()
        rows.append((r.name, r.status, f"{r.shards_written}/{r.shards_reused}",
                     format_bytes(r.bytes_out) if r.bytes_out else "-", f"{r.seconds:.1f}s", detail))
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head) - 1)]
    lines = []
    for row in [head, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" of {len(results)} jobs")
    return "\n".join(line.rstrip() for line in lines)


DESCRIPTION = ("Convert many checkpoints (Hub repos or paths) listed in JOBS into --out-dir: parallel worker processes "
               "within one memory budget, resumable per shard, failures isolated, a summary table at the end "
               f"(exit {EXIT_JOBS_FAILED} if any job failed); optional --push-to-hub.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``convert-bnb batch``."""

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = """\
examples:
  convert-bnb batch jobs.txt --out-dir out/ --to bf16 --jobs 2 --max-memory 4GiB
  convert-bnb batch jobs.txt --out-dir out/ --push-to-hub my-org --dry-run   card + upload plan, no work

jobs.txt:
  # one job per line; options override the command line's
  unsloth/llama-3-8b-bnb-4bit
  unsloth/mistral-7b-bnb-4bit@main --to fp16 --max-shard-size 2GB
  ./local-model-bnb-4bit --name local-bf16

Re-running the same command skips finished jobs and finished shards (state in OUT/.convert-bnb/).
"""
    p.add_argument("jobs_file", metavar="JOBS",
                   help="text file (one 'SRC[@REVISION] [--to T] [--max-shard-size S] [--name N]' per line, "
                   "# comments) or a JSON/YAML list")
    p.add_argument("--out-dir", type=Path, required=True, help="where the outputs and the state files go")
    p.add_argument("--jobs", type=int, default=1, help="conversions running at a time (default: 1)")
    p.add_argument("--to", default="auto", choices=_targets(), metavar="TARGET",
                   help="default target of the jobs (default: auto)")
    p.add_argument("--max-memory", type=parse_size, default=parse_size("1GiB"),
                   help="memory budget of the whole batch, split over --jobs (default: 1GiB)")
    p.add_argument("--threads", type=int, default=None, help="threads of the whole batch (default: all cores)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="default largest output shard (default: 5GB)")
    p.add_argument("--push-to-hub", metavar="ORG", default=None,
                   help="create ORG/NAME repos and upload each output with a model card")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create private repos")
    p.add_argument("--dry-run", action="store_true",
                   help="convert nothing: print each job's plan (and with --push-to-hub the card and upload plan)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip re-reading written shards")
    p.add_argument("--overwrite", action="store_true",
                   help="redo jobs whose output was made with other settings (files the batch did not write are "
                   "never removed)")


def run_command(args: argparse.Namespace) -> int:
    """``convert-bnb batch``: run (or ``--dry-run``: plan) the jobs; exit 3 if any failed."""
    jobs = parse_jobs(args.jobs_file, args)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1", found=args.threads)
    out_dir: Path = args.out_dir
    if args.dry_run:
        plan = plan_batch(jobs, out_dir, args.push_to_hub, args.private)
        if args.json:
            print(json.dumps(plan, indent=2))
        else:
            for e in plan:
                print(f"{e['name']}: {e['src']}" + (f"@{e['commit']}" if e.get("commit") else "")
                      + f" --to {e['to']} -> {e['output']}: {e['action']}"
                      + (f" ({e['error']})" if "error" in e else ""))
                if "upload" in e:
                    up = e["upload"]
                    print(f"  upload: create {up['create_repo']['repo_id']} (private={up['create_repo']['private']}, "
                          f"exist_ok), one commit '{up['commit']['commit_message']}':")
                    for op in up["commit"]["operations"]:
                        print(f"    {op['path_in_repo']:<40} {op['bytes']:>14,d} B  <- {op['from']}")
                    print("  model card:")
                    print("    " + e["card"].replace("\n", "\n    ").rstrip())
        return 0
    def progress(r: JobResult) -> None:
        if not args.quiet and not args.json:
            print(f"[{r.status}] {r.name}" + (f": {r.error}" if r.error else ""), file=sys.stderr, flush=True)

    results = run_batch(jobs, out_dir, n_jobs=args.jobs, max_memory=args.max_memory, threads=args.threads,
                        verify=args.verify, overwrite=args.overwrite, push_to_hub=args.push_to_hub,
                        private=args.private, on_done=progress)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    elif not args.quiet:
        print(summary_table(results))
    return EXIT_JOBS_FAILED if any(r.status == "failed" for r in results) else 0

"""The JOBS file of ``convert-bnb batch``: what each job converts, to what, under which name.

Format
    A text file with one job per line: ``SRC[@REVISION] [--to T] [--revision R] [--max-shard-size S]
    [--name NAME] [--mmproj [MMNAME]] [--modelfile [MFNAME]] [--base MODEL] [llama-quantize's options]``
    (``--tensor-type``,
    ``--output-tensor-type``, ``--token-embedding-type``, ``--pure``, ``--leave-output-tensor``, ``--imatrix``,
    ``--include-weights``, ``--exclude-weights``, as on the command line; in an object, the same names with
    ``_``: ``"tensor_type": ["attn_v=q8_0"]``, ``"pure": true``), where SRC is a Hub repo id (``org/name``)
    or a local path (made absolute, so every worker reads the same one, as an ``--imatrix`` file); ``#``
    starts a comment; blank lines are
    skipped. Or a JSON list (``.json``, or text starting with ``[``), or a YAML list
    (``.yaml``/``.yml``, when PyYAML is installed), whose items are such lines or objects ``{"src",
    "revision", "to", "max_shard_size", "name", "mmproj", "modelfile", "base"}`` (``repo`` is accepted for ``src``;
    ``max_shard_size`` is bytes or a size such as ``"2GB"``; ``mmproj`` and ``modelfile`` are ``true`` or a name).
    Options a job leaves out come from the command line (``--to``, ``--max-shard-size``).
    ``NAME`` defaults to the name a single conversion would give its output
    (:func:`convert.output_names.default_output`: the repo's, folder's or file's name with the target's
    suffix, and a file's extension for a single-file source); it is a plain name under the batch's DIR
    and the name of the pushed repo (a job of several targets: the folder of its outputs, each pushed to a
    repo of its own name).
    ``--mmproj`` (GGUF jobs of a multimodal model) also writes the vision projector GGUF, as
    ``convert-bnb SRC --to gguf:T --mmproj DIR/MMNAME`` does; MMNAME defaults to ``mmproj-NAME`` (the
    prefix llama.cpp's converter gives it) and is pushed into the same repo as NAME.
    ``--modelfile`` (GGUF jobs) also writes an Ollama Modelfile beside NAME, as ``convert-bnb --modelfile`` does
    (:mod:`convert.gguf.modelfile`); MFNAME defaults to NAME with ``.Modelfile`` for ``.gguf`` (one per GGUF in
    DIR), and it is pushed with NAME.
    ``--base MODEL`` (a PEFT LoRA adapter as SRC, ``--to gguf[:TYPE]``): the base model whose config.json the
    GGUF LoRA adapter is planned with, as ``convert-bnb ADAPTER --base MODEL`` (a local path made absolute, as SRC;
    default: the adapter config's ``base_model_name_or_path``).

Rules, checked before any job runs (each a :class:`~formats.errors.UsageError` subclass naming the
file and the line ``FILE:LINE`` or item ``FILE[i]``):

- BATCH-001 :class:`~formats.errors.BatchFileError`: the file reads and parses (text, JSON or YAML
  list) and lists at least one job; it is at most 16 MiB and a JSON list stays within
  :mod:`formats.jsonfile`'s limits (nesting, integer digits, no NaN/Infinity, no key twice).
- BATCH-002 :class:`~formats.errors.BatchJobError`: every item is a job line or an object with
  ``src`` (or ``repo``).
- BATCH-003 :class:`~formats.errors.BatchOptionError`: per-job options are known and valid (``--to``
  a known target, a positive shard size, a plain directory name; ``--mmproj`` and ``--modelfile`` only
  with a GGUF target, their names plain file names).
- BATCH-004 :class:`~formats.errors.BatchNameClashError`: no two outputs of the batch (NAME, MMNAME or
  MFNAME) have the same name (give one of them ``--name``, ``--mmproj MMNAME`` or ``--modelfile MFNAME``).
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from convert.batch.state import manifest_path, state_path
from convert.hub.repo import is_repo_id, parse_repo_spec
from convert.options import (
    DEFAULT_MIX,
    ConvertOptions,
    MixOptions,
    Target,
    add_mix_arguments,
    mix_from_args,
    target_for,
    target_names,
)
from convert.output_names import default_output, default_set_output, modelfile_name, with_target_suffix
from convert.units import parse_size
from formats import jsonfile
from formats.errors import BatchFileError, BatchJobError, BatchNameClashError, BatchOptionError, ConvertBnbError

__all__ = ["Job", "job_options", "parse_jobs", "target_names"]

#: llama-quantize's options a job may give (``--tensor-type`` ... on a line; these keys in a JSON/YAML object).
_MIX_FIELDS = ["tensor_type", "output_tensor_type", "token_embedding_type", "pure", "leave_output_tensor", "imatrix",
               "include_weights", "exclude_weights"]
_FIELDS = ["src", "revision", "to", "max_shard_size", "name", "mmproj", *_MIX_FIELDS, "modelfile", "base"]
#: The longest NAME (UTF-8 bytes): 255, the file name limit, less what the longest file beside the output
#: adds (``.NAME.gguf.convert-bnb-old-PID``, ``NAME.mmproj_files.json``).
MAX_NAME_BYTES = 200


@dataclass
class Job:
    """One conversion of a batch.

    Attributes:
        src: a Hub repo id ``org/name`` or a local path.
        revision: branch, tag or commit (Hub only), or None (the default branch).
        to: the ``--to`` target.
        max_shard_size: largest output shard in bytes.
        name: the output name under the batch's out dir (also the pushed repo's name; a job of several
            targets: the folder of its outputs, each pushed to a repo named after it).
        where: ``FILE:LINE`` (or ``FILE[i]``) the job came from, for messages.
        mmproj: the vision projector GGUF's file name under the out dir (``--mmproj``), or None.
        mix: llama-quantize's options for a ``gguf:TYPE`` job of its types (a list of option words, as
            :meth:`~convert.gguf.types.MixOptions.argv` gives, is parsed here).
        modelfile: the Ollama Modelfile's file name beside NAME (``--modelfile``), or None.
        base: a PEFT LoRA adapter job's base model (``--base``: a Hub repo id or an absolute path), or None.
    """

    src: str
    revision: str | None
    to: Target
    max_shard_size: int
    name: str
    where: str = ""
    mmproj: str | None = None
    mix: MixOptions = DEFAULT_MIX
    modelfile: str | None = None
    base: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.to, str):  # a --to string (a worker's spec file, a library caller): parsed here, once
            self.to = target_for(self.to)
        if isinstance(self.mix, list):  # option words (a worker's spec file, the state file)
            self.mix = mix_from_args(_mix_parser().parse_args([w for words in self.mix for w in words]))

    @property
    def is_repo(self) -> bool:
        """Whether SRC is a Hub repo id (not an existing local path)."""

        return is_repo_id(self.src)

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON data (a worker's spec file, the state file; ``Job(**data)`` reads it back):
        ``to`` as its ``--to`` name."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "to": self.to.name, "mix": self.mix.argv()}

    def outputs(self) -> list[tuple[str, str]]:
        """The job's outputs under the out dir, each with the state field that records its files:
        ``(NAME, "files")``, then ``(MMNAME, "mmproj_files")`` with ``--mmproj``, then ``(MFNAME,
        "modelfile_files")`` with ``--modelfile``."""
        return ([(self.name, "files")] + ([(self.mmproj, "mmproj_files")] if self.mmproj else [])
                + ([(self.modelfile, "modelfile_files")] if self.modelfile else []))



def job_options(job: Job, spec: dict[str, Any], *, revision: str | None = None,
                overwrite: bool = False) -> ConvertOptions:
    """The :class:`~convert.options.ConvertOptions` of one job: exactly what ``convert-bnb SRC --to ...
    -o DIR/NAME`` would use, made resumable (``resume_key``) and with a file manifest.

    Args:
        job: the job.
        spec: the batch settings: ``out_dir``, ``max_memory`` and ``threads`` (this worker's share),
            optionally ``verify``.
        revision: the resolved commit to convert (default: the job's revision).
        overwrite: replace an existing output.
    """
    out_dir = Path(spec["out_dir"])
    state = state_path(out_dir, job.name)
    return ConvertOptions(src=job.src, to=job.to, output=out_dir / job.name,
                          revision=revision or job.revision, max_memory=spec["max_memory"], threads=spec["threads"],
                          max_shard_size=job.max_shard_size, verify=spec.get("verify", True), overwrite=overwrite,
                          resume_key={"batch": job.name}, manifest=manifest_path(state),
                          mmproj=out_dir / job.mmproj if job.mmproj else None,
                          mmproj_manifest=manifest_path(state, "mmproj_files") if job.mmproj else None, mix=job.mix,
                          modelfile=job.modelfile,
                          modelfile_manifest=manifest_path(state, "modelfile_files") if job.modelfile else None,
                          base=job.base)


def _job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="job", add_help=False, exit_on_error=False)
    p.add_argument("src")
    p.add_argument("--to")
    p.add_argument("--revision")
    p.add_argument("--max-shard-size", type=parse_size)
    p.add_argument("--name")
    p.add_argument("--mmproj", nargs="?", const=True)
    p.add_argument("--modelfile", nargs="?", const=True)
    p.add_argument("--base")
    add_mix_arguments(p)
    return p


def _mix_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="job", add_help=False, exit_on_error=False)
    add_mix_arguments(p)
    return p


def _job_mix(fields: dict[str, Any], to: Target, bad: Callable[..., BatchOptionError]) -> MixOptions:
    """A job's llama-quantize options, from its line's or object's fields (an ``imatrix`` path made absolute,
    as SRC: every worker reads the same file).

    Raises:
        BatchOptionError: BATCH-003, a value of the wrong kind, an option llama-quantize's types only take
            with another target, or what :func:`~convert.gguf.types.parse_mix_options` refuses.
    """
    words: list[str] = []
    for key in _MIX_FIELDS:
        value = fields.get(key)
        if value is None or value is False or value == []:
            continue
        option = "--" + key.replace("_", "-")
        if key in ("pure", "leave_output_tensor"):
            if value is not True:
                raise bad(f"{key} must be true or false", found=value)
            words.append(option)
            continue
        values = value if isinstance(value, list) and key in ("tensor_type", "include_weights", "exclude_weights") \
            else [value]
        if not all(isinstance(v, str) for v in values) or (isinstance(value, list) and len(values) != len(value)):
            raise bad(f"{key} must be a string" + (" or a list of strings" if key.endswith(("type", "weights"))
                                                   and key != "output_tensor_type" else ""), found=value)
        for v in values:
            words += [option, os.path.abspath(v) if key == "imatrix" and v else v]
    if not words:
        return DEFAULT_MIX
    if not any(t.llama_quantize for t in to.targets):
        raise bad(f"{words[0]} needs a gguf:TYPE of llama-quantize's types", expected="gguf:q4_0 ... gguf:q6_k",
                  found=f"--to {to.name}")
    try:
        return mix_from_args(_mix_parser().parse_args(words))
    except (ConvertBnbError, argparse.ArgumentError) as exc:
        raise bad(str(exc)) from None


def _default_name(src: str, to: Target, revision: str | None) -> str:

    repo = is_repo_id(src)
    if to.family == "multi":  # several targets: the folder they go into (each output inside as alone)
        return default_set_output(None if repo else Path(src), src if repo else None, revision if repo else None).name
    return default_output(Path(src), to, src if repo else None, revision if repo else None).name


def _make_job(fields: dict[str, Any], defaults: argparse.Namespace, where: str, path: Path) -> Job:

    def bad(msg: str, **kw: Any) -> BatchOptionError:
        return BatchOptionError(f"{where}: {msg}", path=path, **kw)

    src = fields.get("src")
    if not isinstance(src, str) or not src.strip():
        raise BatchJobError(f"{where}: a job needs a source (repo id or path)", path=path, found=fields)
    src, rev_in_src = parse_repo_spec(src.strip())
    src = _absolute_if_local(src)
    revision = fields.get("revision") or rev_in_src
    if revision is not None and not isinstance(revision, str):
        raise bad("revision must be a string", found=revision)
    to = fields.get("to") or defaults.to  # a str from the file, or the command line's parsed --to
    if isinstance(to, str):
        try:
            to = target_for(to)  # any letter case, as on the command line
        except ConvertBnbError as exc:  # its own words: an unknown value, a target named twice, an empty one
            raise bad(exc.reason, expected=exc.expected, found=exc.found) from None
    if not isinstance(to, Target):
        raise bad(f"unknown --to value '{to}'", expected=target_names(), found=to)
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
    name = fields.get("name") or _default_name(src, to, revision)
    if not _plain_name(name):
        raise bad("name must be a plain directory name", expected=_PLAIN_NAME, found=name)
    if to.family == "multi" and name.lower().endswith((".gguf", ".safetensors")):
        raise bad("the name of a job of several targets names the folder their outputs go into", found=name,
                  hint="give a folder name (without a file suffix)")
    name = with_target_suffix(name, to)  # --name model -> model.gguf for a GGUF job, as default names
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise bad("unknown job fields", expected=_FIELDS, found=unknown)
    for flag in ("mmproj", "modelfile"):
        if to.family == "multi" and fields.get(flag) not in (None, False):
            raise bad(f"--{flag} needs a job of one GGUF target", expected="--to gguf[:TYPE]", found=f"--to {to.name}",
                      hint="give the GGUF target that needs it a job line of its own")
    base = fields.get("base")
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise bad("base must be a Hub repo id or a path", found=base)
    if base is not None:
        base = _absolute_if_local(base)
    return Job(src, revision, to, int(mss), name, where, _mmproj_name(fields.get("mmproj"), name, to, bad),
               _job_mix(fields, to, bad), _modelfile_name(fields.get("modelfile"), name, to, bad), base)


def _absolute_if_local(spec: str) -> str:
    """A job's SRC or ``--base``: a local path made absolute, so every worker (another process, or a Ray task's
    machine sharing the folder) reads the same one; anything else (a Hub repo id) as it is."""
    return os.path.abspath(spec) if os.path.exists(spec) else spec


def _mmproj_name(value: Any, name: str, to: Target, bad: Callable[..., BatchOptionError]) -> str | None:
    """A job's ``--mmproj``: None (absent or false), ``mmproj-NAME`` (true), or the given plain file name
    (``.gguf`` added as to NAME)."""
    if value is None or value is False:
        return None
    if to.family != "gguf":
        raise bad("--mmproj needs a GGUF target", expected="--to gguf[:TYPE]", found=f"--to {to.name}")
    if value is True:
        return f"mmproj-{name}"
    if not _plain_name(value):
        raise bad("mmproj must be true or a plain file name", expected=_PLAIN_NAME, found=value)
    return with_target_suffix(value, to)


def _modelfile_name(value: Any, name: str, to: Target, bad: Callable[..., BatchOptionError]) -> str | None:
    """A job's ``--modelfile``: None (absent or false), NAME with ``.Modelfile`` for ``.gguf`` (true:
    :func:`convert.output_names.modelfile_name`), or the given plain file name."""
    if value is None or value is False:
        return None
    if to.family != "gguf":
        raise bad("--modelfile needs a GGUF target", expected="--to gguf[:TYPE]", found=f"--to {to.name}")
    if value is True:
        return modelfile_name(name)
    if not _plain_name(value):
        raise bad("modelfile must be true or a plain file name", expected=_PLAIN_NAME, found=value)
    return str(value)


#: What a job's NAME, MMNAME or MFNAME may be.
_PLAIN_NAME = f"a name without '/' or NUL, not starting with '.', of at most {MAX_NAME_BYTES} UTF-8 bytes"


def _plain_name(value: Any) -> bool:
    """Whether ``value`` can name an output under the batch's DIR (with its ``.gguf`` suffix, staging,
    lock and state files beside it: each at most 255 bytes, the file systems' limit)."""
    if not isinstance(value, str) or not value.strip() or "/" in value or "\0" in value or value.startswith("."):
        return False
    try:
        return len(value.encode("utf-8")) <= MAX_NAME_BYTES
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        return False


def _parse_line(text: str, defaults: argparse.Namespace, where: str, path: Path) -> Job | None:

    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as exc:
        raise BatchFileError(f"{where}: {exc}", path=path) from None
    if not tokens:
        return None
    try:
        ns, rest = _job_parser().parse_known_args(tokens)
    except (argparse.ArgumentError, argparse.ArgumentTypeError) as exc:
        raise BatchOptionError(f"{where}: {exc}", path=path) from None
    if rest:
        raise BatchOptionError(f"{where}: unknown job options", path=path,
                               expected="--to, --revision, --max-shard-size, --name, --mmproj, --modelfile, --base, "
                               "llama-quantize's options (--tensor-type ... --imatrix)", found=rest)
    fields = {k: v for k, v in vars(ns).items() if v is not None and v is not False and v != []}
    return _make_job(fields, defaults, where, path)


def _read_list(p: Path, text: str) -> list[Any] | None:
    """The items of a JSON or YAML JOBS file, or None for a text file (one job per line)."""
    items: Any
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise BatchFileError("a YAML JOBS file needs PyYAML, which is not installed", path=p,
                                 hint="write the list as JSON, or one job per line") from None
        try:
            items = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise BatchFileError(f"the JOBS file is not valid YAML ({exc})", path=p) from None
        except RecursionError:  # PyYAML's composer recurses per level
            raise BatchFileError("the JOBS file is nested too deeply", path=p,
                                 expected=f"at most {jsonfile.MAX_DEPTH} levels", found="more") from None
        except ValueError as exc:  # e.g. an integer of 4,300+ digits (int() refuses it)
            raise BatchFileError(f"the JOBS file holds a value YAML cannot convert ({exc})", path=p) from None
    elif p.suffix.lower() == ".json" or text.lstrip().startswith("["):
        items = jsonfile.load_json_bytes(text.encode("utf-8"), jsonfile.JOBS, BatchFileError, "the JOBS file", path=p)
    else:
        return None
    if not isinstance(items, list):
        raise BatchFileError("the JOBS file must hold a list", path=p, found=type(items).__name__)
    return items


def parse_jobs(path: str | os.PathLike[str], defaults: argparse.Namespace) -> list[Job]:
    """Read a JOBS file (text lines, a JSON list or a YAML list).

    Args:
        path: the JOBS file.
        defaults: an object with ``to`` and ``max_shard_size`` (bytes) for jobs that leave them out.

    Returns:
        the jobs, in file order.

    Raises:
        BatchFileError: BATCH-001, the file cannot be read or parsed, or lists no jobs.
        BatchJobError: BATCH-002, an item without a source.
        BatchOptionError: BATCH-003, an unknown or invalid per-job option.
        BatchNameClashError: BATCH-004, two jobs with the same output name.
    """
    p = Path(path)
    limit = jsonfile.JOBS.max_bytes
    try:
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"cannot read the JOBS file ({exc})", path=p) from None
    if len(raw) > limit:
        raise BatchFileError("the JOBS file is larger than the limit", path=p, expected=f"at most {limit} bytes",
                             found=f"more than {limit} bytes")
    items = _read_list(p, text)
    jobs: list[Job] = []
    if items is not None:
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
                raise BatchJobError(f"{where}: a job must be a string or an object", path=p,
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
        for name, _ in job.outputs():
            if name in seen:
                raise BatchNameClashError(f"{job.where}: output name '{name}' is also written by {seen[name]}",
                                          path=p, hint="give one of them --name (or --mmproj MMNAME, --modelfile "
                                          "MFNAME)")
            seen[name] = job.where
    if not jobs:
        raise BatchFileError("the JOBS file lists no jobs", path=p,
                             expected="one job per line, or a non-empty list", found="none")
    return jobs

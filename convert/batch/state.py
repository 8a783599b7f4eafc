"""A batch job's record under ``DIR/.convert-bnb/``, and the checks made against it.

The state file ``DIR/.convert-bnb/NAME.json`` (written atomically: a killed run leaves the old or the
new one) holds::

    {"version": 1, "key": {...}, "job": {...}, "status": "running" | "done" | "failed",
     "files": {"<relative path>": {"bytes": N, "sha256": "..."}},     # once done
     "mmproj_files": {"<MMNAME>": {"bytes": N, "sha256": "..."}},     # once done, with --mmproj
     "modelfile_files": {"<MFNAME>": {"bytes": N, "sha256": "..."}},  # once done, with --modelfile
     "source": {"repo", "revision", "commit"},                        # a Hub source, once done
     "pushed": {"repo", "key", "commit"},                             # once pushed
     "pushed_outputs": {"<output name>": {"repo", "key", "commit"}},  # several targets: each output pushed
     "partial_files": {"<relative path>": {...}},                     # several targets, some failed
     "error": "..." | null}

A job of several targets (``--to bf16,gguf:q8_0``) writes the folder NAME: ``files`` holds every file in it
(a directory output's under its name, a file output by its name), and each output pushed to its own repo is
recorded in ``pushed_outputs`` under its name. When some of its targets fail, the files of the outputs that were
committed are recorded in ``partial_files`` (the batch's own: the next run replaces them) and the job is failed
(its manifest below is written only once every target is committed).

Beside it, ``DIR/.convert-bnb/NAME.files.json`` is the manifest of the job's last conversion, written
by :func:`convert.job.convert` just before it commits the output (``NAME.mmproj_files.json`` that of
its ``--mmproj`` file, committed after it). A worker killed between that commit
and saving the state as done leaves an installed, complete output that the state does not record
yet; the next run recognises it by this manifest (same key, files match) and records it as done
instead of refusing the files as foreign.

``key`` is :func:`convert.run.single.job_key` (source and resolved commit, ``--to``, ``--max-shard-size``,
every other setting that changes the bytes written, converter version). A state file of another
``version``, or one that does not parse, counts as no record.

The checks: :func:`file_manifest_matches` (a done job is skipped only when its output holds every
recorded file with its recorded size and sha256), :func:`check_complete` (a job is marked
done only when the installed output is complete), :func:`foreign_files` (files in an output the
state does not record are the user's: BATCH-006 refuses to redo such an output rather than delete
them), :func:`check_replaceable` (BATCH-006, and BATCH-005: an output made with other settings is not
replaced without ``--overwrite``; the worker runs it before converting, ``--dry-run`` runs the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convert.output import sha256_file, write_json
from formats.errors import ForeignFilesError, JobSettingsChangedError, VerificationError

__all__ = [
    "PARTIAL_FILES",
    "STATE_DIR",
    "STATE_VERSION",
    "check_complete",
    "check_replaceable",
    "file_manifest_matches",
    "foreign_files",
    "installed_manifest",
    "key_text",
    "load_state",
    "manifest_path",
    "save_state",
    "state_path",
]

#: The batch's own folder under DIR: state files, specs, logs and the batch lock.
STATE_DIR = ".convert-bnb"
#: The ``version`` of the state files this module reads and writes.
STATE_VERSION = 1
#: The state field of a job of several targets that failed in part: the files of its committed outputs.
PARTIAL_FILES = "partial_files"


def load_state(path: Path) -> dict[str, Any]:
    """The state file at ``path``, or ``{}`` when there is none (or it is unreadable or of another version)."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else {}


def state_path(out_dir: Path, name: str) -> Path:
    """The state file of job ``name``: ``DIR/.convert-bnb/NAME.json``."""
    return out_dir / STATE_DIR / f"{name}.json"


def manifest_path(state_path: Path, field: str = "files") -> Path:
    """Where the job's conversion writes an output's manifest before its commit, beside the state:
    ``NAME.files.json`` for the output the state's ``files`` records, ``NAME.mmproj_files.json`` for the
    ``--mmproj`` file (``mmproj_files``)."""
    return state_path.with_name(f"{state_path.stem}.{field}.json")


def installed_manifest(state_path: Path, field: str = "files") -> dict[str, dict[str, Any]]:
    """The manifest of the output that the state's ``field`` records, as the job's last conversion wrote it
    before its commit, or ``{}`` (none, or unreadable)."""
    try:
        files = json.loads(manifest_path(state_path, field).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    ok = isinstance(files, dict) and all(isinstance(r, dict) and isinstance(r.get("bytes"), int)
                                          and isinstance(r.get("sha256"), str) for r in files.values())
    return files if ok else {}


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write the state atomically (a killed run leaves the old or the new state, never half of one)."""
    write_json(path, state)


def key_text(key: Any) -> str:
    """A job key in one line for messages: the settings that differ from run to run."""
    if not isinstance(key, dict):
        return "no record"
    parts = [f"{k}={key[k]}" for k in ("commit", "to", "max_shard_size", "mmproj", "modelfile", "converter")
             if key.get(k) is not None]
    if key.get("mix"):
        parts.append("options=" + " ".join(key["mix"]))
    if key.get("imatrix_sha256"):
        parts.append(f"imatrix sha256={str(key['imatrix_sha256'])[:12]}")
    return ", ".join(parts)


def _matches(path: Path, rec: dict[str, Any]) -> bool:
    """Whether a file has the recorded size and sha256 (size first: cheap)."""
    try:
        if not path.is_file() or path.stat().st_size != rec.get("bytes"):
            return False
    except OSError:
        return False
    return sha256_file(path) == rec.get("sha256")


def _present(root: Path) -> set[str]:
    """Relative names of every file of an output (a file: its own name)."""
    if root.is_file():
        return {root.name}
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def file_manifest_matches(root: Path, files: dict[str, dict[str, Any]]) -> bool:
    """Whether ``root`` holds every recorded file with its recorded size and sha256 (files the user added
    beside them are theirs and do not make the output incomplete)."""
    if not files or not set(files) <= _present(root):
        return False
    return all(_matches(root if root.is_file() else root / rel, rec) for rel, rec in files.items())


def check_complete(root: Path, files: dict[str, dict[str, Any]]) -> None:
    """Refuse to call an output done unless it is complete: exactly the recorded files, at their
    recorded sizes, and every shard its index names.

    Args:
        root: the installed output (a directory or a file).
        files: the manifest the conversion returned, ``{relative path: {"bytes", "sha256"}}``.

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


def foreign_files(root: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Files under an existing output that ``files`` (the job's recorded manifest) does not name: the
    user's. A symlink in place of the output is foreign as a whole; no output, no foreign files."""
    if not (root.exists() or root.is_symlink()):
        return []
    if root.is_symlink():
        return [root.name]
    # (a killed run's staging of its own, inside a folder of several outputs: ``.NAME.convert-bnb-partial``)
    return sorted(p for p in _present(root) - set(files) if not (p.startswith(".") and ".convert-bnb-" in p))


def check_replaceable(outputs: list[tuple[Path, str]], state: dict[str, Any], state_file: Path, key: dict[str, Any],
                      overwrite: bool) -> bool:
    """Whether a job that is not skipped may write its outputs, as the worker decides it before converting
    (and ``--dry-run`` the same way, without converting).

    Args:
        outputs: each output path of the job with the state field recording its files (``files``, then
            ``mmproj_files``), as :meth:`convert.batch.jobs.Job.outputs` names them under the out dir.
        state: the job's state (:func:`load_state`; ``{}`` for none).
        state_file: its path (the manifests of the last conversion lie beside it).
        key: the job's key now (:func:`convert.run.single.job_key`).
        overwrite: ``--overwrite`` was given.

    Returns:
        True when the conversion replaces something in place (an output this batch wrote, or an empty
        folder), False when no output exists.

    Raises:
        ForeignFilesError: BATCH-006, an existing output holds files the batch did not write (even with
            ``overwrite``).
        JobSettingsChangedError: BATCH-005, an output this batch wrote exists with another key, and not
            ``overwrite``.
    """
    done_state = state.get("status") == "done"
    replace, kept = False, []
    for path, f in outputs:
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            replace = True  # an empty folder holds nothing to lose or to check
        elif path.exists() or path.is_symlink():
            ours = {**installed_manifest(state_file, f), **((state.get(f) or {}) if done_state else {}),
                    **((state.get(PARTIAL_FILES) or {}) if f == "files" else {})}
            foreign = foreign_files(path, ours)
            if foreign:
                raise ForeignFilesError(
                    "the job's output holds files this batch did not write; redoing the job would remove them",
                    path=path, action="write", found=foreign[:5],
                    hint="move them out of the folder, or give the job another --name" if f == "files"
                    else "move it away, or give the job another --mmproj MMNAME" if f == "mmproj_files"
                    else "move it away, or give the job another --modelfile MFNAME")
            kept.append(path)
    if kept and state.get("key") != key and not overwrite:
        raise JobSettingsChangedError(
            "the job's output was made with other settings", path=kept[0], action="write",
            expected=key_text(key), found=key_text(state.get("key")),
            hint="pass --overwrite to redo it with the new settings, or give the job another --name")
    return replace or bool(kept)

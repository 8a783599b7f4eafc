"""Uploading a finished output and its model card to a Hub repo: one owner for ``--push-to-hub`` of a single
run (:mod:`convert.hub.publish`) and of a batch (:mod:`convert.batch.card`).

:func:`build_upload_plan` says what a push does (a dry run prints it); :func:`upload` does it:

1. ``create_repo`` (``exist_ok``; ``private`` only matters for a new repo);
2. with a target branch (``--push-revision``), ``create_branch`` (``exist_ok``: from the default branch's head
   when new);
3. an output of at most :data:`LARGE_UPLOAD` bytes (``--push-large-size``) goes up in one ``create_commit``:
   the repo gets every file and the card at once. A larger one goes up with ``upload_folder`` from
   ``.NAME.convert-bnb-upload`` beside the output: links to the output's files and the card (the output itself
   is never written into). With ``hf_xet`` (huggingface_hub 1.20 on) that is huggingface_hub's resumable
   upload: the files streamed in several commits, a re-run skipping committed files and deduplicating
   uploaded chunks; before 1.20, or without ``hf_xet``, it is one ``create_commit`` whose re-run does not
   send again the LFS or Xet contents the Hub already has. The folder is kept when the upload fails (the next
   run uploads from it) and removed once the upload is done.

   Not ``upload_large_folder`` (huggingface_hub 0.25 to 1.x): through 1.31 its workers retry a refused commit
   or pre-upload (a read-only token on an existing repo, a storage limit) for ever, logging every try to
   stderr, and SIGTERM does not end the process (the workers go on; huggingface_hub#3325); 1.22 on deprecate
   it for ``upload_folder`` (a ``FutureWarning`` on stderr), 1.32 on give up after 8 errors in a row. It also
   prints its report to stdout (into ``--json``) and commits with its own message.

Any failure (offline, no token, 401/403, the network down, the Hub refusing) is
:class:`~formats.errors.HubUploadError` (HUB-003), one line naming the repo and huggingface_hub's error.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from formats.errors import HubUploadError

__all__ = ["LARGE_UPLOAD", "UPLOAD_MARK", "PushOptions", "build_upload_plan", "local_file", "push_refused",
           "repo_files", "upload", "upload_folder_path"]

#: Outputs larger than this many bytes (files and card) are uploaded with the resumable folder upload, smaller
#: ones in one commit: 5 GB, transformers' default shard size, so a model of one shard goes up in one commit.
LARGE_UPLOAD = 5 * 10**9
#: The folder a large upload is made from, beside the output: ``.NAME`` + this.
UPLOAD_MARK = ".convert-bnb-upload"
#: What the pushed repo's card is uploaded as.
CARD_NAME = "README.md"


@dataclass(frozen=True)
class PushOptions:
    """Where and how an output is pushed (``--push-to-hub`` and its options).

    Attributes:
        repo_id: the target repo, ``org/name``.
        private: create the repo private (an existing repo keeps its visibility).
        revision: the target branch (``--push-revision``; created from the default branch when missing), or
            None for the default branch.
        large_size: outputs of more bytes than this go up with the resumable folder upload, smaller ones in one
            commit (:data:`LARGE_UPLOAD`).
    """

    repo_id: str
    private: bool = False
    revision: str | None = None
    large_size: int = LARGE_UPLOAD


def upload_folder_path(out: Path) -> Path:
    """The folder a large upload of output ``out`` is made from: ``.NAME.convert-bnb-upload`` beside it."""
    return out.with_name(f".{out.name}{UPLOAD_MARK}")


def local_file(out: Path, rel: str) -> Path:
    """Where file ``rel`` of an output's manifest is: inside a directory output, or beside a file output (a
    file output's manifest names it, or the parts of a split GGUF beside it)."""
    if out.is_dir() or (not out.exists() and rel != out.name):
        return out / rel
    return out.parent / rel


def repo_files(files: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The files of an output's manifest that the pushed repo gets: all but a ``README.md`` (the source's card,
    which a directory output keeps): the pushed card takes its place."""
    return {rel: rec for rel, rec in (files or {}).items() if rel != CARD_NAME}


def build_upload_plan(push: PushOptions, outputs: list[tuple[Path, dict[str, dict[str, Any]] | None]], card: str,
                      message: str) -> dict[str, Any]:
    """What a push does: the repo to create, the branch, the method and the files of the upload.

    Args:
        push: the target.
        outputs: each output (the model, then a ``--mmproj`` file) with its manifest ``{path relative to the
            output: {"bytes", "sha256"}}`` (a file output: its own name), or None when not known yet.
        card: the model card, uploaded as ``README.md``.
        message: the commit message.

    Returns:
        ``{"create_repo": {repo_id, repo_type, private, exist_ok}, "branch": name or None, "method": "commit"
        or "large-folder", "bytes": total bytes (None when a size is not known yet), "commit": {repo_id,
        revision, commit_message, operations: [{path_in_repo, bytes, from}]}}``; ``from`` is the local file,
        or ``model card``. An output's own ``README.md`` is left out (:func:`repo_files`).
    """
    ops: list[dict[str, Any]] = []
    for out, files in outputs:
        for rel, rec in sorted(repo_files(files).items()):
            ops.append({"path_in_repo": rel, "bytes": rec["bytes"], "from": str(local_file(out, rel))})
    ops.append({"path_in_repo": CARD_NAME, "bytes": len(card.encode("utf-8")), "from": "model card"})
    sizes = [o["bytes"] for o in ops]
    total = None if None in sizes else sum(sizes)
    return {
        "create_repo": {"repo_id": push.repo_id, "repo_type": "model", "private": push.private, "exist_ok": True},
        "branch": push.revision,
        "method": "large-folder" if total is not None and total > push.large_size else "commit",
        "bytes": total,
        "commit": {"repo_id": push.repo_id, "revision": push.revision, "operations": ops, "commit_message": message},
    }


def upload(plan: dict[str, Any], card: str, folder: Path, *, hint: str, progress: bool = False) -> str | None:
    """Do a push :func:`build_upload_plan` planned.

    Args:
        plan: the plan (its files complete and in place).
        card: the model card (``README.md``).
        folder: the folder a large upload is made from (:func:`upload_folder_path` of the output).
        hint: what the user should do when it fails (the conversion is kept: how to retry).
        progress: show huggingface_hub's progress (bars, a large upload's report).

    Returns:
        the commit the branch points to after the upload (the last one of a large upload), or None when the
        Hub did not say.

    Raises:
        HubUploadError: HUB-003, the upload failed (offline, no or a read-only token, the Hub refusing, the
            network down); ``folder`` is kept for a retry.
    """
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import CommitOperationAdd, HfApi

    if not progress:
        # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    repo_id, branch = plan["create_repo"]["repo_id"], plan["branch"]
    commit = plan["commit"]
    api = HfApi()
    try:
        api.create_repo(**plan["create_repo"])
        if branch is not None:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        if plan["method"] == "commit":
            ops = [CommitOperationAdd(path_in_repo=o["path_in_repo"], path_or_fileobj=o["from"])
                   for o in commit["operations"] if o["from"] != "model card"]
            ops.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode("utf-8")))
            info = api.create_commit(repo_id, ops, commit_message=commit["commit_message"], revision=branch)
            return getattr(info, "oid", None)
        _stage(folder, commit["operations"], card)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=branch,
                                 commit_message=commit["commit_message"])
        oid = getattr(info, "oid", None)
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors, and its HTTP and socket libraries'
        first = (str(exc).strip().splitlines() or [""])[0]
        raise push_refused([(_where(repo_id, branch), f"{type(exc).__name__}: {first}")], hint) from None
    shutil.rmtree(folder, ignore_errors=True)
    return oid


def _where(repo_id: str, branch: str | None) -> str:
    """A push target as HUB-003 names it: ``'org/name'``, with `` branch 'b'`` when one was asked for."""
    return f"'{repo_id}'" + (f" branch '{branch}'" if branch is not None else "")


def push_refused(refused: list[tuple[str, str]], hint: str) -> HubUploadError:
    """HUB-003 for the pushes that failed: ``(where, cause)`` each, ``where`` the repo (and branch) as
    :func:`_where` names it, ``cause`` huggingface_hub's error (``Type: first line``). Targets that failed for one
    and the same cause share it (``cannot push to 'a', 'b' (cause)``), else each has its own."""
    causes = {cause for _, cause in refused}
    if len(causes) == 1:
        reason = f"cannot push to {', '.join(w for w, _ in refused)} ({causes.pop()})"
    else:
        reason = "; ".join(f"cannot push to {w} ({cause})" for w, cause in refused)
    return HubUploadError(reason, action="push", hint=hint, refused=refused)


def _stage(folder: Path, operations: list[dict[str, Any]], card: str) -> None:
    """Make ``folder`` hold what the repo gets and nothing else: a symlink to each output file under its path in
    the repo, and the card. Links an earlier try left there are kept when they still fit; links that point
    elsewhere and anything else (files the upload no longer has, an older version's ``.cache/``) are
    removed."""
    folder.mkdir(exist_ok=True)
    want = {o["path_in_repo"]: Path(o["from"]).resolve() for o in operations if o["from"] != "model card"}
    for p in sorted(folder.rglob("*"), reverse=True):  # deepest first: a folder emptied is removed after its files
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink() or p.is_file():
            if rel not in want or not p.is_symlink() or Path(os.readlink(p)) != want[rel]:
                p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    for rel, target in want.items():
        link = folder / rel
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)
    (folder / CARD_NAME).write_text(card, encoding="utf-8")

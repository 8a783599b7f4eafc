"""The one output protocol every target uses: pre-flight, claim, staging, commit, recovery (the output's
name and path: :mod:`convert.output_names`).

A conversion's output (a ``.safetensors`` file, a model directory, or a ``.gguf`` file) appears at
its final path only complete, and an existing output is replaced only when asked. The steps, in
:class:`OutputClaim`:

1. Pre-flight: the output is of the right kind (a model directory gives a directory, USE-003), is
   not the input or inside it (USE-002), does not exist unless ``overwrite`` (OUT-001), and the disk
   has room for the planned bytes of the output's files plus :data:`DISK_HEADROOM` (OUT-002).
2. Claim: ``.<name>.convert-bnb-lock`` beside the output, held with ``flock(LOCK_EX | LOCK_NB)`` for
   the whole run. A second run for the same path is refused at once (OUT-004); a run that dies
   (even by SIGKILL) drops its lock with its file descriptors.
3. Recovery, under the claim (so no live run owns what is found): a staging temporary of a dead run
   (``.<name>.convert-bnb-tmp-<pid>``) is removed, or, holding a split output's commit list, its remaining
   parts are renamed into place first; an old output set aside by an ``--overwrite``
   commit that died (``.<name>.convert-bnb-old-<pid>``) is put back when the final path is empty
   (roll back) or removed when the new output is in place (roll forward).
4. Staging: the target writes under ``.<name>.convert-bnb-tmp-<pid>`` beside the output, or under
   ``.<name>.convert-bnb-partial`` for a resumable run (batch jobs): that one is kept when the run
   fails, with a record of the finished shards (:class:`ShardLedger`), so the next run writes only
   the rest.
5. Commit: a file is installed with one ``os.replace`` (atomic, over an old file too). The files of a
   split output (``parts``: a split GGUF's ``OUT-0000i-of-0000N.gguf``, staged together in one temporary
   directory) are installed one ``os.replace`` each, after a list of them (``.convert-bnb-commit``) is
   written into the staging directory and fsynced: a run killed between the renames leaves that list,
   and step 3 of the next run renames the rest into place (roll forward), so the parts appear all
   together or not at all. A directory
   with no output in place is one rename; over an existing directory the old one is first renamed
   aside, then the new one renamed in, then the old one removed - a kill between the two renames
   leaves the old output aside, which step 3 of the next run restores. The parent directory is
   fsynced after the renames. SIGINT/SIGTERM/SIGHUP arriving during the renames is held until they
   are done (:func:`convert.signals.deferred`), so an interrupted commit is reported as such: the new
   output in place (:class:`InterruptedAfterCommit`), and an old one set aside left to step 3.
   A ``--push-to-hub`` record of the output replaced (``.<name>.convert-bnb-push.json``: it describes the old
   files) is removed with the renames; a run that pushes writes its own once the commit is done.

On any error or interruption the temporary is removed (a resumable staging directory is kept) and
the claim released; the input is never opened for writing.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from convert import signals
from formats.checkpoint import path_kind
from formats.errors import (
    ConvertBnbError,
    DiskSpaceError,
    OutputBusyError,
    OutputExistsError,
    OutputInsideInputError,
    OutputKindError,
    OverwriteRefusedError,
)

__all__ = [
    "DISK_HEADROOM",
    "TMP_MARK",
    "InterruptedAfterCommit",
    "OUTPUT_REFUSALS",
    "OutputClaim",
    "RECORD_MARK",
    "ShardLedger",
    "file_manifest",
    "write_json",
    "write_synced",
    "recorded_shards",
    "remove_path",
    "sha256_file",
    "user_path",
]

#: Marks of the hidden names beside an output ``NAME``: ``.NAME<mark>...``.
TMP_MARK = ".convert-bnb-tmp-"
OLD_MARK = ".convert-bnb-old-"
LOCK_MARK = ".convert-bnb-lock"
PARTIAL_MARK = ".convert-bnb-partial"
#: The record of a ``--push-to-hub`` run's output (:mod:`convert.hub.publish`), ``.NAME`` + this beside it: it
#: describes that output, so a commit of another output at the same path removes it.
RECORD_MARK = ".convert-bnb-push.json"
#: Free space required beyond the planned bytes of the output's files (which count their headers, index,
#: config and copied files): the file system's rounding up of each file's last block (4 KiB blocks: 256
#: files), the claim's lock and the resume ledger.
DISK_HEADROOM = 1024 * 1024
#: The record of finished shards inside a resumable staging directory.
LEDGER_NAME = ".convert-bnb-shards.json"
#: Inside a split output's staging directory: the names of its parts, written once they are complete and
#: verified, before the first is renamed into place (the next run completes a commit that died midway).
COMMIT_LIST = ".convert-bnb-commit"


def _hidden(final: Path, mark: str, tail: str = "") -> Path:
    return final.with_name(f".{final.name}{mark}{tail}")


def user_path(path: Path) -> Path:
    """The output a hidden staging or set-aside name stands for (``.OUT.convert-bnb-tmp-PID`` -> ``OUT``),
    for messages; other paths unchanged."""
    name = path.name
    for mark in (TMP_MARK, OLD_MARK, PARTIAL_MARK, LOCK_MARK):
        if name.startswith(".") and mark in name:
            return path.with_name(name[1 : name.index(mark)])
    return path


# ---------------------------------------------------------------------------------------- files

def remove_path(p: Path) -> None:
    """Remove a file, link or directory tree; a missing path is fine."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically: a kill leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def file_manifest(root: Path, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of every file under ``root`` (a file: its own name).

    Args:
        root: an output directory or file.
        known: entries already hashed, reused when the size still matches.
    """
    known = known or {}
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        rel = f.name if root.is_file() else f.relative_to(root).as_posix()
        size = f.stat().st_size
        rec = known.get(rel)
        sha = rec["sha256"] if rec and rec.get("bytes") == size else sha256_file(f)
        out[rel] = {"bytes": size, "sha256": sha}
    return out


def write_synced(path: Path, text: str) -> None:
    """Create ``path`` holding ``text``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _install_parts(staging: Path, parent: Path) -> None:
    """Rename the parts a split output's commit list names from ``staging`` into ``parent`` (those still in
    ``staging``: a commit that died midway has moved the others), then fsync ``parent``."""
    for name in (staging / COMMIT_LIST).read_text().split():
        if (staging / name).is_file():
            os.replace(staging / name, parent / name)
    _fsync_dir(parent)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- resume

@dataclass
class ShardLedger:
    """Finished shards of a resumable staging directory, kept in ``LEDGER_NAME`` inside it.

    A shard is reused only when the ledger's ``key`` (the job's settings) equals the run's and the
    file still has the recorded size and sha256.

    Attributes:
        directory: the staging directory.
        key: what must be equal for finished shards to be reused.
        shards: ``{file name: {"bytes", "sha256"}}``.
    """

    directory: Path
    key: dict[str, Any]
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def open(cls, directory: Path, key: dict[str, Any]) -> ShardLedger:
        """The ledger of ``directory`` for ``key``; empty (and the directory emptied) when the key differs."""
        try:
            data = json.loads((directory / LEDGER_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("shards"), dict):
            return cls(directory, key, dict(data["shards"]))
        for p in list(directory.iterdir()) if directory.is_dir() else []:
            remove_path(p)
        return cls(directory, key)

    def reusable(self, name: str) -> bool:
        """Whether shard ``name`` is finished: recorded, with its recorded size and sha256. A file that is
        not (unrecorded, cut short, damaged) is removed, to be written again."""
        rec = self.shards.get(name)
        path = self.directory / name
        ok = (rec is not None and path.is_file() and path.stat().st_size == rec.get("bytes")
              and sha256_file(path) == rec.get("sha256"))
        if not ok:
            self.shards.pop(name, None)
            remove_path(path)
        return ok

    def record(self, name: str) -> None:
        """Record shard ``name`` as finished (written atomically: a kill leaves the old or the new ledger)."""
        path = self.directory / name
        self.shards[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        write_json(self.directory / LEDGER_NAME, {"key": self.key, "shards": self.shards})

    def keep_only(self, names: list[str]) -> None:
        """Remove files the plan does not name (shards of an earlier plan, leftovers)."""
        wanted = set(names)
        for p in list(self.directory.iterdir()):
            if p.name not in wanted and p.name != LEDGER_NAME:
                remove_path(p)
        for stale in set(self.shards) - set(names):
            del self.shards[stale]


def recorded_shards(final: Path, key: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The shards a resumable run of ``final`` with ``key`` has finished (read only; for plans)."""
    try:
        data = json.loads((_hidden(final, PARTIAL_MARK) / LEDGER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("shards"), dict):
        return dict(data["shards"])
    return {}


# ---------------------------------------------------------------------------------------- the claim

class InterruptedAfterCommit(KeyboardInterrupt):
    """SIGINT/SIGTERM arrived after the output was renamed into place: the output is complete.

    Attributes:
        path: the output (its final name).
        done: in a run of several targets, every output committed before the interrupt (``path`` first).
        targets: the run's targets (1: a single run); those not in ``done`` were not written.
    """

    def __init__(self, path: Path, done: tuple[Path, ...] = (), targets: int = 1) -> None:
        super().__init__(f"interrupted after {path} was complete")
        self.path = path
        self.done = done or (path,)
        self.targets = targets

    def message(self) -> str:
        """What the command line says: the output complete, or which of a set's outputs are and that the others
        were not written."""
        if self.targets <= 1:
            return f"interrupted after the output was complete: {self.path}"
        left = self.targets - len(self.done)
        rest = {0: "", 1: "; the other was not written"}.get(left, f"; the other {left} were not written")
        if left:  # (a rerun of the same targets meets the complete ones: OUT-001)
            rest += f" (convert {'it' if left == 1 else 'them'} alone, or all again with --overwrite)"
        return (f"interrupted after {len(self.done)} of {self.targets} outputs were complete: "
                + ", ".join(str(p) for p in self.done) + rest)


#: What refuses an output before it is written (:class:`OutputClaim`'s checks, and an existing ``--mmproj`` or
#: ``--modelfile`` file, found while the target is planned): one of them refuses every target of a run of several
#: (:class:`convert.run.several._OutputGate`).
OUTPUT_REFUSALS: tuple[type[ConvertBnbError], ...] = (
    OutputExistsError, OutputBusyError, OutputKindError, OutputInsideInputError, OverwriteRefusedError,
    DiskSpaceError)


class OutputClaim:
    """Owns one output path for a run: pre-flight, exclusive claim, recovery, staging and commit.

    Use as a context manager; write into :attr:`staging`, then call :meth:`commit`. Leaving the
    block without a commit (an error, an interrupt) removes the staging temporary (a resumable
    one is kept) and releases the claim.

    Args:
        final: the output path.
        is_dir: whether the output is a directory.
        nbytes: the planned bytes of the output's files (:attr:`convert.targets.TargetJob.disk_nbytes`), for
            the disk pre-flight.
        inputs: the input paths (the output must not be one of them or inside one).
        overwrite: replace an existing output.
        resume_key: make the staging resumable (``.NAME.convert-bnb-partial`` with a
            :class:`ShardLedger` for this key), or None.
        file_suffix: the suffix a file output of this kind has (a directory must not be named so).
        parts: the files of an output written as several files beside each other (a split GGUF's parts, in
            order; ``final`` is the first), or None. They are staged in one temporary directory under their
            own names (``staging / part.name``; never resumable), checked (OUT-001) and installed together.
        others: files of the same output in another layout beside ``final`` (a GGUF split into another number of
            parts, or not split): they count as the output existing (OUT-001 without ``overwrite``) and the commit
            removes them once the new output is in place.
        on_checked: called once the claim is held and every pre-flight check has passed, before the staging
            is made, or None. What it raises undoes the claim as any error does (a run of several targets
            waits there until every target's output is checked: :func:`convert.run.several.convert_set`).

    Raises (on enter):
        OutputKindError: USE-003; OutputInsideInputError: USE-002; OutputBusyError: OUT-004;
        OutputExistsError: OUT-001; DiskSpaceError: OUT-002.
    """

    def __init__(self, final: Path, *, is_dir: bool, nbytes: int, inputs: list[Path], overwrite: bool = False,
                 resume_key: dict[str, Any] | None = None, file_suffix: str = ".safetensors",
                 parts: list[Path] | None = None, on_checked: Callable[[], None] | None = None,
                 others: list[Path] | None = None) -> None:
        self.final = Path(final)
        self.parts = [Path(p) for p in parts] if parts else None
        self.others = [Path(p) for p in others or ()]
        assert self.parts is None or (self.parts[0] == self.final and not is_dir
                                      and all(p.parent == self.final.parent for p in self.parts))
        self.is_dir = is_dir
        self.nbytes = nbytes
        self.inputs = inputs
        self.overwrite = overwrite
        self.resume_key = resume_key
        self.file_suffix = file_suffix
        self.on_checked = on_checked
        self.recovered: list[str] = []
        self.ledger: ShardLedger | None = None
        self.staging = (_hidden(self.final, PARTIAL_MARK) if resume_key is not None and not self.parts
                        else _hidden(self.final, TMP_MARK, str(os.getpid())))
        self._lock_fd: int | None = None
        self._committed = False

    # -- enter / exit
    def __enter__(self) -> OutputClaim:
        self._check_kind()
        self._check_not_input()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        try:
            with signals.deferred():  # a signal waits until the claim is whole, then undoes it below
                self._claim()
        except BaseException:
            with signals.deferred(drop=True):
                if self.resume_key is None or not self.is_dir:
                    remove_path(self.staging)
                self._release()
            raise
        return self

    def _claim(self) -> None:
        """:meth:`__enter__`'s steps 2-4 (the lock, recovery, pre-flight, staging)."""
        self._acquire()
        self.recovered = self._recover()
        existing = [p for p in [*(self.parts or [self.final]), *self.others] if p.exists() or p.is_symlink()]
        if existing and not self.overwrite:
            raise OutputExistsError("output exists", path=existing[0], action="write",
                                    hint="pass --overwrite to replace it, or choose -o")
        if self.final.is_dir() and not self.final.is_symlink():
            self._check_replaceable()
        self._check_disk()
        if self.on_checked is not None:
            self.on_checked()
        if self.resume_key is not None and self.is_dir:
            self.staging.mkdir(exist_ok=True)
            self.ledger = ShardLedger.open(self.staging, self.resume_key)
        else:
            remove_path(self.staging)
            if self.is_dir or self.parts:
                self.staging.mkdir()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with signals.deferred(drop=exc is not None):  # a signal while the claim is released waits
            try:
                if not self._committed and not (self.resume_key is not None and self.is_dir):
                    remove_path(self.staging)
            finally:
                self._release()
        if self._committed and isinstance(exc, KeyboardInterrupt) and not isinstance(exc, InterruptedAfterCommit):
            raise InterruptedAfterCommit(self.final) from exc

    # -- pre-flight
    def _check_kind(self) -> None:
        out, suffix = self.final, self.file_suffix
        # a device, FIFO or socket is never written over (a rename would put a file in place of /dev/null);
        # a symlink is replaced as a link, never what it points to (commit)
        for p in self.parts or [out]:
            kind = path_kind(p, follow_symlinks=False)
            if kind not in ("missing", "file", "directory", "a symlink") and not kind.startswith("unreadable"):
                raise OutputKindError("-o names something that is neither a file nor a directory, which "
                                      "convert-bnb never writes over, even with --overwrite", path=p, action="write",
                                      expected="a file or a directory", found=kind,
                                      hint="choose another path with -o")
        parent = next((p for p in out.parents if path_kind(p, follow_symlinks=False) != "missing"), None)
        parent_kind = "directory" if parent is None else path_kind(parent)
        if parent_kind != "directory" and not parent_kind.startswith("unreadable"):
            raise OutputKindError("a parent of -o is not a directory", path=parent, action="write",
                                  expected="a directory", found={"file": "a file", "missing": "a symlink to nothing"}
                                  .get(parent_kind, parent_kind), hint="choose another path with -o")
        if self.is_dir and out.suffix.lower() == suffix:
            raise OutputKindError(
                f"a model directory converts to a directory, but -o names a '{suffix}' file", path=out,
                action="write", hint=f"give -o a directory name (without '{suffix}'), or convert one weight file "
                "instead")
        if not self.is_dir and out.is_dir() and suffix == ".gguf":
            raise OutputKindError("GGUF output is one file, and -o names a directory", path=out, action="write",
                                  expected="a file", found="a directory", hint="give a file name such as model.gguf")
        for p in self.parts or [out]:
            if p.exists() and p.is_dir() != self.is_dir:
                want, have = ("a directory", "a file") if self.is_dir else ("a file", "a directory")
                raise OutputKindError(
                    "the output exists and is of the other kind; --overwrite never replaces one with the other",
                    path=p, action="write", expected=want, found=have)

    def _check_replaceable(self) -> None:
        """``--overwrite`` replaces a directory only when it is a model output: no subdirectories, some
        ``.safetensors`` or ``config.json`` in it (or nothing at all), and not the working directory or
        one of its parents."""
        out = Path(os.path.realpath(self.final))
        cwd = Path.cwd().resolve()
        if out == cwd or out in cwd.parents:
            raise OverwriteRefusedError("--overwrite would replace the working directory or one of its parents",
                                        path=self.final, action="write", found=str(cwd))
        entries = list(self.final.iterdir())
        subdirs = sorted(p.name for p in entries if p.is_dir())
        model = [p.name for p in entries if p.name == "config.json" or p.suffix == ".safetensors"]
        if subdirs or (entries and not model):
            raise OverwriteRefusedError(
                "--overwrite replaces a model output, and this directory holds other things", path=self.final,
                action="write", expected="a model directory (shards, config.json, tokenizer files)",
                found=f"subdirectories {subdirs[:3]}" if subdirs else f"no model files ({len(entries)} entries)")

    def _check_not_input(self) -> None:
        # realpath, not Path.resolve: a symlink loop (at -o or SRC) stays as it is instead of RuntimeError
        out = Path(os.path.realpath(self.final))
        for src in self.inputs:
            src = Path(os.path.realpath(src))
            if out == src or src in out.parents:
                raise OutputInsideInputError("output must not be the input or inside it", path=self.final,
                                             action="write", hint="choose an output path outside the input with -o")

    def _check_disk(self) -> None:
        need = self.nbytes + DISK_HEADROOM
        free = int(shutil.disk_usage(self.final.parent).free)
        if free < need:
            raise DiskSpaceError(
                "not enough free disk space for the output", path=self.final.parent, action="write",
                expected=f">= {need} bytes free", found=f"{free} bytes free",
                hint="free some space or write elsewhere with -o")

    # -- claim
    def _acquire(self) -> None:
        """Hold ``.NAME.convert-bnb-lock``; retried when another run removed the file between our open and
        our lock (the lock must be on the file that is at the path)."""
        path = _hidden(self.final, LOCK_MARK)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise OutputBusyError(
                    "another convert-bnb run is writing this output", path=self.final, action="write",
                    hint=f"wait for it to finish (its pid is in '{path.name}'), or choose another path with -o",
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    os.ftruncate(fd, 0)
                    os.write(fd, str(os.getpid()).encode())
                except OSError:  # (a full disk): no lock file is left behind, empty or not
                    os.unlink(path)
                    os.close(fd)
                    raise
                self._lock_fd = fd
                return
            os.close(fd)

    def _release(self) -> None:
        if self._lock_fd is None:
            return
        try:
            os.unlink(_hidden(self.final, LOCK_MARK))  # unlinked while held: a waiting run re-opens a new file
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def _recover(self) -> list[str]:
        """Finish or undo what dead runs left beside the output (we hold the claim: none of it is live).

        Returns:
            one line per thing done, for the summary.
        """
        done: list[str] = []
        parent = self.final.parent
        name = self.final.name
        for p in sorted(parent.iterdir()):
            if p.name.startswith(f".{name}{OLD_MARK}"):
                if self.final.exists() or self.final.is_symlink():
                    remove_path(p)
                    done.append(f"removed an old output set aside by an interrupted --overwrite: {p}")
                else:
                    os.rename(p, self.final)
                    _fsync_dir(parent)
                    done.append(f"restored the output that an interrupted --overwrite had set aside: {self.final}")
        for p in sorted(parent.iterdir()):
            if p.name.startswith(f".{name}{TMP_MARK}"):
                if (p / COMMIT_LIST).is_file():
                    _install_parts(p, parent)
                    done.append(f"completed the commit of a split output an interrupted run had begun: {self.final}")
                remove_path(p)
                done.append(f"removed a stale temporary left by an interrupted run: {p}")
        return done

    def manifest(self) -> dict[str, dict[str, Any]]:
        """``{relative path: {"bytes", "sha256"}}`` of the staged output, named as it will be installed
        (shards already hashed by the ledger are not read again)."""
        if self.parts:
            return {p.name: file_manifest(self.staging / p.name)[p.name] for p in self.parts}
        if not self.is_dir:
            return {self.final.name: file_manifest(self.staging)[self.staging.name]}
        files = file_manifest(self.staging, self.ledger.shards if self.ledger is not None else None)
        files.pop(LEDGER_NAME, None)
        return files

    # -- commit
    def commit(self) -> None:
        """Install the staged output at the final path (see the module docstring, step 5)."""
        if self.ledger is not None:
            remove_path(self.staging / LEDGER_NAME)
        parent = self.final.parent
        old: Path | None = None
        with signals.deferred():  # the renames are not cut by a signal: it is raised once they are done
            if self.final.is_symlink() and self.is_dir:  # the link itself is replaced, never what it points to
                self.final.unlink()
            if self.parts:
                write_synced(self.staging / COMMIT_LIST, "".join(f"{p.name}\n" for p in self.parts))
                _fsync_dir(self.staging)
                _install_parts(self.staging, parent)
            elif self.final.exists() and self.is_dir:
                old = _hidden(self.final, OLD_MARK, str(os.getpid()))
                os.rename(self.final, old)
                os.rename(self.staging, self.final)
            else:
                os.replace(self.staging, self.final)
            self._committed = True
            for p in self.others:  # (the output in its earlier layout: replaced by this one)
                remove_path(p)
            remove_path(_hidden(self.final, RECORD_MARK))  # (a stale record of the output replaced, if any)
            _fsync_dir(parent)
        if old is not None:
            remove_path(old)  # (if interrupted, the next run's _recover removes the rest)
        if self.parts:
            remove_path(self.staging)  # (the commit list alone)

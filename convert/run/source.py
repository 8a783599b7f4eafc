"""The input of a conversion as a local path (:class:`ResolvedSource`): a local file or directory as it is, or a
Hub repo id fetched into the HF cache or read in place (:func:`resolve_source`, through
:mod:`convert.hub.download` and :mod:`convert.hub.shards`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from convert.hub.download import HubSource, WeightMode, resolve_repo
from convert.hub.repo import is_repo_id, parse_repo_spec
from convert.hub.shards import HubShards
from formats.checkpoint import Checkpoint, open_checkpoint
from formats.errors import SourceNotFoundError, UsageError
from formats.peft import is_adapter_dir

__all__ = ["ResolvedSource", "absolute", "resolve_source", "src_repo_spec"]


def absolute(path: Path) -> str:
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
        return f"{self.hub.repo_id}@{self.hub.commit}" if self.hub is not None else absolute(self.path)

    @property
    def label(self) -> str:
        """What identifies the input for resuming: the absolute path, or the repo id."""
        return self.hub.repo_id if self.hub is not None else absolute(self.path)

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


def src_repo_spec(src: str) -> tuple[str | None, str | None]:
    """SRC as ``(repo, revision)`` when it is no local path (:func:`convert.hub.repo.parse_repo_spec`), else
    ``(None, None)``."""
    return parse_repo_spec(src) if not os.path.lexists(src) else (None, None)


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

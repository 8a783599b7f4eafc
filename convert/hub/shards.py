"""A Hub repo's safetensors weights read in place: headers over HTTP range requests, data on demand.

Two uses, one reader (:class:`HubShard`, a :class:`formats.checkpoint.ContainerReader`):

- **header-only** (``inspect``, ``--dry-run``): the checkpoint is opened from each shard's header,
  read with one or two range requests and checked by :func:`formats.safetensors.read_header` (the
  same ST rules as a local file). The few tensor bytes a plan reads (a QuantState's JSON, a 16-value
  quant_map) are range requests of their own; no shard is downloaded.
- **low-disk** (``--low-disk``): the same, and :class:`ShardLifetime`, plugged into the pipeline as
  its :class:`convert.stream.pipeline.InputLifetime`, downloads a shard into the run's private staging
  folder just before the first output tensor that reads it is made, and deletes it right after the
  last such tensor is written. Tensors are written in the plan's order (input file order), so at most
  the shard being read and the next one (a layer whose parts straddle two shards) are on disk.

Downloads go through ``huggingface_hub.hf_hub_download(local_dir=...)`` (its size and ETag checks),
then the file's size and header must equal what the Hub listed and served before: else
:class:`~formats.errors.HubShardError` (HUB-002), as for a shard that vanished from the Hub.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from convert.hub.repo import is_hub_exception
from convert.stream.plan import Plan, PlannedTensor
from formats.errors import HubShardError, UsageError
from formats.safetensors import Header, SafetensorsReader, TensorInfo, byte_range, read_header

__all__ = ["HubShard", "HubShards", "RemoteFile", "ShardLifetime"]

#: Bytes fetched with a header's first range request (most headers fit; as huggingface_hub does).
_HEADER_PREFETCH = 100_000


class RemoteFile:
    """One safetensors file of a repo at a commit, read by HTTP range requests (the first
    :data:`_HEADER_PREFETCH` bytes are fetched once and kept: the header is read from them).

    Args:
        repo_id: ``org/name``.
        commit: the commit sha.
        name: the file's path in the repo.
        size: its bytes, as the Hub lists them.
    """

    def __init__(self, repo_id: str, commit: str, name: str, size: int) -> None:
        # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
        from huggingface_hub import hf_hub_url

        self.url = hf_hub_url(repo_id, name, revision=commit)
        self.size = size
        self.name = name
        self._head: bytes | None = None
        self._header: Header | None = None

    def header(self) -> Header:
        """The file's header, read once and checked by the ST rules (:func:`formats.safetensors.read_header`).

        Raises:
            SafetensorsError: the header breaks an ST rule; HubShardError: HUB-002, it cannot be read.
        """
        if self._header is None:
            self._header = read_header(self.name, self.read, self.size)
        return self._header

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the file)."""
        stop = min(offset + n, self.size)
        if stop <= offset:
            return b""
        if stop <= _HEADER_PREFETCH:
            if self._head is None:
                self._head = self._get(0, min(_HEADER_PREFETCH, self.size))
            return self._head[offset:stop]
        return self._get(offset, stop)

    def _get(self, start: int, stop: int) -> bytes:
        # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status


        try:
            response = get_session().get(self.url, headers={**build_hf_headers(), "Range": f"bytes={start}-{stop - 1}"})
            hf_raise_for_status(response)
        except Exception as exc:
            if not is_hub_exception(exc):
                raise
            raise HubShardError("cannot read a shard on the Hub", path=self.name, expected=f"bytes {start}-{stop - 1}",
                                found=_failure(exc), hint="the repo or the network changed; run again") from None
        data = bytes(response.content)
        if response.status_code == 200:  # a server that ignores Range sends the whole file
            data = data[start:stop]
        return data


def _failure(exc: BaseException) -> str:
    """What went wrong, for ``found``: the exception's class and the HTTP status (its message names a URL)."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return type(exc).__name__ + (f" (HTTP {status})" if isinstance(status, int) else "")


class HubShard:
    """One safetensors file of a Hub repo: its header read over HTTP, its bytes read over HTTP until
    :meth:`fetch` downloads it, from the local file then, until :meth:`drop` deletes it.

    Attributes:
        path: where the file is (or will be) on disk.
        name: the file's name in the repo.
        file_size: the file's bytes, as the Hub lists them.
        tensors: name -> :class:`~formats.safetensors.TensorInfo` (checked by the ST rules).
        metadata: the ``__metadata__`` object.
    """

    def __init__(self, pool: HubShards, remote: RemoteFile, path: Path) -> None:
        self.pool = pool
        self.name = remote.name
        self.path = path
        self.file_size = remote.size
        self._remote = remote
        header = remote.header()
        self.metadata = header.metadata
        self.tensors: dict[str, TensorInfo] = header.tensors
        self._local: SafetensorsReader | None = None
        self._lock = threading.Lock()

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]:
        """Bytes [start, stop) of a tensor: a view of the downloaded file, else fetched by a range request."""
        local = self._local
        if local is not None:
            return local.raw(name, start, stop)
        info = self.tensors[name]
        stop = byte_range(name, start, stop, info.nbytes)
        if stop == start:
            return np.empty(0, dtype=np.uint8)
        data = self._remote.read(info.start + start, stop - start)
        if len(data) != stop - start:
            raise HubShardError("the Hub served fewer bytes than the header says", path=self.path, tensor=name,
                                expected=f"{stop - start} bytes", found=f"{len(data)} bytes",
                                hint="the repo changed or the download was cut; run again")
        return np.frombuffer(data, dtype=np.uint8)

    def array(self, name: str) -> np.ndarray:
        """A tensor with its dtype and shape (read-only)."""
        local = self._local
        if local is not None:
            return local.array(name)
        info = self.tensors[name]
        return self.raw(name).view(info.dtype.numpy).reshape(info.shape)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop consumed pages of the downloaded file (nothing before it is downloaded)."""
        local = self._local
        if local is not None:
            local.release(name, start, stop)

    @property
    def fetched(self) -> bool:
        """Whether the file is on disk now."""
        return self._local is not None

    def fetch(self) -> None:
        """Download the file into the pool's folder (once) and read from it from now on.

        Raises:
            HubShardError: HUB-002, the file cannot be downloaded, or its size or header differs from
                what the Hub listed and served.
        """
        with self._lock:
            if self._local is None:
                self._local = self.pool.download(self)

    def drop(self) -> None:
        """Unmap and delete the downloaded file (it is read over HTTP again if ever read again)."""
        with self._lock:
            local, self._local = self._local, None
            if local is not None:
                local.close()
                self.pool.delete(self)

    def close(self) -> None:
        """Unmap the downloaded file (the pool's folder is removed by its owner)."""
        with self._lock:
            if self._local is not None:
                self._local.close()


class HubShards:
    """The safetensors files of one repo at one commit, opened from their headers (a
    :data:`formats.checkpoint.RemoteOpener`), downloaded into ``folder`` one at a time when asked.

    Args:
        repo_id: ``org/name``.
        commit: the commit sha.
        folder: where the files are (the cache snapshot: header-only) or go (low-disk staging).
        files: file name -> its :class:`RemoteFile` (whose header may have been read already).

    Attributes:
        events: ``("fetch" | "delete", file name)`` in the order they happened (what a run did, for
            its notes and for tests).
        peak_bytes: the most bytes of downloaded shards on disk at once.
        opened: file name -> its :class:`HubShard`, for each file opened.
    """

    def __init__(self, repo_id: str, commit: str, folder: Path, files: Mapping[str, RemoteFile]) -> None:
        self.repo_id = repo_id
        self.commit = commit
        self.folder = folder
        self.files = dict(files)
        self.events: list[tuple[str, str]] = []
        self.peak_bytes = 0
        self.opened: dict[str, HubShard] = {}
        self._on_disk: dict[str, int] = {}
        self._lock = threading.Lock()

    def open(self, path: Path) -> HubShard | None:
        """The :class:`HubShard` of a weight file the directory names, or None when the repo has no such
        safetensors file (then the file is missing, CKPT-002).

        Raises:
            SafetensorsError: the served header breaks an ST rule.
        """
        remote = self.files.get(path.name)
        if remote is None or path.parent != self.folder:
            return None
        shard = self.opened[path.name] = HubShard(self, remote, path)
        return shard

    def download(self, shard: HubShard) -> SafetensorsReader:
        """Download one file into :attr:`folder` and open it; its size and header must be the ones served.

        Raises:
            HubShardError: HUB-002.
        """
        # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
        from huggingface_hub import hf_hub_download


        try:
            got = Path(hf_hub_download(self.repo_id, shard.name, revision=self.commit, local_dir=self.folder))
        except Exception as exc:
            if not is_hub_exception(exc) and not isinstance(exc, OSError):
                raise
            raise HubShardError("cannot download a shard of the low-disk run", path=shard.name,
                                expected=f"'{shard.name}' of {self.repo_id}@{self.commit}", found=_failure(exc),
                                hint="the repo or the network changed during the run; run again") from None
        size = got.stat().st_size
        if size != shard.file_size:
            raise HubShardError("a downloaded shard's size differs from the Hub's listing", path=got,
                                expected=f"{shard.file_size} bytes", found=f"{size} bytes",
                                hint="the repo changed during the run; run again")
        reader = SafetensorsReader(got)
        if reader.tensors != shard.tensors:
            name = next((n for n in sorted(set(reader.tensors) | set(shard.tensors))
                         if reader.tensors.get(n) != shard.tensors.get(n)), None)
            want, have = shard.tensors.get(name or ""), reader.tensors.get(name or "")
            reader.close()
            raise HubShardError("a downloaded shard's header differs from the one the Hub served", path=got,
                                tensor=name, expected=_entry(want), found=_entry(have),
                                hint="the repo changed during the run; run again")
        with self._lock:
            self.events.append(("fetch", shard.name))
            self._on_disk[shard.name] = size
            self.peak_bytes = max(self.peak_bytes, sum(self._on_disk.values()))
        return reader

    def delete(self, shard: HubShard) -> None:
        """Delete a downloaded file (and huggingface_hub's note of it in the folder)."""
        shard.path.unlink(missing_ok=True)
        (self.folder / ".cache" / "huggingface" / "download" / f"{shard.name}.metadata").unlink(missing_ok=True)
        with self._lock:
            self.events.append(("delete", shard.name))
            self._on_disk.pop(shard.name, None)


class ShardLifetime:
    """The low-disk policy: which downloaded shards each planned tensor reads, fetched by :meth:`need`
    before it is made and deleted by :meth:`done` once no tensor still to be written reads them
    (a :class:`convert.stream.pipeline.InputLifetime`).

    Args:
        plan: the plan the pipeline writes (its sources name the input tensors they read).
        shards: the pool the plan's checkpoint was opened with.

    Raises:
        UsageError: a planned tensor's source cannot name its inputs (e.g. a re-quantized or GGUF
            tensor): such a plan cannot run low-disk.
    """

    def __init__(self, plan: Plan, shards: HubShards) -> None:
        self._files: dict[int, list[HubShard]] = {}
        self._users: dict[str, int] = {}  # shard name -> tensors still to write that read it
        by_path = {os.fspath(s.path): s for s in shards.opened.values()}
        for t in plan.tensors:
            records = t.source.inputs()
            if records is None:
                raise UsageError("--low-disk cannot tell which input files a tensor reads", tensor=t.name,
                                 found=t.source.kind, expected="--to auto|bf16|fp16|fp32",
                                 hint="convert without --low-disk (the whole repo is downloaded first)")
            used = list(dict.fromkeys(by_path[r.file] for r in records if r.file in by_path))
            self._files[id(t)] = used
            for s in used:
                self._users[s.name] = self._users.get(s.name, 0) + 1

    def ready(self, tensor: PlannedTensor) -> bool:
        """Whether every shard ``tensor`` reads is downloaded."""
        return all(shard.fetched for shard in self._files.get(id(tensor), ()))

    def need(self, tensor: PlannedTensor) -> None:
        """Download the shards ``tensor`` reads (the ones not on disk yet)."""
        for shard in self._files.get(id(tensor), ()):
            shard.fetch()

    def done(self, tensor: PlannedTensor) -> None:
        """``tensor`` is written: delete each shard no tensor still to be written reads."""
        for shard in self._files.get(id(tensor), ()):
            self._users[shard.name] -= 1
            if self._users[shard.name] == 0:
                shard.drop()


def _entry(info: TensorInfo | None) -> str:
    """A header entry as a message shows it: ``BF16 [256, 256] at byte 80`` (or ``absent``)."""
    return "absent" if info is None else f"{info.dtype.code} {list(info.shape)} at byte {info.start}"

"""Hugging Face Hub repos as SRC: ``convert-bnb org/name [--revision REV] --to bf16``.

A SRC that is not an existing local path and looks like ``org/name`` is a Hub model repo. It is
fetched with ``huggingface_hub.snapshot_download`` into the standard cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``), and the conversion then reads the snapshot directory like any model directory.
Everything about the cache and the network is left to huggingface_hub: ``HF_TOKEN`` (or the stored
login) authenticates, ``HF_HUB_OFFLINE=1`` resolves repo ids and revisions from ``refs/`` and
``snapshots/`` alone, and files already cached are not fetched again.

Only what the conversion needs is fetched (top-level files only):

- the weights: the first of :data:`formats.checkpoint.WEIGHT_FILES` present (an index plus exactly the
  shards its ``weight_map`` names, or a single file), as a local directory is read;
- every other top-level file a directory output keeps (:func:`formats.checkpoint.is_extra_file`: config,
  tokenizer, generation config, chat template, README, LICENSE, remote-code ``.py``, ...), the same
  online and offline.

A repo that holds a PEFT LoRA adapter (:func:`formats.peft.is_adapter_listing`: ``adapter_config.json`` with
adapter weights, or with no model weights at all) is an adapter: only ``adapter_config.json``, its weights file
(the first of :data:`formats.peft.ADAPTER_WEIGHTS`) and the few files its conversion reads
(:data:`formats.peft.ADAPTER_EXTRA_FILES`: the card, config.json, generation_config.json) are fetched, and
:attr:`HubSource.adapter` says so; its weights are downloaded (or, with ``headers``, read in place), never in a
low-disk run. A repo with ``adapter_config.json`` and neither weights is LORA-005, one with no weights of either
kind CKPT-005.

Online, the repo's file list and sizes come from the Hub API first (``model_info`` with file
metadata), so the disk pre-flight can count the bytes to download (files not yet in the cache),
and, when the cache and the output share a filesystem, the estimated output too
(:func:`estimate_output_bytes` over the safetensors headers the Hub serves). Offline there is
nothing to download, and a missing snapshot is a :class:`~formats.errors.HubError`.

The weights need not be downloaded first (:data:`WeightMode`, :mod:`convert.hub.shards`): ``inspect`` and
``--dry-run`` read the safetensors headers by HTTP range requests (``headers``); ``--low-disk`` fetches the
small files and then one shard at a time into a staging folder beside the output, never the cache
(``low-disk``), which a conversion also chooses by itself when only that fits the disk (``auto``).

When the Hub cannot be reached (no connection, a timeout, a 5xx answer) the cached snapshot of the
revision is used, as ``snapshot_download`` and transformers do, and :attr:`HubSource.fallback` says
why (the conversion prints it as a note); with nothing cached the network error is the HUB-001 error.

huggingface_hub is imported inside the functions: the CLI's start-up stays light.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from convert.hub.repo import is_hub_exception, is_repo_name
from convert.hub.shards import HubShards, RemoteFile
from convert.options import FLOAT_TARGETS
from formats import jsonfile
from formats.bnb import component_name, int8_scale_name, is_component
from formats.checkpoint import WEIGHT_FILES, WEIGHT_FILES_EXPECTED, is_extra_file, weight_map
from formats.dtypes import BY_CODE, BY_NAME
from formats.errors import (
    ConvertBnbError,
    DiskSpaceError,
    HubError,
    IndexJsonError,
    MissingShardError,
    NoWeightsError,
    UsageError,
)
from formats.peft import ADAPTER_EXTRA_FILES, ADAPTER_WEIGHTS, adapter_weights_file, is_adapter_dir, is_adapter_listing
from formats.peft_config import ADAPTER_CONFIG

__all__ = [
    "DownloadPlan",
    "HubSource",
    "WeightMode",
    "check_disk",
    "choose_weight_files",
    "estimate_output_bytes",
    "plan_download",
    "resolve_config",
    "resolve_repo",
]

#: Suffixes of files that hold weights (any container).
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
#: Bytes of output per byte of packed 4-bit codes, per element byte of the output dtype (2 codes/byte).
_CODES_PER_BYTE = 2
#: How :func:`resolve_repo` makes a repo's weights readable:
#: ``download``: everything into the cache first; ``headers``: the small files into the cache, the
#: safetensors weights opened from their headers over HTTP and never downloaded (inspect, --dry-run);
#: ``low-disk``: the small files and then one shard at a time into a private staging folder beside the
#: output, none into the cache; ``auto``: ``download``, or ``low-disk`` when the download and the output
#: do not fit the disk but the output and the two largest shards do.
WeightMode = Literal["download", "headers", "low-disk", "auto"]
#: Input shards a low-disk run may hold at once: the one being read and the next (a layer split across two).
_LOW_DISK_SHARDS = 2
#: The mark of a low-disk staging folder's name (``.<output name>.convert-bnb-shards-<pid>-<random>``).
SHARDS_MARK = ".convert-bnb-shards-"


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo at a commit.

    Attributes:
        name: path in the repo (top level).
        size: bytes (the LFS object's size for LFS files), or None when the Hub did not say.
        cached: in the local cache before this run (nothing to download).
    """

    name: str
    size: int | None
    cached: bool


@dataclass
class DownloadPlan:
    """What fetching a repo for conversion means, before anything is downloaded.

    Attributes:
        repo_id: ``org/name``.
        revision: the revision asked for (branch, tag or commit), or None for the default branch.
        commit: the commit sha it resolves to.
        files: the files to fetch (weights, index, small files).
        weight_files: the subset holding weights.
        offline: resolved from the cache alone (``HF_HUB_OFFLINE``): nothing to download.
        adapter: the repo is a PEFT LoRA adapter (``files``: its config, weights and card).
    """

    repo_id: str
    revision: str | None
    commit: str
    files: list[RepoFile]
    weight_files: list[str] = field(default_factory=list)
    offline: bool = False
    adapter: bool = False

    @property
    def download_bytes(self) -> int:
        """Bytes still to download (files not in the cache; unknown sizes count as 0)."""
        return sum(f.size or 0 for f in self.files if not f.cached)

    @property
    def low_disk_bytes(self) -> int:
        """Peak bytes of a low-disk run's staging folder: the small files and the two largest shards."""
        small = sum(f.size or 0 for f in self.files if f.name not in self.weight_files)
        weights = sorted((f.size or 0 for f in self.files if f.name in self.weight_files), reverse=True)
        return small + sum(weights[:_LOW_DISK_SHARDS])

    @property
    def reads_in_place(self) -> bool:
        """Whether the weights can be read without downloading them first (safetensors, listed sizes)."""
        sizes = {f.name: f.size for f in self.files}
        return bool(self.weight_files) and all(
            w.endswith(".safetensors") and sizes.get(w) is not None for w in self.weight_files)

    @property
    def allow_patterns(self) -> list[str]:
        """``snapshot_download`` patterns that match exactly :attr:`files`."""
        return [glob.escape(f.name) for f in self.files]

    @property
    def small_patterns(self) -> list[str]:
        """``snapshot_download`` patterns of :attr:`files` without the weights (the index, config, tokenizer...)."""
        return [glob.escape(f.name) for f in self.files if f.name not in self.weight_files]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "repo": self.repo_id, "revision": self.revision, "commit": self.commit, "offline": self.offline,
            "adapter": self.adapter, "download_bytes": self.download_bytes,
            "files": [{"name": f.name, "bytes": f.size, "cached": f.cached} for f in self.files],
        }


@dataclass(frozen=True)
class HubSource:
    """A repo resolved to a local snapshot directory.

    Attributes:
        repo_id: ``org/name``.
        revision: the revision asked for, or None (the default branch).
        commit: the commit sha of the snapshot.
        path: the snapshot directory in the cache (files are symlinks into ``blobs/``).
        downloaded_bytes: bytes fetched by this call (0 offline or when everything was cached; the small
            files alone when the weights are read in place).
        fallback: why the cached snapshot was used although online (the Hub could not be reached), or None.
        shards: the weights read in place (``headers`` and ``low-disk``: open the checkpoint with
            ``remote=shards.open``), or None when they are all on disk.
        staging: the low-disk run's private folder (``path``), removed by :meth:`close`, or None.
        low_disk: why the run is low-disk (a note), or None.
        missing: with ``download=False`` online, the files a conversion needs that are not in the cache
            yet (a conversion would download them); empty otherwise.
        adapter: the repo is a PEFT LoRA adapter (``path`` holds its config, and its weights unless ``shards``
            reads them in place), not a model.
    """

    repo_id: str
    revision: str | None
    commit: str
    path: Path
    downloaded_bytes: int = 0
    fallback: str | None = None
    shards: HubShards | None = None
    staging: Path | None = None
    low_disk: str | None = None
    missing: tuple[str, ...] = ()
    adapter: bool = False

    def close(self) -> None:
        """Remove the low-disk staging folder and all in it (nothing otherwise)."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


def _not_cached_hint() -> str:
    """Why huggingface_hub looked in the cache alone, and found nothing: offline mode (``HF_HUB_OFFLINE``), or
    else the Hub could not be reached (it falls back to the cache when the connection fails)."""
    if _offline():
        return ("HF_HUB_OFFLINE is set and the repo/revision is not in the cache; run once online, or check "
                "HF_HOME / HF_HUB_CACHE")
    return ("the Hub could not be reached (the connection failed) and the repo/revision is not in the cache; check "
            "the network (or HF_ENDPOINT / the proxy settings), or HF_HOME / HF_HUB_CACHE")


def _hub_error(exc: BaseException, repo_id: str, revision: str | None) -> HubError:
    """Turn a huggingface_hub exception into our :class:`HubError` (one line, with a hint)."""
    kind = type(exc).__name__
    rev = revision or "main"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
    if kind == "LocalEntryNotFoundError":  # what happened; its advice is a library caller's (local_files_only=False)
        first = first.split(". ")[0].rstrip(".") + "."
    hints = {
        "RepositoryNotFoundError": "check the repo id; for a private or gated repo set HF_TOKEN or run `hf auth login`",
        "GatedRepoError": "accept the repo's terms on the Hub and set HF_TOKEN",
        "RevisionNotFoundError": "check --revision (a branch, tag or commit sha)",
        "LocalEntryNotFoundError": _not_cached_hint(),
        "IncompleteSnapshotError": "the cached snapshot lacks files; run once online to complete it",
        "OfflineModeIsEnabled": "unset HF_HUB_OFFLINE, or fill the cache first",
    }
    hint = hints.get(kind, "check the network, the repo id and HF_TOKEN")
    return HubError(
        f"cannot fetch Hub repo '{repo_id}' at revision '{rev}' ({kind}: {first})",
        hint=f"{hint}; no local path '{repo_id}' exists either: if you meant one, check its spelling",
        expected="a reachable repo or a filled cache", found=kind,
    )


class _Unreachable(Exception):
    """The Hub could not be reached (raised by :func:`plan_download`; :func:`resolve_repo` then uses the cache)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _network_failure(exc: BaseException) -> bool:
    """A failure of the network or of the Hub itself, after which huggingface_hub uses the cache: no
    connection, a timeout, or a 5xx answer (not a proxy error, nor a missing repo, revision or access)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if "ProxyError" in names:
        return False
    if names & {"ConnectError", "TimeoutException", "ConnectionError", "Timeout"}:  # httpx; requests (older hub)
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return "HfHubHTTPError" in names and isinstance(status, int) and status >= 500


def _offline() -> bool:
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import constants

    fn = getattr(constants, "is_offline_mode", None)
    return bool(fn() if callable(fn) else constants.HF_HUB_OFFLINE)


def _load_index(path: str | Path) -> Any:
    """A shard index from the cache, as :func:`formats.checkpoint.open_checkpoint` reads a local one (CKPT-001)."""
    return jsonfile.load_json_file(path, jsonfile.INDEX, IndexJsonError, "the index")


def choose_weight_files(names: list[str], read_index: Callable[[str], Any], repo_id: str | None = None) -> list[str]:
    """Pick exactly the weight files a conversion reads: the first of :data:`formats.checkpoint.WEIGHT_FILES`
    present, as :func:`formats.checkpoint.open_checkpoint` takes it from a directory.

    Args:
        names: the repo's top-level file names.
        read_index: loads an index file by name (returns its parsed JSON).
        repo_id: ``org/name``, named by the error, or None.

    Returns:
        the index followed by the shards its ``weight_map`` names, or the one single weight file.

    Raises:
        IndexJsonError: CKPT-001, the repo's index has no ``weight_map`` object of strings.
        NoWeightsError: CKPT-005, the repo has no weights convert-bnb can read, neither a model's nor a PEFT
            LoRA adapter's (names the weight-like files found).
    """
    present = set(names)
    for name, is_index in WEIGHT_FILES:
        if name in present:
            return [name, *dict.fromkeys(weight_map(read_index(name), name).values())] if is_index else [name]
    weightish = sorted(n for n in names if any(fnmatch.fnmatch(n, g) for g in _WEIGHT_GLOBS))
    raise NoWeightsError("the repo holds neither a model's weights nor a PEFT LoRA adapter convert-bnb can read",
                         path=repo_id, expected=f"{WEIGHT_FILES_EXPECTED} (a model), or {ADAPTER_CONFIG} with "
                                  f"{' or '.join(ADAPTER_WEIGHTS)} (a PEFT LoRA adapter)",
                         found=weightish or "no weight files")


def choose_files(names: list[str], read_index: Callable[[str], Any], repo_id: str) -> tuple[list[str], list[str], bool]:
    """The files a conversion of a repo holding the top-level files ``names`` fetches.

    Args:
        names: the repo's top-level file names.
        read_index: loads an index file by name (returns its parsed JSON).
        repo_id: ``org/name``, for the errors.

    Returns:
        (the weights: :func:`choose_weight_files`' for a model, ``adapter_config.json`` and its weights file for a
        PEFT LoRA adapter; the other files: every :func:`formats.checkpoint.is_extra_file` of a model, the
        :data:`formats.peft.ADAPTER_EXTRA_FILES` an adapter has; whether it is an adapter
        (:func:`formats.peft.is_adapter_listing`)).

    Raises:
        NoAdapterWeightsError: LORA-005, an adapter's config without its weights (nor a model's).
        IndexJsonError, NoWeightsError: CKPT-001, CKPT-005 (:func:`choose_weight_files`).
    """
    if is_adapter_listing(names):
        weights = [ADAPTER_CONFIG, adapter_weights_file(names, repo_id)]
        return weights, [n for n in ADAPTER_EXTRA_FILES if n in names], True
    weights = choose_weight_files(names, read_index, repo_id)
    return weights, sorted(n for n in names if n not in weights and is_extra_file(n)), False


def plan_download(
    repo_id: str,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    local_dir: Path | None = None,
) -> DownloadPlan | None:
    """Ask the Hub which files a conversion of ``repo_id`` needs and which are not cached yet.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit sha (None: the default branch).
        cache_dir: the cache (None: huggingface_hub's default, from HF_HUB_CACHE / HF_HOME).
        local_dir: where the index is fetched to learn the shards (a low-disk staging folder), or None
            for the cache.

    Returns:
        the :class:`DownloadPlan`, or None in offline mode (resolution then comes from the cache).

    Raises:
        HubError: the repo or revision does not exist or may not be read.
        _Unreachable: the Hub could not be reached (:func:`_network_failure`).
        IndexJsonError, NoWeightsError: the repo holds no readable weights (CKPT-001, CKPT-005).
        NoAdapterWeightsError: LORA-005, the repo holds an adapter's config without its weights.
    """
    if _offline():
        return None
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        commit = str(info.sha)
        sizes: dict[str, int | None] = {}
        for sib in info.siblings or []:
            lfs = getattr(sib, "lfs", None)
            sizes[sib.rfilename] = lfs.size if lfs is not None else sib.size
        top = [n for n in sizes if "/" not in n]

        fetched: set[str] = set()

        def read_index(name: str) -> Any:
            if local_dir is not None or not isinstance(
                    try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=commit), str):
                fetched.add(name)  # fetched now (a few KB) to learn the shards: counted as downloaded
            if local_dir is not None:
                return _load_index(hf_hub_download(repo_id, name, revision=commit, local_dir=local_dir))
            return _load_index(hf_hub_download(repo_id, name, revision=commit, cache_dir=cache_dir))

        weights, small, adapter = choose_files(top, read_index, repo_id)
    except ConvertBnbError:
        raise
    except Exception as exc:
        if _network_failure(exc):
            raise _Unreachable(exc) from None
        if is_hub_exception(exc):
            raise _hub_error(exc, repo_id, revision) from None
        raise
    wanted = weights + small
    files = []
    for n in wanted:
        hit = None if local_dir is not None else try_to_load_from_cache(repo_id, n, cache_dir=cache_dir,
                                                                        revision=commit)
        files.append(RepoFile(n, sizes.get(n), isinstance(hit, str) and n not in fetched))
    return DownloadPlan(repo_id, revision, commit, files, [w for w in weights if not w.endswith(".json")],
                        adapter=adapter)


def estimate_output_bytes(headers: Mapping[str, tuple[str, list[int] | tuple[int, ...], int]], to: str) -> int | None:
    """Estimate the bytes a dequantization writes, from safetensors headers alone (no QuantState read).

    A packed 4-bit weight ``P.weight`` (it has a ``P.weight.absmax``) of ``b`` bytes becomes ``2 * b``
    elements; an int8 weight (it has ``P.SCB``) keeps its element count; QuantState companions vanish;
    other float tensors keep their element count. Elements are priced at the ``--to`` dtype's itemsize
    (``auto``: 2 bytes, the bf16/fp16 QuantState dtype nearly every bnb checkpoint has).

    Args:
        headers: tensor name -> (safetensors dtype code, shape, bytes).
        to: the ``--to`` value.

    Returns:
        the estimate in bytes (exact for bf16/fp16/fp32 when every packed layer has an even element
        count), or None for targets it cannot price (e.g. ``gguf``).
    """

    if to not in FLOAT_TARGETS:
        return None
    dtype = FLOAT_TARGETS[to]
    fixed = BY_NAME[dtype].itemsize if dtype is not None else None
    total = 0
    for name, (code, shape, nbytes) in headers.items():
        if is_component(name):
            continue
        numel = 1
        for d in shape:
            numel *= int(d)
        if component_name(name, "absmax") in headers:
            numel = _CODES_PER_BYTE * int(nbytes)
            size = fixed or 2
        elif name.endswith(".weight") and int8_scale_name(name) in headers:
            size = fixed or 2
        else:
            dt = BY_CODE.get(code)
            if dt is None:
                size = 1
            elif not dt.is_float:
                size = dt.itemsize
            else:
                size = fixed or dt.itemsize
        total += numel * size
    return total


def _offline_patterns(repo_id: str, revision: str | None, cache_dir: str | Path | None) -> list[str]:
    """Offline: exactly the files a conversion needs, from the tree listing huggingface_hub cached online.

    huggingface_hub checks the cached snapshot against that listing for the patterns given, so they
    must name what we fetched, not every weight-like file of the repo. Without a cached listing (a
    cache filled by hand, or an older huggingface_hub) it checks nothing, and
    :func:`formats.checkpoint.open_checkpoint` finds missing shards (CKPT-002).
    """
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    import huggingface_hub

    fallback = ["config.json"]
    get_tree = getattr(huggingface_hub, "get_cached_repo_tree", None)
    if get_tree is None:
        return fallback
    try:
        tree = get_tree(repo_id, revision=revision, cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001 - no cached listing: nothing for huggingface_hub to check
        if is_hub_exception(exc) or isinstance(exc, OSError):
            return fallback
        raise
    top = [f.path for f in tree if "/" not in f.path]

    def read_index(name: str) -> Any:
        hit = huggingface_hub.try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=revision)
        if not isinstance(hit, str):
            raise HubError("the repo's index is not in the cache", path=name,
                           hint="HF_HUB_OFFLINE is set; run once online to fetch it" if _offline() else
                           "the Hub could not be reached (the connection failed); fetch it once the Hub is reachable")
        return _load_index(hit)

    weights, small, _ = choose_files(top, read_index, repo_id)
    return [glob.escape(n) for n in weights + small]


def remote_files(plan: DownloadPlan) -> dict[str, RemoteFile]:
    """The plan's weight files as :class:`~convert.hub.shards.RemoteFile` (none read yet), or {} when
    they cannot be read in place (:attr:`DownloadPlan.reads_in_place`)."""

    if not plan.reads_in_place:
        return {}
    sizes = {f.name: f.size for f in plan.files}
    return {w: RemoteFile(plan.repo_id, plan.commit, w, sizes[w] or 0) for w in plan.weight_files}


def _remote_output_estimate(files: Mapping[str, RemoteFile], to: str) -> int | None:
    """Output estimate from the safetensors headers the Hub serves (range requests, no weights)."""
    if not files:
        return None
    headers: dict[str, tuple[str, list[int], int]] = {}
    try:
        for remote in files.values():
            for name, t in remote.header().tensors.items():
                headers[name] = (t.dtype.code, list(t.shape), t.nbytes)
    except ConvertBnbError:  # an estimate is optional: the header's rule is reported when the file is opened
        return None
    return estimate_output_bytes(headers, to)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_disk(
    download_bytes: int,
    cache_dir: str | Path,
    out: str | Path | None = None,
    out_bytes: int | None = None,
    *,
    disk_usage: Callable[[Path], Any] | None = None,
) -> None:
    """The disk pre-flight of a repo conversion: room for the download, and the output when they share a disk.

    Args:
        download_bytes: bytes still to download into the cache.
        cache_dir: the cache directory (need not exist yet).
        out: the output path (need not exist yet), or None.
        out_bytes: the estimated output bytes, or None when unknown.
        disk_usage: ``shutil.disk_usage``-like function (default: ``shutil.disk_usage``).

    Raises:
        DiskSpaceError: the free space is smaller than what the run needs, naming both figures.
    """
    cache = _existing(Path(cache_dir))
    need = download_bytes
    if out is not None and out_bytes:
        outp = _existing(Path(out).parent)
        if os.stat(outp).st_dev == os.stat(cache).st_dev:
            need += out_bytes
    if need <= 0:
        return
    free = int((disk_usage or shutil.disk_usage)(cache).free)
    if free < need:
        raise DiskSpaceError(
            "not enough free disk space for the download" + (" and the output" if need > download_bytes else ""),
            path=cache, action="download into",
            expected=f">= {need} bytes free ({download_bytes} to download"
            + (f" + {need - download_bytes} of output)" if need > download_bytes else ")"),
            found=f"{free} bytes free",
            hint="free space, or point HF_HUB_CACHE / -o at a larger disk",
        )


def resolve_repo(
    repo_id: str,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    out: str | Path | None = None,
    to: str = "auto",
    download: bool = True,
    progress: bool = True,
    weights: WeightMode = "download",
) -> HubSource:
    """Fetch (or find in the cache) what a conversion of ``repo_id`` needs; return the directory to open.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit sha (None: the default branch).
        cache_dir: the cache (None: huggingface_hub's default from HF_HUB_CACHE / HF_HOME).
        out: the output path, for the disk pre-flight (and the low-disk staging folder, beside it).
        to: the ``--to`` value, for the output estimate.
        download: False resolves the commit only (from the cache, or the Hub when online) and
            returns the snapshot path without fetching (it may not exist yet: online, the source's
            ``missing`` names the files not cached).
        progress: show huggingface_hub's progress bars (False disables them for this process).
        weights: how the weights are made readable (:data:`WeightMode`). ``headers`` and ``low-disk``
            need safetensors weights (``headers`` downloads other weights as ``download`` does);
            offline, or with the Hub unreachable, every mode reads the cached snapshot.

    Returns:
        the :class:`HubSource`; :meth:`HubSource.close` removes a low-disk staging folder.

    Raises:
        HubError: not found, gated, revision unknown, offline without the snapshot (or its index).
        IndexJsonError, NoWeightsError: the repo holds no readable weights (CKPT-001, CKPT-005).
        NoAdapterWeightsError: LORA-005, the repo holds a PEFT adapter's config without its weights.
        DiskSpaceError: the download (and output, on the same disk) does not fit; with ``low-disk``, the
            output and the two largest shards do not fit.
        UsageError: ``low-disk`` without ``out``, or for a repo without safetensors weights or a LoRA adapter.
    """
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import constants

    if not is_repo_name(repo_id):
        raise UsageError("not a Hub repo id", found=repo_id, expected="'org/name'")
    if not progress:
        # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if weights == "low-disk" and out is None:
        raise UsageError("--low-disk needs an output path")
    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    staging = _make_staging(Path(out)) if weights == "low-disk" and out is not None and not _offline() else None
    try:
        source = _resolve(repo_id, revision, cache_dir, cache, out, to, download, weights, staging)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if staging is not None and source.staging != staging:  # the Hub was unreachable: the cache is read
        shutil.rmtree(staging, ignore_errors=True)
    return source


def resolve_config(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
                   progress: bool = False) -> HubSource:
    """A repo's ``config.json`` alone, never its weights (a LoRA adapter's base model: its hyperparameters are
    all a GGUF adapter needs), fetched into the cache or found there: offline (``HF_HUB_OFFLINE``), and when the
    Hub cannot be reached, the cached snapshot of the revision is read, as huggingface_hub does.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit sha (None: the default branch).
        cache_dir: the cache (None: huggingface_hub's default from HF_HUB_CACHE / HF_HOME).
        progress: show huggingface_hub's progress bars.

    Returns:
        the :class:`HubSource` of the snapshot (its ``path`` holds config.json when the repo has one).

    Raises:
        UsageError: ``repo_id`` is not ``org/name``.
        HubError: not found, gated, revision unknown, no network and nothing cached.
    """
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import snapshot_download

    if not is_repo_name(repo_id):
        raise UsageError("not a Hub repo id", found=repo_id, expected="'org/name'")
    if not progress:
        # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=["config.json"])
    except Exception as exc:
        if is_hub_exception(exc) or _network_failure(exc):
            raise _hub_error(exc, repo_id, revision) from None
        raise
    snap = Path(path)
    return HubSource(repo_id, revision, snap.name, snap)


def _make_staging(out: Path) -> Path:
    """A private folder for a low-disk run's downloads beside the output (on its disk; removed when done):
    ``.<output name>.convert-bnb-shards-<pid>-<random>``. Such folders of dead processes (a SIGKILL, a
    power loss) for the same output are removed first."""
    parent = _existing(out.absolute().parent)
    prefix = f".{out.name}{SHARDS_MARK}"
    for old in parent.glob(glob.escape(prefix) + "*"):
        pid = old.name[len(prefix):].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _resolve(repo_id: str, revision: str | None, cache_dir: str | Path | None, cache: Path, out: str | Path | None,
             to: str, download: bool, weights: WeightMode, staging: Path | None) -> HubSource:
    """:func:`resolve_repo` once the staging folder of an explicit low-disk run exists (or None)."""
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import snapshot_download

    unreachable: BaseException | None = None
    try:
        plan = plan_download(repo_id, revision, cache_dir=cache_dir, local_dir=staging)
    except _Unreachable as exc:  # as huggingface_hub does: use the cached snapshot, if there is one
        plan, unreachable = None, exc.cause
    if plan is not None and not download:
        from huggingface_hub.file_download import repo_folder_name  # (heavy, as above)

        snap = cache / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / plan.commit
        return HubSource(repo_id, revision, plan.commit, snap, 0,
                         missing=tuple(f.name for f in plan.files if not f.cached), adapter=plan.adapter)
    mode: WeightMode = "download"
    note = None
    if plan is not None:
        remote = remote_files(plan)
        est = _remote_output_estimate(remote, to) if out is not None and not plan.adapter else None
        mode, note = _choose_mode(plan, weights, cache, out, est)
        if mode == "low-disk":
            assert out is not None
            staging = staging or _make_staging(Path(out))
            try:
                _fetch(repo_id, plan, plan.small_patterns, local_dir=staging)
                total = sum(f.size or 0 for f in plan.files)
                shards = HubShards(repo_id, plan.commit, staging, remote)
                return HubSource(repo_id, revision, plan.commit, staging, total, shards=shards, staging=staging,
                                 low_disk=note)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        patterns = plan.small_patterns if mode == "headers" else plan.allow_patterns
    else:
        patterns = _offline_patterns(repo_id, revision, cache_dir)
    try:
        # (plan None: offline or unreachable, the cache alone; huggingface_hub 1.x lists a commit's tree even
        # with HF_HUB_OFFLINE set unless told so)
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns,
                                 local_files_only=plan is None)
    except Exception as exc:
        if is_hub_exception(exc):
            raise _hub_error(unreachable or exc, repo_id, revision) from None
        raise
    snap = Path(path)
    fallback = None
    if unreachable is not None:
        first = (str(unreachable).strip().splitlines() or [""])[0]
        fallback = (f"the Hub could not be reached ({type(unreachable).__name__}: {first}); used the cached "
                    f"snapshot {repo_id}@{snap.name}, as huggingface_hub does")
    if plan is None:  # offline, or the Hub unreachable: the cached snapshot says what the repo is
        return HubSource(repo_id, revision, snap.name, snap, 0, fallback, adapter=is_adapter_dir(snap))
    if mode == "headers":
        small = sum(f.size or 0 for f in plan.files if not f.cached and f.name not in plan.weight_files)
        return HubSource(repo_id, revision, snap.name, snap, small,
                         shards=HubShards(repo_id, plan.commit, snap, remote), adapter=plan.adapter)
    return HubSource(repo_id, revision, snap.name, snap, plan.download_bytes, adapter=plan.adapter)


def _choose_mode(plan: DownloadPlan, weights: WeightMode, cache: Path, out: str | Path | None,
                 est: int | None) -> tuple[WeightMode, str | None]:
    """The mode a run reads its weights in, with the note that says why when it is low-disk by itself.

    Raises:
        DiskSpaceError: the chosen mode does not fit the disk (:func:`check_disk`).
        UsageError: ``low-disk`` for weights that cannot be read in place, or for a LoRA adapter.
    """
    if plan.adapter and weights == "low-disk":
        raise UsageError("--low-disk applies to a model repo; this repo is a PEFT LoRA adapter",
                         path=plan.repo_id, expected="a model repo", found=ADAPTER_CONFIG,
                         hint="convert without --low-disk (an adapter's few files are downloaded into the cache)")
    if weights == "headers":
        return ("headers" if plan.reads_in_place else "download"), None
    if weights == "low-disk":
        listed = {f.name for f in plan.files if f.size is not None}
        missing = [w for w in plan.weight_files if w.endswith(".safetensors") and w not in listed]
        index = next((f.name for f in plan.files if f.name.endswith(".index.json")), None)
        if missing and index is not None:  # as a downloaded repo reports it
            raise MissingShardError("index names a shard that does not exist", path=index,
                                    expected=f"a file '{missing[0]}'", found="none",
                                    hint=f"the repo {plan.repo_id} lacks it; its uploader must add it")
        if not plan.reads_in_place:
            raise UsageError("--low-disk needs a repo whose weights are safetensors files",
                             expected="model.safetensors or its shards", found=plan.weight_files[:3],
                             hint="convert without --low-disk (the whole repo is downloaded into the cache)")
        assert out is not None
        check_disk(plan.low_disk_bytes, _existing(Path(out).absolute().parent), out, est)
        return "low-disk", None
    try:
        check_disk(plan.download_bytes, cache, out, est)
        return "download", None
    except DiskSpaceError as full:
        if weights != "auto" or out is None or not plan.reads_in_place or plan.adapter:
            raise
        try:
            check_disk(plan.low_disk_bytes, _existing(Path(out).absolute().parent), out, est)
        except DiskSpaceError:
            raise full from None
        return "low-disk", (
            f"low-disk: the download and the output do not fit the free space ({full.found}; "
            f"{full.expected}), so the shards are fetched one at a time into a folder beside the output and "
            f"each deleted once converted (at most {plan.low_disk_bytes} bytes of input on disk); "
            "--low-disk asks for this always")


def _fetch(repo_id: str, plan: DownloadPlan, patterns: list[str], *, local_dir: Path) -> None:
    """Download the files matching ``patterns`` into ``local_dir`` (not the cache)."""
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, revision=plan.commit, local_dir=local_dir, allow_patterns=patterns)
    except Exception as exc:
        if is_hub_exception(exc):
            raise _hub_error(exc, repo_id, plan.revision) from None
        raise

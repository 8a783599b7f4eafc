"""Finding a checkpoint's weight files and presenting them as one name -> tensor map.

Accepted inputs:

- a single weight file (``.safetensors``; ``.bin``/``.pt``/``.pth`` torch checkpoints read by
  :mod:`formats.torch_pickle`; other containers register in :data:`READERS`);
- a model directory holding ``model.safetensors``, or shards plus ``model.safetensors.index.json``
  (``{"metadata": {...}, "weight_map": {tensor: shard file}}``, as transformers writes it); a
  layer's parts may sit in different shards. ``pytorch_model.bin`` and
  ``pytorch_model.bin.index.json`` are used when no safetensors weights are there.

Non-tensor values of torch pickles (an unpacked or legacy-list QuantState) are in
:attr:`Checkpoint.values`.

Directory rules, each with its own subclass of :class:`~formats.errors.CheckpointError`:

========  ==========================  ==========================================================
CKPT-001  IndexJsonError              the index is valid JSON (within :mod:`formats.jsonfile`'s limits)
                                      with a ``weight_map`` object of strings
CKPT-002  MissingShardError           every shard the index names exists
CKPT-003  IndexTensorMissingError     every tensor the index names is in the shard it names
CKPT-004  UnindexedShardError         no shard-named weight file (``model-00001-of-00002.safetensors``)
                                      is left out of the index
CKPT-005  NoWeightsError              the directory holds weights at all, and they hold a tensor
                                      (:meth:`Checkpoint.require_tensors`, before a conversion)
CKPT-006  ShardDuplicateTensorError   a tensor name appears in only one shard
CKPT-007  ConfigJsonError             config.json, when present, is a JSON object (within
                                      :mod:`formats.jsonfile`'s limits)
CKPT-008  UnindexedTensorError        every tensor of a shard is mapped to that shard by the index
CKPT-009  ShardPathError              shard names are plain file names inside the directory
CKPT-010  SourceNotFoundError         SRC exists
CKPT-011  NotRegularFileError         SRC and the weight files are regular files or directories (not a FIFO,
                                      a device, a socket, or a symlink loop)
CKPT-012  InputChangedError           a weight file keeps its size while it is read (:mod:`formats.mapping`)
CKPT-013  ConfigWeightsError          config.json's ``vocab_size``, ``hidden_size`` and ``num_hidden_layers``
                                      describe the weights (:meth:`Checkpoint.check_config`)
========  ==========================  ==========================================================

:func:`open_checkpoint` raises the first problem; given a ``problems`` list it appends the
problems it can step over (a missing shard, a stray file, a damaged tensor entry) and goes on, so
``convert-bnb check`` reports them all.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from . import jsonfile
from .dtypes import DType
from .errors import (
    ConfigJsonError,
    ConfigWeightsError,
    ConvertBnbError,
    IndexJsonError,
    IndexTensorMissingError,
    MissingShardError,
    NotRegularFileError,
    NoWeightsError,
    ShardDuplicateTensorError,
    ShardPathError,
    SourceNotFoundError,
    UnindexedShardError,
    UnindexedTensorError,
    UnsupportedError,
)
from .safetensors import SafetensorsReader
from .torch_pickle import TorchPickleReader

__all__ = [
    "READERS",
    "WEIGHT_FILES",
    "WEIGHT_SUFFIXES",
    "RemoteOpener",
    "Checkpoint",
    "ContainerReader",
    "TensorRecord",
    "gc_paused",
    "is_extra_file",
    "open_checkpoint",
    "path_kind",
    "read_config",
    "shard_suffix",
    "weight_map",
]


#: A vision or audio tower's name part: its embeddings and layers are not the text model's.
_VISION = re.compile(r"(?:^|\.)(?:vision\w*|visual|audio\w*|image\w*|mm_projector|multi_modal_projector)\.")
#: The layer index after ``PREFIX.layers.`` (digits, then a dot).
_LAYER_INDEX = re.compile(r"(\d{1,9})\.")


class _Info(Protocol):
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int


class ContainerReader(Protocol):
    """What a container module (safetensors, torch pickle, ...) provides for one file."""

    path: Path
    file_size: int  # bytes
    tensors: dict[str, Any]  # name -> object with dtype: DType, shape, nbytes

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]: ...

    def array(self, name: str) -> np.ndarray: ...

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None: ...

    def close(self) -> None: ...


#: File suffix -> reader class. Other container modules add themselves here.
READERS: dict[str, Callable[[Path], ContainerReader]] = {
    ".safetensors": SafetensorsReader,
    ".bin": TorchPickleReader,
    ".pt": TorchPickleReader,
    ".pth": TorchPickleReader,
}
#: Opens a weight file that a model directory names but that is not on disk (a Hub shard whose header
#: is read over HTTP and whose data is fetched when first needed): its reader, or None when it is not
#: available there either (then the file is missing, as without an opener).
RemoteOpener = Callable[[Path], "ContainerReader | None"]
#: Where a model directory's (or Hub repo's) weights are, in order of preference: the first present is
#: read. Per container (safetensors before torch pickles) its index, then its single file. ``(file name,
#: whether it is an index)``; the one table of weight-file discovery (:func:`open_checkpoint`,
#: ``convert.hub``).
WEIGHT_FILES: list[tuple[str, bool]] = [
    ("model.safetensors.index.json", True),
    ("model.safetensors", False),
    ("pytorch_model.bin.index.json", True),
    ("pytorch_model.bin", False),
]
#: What a directory without weights is told it lacks (CKPT-005): the indexes, then the single files.
WEIGHT_FILES_EXPECTED = " or ".join([n for n, index in WEIGHT_FILES if index] + [n for n, index in WEIGHT_FILES
                                                                                 if not index])


def shard_suffix(index_name: str) -> str:
    """The suffix of the shards an index names (``model.safetensors.index.json`` -> ``.safetensors``)."""
    return Path(index_name.removesuffix(".index.json")).suffix


def weight_map(index: Any, path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``weight_map`` of a parsed index (tensor name -> shard file name).

    Raises:
        IndexJsonError: CKPT-001, no ``weight_map`` object of strings.
    """
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise IndexJsonError(
            "index must hold a 'weight_map' object mapping tensor names to shard files",
            path=path, expected="{tensor name: shard file}",
            found=type(wmap).__name__ if not isinstance(wmap, dict) else "non-string entries",
        )
    return wmap
#: Suffixes that mark a weight file (never copied as an extra file).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def is_extra_file(name: str) -> bool:
    """Whether a top-level file of a model directory (or Hub repo) is copied to a directory output as it
    is: every file that holds no weights and is no index or hidden file (config, tokenizer, generation
    config, chat template, README, LICENSE, remote-code ``.py``, ...). The one rule for local
    directories and Hub repos alike (``convert.hub`` fetches exactly these)."""
    return (not name.startswith(".") and not name.endswith(".index.json")
            and os.path.splitext(name)[1].lower() not in WEIGHT_SUFFIXES)


_SHARD_RE = re.compile(r".*-\d{5}-of-\d{5}\.[A-Za-z]+$")


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a checkpoint: its header facts and zero-copy access to its bytes.

    Attributes:
        name: the tensor name.
        dtype: its dtype row.
        shape: dimensions in elements.
        nbytes: bytes on disk.
        reader: the container reader holding it.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    reader: ContainerReader = field(repr=False, compare=False)

    @property
    def file(self) -> str:
        """The file the tensor is stored in."""
        return os.fspath(self.reader.path)

    @property
    def numel(self) -> int:
        """Number of elements (a Python int)."""
        return math.prod(self.shape)

    def raw(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]:
        """Zero-copy ``uint8`` view of bytes [start, stop) of the tensor."""
        return self.reader.raw(self.name, start, stop)

    def array(self) -> np.ndarray:
        """Zero-copy view with the tensor's dtype and shape."""
        return self.reader.array(self.name)

    def release(self, start: int = 0, stop: int | None = None) -> None:
        """Drop consumed pages of bytes [start, stop) from the resident set."""
        self.reader.release(self.name, start, stop)


@dataclass
class Checkpoint:
    """A checkpoint opened for reading (never modified).

    Attributes:
        source: the path given (file or directory).
        is_dir: whether it is a model directory.
        files: the weight files, in index order.
        tensors: name -> :class:`TensorRecord`, in file order.
        config: ``config.json`` as a dict, or None.
        extra_files: other top-level files of a directory (tokenizer, generation config, ...).
        readers: the open container readers.
        values: name -> non-tensor value of a torch pickle (see
            :class:`~formats.torch_pickle.TorchPickleReader`); empty for safetensors.
    """

    source: Path
    is_dir: bool
    files: list[Path]
    tensors: dict[str, TensorRecord]
    config: dict[str, Any] | None = None
    extra_files: list[Path] = field(default_factory=list)
    readers: list[ContainerReader] = field(default_factory=list, repr=False)
    values: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for r in self.readers:
            self.values.update(getattr(r, "values", {}))

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(t.nbytes for t in self.tensors.values())

    def require_tensors(self) -> None:
        """Check that the weight files hold a tensor (what a conversion needs; ``inspect`` shows an empty file).

        Raises:
            NoWeightsError: CKPT-005, no tensor in any weight file (an empty state dict, or one of plain values).
        """
        if not self.tensors:
            raise NoWeightsError(
                "the weight files hold no tensors", path=self.source, expected="at least one tensor",
                found=f"0 tensors and {len(self.values)} other values" if self.values else "0 tensors",
                hint="give the model's checkpoint: this one was saved empty, or is not a model")

    def check_config(self) -> None:
        """Check that config.json describes these weights, as transformers needs to load what is written
        from them (it refuses an embedding of another size, and drops or re-initialises the layers the
        config does not count).

        The text model's values (``text_config``'s where it has them, else the top level's) against its
        token embedding (the one unquantized tensor ``PREFIX.embed_tokens.weight`` outside a vision or
        audio tower) and its layers (the indices N of ``PREFIX.layers.N.``, each present): ``vocab_size`` =
        the embedding's rows, ``hidden_size`` (``n_embd``, ``d_model``) = its width, ``num_hidden_layers``
        (``n_layer``, ``num_layers``) = the layers held; each present and an integer (transformers would
        take its class default for a missing one). A model without such an embedding is not checked.

        Raises:
            ConfigWeightsError: CKPT-013, naming config.json, the key, the tensor, and both values.
        """
        cfg = self.config
        if not isinstance(cfg, dict):
            return
        text = cfg.get("text_config")
        hp = {**cfg, **text} if isinstance(text, dict) else cfg
        embeds = [n for n in self.tensors if n.endswith("embed_tokens.weight") and not _VISION.search(n)]
        if len(embeds) != 1:
            return
        emb = embeds[0]
        record = self.tensors[emb]
        if len(record.shape) != 2 or not record.dtype.is_float:
            return
        config_path = self.source / "config.json" if self.is_dir else self.source
        rows, cols = record.shape
        prefix = emb[: -len("embed_tokens.weight")] + "layers."
        seen = {int(m.group(1)) for n in self.tensors if n.startswith(prefix)
                for m in [_LAYER_INDEX.match(n, len(prefix))] if m}
        if seen:
            gaps = sorted(set(range(max(seen) + 1)) - seen)
            if gaps:
                raise ConfigWeightsError(
                    "the weights lack a layer below their last one", path=self.source, tensor=f"{prefix}{gaps[0]}.*",
                    expected=f"layers 0 to {max(seen)}", found=f"no tensor of layer {gaps[0]} ({len(gaps)} missing)",
                    hint="the checkpoint is incomplete: download it again")

        def agree(keys: tuple[str, ...], want: int, what: str, tensor: str) -> None:
            key = next((k for k in keys if k in hp), None)
            if key is None:
                raise ConfigWeightsError(
                    f"config.json has no '{keys[0]}'", path=config_path, tensor=tensor, expected=want, found=None,
                    hint="transformers would take its class default instead of the weights' value: use the "
                         "config.json saved with these weights")
            value = hp[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigWeightsError(
                    f"config.json '{key}' is not an integer", path=config_path, tensor=tensor, expected=want,
                    found=f"{str(value)[:40]} ({type(value).__name__})",
                    hint="use the config.json saved with these weights")
            if value != want:
                raise ConfigWeightsError(
                    f"config.json '{key}' differs from {what}", path=config_path, tensor=tensor,
                    expected=want, found=value,
                    hint="use the config.json saved with these weights: transformers would refuse, drop or "
                         "re-initialise what is written from them")

        agree(("vocab_size",), rows, "the token embedding's rows", emb)
        agree(("hidden_size", "n_embd", "d_model"), cols, "the token embedding's width", emb)
        if seen:
            agree(("num_hidden_layers", "n_layer", "num_layers"), len(seen),
                  f"the layers the tensors hold (0 to {max(seen)})", f"{prefix}*")

    def close(self) -> None:
        """Close every reader."""
        for r in self.readers:
            r.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def path_kind(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> str:
    """What a path is, following symlinks: ``"file"``, ``"directory"``, ``"missing"`` (also a dangling
    symlink), or a description of anything else (``"a FIFO (named pipe)"``, ``"a symlink loop"``, ...).
    With ``follow_symlinks`` False a symlink is ``"a symlink"``, whatever it points to."""
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if exc.errno == errno.ENOTDIR:
            return "missing"
        return f"unreadable ({exc.strerror})"
    return _FILE_TYPES.get(stat.S_IFMT(mode), "not a regular file")


#: ``stat.S_IFMT`` of a path -> what :func:`path_kind` calls it.
_FILE_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "directory", stat.S_IFIFO: "a FIFO (named pipe)",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
               stat.S_IFLNK: "a symlink"}


def _open_file(path: Path, problems: list[ConvertBnbError] | None = None) -> ContainerReader:
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise UnsupportedError(
            f"no reader for '{path.suffix}' files",
            path=path, expected=sorted(READERS), found=path.suffix or "(no suffix)",
        )
    if problems is not None and getattr(reader, "collects_problems", False):
        return reader(path, problems)  # type: ignore[call-arg]
    return reader(path)


def _records(reader: ContainerReader, names: list[str] | None = None) -> dict[str, TensorRecord]:
    out: dict[str, TensorRecord] = {}
    for name in names if names is not None else list(reader.tensors):
        info = reader.tensors[name]
        out[name] = TensorRecord(name, info.dtype, tuple(info.shape), info.nbytes, reader)
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: building millions of header records would otherwise run
    full collections over them again and again (a third to a half of the time for 10^5-10^6 tensors)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model's ``config.json`` as a dict, within :data:`formats.jsonfile.CONFIG`'s limits.

    Raises:
        ConfigJsonError: CKPT-007, not JSON within the limits, or not an object.
        OSError: the file cannot be read.
    """
    config = jsonfile.load_json_file(path, jsonfile.CONFIG, ConfigJsonError, "config.json")
    if not isinstance(config, dict):
        raise ConfigJsonError("config.json must be a JSON object", path=path, expected="object",
                              found=type(config).__name__)
    return config


def open_checkpoint(path: str | os.PathLike[str], problems: list[ConvertBnbError] | None = None,
                    remote: RemoteOpener | None = None) -> Checkpoint:
    """Open a weight file or a model directory (see :func:`_open_checkpoint`)."""
    with gc_paused():
        return _open_checkpoint(path, problems, remote)


def _open_checkpoint(path: str | os.PathLike[str], problems: list[ConvertBnbError] | None = None,
                     remote: RemoteOpener | None = None) -> Checkpoint:
    """Open a weight file or a model directory.

    Args:
        path: a weight file, or a directory with ``model.safetensors`` or an index and shards.
        problems: when given, problems that can be stepped over are appended to it instead of
            raised (the file or tensor concerned is left out) -- see ``convert-bnb check``.
        remote: opens the directory's weight files that are not on disk (:data:`RemoteOpener`), or None.

    Returns:
        a :class:`Checkpoint`; close it (or use ``with``) when done.

    Raises:
        CheckpointError: a CKPT-xxx rule (a subclass per rule, e.g. :class:`MissingShardError`).
        SafetensorsError: a shard breaks the container format.
        UnsupportedError: a file type without a reader.
        SourceNotFoundError: the path does not exist (also a ``FileNotFoundError``).
    """

    def report(exc: ConvertBnbError) -> None:
        if problems is None:
            raise exc
        problems.append(exc)

    src = Path(path)
    kind = path_kind(src)
    if kind == "missing":
        raise SourceNotFoundError("SRC does not exist", path=src,
                                  hint="give a .safetensors file or a model directory")
    if kind not in ("file", "directory"):
        raise NotRegularFileError("SRC is not a regular file or a directory", path=src,
                                  expected="a weight file or a model directory", found=kind)
    if kind == "file":
        reader = _open_file(src, problems)
        return Checkpoint(src, False, [src], _records(reader), readers=[reader])

    config = None
    cfg_path = src / "config.json"
    if cfg_path.is_file():
        try:
            config = read_config(cfg_path)
        except ConfigJsonError as exc:
            config = None
            report(exc)
    extra = sorted(p for p in src.iterdir() if p.is_file() and is_extra_file(p.name))
    readers: list[ContainerReader] = []
    try:
        for name, is_index in WEIGHT_FILES:  # the first present, in order of preference
            weight_path = src / name
            if is_index:
                if weight_path.is_file():
                    files, tensors = _open_index(src, weight_path, shard_suffix(name), readers, report, problems,
                                                 remote)
                    return Checkpoint(src, True, files, tensors, config, extra, readers)
                continue
            single_kind = path_kind(weight_path)
            far = remote(weight_path) if single_kind == "missing" and remote is not None else None
            if single_kind == "missing" and far is None:
                continue
            if single_kind not in ("file", "missing"):
                raise NotRegularFileError("weight file is not a regular file", path=weight_path,
                                          expected="a regular file", found=single_kind)
            reader = far if far is not None else _open_file(weight_path, problems)
            readers.append(reader)
            stray = _stray_shards(src, {weight_path.name}, weight_path.suffix.lower())
            if stray:
                report(UnindexedShardError(
                    "shard files present but no index names them", path=src,
                    expected=f"{weight_path.name}.index.json", found=stray,
                    hint="remove the stray shards or fetch the index",
                ))
            return Checkpoint(src, True, [weight_path], _records(reader), config, extra, readers)
        candidates = sorted(p.name for p in src.iterdir() if p.suffix.lower() in READERS)
        raise NoWeightsError(
            "no weights found", path=src,
            expected=WEIGHT_FILES_EXPECTED, found=candidates or "no weight files",
            hint="point at the model directory or at one weight file",
        )
    except BaseException:
        for r in readers:
            r.close()
        raise


def _stray_shards(root: Path, named: set[str], suffix: str) -> list[str]:
    return sorted(
        p.name for p in root.iterdir()
        if p.suffix.lower() == suffix and _SHARD_RE.match(p.name) and p.name not in named
    )


def _open_index(
    root: Path,
    index_path: Path,
    suffix: str,
    readers: list[ContainerReader],
    report: Callable[[ConvertBnbError], None],
    problems: list[ConvertBnbError] | None,
    remote: RemoteOpener | None = None,
) -> tuple[list[Path], dict[str, TensorRecord]]:
    wmap = weight_map(jsonfile.load_json_file(index_path, jsonfile.INDEX, IndexJsonError, "the index"), index_path)
    shard_names = list(dict.fromkeys(wmap.values()))  # in index order, once each (linear)
    # a name that leaves the directory first: it is the cause when the real shards then look stray (CKPT-004)
    outside = {s for s in shard_names if os.sep in s or (os.altsep and os.altsep in s) or s in ("", ".", "..")}
    for shard in (s for s in shard_names if s in outside):
        report(ShardPathError("index names a shard outside the directory", path=index_path,
                              expected="a plain file name", found=shard))
    unnamable = {s for s in shard_names if "\0" in s and s not in outside}  # no file system takes a NUL byte
    for shard in (s for s in shard_names if s in unnamable):
        report(ShardPathError("index names a shard with a NUL byte in its name", path=index_path,
                              expected="a plain file name", found=shard))
    outside |= unnamable
    stray = _stray_shards(root, set(shard_names), suffix)
    if stray:
        report(UnindexedShardError(
            "shard file is not named by the index", path=index_path,
            expected=f"only {shard_names}", found=stray,
            hint="remove the stray shard or fetch the index that names it",
        ))
    opened: dict[str, ContainerReader] = {}
    files: list[Path] = []
    seen: dict[str, str] = {}
    # per shard that broke a container rule while opening (collected problems only): the tensors named in
    # those problems, or None for the whole file (a truncated data area); a name the index maps there that
    # its reader left out follows from that problem and is not reported again (CKPT-003)
    damaged: dict[str, set[str] | None] = {}
    for shard in shard_names:
        if shard in outside:
            continue
        shard_path = root / shard
        shard_kind = path_kind(shard_path)
        far = remote(shard_path) if shard_kind == "missing" and remote is not None else None
        if shard_kind == "missing" and far is None:
            report(MissingShardError(
                "index names a shard that does not exist", path=index_path,
                expected=f"a file '{shard}'", found="none",
                hint="the download is incomplete; fetch the missing shard",
            ))
            continue
        if shard_kind not in ("file", "missing"):
            report(NotRegularFileError(
                "index names a shard that is not a regular file", path=shard_path,
                expected="a regular file", found=shard_kind,
            ))
            continue
        before = len(problems) if problems is not None else 0
        try:
            reader = far if far is not None else _open_file(shard_path, problems)
        except ConvertBnbError as exc:
            report(exc)
            continue
        new = problems[before:] if problems is not None else []
        if new:
            damaged[shard] = None if any(p.tensor is None for p in new) else {p.tensor for p in new}
        readers.append(reader)
        opened[shard] = reader
        files.append(shard_path)
        inner: set[str] = getattr(reader, "value_tensors", set())
        for name in reader.tensors:
            if name in inner:
                continue  # a tensor inside a non-tensor value (torch pickles); the index names the value
            if name in seen:
                report(ShardDuplicateTensorError(
                    f"tensor is also in shard '{seen[name]}'", path=shard_path, tensor=name,
                    expected="one shard", found=[seen[name], shard],
                ))
            elif wmap.get(name) != shard:
                report(UnindexedTensorError(
                    "shard holds a tensor the index does not map to it", path=shard_path,
                    tensor=name, expected=shard, found=wmap.get(name) or "not in the index",
                ))
            seen.setdefault(name, shard)
    tensors: dict[str, TensorRecord] = {}
    for name, shard in wmap.items():
        opened_reader = opened.get(shard)
        if opened_reader is None:
            continue  # its shard was reported above
        if shard in damaged:
            dropped = damaged[shard]
            if dropped is None or name in dropped:
                continue  # left out of the map by its shard's reported damage
        if name not in opened_reader.tensors and name not in getattr(opened_reader, "values", {}):
            report(IndexTensorMissingError(
                "index names a tensor that is not in its shard", path=opened_reader.path, tensor=name,
                expected=f"'{name}' in {shard}", found="absent",
            ))
    for reader in readers:
        for name, rec in _records(reader).items():
            tensors.setdefault(name, rec)  # a duplicate (reported above) keeps its first shard
    return files, tensors

"""llama.cpp's importance matrix files (``llama-imatrix`` output), read and validated.

Two formats, told apart by the first four bytes (llama.cpp's ``common_imatrix_load`` tries GGUF first):

GGUF (current ``llama-imatrix``, ``--output-format gguf``): a GGUF file with ``general.type`` = "imatrix",
the keys ``imatrix.datasets`` ([str]), ``imatrix.chunk_count`` (u32) and ``imatrix.chunk_size`` (u32), and
per weight ``W`` of the model two F32 tensors: ``W.in_sum2`` (ne ``(n_per_row, n_mat)``: the sums of the
squared activations entering each column, one row per expert matrix) and ``W.counts`` (ne ``(1, n_mat)``:
how many activation rows each sum holds; llama.cpp rounds them to integers, ``lround``).

Legacy ``.dat`` (``--output-format dat``), little-endian::

    n_entries i32 (>= 1)
    n_entries x { name_len i32, name bytes, ncall i32, nval i32 (>= 1), values f32[nval] }
    optional: chunk_count i32, dataset_len i32, dataset bytes

where ``values`` are already averaged per call and multiplied by ``ncall``.

:func:`read_imatrix` gives an :class:`ImatrixFile` of raw sums and counts; what they mean for
quantization (``llama-quantize``'s ``load_imatrix``) is decided in ``convert/``.

Rules (see docs/errors.md):

========  ======================================================================================
IMX-001   the file is a GGUF importance matrix (each ``.in_sum2`` with its ``.counts``, both F32, the
          sums a whole number of rows of the counts; the three ``imatrix.*`` keys present: llama-quantize
          refuses a GGUF file without them) or a complete legacy ``.dat`` file, with at least one entry
          (:class:`~formats.errors.ImatrixFormatError`)
IMX-002   every sum is finite and not negative, every count finite and not negative
          (:class:`~formats.errors.ImatrixValuesError`)
========  ======================================================================================
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import gguf
import numpy as np
import numpy.typing as npt

from .checkpoint import path_kind
from .errors import ImatrixFormatError, ImatrixValuesError

__all__ = ["ImatrixEntry", "ImatrixFile", "read_imatrix"]

#: The largest file read: a matrix for a 1T-parameter MoE model (one float per column per expert matrix)
#: stays far below it.
MAX_IMATRIX_BYTES = 8 << 30
#: The largest count accepted (C's ``lround`` to a 64-bit ``long``).
MAX_COUNT = 2.0**62

_SUMS = ".in_sum2"
_COUNTS = ".counts"
_KEYS = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")


@dataclass(frozen=True)
class ImatrixEntry:
    """One weight's statistics.

    Attributes:
        name: the weight's GGUF name (``blk.0.attn_q.weight``).
        sums: float32 ``(n_mat, n_per_row)``: GGUF: sums of squared activations per column, one row per
            expert matrix; legacy: one row, the per-call mean times ``ncall``.
        counts: int64 ``(n_mat,)``: GGUF: activation rows summed per matrix (rounded as ``lround``);
            legacy: ``(ncall,)``.
    """

    name: str
    sums: npt.NDArray[np.float32]
    counts: npt.NDArray[np.int64]


@dataclass(frozen=True)
class ImatrixFile:
    """An importance matrix file's contents.

    Attributes:
        path: the file as given.
        entries: weight name -> :class:`ImatrixEntry`, in file order.
        datasets: the text files it was computed on (``imatrix.datasets``; legacy: at most one).
        chunk_count: chunks of text it was computed on (0 when the file does not say).
        chunk_size: tokens per chunk (GGUF; 0 for legacy files).
        legacy: a ``.dat`` file.
    """

    path: str
    entries: dict[str, ImatrixEntry]
    datasets: tuple[str, ...]
    chunk_count: int
    chunk_size: int
    legacy: bool


def read_imatrix(path: str | os.PathLike[str]) -> ImatrixFile:
    """Read and validate an importance matrix file of either format.

    Raises:
        ImatrixFormatError: IMX-001 (not an importance matrix, damaged, no entries, keys missing; the file
            cannot be opened).
        ImatrixValuesError: IMX-002 (a sum or count that is NaN, infinite or negative).
    """
    spath = os.fspath(path)
    kind = path_kind(spath)
    if kind == "missing":
        raise ImatrixFormatError("the importance matrix file does not exist", path=spath,
                                 expected="a file llama-imatrix wrote", found="no such file")
    if kind != "file":
        raise ImatrixFormatError("the importance matrix is not a regular file", path=spath,
                                 expected="a file llama-imatrix wrote", found=kind)
    size = os.path.getsize(spath)
    if size > MAX_IMATRIX_BYTES:
        raise ImatrixFormatError("the importance matrix file is larger than any llama-imatrix writes", path=spath,
                                 expected=f"at most {MAX_IMATRIX_BYTES} bytes", found=f"{size} bytes")
    try:
        with open(spath, "rb") as f:
            magic = f.read(4)
            out = _read_gguf(spath) if magic == b"GGUF" else _read_legacy(spath, f)
    except OSError as exc:
        raise ImatrixFormatError(f"cannot read the importance matrix file ({exc.strerror or exc})", path=spath,
                                 expected="a readable file") from None
    if not out.entries:
        raise ImatrixFormatError("the file holds no importance matrix entries", path=spath,
                                 expected="at least one entry", found="none")
    for e in out.entries.values():
        _check_values(spath, e)
    return out


def _check_values(path: str, e: ImatrixEntry) -> None:
    bad = ~np.isfinite(e.sums) | (e.sums < 0)
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise ImatrixValuesError("an importance matrix sum is not a finite non-negative number", path=path,
                                 tensor=e.name, expected="finite values >= 0",
                                 found=f"{float(e.sums.reshape(-1)[i])} at index {i}")
    if (e.counts < 0).any():
        raise ImatrixValuesError("an importance matrix count is negative", path=path, tensor=e.name,
                                 expected="counts >= 0", found=int(e.counts.min()))


def _read_gguf(path: str) -> ImatrixFile:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf-py raises ValueError, struct.error, IndexError ... on damaged files
        raise ImatrixFormatError(f"not a readable GGUF file ({type(exc).__name__}: {exc})", path=path) from None
    missing = [k for k in _KEYS if reader.get_field(k) is None]
    if missing:
        kind = reader.get_field("general.type")
        raise ImatrixFormatError(
            "GGUF file without the importance matrix keys llama-quantize needs", path=path,
            expected="imatrix.datasets, imatrix.chunk_count and imatrix.chunk_size (llama-imatrix output)",
            found=f"general.type {kind.contents()!r}, no {', '.join(missing)}" if kind is not None else
            f"no {', '.join(missing)}")
    pairs: dict[str, dict[str, gguf.ReaderTensor]] = {}
    for t in reader.tensors:
        for suffix in (_SUMS, _COUNTS):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = t
    entries: dict[str, ImatrixEntry] = {}
    for name, pair in pairs.items():
        if len(pair) != 2:
            have = next(iter(pair))
            raise ImatrixFormatError("sums and counts come in pairs", path=path, tensor=name,
                                     expected=f"{name}{_SUMS} and {name}{_COUNTS}", found=f"only {name}{have}")
        sums, counts = pair[_SUMS], pair[_COUNTS]
        for t in (sums, counts):
            if t.tensor_type != gguf.GGMLQuantizationType.F32:
                raise ImatrixFormatError("importance matrix tensors are F32", path=path, tensor=t.name,
                                         expected="F32", found=t.tensor_type.name)
        n_mat = int(counts.n_elements)
        if n_mat < 1 or sums.n_elements % n_mat:
            raise ImatrixFormatError("the sums are not a whole number of rows, one per count", path=path,
                                     tensor=name, expected=f"a multiple of {n_mat} sums", found=int(sums.n_elements))
        c = np.asarray(counts.data, dtype=np.float32).reshape(-1)
        if not (np.isfinite(c) & (np.abs(c) <= MAX_COUNT)).all():
            raise ImatrixValuesError("an importance matrix count is not finite or too large", path=path,
                                     tensor=name, expected=f"finite counts up to {MAX_COUNT:g}",
                                     found=float(c[~(np.isfinite(c) & (np.abs(c) <= MAX_COUNT))][0]))
        entries[name] = ImatrixEntry(
            name, np.array(sums.data, dtype=np.float32).reshape(n_mat, -1),
            np.array([_lround(v) for v in c.tolist()], dtype=np.int64))
    field = reader.get_field("imatrix.datasets")
    # (llama.cpp reads the datasets only from an array of strings)
    strings = field is not None and field.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    datasets = tuple(str(v) for v in field.contents()) if field is not None and strings else ()
    return ImatrixFile(path, entries, datasets, _u32(reader, "imatrix.chunk_count"),
                       _u32(reader, "imatrix.chunk_size"), legacy=False)


def _lround(v: float) -> int:
    """C's ``lround``: to nearest, halves away from zero."""
    return int(math.floor(abs(v) + 0.5)) * (1 if v >= 0 else -1)


def _u32(reader: gguf.GGUFReader, key: str) -> int:
    field = reader.get_field(key)
    value = field.contents() if field is not None else 0
    return int(value) if isinstance(value, (int, np.integer)) else 0


def _read_legacy(path: str, f: BinaryIO) -> ImatrixFile:
    """The ``.dat`` layout, read through a read-only map of the open file ``f`` (nothing copied but the
    values kept)."""
    if os.fstat(f.fileno()).st_size == 0:
        raise ImatrixFormatError("not an importance matrix file (neither GGUF nor llama-imatrix's .dat)",
                                 path=path, expected="at least 4 bytes", found="0 bytes")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _parse_legacy(path, view)
        finally:
            view.release()  # (an error's traceback still holds the view: the map closes only without it)


def _parse_legacy(path: str, data: memoryview) -> ImatrixFile:
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise ImatrixFormatError(f"legacy importance matrix file ends inside {what}", path=path,
                                     expected=f"{n} more bytes at offset {pos}", found=f"{len(data) - pos}")
        pos += n
        return bytes(data[pos - n: pos])

    def i32(what: str) -> int:
        return int(struct.unpack("<i", take(4, what))[0])

    if len(data) < 4:
        raise ImatrixFormatError("not an importance matrix file (neither GGUF nor llama-imatrix's .dat)",
                                 path=path, expected="at least 4 bytes", found=f"{len(data)} bytes")
    n = i32("the entry count")
    if n < 1 or n > len(data) // 12:
        raise ImatrixFormatError("not an importance matrix file (neither GGUF nor llama-imatrix's .dat)",
                                 path=path, expected="a GGUF file, or an entry count of 1 or more",
                                 found=f"first bytes {bytes(data[:4]).hex()} (entry count {n})")
    entries: dict[str, ImatrixEntry] = {}
    for i in range(n):
        raw = take(i32(f"entry {i + 1}'s name length"), f"entry {i + 1}'s name")
        name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        ncall = i32(f"entry {i + 1}'s call count")
        nval = i32(f"entry {i + 1}'s value count")
        if nval < 1:
            raise ImatrixFormatError("an entry has no values", path=path, tensor=name, expected="1 or more",
                                     found=nval)
        sums = np.frombuffer(take(4 * nval, f"entry {i + 1}'s values"), dtype="<f4").astype(np.float32)
        entries[name] = ImatrixEntry(name, sums.reshape(1, -1), np.array([ncall], dtype=np.int64))
    chunk_count, datasets = 0, ()
    if len(data) - pos >= 4:  # the optional trailer, read as far as it goes (as llama.cpp does)
        chunk_count = i32("the chunk count")
        if len(data) - pos >= 4:
            size = i32("the dataset name length")
            if 0 < size <= len(data) - pos:
                datasets = (take(size, "the dataset name").split(b"\0", 1)[0].decode("utf-8", "replace"),)
    return ImatrixFile(path, entries, datasets, chunk_count, 0, legacy=True)

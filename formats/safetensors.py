"""The safetensors container: a validating reader with zero-copy memory-mapped views, and a streaming writer.

Byte layout (https://github.com/huggingface/safetensors, "Format")::

    [0, 8)            N: unsigned little-endian 64-bit header length in bytes
    [8, 8 + N)        header: UTF-8 JSON object
                        {"__metadata__": {str: str},                       (optional)
                         "<name>": {"dtype": "BF16", "shape": [d0, ...],
                                    "data_offsets": [begin, end]}, ...}
                      padded with spaces (0x20) so that 8 + N is a multiple of 8 (we write it so;
                      we accept any N)
    [8 + N, EOF)      data area; a tensor's bytes are [8 + N + begin, 8 + N + end), row-major,
                      little-endian

Rules the reader enforces before anything is allocated (all sizes are Python ints, so no
fixed-width overflow); each has its own subclass of :class:`~formats.errors.SafetensorsError`:

=======  ==========================  =======================================================
ST-001   FileTooShortError           the file holds at least 8 bytes
ST-002   HeaderTooLargeError         N <= file size - 8 and N <= MAX_HEADER_BYTES (100 MiB)
ST-003   HeaderJsonError             the header is UTF-8 JSON: an object of tensor objects, within
                                     :mod:`formats.jsonfile`'s limits (nesting, integer digits,
                                     no NaN/Infinity, no lone surrogate escape)
ST-004   NotSafetensorsError         the file is a safetensors file at all (Git LFS pointer,
                                     HTML, zip, pickle and text are named)
ST-005   UnknownDtypeError           dtype is a known safetensors code
ST-006   TensorShapeError            shape is a list of non-negative integers
ST-007   DataOffsetsError            data_offsets is [begin, end], integers, 0 <= begin <= end
ST-008   ByteSpanError               end - begin == prod(shape) * itemsize
ST-009   TensorOverlapError          no two tensors share bytes
ST-010   TruncatedFileError          the data area is as long as the header says
ST-011   MetadataError               __metadata__ is an object of strings
ST-012   DataGapError                the tensors cover the data area with no gap or trailing bytes
ST-013   DuplicateTensorError        a name appears once in the header
ST-014   TooManyTensorsError         the header lists at most MAX_TENSORS (200,000) tensors,
                                     counted in the raw header before it is parsed
=======  ==========================  =======================================================

Reading never copies tensor data: :meth:`SafetensorsReader.raw` and :meth:`SafetensorsReader.array`
return read-only NumPy views into one ``mmap`` of the file (``np.frombuffer``, the same mapping
``np.memmap`` makes), and :meth:`SafetensorsReader.release` drops consumed pages from the process
(``madvise(MADV_DONTNEED)``) so a streaming pass keeps its resident set bounded.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from . import jsonfile
from .dtypes import DType, by_code
from .errors import (
    ByteSpanError,
    ConvertBnbError,
    DataGapError,
    DataOffsetsError,
    DuplicateTensorError,
    FileTooShortError,
    HeaderJsonError,
    HeaderTooLargeError,
    MetadataError,
    NotSafetensorsError,
    TensorOverlapError,
    TensorShapeError,
    TooManyTensorsError,
    TruncatedFileError,
    UnknownDtypeError,
)
from .jsonfile import load_json_bytes
from .mapping import InputMap
from .writeback import FileStream, bytes_of

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "Header",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorInfo",
    "build_header",
    "read_header",
    "sniff",
]

#: Largest header accepted, in bytes (the Rust library's own limit is 100 MB).
MAX_HEADER_BYTES = jsonfile.HEADER.max_bytes
#: Most tensors one file may list (ST-014). Every tensor costs about 2.5 KiB of records from the
#: header to the written output (``scripts/bench.py tensors``), so 200,000 take about half of the
#: default 1 GiB ``--max-memory``; real shards hold a few thousand (a 5 GB shard of a bnb-4bit MoE
#: model with 6 tensors per expert matrix, about 10,000). A header of 100 MiB could list 1.7 million.
MAX_TENSORS = 200_000
#: Every tensor entry has exactly one ``"data_offsets"`` key; a name or value holding the text has its
#: quotes escaped (``\"``), so counting this in the raw header counts the entries, in C, before parsing.
_ENTRY_KEY = b'"data_offsets"'


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file.

    Attributes:
        name: the tensor name from the header.
        dtype: its row of the dtype table.
        shape: dimensions in elements.
        start: absolute byte offset of the first byte in the file.
        nbytes: length in bytes (= prod(shape) * itemsize, checked).
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements (a Python int)."""
        return math.prod(self.shape)


def sniff(head: bytes) -> str | None:
    """Say what a file that is not safetensors looks like, from its first bytes.

    Returns a short description ("a Git LFS pointer file", "an HTML page", "a zip archive (a PyTorch
    .bin/.pt checkpoint?)", "a pickle", "a text file") or None when nothing is recognised.
    """
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer file (the real file was never downloaded)"
    stripped = head.lstrip().lower()
    if stripped.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        return "an HTML page (an error page saved instead of the file?)"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch .bin/.pt checkpoint?)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a pickle (a legacy PyTorch checkpoint?)"
    if head[:1] in (b"{", b"["):
        return "a JSON text file"
    if head and all(32 <= c < 127 or c in (9, 10, 13) for c in head[:64]):
        return "a text file"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(path: str, name: str, entry: Any) -> tuple[int, int, DType, tuple[int, ...]]:
    """One tensor entry's rules (ST-003, ST-005..ST-008); returns (begin, end, dtype, shape)."""
    if not isinstance(entry, dict):
        raise HeaderJsonError(
            "tensor entry must be an object with dtype, shape and data_offsets",
            path=path, tensor=name, expected="object", found=type(entry).__name__,
        )
    code = entry.get("dtype")
    dt = by_code(code) if isinstance(code, str) else None
    if dt is None:
        raise UnknownDtypeError(
            "unknown dtype", path=path, tensor=name,
            expected="a safetensors dtype code such as 'BF16', 'F16', 'F32', 'U8'", found=code,
        )
    shape = entry.get("shape")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):  # no bool, no float
        raise TensorShapeError(
            "shape must be a list of non-negative integers", path=path, tensor=name,
            expected="[d0, d1, ...] with integers >= 0", found=shape,
        )
    offsets = entry.get("data_offsets")
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
        or offsets[0] < 0
        or offsets[1] < offsets[0]
    ):
        raise DataOffsetsError(
            "data_offsets must be [begin, end] integers with 0 <= begin <= end", path=path, tensor=name,
            expected="[begin, end]", found=offsets,
        )
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d  # Python ints: no overflow
    want = numel * dt.itemsize
    if end - begin != want:
        raise ByteSpanError(
            f"byte span must equal prod(shape) * itemsize for {code} {shape}", path=path, tensor=name,
            expected=want, found=end - begin,
        )
    return begin, end, dt, tuple(shape)


def _parse_header(
    path: str, header_bytes: bytes, data_size: int, problems: list[ConvertBnbError] | None = None
) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Check the header against ST-003 and ST-005..ST-013; return the metadata and name ->
    :class:`TensorInfo` in data-offset order, ``start`` absolute (the data area begins at byte
    ``8 + len(header_bytes)``).

    With ``problems`` (a list), per-tensor and layout problems are appended to it and the tensors
    concerned are left out, so a caller can report every problem of a file; without, the first
    problem is raised.
    """

    def report(exc: ConvertBnbError) -> None:
        if problems is None:
            raise exc
        problems.append(exc)

    def duplicate(key: str) -> ConvertBnbError:
        return DuplicateTensorError("tensor name appears twice in the header", path=path, tensor=key,
                                    expected="each name once", found="twice")

    obj = load_json_bytes(header_bytes, jsonfile.HEADER, HeaderJsonError, "header", path=path, on_duplicate=duplicate)
    if not isinstance(obj, dict):
        raise HeaderJsonError("header must be a JSON object", path=path, expected="object",
                              found=type(obj).__name__)

    metadata: dict[str, str] = {}
    infos: list[tuple[int, int, str, DType | None, tuple[int, ...]]] = []
    unplaced = False  # a tensor whose data_offsets are unusable: gaps cannot be judged
    for name, entry in obj.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                report(MetadataError("__metadata__ must be an object mapping strings to strings", path=path,
                                     expected="{str: str}", found=_kind(entry)))
            else:
                metadata = dict(entry)
            continue
        try:
            begin, end, dt, shape = _check_entry(path, name, entry)
        except ConvertBnbError as exc:
            report(exc)
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                unplaced = True
            else:  # the span is known: keep it for the layout checks, without the tensor
                infos.append((offsets[0], offsets[1], name, None, ()))
            continue
        infos.append((begin, end, name, dt, shape))

    infos.sort(key=lambda t: (t[0], t[1]))
    cursor = 0
    claimed = 0  # the end of the spans of overlapping entries (reported, left out): no gap is theirs
    prev_name: str | None = None
    keep: list[tuple[int, int, str, DType | None, tuple[int, ...]]] = []
    for item in infos:
        begin, end, name, _dt, _shape = item
        if begin < cursor:
            report(TensorOverlapError(
                f"data overlaps tensor '{prev_name}'", path=path, tensor=name,
                expected=f"begin >= {cursor}", found=begin,
            ))
            claimed = max(claimed, end)
            continue
        if begin > cursor and not unplaced and claimed < begin:
            report(DataGapError(
                "gap in the data area before this tensor", path=path, tensor=name,
                expected=f"begin == {cursor}", found=begin,
            ))
        cursor = end
        prev_name = name
        keep.append(item)
    if cursor > data_size:
        report(TruncatedFileError(
            "file is truncated: the data area is shorter than the header says", path=path,
            expected=f"{cursor} data bytes", found=data_size,
            hint="the download or copy was cut short; fetch the file again",
        ))
    elif cursor < data_size and not unplaced:
        report(DataGapError(
            "data area has trailing bytes no tensor covers", path=path,
            expected=f"{cursor} data bytes", found=data_size,
        ))
    base = 8 + len(header_bytes)
    return metadata, {
        name: TensorInfo(name, dt, shape, base + begin, end - begin)
        for begin, end, name, dt, shape in keep
        if dt is not None and end <= data_size
    }


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        bad = [k for k, v in value.items() if not isinstance(v, str)]
        return f"non-string values for {bad[:3]}" if bad else "object"
    return type(value).__name__


@dataclass(frozen=True)
class Header:
    """A checked safetensors header (what :func:`read_header` returns).

    Attributes:
        header_size: 8 + N, the offset of the data area, in bytes.
        metadata: the ``__metadata__`` object (empty if absent).
        tensors: name -> :class:`TensorInfo`, in data-offset order; ``start`` is absolute.
    """

    header_size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]


def read_header(
    path: str, read: Callable[[int, int], bytes], size: int, problems: list[ConvertBnbError] | None = None
) -> Header:
    """Read and check the header of a safetensors file of ``size`` bytes, through ``read`` alone.

    The one header reader: :class:`SafetensorsReader` passes a local file's reads, and a caller that
    holds the file elsewhere (a Hub repo read with HTTP range requests) passes its own, so both refuse
    the same headers by the same rules.

    Args:
        path: the file's name for messages.
        read: ``read(offset, n)`` -> up to ``n`` bytes at byte ``offset`` of the file.
        size: the file's size in bytes.
        problems: as :class:`SafetensorsReader`'s.

    Returns:
        the :class:`Header`.

    Raises:
        SafetensorsError: ST-001..ST-014 (see the module docstring).
    """
    head = read(0, 8)
    if len(head) < 8:
        what = sniff(head)
        raise FileTooShortError(
            "file is shorter than the 8-byte header length", path=path,
            expected=">= 8 bytes", found=f"{size} bytes",
            hint=f"it looks like {what}" if what else "the file is empty or was cut short",
        )
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        what = sniff(read(0, min(512, size)))
        if what is not None:
            raise NotSafetensorsError(
                f"not a safetensors file: it looks like {what}", path=path,
                expected="an 8-byte header length and a JSON header", found=what.split(" (")[0],
                hint="check that the file was downloaded completely (git lfs pull, or download again)",
            )
        limit = min(size - 8, MAX_HEADER_BYTES)
        raise HeaderTooLargeError(
            "header length is larger than the file or the limit", path=path,
            expected=f"<= {limit}", found=n,
            hint="the file is damaged or cut short inside its header; download it again",
        )
    header_bytes = read(8, n)
    entries = header_bytes.count(_ENTRY_KEY)
    if entries > MAX_TENSORS:
        raise TooManyTensorsError(
            "header lists more tensors than a checkpoint file may hold", path=path,
            expected=f"at most {MAX_TENSORS:,} tensors", found=f"{entries:,} tensors",
            hint="each tensor costs memory before any data is read; re-save the model in shards",
        )
    header_size = 8 + n
    try:
        metadata, tensors = _parse_header(path, header_bytes, size - header_size, problems)
    except HeaderJsonError:
        what = sniff(head + header_bytes[:504])
        if what is not None and not header_bytes.lstrip().startswith(b"{"):
            raise NotSafetensorsError(
                f"not a safetensors file: it looks like {what}", path=path,
                expected="an 8-byte header length and a JSON header", found=what.split(" (")[0],
            ) from None
        raise
    return Header(header_size, metadata, tensors)


def byte_range(name: str, start: int, stop: int | None, nbytes: int) -> int:
    """The end of bytes [start, stop) of a tensor of ``nbytes`` bytes (``stop`` None: the end), checked.

    Raises:
        IndexError: the range is not inside the tensor (a caller's bug, not bad input).
    """
    stop = nbytes if stop is None else stop
    if not 0 <= start <= stop <= nbytes:
        raise IndexError(f"byte range [{start}, {stop}) outside tensor '{name}' of {nbytes} bytes")
    return stop


class SafetensorsReader:
    """A validated, memory-mapped safetensors file.

    The header is parsed and checked against every ST rule when the reader is created; tensor data
    is never read until a view of it is used.

    Args:
        path: the ``.safetensors`` file. Opened read-only; never modified.
        problems: when given, per-tensor and layout problems (ST-005..ST-013) are appended to it
            instead of raised, and the tensors concerned are left out of :attr:`tensors`
            (``convert-bnb check`` reports every problem). Whole-file problems are still raised.

    Attributes:
        path: the file.
        metadata: the ``__metadata__`` object (empty if absent).
        tensors: name -> :class:`TensorInfo`, in data-offset order; ``start`` is absolute.
        header_size: 8 + N, the offset of the data area.

    Raises:
        SafetensorsError: any ST-xxx rule (see the module docstring); the subclass names the rule,
            e.g. :class:`~formats.errors.TruncatedFileError` for ST-010.
        OSError: the file cannot be opened.
    """

    #: ``formats.checkpoint`` may pass a ``problems`` list (see ``convert-bnb check``).
    collects_problems = True

    def __init__(self, path: str | os.PathLike[str], problems: list[ConvertBnbError] | None = None) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size

            def read(offset: int, n: int) -> bytes:
                f.seek(offset)
                return f.read(n)

            header = read_header(os.fspath(path), read, size, problems)
        self.header_size = header.header_size
        self.file_size = size
        self.metadata = header.metadata
        self.tensors: dict[str, TensorInfo] = header.tensors
        self._mmap: InputMap | None = None

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsReader('{self.path}', {len(self.tensors)} tensors)"

    def _map(self) -> InputMap:
        if self._mmap is None:
            self._mmap = InputMap(self.path, self.file_size)
        return self._mmap

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]:
        """Zero-copy read-only view of a tensor's bytes.

        Args:
            name: tensor name.
            start, stop: byte range inside the tensor (default: all of it).

        Returns:
            ``uint8[stop - start]`` view into the file mapping.
        """
        info = self.tensors[name]
        stop = byte_range(name, start, stop, info.nbytes)
        if stop == start:
            return np.empty(0, dtype=np.uint8)
        return self._map().view(info.start + start, stop - start)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of a tensor with its dtype and shape (``BF16`` -> ml_dtypes.bfloat16)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return np.empty(info.shape, dtype=info.dtype.numpy)
        return self._map().view(info.start, info.numel, info.dtype.numpy).reshape(info.shape)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop the pages of a consumed byte range of a tensor from this process's resident set.

        Only whole pages inside the range are released; data stays readable (it is re-read from the
        page cache or disk on the next access).
        """
        if self._mmap is None:
            return
        info = self.tensors[name]
        stop = info.nbytes if stop is None else stop
        self._mmap.release(info.start + start, info.start + stop)

    def close(self) -> None:
        """Unmap the file. Views handed out before must no longer be used."""
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def build_header(
    entries: Iterable[tuple[str, DType, Sequence[int]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """Build a safetensors header for tensors laid out in the given order.

    Args:
        entries: (name, dtype, shape) per tensor, in file order.
        metadata: the ``__metadata__`` object.

    Returns:
        (the 8-byte length + padded JSON header, [(name, begin, end)] data offsets in bytes).
    """
    obj: dict[str, Any] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    spans: list[tuple[str, int, int]] = []
    cursor = 0
    for name, dt, shape in entries:
        numel = 1
        for d in shape:
            numel *= int(d)
        end = cursor + numel * dt.itemsize
        obj[name] = {"dtype": dt.code, "shape": [int(d) for d in shape], "data_offsets": [cursor, end]}
        spans.append((name, cursor, end))
        cursor = end
    text = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, spans


class SafetensorsWriter:
    """Streams tensors into a safetensors file whose header is known in advance.

    The header (from the plan) is written first; then each tensor's bytes are appended in order
    with :meth:`write`, in as many pieces as wanted. :meth:`close` checks every byte arrived.

    Args:
        path: the file to create (the caller picks a temporary name and renames it when verified).
        entries: (name, dtype, shape) per tensor, in the order they will be written.
        metadata: ``__metadata__`` (transformers wants ``{"format": "pt"}``).

    Raises:
        ValueError: more or fewer bytes than planned are written for a tensor.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Sequence[tuple[str, DType, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        header, self._spans = build_header(entries, metadata)
        with open(self.path, "xb") as f:
            f.write(header)
        self._file = FileStream(self.path, len(header))
        self._data_start = len(header)
        self._index = 0
        self._written = 0  # bytes of the current tensor
        self.nbytes = len(header) + (self._spans[-1][2] if self._spans else 0)

    def write(self, data: np.ndarray | bytes | memoryview, in_place: bool = False) -> None:
        """Append bytes of the current tensor (``in_place``: ``data`` is given up to the stream,
        :meth:`formats.writeback.FileStream.write`)."""
        payload = bytes_of(data)  # (no copy of a C-contiguous array)
        n = payload.nbytes
        if self._written == 0 and self._index < len(self._spans):
            _, begin, end = self._spans[self._index]
            if n == end - begin:  # one whole tensor: the common case, 10^5 times for many small tensors
                self._file.write(payload, in_place)
                self._index += 1
                if self._index < len(self._spans) and self._spans[self._index][1] == self._spans[self._index][2]:
                    self._skip_empty()
                return
        buf = payload
        while n:
            if self._index >= len(self._spans):
                raise ValueError(f"'{self.path}': more data written than planned")
            name, begin, end = self._spans[self._index]
            room = end - begin - self._written
            take = min(room, n)
            self._file.write(buf[:take], in_place)
            buf = buf[take:]
            n -= take
            self._written += take
            if self._written == end - begin:
                self._index += 1
                self._written = 0
        self._skip_empty()

    def offset(self, index: int) -> int:
        """The file offset of the first byte of the tensor at ``index`` in the order given (for a chunk's
        memory placed at the file's alignment: :func:`formats.writeback.aligned_empty`)."""
        return self._data_start + self._spans[index][1]

    def _skip_empty(self) -> None:
        while self._index < len(self._spans) and self._spans[self._index][1] == self._spans[self._index][2]:
            self._index += 1

    @property
    def current(self) -> str | None:
        """Name of the tensor the next byte belongs to (None when complete)."""
        self._skip_empty()
        return self._spans[self._index][0] if self._index < len(self._spans) else None

    def close(self, fsync: bool = True) -> None:
        """Flush (and fsync) the file and check that every planned byte was written."""
        self._skip_empty()
        if self._index != len(self._spans):
            self._file.abort()
            name = self._spans[self._index][0]
            raise ValueError(f"'{self.path}': tensor '{name}' incomplete when closing")
        self._file.close(fsync=fsync)

    def abort(self) -> None:
        """Close without checks (the caller removes the file)."""
        self._file.abort()

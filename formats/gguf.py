"""The GGUF container (llama.cpp's file format): a streaming writer and the check after writing.

File layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), all little-endian::

    magic "GGUF", version u32 (3), tensor count u64, key/value count u64
    key/value pairs        "{arch}.context_length" = u32, "tokenizer.ggml.tokens" = [str], ...
    tensor infos           name, n_dims u32, ne[n_dims] u64 (innermost first), GGML type u32,
                           offset u64 (from the start of the data section, multiple of 32)
    padding to 32 bytes
    data section           each tensor's bytes, padded to 32 bytes

A tensor of ``n`` elements of a GGML type of ``block`` elements per ``size``-byte block takes
``n / block * size`` bytes (:func:`tensor_nbytes`, gguf-py's ``GGML_QUANT_SIZES``).

The bytes are the ``gguf`` package's (gguf-py in llama.cpp): :class:`GGUFFileWriter` drives
``gguf.GGUFWriter`` for the header, key/value pairs and tensor infos (``write_header_to_file``,
``write_kv_data_to_file``, ``write_ti_data_to_file``) and then appends each tensor's data piece by
piece with the writer's 32-byte padding (``GGUFWriter.write_tensor_data`` wants a whole tensor in
memory). :func:`verify_gguf` re-opens the file with ``gguf.GGUFReader``.

A file can also be written as the parts ``llama-gguf-split --split`` makes of it (:func:`split_layouts`,
:class:`GGUFSplitWriter`, :func:`split_name`): the first part holds every key/value pair plus
``split.no``, ``split.tensors.count`` and ``split.count`` (in that order, as the tool leaves them), the
others only those three; each part holds its run of the tensors in file order, with offsets from its own
data section.

What goes into the file (which tensors, GGML types, metadata) is described by a
:class:`FileLayout`: the architecture name, the key/value table in write order and the tensor infos
in file order. This module only writes and checks it; deciding it (architectures, tensor names,
tokenizer, re-quantization) is conversion, done in ``convert/`` (``convert.gguf_plan``,
``convert.gguf_encode``).

The gguf package logs its notes (e.g. ``SpecialVocab``'s template warnings) through ``logging``;
importing this module gives the ``gguf`` logger a ``NullHandler``, so nothing is printed.

Rules (see docs/errors.md):

========  ======================================================================================
GGUF-008  every tensor's data is as long as its info says (:meth:`GGUFFileWriter.end_tensor`), and
          the written file re-opens with the planned architecture, metadata keys, and tensor names,
          order, GGML types, shapes and sizes, data inside the file (:func:`verify_gguf`);
          :class:`~formats.errors.GgufVerificationError`
========  ======================================================================================
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import gguf
import numpy as np
from gguf.gguf_writer import SHARD_NAME_FORMAT

from .errors import GgufVerificationError
from .writeback import FileStream

__all__ = [
    "FileLayout",
    "GGUFFileWriter",
    "GGUFPart",
    "GGUFSplitWriter",
    "TensorLayout",
    "file_nbytes",
    "split_layouts",
    "split_name",
    "tensor_nbytes",
    "verify_gguf",
]

# With no handler configured anywhere Python would print the gguf package's warnings, and the
# library never prints.
logging.getLogger("gguf").addHandler(logging.NullHandler())


class TensorLayout(Protocol):
    """One tensor info: what the header says about a tensor.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        shape: shape in elements, rows first (the header stores it reversed, innermost first).
        ggml_type: its GGML type.
        nbytes: bytes in the data section (before the 32-byte padding).
    """

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType: ...

    @property
    def nbytes(self) -> int: ...


class FileLayout(Protocol):
    """What one GGUF file holds, except the tensor data (``convert.gguf_plan.GGUFPlan`` is one).

    Attributes:
        arch_name: ``general.architecture`` (the writer adds that key first), or None for a file without
            it (the second and later parts of a split file: :class:`GGUFPart`).
        metadata: key -> (value, GGUF value type, array element type or None), in write order,
            without ``general.architecture``.
        tensors: the tensor infos in file order.
    """

    @property
    def arch_name(self) -> str | None: ...

    @property
    def metadata(self) -> Mapping[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]: ...

    @property
    def tensors(self) -> Sequence[TensorLayout]: ...


#: A key/value table: key -> (value, GGUF value type, array element type or None).
Metadata = Mapping[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]


@dataclass(frozen=True)
class GGUFPart:
    """One part of a split GGUF file (a :class:`FileLayout`).

    Attributes:
        arch_name: ``general.architecture`` in the first part, None in the others.
        metadata: the first part: the whole file's key/value pairs, then the split keys; the others: the
            split keys alone.
        tensors: this part's run of the file's tensors, in file order.
    """

    arch_name: str | None
    metadata: Metadata
    tensors: tuple[TensorLayout, ...]


def tensor_nbytes(shape: Sequence[int], qtype: gguf.GGMLQuantizationType) -> int:
    """Bytes of a tensor's data (padding excluded): elements / block size * block bytes.

    Args:
        shape: the shape in elements (Python ints: no overflow).
        qtype: the GGML type.
    """
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


#: Bytes of a GGUF scalar of each value type (strings and arrays are sized by :func:`file_nbytes`).
_SCALAR_BYTES = {
    gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.BOOL: 1,
    gguf.GGUFValueType.UINT16: 2, gguf.GGUFValueType.INT16: 2,
    gguf.GGUFValueType.UINT32: 4, gguf.GGUFValueType.INT32: 4, gguf.GGUFValueType.FLOAT32: 4,
    gguf.GGUFValueType.UINT64: 8, gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8,
}


def _meta_nbytes(layout: FileLayout) -> int:
    """Bytes of the header, key/value pairs and tensor infos of ``layout`` (GGUF v3), before the padding."""

    def value_bytes(value: Any, vtype: gguf.GGUFValueType, sub_type: gguf.GGUFValueType | None) -> int:
        if vtype == gguf.GGUFValueType.STRING:
            return 8 + len(value.encode("utf-8") if isinstance(value, str) else bytes(value))
        if vtype == gguf.GGUFValueType.ARRAY:  # the element type as gguf-py's _pack_val picks it
            if sub_type is None:
                sub_type = (gguf.GGUFValueType.UINT8 if isinstance(value, bytes)
                            else gguf.GGUFValueType.get_type(value[0]))
            if sub_type in _SCALAR_BYTES:
                return 4 + 8 + _SCALAR_BYTES[sub_type] * len(value)
            return 4 + 8 + sum(value_bytes(v, sub_type, None) for v in value)
        return _SCALAR_BYTES[vtype]

    n = 4 + 4 + 8 + 8  # magic, version, tensor count, key count
    arch = {} if layout.arch_name is None else {
        gguf.Keys.General.ARCHITECTURE: (layout.arch_name, gguf.GGUFValueType.STRING, None)}
    for key, (value, vtype, sub_type) in {**arch, **layout.metadata}.items():
        n += 8 + len(key.encode("utf-8")) + 4 + value_bytes(value, vtype, sub_type)
    for t in layout.tensors:
        n += 8 + len(t.name.encode("utf-8")) + 4 + 8 * len(t.shape) + 4 + 8
    return n


def file_nbytes(layout: FileLayout, alignment: int = 32) -> int:
    """The size in bytes of the GGUF file :class:`GGUFFileWriter` writes for ``layout`` (GGUF v3: the header,
    the keys and values, the tensor infos, padding to ``alignment``, each tensor's data padded to it), for
    the disk pre-flight; computed from the layout, nothing is written."""
    return gguf.GGUFWriter.ggml_pad(_meta_nbytes(layout), alignment) + sum(
        gguf.GGUFWriter.ggml_pad(t.nbytes, alignment) for t in layout.tensors)


def split_name(prefix: str, index: int, count: int) -> str:
    """The file name of part ``index`` (0-based) of ``count``: ``PREFIX-00001-of-00003.gguf``, as llama.cpp's
    ``llama_split_path`` names it (gguf-py's ``SHARD_NAME_FORMAT``)."""
    return SHARD_NAME_FORMAT.format(prefix, index + 1, count)


def split_files(out: Path) -> list[Path]:
    """The existing files beside ``out`` that are parts of a split of it, whatever their count
    (``PREFIX-00002-of-00004.gguf``, :func:`split_name`; the prefix is ``out`` without a ``.gguf`` suffix), sorted."""
    prefix = out.name[: -len(".gguf")] if out.name.lower().endswith(".gguf") else out.name
    pattern = re.compile(re.escape(prefix) + r"-[0-9]{5}-of-[0-9]{5}\.gguf")
    try:
        return sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name))
    except FileNotFoundError:
        return []


def split_layouts(layout: FileLayout, counts: Sequence[int]) -> list[GGUFPart]:
    """``layout`` as the parts ``llama-gguf-split --split`` writes, with ``counts[i]`` tensors in part ``i``.

    Every part gets ``split.no`` (u16, from 0), ``split.tensors.count`` (i32, the file's tensors) and
    ``split.count`` (u16, the parts) in that order (the tool sets ``split.count`` again once it knows it,
    which moves the key last); the first part has the whole file's pairs before them (``gguf_set_kv``).

    Args:
        layout: the whole file.
        counts: tensors per part, each at least 1, summing to the file's tensors.

    Raises:
        ValueError: ``counts`` does not fit the file (a part without tensors, another total, more than
            65535 parts: ``split.count`` is 16 bits).
    """
    tensors = tuple(layout.tensors)
    if any(c < 1 for c in counts) or sum(counts) != len(tensors) or len(counts) > 0xFFFF:
        raise ValueError(f"{len(counts)} parts of {list(counts)[:8]} tensors do not split {len(tensors)} tensors")
    u16, i32 = gguf.GGUFValueType.UINT16, gguf.GGUFValueType.INT32
    parts: list[GGUFPart] = []
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    for i, (start, count) in enumerate(zip(starts, counts, strict=True)):
        keys: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = dict(
            layout.metadata) if i == 0 else {}
        keys[gguf.Keys.Split.LLM_KV_SPLIT_NO] = (i, u16, None)
        keys[gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT] = (len(tensors), i32, None)
        keys[gguf.Keys.Split.LLM_KV_SPLIT_COUNT] = (len(counts), u16, None)
        parts.append(GGUFPart(layout.arch_name if i == 0 else None, keys, tensors[start:start + count]))
    return parts


class GGUFFileWriter:
    """Writes one GGUF file: everything but the tensor data at once, then the data tensor by tensor.

    Opening writes the header, the key/value pairs and the tensor infos of ``layout`` and pads to
    32 bytes. Then, for each tensor in ``layout.tensors`` order, :meth:`write` appends its bytes in
    as many pieces as the caller likes and :meth:`end_tensor` checks the count and pads. Use it as a
    context manager (or call :meth:`close`).

    Args:
        path: the file to create or overwrite.
        layout: the architecture, metadata and tensor infos.

    Raises:
        OSError: the file cannot be created or written.
    """

    def __init__(self, path: str | os.PathLike[str], layout: FileLayout) -> None:
        self.path = os.fspath(path)
        self._tensors = list(layout.tensors)
        self._index = 0
        self._written = 0
        self._w = gguf.GGUFWriter(path=None, arch=layout.arch_name or "")
        if layout.arch_name is None:  # (a later part of a split file: the key is the first part's)
            self._w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
        for key, (value, vtype, sub_type) in layout.metadata.items():
            self._w.add_key_value(key, value, vtype, sub_type)
        for t in self._tensors:
            self._w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
        try:
            self._w.write_header_to_file(path=Path(path))
            self._w.write_kv_data_to_file()
            self._w.write_ti_data_to_file()
            assert self._w.fout is not None
            fout = self._w.fout[0]
            self._w.write_padding(fout, fout.tell())
            start = fout.tell()
        finally:
            self._w.close()  # (gguf-py's file: the data goes through the stream)
        self._alignment = self._w.data_alignment
        padded = (gguf.GGUFWriter.ggml_pad(t.nbytes, self._alignment) for t in self._tensors)
        self._offsets = list(itertools.accumulate(padded, initial=start))  # each tensor's data, then the end
        self._out = FileStream(self.path, start)

    def offset(self, index: int) -> int:
        """The file offset of the data of the tensor at ``index`` in ``layout.tensors`` (for a chunk's memory
        placed at the file's alignment: :func:`formats.writeback.aligned_empty`)."""
        return self._offsets[index]

    def write(self, data: np.ndarray, in_place: bool = False) -> int:
        """Append bytes of the current tensor.

        Args:
            data: any contiguous-able array; its bytes are written as they lie in memory
                (little-endian on the platforms gguf supports).
            in_place: ``data`` is given up to the stream (:meth:`formats.writeback.FileStream.write`).

        Returns:
            The number of bytes written (``data.nbytes``).
        """
        n = self._out.write(data, in_place)
        self._written += n
        return n

    def end_tensor(self) -> None:
        """Finish the current tensor: check its byte count against its info, pad to 32 bytes.

        Raises:
            GgufVerificationError: GGUF-008 (the bytes written differ from the info's ``nbytes``).
        """
        t = self._tensors[self._index]
        if self._written != t.nbytes:
            raise GgufVerificationError(
                "tensor byte count differs from the plan",
                path=self.path,
                tensor=t.name,
                expected=t.nbytes,
                found=self._written,
                action="write",
            )
        self._out.write(bytes(gguf.GGUFWriter.ggml_pad(t.nbytes, self._alignment) - t.nbytes))
        self._index += 1
        self._written = 0

    def close(self) -> None:
        """Write what is buffered, fsync and close the file.

        Raises:
            OSError: a write failed (the file is closed; the caller removes it).
        """
        self._out.close()

    def abort(self) -> None:
        """Close without writing what is buffered (after an error; the caller removes the file)."""
        self._out.abort()

    def __enter__(self) -> GGUFFileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class GGUFSplitWriter:
    """Writes the parts of a split GGUF file one after the other, through :class:`GGUFFileWriter`, with its
    interface: :meth:`offset` and :meth:`write` / :meth:`end_tensor` for the whole file's tensors in order.

    A part is created when its first tensor's turn comes, and closed (fsynced) at its last tensor's end,
    so one part is open at a time.

    Args:
        parts: ``(path, layout)`` of each part, in order (:func:`split_layouts`).
        alignment: the data alignment (GGUF's default, 32, as the parts carry no ``general.alignment``).

    Raises:
        OSError: a part cannot be created or written.
    """

    def __init__(self, parts: Sequence[tuple[str | os.PathLike[str], FileLayout]], alignment: int = 32) -> None:
        self._parts = [(os.fspath(p), layout) for p, layout in parts]
        self._where: list[tuple[int, int]] = []  # the whole file's tensor i -> (part, index in the part)
        self._offsets: list[int] = []  # tensor i's data offset in its part's file
        for k, (_, layout) in enumerate(self._parts):
            start = gguf.GGUFWriter.ggml_pad(_meta_nbytes(layout), alignment)
            padded = [gguf.GGUFWriter.ggml_pad(t.nbytes, alignment) for t in layout.tensors]
            self._offsets += itertools.accumulate(padded[:-1], initial=start)
            self._where += [(k, j) for j in range(len(layout.tensors))]
        self._index = 0
        self._out: GGUFFileWriter | None = None

    def offset(self, index: int) -> int:
        """The offset of the data of the whole file's tensor ``index`` in its part's file."""
        return self._offsets[index]

    def _current(self) -> GGUFFileWriter:
        if self._out is None:
            self._out = GGUFFileWriter(*self._parts[self._where[self._index][0]])
        return self._out

    def write(self, data: np.ndarray, in_place: bool = False) -> int:
        """Append bytes of the current tensor to its part (:meth:`GGUFFileWriter.write`)."""
        return self._current().write(data, in_place)

    def end_tensor(self) -> None:
        """Finish the current tensor (:meth:`GGUFFileWriter.end_tensor`); after its part's last tensor, close
        the part (fsynced).

        Raises:
            GgufVerificationError: GGUF-008 (the bytes written differ from the info's ``nbytes``).
        """
        out = self._current()
        out.end_tensor()
        part, j = self._where[self._index]
        self._index += 1
        if j == len(self._parts[part][1].tensors) - 1:
            self._out = None
            out.close()

    def close(self) -> None:
        """Close the part still open (none once every tensor has ended)."""
        if self._out is not None:
            out, self._out = self._out, None
            out.close()

    def abort(self) -> None:
        """Close the part still open without writing what is buffered (after an error)."""
        if self._out is not None:
            out, self._out = self._out, None
            out.abort()

    def __enter__(self) -> GGUFSplitWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def verify_gguf(path: str | os.PathLike[str], plan: FileLayout) -> None:
    """Re-open a written GGUF with ``gguf.GGUFReader`` and check it against the plan.

    Checks the architecture, every metadata key, and per tensor: name, order, GGML type, shape,
    byte count and that its data lies inside the file.

    Args:
        path: the written file.
        plan: what it should hold (the conversion's ``GGUFPlan``).

    Raises:
        GgufVerificationError: GGUF-008, naming the first difference.
    """
    spath = os.fspath(path)

    def fail(what: str, expected: Any, found: Any, tensor: str | None = None) -> GgufVerificationError:
        return GgufVerificationError(what, path=spath, tensor=tensor, expected=expected, found=found, action="verify")

    try:
        reader = gguf.GGUFReader(spath, "r")
    except (ValueError, IndexError, OSError) as e:  # GGUFReader indexes past a truncated file
        raise fail(f"the file does not parse as GGUF ({e})", "a GGUF file", "unreadable") from None
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents() if arch_field is not None else None
    if arch != plan.arch_name:
        raise fail("general.architecture differs", plan.arch_name, arch)
    missing = [k for k in plan.metadata if reader.get_field(k) is None]
    if missing:
        raise fail("metadata keys missing", "every planned key", ", ".join(missing))
    if len(reader.tensors) != len(plan.tensors):
        raise fail("tensor count differs", len(plan.tensors), len(reader.tensors))
    size = os.path.getsize(spath)
    for t, rt in zip(plan.tensors, reader.tensors, strict=True):
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        if rt.name != t.name:
            raise fail("tensor order differs", t.name, rt.name)
        if rt.tensor_type != t.ggml_type:
            raise fail("GGML type differs", t.ggml_type.name, getattr(rt.tensor_type, "name", rt.tensor_type), t.name)
        if shape != t.shape or int(rt.n_bytes) != t.nbytes:
            raise fail(
                "shape or size differs",
                f"{list(t.shape)} ({t.nbytes} bytes)",
                f"{list(shape)} ({int(rt.n_bytes)} bytes)",
                t.name,
            )
        if int(rt.data_offset) + t.nbytes > size:
            raise fail(
                "tensor data runs past the end of the file",
                f"<= {size}",
                int(rt.data_offset) + t.nbytes,
                t.name,
            )

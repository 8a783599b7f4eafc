"""Write torch.save-format files without torch, for tests.

A tiny pickle emitter (protocol 2 opcodes, the ones torch.save uses) so tests can build exactly the
pickles they need: state dicts with tensors, legacy list QuantStates, pickled QuantState objects, and
hostile globals. Not part of the library.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

STORAGE_OF = {
    np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage",
    np.dtype(ml_dtypes.bfloat16): "BFloat16Storage", np.dtype(np.uint8): "ByteStorage",
    np.dtype(np.int8): "CharStorage", np.dtype(np.int64): "LongStorage", np.dtype(np.int32): "IntStorage",
    np.dtype(np.float64): "DoubleStorage", np.dtype(np.bool_): "BoolStorage",
}


@dataclass
class Global:
    module: str
    name: str


@dataclass
class Reduce:
    func: Any
    args: tuple


@dataclass
class NewObj:
    """NEWOBJ cls() then BUILD state (how protocol 2 pickles a plain class instance)."""

    cls: Global
    state: dict


@dataclass
class Tensor:
    """A tensor over a storage: ``array`` is the storage content; view with offset/shape/stride."""

    array: np.ndarray
    shape: tuple | None = None
    stride: tuple | None = None
    offset: int = 0
    key: str | None = None


def dtype_global(name: str) -> Global:
    return Global("torch", name)


def size(*dims: int) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(dims),))


class Emitter:
    def __init__(self, legacy: bool = False) -> None:
        self.out = io.BytesIO()
        self.storages: dict[str, np.ndarray] = {}
        self.legacy = legacy
        self._ids: dict[int, str] = {}

    def emit(self, obj: Any) -> None:
        w = self.out.write
        if obj is None:
            w(b"N")
        elif obj is True:
            w(b"\x88")
        elif obj is False:
            w(b"\x89")
        elif isinstance(obj, int):
            if -(2**31) <= obj < 2**31:
                w(b"J" + struct.pack("<i", obj))
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                w(b"\x8a" + bytes([len(raw)]) + raw)
        elif isinstance(obj, float):
            w(b"G" + struct.pack(">d", obj))
        elif isinstance(obj, str):
            data = obj.encode("utf-8", "surrogatepass")  # as pickle writes a lone surrogate
            w(b"X" + struct.pack("<I", len(data)) + data)
        elif isinstance(obj, tuple):
            w(b"(")
            for x in obj:
                self.emit(x)
            w(b"t")
        elif isinstance(obj, list):
            w(b"]")
            if obj:
                w(b"(")
                for x in obj:
                    self.emit(x)
                w(b"e")
        elif isinstance(obj, dict):
            w(b"}")
            if obj:
                w(b"(")
                for k, v in obj.items():
                    self.emit(k)
                    self.emit(v)
                w(b"u")
        elif isinstance(obj, Global):
            w(b"c" + obj.module.encode() + b"\n" + obj.name.encode() + b"\n")
        elif isinstance(obj, Reduce):
            self.emit(obj.func)
            self.emit(tuple(obj.args))
            w(b"R")
        elif isinstance(obj, NewObj):
            self.emit(obj.cls)
            self.emit(())
            w(b"\x81")
            self.emit(obj.state)
            w(b"b")
        elif isinstance(obj, Tensor):
            self.emit_tensor(obj)
        else:
            raise TypeError(type(obj))

    def emit_tensor(self, t: Tensor) -> None:
        arr = np.array(t.array, order="C")  # keeps 0-dim tensors 0-dim
        key = t.key if t.key is not None else self._ids.setdefault(id(t.array), str(len(self._ids)))
        self.storages[key] = arr
        shape = t.shape if t.shape is not None else arr.shape
        if t.stride is not None:
            stride = t.stride
        else:
            stride, acc = [], 1
            for d in reversed(shape):
                stride.insert(0, acc)
                acc *= d
            stride = tuple(stride)
        stype = Global("torch", STORAGE_OF[arr.dtype])
        pid = ("storage", stype, key, "cpu", arr.size) + ((None,) if self.legacy else ())
        self.emit(Global("torch._utils", "_rebuild_tensor_v2"))
        w = self.out.write
        w(b"(")
        self.emit(pid)
        w(b"Q")
        self.emit(t.offset)
        self.emit(tuple(shape))
        self.emit(tuple(stride))
        self.emit(False)
        self.emit(Reduce(Global("collections", "OrderedDict"), ()))
        w(b"t")
        w(b"R")

    def dumps(self, obj: Any) -> bytes:
        self.out.write(b"\x80\x02")
        self.emit(obj)
        self.out.write(b".")
        return self.out.getvalue()


def save_zip(path: Path, obj: Any, archive: str = "archive", byteorder: bytes = b"little",
             compress_data: bool = False) -> Path:
    """Write ``obj`` like torch.save (zip layout)."""
    em = Emitter()
    data = em.dumps(obj)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{archive}/data.pkl", data)
        zf.writestr(f"{archive}/byteorder", byteorder)
        for key, arr in sorted(em.storages.items()):
            zf.writestr(f"{archive}/data/{key}", arr.tobytes(),
                        compress_type=zipfile.ZIP_DEFLATED if compress_data else zipfile.ZIP_STORED)
        zf.writestr(f"{archive}/version", b"3\n")
    return path


def save_zip_raw_pickle(path: Path, pickle_bytes: bytes, archive: str = "archive") -> Path:
    """A torch zip whose data.pkl is the given bytes (e.g. a hostile pickle)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{archive}/data.pkl", pickle_bytes)
        zf.writestr(f"{archive}/byteorder", b"little")
        zf.writestr(f"{archive}/version", b"3\n")
    return path


def save_legacy(path: Path, obj: Any) -> Path:
    """Write ``obj`` like torch.save(..., _use_new_zipfile_serialization=False)."""
    em = Emitter(legacy=True)
    main = em.dumps(obj)
    with open(path, "wb") as f:
        f.write(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
        f.write(pickle.dumps(1001, protocol=2))
        f.write(pickle.dumps({"protocol_version": 1001, "little_endian": True,
                              "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2))
        f.write(main)
        keys = list(em.storages)
        f.write(pickle.dumps(keys, protocol=2))
        for k in keys:
            arr = em.storages[k]
            f.write(struct.pack("<q", arr.size))
            f.write(arr.tobytes())
    return path


# ---------------------------------------------------------------------------------- hostile pickles
# Raw opcodes, each a class of input an independent fuzzer found to crash, hang or eat memory before
# the reader had its own bounded pickle machine (issue 12). Protocol 2 opcodes throughout.

LEGACY_MAGIC_PICKLE = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
LEGACY_HEADER = (LEGACY_MAGIC_PICKLE + pickle.dumps(1001, protocol=2)
                 + pickle.dumps({"protocol_version": 1001, "little_endian": True,
                                 "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2))


def _u(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def tensor_with_numel(numel_opcodes: bytes) -> bytes:
    """A state dict {'w': tensor} whose storage's element count is the given raw opcodes."""
    pid = b"(" + _u("storage") + b"ctorch\nFloatStorage\n" + _u("0") + _u("cpu") + numel_opcodes + b"tQ"
    return (b"\x80\x02}(" + _u("w") + b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid
            + b"K\x00K\x18\x85K\x01\x85\x89tRu.")


def huge_long4(value: int = 10**5000) -> bytes:
    """LONG4 opcode of ``value`` (10**5000 is 2077 bytes)."""
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8b" + struct.pack("<i", len(raw)) + raw


def shared_tuples(levels: int) -> bytes:
    """Opcodes leaving t_levels on the stack: t0 = (1,), t_i = (t_{i-1}, t_{i-1}) through the memo, so
    t_levels has 2**levels leaves in 2 * levels + 1 opcodes (exponential to hash, compare or repr)."""
    out = b"K\x01\x85r" + struct.pack("<I", 0)
    for i in range(1, levels + 1):
        get = b"j" + struct.pack("<I", i - 1)
        out += b"0" + get + get + b"\x86r" + struct.pack("<I", i)
    return out


def shared_tuple_key(levels: int = 60) -> bytes:
    """A state dict whose one key is a tuple shared 2**levels ways."""
    return b"\x80\x02}" + shared_tuples(levels) + b"K\x02s."


def shared_tuple_set(levels: int = 60) -> bytes:
    """{'s': builtins.set([t_levels])}: the tuple would be hashed as a set member."""
    return (b"\x80\x02}" + _u("s") + b"cbuiltins\nset\n" + b"]" + shared_tuples(levels) + b"a\x85Rs.")


def shared_tuple_pid(levels: int = 60) -> bytes:
    """A state dict whose value is a persistent id shared 2**levels ways (its repr would be exponential)."""
    return b"\x80\x02}" + _u("w") + shared_tuples(levels) + b"Qs."


def nested_lists(depth: int) -> bytes:
    """A pickle of a list nested ``depth`` deep: [[[...]]], built by appending each list to the one before."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def nested_marks(depth: int) -> bytes:
    """``depth`` MARKs, each opening a tuple: ((((...)))), nested on the machine's mark stack."""
    return b"\x80\x02" + b"(" * depth + b"t" * depth + b"."


def deep_by_mutation(depth: int) -> bytes:
    """{'x': L_0} where L_i holds L_{i+1}, made by appending to each list after it was placed in the one
    before, so no container is ever deeper than 2 when it is placed; only the walk sees the depth."""
    out = b"\x80\x02}" + _u("x") + b"]r" + struct.pack("<I", 0)
    for i in range(1, depth):
        out += b"]r" + struct.pack("<I", i) + b"0j" + struct.pack("<I", i - 1) + b"j" + struct.pack("<I", i) + b"a0"
    return out + b"s."


def save_legacy_raw(path: Path, obj_pickle: bytes, header: bytes = LEGACY_HEADER) -> Path:
    """A legacy-layout file: the three header pickles, ``obj_pickle``, an empty storage key list."""
    path.write_bytes(header + obj_pickle + pickle.dumps([], protocol=2))
    return path


def save_zip_deflated_pickle(path: Path, nbytes: int, archive: str = "archive") -> Path:
    """A torch zip whose data.pkl is ``nbytes`` of pickle (NONE/POP pairs), deflated: a small file that
    inflates to ``nbytes``. Written in chunks, so the test itself stays small in memory."""
    info = zipfile.ZipInfo(f"{archive}/data.pkl")
    info.compress_type = zipfile.ZIP_DEFLATED
    chunk = b"N0" * (1 << 19)
    with zipfile.ZipFile(path, "w") as zf:
        with zf.open(info, "w", force_zip64=nbytes > 0x7FFFFFFF) as w:
            w.write(b"\x80\x02")
            left = nbytes - 4
            while left > 0:
                w.write(chunk[:left])
                left -= len(chunk)
            w.write(b"N.")
        zf.writestr(f"{archive}/byteorder", b"little")
    return path

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
            data = obj.encode("utf-8")
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

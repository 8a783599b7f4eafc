"""PyTorch checkpoints (``pytorch_model.bin``, ``.pt``, ``.pth``) read without torch and without running code.

Two layouts are read, both written by ``torch.save``:

**Zip** (torch >= 1.6, the default; matches ``torch.serialization._load``)::

    <archive>/data.pkl          the pickled object; tensors appear as
                                torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
                                                                requires_grad, backward_hooks[, metadata])
                                with each storage a persistent id
                                ('storage', torch.<Type>Storage, key, location, numel)
    <archive>/data/<key>        the storage's bytes, little-endian, stored uncompressed (numel elements)
    <archive>/byteorder         b"little" (absent in old files: little is assumed)
    <archive>/version, .format_version, .storage_alignment, .data/serialization_id   (ignored)

A member's bytes start after its zip *local* file header:
``header_offset + 30 + len(file name) + len(local extra field)`` (torch pads the local extra field so
data is 64-byte aligned); they are memory-mapped from there, so reading is zero-copy as for
safetensors.

**Legacy** (torch 0.4 .. 1.5, ``_use_new_zipfile_serialization=False``; matches ``_legacy_load``)::

    pickle(MAGIC_NUMBER = 0x1950a86a20f9469cfc6c) pickle(1001) pickle(sys_info)
    pickle(obj)                 storages as ('storage', type, root_key, location, numel, view_metadata)
    pickle([root_key, ...])     the order of the raw storages that follow
    per storage: int64 little-endian element count, then count * itemsize bytes

(The older tar layout of torch < 0.4 is refused.)

Safety: the pickle is read by :class:`pickle.Unpickler` whose ``find_class`` is the only way a pickle
can reach a Python callable. Ours never imports anything: it maps a short allow-list of names to
stand-ins defined here (which only build plain data) and raises :class:`~formats.errors.UnsafePickleError`
naming the global for everything else (``os.system``, ``builtins.eval``, ``subprocess.Popen``, ...).

Allowed globals: ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_tensor`` / ``_rebuild_parameter``,
``torch.<Type>Storage`` / ``torch.cuda.<Type>Storage`` / ``torch.UntypedStorage``, torch dtypes
(``torch.bfloat16``, ... as :class:`TorchDType`), ``torch.Size``, ``torch.device``,
``collections.OrderedDict``, ``_codecs.encode`` (latin-1 only: how protocol 2 spells ``bytes``),
``builtins.set`` / ``frozenset``, and ``bitsandbytes.functional.QuantState`` (kept as a
:class:`PickledObject` holding its attribute dict; never instantiated).

The unpickled object must be a dict (a state dict). Nested dicts are flattened with ``.``. Tensors go to
:attr:`TorchPickleReader.tensors`; every other value (ints, strings, lists such as a legacy list
QuantState, QuantState objects) goes to :attr:`TorchPickleReader.values`, with each tensor inside it
replaced by a :class:`TensorRef` and listed in ``tensors`` under its path (``P.quant_state.0``,
``P.quant_state.4.1.0``, ...).

Rules, each with its own subclass of :class:`~formats.errors.TorchPickleError` (PT-003:
``UnsafePickleError``; see docs/errors.md):

=======  ==========================================================================================
PT-001   the file is a torch zip archive (one directory holding data.pkl) or a legacy torch pickle
PT-002   data.pkl is at most MAX_PICKLE_BYTES
PT-003   every global the pickle names is on the allow-list
PT-004   the pickle is well formed: opcodes, persistent ids, rebuild arguments of the right types
PT-005   every storage record exists, is stored uncompressed, lies inside the file and holds
         numel * itemsize bytes
PT-006   every tensor's view (offset, size, stride) lies inside its storage
PT-007   a tensor is row-major contiguous (small non-contiguous views are copied; large ones refused)
PT-008   the byte order is little-endian
PT-009   the top-level object is a dict with string keys; names are unique
=======  ==========================================================================================
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
import pickle
import pickletools
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from .dtypes import BY_NAME, DType
from .errors import (
    ByteOrderError,
    ConvertBnbError,
    MalformedPickleError,
    NonContiguousTensorError,
    NotStateDictError,
    NotTorchCheckpointError,
    PickleTooLargeError,
    StorageRecordError,
    TensorViewError,
    TorchPickleError,
    UnsafePickleError,
)

__all__ = [
    "ALLOWED_GLOBALS",
    "MAX_COPY_BYTES",
    "MAX_PICKLE_BYTES",
    "PickledObject",
    "PickledTensor",
    "TensorRef",
    "TorchDType",
    "TorchPickleReader",
]

#: Largest data.pkl accepted, in bytes (a 70B-parameter state dict's pickle is about 1 MB).
MAX_PICKLE_BYTES = 256 * 1024 * 1024
#: What :mod:`zipfile` raises on a damaged archive: besides BadZipFile, NotImplementedError for a
#: "version needed" or compression method it lacks and RuntimeError for an "encrypted" flag (a flipped bit).
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError)
#: Largest non-contiguous tensor copied into memory, in bytes; larger ones are refused (PT-007).
MAX_COPY_BYTES = 64 * 1024 * 1024
#: Most containers and scalars walked in the non-tensor values (a pickle can share one list many
#: times over, which would otherwise expand exponentially).
MAX_VALUE_NODES = 1_000_000
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
_PAGE = mmap.PAGESIZE
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature .. name length, extra length (30 bytes)


# ---------------------------------------------------------------------------------------------------
# Stand-ins handed to the pickle. None of them imports, opens or calls anything outside this module.


class TorchDType(str):
    """A torch dtype read from a pickle, as its torch spelling (``"torch.bfloat16"``).

    A ``str`` so QuantState parsing can take it like a JSON dtype; :attr:`dtype` is the table row.
    """

    __slots__ = ()

    @property
    def dtype(self) -> DType:
        """The dtype table row."""
        return BY_NAME[self[len("torch."):]]


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a non-tensor value; ``name`` is its key in :attr:`TorchPickleReader.tensors`."""

    name: str


@dataclass(frozen=True)
class PickledObject:
    """An allowed class instance (bnb ``QuantState``), kept as data and never instantiated.

    Attributes:
        cls: ``"module.name"`` of the class the pickle names.
        state: its attribute dict, tensors replaced by :class:`TensorRef`.
    """

    cls: str
    state: dict[str, Any]


class _Refused(Exception):
    pass


class _NoBuild:
    """Stand-ins the pickle may not modify: BUILD (``__setstate__``) is refused."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Refused(f"BUILD on {type(self).__name__.lstrip('_')} is not allowed")


@dataclass(frozen=True)
class _StorageType(_NoBuild):
    dtype: DType
    name: str

    def __call__(self, *args: Any, **kw: Any) -> Any:
        raise _Refused(f"calling storage type {self.name}")


@dataclass
class _Storage(_NoBuild):
    key: str
    dtype: DType
    numel: int  # elements of dtype
    elem_offset: int = 0  # legacy views into a root storage
    root_key: str = ""


@dataclass
class _Tensor(_NoBuild):
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Object:
    """NEWOBJ + BUILD target for an allowed class; records the state dict only."""

    _cls_name = ""
    state: dict[str, Any]

    def __new__(cls, *args: Any, **kw: Any) -> _Object:
        self = super().__new__(cls)
        self.state = {}
        return self

    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slotstate)
        if not isinstance(state, dict):
            raise _Refused(f"state of {self._cls_name} is a {type(state).__name__}, not a dict")
        self.state = dict(state)


def _object_class(full_name: str) -> type:
    return type("QuantStateStandIn", (_Object,), {"_cls_name": full_name, "__slots__": ()})


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Refused(f"{what} must be an integer, got {type(v).__name__}")
    return v


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)):
        raise _Refused(f"{what} must be a tuple of integers, got {type(v).__name__}")
    return tuple(_int(x, what) for x in v)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise _Refused(f"tensor storage must come from a persistent id, got {type(storage).__name__}")
    if len(rest) > 3:
        raise _Refused(f"_rebuild_tensor_v2 takes at most 7 arguments, got {4 + len(rest)}")
    size_t = _int_tuple(size, "tensor size")
    stride_t = _int_tuple(stride, "tensor stride")
    if len(size_t) != len(stride_t):
        raise _Refused(f"size {list(size_t)} and stride {list(stride_t)} differ in length")
    return _Tensor(storage, _int(storage_offset, "storage offset"), size_t, stride_t)


def _rebuild_parameter(data: Any, *rest: Any) -> _Tensor:
    if not isinstance(data, _Tensor):
        raise _Refused(f"parameter data must be a tensor, got {type(data).__name__}")
    return data


def _torch_size(values: Any = ()) -> tuple[int, ...]:
    return _int_tuple(values, "torch.Size")


def _torch_device(*args: Any) -> str:
    if not args or not all(isinstance(a, (str, int)) for a in args):
        raise _Refused("torch.device takes a string (and an index)")
    return ":".join(str(a) for a in args)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused("_codecs.encode is allowed only as encode(str, 'latin1') (protocol 2 bytes)")
    return text.encode("latin-1")


def _plain_set(items: Any = ()) -> set[Any]:
    if not isinstance(items, (list, tuple)):
        raise _Refused("set() takes a list")
    return set(items)


def _plain_frozenset(items: Any = ()) -> frozenset[Any]:
    if not isinstance(items, (list, tuple)):
        raise _Refused("frozenset() takes a list")
    return frozenset(items)


_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "UntypedStorage": "uint8",
    "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2",
    "UInt16Storage": "uint16", "UInt32Storage": "uint32", "UInt64Storage": "uint64",
}
_TORCH_DTYPES = {
    "float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int8": "int8", "uint8": "uint8",
    "int16": "int16", "short": "int16", "int32": "int32", "int": "int32", "int64": "int64",
    "long": "int64", "bool": "bool", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}
_QUANT_STATE_CLASSES = ("bitsandbytes.functional.QuantState",)


def _build_allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch", "Size"): _torch_size,
        ("torch", "device"): _torch_device,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("_codecs", "encode"): _codecs_encode,
        ("builtins", "set"): _plain_set,
        ("builtins", "frozenset"): _plain_frozenset,
    }
    for sname, dname in _STORAGE_DTYPES.items():
        st = _StorageType(BY_NAME[dname], sname)
        allowed[("torch", sname)] = st
        if sname != "UntypedStorage":
            allowed[("torch.cuda", sname)] = st
    for tname, dname in _TORCH_DTYPES.items():
        allowed[("torch", tname)] = TorchDType("torch." + dname)
    for full in _QUANT_STATE_CLASSES:
        mod, _, name = full.rpartition(".")
        allowed[(mod, name)] = _object_class(full)
    return allowed


#: (module, name) -> the stand-in a pickle gets for it. Everything else is refused (PT-003).
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _build_allowed()


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, path: str, storage_for: Any) -> None:
        super().__init__(file, encoding="utf-8")
        self._path = path
        self._storage_for = storage_for

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - the only door to callables
        stand_in = ALLOWED_GLOBALS.get((module, name))
        if stand_in is None:
            raise UnsafePickleError(
                "pickle names a global outside the allow-list; nothing was imported or run",
                path=self._path,
                expected="torch tensor/storage/dtype globals, OrderedDict, plain containers",
                found=f"{module}.{name}",
                hint="only state dicts of tensors are read; convert trusted files with torch "
                     "to safetensors first if you need more",
            )
        return stand_in

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102
        return self._storage_for(pid)


# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PickledTensor:
    """One tensor of a torch checkpoint.

    Attributes:
        name: its key (nested dict keys joined by ``.``; list items by index).
        dtype: its row of the dtype table.
        shape: dimensions in elements.
        nbytes: bytes of the tensor in row-major order (= prod(shape) * itemsize).
        start: absolute file offset of its first element (contiguous tensors).
        storage: the storage key (zip record ``data/<key>``).
        stride: strides in elements, as pickled.
        contiguous: row-major contiguous (else it is served from an in-memory copy).
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    start: int
    storage: str
    stride: tuple[int, ...] = field(default=())
    contiguous: bool = True

    @property
    def numel(self) -> int:
        """Number of elements (a Python int)."""
        return math.prod(self.shape)


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for d, s in zip(reversed(shape), reversed(stride), strict=True):
        if d == 0:
            return True
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


class TorchPickleReader:
    """A torch checkpoint read with a restricted unpickler; tensor data memory-mapped, zero-copy.

    Implements the same interface as :class:`~formats.safetensors.SafetensorsReader`.

    Args:
        path: a ``.bin`` / ``.pt`` / ``.pth`` file written by ``torch.save``. Opened read-only.

    Attributes:
        path: the file.
        tensors: name -> :class:`PickledTensor`, in pickle order.
        values: name -> every non-tensor value (Python scalars, strings, lists, tuples,
            :class:`TorchDType`, :class:`PickledObject`), tensors inside them as :class:`TensorRef`.
        value_tensors: names in ``tensors`` that live inside a value (not top-level keys).
        layout: ``"zip"`` or ``"legacy"``.

    Raises:
        TorchPickleError: a PT-xxx rule (see the module docstring).
        UnsafePickleError: the pickle names a global outside the allow-list (PT-003).
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._spath = os.fspath(path)
        self._mmap: mmap.mmap | None = None
        self._copies: dict[str, npt.NDArray[np.uint8]] = {}
        self.tensors: dict[str, PickledTensor] = {}
        self.values: dict[str, Any] = {}
        self.value_tensors: set[str] = set()
        self._storages: dict[str, _Storage] = {}
        self._storage_start: dict[str, int] = {}  # root key -> absolute offset of element 0
        self._storage_bytes: dict[str, int] = {}  # root key -> bytes available
        self.file_size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(512)
            f.seek(0)
            if head.startswith(b"PK\x03\x04"):
                self.layout = "zip"
                obj = self._load_zip(f)
            elif head[:1] == b"\x80":
                self.layout = "legacy"
                obj = self._load_legacy(f)
            elif len(head) > 262 and head[257:262] == b"ustar":
                raise self._fail(NotTorchCheckpointError, "tar-format torch checkpoint (torch < 0.4) is not supported",
                                 hint="re-save it with a current torch, or convert it to safetensors")
            else:
                raise self._fail(NotTorchCheckpointError, "not a PyTorch checkpoint",
                                 expected="a zip archive (PK\\x03\\x04) or a pickle (\\x80)",
                                 found=repr(head[:8]))
        self._collect(obj)

    # ----------------------------------------------------------------------------------- loading

    def _fail(
        self, cls: type[TorchPickleError], message: str, tensor: str | None = None, **kw: Any
    ) -> TorchPickleError:
        return cls(message, path=self._spath, tensor=tensor, **kw)

    def _unpickle(self, f: BinaryIO, storage_for: Any) -> Any:
        unpickler = _RestrictedUnpickler(f, self._spath, storage_for)
        try:
            return unpickler.load()
        except ConvertBnbError:
            raise
        except _Refused as exc:
            raise self._fail(MalformedPickleError, f"malformed pickle: {exc}") from None
        except (pickle.UnpicklingError, ValueError, TypeError, EOFError, KeyError, IndexError,
                AttributeError, RecursionError, OverflowError, struct.error, UnicodeDecodeError) as exc:
            raise self._fail(MalformedPickleError, f"malformed pickle ({type(exc).__name__}: {exc})") from None
        except MemoryError:  # a length field (e.g. BYTEARRAY8) far beyond the pickle's own size
            raise self._fail(MalformedPickleError,
                             "malformed pickle: a length field asks for more memory than exists") from None

    def _load_zip(self, f: BinaryIO) -> Any:
        try:
            zf = zipfile.ZipFile(f)
        except _ZIP_ERRORS as exc:
            raise self._fail(NotTorchCheckpointError, f"not a readable zip archive ({exc})",
                             hint="the download may be truncated; fetch the file again") from None
        with zf:
            infos = {i.filename: i for i in zf.infolist()}
            pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkls) != 1:
                raise self._fail(NotTorchCheckpointError, "zip archive is not a torch.save checkpoint",
                                 expected="exactly one '<archive>/data.pkl'", found=pkls or "none")
            prefix = pkls[0][: -len("data.pkl")]
            if prefix + "constants.pkl" in infos or any(n.startswith(prefix + "code/") for n in infos):
                raise self._fail(NotTorchCheckpointError, "a TorchScript archive (torch.jit.save), not a state dict",
                                 hint="save model.state_dict() with torch.save, or use safetensors")
            bo = infos.get(prefix + "byteorder")
            if bo is not None:
                try:
                    order = zf.read(bo).strip()
                except _ZIP_ERRORS as exc:  # a damaged member header
                    raise self._fail(NotTorchCheckpointError, f"cannot read byteorder ({exc})") from None
                if order != b"little":
                    raise self._fail(ByteOrderError, "only little-endian checkpoints are read",
                                     expected="little", found=order.decode("ascii", "replace"))
            pinfo = infos[pkls[0]]
            if pinfo.file_size > MAX_PICKLE_BYTES:
                raise self._fail(PickleTooLargeError, "data.pkl is larger than the limit",
                                 expected=f"<= {MAX_PICKLE_BYTES} bytes", found=pinfo.file_size)
            try:
                data = zf.read(pinfo)
            except _ZIP_ERRORS as exc:
                raise self._fail(NotTorchCheckpointError, f"cannot read data.pkl ({exc})") from None

            def storage_for(pid: Any) -> _Storage:
                if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
                    raise _Refused(
                        f"persistent id must be ('storage', type, key, location, numel), got {pid!r:.80}"
                    )
                _, stype, key, _location, numel = pid
                return self._storage(stype, key, numel)

            try:  # opcode scan first: a damaged length field must not make the C unpickler allocate it
                for _ in pickletools.genops(data):
                    pass
            except (ValueError, EOFError, struct.error, UnicodeDecodeError) as exc:
                raise self._fail(MalformedPickleError, f"malformed pickle ({exc})") from None
            obj = self._unpickle(io.BytesIO(data), storage_for)
            for key, st in self._storages.items():
                info = infos.get(f"{prefix}data/{key}")
                if info is None:
                    raise self._fail(StorageRecordError, f"storage record 'data/{key}' is missing",
                                     expected=f"a member '{prefix}data/{key}'", found="none")
                self._locate_member(f, info, st)
        return obj

    def _locate_member(self, f: BinaryIO, info: zipfile.ZipInfo, st: _Storage) -> None:
        want = st.numel * st.dtype.itemsize
        if info.compress_type != zipfile.ZIP_STORED:
            raise self._fail(StorageRecordError, f"storage record '{info.filename}' is compressed",
                             expected="stored (method 0)", found=f"method {info.compress_type}",
                             hint="torch.save never compresses; re-save the file with torch.save")
        if info.file_size != want:
            raise self._fail(StorageRecordError, f"storage record '{info.filename}' has the wrong size for "
                             f"{st.numel} {st.dtype.name} elements", expected=want, found=info.file_size)
        f.seek(info.header_offset)
        raw = f.read(_LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
            raise self._fail(StorageRecordError, f"zip local header of '{info.filename}' is damaged",
                             found=f"offset {info.header_offset}")
        fields = _LOCAL_HEADER.unpack(raw)
        name_len, extra_len = fields[-2], fields[-1]
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + want > self.file_size:
            raise self._fail(StorageRecordError, f"storage record '{info.filename}' runs past the end of the file",
                             expected=f"{start + want} bytes", found=f"{self.file_size} bytes",
                             hint="the file is truncated; fetch it again")
        self._storage_start[st.key] = start
        self._storage_bytes[st.key] = want

    def _storage(self, stype: Any, key: Any, numel: Any, view: Any = None) -> _Storage:
        if not isinstance(stype, _StorageType):
            raise _Refused(f"storage type must be a torch storage global, got {type(stype).__name__}")
        if isinstance(key, bytes):
            key = key.decode("ascii", "replace")
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise _Refused(f"storage key must be a string, got {type(key).__name__}")
        key = str(key)
        numel = _int(numel, "storage numel")
        if numel < 0:
            raise _Refused(f"storage numel must be >= 0, got {numel}")
        root = self._storages.get(key)
        if root is None:
            root = self._storages[key] = _Storage(key, stype.dtype, numel, 0, key)
        elif root.dtype != stype.dtype or root.numel != numel:
            raise _Refused(f"storage '{key}' is named twice with different dtype or size")
        if view is None:
            return root
        if not isinstance(view, tuple) or len(view) != 3:
            raise _Refused("legacy view metadata must be (view_key, offset, size)")
        _vkey, off, size = view
        off, size = _int(off, "view offset"), _int(size, "view size")
        if off < 0 or size < 0 or off + size > numel:
            raise _Refused(f"storage view [{off}, {off + size}) outside storage '{key}' of {numel} elements")
        return _Storage(key, root.dtype, size, off, key)

    def _load_legacy(self, f: BinaryIO) -> Any:
        def no_storage(pid: Any) -> Any:
            raise _Refused("persistent id in a legacy header pickle")

        magic = self._unpickle(f, no_storage)
        if magic != LEGACY_MAGIC:
            raise self._fail(NotTorchCheckpointError, "a pickle, but not a torch checkpoint (no torch magic number)",
                             expected=hex(LEGACY_MAGIC), found=repr(magic)[:40],
                             hint="plain pickles are never read: they can run code")
        proto = self._unpickle(f, no_storage)
        if proto != LEGACY_PROTOCOL:
            raise self._fail(NotTorchCheckpointError, "unknown legacy torch protocol version", expected=LEGACY_PROTOCOL,
                             found=repr(proto)[:40])
        sys_info = self._unpickle(f, no_storage)
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise self._fail(ByteOrderError, "only little-endian checkpoints are read",
                             expected="little", found="big")

        def storage_for(pid: Any) -> _Storage:
            if not isinstance(pid, tuple) or len(pid) != 6 or pid[0] not in ("storage", b"storage"):
                is_module = isinstance(pid, tuple) and bool(pid) and pid[0] == "module"
                what = "a whole nn.Module" if is_module else repr(pid)[:80]
                raise _Refused(
                    f"persistent id must be ('storage', type, key, location, numel, view), got {what}"
                )
            _, stype, key, _location, numel, view = pid
            return self._storage(stype, key, numel, view)

        obj = self._unpickle(f, storage_for)
        keys = self._unpickle(f, no_storage)
        if not isinstance(keys, list) or not all(isinstance(k, (str, int)) for k in keys):
            raise self._fail(MalformedPickleError, "legacy storage key list is malformed")
        pos = f.tell()
        for k in keys:
            st = self._storages.get(str(k))
            if st is None:
                raise self._fail(StorageRecordError, f"storage '{k}' is listed but no tensor uses it")
            f.seek(pos)
            raw = f.read(8)
            if len(raw) != 8:
                raise self._fail(StorageRecordError, f"file ends before storage '{k}'", hint="the file is truncated")
            (count,) = struct.unpack("<q", raw)
            if count != st.numel:
                raise self._fail(StorageRecordError, f"storage '{k}' has the wrong element count",
                                 expected=st.numel, found=count)
            start, nbytes = pos + 8, count * st.dtype.itemsize
            if start + nbytes > self.file_size:
                raise self._fail(StorageRecordError, f"storage '{k}' runs past the end of the file",
                                 expected=f"{start + nbytes} bytes", found=f"{self.file_size} bytes",
                                 hint="the file is truncated; fetch it again")
            self._storage_start[st.key] = start
            self._storage_bytes[st.key] = nbytes
            pos = start + nbytes
        missing = sorted(set(self._storages) - set(self._storage_start))
        if missing:
            raise self._fail(StorageRecordError, "storages used by tensors are not in the file", found=missing)
        return obj

    # ------------------------------------------------------------------------------- flattening

    def _collect(self, obj: Any) -> None:
        self._budget = MAX_VALUE_NODES
        if not isinstance(obj, dict):
            raise self._fail(NotStateDictError, "the checkpoint is not a state dict", expected="a dict of tensors",
                             found=type(obj).__name__ if not isinstance(obj, _Tensor) else "a single tensor")
        try:
            self._flatten(obj, "")
        except RecursionError:
            raise self._fail(NotStateDictError, "values are nested too deeply") from None

    def _add_name(self, name: str) -> None:
        if name in self.tensors or name in self.values:
            raise self._fail(NotStateDictError, "a name appears twice after flattening nested dicts", tensor=name)

    def _spend(self, name: str) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise self._fail(NotStateDictError, "the pickle holds too many values", tensor=name,
                             expected=f"<= {MAX_VALUE_NODES} containers and scalars")

    def _flatten(self, obj: dict[Any, Any], prefix: str) -> None:
        for k, v in obj.items():
            self._spend(prefix + str(k))
            if not isinstance(k, str):
                raise self._fail(NotStateDictError, "state dict keys must be strings", found=repr(k)[:60])
            name = prefix + k
            if isinstance(v, _Tensor):
                self._add_name(name)
                self._add_tensor(name, v)
            elif isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
                self._flatten(v, name + ".")
            else:
                self._add_name(name)
                self.values[name] = self._value(v, name)

    def _value(self, v: Any, name: str) -> Any:
        self._spend(name)
        if isinstance(v, _Tensor):
            self._add_name(name)
            self._add_tensor(name, v)
            self.value_tensors.add(name)
            return TensorRef(name)
        if isinstance(v, list):
            return [self._value(x, f"{name}.{i}") for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(self._value(x, f"{name}.{i}") for i, x in enumerate(v))
        if isinstance(v, dict):
            return {k: self._value(x, f"{name}.{k}") for k, x in v.items()}
        if isinstance(v, _Object):
            state = {str(k): self._value(x, f"{name}.{k}") for k, x in v.state.items()}
            return PickledObject(v._cls_name, state)
        if isinstance(v, (_Storage, _StorageType)):
            raise self._fail(NotStateDictError, "a bare storage is not a tensor", tensor=name)
        return v

    def _add_tensor(self, name: str, t: _Tensor) -> None:
        st = t.storage
        dt = st.dtype
        if any(d < 0 for d in t.size) or any(s < 0 for s in t.stride) or t.offset < 0:
            raise self._fail(TensorViewError, "tensor size, stride and offset must be non-negative", tensor=name,
                             found=f"size {list(t.size)} stride {list(t.stride)} offset {t.offset}")
        numel = 1
        for d in t.size:
            numel *= d
        if numel:
            last = t.offset + sum((d - 1) * s for d, s in zip(t.size, t.stride, strict=True))
            if last >= st.numel:
                raise self._fail(TensorViewError, "tensor view reaches past its storage", tensor=name,
                                 expected=f"last element < {st.numel}", found=last)
        contiguous = _is_contiguous(t.size, t.stride)
        nbytes = numel * dt.itemsize
        if not contiguous and nbytes > MAX_COPY_BYTES:
            raise self._fail(NonContiguousTensorError, "tensor is a non-contiguous view too large to copy", tensor=name,
                             expected=f"contiguous, or <= {MAX_COPY_BYTES} bytes", found=nbytes,
                             hint="save it with tensor.contiguous(), or convert the file with torch")
        start = (st.elem_offset + t.offset) * dt.itemsize  # relative to the root storage until located
        self.tensors[name] = PickledTensor(name, dt, t.size, nbytes, start, st.root_key, t.stride, contiguous)

    # ---------------------------------------------------------------------------------- access

    def _map(self) -> mmap.mmap:
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmap

    def _abs_start(self, info: PickledTensor) -> int:
        return self._storage_start[info.storage] + info.start

    def _copy(self, info: PickledTensor) -> npt.NDArray[np.uint8]:
        buf = self._copies.get(info.name)
        if buf is None:
            isz = info.dtype.itemsize
            base = np.frombuffer(self._map(), dtype=np.uint8, count=self._storage_bytes[info.storage],
                                 offset=self._storage_start[info.storage]).view(info.dtype.numpy)
            view = np.lib.stride_tricks.as_strided(
                base[info.start // isz:], shape=info.shape, strides=tuple(s * isz for s in info.stride),
                writeable=False,
            )
            buf = np.ascontiguousarray(view).reshape(-1).view(np.uint8)
            buf.setflags(write=False)
            self._copies[info.name] = buf
        return buf

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]:
        """Read-only ``uint8[stop - start]`` view of bytes [start, stop) of a tensor in row-major order.

        Zero-copy into the file mapping for contiguous tensors (all tensors torch.save writes from a
        state dict); a small non-contiguous view is served from a copy made once.
        """
        info = self.tensors[name]
        stop = info.nbytes if stop is None else stop
        if not 0 <= start <= stop <= info.nbytes:
            raise IndexError(f"byte range [{start}, {stop}) outside tensor '{name}' of {info.nbytes} bytes")
        if stop == start:
            return np.empty(0, dtype=np.uint8)
        if not info.contiguous:
            return self._copy(info)[start:stop]
        offset = self._abs_start(info) + start
        return np.frombuffer(self._map(), dtype=np.uint8, count=stop - start, offset=offset)

    def array(self, name: str) -> np.ndarray:
        """Read-only view with the tensor's dtype and shape (``bfloat16`` -> ml_dtypes.bfloat16)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return np.empty(info.shape, dtype=info.dtype.numpy)
        return self.raw(name).view(info.dtype.numpy).reshape(info.shape)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop the whole pages of a consumed byte range of a tensor from the resident set."""
        info = self.tensors[name]
        if self._mmap is None or not info.contiguous:
            return
        stop = info.nbytes if stop is None else stop
        base = self._abs_start(info)
        lo = -(-(base + start) // _PAGE) * _PAGE
        hi = ((base + stop) // _PAGE) * _PAGE
        if hi > lo:
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Unmap the file. Views handed out before must no longer be used."""
        self._copies.clear()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes when it does
            self._mmap = None

    def __enter__(self) -> TorchPickleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TorchPickleReader('{self.path}', {self.layout}, {len(self.tensors)} tensors)"

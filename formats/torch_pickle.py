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

Safety: the pickle is run by our own pickle machine (:class:`~formats.pickle_machine.PickleMachine`,
every opcode of protocols 0-5, iterative and bounded: see :mod:`formats.pickle_machine` for its design
and its limits, MAX_PICKLE_BYTES ... MAX_KEY_COST), not by :class:`pickle.Unpickler`. Its
``find_class`` is the only way a pickle can reach a Python callable; it never imports anything: it maps
a short allow-list of names to stand-ins defined here and in the machine (which only build plain data)
and raises :class:`~formats.errors.UnsafePickleError` naming the global for everything else
(``os.system``, ``builtins.eval``, ``subprocess.Popen``, ...).

Bounds: bad input never crashes, hangs or eats memory. Besides the machine's limits, the walk that
flattens the result is iterative too (nesting at most the machine's MAX_DEPTH), every message that shows
pickled data goes through the machine's bounded :func:`~formats.pickle_machine.summary`, and the
reader has limits of its own:

====================  ===========  ========================================================================
MAX_DIMS              64           dimensions of a tensor (PT-004)
MAX_VALUE_NODES       1,000,000    nodes visited flattening the values (a list shared 2**40 ways) (PT-009)
MAX_ZIP_MEMBERS       200,000      members of the zip (one per storage), from the end record before the
                                   directory is read: ~600 bytes of memory each (PT-001)
====================  ===========  ========================================================================

Storage keys are at most 256 characters (PT-004).

Allowed globals: ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_tensor`` / ``_rebuild_parameter``,
``torch.<Type>Storage`` / ``torch.cuda.<Type>Storage`` / ``torch.UntypedStorage``, torch dtypes
(``torch.bfloat16``, ... as :class:`TorchDType`), ``torch.Size``, ``torch.device``,
``bitsandbytes.functional.QuantState`` (kept as a :class:`PickledObject` holding its attribute dict;
never instantiated), and the machine's plain ones (:data:`~formats.pickle_machine.PLAIN_GLOBALS`):
``collections.OrderedDict``, ``_codecs.encode`` (latin-1 only: how protocol 2 spells ``bytes``),
``builtins.set`` / ``frozenset``.

The unpickled object must be a dict (a state dict). Nested dicts are flattened with ``.``. Tensors go to
:attr:`TorchPickleReader.tensors`; every other value (ints, strings, lists such as a legacy list
QuantState, QuantState objects) goes to :attr:`TorchPickleReader.values`, with each tensor inside it
replaced by a :class:`TensorRef` and listed in ``tensors`` under its path (``P.quant_state.0``,
``P.quant_state.4.1.0``, ...).

Rules, each with its own subclass of :class:`~formats.errors.TorchPickleError` (PT-003:
``UnsafePickleError``; see docs/errors.md):

=======  ==========================================================================================
PT-001   the file is a torch zip archive (one directory holding data.pkl) or a legacy torch pickle
PT-002   data.pkl is at most MAX_PICKLE_BYTES (the machine's)
PT-003   every global the pickle names is on the allow-list
PT-004   the pickle is well formed: opcodes, persistent ids, rebuild arguments of the right types
PT-005   every storage record exists, is stored uncompressed, lies inside the file and holds
         numel * itemsize bytes
PT-006   every tensor's view (offset, size, stride) lies inside its storage
PT-007   a tensor is row-major contiguous (small non-contiguous views are copied; large ones refused)
PT-008   the byte order is little-endian
PT-009   the top-level object is a dict with string keys; names are unique; values nest at most
         MAX_DEPTH (the machine's) deep and hold at most MAX_VALUE_NODES nodes
PT-010   the pickle stays within the machine's limits (formats.pickle_machine)
=======  ==========================================================================================
"""

from __future__ import annotations

import math
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from . import pickle_machine  # its limits are read from the module when used (tests lower them)
from .dtypes import BY_NAME, DType
from .errors import (
    ByteOrderError,
    ConvertBnbError,
    MalformedPickleError,
    NonContiguousTensorError,
    NotStateDictError,
    NotTorchCheckpointError,
    PickleLimitError,
    PickleTooLargeError,
    StorageRecordError,
    TensorViewError,
    TorchPickleError,
    UnsafePickleError,
)
from .mapping import InputMap
from .pickle_machine import (
    PLAIN_GLOBALS,
    Limit,
    NoBuild,
    ObjectStandIn,
    PickleMachine,
    Refused,
    TooLong,
    clip,
    summary,
)
from .safetensors import byte_range

__all__ = [
    "ALLOWED_GLOBALS",
    "MAX_COPY_BYTES",
    "PickledObject",
    "PickledTensor",
    "TensorRef",
    "TorchDType",
    "TorchPickleReader",
]

#: What :mod:`zipfile` raises on a damaged archive: besides BadZipFile, NotImplementedError for a
#: "version needed" or compression method it lacks and RuntimeError for an "encrypted" flag (a flipped bit).
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError)
#: Largest non-contiguous tensor copied into memory, in bytes; larger ones are refused (PT-007).
MAX_COPY_BYTES = 64 * 1024 * 1024
#: Most containers and scalars walked in the non-tensor values (a pickle can share one list many
#: times over, which would otherwise expand exponentially).
MAX_VALUE_NODES = 1_000_000
#: Most dimensions of a tensor (size and stride tuples).
MAX_DIMS = 64
#: Most members of a torch zip (one per storage, plus ~5), checked before zipfile reads the directory.
MAX_ZIP_MEMBERS = 200_000
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature .. name length, extra length (30 bytes)


# ---------------------------------------------------------------------------------------------------
# Stand-ins handed to the pickle (besides the machine's plain ones). None of them imports, opens or calls
# anything outside this module and formats.pickle_machine.


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


@dataclass(frozen=True)
class _StorageType(NoBuild):
    dtype: DType
    name: str

    def __call__(self, *args: Any, **kw: Any) -> Any:
        raise Refused(f"calling storage type {self.name}")

    def label(self) -> str:
        return f"torch.{self.name}"


@dataclass
class _Storage(NoBuild):
    key: str
    dtype: DType
    numel: int  # elements of dtype
    elem_offset: int = 0  # legacy views into a root storage
    root_key: str = ""

    def label(self) -> str:
        return "<storage>"


@dataclass
class _Tensor(NoBuild):
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def label(self) -> str:
        return "<tensor>"


def _object_class(full_name: str) -> type:
    return type("QuantStateStandIn", (ObjectStandIn,), {"cls_name": full_name, "__slots__": ()})


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise Refused(f"{what} must be an integer, got {type(v).__name__}")
    if not -(2**63) <= v < 2**63:  # torch's int64; the machine already refuses ints over MAX_INT_BYTES
        raise Refused(f"{what} must fit in 64 bits, got an integer of {v.bit_length()} bits")
    return v


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)):
        raise Refused(f"{what} must be a tuple of integers, got {type(v).__name__}")
    if len(v) > MAX_DIMS:
        raise Refused(f"{what} has {len(v)} dimensions (at most {MAX_DIMS})")
    return tuple(_int(x, what) for x in v)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise Refused(f"tensor storage must come from a persistent id, got {type(storage).__name__}")
    if len(rest) > 3:
        raise Refused(f"_rebuild_tensor_v2 takes at most 7 arguments, got {4 + len(rest)}")
    size_t = _int_tuple(size, "tensor size")
    stride_t = _int_tuple(stride, "tensor stride")
    if len(size_t) != len(stride_t):
        raise Refused(f"size {summary(list(size_t))} and stride {summary(list(stride_t))} differ in length")
    return _Tensor(storage, _int(storage_offset, "storage offset"), size_t, stride_t)


def _rebuild_parameter(data: Any, *rest: Any) -> _Tensor:
    if not isinstance(data, _Tensor):
        raise Refused(f"parameter data must be a tensor, got {type(data).__name__}")
    return data


def _torch_size(values: Any = ()) -> tuple[int, ...]:
    return _int_tuple(values, "torch.Size")


def _torch_device(*args: Any) -> str:
    if not args or not all(isinstance(a, (str, int)) for a in args):
        raise Refused("torch.device takes a string (and an index)")
    return ":".join(str(a) for a in args)


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
_STORAGE_TYPES = {sname: _StorageType(BY_NAME[dname], sname) for sname, dname in _STORAGE_DTYPES.items()}


def _build_allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch", "Size"): _torch_size,
        ("torch", "device"): _torch_device,
        **PLAIN_GLOBALS,  # OrderedDict, _codecs.encode, set, frozenset
    }
    for sname, st in _STORAGE_TYPES.items():
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
#: What REDUCE / INST / OBJ may call besides the machine's own stand-ins: torch's functions, and its
#: storage types (calling one is refused: "calling storage type ...").
_CALLABLES = (_rebuild_tensor, _rebuild_parameter, _torch_size, _torch_device, *_STORAGE_TYPES.values())


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
        PickleLimitError: the pickle exceeds a limit of the pickle machine (PT-010).
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._spath = os.fspath(path)
        self._mmap: InputMap | None = None
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

    def _find_class(self, module: str, name: str) -> Any:
        """The only door from a pickle to a Python object: the allow-list, nothing is imported."""
        stand_in = ALLOWED_GLOBALS.get((module, name))
        if stand_in is None:
            spelled = f"{module}.{name}"
            raise self._fail(
                UnsafePickleError,
                "pickle names a global outside the allow-list; nothing was imported or run",
                expected="torch tensor/storage/dtype globals, OrderedDict, plain containers",
                found=spelled if len(spelled) <= 200 else spelled[:200] + "...",
                hint="only state dicts of tensors are read; convert trusted files with torch "
                     "to safetensors first if you need more",
            )
        return stand_in

    def _unpickle(self, buf: Any, pos: int, storage_for: Any) -> tuple[Any, int]:
        """Run one pickle at ``buf[pos:]`` (bytes or the file's mapping); the object and the end offset."""
        machine = PickleMachine(self._find_class, storage_for, _CALLABLES, (TorchDType,))
        try:
            return machine.run(buf, pos, len(buf))
        except ConvertBnbError:
            raise
        except Refused as exc:
            raise self._fail(MalformedPickleError, f"malformed pickle: {exc}") from None
        except Limit as exc:
            raise self._fail(PickleLimitError, str(exc), expected=exc.expected,
                             found=exc.found,
                             hint="a torch.save state dict is far within it; this file is damaged or hostile") from None
        except TooLong:
            limit = pickle_machine.MAX_PICKLE_BYTES
            raise self._fail(PickleTooLargeError, "pickle data is larger than the limit",
                             expected=f"<= {limit} bytes", found=f"more than {limit}") from None
        except IndexError:
            raise self._fail(MalformedPickleError, "malformed pickle: stack underflow") from None
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, struct.error) as exc:
            # ValueError includes UnicodeDecodeError and bad INT/FLOAT text; messages are clipped
            raise self._fail(MalformedPickleError,
                             f"malformed pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
        finally:
            machine.meta.clear()

    def _load_zip(self, f: BinaryIO) -> Any:
        try:  # the member count from the end record, before zipfile makes an object per member
            end = zipfile._EndRecData(f)  # type: ignore[attr-defined]
        except _ZIP_ERRORS:
            end = None
        if end is not None and end[zipfile._ECD_ENTRIES_TOTAL] > MAX_ZIP_MEMBERS:  # type: ignore[attr-defined]
            raise self._fail(NotTorchCheckpointError, "zip archive has more members than a torch checkpoint can",
                             expected=f"<= {MAX_ZIP_MEMBERS} (one per storage)",
                             found=end[zipfile._ECD_ENTRIES_TOTAL])  # type: ignore[attr-defined]
        f.seek(0)
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
                    with zf.open(bo) as fh:  # capped: a deflated member may declare or inflate to any size
                        order = fh.read(64).strip()
                except _ZIP_ERRORS as exc:  # a damaged member header
                    raise self._fail(NotTorchCheckpointError, f"cannot read byteorder ({exc})") from None
                if order != b"little":
                    raise self._fail(ByteOrderError, "only little-endian checkpoints are read",
                                     expected="little", found=order.decode("ascii", "replace"))
            pinfo = infos[pkls[0]]
            limit = pickle_machine.MAX_PICKLE_BYTES  # the machine's limit, read now (tests lower it)
            if pinfo.file_size > limit:  # the declared size, checked before inflating anything
                raise self._fail(PickleTooLargeError, "data.pkl is larger than the limit",
                                 expected=f"<= {limit} bytes", found=pinfo.file_size)
            try:
                with zf.open(pinfo) as fh:  # and a cap on what inflating may produce, whatever was declared
                    data = fh.read(limit + 1)
            except _ZIP_ERRORS as exc:
                raise self._fail(NotTorchCheckpointError, f"cannot read data.pkl ({exc})") from None
            if len(data) > limit:
                raise self._fail(PickleTooLargeError, "data.pkl is larger than the limit",
                                 expected=f"<= {limit} bytes", found=f"more than {limit}")

            def storage_for(pid: Any) -> _Storage:
                if type(pid) is not tuple or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
                    raise Refused(
                        f"persistent id must be ('storage', type, key, location, numel), got {summary(pid)}"
                    )
                _, stype, key, _location, numel = pid
                return self._storage(stype, key, numel)

            obj, _end = self._unpickle(data, 0, storage_for)
            del data
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
            raise Refused(f"storage type must be a torch storage global, got {type(stype).__name__}")
        if isinstance(key, bytes):
            key = key.decode("ascii", "replace")
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise Refused(f"storage key must be a string, got {type(key).__name__}")
        key = str(key)
        if len(key) > 256:
            raise Refused(f"storage key must be at most 256 characters, got {len(key)}")
        numel = _int(numel, "storage numel")
        if numel < 0:
            raise Refused(f"storage numel must be >= 0, got {numel}")
        root = self._storages.get(key)
        if root is None:
            root = self._storages[key] = _Storage(key, stype.dtype, numel, 0, key)
        elif root.dtype != stype.dtype or root.numel != numel:
            raise Refused(f"storage '{key}' is named twice with different dtype or size")
        if view is None:
            return root
        if not isinstance(view, tuple) or len(view) != 3:
            raise Refused("legacy view metadata must be (view_key, offset, size)")
        _vkey, off, size = view
        off, size = _int(off, "view offset"), _int(size, "view size")
        if off < 0 or size < 0 or off + size > numel:
            raise Refused(f"storage view [{off}, {off + size}) outside storage '{key}' of {numel} elements")
        return _Storage(key, root.dtype, size, off, key)

    def _load_legacy(self, f: BinaryIO) -> Any:
        def no_storage(pid: Any) -> Any:
            raise Refused("persistent id in a legacy header pickle")

        buf = self._map().buffer  # the pickles are parsed in place; each may span at most MAX_PICKLE_BYTES
        magic, pos = self._unpickle(buf, 0, no_storage)
        if type(magic) is not int or magic != LEGACY_MAGIC:
            raise self._fail(NotTorchCheckpointError, "a pickle, but not a torch checkpoint (no torch magic number)",
                             expected=hex(LEGACY_MAGIC), found=summary(magic, 40),
                             hint="plain pickles are never read: they can run code")
        proto, pos = self._unpickle(buf, pos, no_storage)
        if type(proto) is not int or proto != LEGACY_PROTOCOL:
            raise self._fail(NotTorchCheckpointError, "unknown legacy torch protocol version", expected=LEGACY_PROTOCOL,
                             found=summary(proto, 40))
        sys_info, pos = self._unpickle(buf, pos, no_storage)
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise self._fail(ByteOrderError, "only little-endian checkpoints are read",
                             expected="little", found="big")

        def storage_for(pid: Any) -> _Storage:
            if type(pid) is not tuple or len(pid) != 6 or pid[0] not in ("storage", b"storage"):
                is_module = type(pid) is tuple and bool(pid) and type(pid[0]) is str and pid[0] == "module"
                what = "a whole nn.Module" if is_module else summary(pid)
                raise Refused(
                    f"persistent id must be ('storage', type, key, location, numel, view), got {what}"
                )
            _, stype, key, _location, numel, view = pid
            return self._storage(stype, key, numel, view)

        obj, pos = self._unpickle(buf, pos, storage_for)
        keys, pos = self._unpickle(buf, pos, no_storage)
        if not isinstance(keys, list) or not all(isinstance(k, (str, int)) for k in keys):
            raise self._fail(MalformedPickleError, "legacy storage key list is malformed")
        for k in keys:
            st = self._storages.get(str(k))
            if st is None:
                raise self._fail(StorageRecordError, f"storage '{clip(str(k))}' is listed but no tensor uses it")
            if pos + 8 > self.file_size:
                raise self._fail(StorageRecordError, f"file ends before storage '{k}'", hint="the file is truncated")
            (count,) = struct.unpack_from("<q", buf, pos)
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
            raise self._fail(StorageRecordError, "storages used by tensors are not in the file",
                             found=summary(missing, 120))
        return obj

    # ------------------------------------------------------------------------------- flattening

    def _collect(self, obj: Any) -> None:
        """Flatten the state dict into ``tensors`` and ``values``: iterative, depth- and budget-bounded."""
        self._budget = MAX_VALUE_NODES
        max_depth = pickle_machine.MAX_DEPTH  # the machine's nesting limit also bounds the flattening
        if not isinstance(obj, dict):
            raise self._fail(NotStateDictError, "the checkpoint is not a state dict", expected="a dict of tensors",
                             found=type(obj).__name__ if not isinstance(obj, _Tensor) else "a single tensor")
        frames: list[tuple[Any, str]] = [(iter(obj.items()), "")]  # nested dicts of string keys, depth first
        while frames:
            items, prefix = frames[-1]
            entry = next(items, None)
            if entry is None:
                frames.pop()
                continue
            k, v = entry
            if not isinstance(k, str):
                raise self._fail(NotStateDictError, "state dict keys must be strings", found=summary(k, 60))
            name = prefix + k
            self._spend(name)
            if isinstance(v, _Tensor):
                self._add_name(name)
                self._add_tensor(name, v)
            elif isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
                if len(frames) >= max_depth:
                    raise self._fail(NotStateDictError, "values are nested too deeply", tensor=clip(name),
                                     expected=f"<= {max_depth} levels")
                frames.append((iter(v.items()), name + "."))
            else:
                self._add_name(name)
                self.values[name] = self._value(v, name)

    def _add_name(self, name: str) -> None:
        # a pickle string may hold anything; a safetensors name may not, and '__metadata__' is its header's
        # metadata key (a tensor of that name made a file the safetensors library refuses)
        if "\0" in name or not _utf8(name) or name == "__metadata__":
            raise self._fail(NotStateDictError, "a name is not writable as a tensor name",
                             expected="UTF-8 text without NUL bytes (no lone surrogates), not '__metadata__', as "
                                      "safetensors requires",
                             found=ascii(clip(name)))
        if name in self.tensors or name in self.values:
            raise self._fail(NotStateDictError, "a name appears twice after flattening nested dicts", tensor=name)

    def _spend(self, name: str) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise self._fail(NotStateDictError, "the pickle holds too many values", tensor=clip(name),
                             expected=f"<= {MAX_VALUE_NODES} containers and scalars")

    def _open(self, v: Any, name: str) -> tuple[bool, Any]:
        """One value: ``(True, converted)`` for a leaf, ``(False, frame)`` for a container to walk."""
        self._spend(name)
        if isinstance(v, _Tensor):
            self._add_name(name)
            self._add_tensor(name, v)
            self.value_tensors.add(name)
            return True, TensorRef(name)
        if isinstance(v, (list, tuple)):
            return False, [type(v) if type(v) in (list, tuple) else list, iter(enumerate(v)), [], name, None, None]
        if isinstance(v, dict):
            return False, [dict, iter(v.items()), [], name, None, None]
        if isinstance(v, ObjectStandIn):
            return False, [PickledObject, iter(v.state.items()), [], name, v.cls_name, None]
        if isinstance(v, (_Storage, _StorageType)):
            raise self._fail(NotStateDictError, "a bare storage is not a tensor", tensor=clip(name))
        return True, v

    def _value(self, root: Any, root_name: str) -> Any:
        """A non-tensor value rebuilt as plain data, tensors inside it replaced by :class:`TensorRef`.

        Walks with an explicit stack: depth <= the machine's MAX_DEPTH (a self-referencing list ends there),
        nodes <= MAX_VALUE_NODES in all (a list shared 2**40 ways ends there).
        """
        leaf, out = self._open(root, root_name)
        if leaf:
            return out
        max_depth = pickle_machine.MAX_DEPTH
        frames: list[list[Any]] = [out]
        while True:
            kind, items, acc, name, cls, _ = frames[-1]
            entry = next(items, None)
            if entry is None:
                frames.pop()
                if kind is list:
                    done: Any = [x for _, x in acc]
                elif kind is tuple:
                    done = tuple(x for _, x in acc)
                elif kind is dict:
                    done = dict(acc)
                else:
                    done = PickledObject(cls, {str(k): x for k, x in acc})
                if not frames:
                    return done
                frames[-1][2].append((frames[-1][5], done))  # under the key it was opened with
                continue
            k, child = entry
            leaf, out = self._open(child, f"{name}.{k}")
            if leaf:
                acc.append((k, out))
            else:
                if len(frames) >= max_depth:
                    raise self._fail(NotStateDictError, "values are nested too deeply", tensor=clip(root_name),
                                     expected=f"<= {max_depth} levels")
                frames[-1][5] = k
                frames.append(out)

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

    def _map(self) -> InputMap:
        if self._mmap is None:
            self._mmap = InputMap(self.path, self.file_size)
        return self._mmap

    def _abs_start(self, info: PickledTensor) -> int:
        return self._storage_start[info.storage] + info.start

    def _copy(self, info: PickledTensor) -> npt.NDArray[np.uint8]:
        buf = self._copies.get(info.name)
        if buf is None:
            isz = info.dtype.itemsize
            base = self._map().view(self._storage_start[info.storage],
                                    self._storage_bytes[info.storage]).view(info.dtype.numpy)
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
        stop = byte_range(name, start, stop, info.nbytes)
        if stop == start:
            return np.empty(0, dtype=np.uint8)
        if not info.contiguous:
            return self._copy(info)[start:stop]
        offset = self._abs_start(info) + start
        return self._map().view(offset, stop - start)

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
        self._mmap.release(base + start, base + stop)

    def close(self) -> None:
        """Unmap the file. Views handed out before must no longer be used."""
        self._copies.clear()
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def __enter__(self) -> TorchPickleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TorchPickleReader('{self.path}', {self.layout}, {len(self.tensors)} tensors)"


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a pickle's strings are decoded with ``surrogatepass``: a lone
    surrogate survives into the name)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

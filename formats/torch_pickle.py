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

Safety: the pickle is run by our own pickle machine (:class:`_Machine`, every opcode of protocols 0-5),
not by :class:`pickle.Unpickler`. Its ``find_class`` is the only way a pickle can reach a Python
callable; it never imports anything: it maps a short allow-list of names to stand-ins defined here
(which only build plain data) and raises :class:`~formats.errors.UnsafePickleError` naming the global
for everything else (``os.system``, ``builtins.eval``, ``subprocess.Popen``, ...).

Bounds: bad input never crashes, hangs or eats memory. The machine is a loop over a stack (no
recursion, so no RecursionError and no C-stack overflow; SIGINT/SIGTERM land between two opcodes),
the walk that flattens the result is iterative too, and every message that shows pickled data goes
through a summariser that looks at no more than ~80 items and never prints a big integer in decimal.
The limits, against what a real state dict needs (``torch.save`` of a Llama state dict costs about 30
opcodes, 8 memo entries, 21 container elements and 125 bytes of pickle per tensor; a 70B model's
``pytorch_model.bin`` holds a few thousand tensors, so its pickle is under 1 MB and 150,000 opcodes):

====================  ===========  ========================================================================
MAX_PICKLE_BYTES      64 MiB       data.pkl (declared size checked before inflating; inflating is capped
                                   too), or one legacy pickle (PT-002); ~500,000 tensors
MAX_OPCODES           2,000,000    opcodes per pickle, ~65,000 tensors; bounds the time (a few seconds)
MAX_MEMO              1,000,000    memo entries
MAX_CONTAINER_ITEMS   1,000,000    elements of one list/tuple/dict/set, and values on the machine's stack
MAX_TOTAL_ITEMS       2,000,000    containers and elements made in all, ~95,000 tensors; bounds memory
                                   (a hostile pickle at every limit stays well under 1 GiB)
MAX_DEPTH             100          nesting of containers and of MARKs (a state dict nests < 10 deep)
MAX_INT_BYTES         16           bytes of a LONG1/LONG4 integer (40 digits for text INT/LONG); counts,
                                   offsets, sizes and strides must also fit in int64
MAX_KEY_COST          256          a dict key or set member is a str/bytes/number/None/bool, or a tuple
                                   of them with at most 256 elements in all (nothing else is hashed)
MAX_DIMS              64           dimensions of a tensor
MAX_VALUE_NODES       1,000,000    nodes visited flattening the values (a list shared 2**40 ways) (PT-009)
MAX_ZIP_MEMBERS       200,000      members of the zip (one per storage), from the end record before the
                                   directory is read: ~600 bytes of memory each (PT-001)
====================  ===========  ========================================================================

Each limit but the three marked is rule PT-010 (:class:`~formats.errors.PickleLimitError`), naming the limit
and what was found. Storage keys are at most 256 characters (PT-004).

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
PT-009   the top-level object is a dict with string keys; names are unique; values nest at most
         MAX_DEPTH deep and hold at most MAX_VALUE_NODES nodes
PT-010   the pickle stays within the machine's limits (above)
=======  ==========================================================================================
"""

from __future__ import annotations

import codecs
import collections
import copyreg
import itertools
import math
import mmap
import os
import pickle
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
    PickleLimitError,
    PickleTooLargeError,
    StorageRecordError,
    TensorViewError,
    TorchPickleError,
    UnsafePickleError,
)
from .safetensors import byte_range

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
MAX_PICKLE_BYTES = 64 * 1024 * 1024
#: What :mod:`zipfile` raises on a damaged archive: besides BadZipFile, NotImplementedError for a
#: "version needed" or compression method it lacks and RuntimeError for an "encrypted" flag (a flipped bit).
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError)
#: Largest non-contiguous tensor copied into memory, in bytes; larger ones are refused (PT-007).
MAX_COPY_BYTES = 64 * 1024 * 1024
#: Most containers and scalars walked in the non-tensor values (a pickle can share one list many
#: times over, which would otherwise expand exponentially).
MAX_VALUE_NODES = 1_000_000
#: Limits of the pickle machine (PT-010; see the module docstring for why each is what it is).
MAX_OPCODES = 2_000_000
MAX_MEMO = 1_000_000
MAX_CONTAINER_ITEMS = 1_000_000
MAX_TOTAL_ITEMS = 2_000_000
MAX_DEPTH = 100
MAX_INT_BYTES = 16
MAX_KEY_COST = 256
#: Most dimensions of a tensor (size and stride tuples).
MAX_DIMS = 64
#: Most members of a torch zip (one per storage, plus ~5), checked before zipfile reads the directory.
MAX_ZIP_MEMBERS = 200_000
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
    if not -(2**63) <= v < 2**63:  # torch's int64; the machine already refuses ints over MAX_INT_BYTES
        raise _Refused(f"{what} must fit in 64 bits, got an integer of {v.bit_length()} bits")
    return v


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)):
        raise _Refused(f"{what} must be a tuple of integers, got {type(v).__name__}")
    if len(v) > MAX_DIMS:
        raise _Refused(f"{what} has {len(v)} dimensions (at most {MAX_DIMS})")
    return tuple(_int(x, what) for x in v)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise _Refused(f"tensor storage must come from a persistent id, got {type(storage).__name__}")
    if len(rest) > 3:
        raise _Refused(f"_rebuild_tensor_v2 takes at most 7 arguments, got {4 + len(rest)}")
    size_t = _int_tuple(size, "tensor size")
    stride_t = _int_tuple(stride, "tensor stride")
    if len(size_t) != len(stride_t):
        raise _Refused(f"size {_summary(list(size_t))} and stride {_summary(list(stride_t))} differ in length")
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


# ---------------------------------------------------------------------------------------------------
# The pickle machine. Our own, in Python, instead of pickle.Unpickler: every opcode is counted, every
# length is checked against the bytes that are left before anything is allocated, every container
# knows its nesting depth, and only small immutable values may be hashed (dict keys, set members).
# It is a loop over a stack: nothing in it recurses, so it cannot exhaust the C stack or the Python
# recursion limit, and a signal (KeyboardInterrupt) is delivered between any two opcodes.


class _Text(str):
    """Literal text inside :func:`_summary`'s work list (not a value being summarised)."""

    __slots__ = ()


def _summary(obj: Any, limit: int = 80) -> str:
    """``repr``-like text of a pickled value, at most about ``limit`` characters.

    Iterative and bounded: looks at no more than ``limit`` items in all, slices strings and bytes
    before ``repr``, and never converts a large integer to decimal, so a value shared 2**60 ways or
    nested 200,000 deep costs no more than a small one.
    """
    parts: list[str] = []
    used = 0
    todo: list[Any] = [obj]
    while todo and used < limit:
        x = todo.pop()
        if type(x) is _Text:
            s = str(x)
        elif isinstance(x, (str, bytes, bytearray)):
            s = repr(x[:limit])
        elif isinstance(x, bool) or x is None or isinstance(x, float):
            s = repr(x)
        elif isinstance(x, int):
            s = repr(x) if x.bit_length() <= 128 else f"<integer of {x.bit_length()} bits>"
        elif isinstance(x, (list, tuple, set, frozenset, dict)):
            brackets = {list: "[]", tuple: "()", dict: "{}"}.get(type(x), "{}")
            opener, closer = brackets[0], brackets[1]
            if isinstance(x, (set, frozenset)) and not x:
                opener, closer = f"{type(x).__name__}(", ")"
            room = max(1, (limit - used) // 2)
            items = list(itertools.islice(x.items() if isinstance(x, dict) else iter(x), room))
            tail: list[Any] = [_Text(closer)]
            if len(x) > len(items):
                tail.append(_Text(", ..."))
            for i in range(len(items) - 1, -1, -1):
                if isinstance(x, dict):
                    tail.extend([items[i][1], _Text(": "), items[i][0]])
                else:
                    tail.append(items[i])
                if i:
                    tail.append(_Text(", "))
            if isinstance(x, tuple) and len(x) == 1:
                tail.insert(1, _Text(","))
            todo.extend(tail)
            s = opener
        elif isinstance(x, _Tensor):
            s = "<tensor>"
        elif isinstance(x, _Storage):
            s = "<storage>"
        elif isinstance(x, _StorageType):
            s = f"torch.{x.name}"
        elif isinstance(x, _Object):
            s = f"<{x._cls_name}>"
        elif isinstance(x, type):
            s = f"<class {x.__name__}>"
        else:
            s = f"<{type(x).__name__}>"
        if used + len(s) > limit:
            parts.append(s[: limit - used])
            used = limit + 1
            break
        parts.append(s)
        used += len(s)
    if todo or used > limit:
        parts.append("...")
    return "".join(parts)


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class _Limit(Exception):
    """A parsing limit is exceeded (PT-010); the reader adds the file."""

    def __init__(self, message: str, expected: Any, found: Any) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class _TooLong(Exception):
    """The pickle runs past MAX_PICKLE_BYTES (PT-002)."""


# scalar types that may be hashed (dict keys, set members); each costs 1 toward MAX_KEY_COST
_KEY_SCALARS = frozenset({str, bytes, int, float, bool, type(None), TorchDType})
_NOT_KEY = -1
_DIGITS = 40  # longest INT/LONG/GET/PUT text argument (protocol 0), in characters


def _decode_long_text(line: bytes) -> int:
    if len(line) > _DIGITS:
        raise _Limit("an integer in the pickle is too large", f"<= {_DIGITS} digits",
                     f"{len(line)} characters")
    return int(line)


class _Machine:
    """Runs one pickle from ``buf[pos:]`` under the limits; see :meth:`run`."""

    def __init__(self, find_class: Any, persistent_load: Any) -> None:
        self.find_class = find_class
        self.persistent_load = persistent_load
        # id(container) -> (depth, key cost). Every container the machine makes is entered when it is
        # made (so an entry left by a freed object whose id is reused is overwritten), and any other
        # object it makes or receives (call results, storages, globals) has its id's entry removed.
        self.meta: dict[int, tuple[int, int]] = {}
        self.items = 0  # containers and container elements made so far (MAX_TOTAL_ITEMS)

    # ------------------------------------------------------------------------------ bookkeeping

    def info(self, x: Any) -> tuple[int, int]:
        if type(x) in _KEY_SCALARS:
            return (0, 1)
        m = self.meta.get(id(x))
        return m if m is not None else (0, _NOT_KEY)

    def note(self, x: Any, depth: int, cost: int, new: bool = False) -> Any:
        if depth > MAX_DEPTH:
            raise _Limit("containers are nested too deeply", f"<= {MAX_DEPTH} levels", f"{depth} levels")
        if new:
            self.count(1, 0)
        self.meta[id(x)] = (depth, cost)
        return x

    def plain(self, x: Any) -> Any:
        """An object that is no container of ours (a call result, storage, global): forget its id."""
        self.meta.pop(id(x), None)
        return x

    def count(self, n: int, size: int) -> None:
        self.items += n
        if size > MAX_CONTAINER_ITEMS:
            raise _Limit("a list, tuple, dict or set has too many elements",
                         f"<= {MAX_CONTAINER_ITEMS}", size)
        if self.items > MAX_TOTAL_ITEMS:
            raise _Limit("the pickle's containers hold too many elements in all",
                         f"<= {MAX_TOTAL_ITEMS}", f"more than {MAX_TOTAL_ITEMS}")

    def tuple_of(self, items: Any) -> tuple[Any, ...]:
        t = tuple(items)
        n = len(t)
        self.items += n + 1
        if n > MAX_CONTAINER_ITEMS or self.items > MAX_TOTAL_ITEMS:
            self.count(0, n)  # raises
        depth, cost = 0, 1
        meta = self.meta
        for x in t:  # the hot path of a torch pickle: inlined info()
            if type(x) in _KEY_SCALARS:
                cost += 1
                continue
            m = meta.get(id(x))
            if m is None:
                cost = _NOT_KEY
                continue
            if m[0] > depth:
                depth = m[0]
            if m[1] == _NOT_KEY:
                cost = _NOT_KEY
            elif cost != _NOT_KEY:
                cost += m[1]
        if cost == _NOT_KEY or cost > MAX_KEY_COST:
            cost = _NOT_KEY if cost == _NOT_KEY else MAX_KEY_COST + 1
        if depth >= MAX_DEPTH:
            self.note(t, depth + 1, cost)  # raises
        meta[id(t)] = (depth + 1, cost)
        return t

    def key(self, k: Any, where: str) -> Any:
        cost = self.info(k)[1]
        if cost == _NOT_KEY:
            raise _Refused(f"{where} must be a string, number, bytes, None or a tuple of them, "
                           f"got {type(k).__name__}")
        if cost > MAX_KEY_COST:
            raise _Limit(f"{where} is too large to hash", f"a tuple of <= {MAX_KEY_COST} elements in all",
                         f"more than {MAX_KEY_COST}")
        return k

    def grow(self, c: Any, children: Any) -> None:
        depth, cost = self.info(c)
        meta = self.meta
        for x in children:
            if type(x) not in _KEY_SCALARS:
                m = meta.get(id(x))
                if m is not None and m[0] >= depth:
                    depth = m[0] + 1
        self.note(c, depth, cost)

    def extend(self, lst: Any, items: list[Any]) -> None:
        if type(lst) is not list:
            raise _Refused(f"APPEND to a {type(lst).__name__}, not a list")
        lst.extend(items)
        self.count(len(items), len(lst))
        self.grow(lst, items)

    def set_items(self, d: Any, items: list[Any]) -> None:
        if not isinstance(d, dict) or type(d) not in (dict, collections.OrderedDict):
            raise _Refused(f"SETITEM on a {type(d).__name__}, not a dict")
        if len(items) % 2:
            raise _Refused("SETITEMS needs key/value pairs (odd number of items)")
        for i in range(0, len(items), 2):
            d[self.key(items[i], "a dict key")] = items[i + 1]
        self.count(len(items) // 2, len(d))
        self.grow(d, items[1::2])

    def new_dict(self) -> dict[Any, Any]:
        return self.note({}, 1, _NOT_KEY, new=True)  # plain: it keeps order, at half OrderedDict's memory

    def new_set(self, kind: type, items: Any, what: str) -> Any:
        if not isinstance(items, (list, tuple)):
            raise _Refused(f"{what} takes a list")
        for x in items:
            self.key(x, f"a {kind.__name__} member")
        s = kind(items)
        self.count(len(s), len(s))
        depth = max((self.info(x)[0] for x in items), default=0) + 1
        return self.note(s, depth, _NOT_KEY, new=True)

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE / INST / OBJ: ``func(*args)`` for the allow-listed stand-ins only."""
        if type(args) is not tuple:
            raise _Refused(f"call arguments must be a tuple, got {type(args).__name__}")
        if func is collections.OrderedDict:
            d = self.new_dict()
            if args:
                pairs = args[0]
                if len(args) > 1 or not isinstance(pairs, list) or not all(
                        type(p) is tuple and len(p) == 2 for p in pairs):
                    raise _Refused("OrderedDict() takes a list of (key, value) pairs")
                self.set_items(d, [x for p in pairs for x in p])
            return d
        if func is _plain_set or func is _plain_frozenset:
            kind = set if func is _plain_set else frozenset
            if len(args) > 1:
                raise _Refused(f"{kind.__name__}() takes one list")
            return self.new_set(kind, args[0] if args else [], f"{kind.__name__}()")
        if isinstance(func, type) and issubclass(func, _Object):
            return self.note(func.__new__(func), 1, _NOT_KEY, new=True)
        if any(func is c for c in _CALLABLES) or isinstance(func, _StorageType):  # `is`: func may be unhashable
            try:
                out = func(*args)
            except TypeError as exc:  # wrong number of arguments
                raise _Refused(str(exc)[:200]) from None
            return self.tuple_of(out) if type(out) is tuple else self.plain(out)
        raise _Refused(f"{_summary(func, 60)} is not callable")

    def new_object(self, cls: Any, args: Any, kwargs: Any = None) -> Any:
        """NEWOBJ / NEWOBJ_EX: ``cls.__new__(cls, *args)`` for an allowed class."""
        if type(args) is not tuple or (kwargs is not None and not isinstance(kwargs, dict)):
            raise _Refused("NEWOBJ arguments must be a tuple (and a dict)")
        if cls is collections.OrderedDict:
            return self.new_dict()
        if isinstance(cls, type) and issubclass(cls, _Object):
            return self.note(cls.__new__(cls), 1, _NOT_KEY, new=True)
        raise _Refused(f"NEWOBJ on {_summary(cls, 60)}, which is not an allowed class")

    def build(self, inst: Any, state: Any) -> None:
        if isinstance(inst, _Object):
            inst.__setstate__(state)
            self.grow(inst, [state])
        elif type(inst) in (dict, collections.OrderedDict):
            # a state dict's `_metadata` attribute (OrderedDict.__reduce__ state): dropped
            if not (isinstance(state, dict) or (type(state) is tuple and len(state) == 2
                                                and all(s is None or isinstance(s, dict) for s in state))):
                raise _Refused(f"state of a dict is a {type(state).__name__}")
        else:
            raise _Refused(f"BUILD on {type(inst).__name__.lstrip('_')} is not allowed")

    # ------------------------------------------------------------------------------------- run

    def run(self, buf: Any, pos: int, end: int) -> tuple[Any, int]:
        """Unpickle the pickle at ``buf[pos:end]``; returns the object and the offset after STOP.

        Raises:
            _Refused: malformed (PT-004). _Limit: a limit (PT-010). _TooLong: MAX_PICKLE_BYTES (PT-002).
            UnsafePickleError: from ``find_class``.
        """
        stop = min(end, pos + MAX_PICKLE_BYTES)
        stack: list[Any] = []
        marks: list[int] = []
        memo: dict[int, Any] = {}
        push = stack.append
        spop = stack.pop
        done: list[Any] = []  # STOP puts the result here

        def take(n: int) -> bytes:
            nonlocal pos
            if n < 0 or pos + n > stop:
                if 0 <= n and pos + n <= end:
                    raise _TooLong
                raise _Refused(f"pickle data was truncated (needs {n} bytes at offset {pos}, "
                               f"{max(0, stop - pos)} left)")
            raw = buf[pos:pos + n]
            pos += n
            return raw

        def u8() -> int:
            nonlocal pos
            if pos >= stop:
                take(1)
            pos += 1
            return buf[pos - 1]

        def line() -> bytes:
            nonlocal pos
            i = buf.find(b"\n", pos, stop)
            if i < 0:
                if stop < end:
                    raise _TooLong
                raise _Refused("pickle data was truncated (a text argument has no newline)")
            raw = bytes(buf[pos:i])
            pos = i + 1
            return raw

        def text(raw: bytes) -> str:
            return raw.decode("utf-8", "surrogatepass")

        def pop_mark() -> list[Any]:
            if not marks:
                raise _Refused("could not find MARK")
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            return items

        def put(idx: int) -> None:
            if not stack:
                raise _Refused("PUT with an empty stack")
            if idx not in memo and len(memo) >= MAX_MEMO:
                raise _Limit("the pickle's memo has too many entries", f"<= {MAX_MEMO}", f"more than {MAX_MEMO}")
            memo[idx] = stack[-1]

        def get(idx: int) -> None:
            try:
                push(memo[idx])
            except KeyError:
                raise _Refused(f"memo key {idx} is not defined") from None

        def too_big(n: int) -> None:
            raise _Limit("an integer in the pickle is too large", f"<= {MAX_INT_BYTES} bytes", f"{n} bytes")

        # ---- one small function per opcode (a table lookup costs the same for every opcode)
        def binput() -> None:
            put(u8())

        def binget() -> None:
            nonlocal pos
            if pos >= stop:
                take(1)
            pos += 1
            try:
                push(memo[buf[pos - 1]])
            except KeyError:
                raise _Refused(f"memo key {buf[pos - 1]} is not defined") from None

        def long_binput() -> None:
            put(_U32.unpack(take(4))[0])

        def long_binget() -> None:
            get(_U32.unpack(take(4))[0])

        def memoize() -> None:
            put(len(memo))

        def binunicode() -> None:
            push(text(take(_U32.unpack(take(4))[0])))

        def short_binunicode() -> None:
            push(text(take(u8())))

        def binunicode8() -> None:
            push(text(take(_U64.unpack(take(8))[0])))

        def mark() -> None:
            marks.append(len(stack))
            if len(marks) > MAX_DEPTH:
                raise _Limit("MARKs are nested too deeply", f"<= {MAX_DEPTH}", len(marks))

        def tuple_() -> None:
            push(self.tuple_of(pop_mark()))

        def tuple_n(n: int) -> Any:
            def op() -> None:
                if len(stack) < n:
                    raise _Refused("stack underflow")
                items = stack[-n:]
                del stack[-n:]
                push(self.tuple_of(items))
            return op

        def empty_tuple() -> None:
            push(self.tuple_of(()))

        def binint1() -> None:
            nonlocal pos
            if pos >= stop:
                take(1)
            push(buf[pos])
            pos += 1

        def binint2() -> None:
            push(_U16.unpack(take(2))[0])

        def binint() -> None:
            push(_I32.unpack(take(4))[0])

        def long1() -> None:
            n = u8()
            if n > MAX_INT_BYTES:
                too_big(n)
            push(int.from_bytes(take(n), "little", signed=True))

        def long4() -> None:
            n = _I32.unpack(take(4))[0]
            if n < 0:
                raise _Refused("LONG pickle has negative byte count")
            if n > MAX_INT_BYTES:
                too_big(n)
            push(int.from_bytes(take(n), "little", signed=True))

        def binfloat() -> None:
            push(_F64.unpack(take(8))[0])

        def none() -> None:
            push(None)

        def newtrue() -> None:
            push(True)

        def newfalse() -> None:
            push(False)

        def reduce() -> None:
            args = spop()
            stack[-1] = self.call(stack[-1], args)

        def empty_dict() -> None:
            push(self.new_dict())

        def setitems() -> None:
            items = pop_mark()
            self.set_items(stack[-1], items)

        def setitem() -> None:
            v = spop()
            k = spop()
            self.set_items(stack[-1], [k, v])

        def dict_() -> None:
            items = pop_mark()
            d = self.new_dict()
            self.set_items(d, items)
            push(d)

        def empty_list() -> None:
            push(self.note([], 1, _NOT_KEY, new=True))

        def appends() -> None:
            items = pop_mark()
            self.extend(stack[-1], items)

        def append() -> None:
            v = spop()
            self.extend(stack[-1], [v])

        def list_() -> None:
            items = pop_mark()
            lst = self.note([], 1, _NOT_KEY, new=True)
            self.extend(lst, items)
            push(lst)

        def empty_set() -> None:
            push(self.new_set(set, [], "set()"))

        def additems() -> None:
            items = pop_mark()
            s = stack[-1]
            if type(s) is not set:
                raise _Refused(f"ADDITEMS to a {type(s).__name__}, not a set")
            for x in items:
                s.add(self.key(x, "a set member"))
            self.count(len(items), len(s))
            self.grow(s, items)

        def frozenset_() -> None:
            push(self.new_set(frozenset, pop_mark(), "frozenset()"))

        def global_() -> None:
            module = text(line())
            push(self.plain(self.find_class(module, text(line()))))

        def stack_global() -> None:
            name = spop()
            module = spop()
            if type(name) is not str or type(module) is not str:
                raise _Refused("STACK_GLOBAL requires str module and name")
            push(self.plain(self.find_class(module, name)))

        def binpersid() -> None:
            stack[-1] = self.plain(self.persistent_load(stack[-1]))

        def persid() -> None:
            push(self.plain(self.persistent_load(line().decode("ascii"))))

        def newobj() -> None:
            args = spop()
            stack[-1] = self.new_object(stack[-1], args)

        def newobj_ex() -> None:
            kwargs = spop()
            args = spop()
            stack[-1] = self.new_object(stack[-1], args, kwargs)

        def build() -> None:
            state = spop()
            self.build(stack[-1], state)

        def inst() -> None:
            module = text(line())
            cls = self.find_class(module, text(line()))
            push(self.call(cls, self.tuple_of(pop_mark())))

        def obj() -> None:
            items = pop_mark()
            if not items:
                raise _Refused("OBJ without a class")
            push(self.call(items[0], self.tuple_of(items[1:])))

        def proto() -> None:
            p = u8()
            if p > pickle.HIGHEST_PROTOCOL:
                raise _Refused(f"unsupported pickle protocol: {p}")

        def frame() -> None:  # a hint for buffered readers; we read from memory
            take(8)

        def stop_() -> None:
            if not stack:
                raise _Refused("STOP with an empty stack")
            done.append(spop())

        def pop() -> None:
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                spop()

        def pop_mark_() -> None:
            pop_mark()

        def dup() -> None:
            push(stack[-1])

        def binbytes() -> None:
            push(take(_U32.unpack(take(4))[0]))

        def short_binbytes() -> None:
            push(take(u8()))

        def binbytes8() -> None:
            push(take(_U64.unpack(take(8))[0]))

        def bytearray8() -> None:
            push(self.plain(bytearray(take(_U64.unpack(take(8))[0]))))

        def binstring() -> None:  # protocol 1 str, read as utf-8
            push(take(_I32.unpack(take(4))[0]).decode("utf-8"))

        def short_binstring() -> None:
            push(take(u8()).decode("utf-8"))

        def int_() -> None:
            raw = line()
            push(False if raw == b"00" else True if raw == b"01" else _decode_long_text(raw))

        def long_() -> None:
            raw = line()
            push(_decode_long_text(raw[:-1] if raw.endswith(b"L") else raw))

        def float_() -> None:
            push(float(line()))

        def string() -> None:
            raw = line()
            if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
                raise _Refused("the STRING opcode argument must be quoted")
            push(codecs.escape_decode(raw[1:-1])[0].decode("utf-8"))

        def unicode() -> None:
            push(line().decode("raw-unicode-escape"))

        def get_() -> None:
            get(_decode_long_text(line()))

        def put_() -> None:
            put(_decode_long_text(line()))

        def ext(size: int) -> Any:
            def op() -> None:
                raw = take(size)
                code = raw[0] if size == 1 else _U16.unpack(raw)[0] if size == 2 else _I32.unpack(raw)[0]
                pair = copyreg._inverted_registry.get(code)  # type: ignore[attr-defined]
                if pair is None:
                    raise _Refused(f"unregistered extension code {code}")
                push(self.plain(self.find_class(*pair)))
            return op

        def buffer() -> None:
            raise _Refused("out-of-band buffers (NEXT_BUFFER) are not part of a checkpoint")

        table: list[Any] = [None] * 256
        for code, fn in {
            b"q": binput, b"h": binget, b"r": long_binput, b"j": long_binget, b"\x94": memoize,
            b"X": binunicode, b"\x8c": short_binunicode, b"\x8d": binunicode8, b"(": mark, b"t": tuple_,
            b"\x85": tuple_n(1), b"\x86": tuple_n(2), b"\x87": tuple_n(3), b")": empty_tuple,
            b"K": binint1, b"M": binint2, b"J": binint, b"\x8a": long1, b"\x8b": long4, b"G": binfloat,
            b"N": none, b"\x88": newtrue, b"\x89": newfalse, b"R": reduce, b"}": empty_dict, b"u": setitems,
            b"s": setitem, b"d": dict_, b"]": empty_list, b"e": appends, b"a": append, b"l": list_,
            b"\x8f": empty_set, b"\x90": additems, b"\x91": frozenset_, b"c": global_,
            b"\x93": stack_global, b"Q": binpersid, b"P": persid, b"\x81": newobj, b"\x92": newobj_ex,
            b"b": build, b"i": inst, b"o": obj, b"\x80": proto, b"\x95": frame, b".": stop_, b"0": pop,
            b"1": pop_mark_, b"2": dup, b"B": binbytes, b"C": short_binbytes, b"\x8e": binbytes8,
            b"\x96": bytearray8, b"T": binstring, b"U": short_binstring, b"I": int_, b"L": long_,
            b"F": float_, b"S": string, b"V": unicode, b"g": get_, b"p": put_, b"\x82": ext(1),
            b"\x83": ext(2), b"\x84": ext(4), b"\x97": buffer, b"\x98": buffer,
        }.items():
            table[code[0]] = fn

        ops = 0
        while not done:
            if pos >= stop:
                take(1)  # raises: truncated, or over MAX_PICKLE_BYTES
            handler = table[buf[pos]]
            pos += 1
            if handler is None:
                raise _Refused(f"invalid load key {chr(buf[pos - 1])!r} (opcode 0x{buf[pos - 1]:02x}) "
                               f"at offset {pos - 1}")
            handler()
            ops += 1
            if not ops & 1023:
                if ops > MAX_OPCODES:
                    raise _Limit("the pickle has too many opcodes", f"<= {MAX_OPCODES}", f"more than {MAX_OPCODES}")
                if len(stack) > MAX_CONTAINER_ITEMS:
                    raise _Limit("the pickle's stack holds too many values", f"<= {MAX_CONTAINER_ITEMS}",
                                 len(stack))
        return done[0], pos


_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")
_CALLABLES = (_rebuild_tensor, _rebuild_parameter, _torch_size, _torch_device, _codecs_encode)


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
        machine = _Machine(self._find_class, storage_for)
        try:
            return machine.run(buf, pos, len(buf))
        except ConvertBnbError:
            raise
        except _Refused as exc:
            raise self._fail(MalformedPickleError, f"malformed pickle: {exc}") from None
        except _Limit as exc:
            raise self._fail(PickleLimitError, str(exc), expected=exc.expected,
                             found=exc.found,
                             hint="a torch.save state dict is far within it; this file is damaged or hostile") from None
        except _TooLong:
            raise self._fail(PickleTooLargeError, "pickle data is larger than the limit",
                             expected=f"<= {MAX_PICKLE_BYTES} bytes", found=f"more than {MAX_PICKLE_BYTES}") from None
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
            if pinfo.file_size > MAX_PICKLE_BYTES:  # the declared size, checked before inflating anything
                raise self._fail(PickleTooLargeError, "data.pkl is larger than the limit",
                                 expected=f"<= {MAX_PICKLE_BYTES} bytes", found=pinfo.file_size)
            try:
                with zf.open(pinfo) as fh:  # and a cap on what inflating may produce, whatever was declared
                    data = fh.read(MAX_PICKLE_BYTES + 1)
            except _ZIP_ERRORS as exc:
                raise self._fail(NotTorchCheckpointError, f"cannot read data.pkl ({exc})") from None
            if len(data) > MAX_PICKLE_BYTES:
                raise self._fail(PickleTooLargeError, "data.pkl is larger than the limit",
                                 expected=f"<= {MAX_PICKLE_BYTES} bytes", found=f"more than {MAX_PICKLE_BYTES}")

            def storage_for(pid: Any) -> _Storage:
                if type(pid) is not tuple or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
                    raise _Refused(
                        f"persistent id must be ('storage', type, key, location, numel), got {_summary(pid)}"
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
            raise _Refused(f"storage type must be a torch storage global, got {type(stype).__name__}")
        if isinstance(key, bytes):
            key = key.decode("ascii", "replace")
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise _Refused(f"storage key must be a string, got {type(key).__name__}")
        key = str(key)
        if len(key) > 256:
            raise _Refused(f"storage key must be at most 256 characters, got {len(key)}")
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

        buf = self._map()  # the pickles are parsed in place; each may span at most MAX_PICKLE_BYTES
        magic, pos = self._unpickle(buf, 0, no_storage)
        if type(magic) is not int or magic != LEGACY_MAGIC:
            raise self._fail(NotTorchCheckpointError, "a pickle, but not a torch checkpoint (no torch magic number)",
                             expected=hex(LEGACY_MAGIC), found=_summary(magic, 40),
                             hint="plain pickles are never read: they can run code")
        proto, pos = self._unpickle(buf, pos, no_storage)
        if type(proto) is not int or proto != LEGACY_PROTOCOL:
            raise self._fail(NotTorchCheckpointError, "unknown legacy torch protocol version", expected=LEGACY_PROTOCOL,
                             found=_summary(proto, 40))
        sys_info, pos = self._unpickle(buf, pos, no_storage)
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise self._fail(ByteOrderError, "only little-endian checkpoints are read",
                             expected="little", found="big")

        def storage_for(pid: Any) -> _Storage:
            if type(pid) is not tuple or len(pid) != 6 or pid[0] not in ("storage", b"storage"):
                is_module = type(pid) is tuple and bool(pid) and type(pid[0]) is str and pid[0] == "module"
                what = "a whole nn.Module" if is_module else _summary(pid)
                raise _Refused(
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
                raise self._fail(StorageRecordError, f"storage '{_clip(str(k))}' is listed but no tensor uses it")
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
                             found=_summary(missing, 120))
        return obj

    # ------------------------------------------------------------------------------- flattening

    def _collect(self, obj: Any) -> None:
        """Flatten the state dict into ``tensors`` and ``values``: iterative, depth- and budget-bounded."""
        self._budget = MAX_VALUE_NODES
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
                raise self._fail(NotStateDictError, "state dict keys must be strings", found=_summary(k, 60))
            name = prefix + k
            self._spend(name)
            if isinstance(v, _Tensor):
                self._add_name(name)
                self._add_tensor(name, v)
            elif isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
                if len(frames) >= MAX_DEPTH:
                    raise self._fail(NotStateDictError, "values are nested too deeply", tensor=_clip(name),
                                     expected=f"<= {MAX_DEPTH} levels")
                frames.append((iter(v.items()), name + "."))
            else:
                self._add_name(name)
                self.values[name] = self._value(v, name)

    def _add_name(self, name: str) -> None:
        if name in self.tensors or name in self.values:
            raise self._fail(NotStateDictError, "a name appears twice after flattening nested dicts", tensor=name)

    def _spend(self, name: str) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise self._fail(NotStateDictError, "the pickle holds too many values", tensor=_clip(name),
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
        if isinstance(v, _Object):
            return False, [PickledObject, iter(v.state.items()), [], name, v._cls_name, None]
        if isinstance(v, (_Storage, _StorageType)):
            raise self._fail(NotStateDictError, "a bare storage is not a tensor", tensor=_clip(name))
        return True, v

    def _value(self, root: Any, root_name: str) -> Any:
        """A non-tensor value rebuilt as plain data, tensors inside it replaced by :class:`TensorRef`.

        Walks with an explicit stack: depth <= MAX_DEPTH (a self-referencing list ends there), nodes
        <= MAX_VALUE_NODES in all (a list shared 2**40 ways ends there).
        """
        leaf, out = self._open(root, root_name)
        if leaf:
            return out
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
                if len(frames) >= MAX_DEPTH:
                    raise self._fail(NotStateDictError, "values are nested too deeply", tensor=_clip(root_name),
                                     expected=f"<= {MAX_DEPTH} levels")
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
        stop = byte_range(name, start, stop, info.nbytes)
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

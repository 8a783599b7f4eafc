"""bitsandbytes' on-disk layout of a 4-bit layer: QuantState parsing, grouping and validation.

A 4-bit Linear weight ``P.weight`` is stored (``Linear4bit._save_to_state_dict`` /
``QuantState.as_dict(packed=True)``) as:

==============================================  =========================  ============================
key                                             dtype / shape              content
==============================================  =========================  ============================
``P.weight``                                    U8 (any storage dtype),    packed codes over the flat
                                                any shape of ceil(n/2) B   row-major tensor, high nibble
                                                                           = even element
``P.weight.absmax``                             F32 [ceil(n/bs)]           per-block absmax
                                                (U8 if nested)             (nested: 8-bit codes)
``P.weight.nested_absmax``                      F32 [ceil(n_absmax/256)]   nested only
``P.weight.nested_quant_map``                   F32 [256]                  nested only: dynamic map
``P.weight.quant_map``                          F32 [16]                   the NF4 or FP4 table
``P.weight.quant_state.bitsandbytes__nf4|fp4``  U8 [len]                   JSON: quant_type, blocksize,
                                                                           dtype, shape, nested_*
==============================================  =========================  ============================

The unpacked layout (``as_dict(packed=False)``) carries the JSON's fields as separate entries
``P.weight.quant_type``, ``P.weight.blocksize``, ... (tensors, or Python values in pickles).

Validation rules, each with its own subclass of :class:`~formats.errors.BnbLayerError` (see
docs/errors.md), naming file, tensor and rule:

=======  ==========================================================================================
BNB-001  quant_type is "nf4" or "fp4"
BNB-002  blocksize is a power of two in [32, 4096]
BNB-003  the packed weight holds exactly ceil(n / 2) bytes, n = prod(QuantState shape)
BNB-004  absmax holds ceil(n / blocksize) values (F32, or U8 codes when nested; F16/BF16 accepted)
BNB-005  quant_map holds the 16 fp32 values of the table for quant_type (bit for bit)
BNB-006  nested fields are all present or all absent
BNB-007  nested_quant_map holds 256 fp32 values
BNB-008  nested_absmax holds ceil(n_absmax / nested_blocksize) values
BNB-009  the QuantState JSON / fields are valid (object, required fields present, right types; the
         JSON within :mod:`formats.jsonfile`'s limits: 1 MiB, nesting, integer digits)
BNB-010  a QuantState component has its weight
BNB-011  a weight with QuantState components has all the required ones (absmax, quant_map, state)
BNB-012  absmax (after undoing double quantization) is finite
BNB-013  dtype is float16, bfloat16 or float32
BNB-014  shape is a list of positive integers
BNB-015  an int8 layer has weight I8 [out, in] and SCB F32 [out]
BNB-016  an int8 layer's weight_format is 0 / "row" (col32, col_turing, col_ampere are refused)
BNB-017  a legacy QuantState (list or pickled object) has the documented layout
BNB-018  absmax has a dtype bnb writes (F32/F16/BF16; U8 codes when nested)
BNB-019  one QuantState per weight (packed, unpacked or legacy), whose key names the quant type of its JSON
BNB-020  an int8 weight has its SCB: a ``P.weight_format`` without ``P.SCB``, or an I8 ``P.weight`` without
         ``P.SCB`` in a model whose config says ``load_in_8bit``, is an LLM.int8 layer missing its scales
=======  ==========================================================================================

Layouts from older or buggy bitsandbytes, all accepted (bnb-format.md section 1):

- **legacy list QuantState** (old ``.bin`` pickles), stored as a non-tensor value ``P.weight.quant_state``
  (or ``P.quant_state``): ``[absmax, shape, dtype, blocksize, compressed, quant_type]`` with ``compressed``
  None or ``[offset, state2]``; ``state2`` is ``[absmax2, code2, blocksize2, nested, dtype2, offset2,
  state3]`` (bnb 0.40), ``(absmax2, code2)`` (bnb 0.39: blocksize2 inferred from the counts) or a pickled
  ``QuantState``. A pickled ``QuantState`` object (``absmax``, ``shape``, ``dtype``, ``blocksize``,
  ``quant_type``, ``offset``, ``state2``) is read the same way. The quant_map is the table of quant_type.
- **absmax saved after a CPU forward**: F16/BF16 absmax (upcast exactly), a 2-D absmax of shape
  ``(K/blocksize, N)`` for a weight ``(N, K)`` (the transpose of the flat order; read as
  ``absmax.T.reshape(-1)``), ``nested_dtype`` other than float32. Each is reported in
  :attr:`QuantizedLayer.warnings` (the library never prints).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from . import jsonfile
from .dtypes import FLOAT_OUTPUTS, DType, by_numpy, float_dtype_name
from .errors import (
    AbsmaxCountError,
    AbsmaxDtypeError,
    BlocksizeError,
    BnbLayerError,
    ConflictingQuantStateError,
    ConvertBnbError,
    Int8LayoutError,
    Int8ScaleMissingError,
    Int8WeightFormatError,
    LegacyQuantStateError,
    MissingComponentError,
    NestedAbsmaxError,
    NestedFieldsError,
    NestedQuantMapError,
    OrphanComponentError,
    PackedSizeError,
    QuantDtypeError,
    QuantMapError,
    QuantShapeError,
    QuantStateJsonError,
    QuantTypeError,
)
from .torch_pickle import PickledObject, TensorRef

__all__ = [
    "BLOCKSIZES",
    "ConstTensor",
    "DYNAMIC_MAP_SIGNED",
    "FP4_TABLE",
    "NF4_TABLE",
    "QUANT_TABLES",
    "Int8Layer",
    "QuantState",
    "QuantizedLayer",
    "TensorLike",
    "group_layers",
    "is_int8_config",
    "parse_quant_state",
]


def _table(hexstr: str) -> npt.NDArray[np.float32]:
    arr = np.frombuffer(bytes.fromhex(hexstr), dtype="<f4").astype(np.float32)
    arr.setflags(write=False)
    return arr


#: bitsandbytes' NF4 table (``get_4bit_type("nf4")``), fp32, indexed by code.
NF4_TABLE = _table(
    "000080bfb13932bf306b06bfa032cabe4da291be3f353dbe7178babd00000000fffaa23de3ca243edd047c3e3a03ad3e"
    "b8a4e13eab07103fb313393f0000803f"
)
#: bitsandbytes' FP4 table (``get_4bit_type("fp4")``), fp32, indexed by code; +0.0 at codes 0 and 8.
FP4_TABLE = _table(
    "00000000abaaaa3babaa2a3f0000803fabaaaa3e0000003fabaa2a3e0000803e00000000abaaaabbabaa2abf000080bf"
    "abaaaabe000000bfabaa2abe000080be"
)
#: bitsandbytes' signed dynamic map (``create_dynamic_map(signed=True)``), fp32[256]: nested_quant_map.
DYNAMIC_MAP_SIGNED = _table(
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf"
    "000053bf66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbf"
    "cdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf"
    "3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe"
    "cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327be"
    "cdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd"
    "0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd"
    "a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc"
    "643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb"
    "5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b9"
    "4b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36ff0502370642b237"
    "34803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a"
    "fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c"
    "cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d"
    "6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3d"
    "eb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d"
    "0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e"
    "6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33e"
    "ccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f"
    "9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f"
    "cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f"
    "0000773f9a997a3f33337e3f0000803f"
)
QUANT_TABLES: dict[str, npt.NDArray[np.float32]] = {"nf4": NF4_TABLE, "fp4": FP4_TABLE}
#: Blocksizes bitsandbytes writes for 4-bit weights.
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Blocksizes of the 8-bit quantization of absmax (bnb writes 256; bnb 0.39 wrote 4096).
NESTED_BLOCKSIZES = BLOCKSIZES
#: The tensors stored beside a 4-bit ``P.weight`` as ``P.weight.<component>`` (nested ones only when nested).
QUANT_STATE_COMPONENTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
#: The QuantState JSON's component is ``quant_state.bitsandbytes__<quant_type>``.
STATE_KEY_PREFIX = "quant_state.bitsandbytes__"
_COMPONENT_NAMES = frozenset(QUANT_STATE_COMPONENTS)
_UNPACKED_FIELDS = (
    "quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset",
)
#: The tensors stored beside an LLM.int8 ``P.weight``: ``P.SCB`` and ``P.weight_format``.
INT8_COMPONENTS = ("SCB", "weight_format")
#: bitsandbytes' int8 weight_format codes (``Linear8bitLt``: format_to_int).
INT8_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}


class TensorLike(Protocol):
    """What a container reader hands out per tensor (see formats.checkpoint.TensorRecord)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> DType: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def file(self) -> str: ...

    @property
    def numel(self) -> int: ...

    def raw(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]: ...

    def array(self) -> np.ndarray: ...

    def release(self, start: int = 0, stop: int | None = None) -> None: ...


@dataclass(frozen=True)
class QuantState:
    """The parameters of one 4-bit weight (bitsandbytes ``functional.QuantState``, minus the arrays).

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: elements per absmax block (32..4096).
        dtype: the weight's dtype before quantization, a torch name (``"bfloat16"``): the natural
            output dtype.
        shape: the logical shape of the weight, in elements.
        nested: whether absmax is itself 8-bit quantized (double quantization).
        nested_blocksize: absmax values per nested block (256 in bnb), or None.
        nested_dtype: torch name of the dtype the nested steps round to, or None.
        nested_offset: the mean subtracted before nested quantization; a Python float that holds an
            fp32 exactly (``np.float32(nested_offset)`` recovers it bit for bit), or None.
    """

    quant_type: str
    blocksize: int
    dtype: str
    shape: tuple[int, ...]
    nested: bool = False
    nested_blocksize: int | None = None
    nested_dtype: str | None = None
    nested_offset: float | None = None

    @property
    def numel(self) -> int:
        """n = prod(shape), a Python int."""
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        """ceil(n / blocksize): the number of absmax values."""
        return -(-self.numel // self.blocksize)

    @property
    def packed_nbytes(self) -> int:
        """ceil(n / 2): bytes of packed codes."""
        return -(-self.numel // 2)

    @property
    def n_nested_blocks(self) -> int:
        """ceil(n_blocks / nested_blocksize), 0 when not nested."""
        if not self.nested or not self.nested_blocksize:
            return 0
        return -(-self.n_blocks // self.nested_blocksize)

    def to_json(self) -> str:
        """The packed JSON exactly as bitsandbytes writes it (``json.dumps``, default separators)."""
        obj: dict[str, Any] = {
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        if self.nested:
            obj["nested_blocksize"] = self.nested_blocksize
            obj["nested_dtype"] = self.nested_dtype
            obj["nested_offset"] = float(np.float32(self.nested_offset))
        return json.dumps(obj)


@dataclass(frozen=True)
class QuantizedLayer:
    """A 4-bit weight and its companions, grouped by exact prefix.

    Attributes:
        name: the weight's name, ``P.weight``.
        state: the parsed :class:`QuantState`.
        packed: the packed codes (any storage dtype; read as raw bytes).
        absmax: F32 [n_blocks], or U8 codes when nested (F16/BF16 and a 2-D transposed layout occur).
        quant_map: F32 [16].
        nested_absmax: F32 [n_nested_blocks] or None.
        nested_quant_map: F32 [256] or None.
        components: every tensor name this layer consumes (the weight included).
        absmax_transposed: absmax is stored 2-D as ``(K/blocksize, N)`` (bnb CPU forward path).
        warnings: what was unusual about the layer (BF16 absmax, transposed absmax, nested_dtype,
            legacy QuantState), one sentence each, for the caller to show.
    """

    name: str
    state: QuantState
    packed: TensorLike
    absmax: TensorLike
    quant_map: TensorLike
    nested_absmax: TensorLike | None = None
    nested_quant_map: TensorLike | None = None
    components: tuple[str, ...] = field(default=())
    absmax_transposed: bool = False
    warnings: tuple[str, ...] = field(default=())

    def absmax_flat(self) -> np.ndarray:
        """The stored absmax in bitsandbytes' flat block order, in its stored dtype.

        Returns:
            ``[n_blocks]`` of the stored dtype (F32/F16/BF16 values, or U8 codes when nested): a
            zero-copy view, or a small copy when the absmax is stored transposed.
        """
        arr = self.absmax.array()
        if self.absmax_transposed:
            return np.ascontiguousarray(arr.T).reshape(-1)
        return arr.reshape(-1)


@dataclass(frozen=True)
class Int8Layer:
    """An LLM.int8 weight: ``P.weight`` I8 [out, in], ``P.SCB`` F32 [out], optional ``P.weight_format``."""

    name: str
    weight: TensorLike
    scb: TensorLike
    weight_format: TensorLike | None
    components: tuple[str, ...] = field(default=())

    @property
    def shape(self) -> tuple[int, ...]:
        """[out, in] in elements."""
        return tuple(self.weight.shape)


class ConstTensor:
    """An in-memory tensor that stands where a file holds none (e.g. the quant_map a legacy
    QuantState implies). Implements :class:`TensorLike`.

    Args:
        name: a name for messages.
        array: the values (kept read-only).
        file: the file the layer came from.
    """

    def __init__(self, name: str, array: np.ndarray, file: str) -> None:
        self.name = name
        self._array = np.ascontiguousarray(array)
        self._array.setflags(write=False)
        self.dtype: DType = by_numpy(self._array.dtype)
        self.shape: tuple[int, ...] = tuple(self._array.shape)
        self.nbytes: int = self._array.nbytes
        self._file = file

    @property
    def file(self) -> str:
        """The file the owning layer came from."""
        return self._file

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(self._array.size)

    def raw(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.uint8]:
        """Bytes [start, stop) of the values."""
        return self._array.reshape(-1).view(np.uint8)[start:stop]

    def array(self) -> np.ndarray:
        """The values."""
        return self._array

    def release(self, start: int = 0, stop: int | None = None) -> None:
        """Nothing to release."""


def _err(
    cls: type[BnbLayerError], t: TensorLike | None, name: str, message: str, **kw: Any
) -> BnbLayerError:
    return cls(message, path=t.file if t is not None else None, tensor=name, **kw)


def _scalar(value: Any, name: str, t: TensorLike | None) -> Any:
    """An unpacked field's value: Python values pass; tensors become int/float/str/list."""
    if not hasattr(value, "raw"):
        return value
    arr = value.array()
    if value.dtype.code == "U8" and arr.ndim == 1 and arr.size > 0 and arr.max() >= 32:
        return bytes(arr).decode("utf-8", errors="replace")
    if arr.ndim == 0:
        return arr.item()
    return [x.item() for x in arr.reshape(-1)]


def parse_quant_state(
    fields: Mapping[str, Any], weight: str, source: TensorLike | None, key_quant_type: str | None = None
) -> QuantState:
    """Build a :class:`QuantState` from the JSON object (packed) or the unpacked fields.

    Matches bitsandbytes ``QuantState.from_dict``. ``key_quant_type`` is the quant type named by
    the ``quant_state.bitsandbytes__<type>`` key, checked against the JSON.

    Raises:
        BnbLayerError: BNB-001, BNB-002, BNB-006, BNB-009, BNB-013 or BNB-014.
    """

    def bad(message: str, **kw: Any) -> BnbLayerError:
        return _err(QuantStateJsonError, source, weight, message, **kw)

    for req in ("quant_type", "blocksize", "dtype", "shape"):
        if req not in fields:
            raise bad(f"QuantState field '{req}' is missing", expected=list(_UNPACKED_FIELDS[:4]),
                      found=sorted(fields))
    qt = fields["quant_type"]
    if not isinstance(qt, str):
        raise bad("QuantState field 'quant_type' must be a string", found=qt)
    if qt not in QUANT_TABLES:
        raise _err(QuantTypeError, source, weight, "quant_type must be nf4 or fp4", expected="'nf4' or 'fp4'", found=qt)
    if key_quant_type is not None and key_quant_type != qt:
        raise _err(ConflictingQuantStateError, source, weight,
                   "the quant_state key and its JSON name different quant types",
                   expected=key_quant_type, found=qt)
    bs = fields["blocksize"]
    if not isinstance(bs, int) or isinstance(bs, bool):
        raise bad("QuantState field 'blocksize' must be an integer", found=bs)
    if bs not in BLOCKSIZES:
        raise _err(BlocksizeError, source, weight, "blocksize must be a power of two from 32 to 4096",
                   expected=list(BLOCKSIZES), found=bs)
    dt = float_dtype_name(fields["dtype"])
    if dt is None:
        raise _err(QuantDtypeError, source, weight, "dtype must be float16, bfloat16 or float32",
                   expected=list(FLOAT_OUTPUTS), found=fields["dtype"])
    shape = fields["shape"]
    if isinstance(shape, tuple):
        shape = list(shape)
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise _err(QuantShapeError, source, weight, "shape must be a non-empty list of positive integers",
                   expected="[d0, d1, ...] with integers > 0", found=shape)
    nested_keys = [k for k in ("nested_blocksize", "nested_dtype", "nested_offset") if k in fields]
    if not nested_keys:
        return QuantState(qt, bs, dt, tuple(shape))
    if len(nested_keys) != 3:
        missing = sorted({"nested_blocksize", "nested_dtype", "nested_offset"} - set(nested_keys))
        raise _err(NestedFieldsError, source, weight, "nested fields must be all present or all absent",
                   expected="nested_blocksize, nested_dtype, nested_offset", found=f"missing {missing}")
    nbs, ndt, off = fields["nested_blocksize"], fields["nested_dtype"], fields["nested_offset"]
    if not isinstance(nbs, int) or isinstance(nbs, bool) or nbs <= 0:
        raise bad("QuantState field 'nested_blocksize' must be a positive integer", found=nbs)
    if nbs not in NESTED_BLOCKSIZES:
        raise _err(BlocksizeError, source, weight, "nested_blocksize must be a power of two from 32 to 4096",
                   expected=list(NESTED_BLOCKSIZES), found=nbs)
    ndt = float_dtype_name(fields["nested_dtype"])
    if ndt is None:
        raise _err(QuantDtypeError, source, weight, "nested_dtype must be float16, bfloat16 or float32",
                   expected=list(FLOAT_OUTPUTS), found=fields["nested_dtype"])
    if not isinstance(off, (int, float)) or isinstance(off, bool) or not _finite(off):
        raise bad("QuantState field 'nested_offset' must be a finite number", found=off)
    with np.errstate(over="ignore"):
        off32 = np.float32(off)
    if not np.isfinite(off32):
        raise bad("QuantState field 'nested_offset' must be a finite float32", found=off)
    return QuantState(qt, bs, dt, tuple(shape), True, nbs, ndt, float(off32))


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def state_key(quant_type: str) -> str:
    """The QuantState JSON's component name for ``quant_type``: ``quant_state.bitsandbytes__nf4`` (or fp4)."""
    return STATE_KEY_PREFIX + quant_type


def component_name(weight_name: str, component: str) -> str:
    """The on-disk name of a 4-bit weight's component: (``P.weight``, ``absmax``) -> ``P.weight.absmax``."""
    return f"{weight_name}.{component}"


def int8_scale_name(weight_name: str) -> str:
    """The on-disk name of an LLM.int8 weight's row scales: ``P.weight`` -> ``P.SCB``."""
    return weight_name[: -len("weight")] + "SCB" if weight_name.endswith(".weight") else weight_name + ".SCB"


def split_component(name: str) -> tuple[str, str] | None:
    """Split ``P.weight.<component>`` into (``P.weight``, component) for 4-bit QuantState components.

    Returns:
        None when ``name`` is not a QuantState component (the packed weight itself, int8 parts, ...).
    """
    marker = "." + STATE_KEY_PREFIX
    i = name.rfind(marker)
    if i > 0:
        return name[:i], name[i + 1:]
    base, dot, last = name.rpartition(".")
    if dot and last in _COMPONENT_NAMES:  # one set lookup per name: 10^5 names in a big checkpoint
        return base, last
    return None


def is_component(name: str) -> bool:
    """Whether ``name`` is stored beside a quantized weight (QuantState or int8 parts), not a weight itself."""
    return split_component(name) is not None or name.endswith(tuple("." + c for c in INT8_COMPONENTS))


def _refs(value: Any, out: set[str]) -> set[str]:
    """Names of every tensor referenced inside a pickled value."""
    if isinstance(value, TensorRef):
        out.add(value.name)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _refs(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _refs(v, out)
    elif isinstance(value, PickledObject):
        _refs(value.state, out)
    return out


def is_int8_config(config: Any) -> bool:
    """Whether a transformers ``config.json`` object says the model is LLM.int8 (``load_in_8bit``)."""
    if not isinstance(config, dict):
        return False
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("load_in_8bit") is True


#: Orphan components that get a "it may belong to ..." hint (a fuzzy search over every weight name).
_ORPHAN_HINTS = 5


def group_layers(
    tensors: Mapping[str, TensorLike],
    values: Mapping[str, Any] | None = None,
    problems: list[ConvertBnbError] | None = None,
    int8_model: bool = False,
) -> tuple[dict[str, QuantizedLayer | Int8Layer], list[str]]:
    """Group bitsandbytes companions with their weights by exact prefix.

    Args:
        tensors: every tensor of a checkpoint, name -> record.
        values: non-tensor values of a torch pickle (``Checkpoint.values``): unpacked QuantState
            fields, legacy list QuantStates, int8 ``weight_format``; tensors inside them are
            :class:`~formats.torch_pickle.TensorRef` into ``tensors``.
        problems: when given, a broken layer's error is appended to it and the layer (with its
            components) is left out of both results, so every layer can be checked
            (``convert-bnb check``); without, the first error is raised.
        int8_model: the config says ``load_in_8bit`` (:func:`is_int8_config`): an I8 ``P.weight``
            without ``P.SCB`` is then a broken int8 layer (BNB-020), not a plain int8 tensor.

    Returns:
        (layers by weight name, names of the remaining plain tensors in input order).

    Raises:
        BnbLayerError: any BNB-xxx rule, one subclass per rule (e.g. :class:`~formats.errors.QuantMapError`;
            BNB-016 :class:`~formats.errors.Int8WeightFormatError` is also an ``UnsupportedError``).
    """

    def report(exc: ConvertBnbError) -> None:
        if problems is None:
            raise exc
        problems.append(exc)

    values = values or {}
    inner: set[str] = set()
    for v in values.values():
        _refs(v, inner)
    by_weight: dict[str, dict[str, Any]] = {}
    broken: set[str] = set()
    orphans: list[tuple[str, str, TensorLike]] = []
    for name, t in tensors.items():
        if name in inner:
            continue
        split = split_component(name)
        if split is None:
            continue
        base, comp = split
        if base not in tensors:
            orphans.append((base, comp, t))
            broken.add(name)
            continue
        by_weight.setdefault(base, {})[comp] = t
    lone_weights = [n for n in tensors if n.endswith(".weight") and n not in by_weight
                    and split_component(n) is None] if orphans else []
    for k, (base, comp, t) in enumerate(orphans):
        # a weight of another prefix that lacks this component is the likely owner; the search is
        # linear per orphan, so only the first few get it (check mode reports every orphan)
        close: list[str] = []
        if k < _ORPHAN_HINTS:
            owners = [w for w, comps in by_weight.items() if comp not in comps] + lone_weights
            close = difflib.get_close_matches(base, owners, n=1, cutoff=0.6)
        report(_err(OrphanComponentError, t, t.name, f"QuantState component '{comp}' has no weight",
                    expected=f"a tensor named '{base}'", found="none",
                    hint=f"it may belong to '{close[0]}' under another prefix; the names were changed"
                    if close else "the checkpoint is incomplete or its names were changed"))
    # unpacked QuantState fields sit next to an absmax (tensors, or Python values in pickles)
    for base, comps in by_weight.items():
        if "absmax" in comps:
            for f in _UNPACKED_FIELDS:
                key = f"{base}.{f}"
                if key in tensors:
                    comps[f] = tensors[key]
                elif key in values:
                    comps[f] = values[key]

    layers: dict[str, QuantizedLayer | Int8Layer] = {}
    consumed: set[str] = set()
    for base, comps in by_weight.items():
        try:
            layer = _build_layer(base, tensors[base], comps)
        except BnbLayerError as exc:
            report(exc)
            broken.add(base)
            broken.update(f"{base}.{c}" for c in comps)
            broken.update(c.name for c in comps.values() if hasattr(c, "raw"))
            continue
        layers[base] = layer
        consumed.update(layer.components)

    for name, value in values.items():
        if not name.endswith(".quant_state") or not _is_legacy_state(value):
            continue
        stem = name[: -len(".quant_state")]
        base = stem if stem in tensors else stem + ".weight"
        try:
            if base not in tensors:
                raise _err(OrphanComponentError, None, name, "legacy QuantState has no weight",
                           expected=f"a tensor named '{stem}' or '{stem}.weight'", found="none")
            if base in layers or base in broken:
                raise _err(ConflictingQuantStateError, tensors[base], base,
                           "weight has both a legacy and a current QuantState", expected="one", found=name)
            layer = _legacy_layer(base, tensors[base], name, value, tensors)
        except BnbLayerError as exc:
            report(exc)
            broken.add(base)
            broken.update(_refs(value, set()))
            continue
        layers[base] = layer
        consumed.update(layer.components)

    for name, t in tensors.items():
        if name.endswith(".SCB") and name not in inner:
            base = name[: -len(".SCB")] + ".weight"
            fmt_name = base + "_format"
            try:
                if base not in tensors:
                    raise _err(OrphanComponentError, t, name, "int8 scale 'SCB' has no weight",
                               expected=f"a tensor named '{base}'", found="none")
                fmt = tensors.get(fmt_name, values.get(fmt_name))
                layer8 = _build_int8(base, tensors[base], t, fmt)
            except BnbLayerError as exc:
                report(exc)
                broken.update((base, name, fmt_name))
                continue
            layers[base] = layer8
            consumed.update(layer8.components)
    # an int8 weight whose SCB is missing: copied as raw codes it would be silently wrong
    fmt_names = [n for n in tensors if n.endswith(".weight_format") and n not in inner]
    fmt_names += [n for n in values if n.endswith(".weight_format") and n not in tensors]
    suspects = {n[: -len("_format")]: n for n in fmt_names}
    if int8_model:
        for name, t in tensors.items():
            if name.endswith(".weight") and t.dtype.code == "I8" and name not in inner:
                suspects.setdefault(name, "")
    for base, fmt_name in suspects.items():
        if base in layers or base in broken:
            continue
        scb_name = int8_scale_name(base)
        weight = tensors.get(base)
        why = f"it has '{fmt_name}'" if fmt_name else "the config says load_in_8bit"
        report(_err(Int8ScaleMissingError, weight if weight is not None else tensors.get(fmt_name), base,
                    f"int8 weight has no SCB row scales ({why})",
                    expected=f"a tensor named '{scb_name}'", found="none",
                    hint="without SCB the int8 codes cannot be dequantized; the checkpoint is incomplete"))
        broken.update(n for n in (base, fmt_name) if n)
    plain = [n for n in tensors if n not in consumed and n not in inner and n not in broken]
    return layers, plain


def _build_int8(base: str, weight: TensorLike, scb: TensorLike, fmt: Any) -> Int8Layer:
    """Validate an LLM.int8 layer (bitsandbytes ``Linear8bitLt._save_to_state_dict``)."""
    if weight.dtype.code != "I8" or len(weight.shape) != 2:
        raise _err(Int8LayoutError, weight, base, "int8 weight must be I8 [out, in]",
                   expected="I8 2-D", found=f"{weight.dtype.code} {list(weight.shape)}")
    out = weight.shape[0]
    if scb.dtype.code != "F32" or tuple(scb.shape) != (out,):
        raise _err(Int8LayoutError, scb, scb.name, "SCB must hold one float32 row absmax per output row",
                   expected=f"F32 [{out}]", found=f"{scb.dtype.code} {list(scb.shape)}")
    comps: tuple[str, ...] = (base, scb.name)
    if fmt is not None:
        if hasattr(fmt, "raw"):
            if fmt.numel != 1 or fmt.dtype.is_float:
                raise _err(Int8WeightFormatError, fmt, fmt.name, "weight_format must be one integer",
                           expected="U8 []", found=f"{fmt.dtype.code} {list(fmt.shape)}")
            code: Any = fmt.array().reshape(-1)[0].item()
            comps += (fmt.name,)
        else:
            code = fmt
        layout = INT8_FORMATS.get(code) if isinstance(code, int) and not isinstance(code, bool) else code
        if layout != "row":
            raise Int8WeightFormatError(
                "only the row weight_format of int8 layers is supported", path=weight.file,
                tensor=base + "_format", expected="0 (row)",
                found=f"{code!r} ({layout or 'unknown'})" if layout != code else repr(code),
                hint="col32/col_turing/col_ampere are GPU tile layouts written by bitsandbytes < 0.45; "
                     "load the model with a current bitsandbytes and save it again",
            )
    return Int8Layer(base, weight, scb, fmt if hasattr(fmt, "raw") else None, comps)


def _is_legacy_state(value: Any) -> bool:
    if isinstance(value, PickledObject):
        return value.cls.endswith(".QuantState")
    return isinstance(value, (list, tuple)) and len(value) == 6


def _legacy_layer(
    base: str, weight: TensorLike, key: str, value: Any, tensors: Mapping[str, TensorLike]
) -> QuantizedLayer:
    """Parse a legacy list QuantState or a pickled QuantState object into a :class:`QuantizedLayer`.

    Matches bitsandbytes 0.39/0.40 ``quantize_4bit`` (list state) and the QuantState attributes of
    0.41+; see the module docstring.
    """

    def bad(message: str, **kw: Any) -> BnbLayerError:
        return _err(LegacyQuantStateError, weight, key, message, **kw)

    def tensor(v: Any, what: str) -> TensorLike:
        if not isinstance(v, TensorRef) or v.name not in tensors:
            raise bad(f"{what} must be a tensor", found=type(v).__name__)
        return tensors[v.name]

    def number(v: Any, what: str) -> float:
        if isinstance(v, TensorRef):
            t = tensor(v, what)
            if t.numel != 1:
                raise bad(f"{what} must be one value", found=list(t.shape))
            return float(t.array().reshape(-1)[0].item())
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise bad(f"{what} must be a number", found=type(v).__name__)

    def to_int(v: Any, what: str) -> int:
        if isinstance(v, TensorRef):
            v = number(v, what)
            if not float(v).is_integer():
                raise bad(f"{what} must be an integer", found=v)
            return int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad(f"{what} must be an integer", found=repr(v)[:40])
        return v

    if isinstance(value, PickledObject):
        st = value.state
        for req in ("absmax", "shape", "dtype", "blocksize", "quant_type"):
            if req not in st:
                raise bad(f"pickled QuantState has no '{req}'", expected="absmax, shape, dtype, blocksize, "
                          "quant_type", found=sorted(st))
        absmax_v, shape, dtype = st["absmax"], st["shape"], st["dtype"]
        bs, qt = st["blocksize"], st["quant_type"]
        nested_pair = (st["offset"], st["state2"]) if st.get("state2") is not None else None
        layout = "a pickled QuantState object"
    else:
        absmax_v, shape, dtype, bs, compressed, qt = value
        if compressed is not None and (not isinstance(compressed, (list, tuple)) or len(compressed) != 2):
            raise bad("compressed statistics must be [offset, state2]", found=repr(compressed)[:60])
        nested_pair = tuple(compressed) if compressed is not None else None
        layout = "a legacy list QuantState (bitsandbytes < 0.41)"

    fields: dict[str, Any] = {
        "quant_type": qt, "blocksize": to_int(bs, "blocksize"), "dtype": dtype,
        "shape": list(shape) if isinstance(shape, (list, tuple)) else shape,
    }
    absmax = tensor(absmax_v, "absmax")
    comps: dict[str, Any] = {"absmax": absmax}
    if nested_pair is not None:
        offset_v, state2 = nested_pair
        if isinstance(state2, PickledObject):
            s2 = state2.state
            if "absmax" not in s2 or "code" not in s2:
                raise bad("nested QuantState needs absmax and code", found=sorted(s2))
            a2, code2, bs2, dt2 = s2["absmax"], s2["code"], s2.get("blocksize"), s2.get("dtype")
        elif isinstance(state2, (list, tuple)) and len(state2) == 7:
            a2, code2, bs2, _nested2, dt2 = state2[:5]
        elif isinstance(state2, (list, tuple)) and len(state2) == 2:
            a2, code2, bs2, dt2 = state2[0], state2[1], None, None
        else:
            raise bad("state2 must be [absmax, code, blocksize, nested, dtype, offset, state2], "
                      "(absmax, code) or a QuantState", found=repr(state2)[:60])
        nested_absmax, nested_qmap = tensor(a2, "state2 absmax"), tensor(code2, "state2 code")
        if bs2 is None:
            n_blocks = absmax.numel
            fits = [b for b in (256, 4096) if -(-n_blocks // b) == nested_absmax.numel]
            if not fits:
                raise bad("cannot infer the nested blocksize from (absmax, code)",
                          expected="256 or 4096", found=f"{n_blocks} codes, {nested_absmax.numel} absmax")
            bs2 = fits[0]
        fields.update(nested_blocksize=to_int(bs2, "nested blocksize"),
                      nested_dtype=dt2 if dt2 is not None else "float32",
                      nested_offset=number(offset_v, "offset"))
        comps.update(nested_absmax=nested_absmax, nested_quant_map=nested_qmap)
    state = parse_quant_state(fields, base, weight)
    comps["quant_map"] = ConstTensor(f"{key}.<quant_map {state.quant_type}>", QUANT_TABLES[state.quant_type],
                                     weight.file)
    layer = _build_layer(base, weight, comps, state=state, notes=(f"QuantState read from {layout}",))
    extra = tuple(sorted(_refs(value, set())))
    return QuantizedLayer(
        layer.name, layer.state, layer.packed, layer.absmax, layer.quant_map, layer.nested_absmax,
        layer.nested_quant_map, (base, *extra), layer.absmax_transposed, layer.warnings,
    )


def _build_layer(
    base: str,
    weight: TensorLike,
    comps: dict[str, Any],
    state: QuantState | None = None,
    notes: tuple[str, ...] = (),
) -> QuantizedLayer:
    state_keys = [k for k in comps if k.startswith(STATE_KEY_PREFIX)]
    if state is not None:
        pass
    elif len(state_keys) > 1:
        raise _err(ConflictingQuantStateError, weight, base, "more than one packed quant_state",
                   expected="one", found=sorted(state_keys))
    elif state_keys:
        st = comps[state_keys[0]]
        hint = "the quant_state bytes are damaged; download the checkpoint again"
        if st.nbytes > jsonfile.QUANT_STATE.max_bytes:  # checked before a byte is read
            raise _err(QuantStateJsonError, st, st.name, "quant_state is larger than the limit for a JSON QuantState",
                       expected=f"at most {jsonfile.QUANT_STATE.max_bytes} bytes", found=f"{st.nbytes} bytes",
                       hint=hint)
        obj = jsonfile.load_json_bytes(bytes(st.raw()), jsonfile.QUANT_STATE, QuantStateJsonError, "quant_state",
                                       path=st.file, tensor=st.name, hint=hint)
        if not isinstance(obj, dict):
            raise _err(QuantStateJsonError, st, st.name, "quant_state JSON must be an object", found=type(obj).__name__)
        state = parse_quant_state(obj, base, st, key_quant_type=state_keys[0][len(STATE_KEY_PREFIX):])
    elif "quant_type" in comps:
        fields = {f: _scalar(comps[f], f"{base}.{f}", weight) for f in _UNPACKED_FIELDS if f in comps}
        state = parse_quant_state(fields, base, weight)
    else:
        raise _err(MissingComponentError, weight, base, "4-bit weight has no QuantState",
                   expected=f"'{base}.quant_state.bitsandbytes__nf4' (or __fp4, or unpacked fields)",
                   found=f"only {sorted(comps)}")
    for req in ("absmax", "quant_map"):
        if req not in comps:
            raise _err(MissingComponentError, weight, base, f"4-bit weight is missing its companion '{req}'",
                       expected=f"a tensor named '{base}.{req}'", found="none")
    absmax, qmap = comps["absmax"], comps["quant_map"]

    if weight.nbytes != state.packed_nbytes:
        raise _err(PackedSizeError, weight, base,
                   f"packed weight must hold ceil(n/2) bytes for shape {list(state.shape)}",
                   expected=state.packed_nbytes, found=weight.nbytes)
    if absmax.numel != state.n_blocks:
        raise _err(AbsmaxCountError, absmax, absmax.name,
                   f"absmax count must be ceil(n/blocksize) = ceil({state.numel}/{state.blocksize})",
                   expected=state.n_blocks, found=absmax.numel)
    want_absmax = ("U8",) if state.nested else ("F32", "F16", "BF16")
    if absmax.dtype.code not in want_absmax:
        raise _err(AbsmaxDtypeError, absmax, absmax.name, "absmax has the wrong dtype",
                   expected=" or ".join(want_absmax), found=absmax.dtype.code)
    warnings = list(notes)
    transposed = _absmax_transposed(absmax, state)
    if transposed:
        warnings.append(
            f"absmax is stored 2-D {list(absmax.shape)} = (K/blocksize, N), the transpose of bitsandbytes' "
            "flat order, as bitsandbytes writes it after a CPU forward pass; read as absmax.T.reshape(-1) "
            "(bitsandbytes itself reloads this file wrongly)"
        )
    if absmax.dtype.code in ("F16", "BF16"):
        warnings.append(
            f"absmax is stored as {absmax.dtype.name}, as bitsandbytes writes it after a CPU forward pass "
            "(AVX512-BF16); upcast to float32 exactly"
        )
    table = QUANT_TABLES[state.quant_type]
    if qmap.dtype.code != "F32" or qmap.numel != 16:
        raise _err(QuantMapError, qmap, qmap.name, "quant_map must be 16 float32 values",
                   expected="F32 [16]", found=f"{qmap.dtype.code} {list(qmap.shape)}")
    qvals = qmap.array().reshape(-1)
    if qvals.view(np.uint32).tolist() != table.view(np.uint32).tolist():
        other = [k for k, v in QUANT_TABLES.items() if qvals.view(np.uint32).tolist() == v.view(np.uint32).tolist()]
        raise _err(QuantMapError, qmap, qmap.name,
                   f"quant_map is not the {state.quant_type} table the QuantState names",
                   expected=f"the {state.quant_type} table",
                   found=f"the {other[0]} table" if other else "another table")
    n_abs = nq = None
    if state.nested:
        n_abs, nq = comps.get("nested_absmax"), comps.get("nested_quant_map")
        if n_abs is None or nq is None:
            missing = [k for k in ("nested_absmax", "nested_quant_map") if k not in comps]
            raise _err(NestedFieldsError, weight, base, "nested QuantState without its nested tensors",
                       expected="nested_absmax and nested_quant_map", found=f"missing {missing}")
        if nq.dtype.code != "F32" or nq.numel != 256:
            raise _err(NestedQuantMapError, nq, nq.name, "nested_quant_map must be 256 float32 values",
                       expected="F32 [256]", found=f"{nq.dtype.code} {list(nq.shape)}")
        if n_abs.numel != state.n_nested_blocks:
            raise _err(NestedAbsmaxError, n_abs, n_abs.name,
                       "nested_absmax count must be ceil(n_absmax/nested_blocksize)",
                       expected=state.n_nested_blocks, found=n_abs.numel)
        if n_abs.dtype.code not in ("F32", "F16", "BF16"):
            raise _err(NestedAbsmaxError, n_abs, n_abs.name, "nested_absmax has the wrong dtype",
                       expected="F32", found=n_abs.dtype.code)
        if n_abs.dtype.code != "F32":
            warnings.append(
                f"nested_absmax is stored as {n_abs.dtype.name} (bitsandbytes CPU forward path); "
                "upcast to float32 exactly"
            )
        if state.nested_dtype != "float32":
            warnings.append(
                f"nested_dtype is {state.nested_dtype} (bitsandbytes CPU forward path): each step of "
                f"undoing double quantization is rounded to {state.nested_dtype}, as bitsandbytes does"
            )
    elif "nested_absmax" in comps or "nested_quant_map" in comps:
        raise _err(NestedFieldsError, weight, base, "nested tensors present but the QuantState is not nested",
                   expected="no nested_absmax / nested_quant_map", found="present")
    components = (base,) + tuple(c.name for c in comps.values() if hasattr(c, "raw"))
    if not state_keys and "quant_type" in comps:
        components += tuple(f"{base}.{f}" for f in _UNPACKED_FIELDS if f in comps)
    return QuantizedLayer(base, state, weight, absmax, qmap, n_abs, nq, components, transposed,
                          tuple(warnings))


def _absmax_transposed(absmax: TensorLike, state: QuantState) -> bool:
    """Whether a 2-D absmax is bnb's transposed ``(K/blocksize, N)`` layout (BNB-004 otherwise)."""
    dims = [d for d in absmax.shape if d != 1]
    if len(dims) <= 1:
        return False
    shape = state.shape
    if len(shape) == 2 and shape[1] % state.blocksize == 0:
        n, k = shape
        if tuple(absmax.shape) == (k // state.blocksize, n):
            return True
        if tuple(absmax.shape) == (n, k // state.blocksize):
            return False
    raise _err(AbsmaxCountError, absmax, absmax.name,
               "a multi-dimensional absmax must be (K/blocksize, N) for a weight (N, K)",
               expected=(f"[{shape[1] // state.blocksize}, {shape[0]}]"
                         if len(shape) == 2 and shape[1] % state.blocksize == 0 else "a 1-D absmax"),
               found=list(absmax.shape))

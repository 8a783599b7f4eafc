"""bitsandbytes' on-disk vocabulary: the names, tables and data classes of its 4-bit and LLM.int8 layers,
and the QuantState parser.

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

Rules checked here, by :func:`parse_quant_state` (a QuantState's fields, from the packed JSON, the
unpacked fields or a legacy QuantState), each with its own subclass of
:class:`~formats.errors.BnbLayerError` (see docs/errors.md), naming file, tensor and rule:

=======  ==========================================================================================
BNB-001  quant_type is "nf4" or "fp4"
BNB-002  blocksize (and nested_blocksize) is a power of two in [32, 4096]
BNB-006  nested fields (nested_blocksize, nested_dtype, nested_offset) are all present or all absent
BNB-009  the QuantState fields are valid (required fields present, right types, finite nested_offset)
BNB-013  dtype (and nested_dtype) is float16, bfloat16 or float32
BNB-014  shape is a list of positive integers
BNB-019  the ``quant_state.bitsandbytes__<type>`` key names the quant type of its JSON
=======  ==========================================================================================

Grouping a checkpoint's tensors into layers (:func:`formats.bnb_layers.group_layers`), the rules on a
layer's tensors and the layouts of older or buggy bitsandbytes (legacy list QuantStates, absmax written
after a CPU forward) are in :mod:`formats.bnb_layers`, which builds on this module (never the reverse).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .dtypes import FLOAT_OUTPUTS, DType, by_numpy, float_dtype_name
from .errors import (
    BlocksizeError,
    BnbLayerError,
    ConflictingQuantStateError,
    NestedFieldsError,
    QuantDtypeError,
    QuantShapeError,
    QuantStateJsonError,
    QuantTypeError,
)

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
#: The QuantState fields the unpacked layout stores as separate entries ``P.weight.<field>``.
UNPACKED_FIELDS = (
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


def err(
    cls: type[BnbLayerError], t: TensorLike | None, name: str, message: str, **kw: Any
) -> BnbLayerError:
    """The error ``cls`` for tensor ``name``, in ``t``'s file when there is one."""
    return cls(message, path=t.file if t is not None else None, tensor=name, **kw)


def parse_quant_state(
    fields: Mapping[str, Any], weight: str, source: TensorLike | None, key_quant_type: str | None = None
) -> QuantState:
    """Build a :class:`QuantState` from the JSON object (packed) or the unpacked fields.

    Matches bitsandbytes ``QuantState.from_dict``. ``key_quant_type`` is the quant type named by
    the ``quant_state.bitsandbytes__<type>`` key, checked against the JSON.

    Raises:
        BnbLayerError: BNB-001, BNB-002, BNB-006, BNB-009, BNB-013, BNB-014 or BNB-019.
    """

    def bad(message: str, **kw: Any) -> BnbLayerError:
        return err(QuantStateJsonError, source, weight, message, **kw)

    for req in ("quant_type", "blocksize", "dtype", "shape"):
        if req not in fields:
            raise bad(f"QuantState field '{req}' is missing", expected=list(UNPACKED_FIELDS[:4]),
                      found=sorted(fields))
    qt = fields["quant_type"]
    if not isinstance(qt, str):
        raise bad("QuantState field 'quant_type' must be a string", found=qt)
    if qt not in QUANT_TABLES:
        raise err(QuantTypeError, source, weight, "quant_type must be nf4 or fp4", expected="'nf4' or 'fp4'", found=qt)
    if key_quant_type is not None and key_quant_type != qt:
        raise err(ConflictingQuantStateError, source, weight,
                  "the quant_state key and its JSON name different quant types",
                  expected=key_quant_type, found=qt)
    bs = fields["blocksize"]
    if not isinstance(bs, int) or isinstance(bs, bool):
        raise bad("QuantState field 'blocksize' must be an integer", found=bs)
    if bs not in BLOCKSIZES:
        raise err(BlocksizeError, source, weight, "blocksize must be a power of two from 32 to 4096",
                  expected=list(BLOCKSIZES), found=bs)
    dt = float_dtype_name(fields["dtype"])
    if dt is None:
        raise err(QuantDtypeError, source, weight, "dtype must be float16, bfloat16 or float32",
                  expected=list(FLOAT_OUTPUTS), found=fields["dtype"])
    shape = fields["shape"]
    if isinstance(shape, tuple):
        shape = list(shape)
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise err(QuantShapeError, source, weight, "shape must be a non-empty list of positive integers",
                  expected="[d0, d1, ...] with integers > 0", found=shape)
    nested_keys = [k for k in ("nested_blocksize", "nested_dtype", "nested_offset") if k in fields]
    if not nested_keys:
        return QuantState(qt, bs, dt, tuple(shape))
    if len(nested_keys) != 3:
        missing = sorted({"nested_blocksize", "nested_dtype", "nested_offset"} - set(nested_keys))
        raise err(NestedFieldsError, source, weight, "nested fields must be all present or all absent",
                  expected="nested_blocksize, nested_dtype, nested_offset", found=f"missing {missing}")
    nbs, ndt, off = fields["nested_blocksize"], fields["nested_dtype"], fields["nested_offset"]
    if not isinstance(nbs, int) or isinstance(nbs, bool) or nbs <= 0:
        raise bad("QuantState field 'nested_blocksize' must be a positive integer", found=nbs)
    if nbs not in NESTED_BLOCKSIZES:
        raise err(BlocksizeError, source, weight, "nested_blocksize must be a power of two from 32 to 4096",
                  expected=list(NESTED_BLOCKSIZES), found=nbs)
    ndt = float_dtype_name(fields["nested_dtype"])
    if ndt is None:
        raise err(QuantDtypeError, source, weight, "nested_dtype must be float16, bfloat16 or float32",
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


def is_int8_config(config: Any) -> bool:
    """Whether a transformers ``config.json`` object says the model is LLM.int8 (``load_in_8bit``)."""
    if not isinstance(config, dict):
        return False
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("load_in_8bit") is True

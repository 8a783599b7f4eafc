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
BNB-009  the QuantState JSON / fields are valid (object, required fields present, right types)
BNB-010  a QuantState component has its weight
BNB-011  a weight with QuantState components has all the required ones (absmax, quant_map, state)
BNB-012  absmax (after undoing double quantization) is finite
BNB-013  dtype is float16, bfloat16 or float32
BNB-014  shape is a list of positive integers
BNB-015  an LLM.int8 weight is in row format (weight_format 0 or absent)
BNB-016  absmax has a dtype bnb writes (F32/F16/BF16; U8 when nested)
BNB-017  one packed QuantState per weight, whose key names the same quant type as its JSON
=======  ==========================================================================================
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

from .dtypes import DType
from .errors import (
    AbsmaxCountError,
    AbsmaxDtypeError,
    BlocksizeError,
    BnbLayerError,
    ConflictingQuantStateError,
    ConvertBnbError,
    Int8WeightFormatError,
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

__all__ = [
    "BLOCKSIZES",
    "DYNAMIC_MAP_SIGNED",
    "FP4_TABLE",
    "NF4_TABLE",
    "QUANT_TABLES",
    "Int8Layer",
    "QuantState",
    "QuantizedLayer",
    "TensorLike",
    "group_layers",
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
_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_STATE_PREFIX = "quant_state.bitsandbytes__"
_COMPANIONS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_UNPACKED_FIELDS = (
    "quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset",
)
_INT8_COMPANIONS = ("SCB", "weight_format")


class TensorLike(Protocol):
    """What a container reader hands out per tensor (see formats.checkpoint.TensorRecord)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int

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
    """

    name: str
    state: QuantState
    packed: TensorLike
    absmax: TensorLike
    quant_map: TensorLike
    nested_absmax: TensorLike | None = None
    nested_quant_map: TensorLike | None = None
    components: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Int8Layer:
    """An LLM.int8 weight: ``P.weight`` I8 [out, in], ``P.SCB`` F32 [out], optional ``P.weight_format``."""

    name: str
    weight: TensorLike
    scb: TensorLike
    weight_format: TensorLike | None
    components: tuple[str, ...] = field(default=())


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
    dt = fields["dtype"]
    if isinstance(dt, str) and dt.startswith("torch."):
        dt = dt[len("torch."):]
    if not isinstance(dt, str) or dt not in _FLOAT_DTYPES:
        raise _err(QuantDtypeError, source, weight, "dtype must be float16, bfloat16 or float32",
                   expected=list(_FLOAT_DTYPES), found=fields["dtype"])
    shape = fields["shape"]
    if isinstance(shape, tuple):
        shape = list(shape)
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise _err(QuantShapeError, source, weight, "shape must be a non-empty list of positive integers", found=shape)
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
    if isinstance(ndt, str) and ndt.startswith("torch."):
        ndt = ndt[len("torch."):]
    if not isinstance(ndt, str) or ndt not in _FLOAT_DTYPES:
        raise _err(QuantDtypeError, source, weight, "nested_dtype must be float16, bfloat16 or float32",
                   expected=list(_FLOAT_DTYPES), found=fields["nested_dtype"])
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


def _suffix_of(name: str) -> tuple[str, str] | None:
    """Split ``P.weight.<companion>`` into (``P.weight``, companion) for 4-bit companions."""
    marker = "." + _STATE_PREFIX
    i = name.rfind(marker)
    if i > 0:
        return name[:i], name[i + 1:]
    for suffix in _COMPANIONS:
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], suffix
    return None


def group_layers(
    tensors: Mapping[str, TensorLike],
    problems: list[ConvertBnbError] | None = None,
) -> tuple[dict[str, QuantizedLayer | Int8Layer], list[str]]:
    """Group bitsandbytes companions with their weights by exact prefix.

    Args:
        tensors: every tensor of a checkpoint, name -> record.
        problems: when given, a broken layer's error is appended to it and the layer (with its
            components) is left out of both results, so every layer can be checked
            (``convert-bnb check``); without, the first error is raised.

    Returns:
        (layers by weight name, names of the remaining plain tensors in input order).

    Raises:
        BnbLayerError: any BNB-xxx rule (a subclass per rule, e.g. :class:`~formats.errors.QuantMapError`).
    """

    def report(exc: ConvertBnbError) -> None:
        if problems is None:
            raise exc
        problems.append(exc)

    by_weight: dict[str, dict[str, TensorLike]] = {}
    broken: set[str] = set()
    orphans: list[tuple[str, str, TensorLike]] = []
    for name, t in tensors.items():
        split = _suffix_of(name)
        if split is None:
            continue
        base, comp = split
        if base not in tensors:
            orphans.append((base, comp, t))
            broken.add(name)
            continue
        by_weight.setdefault(base, {})[comp] = t
    for base, comp, t in orphans:
        # a weight of another prefix that lacks this component is the likely owner
        owners = [w for w, comps in by_weight.items() if comp not in comps]
        owners += [n for n in tensors if n.endswith(".weight") and n not in by_weight and _suffix_of(n) is None]
        close = difflib.get_close_matches(base, owners, n=1, cutoff=0.6)
        report(_err(OrphanComponentError, t, t.name, f"QuantState component '{comp}' has no weight",
                    expected=f"a tensor named '{base}'", found="none",
                    hint=f"it may belong to '{close[0]}' under another prefix; the names were changed"
                    if close else "the checkpoint is incomplete or its names were changed"))
    # unpacked QuantState fields sit next to an absmax
    for base, comps in by_weight.items():
        if "absmax" in comps:
            for f in _UNPACKED_FIELDS:
                key = f"{base}.{f}"
                if key in tensors:
                    comps[f] = tensors[key]

    layers: dict[str, QuantizedLayer | Int8Layer] = {}
    consumed: set[str] = set()
    for base, comps in by_weight.items():
        try:
            layer = _build_layer(base, tensors[base], comps)
        except BnbLayerError as exc:
            report(exc)
            broken.add(base)
            broken.update(f"{base}.{c}" for c in comps)
            broken.update(c.name for c in comps.values())
            continue
        layers[base] = layer
        consumed.update(layer.components)

    for name, t in tensors.items():
        if name.endswith(".SCB"):
            base = name[: -len(".SCB")] + ".weight"
            if base not in tensors:
                report(_err(OrphanComponentError, t, name, "int8 scale 'SCB' has no weight",
                            expected=f"a tensor named '{base}'", found="none"))
                broken.add(name)
                continue
            fmt = tensors.get(base + "_format")
            comps = (base, name) + ((base + "_format",) if fmt is not None else ())
            try:
                _check_weight_format(base, fmt)
            except BnbLayerError as exc:
                report(exc)
                broken.update(comps)
                continue
            layers[base] = Int8Layer(base, tensors[base], t, fmt, comps)
            consumed.update(comps)
    plain = [n for n in tensors if n not in consumed and n not in broken]
    return layers, plain


#: ``weight_format`` codes of ``Linear8bitLt`` (bitsandbytes ``LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING``).
INT8_WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}


def _check_weight_format(base: str, fmt: TensorLike | None) -> None:
    """BNB-015: an LLM.int8 weight must be in ``row`` layout (code 0; a missing entry means row)."""
    if fmt is None:
        return
    if fmt.numel != 1 or not fmt.dtype.code.startswith(("U", "I")):
        raise _err(Int8WeightFormatError, fmt, fmt.name, "weight_format must be one integer code",
                   expected="U8 scalar 0 (row)", found=f"{fmt.dtype.code} {list(fmt.shape)}")
    code = int(fmt.array().reshape(-1)[0])
    if code != 0:
        raise _err(Int8WeightFormatError, fmt, base, "LLM.int8 weight is not in row format",
                   expected="row (0)", found=f"{INT8_WEIGHT_FORMATS.get(code, 'unknown')} ({code})",
                   hint="re-save the model with a current bitsandbytes, which saves row format")


def _build_layer(base: str, weight: TensorLike, comps: dict[str, TensorLike]) -> QuantizedLayer:
    state_keys = [k for k in comps if k.startswith(_STATE_PREFIX)]
    if len(state_keys) > 1:
        raise _err(ConflictingQuantStateError, weight, base, "more than one packed quant_state",
                   expected="one", found=sorted(state_keys))
    if state_keys:
        st = comps[state_keys[0]]
        text = bytes(st.raw())
        try:
            obj = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise _err(QuantStateJsonError, st, st.name, f"quant_state is not valid UTF-8 JSON ({detail})",
                       hint="the quant_state bytes are damaged; download the checkpoint again") from None
        if not isinstance(obj, dict):
            raise _err(QuantStateJsonError, st, st.name, "quant_state JSON must be an object", found=type(obj).__name__)
        state = parse_quant_state(obj, base, st, key_quant_type=state_keys[0][len(_STATE_PREFIX):])
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
    elif "nested_absmax" in comps or "nested_quant_map" in comps:
        raise _err(NestedFieldsError, weight, base, "nested tensors present but the QuantState is not nested",
                   expected="no nested_absmax / nested_quant_map", found="present")
    components = (base,) + tuple(c.name for c in comps.values())
    return QuantizedLayer(base, state, weight, absmax, qmap, n_abs, nq, components)

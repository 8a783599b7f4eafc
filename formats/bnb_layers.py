"""Grouping a bitsandbytes checkpoint's tensors into layers, and the rules on a layer's tensors.

:func:`group_layers` groups by exact prefix (a fuzzy search only suggests the owner of an orphan
component in its message); :mod:`formats.bnb` holds the on-disk names, the data classes and
:func:`~formats.bnb.parse_quant_state`, and never imports this module:

- **4-bit layers**: each ``P.weight.<component>`` (absmax, quant_map, nested_absmax, nested_quant_map,
  ``quant_state.bitsandbytes__<type>``; :func:`~formats.bnb.split_component`) joins the tensor ``P.weight``,
  a :class:`~formats.bnb.QuantizedLayer`. The unpacked fields ``P.weight.quant_type``, ... (tensors, or
  Python values in pickles) join a weight that has an absmax.
- **LLM.int8 layers**: ``P.SCB`` joins ``P.weight`` and ``P.weight_format`` (a tensor or a pickled value,
  optional), an :class:`~formats.bnb.Int8Layer`. An int8 weight without its SCB (it has a
  ``P.weight_format``, or it is an I8 ``P.weight`` of a model whose config says ``load_in_8bit``) is an
  error: copied as raw codes it would be silently wrong.
- **legacy QuantStates**: a non-tensor value ``P.weight.quant_state`` or ``P.quant_state`` (below).
- Every other tensor is plain, except the tensors referenced inside pickled values (never plain).

Rules checked here, each with its own subclass of :class:`~formats.errors.BnbLayerError` (see
docs/errors.md), naming file, tensor and rule; every QuantState also goes through
:func:`~formats.bnb.parse_quant_state` (BNB-001, 002, 006, 009, 013, 014, 019: see :mod:`formats.bnb`):

=======  ==========================================================================================
BNB-003  the packed weight holds exactly ceil(n / 2) bytes, n = prod(QuantState shape)
BNB-004  absmax holds ceil(n / blocksize) values (F32, or U8 codes when nested; F16/BF16 accepted)
BNB-005  quant_map holds the 16 fp32 values of the table for quant_type (bit for bit)
BNB-006  nested tensors are present exactly when the QuantState is nested
BNB-007  nested_quant_map holds 256 fp32 values
BNB-008  nested_absmax holds ceil(n_absmax / nested_blocksize) values
BNB-009  the packed QuantState JSON is an object, within :mod:`formats.jsonfile`'s limits (1 MiB,
         nesting, integer digits)
BNB-010  a QuantState component has its weight
BNB-011  a weight with QuantState components has all the required ones (absmax, quant_map, state)
BNB-015  an int8 layer has weight I8 [out, in] and SCB F32 [out]
BNB-016  an int8 layer's weight_format is 0 / "row" (col32, col_turing, col_ampere are refused)
BNB-017  a legacy QuantState (list or pickled object) has the documented layout
BNB-018  absmax has a dtype bnb writes (F32/F16/BF16; U8 codes when nested)
BNB-019  one QuantState per weight (packed, unpacked or legacy)
BNB-020  an int8 weight has its SCB: a ``P.weight_format`` without ``P.SCB``, or an I8 ``P.weight`` without
         ``P.SCB`` in a model whose config says ``load_in_8bit``, is an LLM.int8 layer missing its scales
=======  ==========================================================================================

BNB-012 (absmax, after undoing double quantization, is finite) is checked where the absmax is resolved,
in :mod:`convert.plan` (``Dequant4Source.absmax``) and ``convert-bnb check``.

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
  :attr:`~formats.bnb.QuantizedLayer.warnings` (the library never prints).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import jsonfile
from .bnb import (
    INT8_FORMATS,
    QUANT_TABLES,
    STATE_KEY_PREFIX,
    UNPACKED_FIELDS,
    ConstTensor,
    Int8Layer,
    QuantizedLayer,
    QuantState,
    TensorLike,
    err,
    int8_scale_name,
    parse_quant_state,
    split_component,
)
from .errors import (
    AbsmaxCountError,
    AbsmaxDtypeError,
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
    QuantMapError,
    QuantStateJsonError,
)
from .torch_pickle import PickledObject, TensorRef

__all__ = ["group_layers"]


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
        int8_model: the config says ``load_in_8bit`` (:func:`~formats.bnb.is_int8_config`): an I8 ``P.weight``
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
        report(err(OrphanComponentError, t, t.name, f"QuantState component '{comp}' has no weight",
                   expected=f"a tensor named '{base}'", found="none",
                   hint=f"it may belong to '{close[0]}' under another prefix; the names were changed"
                   if close else "the checkpoint is incomplete or its names were changed"))
    # unpacked QuantState fields sit next to an absmax (tensors, or Python values in pickles)
    for base, comps in by_weight.items():
        if "absmax" in comps:
            for f in UNPACKED_FIELDS:
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
                raise err(OrphanComponentError, None, name, "legacy QuantState has no weight",
                          expected=f"a tensor named '{stem}' or '{stem}.weight'", found="none")
            if base in layers or base in broken:
                raise err(ConflictingQuantStateError, tensors[base], base,
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
                    raise err(OrphanComponentError, t, name, "int8 scale 'SCB' has no weight",
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
        report(err(Int8ScaleMissingError, weight if weight is not None else tensors.get(fmt_name), base,
                   f"int8 weight has no SCB row scales ({why})",
                   expected=f"a tensor named '{scb_name}'", found="none",
                   hint="without SCB the int8 codes cannot be dequantized; the checkpoint is incomplete"))
        broken.update(n for n in (base, fmt_name) if n)
    plain = [n for n in tensors if n not in consumed and n not in inner and n not in broken]
    return layers, plain


def _build_int8(base: str, weight: TensorLike, scb: TensorLike, fmt: Any) -> Int8Layer:
    """Validate an LLM.int8 layer (bitsandbytes ``Linear8bitLt._save_to_state_dict``)."""
    if weight.dtype.code != "I8" or len(weight.shape) != 2:
        raise err(Int8LayoutError, weight, base, "int8 weight must be I8 [out, in]",
                  expected="I8 2-D", found=f"{weight.dtype.code} {list(weight.shape)}")
    out = weight.shape[0]
    if scb.dtype.code != "F32" or tuple(scb.shape) != (out,):
        raise err(Int8LayoutError, scb, scb.name, "SCB must hold one float32 row absmax per output row",
                  expected=f"F32 [{out}]", found=f"{scb.dtype.code} {list(scb.shape)}")
    comps: tuple[str, ...] = (base, scb.name)
    if fmt is not None:
        if hasattr(fmt, "raw"):
            if fmt.numel != 1 or fmt.dtype.is_float:
                raise err(Int8WeightFormatError, fmt, fmt.name, "weight_format must be one integer",
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
        return err(LegacyQuantStateError, weight, key, message, **kw)

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
        raise err(ConflictingQuantStateError, weight, base, "more than one packed quant_state",
                  expected="one", found=sorted(state_keys))
    elif state_keys:
        st = comps[state_keys[0]]
        hint = "the quant_state bytes are damaged; download the checkpoint again"
        if st.nbytes > jsonfile.QUANT_STATE.max_bytes:  # checked before a byte is read
            raise err(QuantStateJsonError, st, st.name, "quant_state is larger than the limit for a JSON QuantState",
                      expected=f"at most {jsonfile.QUANT_STATE.max_bytes} bytes", found=f"{st.nbytes} bytes",
                      hint=hint)
        obj = jsonfile.load_json_bytes(bytes(st.raw()), jsonfile.QUANT_STATE, QuantStateJsonError, "quant_state",
                                       path=st.file, tensor=st.name, hint=hint)
        if not isinstance(obj, dict):
            raise err(QuantStateJsonError, st, st.name, "quant_state JSON must be an object", found=type(obj).__name__)
        state = parse_quant_state(obj, base, st, key_quant_type=state_keys[0][len(STATE_KEY_PREFIX):])
    elif "quant_type" in comps:
        fields = {f: _scalar(comps[f], f"{base}.{f}", weight) for f in UNPACKED_FIELDS if f in comps}
        state = parse_quant_state(fields, base, weight)
    else:
        raise err(MissingComponentError, weight, base, "4-bit weight has no QuantState",
                  expected=f"'{base}.quant_state.bitsandbytes__nf4' (or __fp4, or unpacked fields)",
                  found=f"only {sorted(comps)}")
    for req in ("absmax", "quant_map"):
        if req not in comps:
            raise err(MissingComponentError, weight, base, f"4-bit weight is missing its companion '{req}'",
                      expected=f"a tensor named '{base}.{req}'", found="none")
    absmax, qmap = comps["absmax"], comps["quant_map"]

    if weight.nbytes != state.packed_nbytes:
        raise err(PackedSizeError, weight, base,
                  f"packed weight must hold ceil(n/2) bytes for shape {list(state.shape)}",
                  expected=state.packed_nbytes, found=weight.nbytes)
    if absmax.numel != state.n_blocks:
        raise err(AbsmaxCountError, absmax, absmax.name,
                  f"absmax count must be ceil(n/blocksize) = ceil({state.numel}/{state.blocksize})",
                  expected=state.n_blocks, found=absmax.numel)
    want_absmax = ("U8",) if state.nested else ("F32", "F16", "BF16")
    if absmax.dtype.code not in want_absmax:
        raise err(AbsmaxDtypeError, absmax, absmax.name, "absmax has the wrong dtype",
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
        raise err(QuantMapError, qmap, qmap.name, "quant_map must be 16 float32 values",
                  expected="F32 [16]", found=f"{qmap.dtype.code} {list(qmap.shape)}")
    qvals = qmap.array().reshape(-1)
    if qvals.view(np.uint32).tolist() != table.view(np.uint32).tolist():
        other = [k for k, v in QUANT_TABLES.items() if qvals.view(np.uint32).tolist() == v.view(np.uint32).tolist()]
        raise err(QuantMapError, qmap, qmap.name,
                  f"quant_map is not the {state.quant_type} table the QuantState names",
                  expected=f"the {state.quant_type} table",
                  found=f"the {other[0]} table" if other else "another table")
    n_abs = nq = None
    if state.nested:
        n_abs, nq = comps.get("nested_absmax"), comps.get("nested_quant_map")
        if n_abs is None or nq is None:
            missing = [k for k in ("nested_absmax", "nested_quant_map") if k not in comps]
            raise err(NestedFieldsError, weight, base, "nested QuantState without its nested tensors",
                      expected="nested_absmax and nested_quant_map", found=f"missing {missing}")
        if nq.dtype.code != "F32" or nq.numel != 256:
            raise err(NestedQuantMapError, nq, nq.name, "nested_quant_map must be 256 float32 values",
                      expected="F32 [256]", found=f"{nq.dtype.code} {list(nq.shape)}")
        if n_abs.numel != state.n_nested_blocks:
            raise err(NestedAbsmaxError, n_abs, n_abs.name,
                      "nested_absmax count must be ceil(n_absmax/nested_blocksize)",
                      expected=state.n_nested_blocks, found=n_abs.numel)
        if n_abs.dtype.code not in ("F32", "F16", "BF16"):
            raise err(NestedAbsmaxError, n_abs, n_abs.name, "nested_absmax has the wrong dtype",
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
        raise err(NestedFieldsError, weight, base, "nested tensors present but the QuantState is not nested",
                  expected="no nested_absmax / nested_quant_map", found="present")
    components = (base,) + tuple(c.name for c in comps.values() if hasattr(c, "raw"))
    if not state_keys and "quant_type" in comps:
        components += tuple(f"{base}.{f}" for f in UNPACKED_FIELDS if f in comps)
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
    raise err(AbsmaxCountError, absmax, absmax.name,
              "a multi-dimensional absmax must be (K/blocksize, N) for a weight (N, K)",
              expected=(f"[{shape[1] // state.blocksize}, {shape[0]}]"
                        if len(shape) == 2 and shape[1] % state.blocksize == 0 else "a 1-D absmax"),
              found=list(absmax.shape))

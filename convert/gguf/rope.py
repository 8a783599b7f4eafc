"""RoPE scaling for GGUF: the metadata keys and the factor tensors llama.cpp's converter writes.

Follows llama.cpp's ``convert_hf_to_gguf.py``. The RoPE object is config.json's ``rope_parameters``
(transformers >= 5), else ``rope_scaling``; for a model with per-attention-kind parameters, that of the
full-attention layers (:func:`rope_object`, ``TextModel``). Its type is ``rope_type``, else ``type``,
in lower case; none means no scaling. Which types an architecture takes is its row's ``rope_types``
(:class:`convert.gguf.families.Architecture`):

- :func:`rope_metadata` (``TextModel.set_gguf_parameters``): ``linear`` with a ``factor`` writes
  ``rope.scaling.type`` (linear) and ``rope.scaling.factor``; ``yarn`` with a ``factor`` writes the
  type (yarn), the factor, ``rope.scaling.original_context_length`` and, where set, the YaRN
  extrapolation factor, attention factor (``attention_factor`` or ``attn_factor``), ``beta_fast`` and
  ``beta_slow``; ``default``, ``llama3`` and a type without a factor write no scaling key. Phi-3
  writes its own keys instead (``rope_scaling_keys`` false: only the type is checked).
- :func:`llama3_rope_freqs` (``LlamaModel.generate_extra_tensors``): for ``llama3`` scaling,
  ``rope_freqs.weight``, float32, one factor per rotary pair (shape ``(head_dim / 2,)``): the
  frequency ``1 / base ** (2i / head_dim)`` of pair i (float32; ``base`` the RoPE object's
  ``rope_theta``, else the hyperparameters', else 10000) has a wavelength ``2 pi / frequency`` in
  positions; its factor is 1 when that is below ``original_max_position_embeddings /
  high_freq_factor``, ``factor`` when above ``original_max_position_embeddings / low_freq_factor``,
  smoothly interpolated between (defaults: factor 8, low 1, high 4, original context 8192).
- :func:`longrope_factors` (``Phi3MiniModel.generate_extra_tensors``): with a ``long_factor``,
  ``rope_factors_long.weight`` and ``rope_factors_short.weight``, float32, shape
  ``(rotary dimensions / 2,)``: ``long_factor`` and ``short_factor`` as config.json gives them; and
  :func:`longrope_attn_factor`, written as ``rope.scaling.attn_factor``: with scale = context length /
  ``original_max_position_embeddings``, 1 when scale <= 1, ``0.1 ln(scale) + 1`` for yarn, else
  ``sqrt(1 + ln(scale) / ln(original))``.
- what :func:`convert.gguf.arch.hparams` derives from the RoPE object and config.json:
  :data:`LOCAL_THETA` (the keys of the sliding-window layers' RoPE base, ``@rope_theta_swa``),
  :func:`rotary_dims` (Phi-3's ``rope.dimension_count``, ``@rope_dimension_count``) and
  :func:`longrope_attn_factor` (``@rope_attn_factor``).

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-005  the RoPE scaling type is supported: none/default, linear, yarn, llama3 for Llama; the
          RoPE type a string, its keys as llama.cpp reads them
          (:func:`convert.gguf.config.check_rope`); Phi-3's LongRoPE factors one finite number per
          rotary dimension pair, with a longrope, su or yarn type (:class:`RopeScalingError`)
GGUF-006  Phi-3's ``partial_rotary_factor`` a number in (0, 1] that leaves at least 2 rotary
          dimensions, its context lengths positive integers (the original one >= 2 for LongRoPE);
          Llama 3's ``rope_theta`` and head dimension positive (:class:`GgufConfigError`)
========  ======================================================================================

:mod:`convert.gguf.arch` imports this module, never the reverse: the architecture row is read
through the fields used here (:class:`_ArchitectureLike`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Protocol

import gguf
import numpy as np
import numpy.typing as npt

from convert.gguf.config import check_rope, real, whole
from formats.errors import GgufConfigError, RopeScalingError

__all__ = [
    "LOCAL_THETA",
    "llama3_rope_freqs",
    "longrope_attn_factor",
    "longrope_factors",
    "rope_metadata",
    "rope_object",
    "rotary_dims",
]


class _ArchitectureLike(Protocol):
    """The fields of :class:`convert.gguf.families.Architecture` read here."""

    @property
    def rope_types(self) -> tuple[str, ...]: ...

    @property
    def rope_scaling_keys(self) -> bool: ...

    @property
    def longrope_factors(self) -> bool: ...


#: Keys of the sliding-window layers' RoPE base (TextModel.__init__'s ``local_rope_theta``).
LOCAL_THETA = ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq")


def _rope_root(hp: Mapping[str, Any]) -> Any:
    """config.json's RoPE value as llama.cpp's converter picks it: ``rope_parameters`` (transformers >= 5),
    else ``rope_scaling`` (either may be any JSON value; {} when neither is set)."""
    return hp.get("rope_parameters") or hp.get("rope_scaling") or {}


def rope_choice_note(hp: Mapping[str, Any]) -> str | None:
    """A note when config.json holds both ``rope_parameters`` and ``rope_scaling`` and they differ: the GGUF
    takes ``rope_parameters`` (as transformers >= 5 and llama.cpp's converter do) and ignores the other."""
    new, old = hp.get("rope_parameters"), hp.get("rope_scaling")
    if not new or not old or new == old:
        return None
    return ("config.json has both 'rope_parameters' and 'rope_scaling', and they differ: the GGUF takes "
            "'rope_parameters' (as transformers >= 5 and llama.cpp's converter do); 'rope_scaling' "
            f"{json.dumps(old, sort_keys=True)[:120]} is ignored")


def rope_object(hp: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE object (:func:`_rope_root`; {} when it is not an object); for a model with
    per-attention-kind parameters, those of the full-attention layers (TextModel)."""
    rope = _rope_root(hp)
    if not isinstance(rope, dict):
        return {}
    full = rope.get("full_attention")
    if isinstance(full, dict):
        return full
    return rope


def _rope_kind(rope: Mapping[str, Any], path: str | None) -> str | None:
    kind = rope.get("rope_type", rope.get("type"))
    if kind is None or isinstance(kind, str):
        return kind.lower() if kind is not None else None
    raise RopeScalingError(
        "config.json RoPE 'rope_type' is not a string",
        path=path,
        expected="a string such as 'linear'",
        found=f"{type(kind).__name__} {str(kind)[:40]}",
        action="convert",
    )


def rotary_dims(hp: Mapping[str, Any], path: str | None) -> int:
    """``int(partial_rotary_factor * hidden_size) // num_attention_heads`` (Phi3MiniModel).

    ``partial_rotary_factor`` is ``hp["@partial_rotary_factor"]`` (:func:`convert.gguf.arch.hparams`).

    Raises:
        GgufConfigError: GGUF-006 (sizes that are not positive integers, a factor outside (0, 1],
            fewer than 2 rotary dimensions).
    """
    hidden = whole(hp.get("hidden_size", hp.get("n_embd")), "hidden_size", path)
    heads = whole(hp.get("num_attention_heads", hp.get("n_head")), "num_attention_heads", path)
    pct = real(hp["@partial_rotary_factor"], "partial_rotary_factor", path, hi=1.0)
    dims = int(pct * hidden) // heads
    if dims < 2:
        raise GgufConfigError(
            "config.json 'partial_rotary_factor' leaves no rotary dimensions",
            path=path, expected="int(factor x hidden_size) // heads >= 2", found=pct, action="convert",
        )
    return dims


def longrope_attn_factor(hp: Mapping[str, Any], path: str | None) -> float | None:
    """The attention factor Phi3MiniModel.generate_extra_tensors writes when LongRoPE factors are given.

    Raises:
        RopeScalingError: GGUF-005 (a scaling type with factors that is not longrope/su/yarn).
        GgufConfigError: GGUF-006 (context lengths that are not positive integers).
    """
    rope = rope_object(hp)
    if not rope.get("long_factor"):
        return None
    kind = (_rope_kind(rope, path) or "").lower()
    if kind not in ("longrope", "su", "yarn"):
        raise RopeScalingError(
            "RoPE long/short factors with a scaling type llama.cpp does not convert",
            path=path, expected="rope_type longrope, su or yarn", found=kind or "none", action="convert",
        )
    ctx = whole(hp.get("n_positions", hp.get("max_position_embeddings")), "max_position_embeddings", path)
    orig = whole(hp.get("@original_max_position_embeddings"), "original_max_position_embeddings", path)
    scale = ctx / orig
    if scale <= 1.0:
        return 1.0
    if kind == "yarn":
        return 0.1 * math.log(scale) + 1.0
    if orig < 2:
        raise GgufConfigError(
            "config.json 'original_max_position_embeddings' is too small for LongRoPE",
            path=path, expected="an integer >= 2", found=orig, action="convert",
        )
    return math.sqrt(1 + math.log(scale) / math.log(orig))


def longrope_factors(
    hp: Mapping[str, Any], arch: _ArchitectureLike, path: str | None
) -> list[tuple[str, npt.NDArray[np.float32]]]:
    """``rope_factors_long/short.weight`` (Phi3MiniModel.generate_extra_tensors), [] without long factors.

    Raises:
        RopeScalingError: GGUF-005 (factors missing, not finite numbers, or not rotary dims / 2 of each).
    """
    rope = rope_object(hp)
    if not arch.longrope_factors or not rope.get("long_factor"):
        return []
    dims = hp["@rope_dimension_count"]
    out = []
    for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                        ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
        values = rope.get(key)
        if not isinstance(values, list) or len(values) * 2 != dims:
            raise RopeScalingError(
                f"config.json RoPE '{key}' does not hold one factor per rotary dimension pair",
                path=path, expected=f"a list of {dims // 2} numbers",
                found=f"{type(values).__name__} of {len(values)}" if isinstance(values, list) else values,
                action="convert",
            )
        factors = [real(v, f"rope.{key}[{i}]", path, error=RopeScalingError) for i, v in enumerate(values)]
        out.append((gguf.TENSOR_NAMES[tensor] + ".weight", np.asarray(factors, dtype=np.float32)))
    return out


def rope_metadata(hp: Mapping[str, Any], arch: _ArchitectureLike, path: str | None) -> list[tuple[str, Any]]:
    """(writer method, value) for the RoPE scaling keys (TextModel.set_gguf_parameters).

    Raises:
        RopeScalingError: GGUF-005 (a scaling type the architecture does not take, or keys the type
            needs missing, of the wrong type or out of range: :func:`convert.gguf.config.check_rope`).
    """
    rope = rope_object(hp)
    kind = _rope_kind(rope, path)
    if kind is None:
        sections = _mrope_sections(hp, path) if arch.rope_scaling_keys else None
        return [] if sections is None else [("add_rope_dimension_sections", sections)]
    if kind not in arch.rope_types:
        raise RopeScalingError(
            "RoPE scaling type not supported for GGUF output",
            path=path,
            expected=f"one of {', '.join(arch.rope_types)}",
            found=kind,
            action="convert",
        )
    if not arch.rope_scaling_keys:  # Phi-3: its own keys (gguf_arch's _PHI3_PARAMS, longrope_factors)
        return []
    checked = check_rope(rope, kind, hp, path)
    factor = rope.get("factor")
    out: list[tuple[str, Any]] = []
    if kind == "linear" and factor is not None:
        out += [("add_rope_scaling_type", gguf.RopeScalingType.LINEAR), ("add_rope_scaling_factor", factor)]
    elif kind == "yarn" and factor is not None:
        out += [
            ("add_rope_scaling_type", gguf.RopeScalingType.YARN),
            ("add_rope_scaling_factor", factor),
            ("add_rope_scaling_orig_ctx_len", checked["original_max_position_embeddings"]),
        ]
        for method, keys in (
            ("add_rope_scaling_yarn_ext_factor", ("extrapolation_factor",)),
            ("add_rope_scaling_yarn_attn_factor", ("attention_factor", "attn_factor")),
            ("add_rope_scaling_yarn_beta_fast", ("beta_fast",)),
            ("add_rope_scaling_yarn_beta_slow", ("beta_slow",)),
        ):
            value = next((rope[k] for k in keys if rope.get(k) is not None), None)
            if value is not None:
                out.append((method, value))
    sections = _mrope_sections(hp, path)
    if sections is not None:
        out.append(("add_rope_dimension_sections", sections))
    return out


def _mrope_sections(hp: Mapping[str, Any], path: str | None) -> list[int] | None:
    """Qwen2-VL's M-RoPE sections (``mrope_section`` of the top-level RoPE object, not of a per-attention
    kind) padded with 0 to 4 (time, height, width, extra), as TextModel.set_gguf_parameters writes them.

    Raises:
        RopeScalingError: GGUF-005 (not a list of at most 4 non-negative integers).
    """
    rope = _rope_root(hp)
    if not isinstance(rope, dict) or "mrope_section" not in rope:
        return None
    sections = rope["mrope_section"]
    if (not isinstance(sections, list) or len(sections) > 4
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31 for v in sections)
            or not any(sections[:3])):
        raise RopeScalingError(
            "config.json RoPE 'mrope_section' is not a list of up to 4 section sizes (uint32), one of the first "
            "three above 0 (llama.cpp aborts on others)",
            path=path,
            expected="a list such as [16, 24, 24]",
            found=str(sections)[:60],
            action="convert",
        )
    return [*sections, *[0] * (4 - len(sections))]


def llama3_rope_freqs(hp: Mapping[str, Any], path: str | None = None) -> npt.NDArray[np.float32] | None:
    """The ``rope_freqs.weight`` factors of Llama 3.1 RoPE scaling (LlamaModel.generate_extra_tensors).

    Raises:
        RopeScalingError: GGUF-005 (:func:`convert.gguf.config.check_rope`).
        GgufConfigError: GGUF-006 (``rope_theta`` or the head dimension not a positive number).
    """
    rope = rope_object(hp)
    if _rope_kind(rope, path) != "llama3":
        return None
    checked = check_rope(rope, "llama3", hp, path)
    base = checked.get("rope_theta")
    if base is None:
        base = float(hp["rope_theta"]) if hp.get("rope_theta") is not None else 10000.0
    base = real(base, "rope_theta", path)
    dim = whole(hp.get("@head_dim"), "head_dim", path)
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    factor = checked.get("factor", 8.0)
    low = checked.get("low_freq_factor", 1.0)
    high = checked.get("high_freq_factor", 4.0)
    old_ctx = float(checked.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f) if f > 0 else math.inf
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)

"""Checking what the GGUF writer reads from config.json against its rules and against the tensors.

llama.cpp's ``convert_hf_to_gguf.py`` trusts config.json: a negative ``hidden_size``, a context
length past uint32, a string ``rope_theta``, a yarn ``rope_scaling`` without
``original_max_position_embeddings`` or a ``vocab_size`` of 10**12 surface as a ``struct.error``,
a ``KeyError`` or an allocation of that size. Here every value is checked before it is used, and
every size that allocates is taken from the tensors, not from the config:

- :func:`check_param`: each :class:`convert.gguf.families.Param` value has the type and range of the
  GGUF value it is written as (:data:`PARAM_RULES`: uint32 counts and lengths >= 1, float32 values
  finite, ``rope_theta`` > 0, epsilons >= 0); a ``bool`` or ``4.0`` is not an integer;
- :func:`check_heads`: ``num_attention_heads`` is a multiple of ``num_key_value_heads``, and
  ``hidden_size`` of ``num_attention_heads`` when ``head_dim`` is derived from them;
- :func:`check_rope`: the RoPE scaling keys llama.cpp reads for the type (``TextModel.set_gguf_parameters``
  for linear and yarn, ``LlamaModel.generate_extra_tensors`` for llama3): yarn with a factor needs
  ``original_max_position_embeddings``; factors finite and > 0; llama3 needs
  0 < ``low_freq_factor`` < ``high_freq_factor`` (llama.cpp divides by both and by their difference);
- :func:`layer_count`: ``num_hidden_layers`` equals the number of layers the tensor names hold
  (``model.layers.N.``: N from 0 to count - 1), checked before gguf's ``TensorNameMap`` (which
  builds names per layer) is made;
- :func:`check_vocab`: ``vocab_size`` equals the rows of the token embedding (``token_embd`` or,
  without it, ``output``) and ``hidden_size`` its width; the tokenizer's vocabulary may not exceed
  those rows (llama.cpp's loader requires it), which bounds every per-token list;
- :func:`check_packable`: last, every metadata value packs as its GGUF type (uint32 in range, text
  that encodes as UTF-8), so writing the header cannot fail half-way;
- :func:`check_special_ids`: ``bos_token_id`` etc. (config.json, read by gguf-py's ``SpecialVocab``)
  are null, a list (ignored, as llama.cpp does) or an integer >= 0, never a bool.

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-005  the RoPE scaling keys have the types, ranges and presence llama.cpp needs for the type
          (:class:`RopeScalingError`)
GGUF-006  config.json values have the type and range of the GGUF value they become, the head
          counts divide, and the layer count, ``vocab_size``, ``hidden_size`` and every tensor's
          shape agree with the tensors (:class:`GgufConfigError`)
========  ======================================================================================

Messages name the file, the key, the rule and what was found (with its JSON type when the type is
wrong); all of this runs while planning, before any output file exists.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gguf

from formats.errors import GgufConfigError, RopeScalingError, TokenizerError

__all__ = [
    "FLOAT32_MAX",
    "PARAM_RULES",
    "SPECIAL_TOKEN_TYPES",
    "UINT32_MAX",
    "check_heads",
    "check_packable",
    "check_param",
    "check_rope",
    "check_special_ids",
    "check_vocab",
    "layer_count",
    "real",
    "whole",
]

UINT32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38

#: ``GGUFWriter.add_*`` method -> what its value must be: ("count", lowest) for uint32 integers,
#: ("float", lowest, lowest allowed) for float32 values (``False``: > lowest, ``True``: >= lowest).
PARAM_RULES: dict[str, tuple[Any, ...]] = {
    "add_block_count": ("count", 1),
    "add_context_length": ("count", 1),
    "add_embedding_length": ("count", 1),
    "add_feed_forward_length": ("count", 1),
    "add_head_count": ("count", 1),
    "add_head_count_kv": ("count", 1),
    "add_key_length": ("count", 1),
    "add_value_length": ("count", 1),
    "add_vocab_size": ("count", 1),
    "add_rope_dimension_count": ("count", 1),
    "add_rope_freq_base": ("float", 0.0, False),
    "add_rope_freq_base_swa": ("float", 0.0, False),
    "add_attn_logit_softcapping": ("float", 0.0, False),
    "add_final_logit_softcapping": ("float", 0.0, False),
    "add_sliding_window": ("count", 0),
    "add_rope_scaling_orig_ctx_len": ("count", 1),
    "add_rope_scaling_attn_factors": ("float", 0.0, False),
    "add_layer_norm_rms_eps": ("float", 0.0, True),
    "add_layer_norm_eps": ("float", 0.0, True),
    "add_attention_scale": ("float", 0.0, False),
    "add_embedding_scale": ("float", 0.0, False),
    "add_residual_scale": ("float", 0.0, False),
    "add_logit_scale": ("float", 0.0, False),
    "add_expert_count": ("count", 1),
    "add_expert_used_count": ("count", 1),
    "add_expert_feed_forward_length": ("count", 1),
    "add_expert_shared_feed_forward_length": ("count", 1),
}

#: The special token types gguf-py's SpecialVocab reads from config.json (``{type}_token_id``).
SPECIAL_TOKEN_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask", "prefix", "suffix", "middle", "fsep",
                       "eot", "eom")

#: A tensor of the text model's transformer block N (``model.layers.N.``, ``transformer.h.N.``, ``layers.N.``;
#: not a vision tower's ``vision_model.encoder.layers.N.``, which GGUF-003 refuses by name).
_LAYER = re.compile(r"^(?:model\.|transformer\.)?(?:layers|h|blocks)\.(\d+)\.")


def _kind(value: Any) -> str:
    """The JSON type of a value, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _found(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:60] + "..."
    return f"{text} ({_kind(value)})"


def whole(
    value: Any,
    key: str,
    path: str | None,
    *,
    lo: int = 1,
    hi: int = UINT32_MAX,
    file: str = "config.json",
    error: type[GgufConfigError] | type[RopeScalingError] = GgufConfigError,
) -> int:
    """``value`` as an integer from ``lo`` to ``hi`` (a JSON integer: not a bool, not ``4.0``).

    Raises:
        GgufConfigError: GGUF-006 (or ``error``), naming ``file``, ``key``, the range and the value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return value
    bounds = f"an integer from {lo} to {hi}" + (" (uint32)" if hi == UINT32_MAX else "")
    what = "is out of range" if isinstance(value, int) and not isinstance(value, bool) else "is not an integer"
    raise error(
        f"{file} {key!r} {what}",
        path=path,
        expected=bounds,
        found=value if what == "is out of range" else _found(value),
        action="convert",
    )


def real(
    value: Any,
    key: str,
    path: str | None,
    *,
    lo: float = 0.0,
    inclusive: bool = False,
    hi: float = FLOAT32_MAX,
    file: str = "config.json",
    error: type[GgufConfigError] | type[RopeScalingError] = GgufConfigError,
) -> float:
    """``value`` as a finite float32 number above ``lo`` (or at it, when ``inclusive``) and <= ``hi``.

    Raises:
        GgufConfigError: GGUF-006 (or ``error``), naming ``file``, ``key``, the range and the value.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number:
        try:
            x = float(value)
        except OverflowError:  # an integer past the float range
            x = math.inf
        if math.isfinite(x) and (x >= lo if inclusive else x > lo) and x <= hi:
            return x
    bounds = f"a finite number {'>=' if inclusive else '>'} {lo:g}" + (" (float32)" if hi == FLOAT32_MAX else
                                                                        f" and <= {hi:g}")
    raise error(
        f"{file} {key!r} {'is out of range' if number else 'is not a number'}",
        path=path,
        expected=bounds,
        found=value if number else _found(value),
        action="convert",
    )


def check_param(method: str, key: str, value: Any, path: str | None) -> Any:
    """A :class:`convert.gguf.families.Param` value, checked by :data:`PARAM_RULES` (others pass as they are).

    Returns:
        The value as the writer takes it (int or float).

    Raises:
        GgufConfigError: GGUF-006.
    """
    rule = PARAM_RULES.get(method)
    if rule is None:
        return value
    if rule[0] == "count":
        return whole(value, key, path, lo=rule[1])
    return real(value, key, path, lo=rule[1], inclusive=rule[2])


def check_heads(hp: Mapping[str, Any], path: str | None) -> None:
    """Head counts divide: kv heads into heads, heads into hidden_size when head_dim is derived.

    Raises:
        GgufConfigError: GGUF-006.
    """
    heads = hp.get("num_attention_heads")
    kv = hp.get("num_key_value_heads")
    hidden = hp.get("hidden_size")
    if heads is not None:
        whole(heads, "num_attention_heads", path)
    if kv is not None:
        whole(kv, "num_key_value_heads", path)
        if heads is not None and heads % kv:
            raise GgufConfigError(
                "config.json 'num_attention_heads' is not a multiple of 'num_key_value_heads'",
                path=path,
                expected=f"a multiple of {kv}",
                found=heads,
                action="convert",
            )
    if hidden is not None:
        whole(hidden, "hidden_size", path)
        if heads is not None and hp.get("head_dim") is None and hidden % heads:
            raise GgufConfigError(
                "config.json 'hidden_size' is not a multiple of 'num_attention_heads' (no 'head_dim' given)",
                path=path,
                expected=f"a multiple of {heads}",
                found=hidden,
                action="convert",
            )


def check_rope(rope: Any, kind: str, hp: Mapping[str, Any], path: str | None) -> dict[str, float]:
    """The RoPE scaling values llama.cpp reads for ``kind``, checked.

    Args:
        rope: the ``rope_parameters`` / ``rope_scaling`` object.
        kind: its type, lower case (``linear``, ``yarn``, ``llama3``, ``default``).
        hp: the hyperparameters (llama3 reads ``original_max_position_embeddings`` there first).
        path: the config file.

    Returns:
        key -> value of every key present and read (factors as floats, context lengths as ints).

    Raises:
        RopeScalingError: GGUF-005.
    """
    where = "rope_scaling" if "rope_parameters" not in hp else "rope_parameters"
    out: dict[str, float] = {}

    def number(key: str, *, lo: float = 0.0, inclusive: bool = False) -> None:
        if rope.get(key) is not None:
            out[key] = real(rope[key], f"{where}.{key}", path, lo=lo, inclusive=inclusive, error=RopeScalingError)

    if kind in ("linear", "yarn", "llama3"):
        number("factor")
    if kind == "yarn" and "factor" in out:
        if rope.get("original_max_position_embeddings") is None:
            raise RopeScalingError(
                f"config.json '{where}' of type yarn lacks a key llama.cpp needs",
                path=path,
                expected="original_max_position_embeddings",
                found=f"keys {sorted(rope)}",
                action="convert",
            )
        out["original_max_position_embeddings"] = whole(
            rope["original_max_position_embeddings"], f"{where}.original_max_position_embeddings", path,
            error=RopeScalingError)
        number("extrapolation_factor", inclusive=True)
        number("attention_factor", inclusive=True)
        number("attn_factor", inclusive=True)
        number("beta_fast", lo=-FLOAT32_MAX, inclusive=True)
        number("beta_slow", lo=-FLOAT32_MAX, inclusive=True)
    if kind == "llama3":
        number("low_freq_factor")
        number("high_freq_factor")
        low, high = out.get("low_freq_factor", 1.0), out.get("high_freq_factor", 4.0)
        if not low < high:
            raise RopeScalingError(
                f"config.json '{where}' of type llama3 needs low_freq_factor < high_freq_factor",
                path=path,
                expected=f"low_freq_factor < {high:g}",
                found=low,
                action="convert",
            )
        if rope.get("rope_theta") is not None:
            out["rope_theta"] = real(rope["rope_theta"], f"{where}.rope_theta", path, error=RopeScalingError)
        old_ctx = "original_max_position_embeddings"  # LlamaModel reads the top level first
        if hp.get(old_ctx) is not None:
            out[old_ctx] = whole(hp[old_ctx], old_ctx, path, error=RopeScalingError)
        elif rope.get(old_ctx) is not None:
            out[old_ctx] = whole(rope[old_ctx], f"{where}.{old_ctx}", path, error=RopeScalingError)
    return out


def check_special_ids(config: Mapping[str, Any], path: str | None) -> None:
    """``{type}_token_id`` in config.json (and its text_config): null, a list (ignored) or an int >= 0.

    Raises:
        GgufConfigError: GGUF-006.
    """
    scopes: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    text = config.get("text_config")
    if isinstance(text, dict):
        scopes.append(("text_config.", text))
    for prefix, scope in scopes:
        for typ in SPECIAL_TOKEN_TYPES:
            key = f"{typ}_token_id"
            value = scope.get(key)
            if value is None or isinstance(value, list):
                continue
            whole(value, prefix + key, path, lo=0)


def layer_count(n_blocks: int, names: Iterable[str], path: str | None) -> None:
    """``num_hidden_layers`` equals the layers the tensors hold: indices 0 .. n_blocks - 1, each present.

    Runs before gguf's ``TensorNameMap`` is built for ``n_blocks`` layers (it makes names per layer),
    so the map is never larger than the tensor list.

    Raises:
        GgufConfigError: GGUF-006 (a tensor of a layer past the count, or layers missing).
    """
    seen: set[int] = set()
    for name in names:
        m = _LAYER.search(name)
        if m is None:
            continue
        index = int(m.group(1)) if len(m.group(1)) < 12 else UINT32_MAX + 1
        if index >= n_blocks:
            raise GgufConfigError(
                "tensor belongs to a layer past config.json's 'num_hidden_layers'",
                path=path,
                tensor=name,
                expected=f"a layer index < {n_blocks}",
                found=index,
                action="convert",
            )
        seen.add(index)
    if len(seen) != n_blocks:
        first = next(i for i in range(n_blocks) if i not in seen)
        raise GgufConfigError(
            "config.json 'num_hidden_layers' differs from the layers the tensors hold",
            path=path,
            expected=f"{len(seen)} (layers found in the tensors)",
            found=f"{n_blocks} (no tensor of layer {first})",
            action="convert",
        )


def check_vocab(
    hp: Mapping[str, Any], embedding: tuple[str, Sequence[int]] | None, path: str | None, *, needs_vocab_size: bool
) -> int:
    """``vocab_size`` and ``hidden_size`` against the token embedding; returns its rows (the vocabulary bound).

    Args:
        hp: the hyperparameters.
        embedding: (Hugging Face name, shape) of ``token_embd`` (or ``output``), None when absent.
        path: the config file.
        needs_vocab_size: the architecture writes ``{arch}.vocab_size`` (Llama).

    Raises:
        GgufConfigError: GGUF-006 (no embedding tensor, or a config value that disagrees with it).
    """
    if embedding is None:
        raise GgufConfigError(
            "the weights hold no token embedding",
            path=path,
            expected="model.embed_tokens.weight (or lm_head.weight)",
            found=None,
            action="convert",
        )
    name, shape = embedding
    if len(shape) != 2:
        raise GgufConfigError(
            "the token embedding is not a matrix", path=path, tensor=name,
            expected="[vocab_size, hidden_size]", found=list(shape), action="convert",
        )
    rows, cols = int(shape[0]), int(shape[1])
    vocab = hp.get("vocab_size")
    if vocab is None and needs_vocab_size:
        raise GgufConfigError(
            "config.json lacks a hyperparameter llama.cpp needs", path=path,
            expected="vocab_size", found=None, action="convert",
        )
    if vocab is not None and whole(vocab, "vocab_size", path) != rows:
        raise GgufConfigError(
            "config.json 'vocab_size' differs from the token embedding's rows",
            path=path,
            tensor=name,
            expected=rows,
            found=vocab,
            action="convert",
        )
    hidden = hp.get("hidden_size")
    if hidden is not None and hidden != cols:
        raise GgufConfigError(
            "config.json 'hidden_size' differs from the token embedding's width",
            path=path,
            tensor=name,
            expected=cols,
            found=hidden,
            action="convert",
        )
    whole(rows, "vocab_size", path)  # the rows themselves fit the GGUF's uint32 fields
    return rows


_PACK_ERRORS = (struct.error, OverflowError, TypeError, ValueError, UnicodeEncodeError, AttributeError)


def check_packable(writer: gguf.GGUFWriter, tok_dir: str | os.PathLike[str], path: str | None) -> None:
    """Every key/value of a scratch writer packs as its GGUF type (what writing the header does).

    Raises:
        TokenizerError: GGUF-004 (a ``tokenizer.*`` value, e.g. a token that is not valid UTF-8 text).
        GgufConfigError: GGUF-006 (any other key).
    """
    for key, v in writer.kv_data[0].items():
        try:
            if (v.type == gguf.GGUFValueType.ARRAY and isinstance(v.value, list) and v.value
                    and all(isinstance(x, str) for x in v.value)):
                "".join(v.value).encode("utf-8")  # tokens, merges: the only way a str array fails
            else:
                writer._pack_val(v.value, v.type, add_vtype=True, sub_type=v.sub_type)
        except _PACK_ERRORS as e:
            where, err, kind = key, e, v.type
            if v.type == gguf.GGUFValueType.ARRAY and isinstance(v.value, (list, tuple)) and v.value:
                kind = v.sub_type or gguf.GGUFValueType.get_type(v.value[0])
                for i, item in enumerate(v.value):
                    try:
                        writer._pack_val(item, kind, add_vtype=False)
                    except _PACK_ERRORS as e2:
                        where, err = f"{key}[{i}]", e2
                        break
            tok = key.startswith("tokenizer.")
            raise (TokenizerError if tok else GgufConfigError)(
                f"GGUF key {where!r} cannot be written as {kind.name}",
                path=tok_dir if tok else path,
                expected=f"a {kind.name} value",
                found=f"{type(err).__name__}: {str(err)[:80]}",
                action="convert",
            ) from None

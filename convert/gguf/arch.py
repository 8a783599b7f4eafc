"""How a Hugging Face model's config.json and tensor names become GGUF, reading the architecture table.

Follows llama.cpp's ``convert_hf_to_gguf.py`` and gguf-py's name tables; the per-class data (metadata
entries, defaults, tokenizer kinds, experts) is the table of :mod:`convert.gguf.families`, one row per
model class instead of one class with methods (docs/gguf.md lists them and what each does specially):

- :data:`ARCHITECTURES` and :func:`find_architecture`: ``config.json`` ``architectures[0]`` -> the
  row (``general.architecture``, the ``gguf.MODEL_ARCH`` that selects the ``TensorNameMap``);
- :func:`hparams`: config.json plus the defaults transformers' config classes fill in (llama.cpp
  reads the config through ``AutoConfig``), ``text_config`` merged, ``rope_theta`` found where
  transformers >= 5 keeps it (per attention kind for sliding-window models), derived ``@`` keys
  (the SWA RoPE base, Phi-3's rotary dimensions and LongRoPE attention factor, with
  :mod:`convert.gguf.rope`'s helpers; Gemma 3's optional keys); :func:`block_count`; the table's
  ``Param`` rows map keys to ``GGUFWriter.add_*`` calls
  (``TextModel``/``GemmaModel``/``Gemma2Model``/``Gemma3Model``/``Phi3MiniModel.set_gguf_parameters``);
- RoPE scaling (its metadata keys, ``rope_freqs.weight``, ``rope_factors_long/short.weight``) is
  :mod:`convert.gguf.rope`'s, driven by each row's ``rope_types``, ``rope_scaling_keys`` and
  ``longrope_factors``;
- tensor names: :func:`text_name` (a multimodal checkpoint's other towers left out, its
  ``language_model.`` level dropped: TextModel.filter_tensors), :func:`is_skipped` (tensors llama.cpp
  never writes) and :func:`gguf_tensor_name`
  (gguf-py's ``TensorNameMap.get_name``: ``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``), refused before any weight is read;
- weight transforms: Llama's q/k row permutation (:func:`permute_heads`, :func:`permutation`: HF
  rotary halves -> GGML interleaved pairs, ``LlamaModel.permute``) and Gemma's ``+1`` on every
  ``*norm.weight`` (:func:`norm_offset`; Gemma's RMSNorm multiplies by ``1 + weight``), both applied
  in float32 by :mod:`convert.gguf.encode`.

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-001  the architecture is a row of :data:`convert.gguf.families.ARCHITECTURES`, and not a Qwen3
          reranker (which llama.cpp converts with a classifier head) (:class:`UnsupportedArchitectureError`)
GGUF-003  every tensor name maps to a GGUF name for the architecture (:class:`UnmappedTensorError`)
GGUF-005  ``rope_parameters`` / ``rope_scaling`` is an object (or null) (:class:`RopeScalingError`;
          the scaling type, its keys and Phi-3's LongRoPE factors: :mod:`convert.gguf.rope`)
GGUF-006  config.json holds the hyperparameters the architecture needs, no MoE experts unless the row
          stacks them, not a Ministral 3 text model, q/k rows
          split into heads, ``text_config`` an object, head counts and the layer count positive
          integers that divide (:mod:`convert.gguf.config`) (:class:`GgufConfigError`)
========  ======================================================================================

Every value is checked (:mod:`convert.gguf.config`) before it is used; nothing here trusts a
config.json type or range.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from convert.gguf.config import check_heads, whole
from convert.gguf.families import ARCHITECTURES, Architecture
from convert.gguf.rope import LOCAL_THETA, longrope_attn_factor, rope_object, rotary_dims
from formats.errors import (
    GgufConfigError,
    RopeScalingError,
    UnmappedTensorError,
    UnsupportedArchitectureError,
)

__all__ = [
    "block_count",
    "find_architecture",
    "gguf_tensor_name",
    "hparams",
    "is_skipped",
    "norm_offset",
    "permutation",
    "permute_heads",
    "text_name",
]

#: Source tensors llama.cpp never writes.
_ALWAYS_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")

#: The other towers of a multimodal checkpoint (vision, audio, projector), never in the text model's
#: file: names starting with one of these (TextModel.filter_tensors) ...
_TOWER_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
                   "sound_projection.", "speech_embeddings.")
#: ... or holding one of these
_TOWER_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.",
                "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed",
                "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector.")


def _supported() -> str:
    """Every supported class name (the GGUF architecture each becomes: docs/gguf.md)."""
    return ", ".join(a for arch in ARCHITECTURES for a in arch.hf_architectures)


def _is_qwen3_reranker(config: Mapping[str, Any], model_dir: Path) -> bool:
    """Qwen3Model._is_qwen3_reranker: a README heading or a name (directory, ``_name_or_path``,
    ``model_type``) that says Qwen3 reranker."""
    readme = model_dir / "README.md"
    try:
        text = readme.read_bytes()[: 1 << 20].decode("utf-8", "replace").lower() if readme.is_file() else ""
    except OSError:
        text = ""
    if "# qwen3-reranker" in text or "# qwen3-vl-reranker" in text:
        return True
    hints = [model_dir.name, config.get("_name_or_path"), config.get("model_type")]
    return any(isinstance(h, str) and ("qwen3-reranker" in h.lower() or "qwen3-vl-reranker" in h.lower())
               for h in hints)


def find_architecture(config: Mapping[str, Any], *, path: str | None = None) -> Architecture:
    """The :class:`Architecture` for a ``config.json``.

    Args:
        config: the parsed config.json.
        path: the config file, for error messages.

    Returns:
        The table row whose ``hf_architectures`` holds ``config["architectures"][0]``.

    Raises:
        UnsupportedArchitectureError: GGUF-001, naming every supported architecture.
        GgufConfigError: GGUF-006, ``architectures`` is not a list of strings.
    """
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise GgufConfigError(
            "config.json 'architectures' must be a list of class names",
            path=path,
            expected='a list such as ["LlamaForCausalLM"]',
            found=f"{type(archs).__name__} {str(archs)[:80]!r}",
            action="convert",
        )
    hf = archs[0] if archs else None
    for arch in ARCHITECTURES:
        if hf in arch.hf_architectures:
            if arch.name == "qwen3" and path is not None and _is_qwen3_reranker(config, Path(path).parent):
                raise UnsupportedArchitectureError(
                    "a Qwen3 reranker is not supported for GGUF output (llama.cpp writes it with a "
                    "classifier head and rank pooling)",
                    path=path,
                    expected=f"a causal language model: one of {_supported()}",
                    found=f"{hf} named as a Qwen3 reranker",
                    hint="convert to safetensors (--to bf16) instead, and use llama.cpp's converter on the result",
                    action="convert",
                )
            return arch
    raise UnsupportedArchitectureError(
        "architecture not supported for GGUF output",
        path=path,
        expected="a class of the GGUF table (docs/gguf.md)",
        found=hf if hf is not None else f"model_type {config.get('model_type')!r}",
        hint=f"the supported classes are {_supported()}; for another, convert to safetensors (--to bf16) "
             "instead, and use llama.cpp's converter on the result",
        action="convert",
    )


def hparams(config: Mapping[str, Any], arch: Architecture, path: str | None) -> dict[str, Any]:
    """config.json plus the defaults transformers fills in, with derived ``@`` keys.

    Args:
        config: the parsed config.json (``text_config`` entries override the top level).
        arch: the architecture row (its ``config_defaults``).
        path: the config file, for error messages.

    Returns:
        The hyperparameters; ``"@head_dim"`` is ``head_dim`` or hidden size / heads.

    Raises:
        GgufConfigError: GGUF-006 (a mixture-of-experts model, a ``text_config`` that is not an object,
            head counts that are not positive integers or do not divide:
            :func:`convert.gguf.config.check_heads`).
        RopeScalingError: GGUF-005 (``rope_parameters`` / ``rope_scaling`` that is not an object).
    """
    hp: dict[str, Any] = dict(config)
    text = hp.get("text_config")
    if isinstance(text, dict):
        hp = {**hp, **text}
    elif "text_config" in hp:  # gguf-py's SpecialVocab reads token ids from it
        raise GgufConfigError(
            "config.json 'text_config' is not an object",
            path=path,
            expected="an object",
            found=f"{type(text).__name__} {str(text)[:40]}",
            action="convert",
        )
    for key in arch.ignored_keys:
        hp.pop(key, None)
    for key in ("rope_parameters", "rope_scaling"):
        if hp.get(key) is not None and not isinstance(hp[key], dict):
            raise RopeScalingError(
                f"config.json '{key}' is not an object",
                path=path,
                expected="an object (or null)",
                found=f"{type(hp[key]).__name__} {str(hp[key])[:40]}",
                action="convert",
            )
    # rope_theta lives in rope_parameters (transformers >= 5; per attention kind for models with
    # sliding-window layers) or at the top level (older configs); TextModel.__init__
    rope = rope_object(hp)
    if "rope_theta" not in hp or hp["rope_theta"] is None:
        theta = rope.get("rope_theta", hp.get("rotary_emb_base"))
        if theta is not None:
            hp["rope_theta"] = theta
    params = hp.get("rope_parameters")
    swa = params.get("sliding_attention") if isinstance(params, dict) else None
    swa_theta = swa.get("rope_theta") if isinstance(swa, dict) else None
    if swa_theta is None:
        swa_theta = next((hp[k] for k in LOCAL_THETA if hp.get(k) is not None), None)
    check_heads(hp, path)  # before the defaults: head_dim is derived only when config.json has none
    heads = hp.get("num_attention_heads")
    hidden = hp.get("hidden_size")
    derived_head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    for key, default in arch.config_defaults.items():
        if hp.get(key) is not None or (key in arch.keep_null and key in hp):
            continue
        if isinstance(default, str) and default.startswith("="):
            default = hp.get(default[1:])
        elif default == "@head_dim":
            default = derived_head_dim
        if default is not None:
            hp[key] = default
    hp["@head_dim"] = hp.get("head_dim") or derived_head_dim
    if swa_theta is None:
        swa_theta = next((hp[k] for k in LOCAL_THETA if hp.get(k) is not None), None)
    hp["@rope_theta_swa"] = swa_theta
    rope_obj = rope_object(hp)
    orig = rope_obj.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    hp["@original_max_position_embeddings"] = orig
    # Phi3MiniModel: rotary dimensions int(partial_rotary_factor * hidden) // heads, window 0 when unset
    hp["@partial_rotary_factor"] = next(
        (v for v in (rope_obj.get("partial_rotary_factor"), hp.get("partial_rotary_factor"), hp.get("rope_pct"),
                     hp.get("rope_percent")) if v is not None), 1.0)
    hp["@rope_dimension_count"] = rotary_dims(hp, path) if arch.longrope_factors else None
    hp["@sliding_window_or_0"] = hp.get("sliding_window") if hp.get("sliding_window") is not None else 0
    hp["@rope_attn_factor"] = longrope_attn_factor(hp, path) if arch.longrope_factors else None
    # Gemma3Model: the final softcapping only when set, the window unless every layer is global
    hp["@final_logit_softcapping"] = hp.get("final_logit_softcapping") or None
    hp["@sliding_window"] = hp.get("sliding_window") if hp.get("sliding_window_pattern") != 1 else None
    # GraniteMoeModel: the shared expert's size only when set and not 0
    hp["@shared_intermediate_size"] = hp.get("shared_intermediate_size") or None
    if arch.name == "mistral3" and hp.get("model_type") == "ministral3":
        _ministral3_keys(hp, path)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hp.get(key) and arch.experts is None:
            moe = ", ".join(a for row in ARCHITECTURES if row.experts is not None for a in row.hf_architectures)
            raise GgufConfigError(
                f"config.json gives experts, and this architecture has no mixture-of-experts layout (those "
                f"that do: {moe})",
                path=path,
                expected="no experts",
                found=f"{key} = {hp[key]}",
                action="convert",
            )
    _check_experts_used(hp, arch, path)
    return hp


def _check_experts_used(hp: Mapping[str, Any], arch: Architecture, path: str | None) -> None:
    """llama.cpp asserts ``expert_used_count <= expert_count`` when it builds the graph (an abort, not an
    error): checked here.

    Raises:
        GgufConfigError: GGUF-006.
    """
    if arch.experts is None:
        return
    count = next((hp[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if hp.get(k) is not None),
                 None)
    used_key = next((k for k in ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")
                     if hp.get(k) is not None), None)
    if used_key is None or not isinstance(count, int) or isinstance(count, bool):
        return
    used = hp[used_key]
    if isinstance(used, int) and not isinstance(used, bool) and used > count:
        raise GgufConfigError(
            "config.json routes each token to more experts than the model has",
            path=path,
            expected=f"{used_key} <= {count} (the expert count)",
            found=used,
            action="convert",
        )


def _ministral3_keys(hp: dict[str, Any], path: str | None) -> None:
    """Ministral3Model's own keys for a ``ministral3`` text model: ``rope.scaling.yarn_log_multiplier`` and
    ``attention.temperature_scale`` from its YaRN RoPE object (``mscale_all_dim``, ``llama_4_scaling_beta``).

    Raises:
        RopeScalingError: GGUF-005 (not YaRN, or either value missing or not a number).
    """
    rope = rope_object(hp)
    kind = rope.get("rope_type", rope.get("type"))
    for key in ("mscale_all_dim", "llama_4_scaling_beta"):
        value = rope.get(key)
        if kind != "yarn" or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RopeScalingError(
                "a Ministral 3 text model needs YaRN RoPE with its mscale_all_dim and llama_4_scaling_beta",
                path=path,
                expected=f"rope_parameters of type yarn with a number {key}",
                found=f"type {kind!r}, {key} {value!r}",
                action="convert",
            )
    hp["@yarn_log_mul"] = float(rope["mscale_all_dim"])
    hp["@attn_temperature_scale"] = float(rope["llama_4_scaling_beta"])


def block_count(hp: Mapping[str, Any], path: str | None) -> int:
    """The number of transformer blocks (``{arch}.block_count``; sizes the ``TensorNameMap``).

    Raises:
        GgufConfigError: GGUF-006 (config.json has no layer count, or one that is not an integer
            from 1 to 2**32 - 1; :func:`convert.gguf.config.layer_count` checks it against the tensors).
    """
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in hp:
            return whole(hp[key], key, path)
    raise GgufConfigError(
        "config.json has no layer count",
        path=path,
        expected="num_hidden_layers",
        found=None,
        action="convert",
    )


def text_name(arch: Architecture, hf_name: str) -> str | None:
    """The name llama.cpp's converter gives a tensor before mapping it, None for a tensor of a
    multimodal checkpoint's other towers (vision, audio, projector: TextModel.filter_tensors).

    ``language_model.model.layers.0.mlp.up_proj.weight`` (transformers 4.x) and
    ``model.language_model.layers.0.mlp.up_proj.weight`` (5.x) -> ``model.layers.0.mlp.up_proj.weight``;
    ``vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight`` -> None.
    """
    if hf_name.startswith(_TOWER_PREFIXES) or any(part in hf_name for part in _TOWER_PARTS):
        return None
    for part in arch.strip:
        hf_name = hf_name.replace(part, "")
    return hf_name


def is_skipped(arch: Architecture, hf_name: str) -> bool:
    """True for a source tensor llama.cpp never writes (rotary caches, masks, Gemma's tied head)."""
    return hf_name.endswith(_ALWAYS_SKIPPED) or hf_name in arch.skip


def gguf_tensor_name(
    name_map: gguf.TensorNameMap, arch: Architecture, hf_name: str, path: str | None
) -> str:
    """The GGUF name of a Hugging Face tensor (gguf-py ``TensorNameMap.get_name``).

    Args:
        name_map: ``gguf.get_tensor_name_map(arch.model_arch, block_count)``.
        arch: the architecture row.
        hf_name: e.g. ``model.layers.3.self_attn.q_proj.weight``.
        path: the config file, for error messages.

    Returns:
        e.g. ``blk.3.attn_q.weight``.

    Raises:
        UnmappedTensorError: GGUF-003 (no GGUF name for this architecture).
    """
    gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise UnmappedTensorError(
            "tensor has no GGUF name for this architecture",
            path=path,
            tensor=hf_name,
            expected=f"a tensor of a {arch.name} model",
            found=hf_name,
            action="convert",
            hint="only the text model's weights can be written (no vision towers or extra heads)",
        )
    return gguf_name


def permute_heads(
    arch: Architecture, hf_name: str, shape: tuple[int, ...], hp: Mapping[str, Any], path: str | None
) -> int:
    """The head count ``LlamaModel.permute`` uses for this tensor's rows, 0 when it is not permuted.

    q_proj weight/bias: ``num_attention_heads``; k_proj: ``num_key_value_heads``; only for an
    architecture with ``permute_qk``.

    Raises:
        GgufConfigError: GGUF-006 (the rows do not split into 2 x heads).
    """
    n_head = hp.get("num_attention_heads")
    n_head_kv = hp.get("num_key_value_heads", n_head)
    heads = 0
    if arch.permute_qk and isinstance(n_head, int):
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_head
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_head_kv if isinstance(n_head_kv, int) else n_head
        if heads and (not shape or shape[0] % (2 * heads)):
            raise GgufConfigError(
                "q/k rows do not split into heads",
                path=path,
                tensor=hf_name,
                expected=f"a multiple of 2 x {heads}",
                found=shape[0] if shape else "a scalar",
                action="convert",
            )
    return heads


def norm_offset(arch: Architecture, hf_name: str) -> float:
    """Value added in float32 before rounding: Gemma's ``1.0`` on every ``*norm.weight``, else 0."""
    return arch.norm_offset if arch.norm_offset and hf_name.endswith("norm.weight") else 0.0


def permutation(rows: int, heads: int) -> npt.NDArray[np.intp]:
    """Row order of ``LlamaModel.permute``: ``out[r] = in[perm[r]]``.

    ``LlamaModel.permute`` reshapes to ``(heads, 2, rows/heads/2, ...)`` and swaps axes 1 and 2, so
    each head's two rotary halves become interleaved pairs; rows stay inside their head's block of
    ``rows/heads``.

    Returns:
        intp[rows], a permutation of ``range(rows)``.
    """
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).swapaxes(1, 2).reshape(-1)

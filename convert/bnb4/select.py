"""Which planned tensors ``--to nf4|fp4`` quantizes, and the ``quantization_config`` it writes.

Header-only rules that equal transformers' ``replace_with_bnb_linear`` on standard models, since no
model class is built (:func:`should_quantize`):

- 2-D float ``<module>.weight`` tensors (Linear / Conv1D weights), and every layer that is already
  4-bit or 8-bit in the input;
- not norms (a module named ``*norm``: Command R+'s 2-D per-head ``q_norm``/``k_norm``), not embeddings
  (a name part containing ``embed``, or ``wte``, ``wpe``, ``shared``), not the
  output head (``lm_head``, ``embed_out``, ``score``, ``classifier``, ``qa_outputs`` outside the
  blocks: transformers' ``get_keys_to_not_convert``), never norms (1-D) or biases;
- not modules matching ``--skip-modules`` (transformers' ``should_convert_module`` matching:
  :func:`matches_module`); these and the head go into ``llm_int8_skip_modules`` (null when nothing
  was asked, as transformers writes it);
- not a Mixture-of-Experts model's experts and router (:func:`moe_kept`): transformers 5 holds them as
  bare parameters (fused 3-D experts, a top-k router module) where ``replace_with_bnb_linear`` converts
  only modules whose type is exactly ``nn.Linear``; it saves them under the per-expert names of the
  original checkpoint, 16-bit, and refuses 4-bit ones ("size mismatch"). 4-bit experts of an input
  (transformers 4.x quantized them) are dequantized. Shared experts and Qwen2-MoE's
  ``shared_expert_gate`` are ``nn.Linear`` and quantized;
- not the ``out_proj`` of an ``nn.MultiheadAttention`` (:func:`multihead_out_projs`: a
  ``NonDynamicallyQuantizableLinear``, which ``replace_with_bnb_linear`` skips as it is not exactly ``nn.Linear``);
- ``--include`` forces a tensor (e.g. the 1-D or 3-D tensor of a single-tensor file).

``config.json`` gets the ``quantization_config`` block transformers 5 writes
(:func:`quantization_config`); a bnb input's own block hands on its skip list and compute dtype
(:func:`input_quantization_config`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from convert.bnb4.settings import QuantSettings
from formats.dtypes import FLOAT_OUTPUTS, DType, float_dtype_name

__all__ = [
    "MOE_TYPES",
    "input_quantization_config",
    "is_expert",
    "is_head",
    "matches_module",
    "module_name",
    "moe_kept",
    "moe_unknown",
    "multihead_out_projs",
    "quantization_config",
    "should_quantize",
]

_HEADS = ("lm_head", "embed_out", "score", "classifier", "qa_outputs")
_EMBED_EXACT = ("wte", "wpe", "shared")

#: config.json ``model_type`` of a transformers 5 MoE model -> its router module below a layer (a
#: ``*TopKRouter`` holding a bare ``weight``), as the saved checkpoint names it (modeling_<type>.py).
_MOE_ROUTERS: dict[str, str] = {
    "mixtral": r"(?:block_sparse_moe|mlp)\.gate",
    "phimoe": r"(?:block_sparse_moe|mlp)\.gate",
    "qwen2_moe": r"mlp\.gate",
    "qwen3_moe": r"mlp\.gate",
    "olmoe": r"mlp\.gate",
    "granitemoe": r"block_sparse_moe\.router\.layer",
    "granitemoeshared": r"block_sparse_moe\.router\.layer",
}
#: The MoE model types whose layout transformers + bnb save is known (:data:`_MOE_ROUTERS`' keys).
MOE_TYPES = tuple(_MOE_ROUTERS)
#: The experts below a layer: per-expert modules (``experts.3.w1``, ``experts.3.gate_proj``), the fused
#: parameters (``experts.gate_up_proj``), Granite's ``input_linear``/``output_linear``.
_MOE_EXPERTS = r"(?:block_sparse_moe|mlp)\.(?:experts\..+|input_linear|output_linear)"


def matches_module(full_name: str, pattern: str) -> bool:
    """transformers' ``should_convert_module`` test for one pattern (True = the pattern matches).

    A regex matched from the start up to a module boundary (``layer.1`` matches ``layer.1.attn``,
    not ``layer.11.attn``), or a plain suffix (``fc1`` matches ``model.layers.3.fc1``).
    """
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    try:
        if re.match(rf"(?:{pattern}){boundary}", full_name):
            return True
    except re.error:
        pass
    return full_name.endswith(pattern)


def selects(name: str, pattern: str, *, include: bool) -> bool:
    """Whether a ``--skip-modules`` (``include`` False) or ``--include`` pattern names the tensor ``name``:
    its module by :func:`matches_module` (an ``--include`` pattern may also name the tensor itself)."""
    return matches_module(module_name(name), pattern) or (include and matches_module(name, pattern))


def module_name(name: str) -> str:
    """The module a tensor belongs to: ``name`` without a trailing ``.weight``."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _is_embedding(module: str) -> bool:
    return any("embed" in part or part in _EMBED_EXACT for part in module.split("."))


def is_head(module: str) -> bool:
    """Whether a module is an output head outside the blocks (transformers' ``get_keys_to_not_convert``)."""
    parts = module.split(".")
    return parts[-1] in _HEADS and not any(p.isdigit() for p in parts)


def moe_kept(config: Any) -> re.Pattern[str] | None:
    """The modules of a Mixture-of-Experts model that transformers 5 + bnb keep 16-bit (experts and
    router), matched against a module name by ``search``; None for other models.

    Args:
        config: the checkpoint's ``config.json`` (any JSON value); a multimodal model's ``text_config``
            names the text model's type.
    """
    if not isinstance(config, dict):
        return None
    types = [config.get("model_type")]
    if isinstance(config.get("text_config"), dict):
        types.append(config["text_config"].get("model_type"))
    for t in types:
        if isinstance(t, str) and t in _MOE_ROUTERS:
            return re.compile(rf"(?:^|\.)layers\.\d+\.(?:{_MOE_EXPERTS}|{_MOE_ROUTERS[t]})$")
    return None


#: config.json keys giving a Mixture-of-Experts model's expert count (transformers' config classes).
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def moe_unknown(config: Any) -> str | None:
    """A Mixture-of-Experts model whose type :data:`_MOE_ROUTERS` does not hold (transformers' layout of
    its experts and router unknown here), described as ``model_type 'x' with N experts``; None otherwise.

    Args:
        config: the checkpoint's ``config.json`` (any JSON value); ``text_config`` is read too.
    """
    if not isinstance(config, dict) or moe_kept(config) is not None:
        return None
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        for key in _EXPERT_COUNTS:
            n = cfg.get(key)
            if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                return f"model_type {cfg.get('model_type', config.get('model_type'))!r} with {key} = {n}"
    return None


def is_expert(name: str) -> bool:
    """Whether a tensor belongs to a layer's experts (per-expert modules or fused expert parameters)."""
    return re.search(rf"(?:^|\.)layers\.\d+\.{_MOE_EXPERTS}$", module_name(name)) is not None


def multihead_out_projs(names: Iterable[str]) -> frozenset[str]:
    """The ``out_proj`` modules of ``nn.MultiheadAttention`` layers (a SigLIP vision tower's pooling head):
    a module holding a bare ``in_proj_weight``. Their ``out_proj`` is a ``NonDynamicallyQuantizableLinear``,
    not exactly ``nn.Linear``, so transformers + bnb leave it 16-bit."""
    return frozenset(n.removesuffix("in_proj_weight") + "out_proj" for n in names if n.endswith(".in_proj_weight"))


def should_quantize(
    name: str, shape: Sequence[int], dtype: DType, *, was_quantized: bool = False,
    skip: Sequence[str] = (), include: Sequence[str] = (), moe: re.Pattern[str] | None = None,
    mha: frozenset[str] = frozenset(),
) -> tuple[bool, str]:
    """Whether a planned tensor becomes a 4-bit layer, and why (for the plan listing).

    Args:
        name: the tensor name.
        shape: its shape in elements.
        dtype: its (float) dtype in the plan.
        was_quantized: the input holds it as a bnb 4-bit or 8-bit layer.
        skip: ``--skip-modules`` patterns.
        include: ``--include`` patterns (win over every other rule).
        moe: :func:`moe_kept` of the model's config (its experts and router stay 16-bit).
        mha: :func:`multihead_out_projs` of the model's tensors (they stay 16-bit).

    Returns:
        (quantize?, reason).
    """
    module = module_name(name)
    if not dtype.is_float:
        return False, "not a float tensor"
    if dtype.name not in FLOAT_OUTPUTS:
        # bnb's QuantState dtype is float16, bfloat16 or float32 (BNB-013 on reading): a float8 or
        # float64 weight (diffusion checkpoints' text encoders) is kept as it is
        return False, f"{dtype.code} weight (a QuantState dtype is F16, BF16 or F32)"
    if any(d == 0 for d in shape):  # a QuantState's shape has positive sizes (BNB-014 would refuse the output)
        return False, "empty (no values to quantize)"
    if any(selects(name, p, include=True) for p in include):
        return True, "--include"
    if any(selects(name, p, include=False) for p in skip):
        return False, "--skip-modules"
    if moe is not None and moe.search(module):
        return False, "MoE expert or router (transformers keeps it 16-bit)"
    if module in mha:
        return False, "nn.MultiheadAttention's out_proj (transformers keeps it 16-bit)"
    if was_quantized:
        if is_head(module):
            return False, "output head"
        return True, "4-bit/8-bit in the input"
    if not name.endswith(".weight") or len(shape) != 2:
        return False, "not a 2-D weight"
    if module.rsplit(".", 1)[-1].endswith("norm"):  # per-head q/k norms (Command R+): a norm module, never Linear
        return False, "a norm (not an nn.Linear)"
    if _is_embedding(module):
        return False, "embedding"
    if is_head(module):
        return False, "output head"
    return True, "Linear weight"


def quantization_config(settings: QuantSettings, compute_dtype: str,
                        skip_modules: list[str] | None) -> dict[str, Any]:
    """The ``quantization_config`` block transformers 5 writes for these settings (BitsAndBytesConfig)."""
    return {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": settings.quant_storage,
        "bnb_4bit_quant_type": settings.quant_type,
        "bnb_4bit_use_double_quant": settings.nested,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }


def input_quantization_config(config: Any) -> dict[str, Any]:
    """What carries over from an input's bnb ``quantization_config``: its skip list and compute dtype.

    Args:
        config: the input's ``config.json`` (any JSON value; None when there is none).

    Returns:
        ``llm_int8_skip_modules`` and ``bnb_4bit_compute_dtype`` (without ``torch.``) where present and
        valid; {} when the input is not a bnb checkpoint.
    """
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "bitsandbytes":
        return {}
    out: dict[str, Any] = {}
    skip = qc.get("llm_int8_skip_modules")
    if isinstance(skip, list) and all(isinstance(x, str) for x in skip):
        out["llm_int8_skip_modules"] = skip
    compute = float_dtype_name(qc.get("bnb_4bit_compute_dtype"))
    if compute is not None:
        out["bnb_4bit_compute_dtype"] = compute
    return out

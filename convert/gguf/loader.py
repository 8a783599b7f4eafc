"""The planned tensors against what llama.cpp's loader creates from the metadata written
(``llama_model_<arch>::load_arch_tensors``): shapes and required tensors, checked while planning.

- :func:`check_shapes`: every planned tensor has the shape llama.cpp's loader creates it with from the
  metadata the plan writes (:data:`LOADER_SHAPES`: ``attn_q`` rows ``head_count x key_length``, ``ffn_up``
  rows ``feed_forward_length``, expert stacks ``[expert_count, rows, cols]``, ...), so a config.json that
  does not fit the weights is refused here instead of by ``check_tensor_dims``;
- :func:`check_required`: every tensor the loader requires (:data:`REQUIRED_PER_LAYER`) comes from some input
  tensor, and no shared expert it would not load is planned ("tensor ... not found" / "wrong number of
  tensors" otherwise).

Rules raised here (see docs/errors.md): GGUF-006 (:class:`GgufConfigError`), naming config.json, the tensor,
its size and the expected one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from formats.errors import GgufConfigError

__all__ = ["LOADER_SHAPES", "REQUIRED_PER_LAYER", "check_required", "check_shapes"]


#: GGUF writer method -> the llama.cpp hyperparameter it sets (``llama_model_base::load_hparams``).
_SYMBOL_OF = {
    "add_embedding_length": "n_embd",
    "add_head_count": "n_head",
    "add_head_count_kv": "n_head_kv",
    "add_key_length": "n_embd_head_k",
    "add_value_length": "n_embd_head_v",
    "add_feed_forward_length": "n_ff",
    "add_expert_count": "n_expert",
    "add_expert_feed_forward_length": "n_ff_exp",
    "add_expert_shared_feed_forward_length": "n_ff_shexp",
}

_E, _V = "n_embd", "n_vocab"
# upstream's products with the head count first (for the message: "num_attention_heads 8 x head_dim 64")
_Q = "n_head*n_embd_head_k"  # n_embd_head_k * n_head: the width of q and of attn_output's input
_K_GQA = "n_head_kv*n_embd_head_k"  # n_embd_k_gqa
_V_GQA = "n_head_kv*n_embd_head_v"  # n_embd_v_gqa (also ``n_embd_gqa``)

#: Shapes llama.cpp creates without a layer (GGUF order: ne0 = columns first; ``n_vocab`` not checked).
_GLOBAL: dict[str, tuple[str, ...]] = {
    "token_embd.weight": (_E, _V),
    "output_norm.weight": (_E,),
    "output.weight": (_E, _V),
    "output.bias": (_V,),
}

#: ``llama_model_llama::load_arch_tensors`` (GEMMA's is the same minus the biases): per layer, with
#: ``create_tensor_qkv(layer, i, n_embd, n_embd_head_k * n_head, n_embd_k_gqa, n_embd_v_gqa)``.
_LLAMA: dict[str, tuple[str, ...]] = {
    "attn_norm.weight": (_E,),
    "attn_q.weight": (_E, _Q),
    "attn_k.weight": (_E, _K_GQA),
    "attn_v.weight": (_E, _V_GQA),
    "attn_q.bias": (_Q,),
    "attn_k.bias": (_K_GQA,),
    "attn_v.bias": (_V_GQA,),
    "attn_output.weight": (_Q, _E),
    "attn_output.bias": (_E,),
    "ffn_norm.weight": (_E,),
    "ffn_gate.weight": (_E, "n_ff"),
    "ffn_down.weight": ("n_ff", _E),
    "ffn_up.weight": (_E, "n_ff"),
    "ffn_gate.bias": ("n_ff",),
    "ffn_down.bias": (_E,),
    "ffn_up.bias": ("n_ff",),
}

#: ``llama_model_qwen2::load_arch_tensors``: q and attn_output are ``n_embd`` wide, k and v ``n_embd_gqa``.
_QWEN2 = {
    **_LLAMA,
    "attn_q.weight": (_E, _E),
    "attn_k.weight": (_E, _V_GQA),
    "attn_v.weight": (_E, _V_GQA),
    "attn_q.bias": (_E,),
    "attn_k.bias": (_V_GQA,),
    "attn_v.bias": (_V_GQA,),
    "attn_output.weight": (_E, _E),
}

#: ``llama_model_qwen3::load_arch_tensors``: q ``n_embd_head_k * n_head``, k and v ``n_embd_gqa``, q/k norms.
_QWEN3 = {
    **_QWEN2,
    "attn_q.weight": (_E, _Q),
    "attn_q.bias": (_Q,),
    "attn_output.weight": (_Q, _E),
    "attn_k_norm.weight": ("n_embd_head_k",),
    "attn_q_norm.weight": ("n_embd_head_k",),
}

#: ``llama_model_gemma2::load_arch_tensors``: Llama's plus the post-attention and post-FFN norms.
_GEMMA2 = {**_LLAMA, "post_attention_norm.weight": (_E,), "post_ffw_norm.weight": (_E,)}

#: ``llama_model_phi3::load_arch_tensors``: a fused qkv (``create_tensor_qkv(layer, i, n_embd, n_embd,
#: n_embd_gqa, n_embd_gqa)``), attn_output ``n_embd`` wide, a fused gate/up of ``2 * n_ff`` rows.
_PHI3 = {
    **_QWEN2,
    "attn_qkv.weight": (_E, f"{_E}+2*{_V_GQA}"),
    "attn_qkv.bias": (f"{_E}+2*{_V_GQA}",),
    "ffn_up.weight": (_E, "2*n_ff"),
}

#: The MoE layer of ``llama_model_llama::load_arch_tensors`` (n_expert > 0): a router and stacked experts
#: of ``n_ff`` rows.
_LLAMA_MOE = {
    "ffn_gate_inp.weight": (_E, "n_expert"),
    "ffn_gate_exps.weight": (_E, "n_ff", "n_expert"),
    "ffn_down_exps.weight": ("n_ff", _E, "n_expert"),
    "ffn_up_exps.weight": (_E, "n_ff", "n_expert"),
}

#: ``llama_model_qwen3moe::load_arch_tensors``' MoE layer: experts of ``expert_feed_forward_length`` rows.
_QWEN_MOE = {
    "ffn_gate_inp.weight": (_E, "n_expert"),
    "ffn_gate_exps.weight": (_E, "n_ff_exp", "n_expert"),
    "ffn_down_exps.weight": ("n_ff_exp", _E, "n_expert"),
    "ffn_up_exps.weight": (_E, "n_ff_exp", "n_expert"),
}

#: ``llama_model_qwen2moe::load_arch_tensors``: Qwen3-MoE's experts plus a shared expert and its gate.
_QWEN2_MOE = {
    **_QWEN_MOE,
    "ffn_gate_inp_shexp.weight": (_E,),
    "ffn_gate_shexp.weight": (_E, "n_ff_shexp"),
    "ffn_down_shexp.weight": ("n_ff_shexp", _E),
    "ffn_up_shexp.weight": (_E, "n_ff_shexp"),
}

#: ``llama_model_olmo2::load_arch_tensors``: Qwen2's attention widths, q/k norms over all heads, post-attention
#: and post-FFN norms (no pre-norms).
_OLMO2 = {
    **{k: v for k, v in _QWEN2.items() if k not in ("attn_norm.weight", "ffn_norm.weight")},
    "attn_q_norm.weight": (_E,),
    "attn_k_norm.weight": (_K_GQA,),
    "post_attention_norm.weight": (_E,),
    "post_ffw_norm.weight": (_E,),
}

#: ``llama_model_command_r::load_arch_tensors``: Qwen2's widths, no output (the embedding is reused), per-head
#: q/k norms (``use_qk_norm``).
_COMMAND_R = {
    **_QWEN2,
    "attn_q_norm.weight": ("n_embd_head_k", "n_head"),
    "attn_k_norm.weight": ("n_embd_head_k", "n_head_kv"),
}

#: ``general.architecture`` -> (GGUF tensor name, ``blk.N.`` stripped) -> the dimensions llama.cpp's
#: ``load_arch_tensors`` passes to ``create_tensor``, written as there: GGUF order (ne0, the row
#: length, first; reversed against our PyTorch-order shapes), products and sums of its
#: hyperparameters. ``check_tensor_dims`` refuses a file whose tensor differs in any dimension.
#: Entries are in the loader's order (global tensors, then per layer), so the tensor named in the
#: error is the one llama.cpp would name.
LOADER_SHAPES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {**_GLOBAL, **_LLAMA, **_LLAMA_MOE},
    "granite": {**_GLOBAL, **_LLAMA},
    "smollm3": {**_GLOBAL, **_LLAMA},
    "mistral3": {**_GLOBAL, **_LLAMA},
    "qwen2": {**_GLOBAL, **_QWEN2},
    "qwen2vl": {**_GLOBAL, **_QWEN2},
    "olmo2": {**_GLOBAL, **_OLMO2},
    "command-r": {**_GLOBAL, **_COMMAND_R},
    "qwen3": {**_GLOBAL, **_QWEN3},
    "qwen2moe": {**_GLOBAL, **_QWEN2, **_QWEN2_MOE},
    "qwen3moe": {**_GLOBAL, **_QWEN3, **_QWEN_MOE},
    "granitemoe": {**_GLOBAL, **_LLAMA, **_LLAMA_MOE, **{k: v for k, v in _QWEN2_MOE.items() if "shexp" in k and
                                                         k != "ffn_gate_inp_shexp.weight"}},
    "gemma": {**_GLOBAL, **_LLAMA},
    "gemma2": {**_GLOBAL, **_GEMMA2},
    "gemma3": {**_GLOBAL, **_GEMMA2, **{k: _QWEN3[k] for k in ("attn_q_norm.weight", "attn_k_norm.weight")}},
    "phi3": {**_GLOBAL, **_PHI3},
}

_BLOCK = re.compile(r"^blk\.\d+\.")

_ATTN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
_DENSE_FFN = ("ffn_gate.weight", "ffn_down.weight", "ffn_up.weight")
_POST = ("post_attention_norm.weight", "post_ffw_norm.weight")
_QK_NORM = ("attn_q_norm.weight", "attn_k_norm.weight")

#: ``general.architecture`` -> the per-layer tensors llama.cpp's ``load_arch_tensors`` creates without
#: ``TENSOR_NOT_REQUIRED`` (its loader refuses a file that lacks one), for a dense model; besides these, every
#: file needs ``token_embd`` and ``output_norm``. A MoE layer (``expert_count`` > 0) needs :data:`_MOE_REQUIRED`
#: instead of the dense FFN.
REQUIRED_PER_LAYER: dict[str, tuple[str, ...]] = {
    "llama": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "granite": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "granitemoe": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "smollm3": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "mistral3": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "qwen2": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "qwen2vl": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "qwen3": ("attn_norm.weight", *_ATTN, *_QK_NORM, "ffn_norm.weight", *_DENSE_FFN),
    "qwen2moe": ("attn_norm.weight", *_ATTN, "ffn_norm.weight"),
    "qwen3moe": ("attn_norm.weight", *_ATTN, *_QK_NORM, "ffn_norm.weight"),
    "olmo2": (*_ATTN, *_QK_NORM, *_POST, *_DENSE_FFN),
    "command-r": ("attn_norm.weight", *_ATTN, *_DENSE_FFN),
    "gemma": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN),
    "gemma2": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN, *_POST),
    "gemma3": ("attn_norm.weight", *_ATTN, "ffn_norm.weight", *_DENSE_FFN, *_POST),
    "phi3": ("attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_down.weight", "ffn_up.weight"),
}

#: A MoE layer's required tensors (the router, the down and up stacks; llama's gate stack is optional), by
#: architecture; the shared expert's where its size is set (Qwen2-MoE always, GraniteMoe when not 0).
_MOE_REQUIRED: dict[str, tuple[str, ...]] = {
    "llama": ("ffn_gate_inp.weight", "ffn_down_exps.weight", "ffn_up_exps.weight"),
    "granitemoe": ("ffn_gate_inp.weight", "ffn_down_exps.weight", "ffn_up_exps.weight"),
    "qwen2moe": ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_down_exps.weight", "ffn_up_exps.weight",
                 "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_down_shexp.weight", "ffn_up_shexp.weight"),
    "qwen3moe": ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_down_exps.weight", "ffn_up_exps.weight"),
}
_SHARED_EXPERT = ("ffn_gate_shexp.weight", "ffn_down_shexp.weight", "ffn_up_shexp.weight")


def check_required(arch_name: str, n_blocks: int, names: Iterable[str], experts: int, shared_ff: int,
                   path: str | None) -> None:
    """Every tensor llama.cpp's loader requires is planned, and no shared expert it would not load is.

    Args:
        arch_name: ``general.architecture``.
        n_blocks: the layer count.
        names: the planned GGUF tensor names.
        experts: ``{arch}.expert_count`` (0 for a dense model).
        shared_ff: ``{arch}.expert_shared_feed_forward_length`` (0 when not written).
        path: the config file.

    Raises:
        GgufConfigError: GGUF-006, naming the first missing tensor (in the loader's order) or an unexpected
            shared expert (llama.cpp: "tensor ... not found" / "wrong number of tensors").
    """
    per_layer = REQUIRED_PER_LAYER.get(arch_name)
    if per_layer is None:
        return
    if experts > 0:
        per_layer = (*(n for n in per_layer if n not in _DENSE_FFN), *_MOE_REQUIRED.get(arch_name, ()))
        if arch_name == "granitemoe" and shared_ff > 0:
            per_layer = (*per_layer, *_SHARED_EXPERT)
    have = set(names)
    wanted = ["token_embd.weight", "output_norm.weight",
              *(f"blk.{i}.{n}" for i in range(n_blocks) for n in per_layer)]
    missing = next((n for n in wanted if n not in have), None)
    if missing is not None:
        raise GgufConfigError(
            f"the weights lack a tensor llama.cpp's loader requires: {missing} (no tensor of the input becomes it)",
            path=path,
            expected=f"every layer's {', '.join(n.removesuffix('.weight') for n in per_layer)}",
            found=f"no {missing}",
            action="convert",
        )
    extra = next((n for n in sorted(have) if arch_name == "granitemoe" and shared_ff <= 0
                  and _BLOCK.sub("", n) in _SHARED_EXPERT), None)
    if extra is not None:
        raise GgufConfigError(
            "the weights hold a shared expert, and config.json gives it no size (llama.cpp would not load it)",
            path=path,
            expected="shared_intermediate_size > 0",
            found=f"{extra} and shared_intermediate_size {shared_ff or 'unset'}",
            action="convert",
        )


class _ParamLike(Protocol):
    @property
    def method(self) -> str: ...

    @property
    def keys(self) -> tuple[str, ...]: ...


class _TensorLike(Protocol):
    @property
    def source(self) -> str | None: ...

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def _hyperparameters(
    values: Iterable[tuple[_ParamLike, Any]], hp: Mapping[str, Any]
) -> dict[str, tuple[int, str]]:
    """llama.cpp's hyperparameter -> (value, how config.json gives it), as ``llama_model_base::load_hparams``
    reads them from the metadata written: ``head_count_kv`` defaults to ``head_count``, ``key_length``
    and ``value_length`` to ``embedding_length / head_count`` (integer division), a missing
    ``feed_forward_length`` to 0."""
    sym: dict[str, tuple[int, str]] = {}
    for param, value in values:
        name = _SYMBOL_OF.get(param.method)
        if name is None:
            continue
        key = next((k for k in param.keys if hp.get(k) is not None), param.keys[0]).lstrip("@")
        sym[name] = (int(value), f"{key} {int(value)}")
    if "n_embd" in sym and "n_head" in sym:  # required by every architecture row; otherwise not checked
        n_embd, n_head = sym["n_embd"], sym["n_head"]
        sym.setdefault("n_head_kv", n_head)
        for name in ("n_embd_head_k", "n_embd_head_v"):
            sym.setdefault(name, (n_embd[0] // n_head[0], f"({n_embd[1]} / {n_head[1]})"))
    sym.setdefault("n_ff", (0, "feed_forward_length 0 (not written)"))
    return sym


def _dimension(expr: str, sym: Mapping[str, tuple[int, str]]) -> tuple[int, str] | None:
    """An expression of the table (``n_embd+2*n_head_kv*n_embd_head_v``) -> (value, explanation), None for
    a dimension not checked (``n_vocab``: the tokenizer's, checked by :func:`check_vocab`)."""
    total, terms, factors_seen = 0, [], 0
    for term in expr.split("+"):
        product, words = 1, []
        for factor in term.split("*"):
            if factor.isdigit():
                product *= int(factor)
                words.append(factor)
            elif factor in sym:
                product *= sym[factor][0]
                words.append(sym[factor][1])
            else:
                return None
            factors_seen += 1
        total += product
        terms.append(" x ".join(words))
    text = " + ".join(terms)
    return total, text if factors_seen == 1 else f"{text} = {total}"


def check_shapes(
    arch_name: str,
    values: Iterable[tuple[_ParamLike, Any]],
    hp: Mapping[str, Any],
    tensors: Iterable[_TensorLike],
    path: str | None,
) -> None:
    """Every planned tensor has the shape llama.cpp's loader expects from the metadata written.

    Matches ``llama_model_<arch>::load_arch_tensors`` (``create_tensor`` / ``create_tensor_qkv`` and the
    loader's ``check_tensor_dims``) for the architectures of :data:`LOADER_SHAPES`, with the
    hyperparameters ``llama_model_base::load_hparams`` reads (defaults included): a config.json value
    that does not fit the weights (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``intermediate_size``) would otherwise give a file llama.cpp refuses to load, and a wrong head
    count would also feed the q/k row permutation. Tensors the table does not name (generated RoPE
    factors) are not checked here.

    Args:
        arch_name: ``general.architecture``.
        values: (:class:`convert.gguf.families.Param`, checked value) of every metadata entry written.
        hp: the hyperparameters (which config.json key gave each value, for the message).
        tensors: the planned tensors (GGUF name, PyTorch-order shape, Hugging Face source).
        path: the config file.

    Raises:
        GgufConfigError: GGUF-006, naming config.json, the tensor, its size and the expected one
            (``blk.0.attn_q.weight has 256 rows; num_attention_heads 8 x head_dim 64 = 512``).
    """
    table = LOADER_SHAPES.get(arch_name)
    if table is None:
        return
    sym = _hyperparameters(values, hp)
    order = {name: i for i, name in enumerate(table)}
    first: tuple[tuple[int, int], GgufConfigError] | None = None
    for t in tensors:
        base = _BLOCK.sub("", t.name)
        dims = table.get(base)
        if dims is None:
            continue
        error = _shape_error(t, dims, sym, path)
        block = _BLOCK.match(t.name)
        rank = (int(block.group(0)[4:-1]) if block else -1, order[base])
        if error is not None and (first is None or rank < first[0]):
            first = (rank, error)
    if first is not None:
        raise first[1]


def _shape_error(
    t: _TensorLike, dims: tuple[str, ...], sym: Mapping[str, tuple[int, str]], path: str | None
) -> GgufConfigError | None:
    """The error for a tensor whose shape differs from ``dims`` (GGUF order), None when it fits."""
    shape = tuple(t.shape)
    while len(shape) > len(dims) and shape[0] == 1:  # ggml's trailing dimensions of 1 (a router of one row)
        shape = shape[1:]
    if len(shape) != len(dims):
        return GgufConfigError(
            f"config.json disagrees with the weights: {t.name} has {len(shape)} dimensions; llama.cpp "
            f"loads it with {len(dims)}",
            path=path, tensor=t.source, expected=len(dims), found=list(shape), action="convert",
        )
    for axis, expr in enumerate(reversed(dims)):  # GGUF (ne0, ne1) -> PyTorch (rows, cols)
        want = _dimension(expr, sym)
        if want is None or want[0] == shape[axis]:
            continue
        what = "elements" if len(shape) == 1 else ("experts", "rows", "columns")[axis + 3 - len(shape)]
        return GgufConfigError(
            f"config.json disagrees with the weights: {t.name} has {shape[axis]} {what}; {want[1]} "
            f"(llama.cpp would refuse the file)",
            path=path, tensor=t.source, expected=want[0], found=shape[axis], action="convert",
        )
    return None

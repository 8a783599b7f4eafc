"""llama-quantize's file-type mixes: which GGML type each tensor of a GGUF file gets.

``--to gguf:q4_k_m`` (and the other names of :data:`FILE_TYPES`) writes what llama.cpp's
``llama-quantize`` writes when given our ``--to gguf:f32`` file and that file type: the same GGML
type for every tensor. :func:`mix_types` is a re-implementation, from reading the source, of
``src/llama-quant.cpp`` of the llama.cpp revision vendored in llama-cpp-python 0.3.36
(``vendor/llama.cpp``, ggml 0.25.3; the sdist names no commit, so the file is pinned by its sha256
``24305a44864f6e12bdbaa29c28ce71395c6ff5af806576f966020939164e13f1``; the functions named below are
that file's) for the file types listed, with
``llama_model_quantize_default_params()`` (no imatrix, no ``--pure``, no type overrides, output
tensor quantized):

- which tensors are quantized at all (``tensor_allows_quantization``): names ending in ``weight``
  with at least 2 dimensions (``ggml_n_dims``: trailing dimensions of 1 do not count), except norms
  (``_norm.weight``), expert routers (``ffn_gate_inp``) and a few small tensors of other
  architectures; the others keep the type of the f32 input, F32;
- the per-ftype default type (``llama_ftype_get_default_type``) and the rules of
  ``llama_tensor_get_type_impl``, by tensor category (``tensor_get_category``): ``output.weight``
  (and ``token_embd.weight`` when there is no ``output.weight``: tied embeddings) gets Q6_K, or
  Q8_0 when its row is not a multiple of the default type's block; ``attn_v`` (and ``attn_qkv``,
  ``attn_kv_b``: ``category_is_attn_v``), ``ffn_down`` and ``attn_output`` get more bits in some
  mixes and on some layers (``use_more_bits``), counted as llama.cpp counts them: the counters
  ``i_attention_wv`` (over attn_v-like tensors in llama.cpp's tensor order, out of
  ``n_attention_wv``), ``i_ffn_down``/``i_ffn_gate``/``i_ffn_up`` (out of the block count; the
  layer number parsed from the name when ``n_expert > 1``: ``layer_info``); conditions on
  ``n_gqa()`` (heads / kv heads), ``n_expert`` (8), the 70B model type (Llama with 80 layers and
  fewer kv heads than heads, any Qwen2 with 80 layers) and the architecture (Falcon);
- the fallback when a row (``ne[0]``) is not a multiple of the type's block
  (``tensor_type_fallback``): Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, a
  32-block type keeps its type, and F16 when the row is not a multiple of that one's block either.

llama.cpp walks the tensors in its loader's order (``llama_model_loader::weight_name_comparer``:
tensors outside ``blk.N.`` first, then by layer number, then by name); the counters depend on that
order, so :func:`mix_types` sorts the same way and returns the types in the order it was given.
llama-quantize also writes its output file in that order (ours keeps the converter's order).

Two quirks are reproduced as the source has them: ``attn_qkv`` tensors take the attn_v branch (the
separate ``ATTENTION_QKV`` branch after it is never reached), and ``attn_v``'s ``use_more_bits``
counts attn_v tensors, not layers.

llama-quantize's per-tensor options (:class:`MixOptions`: ``--output-tensor-type``,
``--token-embedding-type``, ``--tensor-type``, ``--pure``, ``--leave-output-tensor``) are applied as
``llama_tensor_get_type`` applies them around the mix (:func:`_choose`).

With an importance matrix (``has_imatrix``) IQ4_XS keeps its first ffn_down layers at IQ4_XS and Q4_0/Q5_0
give them Q4_1/Q5_1; Q2_K_S needs one for its Q2_K tensors (:func:`requires_imatrix`). Not covered: the
IQ1/IQ2/IQ3/TQ*/MXFP4 file types (codecs we do not have).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import gguf

from convert.gguf.types import DEFAULT_MIX, FILE_TYPES, FileType, MixOptions
from formats.errors import GgufTypeError

__all__ = ["MixChoice", "MixModel", "mix_summary", "mix_types", "requires_imatrix", "use_more_bits"]

GT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

#: Upstream pinned by this module: llama.cpp as vendored in llama-cpp-python 0.3.36.
UPSTREAM = "llama.cpp vendored in llama-cpp-python 0.3.36 (ggml 0.25.3), src/llama-quant.cpp sha256 24305a44..."


@dataclass(frozen=True)
class MixModel:
    """The hyperparameters llama.cpp's type choice reads (``llama_hparams``, ``llama_model::type``).

    Attributes:
        arch: ``general.architecture`` (``llama``).
        n_layer: ``{arch}.block_count`` (``n_layer_all``: the ffn counters' total).
        n_head: ``{arch}.attention.head_count`` (layer 0's).
        n_head_kv: ``{arch}.attention.head_count_kv`` (``n_head`` when absent).
        n_expert: ``{arch}.expert_count`` (0 when absent).
    """

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        """``llama_hparams::n_gqa()``: heads per kv head, integer division (0 without kv heads)."""
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's ``LLM_TYPE_70B``: ``models/llama.cpp`` (80 layers, GQA, not 8 experts) and
        ``models/qwen2.cpp`` (80 layers); Gemma and the others never are."""
        if self.n_layer != 80:
            return False
        if self.arch == "llama":
            return self.n_expert != 8 and self.n_head != self.n_head_kv
        return self.arch == "qwen2"


@dataclass(frozen=True)
class MixChoice:
    """One tensor's type and why (``reason`` is "" when it gets the file type's default type or is
    kept F32 as a norm, bias or 1-D tensor)."""

    ggml_type: gguf.GGMLQuantizationType
    reason: str = ""


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's ``use_more_bits``: the first and last eighth, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


#: ``tensor_allows_quantization``: name fragments never quantized (architecture-independent ones).
_NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
#: ``LLM_TN(arch)(LLM_TENSOR_POS_EMBD / LLM_TENSOR_TOKEN_TYPES, "weight")``.
_NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")

_LAYER = re.compile(r"blk\.([+-]?\d+)")


def _layer(name: str) -> int:
    """``sscanf(name, "blk.%d.", &layer)``, -1 when the name has no layer number."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _n_dims(shape: Sequence[int]) -> int:
    """``ggml_n_dims``: dimensions up to the last one larger than 1 (shape given rows first)."""
    ne = list(reversed(shape))
    for i in range(len(ne) - 1, 0, -1):
        if ne[i] > 1:
            return i + 1
    return 1


def _allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """``tensor_allows_quantization`` with the default parameters."""
    if _n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(f in name for f in _NEVER_QUANTIZED) and name not in _NEVER_QUANTIZED_NAMES


def _category(name: str) -> str:
    """``tensor_get_category``: the first matching fragment, in llama.cpp's order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for frag, cat in (
        ("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
    ):
        if frag in name:
            return cat
    return "other"


_ATTN_V = ("attn_v", "attn_qkv", "attn_kv_b")


def _block(t: gguf.GGMLQuantizationType) -> int:
    return gguf.GGML_QUANT_SIZES[t][0]


#: ``tensor_type_fallback``: a 256-block type whose row does not fit -> a 32-block type.
_FALLBACK = {GT.Q2_K: GT.Q4_0, GT.Q3_K: GT.Q4_0, GT.Q4_K: GT.Q5_0, GT.Q5_K: GT.Q5_1, GT.Q6_K: GT.Q8_0,
             GT.IQ4_XS: GT.IQ4_NL}


class _State:
    """``quantize_state_impl``'s counters."""

    def __init__(self, n_attention_wv: int, n_layer: int, tied: bool, has_imatrix: bool) -> None:
        self.has_imatrix = has_imatrix
        self.n_attention_wv = n_attention_wv
        self.n_ffn = n_layer
        self.i_attention_wv = 0
        self.i_ffn = {"ffn_down": 0, "ffn_gate": 0, "ffn_up": 0}
        self.tied = tied


def _layer_info(i: int, n: int, name: str, model: MixModel) -> tuple[int, int]:
    """``layer_info``: the counter, or with experts the layer number parsed from the name."""
    if model.n_expert > 1:
        i = _layer(name)
        if not name.startswith("blk.") or i < 0 or i >= n:
            raise ValueError(f"cannot determine the layer of tensor {name} (0 <= layer < {n})")
    return i, n


def _impl_type(
    qs: _State, ft: FileType, name: str, row: int, cat: str, model: MixModel, options: MixOptions
) -> tuple[gguf.GGMLQuantizationType, str]:
    """``llama_tensor_get_type_impl`` for the file types of :data:`FILE_TYPES` (``qs.has_imatrix``: an
    importance matrix is given)."""
    f = ft.name
    new = ft.default
    why = ""
    falcon = model.arch == "falcon"
    if cat == "output" or (qs.tied and cat == "token_embd"):
        what = "output.weight" if cat == "output" else "token_embd (tied: there is no output.weight)"
        if options.output_tensor_type is not None:
            new, why = options.output_tensor_type, f"{what}, --output-tensor-type"
        elif falcon or row % _block(new):
            why = f"{what} of Falcon" if falcon else f"{what}, row of {row} not a multiple of {_block(new)}"
            new = GT.Q8_0
        elif new != GT.Q8_0:
            new, why = GT.Q6_K, what
    elif cat == "token_embd":
        pass  # only the IQ*/TQ* file types change an untied token_embd
    elif cat in _ATTN_V:
        kind = cat
        if f == "Q2_K":
            new = GT.Q4_K if model.n_gqa >= 4 else GT.Q3_K
            why = f"{kind} with n_gqa {model.n_gqa} {'>=' if model.n_gqa >= 4 else '<'} 4"
        elif f == "Q2_K_S" and model.n_gqa >= 4:
            new, why = GT.Q4_K, f"{kind} with n_gqa {model.n_gqa} >= 4"
        elif f == "Q3_K_M":
            new = GT.Q5_K if qs.i_attention_wv < 2 else GT.Q4_K
            why = f"{kind} {'among the first 2' if qs.i_attention_wv < 2 else 'after the first 2'}"
        elif f == "Q3_K_L":
            new, why = GT.Q5_K, kind
        elif f in ("IQ4_NL", "IQ4_XS") and model.n_gqa >= 4:
            new, why = GT.Q5_K, f"{kind} with n_gqa {model.n_gqa} >= 4"
        elif f in ("Q4_K_M", "Q5_K_M") and use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new, why = GT.Q6_K, f"{kind} on a use_more_bits layer"
        elif f == "Q4_K_S" and qs.i_attention_wv < 4:
            new, why = GT.Q5_K, f"{kind} among the first 4"
        if model.is_70b and new in (GT.Q3_K, GT.Q4_K):
            new, why = GT.Q5_K, f"{kind} of a 70B model"
        if model.n_expert == 8:
            new, why = GT.Q8_0, f"{kind} of an 8-expert model"
        qs.i_attention_wv += 1
    elif cat == "attn_k":
        if model.n_expert == 8:
            new, why = GT.Q8_0, "attn_k of an 8-expert model"
    elif cat == "attn_q":
        pass  # only IQ3_XS / IQ3_XXS
    elif cat == "ffn_down":
        i, n = _layer_info(qs.i_ffn[cat], qs.n_ffn, name, model)
        if f == "Q2_K":
            new, why = GT.Q3_K, "ffn_down"
        elif f == "Q2_K_S":
            if i < n // 8:
                new, why = GT.Q4_K, "ffn_down in the first 1/8 of the layers"
        elif f == "Q3_K_M":
            if i < n // 16:
                new, why = GT.Q5_K, "ffn_down in the first 1/16 of the layers"
            elif not falcon or use_more_bits(i, n):
                new, why = GT.Q4_K, "ffn_down"
        elif f == "Q3_K_L":
            new, why = (GT.Q4_K if falcon else GT.Q5_K), "ffn_down"
        elif f == "Q4_K_M":
            if falcon:
                if i < n // 16:
                    new, why = GT.Q6_K, "ffn_down in the first 1/16 of the layers"
                elif use_more_bits(i, n):
                    new, why = GT.Q5_K, "ffn_down on a use_more_bits layer"
            elif use_more_bits(i, n):
                new, why = GT.Q6_K, "ffn_down on a use_more_bits layer"
        elif f in ("IQ4_NL", "IQ4_XS") and i < n // 8 and not qs.has_imatrix:
            new, why = GT.Q5_K, "ffn_down in the first 1/8 of the layers (no importance matrix)"
        elif f == "Q5_K_M" and use_more_bits(i, n):
            new, why = GT.Q6_K, "ffn_down on a use_more_bits layer"
        elif f == "Q4_K_S" and not falcon and i < n // 8:
            new, why = GT.Q5_K, "ffn_down in the first 1/8 of the layers"
        elif f in ("Q4_0", "Q5_0") and qs.has_imatrix and i < n // 8:
            new = GT.Q4_1 if f == "Q4_0" else GT.Q5_1
            why = "ffn_down in the first 1/8 of the layers (with an importance matrix)"
        qs.i_ffn[cat] += 1
    elif cat == "attn_output":
        if not falcon:
            if model.n_expert == 8:
                if f in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS"):
                    new, why = GT.Q5_K, "attn_output of an 8-expert model"
            else:
                bump = {"Q2_K": GT.Q3_K, "Q3_K_M": GT.Q4_K, "Q3_K_L": GT.Q5_K}.get(f)
                if bump is not None:
                    new, why = bump, "attn_output"
        elif f == "Q3_K_L":
            new, why = GT.Q4_K, "attn_output"
    elif cat in ("ffn_gate", "ffn_up"):
        _layer_info(qs.i_ffn[cat], qs.n_ffn, name, model)  # only IQ3_XS uses the layer; it may raise
        qs.i_ffn[cat] += 1
    if why:
        why = f"{why}: {new.name}"
    return new, why


def _fallback(new: gguf.GGMLQuantizationType, row: int) -> tuple[gguf.GGMLQuantizationType, str]:
    """``tensor_type_fallback``: a type whose block does not divide the row -> a smaller block, or F16."""
    block = _block(new)
    if row % block == 0:
        return new, ""
    to = _FALLBACK.get(new, new if block <= 32 else None)
    if to is None:
        raise ValueError(f"llama.cpp has no fallback type for {new.name}")
    if row % _block(to):
        also = f" nor of {to.name}'s {_block(to)}" if to != new else ""
        return GT.F16, f"row of {row} is not a multiple of {new.name}'s block of {block}{also}: F16"
    return to, f"row of {row} is not a multiple of {block}: {to.name}"


def _llama_order(names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in ``llama_model_loader::weight_name_comparer`` order."""
    return sorted(range(len(names)), key=lambda i: (_layer(names[i]), names[i]))


def mix_types(
    file_type: str, tensors: Sequence[tuple[str, Sequence[int]]], model: MixModel,
    options: MixOptions = DEFAULT_MIX, has_imatrix: bool = False,
) -> list[MixChoice]:
    """The GGML type llama-quantize gives each tensor of an all-F32 GGUF file (``llama_tensor_get_type``).

    Args:
        file_type: a key of :data:`FILE_TYPES` (``q4_k_m``).
        tensors: (GGUF name, shape rows first) of every tensor of the file, in any order; names
            are unique.
        model: the hyperparameters read from the file's metadata.
        options: llama-quantize's per-tensor options (``llama_tensor_get_type``'s wrapper: the token
            embedding and output types first, then the first ``--tensor-type`` rule that matches, which
            skips the mix's rules and their counters, as ``--pure`` skips them for every tensor; the row
            fallback after both).
        has_imatrix: an importance matrix with entries is given (``quantize_state_impl::has_imatrix``:
            IQ4_XS keeps the first ffn_down layers at its type, Q4_0/Q5_0 give them Q4_1/Q5_1).

    Returns:
        One :class:`MixChoice` per tensor, in the order given.

    Raises:
        KeyError: an unknown file type.
        ValueError: with experts, an ffn tensor whose name has no valid layer number (llama.cpp
            refuses those too).
    """
    ft = FILE_TYPES[file_type]
    names = [n for n, _ in tensors]
    cats = [_category(n) for n in names]
    qs = _State(sum(c in _ATTN_V for c in cats), model.n_layer, tied="output" not in cats, has_imatrix=has_imatrix)
    out: list[MixChoice | None] = [None] * len(tensors)
    for i in _llama_order(names):
        name, shape = tensors[i]
        if not _allows_quantization(name, shape) or (options.leave_output_tensor and name == "output.weight"):
            out[i] = MixChoice(GT.F32, "--leave-output-tensor" if name == "output.weight" and
                               _allows_quantization(name, shape) else "")
            continue
        out[i] = _choose(qs, ft, name, int(shape[-1]), cats[i], model, options)
    return [c for c in out if c is not None]


def _choose(qs: _State, ft: FileType, name: str, row: int, cat: str, model: MixModel,
            options: MixOptions) -> MixChoice:
    """``llama_tensor_get_type`` for a tensor that may be quantized."""
    if options.token_embedding_type is not None and cat == "token_embd":
        # per_layer_token_embd follows --token-embedding-type unless a --tensor-type rule names it
        if name != "per_layer_token_embd.weight" or not any(r.regex.search(name) for r in options.tensor_types):
            return _as_given(options.token_embedding_type, "--token-embedding-type", name, row)
    if options.output_tensor_type is not None and cat == "output":
        return _as_given(options.output_tensor_type, "--output-tensor-type", name, row)
    rule = next((r for r in options.tensor_types if r.regex.search(name)), None)
    if rule is not None:
        new, why = rule.ggml_type, f"--tensor-type {rule.pattern}={rule.ggml_type.name.lower()}"
    elif options.pure:
        new, why = ft.default, ""
    else:
        new, why = _impl_type(qs, ft, name, row, cat, model, options)
    new, fall = _fallback(new, row)
    return MixChoice(new, "; ".join(w for w in (why, fall) if w))


def _as_given(t: gguf.GGMLQuantizationType, option: str, name: str, row: int) -> MixChoice:
    """A type given by ``--token-embedding-type`` / ``--output-tensor-type``: llama.cpp takes it as it is
    (no row fallback), so a block that does not divide the row is refused here (llama-quantize aborts in
    ``ggml_quantize_chunk`` there).

    Raises:
        GgufTypeError: GGUF-002, the row is not a multiple of the type's block.
    """
    if row % _block(t):
        raise GgufTypeError(f"{option} {t.name.lower()}: the tensor's rows are not a multiple of the type's block "
                            "(llama-quantize takes this type without a fallback and fails)", tensor=name,
                            expected=f"a type whose block divides {row}", found=f"{t.name}, block of {_block(t)}")
    return MixChoice(t, option)


#: ``tensor_requires_imatrix``: the types llama-quantize never writes without an importance matrix row.
_NEEDS_IMATRIX = frozenset({GT.IQ3_XXS, GT.IQ2_XXS, GT.IQ2_XS, GT.IQ2_S, GT.IQ1_M, GT.IQ1_S})


def requires_imatrix(name: str, ggml_type: gguf.GGMLQuantizationType, file_type: str) -> bool:
    """``tensor_requires_imatrix``: a tensor of ``ggml_type`` in a ``file_type`` file (a key of
    :data:`FILE_TYPES`) needs an importance matrix row: the IQ1/IQ2 types and IQ3_XXS, and Q2_K in a
    Q2_K_S file; never the token embeddings or ``output.weight``."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return ggml_type in _NEEDS_IMATRIX or (ggml_type == GT.Q2_K and file_type == "q2_k_s")


def mix_summary(types: Sequence[gguf.GGMLQuantizationType]) -> str:
    """``14 Q4_K, 3 Q6_K, 2 Q5_0, 5 F32``: tensors per type, most frequent first."""
    counts = Counter(t.name for t in types)
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

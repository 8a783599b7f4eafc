"""Planning a GGUF file from headers alone: output types, which tensor gets which GGML type, metadata.

:func:`plan_gguf` turns a config.json, the (name, shape) list of the float tensors and the tokenizer
directory into a :class:`GGUFPlan`: every tensor's GGUF name, GGML type, shape and byte count, and
every metadata key, before any weight is read. It matches what llama.cpp's ``convert_hf_to_gguf.py``
writes for the same model and ``--outtype`` (``TextModel.set_gguf_parameters``,
``ModelBase.prepare_tensors``, ``LlamaModel.generate_extra_tensors``); the metadata keys and value
types are the gguf package's own (the plan fills a scratch ``GGUFWriter`` with ``add_*`` calls and
keeps its key/value table). The architecture rows are :mod:`convert.gguf.arch`'s, the RoPE scaling keys
and tensors :mod:`convert.gguf.rope`'s, the tokenizer keys :mod:`convert.gguf.tokenizer`'s;
:mod:`convert.gguf.encode` writes the plan.

Output types (``--to gguf:TYPE``, :data:`convert.gguf.types.OUTPUT_TYPES`, any letter case):

- ``f32``, ``f16`` (default), ``bf16``, ``q8_0``: ``convert_hf_to_gguf.py``'s ``--outtype``. As in
  its ``prepare_tensors`` (:func:`choose_type`), 1-D tensors, norms and biases stay F32, and a
  matrix whose rows are not a multiple of the type's block falls back to F16.
- ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` and the K-quant mixes ``q2_k``, ``q3_k_s``, ``q3_k_m``,
  ``q3_k_l``, ``q4_k_s``, ``q4_k_m``, ``q5_k_s``, ``q5_k_m``, ``q6_k``: llama.cpp's
  ``llama-quantize`` file types. Each tensor gets the type llama-quantize would give it when
  quantizing our ``f32`` file (:func:`convert.gguf.mix.mix_types`: ``output.weight`` Q6_K, more
  bits for some ``attn_v``/``ffn_down`` layers, fallbacks for rows that are not a multiple of 256),
  with the hyperparameters the planned metadata holds; the reason is each tensor's ``fallback``.

Where the output knowingly differs from ``convert_hf_to_gguf.py`` (which needs torch and
transformers):

- none in ``general.*``: they are the converter's (:mod:`convert.gguf.general`: the model card,
  config.json, the directory's name without its bnb quantization words, the ``--metadata`` file).
- ``f32`` holds the exact float32 dequantized weights (a 4-bit layer's fp32 products, before the
  rounding to the checkpoint's bf16/f16 that transformers' ``dequantize()`` does), and the
  llama-quantize types are quantized from them (:data:`convert.gguf.types.FLOAT32_INPUT`): never from a 16-bit
  intermediate, so they are at least as close to the bnb weights as bnb -> bf16 -> F16 GGUF ->
  ``llama-quantize`` (scripts/kquant_routes.py measures both routes).
- llama-quantize writes its tensors in its loader's order (outside-layer tensors first, then by
  layer and name); ours keep the converter's order. Types and bytes are the same.

Rules raised here (see docs/errors.md), besides those of :mod:`convert.gguf.arch` (GGUF-001, 003,
005, 006), :mod:`convert.gguf.rope` (GGUF-005, 006) and :mod:`convert.gguf.tokenizer` (GGUF-004):

========  ======================================================================================
GGUF-002  the output type is one of :data:`convert.gguf.types.OUTPUT_TYPES` (:class:`GgufTypeError`,
          :func:`convert.gguf.types.parse_output_type`)
GGUF-006  config.json holds every required hyperparameter of the architecture
          (:class:`GgufConfigError`)
========  ======================================================================================

Order (nothing is sized by a config value before it is checked): the hyperparameters and RoPE keys
(:mod:`convert.gguf.config`), the layer count against the tensor names, then gguf's
``TensorNameMap`` for that many layers, the tensors, ``vocab_size``/``hidden_size`` against the
token embedding, the tokenizer bounded by the embedding's rows, and last a check that every
metadata value packs as its GGUF type (:func:`convert.gguf.config.check_packable`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from convert.gguf.arch import (
    block_count,
    find_architecture,
    gguf_tensor_name,
    hparams,
    is_skipped,
    norm_offset,
    permute_heads,
    text_name,
)
from convert.gguf.config import (
    check_packable,
    check_param,
    check_special_ids,
    check_vocab,
    layer_count,
    whole,
)
from convert.gguf.families import Architecture, Param
from convert.gguf.general import MetadataSource, model_metadata, naming, parameter_counts
from convert.gguf.imatrix import imatrix_keys, importance_rows, load_importance
from convert.gguf.loader import check_required, check_shapes
from convert.gguf.mix import MixModel, mix_types, requires_imatrix
from convert.gguf.rope import llama3_rope_freqs, longrope_factors, rope_choice_note, rope_metadata
from convert.gguf.tokenizer import add_tokenizer
from convert.gguf.types import DEFAULT_MIX, FILE_TYPES, OUTPUT_TYPES, MixOptions, parse_output_type
from convert.output_names import GgufNaming
from formats.errors import GgufConfigError, ImatrixRequiredError, RopeScalingError
from formats.gguf import tensor_nbytes

__all__ = [
    "GGUFPlan",
    "GGUFTensor",
    "apply_mix",
    "check_importance",
    "choose_type",
    "mix_model",
    "plan_gguf",
]

GT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the GGUF file.

    Attributes:
        source: the Hugging Face name (None for generated tensors such as ``rope_freqs.weight``).
        name: the GGUF name (``blk.0.attn_q.weight``).
        shape: shape in elements, rows first (the GGUF header stores it reversed).
        ggml_type: its GGML type.
        nbytes: bytes in the data section (before the 32-byte padding).
        permute_heads: rows are permuted as ``LlamaModel.permute`` with this many heads (0: not).
        offset: value added in float32 before rounding (Gemma norms: 1.0).
        fallback: why the type differs from the requested one ("" when it does not): a fallback for
            the row length, or llama-quantize's rule in a mix (``attn_v on a use_more_bits layer: Q6_K``).
        parts: a MoE tensor made of slices of its sources, in order: (Hugging Face name, first element,
            element past the last), one per expert (``source`` then labels them all,
            ``model.layers.0.mlp.experts.[0-7].up_proj.weight``, or ``...input_linear.weight[rows 0:512]``);
            () otherwise.
    """

    source: str | None
    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    nbytes: int
    permute_heads: int = 0
    offset: float = 0.0
    fallback: str = ""
    parts: tuple[tuple[str, int, int], ...] = ()

    @property
    def numel(self) -> int:
        """Number of elements (Python int)."""
        return math.prod(self.shape)


@dataclass
class GGUFPlan:
    """Everything :func:`convert.gguf.encode.write_gguf` needs except the weights.

    It is the :class:`formats.gguf.FileLayout` that :class:`formats.gguf.GGUFFileWriter` writes and
    :func:`formats.gguf.verify_gguf` checks.

    Attributes:
        arch: the architecture row.
        output_type: the ``--to gguf:TYPE`` name.
        file_type: ``general.file_type``.
        metadata: key -> (value, GGUF value type, array element type), in write order, without
            ``general.architecture`` (the writer adds it).
        tensors: the tensors in file order.
        generated: GGUF name -> values of tensors made from the config (``rope_freqs.weight``).
        towers: source tensors of a multimodal checkpoint's other towers (vision, audio, projector), not
            written (:func:`convert.gguf.arch.text_name`).
        notes: what the user should know about how config.json was read (e.g. which RoPE object), and
            what of the model card was left out of ``general.*``.
        naming: the default file name's parts (:func:`convert.gguf.general.naming`), or None.
        importance: ``--imatrix``: GGUF name -> float32 ``(n_mat, n_per_row)`` importance rows of the
            weights that have an entry (:func:`convert.gguf.imatrix.importance_rows`); empty without one.
    """

    arch: Architecture
    output_type: str
    file_type: gguf.LlamaFileType
    metadata: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]
    tensors: list[GGUFTensor]
    generated: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)
    towers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    naming: GgufNaming | None = None
    importance: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)

    @property
    def arch_name(self) -> str:
        """``general.architecture`` (the architecture row's GGUF name)."""
        return self.arch.name

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (padding excluded)."""
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> list[str]:
        """One line per tensor for ``--dry-run``: GGUF name, type, shape (rows first), bytes, source."""
        lines = []
        for t in self.tensors:
            note = f" ({t.fallback})" if t.fallback else ""
            if t.name in self.importance:
                note += " [imatrix]"
            lines.append(
                f"{t.name:<28} {t.ggml_type.name:<5} {list(t.shape)!s:<14} {t.nbytes:>12} "
                f"<- {t.source or 'generated'}{note}"
            )
        return lines


#: Tensors ModelBase.prepare_tensors always writes F32, by GGUF name without ``blk.N.`` and the suffix
#: (of its list, those of the architectures here: MoE routers, position and token type embeddings).
_ALWAYS_F32 = frozenset(
    gguf.TENSOR_NAMES[k].removeprefix("blk.{bid}.")
    for k in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
              gguf.MODEL_TENSOR.TOKEN_TYPES)
)
_BLOCK_PREFIX = re.compile(r"^blk\.\d+\.")


def choose_type(
    gguf_name: str, shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType
) -> tuple[gguf.GGMLQuantizationType, str]:
    """llama.cpp's prepare_tensors: 1-D, norms, MoE routers and non-``.weight`` tensors are F32; odd rows -> F16."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return GT.F32, "" if wanted == GT.F32 else "kept F32 (1-D, norm or bias)"
    if _BLOCK_PREFIX.sub("", gguf_name).removesuffix(".weight") in _ALWAYS_F32:
        return GT.F32, "" if wanted == GT.F32 else "kept F32 (an expert router)"
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return GT.F16, f"row of {shape[-1]} is not a multiple of the {wanted.name} block of {block}: F16"
    return wanted, ""


def plan_gguf(
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, Sequence[int]]],
    tokenizer_dir: str | os.PathLike[str],
    output_type: str | None = None,
    *,
    model: MetadataSource | None = None,
    config_path: str | None = None,
    mix: MixOptions = DEFAULT_MIX,
) -> GGUFPlan:
    """Plan a GGUF file from headers alone: names, types, shapes, sizes, metadata and tokenizer.

    Matches the metadata, tensor names, tensor types and tokenizer llama.cpp's
    ``convert_hf_to_gguf.py`` writes for the same model and ``--outtype``; for llama-quantize's file
    types (:data:`convert.gguf.types.FILE_TYPES`) each tensor's type is llama-quantize's
    (:func:`apply_mix`, from the planned metadata's block count, heads, kv heads and experts).

    Args:
        config: the model's config.json (``quantization_config`` is ignored).
        tensors: (Hugging Face name, shape) of every float tensor to write, in file order.
        tokenizer_dir: the directory with ``tokenizer.model`` / ``tokenizer.json`` /
            ``tokenizer_config.json`` (and config.json for special token ids).
        output_type: a key of :data:`OUTPUT_TYPES` (default ``f16``).
        model: where the ``general.*`` keys come from (:mod:`convert.gguf.general`; default: the
            tokenizer directory, named as it is, and ``config``).
        config_path: the config file, for error messages.
        mix: llama-quantize's per-tensor options, for its file types.

    Returns:
        The plan; no weight has been read.

    Raises:
        UnsupportedArchitectureError: GGUF-001.
        GgufTypeError: GGUF-002.
        UnmappedTensorError: GGUF-003.
        TokenizerError: GGUF-004 (no tokenizer, or one of an unsupported kind).
        RopeScalingError: GGUF-005.
        GgufConfigError: GGUF-006.
        CheckpointError: SPM-xxx (bad tokenizer.model).
        UsageError: USE-001, a bad ``--metadata`` file (:func:`convert.gguf.general.read_override`).
    """
    arch = find_architecture(config, path=config_path)
    out_name = parse_output_type(output_type)
    wanted, file_type = OUTPUT_TYPES[out_name]
    hp = hparams(config, arch, config_path)
    # every value is checked before it sizes anything: the layer count against the tensors before
    # the name map (built per layer), the parameters before the writer, the vocabulary below
    check_special_ids(config, config_path)
    n_blocks = block_count(hp, config_path)
    shapes: list[tuple[str, str, tuple[int, ...]]] = []  # (source name, text model name, shape)
    towers: list[str] = []
    for hf_name, shape_seq in tensors:
        name = text_name(arch, hf_name)
        if name is None:
            towers.append(hf_name)
        else:
            shapes.append((hf_name, name, tuple(int(d) for d in shape_seq)))
    layer_count(n_blocks, (n for _, n, _ in shapes), config_path)
    values: list[tuple[Param, Any]] = []
    for param in arch.params + arch.extra_params:
        key = next((k for k in param.keys if hp.get(k) is not None), None)
        if key is None:
            if param.required:
                raise GgufConfigError(
                    "config.json lacks a hyperparameter llama.cpp needs",
                    path=config_path,
                    expected=" or ".join(param.keys),
                    found=None,
                    action="convert",
                )
            continue
        name = key.lstrip("@")  # a derived key is named by the config key it comes from
        values.append((param, check_param(param.method, name, hp[key], config_path)))
    rope_keys = rope_metadata(hp, arch, config_path)
    if arch.mrope and not any(method == "add_rope_dimension_sections" for method, _ in rope_keys):
        raise RopeScalingError(
            f"a {arch.name} model needs its M-RoPE sections (llama.cpp's loader requires them)",
            path=config_path,
            expected="rope_parameters (or rope_scaling) with mrope_section, such as [16, 24, 24]",
            found="no mrope_section",
            action="convert",
        )
    name_map = gguf.get_tensor_name_map(arch.model_arch, n_blocks)

    planned: list[GGUFTensor] = []
    generated: dict[str, npt.NDArray[np.float32]] = {}
    rope_freqs = llama3_rope_freqs(hp, config_path) if "llama3" in arch.rope_types else None
    rf_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    extra = [(rf_name, rope_freqs)] if rope_freqs is not None else []
    for rf_name, factors in extra + longrope_factors(hp, arch, config_path):
        generated[rf_name] = factors
        planned.append(GGUFTensor(None, rf_name, factors.shape, GT.F32, factors.nbytes))
    embedding: dict[str, tuple[str, tuple[int, ...]]] = {}
    stacks = _ExpertStacks(arch, hp, config_path)
    for hf_name, name, shape in shapes:
        if is_skipped(arch, name):
            continue
        if stacks.takes(hf_name, name, shape):
            for merged, label, parts, stacked in stacks.ready():
                gguf_name = gguf_tensor_name(name_map, arch, merged, config_path)
                qtype, why = choose_type(gguf_name, stacked, wanted)
                planned.append(GGUFTensor(label, gguf_name, stacked, qtype, tensor_nbytes(stacked, qtype),
                                          fallback=why, parts=parts))
            continue
        gguf_name = gguf_tensor_name(name_map, arch, name, config_path)
        if gguf_name in ("token_embd.weight", "output.weight"):
            embedding[gguf_name] = (hf_name, shape)
        qtype, why = choose_type(gguf_name, shape, wanted)
        heads = permute_heads(arch, name, shape, hp, config_path)
        offset = norm_offset(arch, name)
        planned.append(
            GGUFTensor(hf_name, gguf_name, shape, qtype, tensor_nbytes(shape, qtype), heads, offset, why)
        )
    stacks.check_complete()
    _check_qk_norms(arch, n_blocks, planned, config_path)
    n_vocab = check_vocab(
        hp,
        embedding.get("token_embd.weight", embedding.get("output.weight")),
        config_path,
        needs_vocab_size=any(p.method == "add_vocab_size" for p in arch.extra_params),
    )
    check_shapes(arch.name, values, hp, planned, config_path)  # llama.cpp's load_arch_tensors
    by_method = {p.method: v for p, v in values}
    check_required(arch.name, n_blocks, (t.name for t in planned), int(by_method.get("add_expert_count", 0)),
                   int(by_method.get("add_expert_shared_feed_forward_length", 0)), config_path)

    scratch = gguf.GGUFWriter(path=None, arch=arch.name)
    scratch.add_type(gguf.GGUFType.MODEL)
    if model is None:
        model = MetadataSource(Path(tokenizer_dir), Path(tokenizer_dir).resolve().name, config)
    general, general_notes = model_metadata(model, parameter_counts((t.name, t.shape) for t in planned))
    general.set_gguf_meta_model(scratch)
    scratch.add_block_count(n_blocks)
    for param in arch.params + arch.extra_params:
        if param.method == "add_rope_freq_base":
            # TextModel writes the scaling keys just before the frequency base
            for method, v in rope_keys:
                getattr(scratch, method)(v)
        if param.method in by_method:
            getattr(scratch, param.method)(by_method[param.method])
    if arch.rope_scaling_none:
        scratch.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if hp.get("is_causal") is False:
        scratch.add_causal_attention(False)
    scratch.add_file_type(file_type)
    scratch.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(scratch, Path(tokenizer_dir), arch, hp, n_vocab=n_vocab)
    check_packable(scratch, Path(tokenizer_dir), config_path)

    metadata = {
        k: (v.value, v.type, v.sub_type) for k, v in scratch.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE
    }
    importance: dict[str, npt.NDArray[np.float32]] = {}
    if out_name in FILE_TYPES:
        imp = load_importance(mix.imatrix, mix.include_weights, mix.exclude_weights) if mix.imatrix else None
        planned = apply_mix(out_name, planned, mix_model(arch.name, metadata), mix, has_imatrix=imp is not None)
        if imp is not None:
            importance = importance_rows(imp, [(t.name, t.shape) for t in planned], imp.file)
            for key, value, vtype in imatrix_keys(imp):  # llama-quantize adds them after the input's keys
                metadata[key] = (value, vtype, None)
        check_importance(out_name, planned, importance, mix.imatrix)
    notes = [n for n in (rope_choice_note(hp), _importance_note(mix.imatrix, planned, importance)) if n]
    return GGUFPlan(arch, out_name, file_type, metadata, planned, generated, towers, notes + general_notes,
                    naming(general, file_type), importance)


def _check_qk_norms(arch: Architecture, n_blocks: int, planned: Sequence[GGUFTensor], path: str | None) -> None:
    """Command-R: llama.cpp's loader takes q/k norms exactly when there are 64 layers or more (Command R+);
    any other combination is a file it refuses ("wrong number of tensors").

    Raises:
        GgufConfigError: GGUF-006.
    """
    if arch.name != "command-r":
        return
    norm = next((t for t in planned if t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))), None)
    if (norm is not None) != (n_blocks >= 64):
        raise GgufConfigError(
            "llama.cpp loads a Command-R model's q/k norms exactly when it has 64 layers or more",
            path=path,
            tensor=norm.source if norm is not None else None,
            expected="q/k norms (use_qk_norm) with >= 64 layers, none with fewer",
            found=f"{n_blocks} layers {'with' if norm is not None else 'without'} q/k norms",
            action="convert",
        )


#: A slice of a source tensor: (Hugging Face name, first element, element past the last).
Part = tuple[str, int, int]


class _ExpertStacks:
    """A MoE model's expert weights as the tensors GGUF writes (``LlamaModel`` / ``Qwen2MoeModel`` /
    ``GraniteMoeModel.modify_tensors``): per-expert weights gathered per layer into stacks (when a layer's
    last expert weight has been seen, its stacks come from :meth:`ready`, in the architecture's order), and
    fused parameters split along their rows. A tensor is then element slices of its sources (:data:`Part`).

    Raises:
        GgufConfigError: GGUF-006 (an expert index past the expert count, experts of one weight with
            different shapes, experts missing at the end (:meth:`check_complete`), a fused parameter whose
            rows do not split).
    """

    def __init__(self, arch: Architecture, hp: Mapping[str, Any], path: str | None) -> None:
        self.experts = arch.experts
        self.path = path
        self.pattern = (re.compile(self.experts.pattern) if self.experts is not None and self.experts.pattern
                        else None)
        self.fused = [(re.compile(f.pattern), f.outputs) for f in (self.experts.fused if self.experts else ())]
        self.count = 0
        if self.experts is not None and self.experts.pattern:
            key = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if hp.get(k) is not None),
                       "num_local_experts")
            self.count = whole(hp.get(key), key, path)
        self.pending: dict[int, dict[tuple[str, int], tuple[str, tuple[int, ...]]]] = {}
        self._ready: list[tuple[str, str, tuple[Part, ...], tuple[int, ...]]] = []

    def takes(self, hf_name: str, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the tensor is an expert's weight or a fused parameter (then held for :meth:`ready`)."""
        for pattern, outputs in self.fused:
            m = pattern.match(name)
            if m is not None:
                self._split(hf_name, int(m["bid"]), outputs, shape)
                return True
        m = self.pattern.match(name) if self.pattern is not None else None
        if m is None:
            return False
        assert self.experts is not None
        bid, xid = int(m["bid"]), int(m["xid"])
        if xid >= self.count:
            raise GgufConfigError(
                "tensor belongs to an expert past config.json's expert count",
                path=self.path, tensor=hf_name, expected=f"an expert index < {self.count}", found=xid,
                action="convert",
            )
        group = self.pending.setdefault(bid, {})
        group[(m["w"], xid)] = (hf_name, shape)
        if len(group) == self.count * len(self.experts.weights):
            for w in self.experts.weights:
                parts = [group[(w, x)] for x in range(self.count)]
                first = parts[0]
                odd = next((p for p in parts if p[1] != first[1]), None)
                if odd is not None:
                    raise GgufConfigError(
                        "experts of one layer's weight have different shapes (they are stacked into one tensor)",
                        path=self.path, tensor=odd[0], expected=list(first[1]), found=list(odd[1]), action="convert",
                    )
                n = math.prod(first[1])
                head, _, tail = first[0].rpartition(".experts.0.")
                label = f"{head}.experts.[0-{self.count - 1}].{tail}"
                self._ready.append((self.experts.merged.format(bid=bid, w=w), label,
                                    tuple((p[0], 0, n) for p in parts), (self.count, *first[1])))
            del self.pending[bid]
        return True

    def _split(self, hf_name: str, bid: int, outputs: tuple[str, ...], shape: tuple[int, ...]) -> None:
        """A fused parameter ``[experts, k * rows, cols]`` (or ``[k * rows, cols]``) as ``k`` tensors
        ``[experts, rows, cols]``: each expert's k-th block of rows."""
        k = len(outputs)
        if len(shape) < 2 or shape[-2] % k:
            raise GgufConfigError(
                "a fused expert parameter does not split into its parts along its rows",
                path=self.path, tensor=hf_name, expected=f"a 2-D or 3-D tensor whose rows are a multiple of {k}",
                found=list(shape), action="convert",
            )
        rows, cols = shape[-2] // k, shape[-1]
        experts = shape[0] if len(shape) == 3 else 1
        block = rows * cols
        for i, out in enumerate(outputs):
            parts = tuple((hf_name, (e * k + i) * block, (e * k + i + 1) * block) for e in range(experts))
            label = hf_name if k == 1 else f"{hf_name}[rows {i * rows}:{(i + 1) * rows}]"
            self._ready.append((out.format(bid=bid), label, parts, (*shape[:-2], rows, cols)))

    def ready(self) -> list[tuple[str, str, tuple[Part, ...], tuple[int, ...]]]:
        """The tensors completed by the last tensor taken: (name before mapping, the source's label for
        messages and listings, parts, shape)."""
        out, self._ready = self._ready, []
        return out

    def check_complete(self) -> None:
        """Every layer's experts were all there (GGUF-006 otherwise)."""
        if self.pending and self.experts is not None:
            bid, group = next(iter(self.pending.items()))
            w, x = next((w, x) for x in range(self.count) for w in self.experts.weights if (w, x) not in group)
            raise GgufConfigError(
                "a layer's experts are incomplete (every expert's weights are stacked into one tensor)",
                path=self.path, tensor=next(iter(group.values()))[0],
                expected=f"{self.count} experts x {', '.join(self.experts.weights)} in layer {bid}",
                found=f"no {w} of expert {x} ({len(group)} of {self.count * len(self.experts.weights)} tensors)",
                action="convert",
            )


def _importance_note(imatrix: str | None, planned: Sequence[GGUFTensor],
                     importance: Mapping[str, Any]) -> str | None:
    """``importance matrix imatrix.gguf: 14 of 16 quantized tensors (without: token_embd.weight, ...)``."""
    if imatrix is None:
        return None
    if not importance:
        return f"importance matrix {imatrix}: no entry left (--include-weights/--exclude-weights): not used"
    quantized = [t.name for t in planned if t.ggml_type not in (GT.F32, GT.F16, GT.BF16)]
    without = [n for n in quantized if n not in importance]
    rest = f" (without: {', '.join(without[:3])}{' ...' if len(without) > 3 else ''})" if without else ""
    return f"importance matrix {imatrix}: {len(quantized) - len(without)} of {len(quantized)} quantized tensors{rest}"


def check_importance(out_name: str, planned: Sequence[GGUFTensor], importance: Mapping[str, Any],
                     imatrix: str | None) -> None:
    """Every tensor whose type needs an importance matrix (:func:`convert.gguf.mix.requires_imatrix`) has
    rows in it, checked before anything is written (llama-quantize: "this quantization requires an
    importance matrix!", and "Missing importance matrix for tensor ... in a very low-bit quantization").

    Raises:
        ImatrixRequiredError: IMX-004, naming the first such tensor and its type.
    """
    for t in planned:
        if requires_imatrix(t.name, t.ggml_type, out_name) and t.name not in importance:
            given = imatrix is not None
            raise ImatrixRequiredError(
                f"gguf:{out_name} {t.ggml_type.name} needs an importance matrix"
                + (" entry for this tensor" if given else " (llama-quantize refuses it without one)"),
                path=imatrix, tensor=t.name, expected=f"importance rows for {t.name}",
                found="no entry of that name" if given else "no --imatrix")


def mix_model(arch_name: str, metadata: Mapping[str, tuple[Any, Any, Any]]) -> MixModel:
    """The hyperparameters llama.cpp reads for its type choice, from the planned metadata (what
    llama.cpp loads from the file: block count, heads, kv heads (default: heads), experts)."""

    def first(key: str, default: int) -> int:
        entry = metadata.get(key.format(arch=arch_name))
        if entry is None:
            return default
        v = entry[0]
        return int(v[0] if isinstance(v, (list, tuple)) else v)

    n_head = first(gguf.Keys.Attention.HEAD_COUNT, 0)
    return MixModel(
        arch_name,
        first(gguf.Keys.LLM.BLOCK_COUNT, 0),
        n_head,
        first(gguf.Keys.Attention.HEAD_COUNT_KV, n_head),
        first(gguf.Keys.LLM.EXPERT_COUNT, 0),
    )


def apply_mix(out_name: str, planned: Sequence[GGUFTensor], model: MixModel,
              options: MixOptions = DEFAULT_MIX, has_imatrix: bool = False) -> list[GGUFTensor]:
    """The planned tensors with llama-quantize's type for each (:func:`convert.gguf.mix.mix_types`)."""
    choices = mix_types(out_name, [(t.name, t.shape) for t in planned], model, options, has_imatrix)
    return [
        replace(t, ggml_type=c.ggml_type, nbytes=tensor_nbytes(t.shape, c.ggml_type), fallback=c.reason)
        for t, c in zip(planned, choices, strict=True)
    ]

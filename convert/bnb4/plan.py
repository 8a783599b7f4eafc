"""``--to nf4|fp4``: write a model as bitsandbytes 4-bit, byte-identical to what bitsandbytes writes.

The input is anything the dequantization plan reads (a float model or file, a bnb 4-bit or 8-bit
checkpoint) after every plan hook (``--merge-lora``): each planned float tensor is a
:class:`~convert.stream.sources.Source` of its values. :func:`make_quant_plan` replaces the tensors transformers
would quantize (the rules of :mod:`convert.bnb4.select`) with the tensors ``Linear4bit`` saves
(:mod:`convert.bnb4.sources`; :func:`convert.bnb4.layer.layer_tensors` is the in-memory reference),
and adds ``quantization_config`` to ``config.json`` as transformers writes it.

Streaming under the memory cap: a layer's tensors are produced from its source in block-aligned
pieces by two passes (:mod:`convert.bnb4.passes`). The pre-pass runs here, over every nested layer
before anything is written, because the QuantState JSON's length (in the header) depends on the
nested offset; it keeps only the nested statistics. The codes pass runs while the tensors are
written. Tensors are written in the order the ``safetensors`` library writes them (dtype, then name),
so a single-file output is byte-identical to transformers' ``save_pretrained`` of the same quantized
model.

A bnb input whose layer already has the asked settings is passed through unchanged (no drift from
re-quantizing nested absmax) unless ``--requantize`` is given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from convert.bnb4.passes import AbsmaxBudget, LayerJob
from convert.bnb4.select import (
    MOE_TYPES,
    input_quantization_config,
    is_expert,
    is_head,
    module_name,
    moe_kept,
    moe_unknown,
    multihead_out_projs,
    quantization_config,
    selects,
    should_quantize,
)
from convert.bnb4.settings import QuantSettings
from convert.bnb4.sources import job_tensors, passthrough_tensors, requantize_reason
from convert.stream.pipeline import chunk_elements
from convert.stream.plan import Plan, PlannedTensor, bnb_cpu_notes, shard_tensors
from convert.stream.sources import Dequant4Source
from formats.bnb import Int8Layer, QuantizedLayer
from formats.dtypes import DType, float_dtype_name
from formats.errors import UnknownMoeLayoutError

__all__ = [
    "SAFETENSORS_DTYPE_ORDER",
    "QuantPlanInfo",
    "make_quant_plan",
    "safetensors_order_key",
]

#: dtype codes in the order the safetensors library writes tensors (``Dtype`` compared descending),
#: then by name; read off safetensors 0.8 ``save``.
SAFETENSORS_DTYPE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                           "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


def safetensors_order_key(name: str, dtype: DType) -> tuple[int, str]:
    """Sort key giving the tensor order of safetensors' ``save_file`` (and so of transformers)."""
    try:
        rank = SAFETENSORS_DTYPE_ORDER.index(dtype.code)
    except ValueError:
        rank = len(SAFETENSORS_DTYPE_ORDER)
    return rank, name


@dataclass
class QuantPlanInfo:
    """What :func:`make_quant_plan` decided, besides the plan itself.

    Attributes:
        jobs: the layers to quantize (their reports fill in as they are written).
        passthrough: weights copied unchanged from a bnb input.
        requantized: bnb 4-bit weights re-quantized although ``--requantize`` was not given, by reason
            (other settings than asked; absmax stored as a bnb CPU forward leaves it).
        kept: tensors left as they are, with the reason.
        skip_modules: the ``llm_int8_skip_modules`` written to config.json (None = null).
        unmatched: the ``--skip-modules`` and ``--include`` patterns given that name no tensor of the
            input, by option (a typo, or a name of another model).
    """

    jobs: list[LayerJob] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)
    requantized: dict[str, list[str]] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    skip_modules: list[str] | None = None
    unmatched: dict[str, list[str]] = field(default_factory=dict)


def make_quant_plan(
    plan: Plan,
    settings: QuantSettings,
    *,
    skip: Sequence[str] = (),
    include: Sequence[str] = (),
    max_memory: int = 1 << 30,
    threads: int = 1,
    max_shard_size: int = 5 * 10**9,
    requantize: bool = False,
    report: bool = True,
    report_sample: int = 1,
    outlier_factor: float = 10.0,
    prepass: bool = True,
    piece_elements: int | None = None,
    cache_bytes: int | None = None,
) -> tuple[Plan, QuantPlanInfo]:
    """Turn a dequantization plan (``--to auto`` + hooks) into a 4-bit plan.

    Args:
        plan: from :func:`convert.stream.plan.make_plan` with ``to="auto"``, after the plan hooks.
        settings: quant type, blocksize, nesting, storage.
        skip: ``--skip-modules`` patterns.
        include: ``--include`` patterns.
        max_memory: the memory cap in bytes (sizes the pieces and the absmax cache).
        threads: worker threads of the pre-pass.
        max_shard_size: largest shard of a directory output, in bytes.
        requantize: re-quantize bnb layers even when they already have these settings.
        report: collect a :class:`~convert.bnb4.report.QuantReport` per quantized weight.
        report_sample: measure its error and zero share on one piece of the weight in this many (1:
            exact; :data:`~convert.options.SUMMARY_SAMPLE` for the summary's figures alone).
        outlier_factor: the report's outlier threshold, in layer medians of absmax.
        prepass: read each nested layer once now, so its QuantState JSON length is known (needed
            before writing; ``False`` for ``--dry-run``, which then shows an estimated length).
        piece_elements: elements read from a source at a time (default: from ``max_memory``).
        cache_bytes: bytes of fp32 absmax kept between passes (default: ``max_memory / 8``).

    Returns:
        (the new plan, a :class:`QuantPlanInfo`).

    Raises:
        UnknownMoeLayoutError: QNT-007, a Mixture-of-Experts model of a type :mod:`convert.bnb4.select` does
            not know, whose experts would be quantized (unless ``--skip-modules`` / ``--include`` name them).
        UnsupportedError: QNT-005, a weight whose packed bytes do not fill ``quant_storage``
            elements; QNT-003, a weight with NaN or infinity (found in the pre-pass or while writing).
    """

    info = QuantPlanInfo()
    for option, patterns, include_ in (("--skip-modules", skip, False), ("--include", include, True)):
        missed = [p for p in dict.fromkeys(patterns) if not any(selects(t.name, p, include=include_)
                                                                for t in plan.tensors)]
        if missed:
            info.unmatched[option] = missed
    old_qc = input_quantization_config(plan.checkpoint.config)
    skip = list(dict.fromkeys([*skip, *(old_qc.get("llm_int8_skip_modules") or [])]))
    if piece_elements is None:
        piece_elements = chunk_elements(settings.blocksize, max_memory, max(1, threads)) // 2
    piece = max(settings.blocksize, piece_elements)
    budget = AbsmaxBudget(max(0, max_memory // 8 if cache_bytes is None else cache_bytes))
    grouped: list[list[PlannedTensor] | LayerJob] = []  # per input tensor: its output tensors, or its job
    heads_kept: list[str] = []
    moe = moe_kept(plan.checkpoint.config)
    unknown = moe_unknown(plan.checkpoint.config)
    if unknown is None and moe is None and any(is_expert(t.name) for t in plan.tensors):
        config = plan.checkpoint.config if isinstance(plan.checkpoint.config, dict) else {}
        unknown = f"model_type {config.get('model_type')!r} with expert tensors"
    mha = multihead_out_projs(t.name for t in plan.tensors)
    for t in plan.tensors:
        was_q = isinstance(getattr(t.source, "layer", None), (QuantizedLayer, Int8Layer))
        ok, why = should_quantize(t.name, t.shape, t.dtype, was_quantized=was_q, skip=skip, include=include,
                                   moe=moe, mha=mha)
        if ok and unknown is not None and is_expert(t.name) and why != "--include":
            raise UnknownMoeLayoutError(
                "the experts of this Mixture-of-Experts model would be quantized, and transformers + bnb "
                "may keep them 16-bit (a file it cannot load)",
                path=plan.checkpoint.source,
                tensor=t.name,
                expected=f"a MoE model of a known layout (model_type {', '.join(MOE_TYPES)})",
                found=unknown,
                hint="convert to bf16 instead, or, when you know transformers keeps this class's experts 16-bit, "
                     "name them: --skip-modules '.*\\.experts' (and its router module)",
                action="quantize",
            )
        if not ok:
            info.kept[t.name] = why
            if why == "output head" and t.name.endswith(".weight"):
                heads_kept.append(module_name(t.name))
            grouped.append([t])
            continue
        reason = None if requantize else requantize_reason(t.source, settings)
        if reason is None and not requantize:
            assert isinstance(t.source, Dequant4Source)
            info.passthrough.append(t.name)
            grouped.append(passthrough_tensors(t, t.source, settings))
            continue
        if reason is not None and reason != "not a bnb 4-bit layer":
            info.requantized.setdefault(reason, []).append(t.name)
        settings.storage_shape(math.prod(t.shape), t.name)  # QNT-005 before any work
        job = LayerJob(t, settings, piece, budget, report, outlier_factor, report_sample)
        info.jobs.append(job)
        grouped.append(job)  # its tensors are planned after the pre-pass
    if prepass and settings.nested and info.jobs:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(lambda j: j.prepass(), info.jobs))
    tensors: list[PlannedTensor] = [
        t for g in grouped for t in (g if isinstance(g, list) else _quantized_tensors(g, settings, prepass))
    ]
    written = [(j.input.name, j.input.shape, settings.blocksize) for j in info.jobs]
    copied = set(info.passthrough)
    written += [(t.name, t.source.layer.state.shape, t.source.layer.state.blocksize) for t in plan.tensors
                if t.name in copied]
    new = Plan(checkpoint=plan.checkpoint, to=settings.quant_type, tensors=tensors,
               shards=_shards(tensors, plan.checkpoint.is_dir, max_shard_size), config=plan.config,
               notes=[n for n in plan.notes if n not in plan.dequant_notes] + bnb_cpu_notes(written, written=True))
    info.skip_modules = _skip_modules(plan, info.kept, skip, heads_kept)
    new.notes += _kept_notes(info.kept)
    new.notes += [f"{len(names)} bnb 4-bit layer{'s' if len(names) > 1 else ''} re-quantized, not copied unchanged: "
                  f"{why} (first: {names[0]})" + ("; re-quantizing nested absmax moves values by ~0.2%, see the "
                                                  "error figures" if settings.nested else "")
                  for why, names in info.requantized.items()]
    if new.config is not None:
        cfg = dict(new.config)
        compute = old_qc.get("bnb_4bit_compute_dtype") or _compute_dtype(cfg, info.jobs, plan)
        cfg["quantization_config"] = quantization_config(settings, compute, info.skip_modules)
        new.config = _sub_config_dtypes(cfg)
    return new, info


def _quantized_tensors(job: LayerJob, settings: QuantSettings, prepass: bool) -> list[PlannedTensor]:
    """A job's planned tensors; a nested layer's JSON length is estimated when there was no pre-pass."""
    if not settings.nested:
        return job_tensors(job, settings, None)
    if prepass:
        return job_tensors(job, settings, len(job.state().to_json().encode("utf-8")))
    # estimate for the plan listing: the offset's repr is 17-22 characters
    json_len = len(settings.state(job.input.shape, job.input.dtype.name, 0.0).to_json()) + 17
    out = job_tensors(job, settings, json_len)
    out[-1].source.kind = "quant_state JSON (length estimated: the offset is not read yet)"
    return out


def _shards(tensors: list[PlannedTensor], is_dir: bool, max_shard_size: int) -> list[list[int]]:
    """Tensor indices per output file, each file in the order safetensors writes it."""
    shards = shard_tensors(tensors, max_shard_size) if is_dir else [list(range(len(tensors)))]
    for shard in shards:
        shard.sort(key=lambda k: safetensors_order_key(tensors[k].name, tensors[k].dtype))
    return shards


def _skip_modules(plan: Plan, kept: dict[str, str], skip: list[str], heads_kept: list[str]) -> list[str] | None:
    """The ``llm_int8_skip_modules`` to write: None (null) unless patterns were given or a head is quantized."""
    user_skip = list(dict.fromkeys(skip))
    # transformers leaves the head out only while llm_int8_skip_modules is null: once patterns are
    # given (or the head is quantized on request), the list must name every kept head itself
    included_heads = sorted({module_name(t.name) for t in plan.tensors
                             if is_head(module_name(t.name)) and t.name not in kept})
    if user_skip or included_heads:
        return sorted(set(user_skip) | set(heads_kept))
    return None


def _kept_notes(kept: dict[str, str]) -> list[str]:
    """One note per reason a weight stays 16-bit (MoE experts and routers, heads, embeddings, ...), with a
    count and the first tensor; 1-D tensors and biases (never quantized) are not counted."""
    by_reason: dict[str, list[str]] = {}
    for name, why in kept.items():
        if why not in ("not a 2-D weight", "not a float tensor"):
            by_reason.setdefault(why, []).append(name)
    return [f"{len(names)} weight{'s' if len(names) > 1 else ''} not quantized: {why} (first: {names[0]})"
            for why, names in by_reason.items()]


def _sub_config_dtypes(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with the model's ``dtype`` in each sub-config (``text_config``, ``vision_config`` ...: an
    object with a ``model_type``), as transformers writes a model loaded with a dtype and saved."""
    top = cfg.get("dtype", cfg.get("torch_dtype"))
    if not isinstance(top, str):
        return cfg
    return {k: {**v, "dtype": top} if isinstance(v, dict) and "model_type" in v and k != "quantization_config" else v
            for k, v in cfg.items()}


def _compute_dtype(cfg: dict[str, Any], jobs: list[LayerJob], plan: Plan) -> str:
    for key in ("dtype", "torch_dtype"):
        name = float_dtype_name(cfg.get(key))
        if name is not None:
            return name
    names = {j.input.dtype.name for j in jobs}
    return names.pop() if len(names) == 1 else "float32"

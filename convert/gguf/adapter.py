"""A PEFT LoRA adapter as a GGUF LoRA adapter: ``convert-bnb ADAPTER --to gguf[:f32|f16|bf16|q8_0] [--base MODEL]``,
the file llama.cpp applies to a base model's GGUF (``llama_adapter_lora_init``; ``llama-cli --lora``, Ollama's
``ADAPTER``) without merging.

What is written is what llama.cpp's ``convert_lora_to_gguf.py`` writes (at the pinned revision; it reuses
``convert_hf_to_gguf.py``'s model classes for names and transforms), byte for byte for a plain LoRA
(``tests/lora/test_gguf_adapter.py`` runs the script):

- tensors: per LoRA module, ``<GGUF name of the base weight>.lora_a`` then ``.lora_b``
  (``blk.0.attn_q.weight.lora_a``), modules in the order the converter reads them (a safetensors file by data
  offset, as ``safetensors.torch.load_file``; a ``.bin`` as pickled), each named by the architecture table
  (:func:`convert.gguf.arch.text_name`, :func:`convert.gguf.arch.gguf_tensor_name`);
- layouts: ``lora_a`` is PEFT's ``lora_A`` ``[r, in]`` (GGUF ne ``{in, r}``), ``lora_b`` is ``lora_B``
  ``[out, r]`` (ne ``{r, out}``); an Embedding's ``lora_embedding_A`` ``[r, vocab]`` is written transposed,
  ``[vocab, r]`` (llama.cpp reads token_embd's pair flipped); Llama's q/k permutation (``LlamaModel.permute``,
  :func:`convert.gguf.arch.permute_heads`) reorders the rows of ``lora_b``, the output rows, as the converter's
  ``LoraTorchTensor`` does;
- types: every tensor in the asked type; for Q8_0 a tensor whose rows are not a multiple of 32 (the
  ``lora_b`` of a rank below 32) is F16, as gguf-py's ``quantize`` falls back; values as the converter takes
  them (bf16 widened to float32, exactly; f16 and f32 as they are);
- metadata: ``general.architecture`` (the base's), ``general.type`` ``adapter``, ``adapter.type`` ``lora``, the
  ``general.*`` keys gguf-py's ``Metadata.load`` makes of the adapter directory (its name, its model card's
  ``base_model`` and tags, ...: :func:`convert.gguf.general.model_metadata`, with the converter's negative
  parameter count of a LoRA), ``adapter.lora.alpha`` (float32) and ``general.quantization_version``; no
  ``general.file_type``, no hyperparameters, no tokenizer;
- the default file name: gguf-py's naming convention with the ``LoRA`` kind, ``Adapter-F16-LoRA.gguf``, next to
  the adapter directory (the converter writes it inside; the input is never touched here); a Hub adapter repo
  (``org/name``, fetched as :mod:`convert.hub.download` fetches an adapter) is named as a Hub model is: the repo id
  as ``general.name``, ``org-name-F16-LoRA.gguf`` in the working directory.

The base model (:class:`BaseModel`: ``--base``, by default the adapter config's ``base_model_name_or_path``,
a local directory or a Hub repo) gives its ``config.json`` alone: the architecture, the layer count, the head
counts, the vocabulary size and whether the embeddings are tied. Its weights are never read.

Where the converter is wrong, this module is right instead: the scale. PEFT scales a module's ``B @ A`` by
``s_m = alpha_m / r_m``, or ``alpha_m / sqrt(r_m)`` with ``use_rslora``, ``r_m`` and ``alpha_m`` taken from
``rank_pattern`` / ``alpha_pattern`` (:meth:`formats.peft_config.LoraConfig.scale_for`). llama.cpp scales by
``adapter.lora.alpha / r_m``, ``r_m`` the tensor's own rank (``llama_adapter_lora_weight::get_scale``; an alpha
of 0 means no scaling at all). The converter writes ``lora_alpha`` as it is, so an rsLoRA adapter is applied
with ``alpha / r`` and an ``alpha_pattern`` is lost (a ``rank_pattern`` alone comes out right, through the
per-tensor rank). Here (:func:`gguf_scales`):

1. each module needs an alpha ``a_m = s_m * r_m``: ``alpha_m``, or ``alpha_m * sqrt(r_m)`` with rsLoRA
   (float64);
2. when every module's ``a_m`` rounds to one nonzero float32 value, that value is ``adapter.lora.alpha`` and no
   tensor changes (a plain LoRA: ``lora_alpha``, the converter's file);
3. otherwise ``adapter.lora.alpha`` is the config's default ``a`` (``lora_alpha``, or ``lora_alpha * sqrt(r)``
   with rsLoRA) rounded to float32, or 1.0 when that is 0; the ``lora_b`` of each module whose ``a_m`` rounds to
   another value is multiplied by ``a_m / adapter.lora.alpha`` (the float64 product of its float32 values and
   that factor, rounded once to float32, before the Llama permutation and the output type's rounding), so that
   llama.cpp's ``adapter.lora.alpha / r_m`` times it is ``s_m``.

Rules raised here (docs/errors.md), before anything is written, besides the adapter's own (LORA-001..013, from
:func:`formats.peft.open_adapter`; LORA-009 from :meth:`formats.peft.Adapter.check_targets`: LoRA weights on a
module the config does not target, which PEFT drops and the converter would write) and the base config's
(GGUF-001, GGUF-005, GGUF-006, CKPT-007):

========  ======================================================================================
LORA-010  every lora_A / lora_B fits the base weight its config gives (q/k/v/o, gate/up/down, lm_head,
          embed_tokens: :func:`base_module_shape`; others unchecked) (:class:`LoraShapeError`)
LORA-014  no lora_A / lora_B value is NaN or infinite, nor a lora_b made so by its factor (checked as the
          tensor is written; the file is then not committed) (:class:`NonFiniteAdapterError`)
LORA-015  only what a GGUF adapter holds: no DoRA magnitude vector, no ``modules_to_save`` or other full
          tensor, no resized vocabulary (an embedding or head whose rows differ from ``vocab_size``), no
          LoRA on MoE experts or on a vision/audio tower, no head or embedding pair llama.cpp's base file
          cannot take (a tied ``lm_head``; an embedding pair with tied embeddings, which llama.cpp would apply
          to the output projection as well), an alpha that fits float32 (:class:`GgufAdapterError`)
GGUF-003  every LoRA module is a weight with a GGUF name for the base's architecture
          (:class:`UnmappedTensorError`)
========  ======================================================================================
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from convert.gguf.arch import (
    block_count,
    find_architecture,
    gguf_tensor_name,
    hparams,
    is_skipped,
    permute_heads,
    text_name,
)
from convert.gguf.general import MetadataSource, model_metadata
from convert.gguf.plan import GGUFPlan, GGUFTensor
from convert.gguf.target import GgufJob
from convert.gguf.types import OUTPUT_TYPES, parse_output_type
from convert.options import SUMMARY_SAMPLE, ConvertOptions
from convert.output_names import GgufNaming, gguf_encoding
from convert.stream.plan import Plan, PlannedTensor
from convert.stream.sources import Source
from formats.checkpoint import Checkpoint, TensorRecord, read_config
from formats.dtypes import BY_CODE, DType
from formats.errors import GgufAdapterError, GgufTypeError, LoraShapeError, NonFiniteAdapterError
from formats.gguf import tensor_nbytes
from formats.peft import Adapter, AdapterModule, check_finite, parse_adapter_key

__all__ = ["ADAPTER_TYPES", "AdapterTensorSource", "BaseModel", "GgufAdapterJob", "adapter_order", "gguf_scales",
           "lora_modules", "plan_adapter"]

GT = gguf.GGMLQuantizationType
_F32 = BY_CODE["F32"]

#: The ``--to gguf:TYPE`` values of an adapter: ``convert_lora_to_gguf.py``'s ``--outtype`` (a bare ``gguf`` is
#: F16, as for a model).
ADAPTER_TYPES = ("f32", "f16", "bf16", "q8_0")

#: Where to go instead when a GGUF adapter cannot hold the adapter (LORA-015's hint).
_MERGE_HINT = "merge it into the model instead: convert-bnb BASE --to gguf:TYPE --merge-lora ADAPTER"


@dataclass(frozen=True)
class BaseModel:
    """The model an adapter applies to, as far as its GGUF adapter needs it: its ``config.json``.

    Attributes:
        directory: the directory holding config.json (a Hub repo's snapshot).
        model_id: the folder's name, or the Hub repo id.
        config: config.json as read (an object).
        ref: what was read, for notes: the directory's absolute path, or ``org/name@commit``.
    """

    directory: Path
    model_id: str
    config: Mapping[str, Any]
    ref: str

    @property
    def repo_id(self) -> str | None:
        """The Hub repo id when the base is a Hub repo (``ref`` is ``org/name@commit``), else None."""
        return self.model_id if self.ref.startswith(f"{self.model_id}@") and not os.path.isabs(self.ref) else None

    @property
    def config_path(self) -> str:
        """config.json's path (for error messages)."""
        return str(self.directory / "config.json")

    @classmethod
    def read(cls, directory: Path, model_id: str, ref: str) -> BaseModel:
        """The base model of ``directory`` (its config.json).

        Raises:
            ConfigJsonError: CKPT-007 (config.json is not a JSON object within the limits).
            OSError: it cannot be read.
        """
        return cls(directory, model_id, read_config(directory / "config.json"), ref)


def adapter_order(adapter: Adapter) -> list[str]:
    """The adapter's keys in the order ``convert_lora_to_gguf.py`` reads them: a safetensors file's by data offset
    (``safetensors.torch.load_file``), a pickle's as stored."""
    reader = adapter.reader
    infos = getattr(reader, "tensors", None)
    keys = list(adapter.tensors)
    if adapter.weights_file.suffix == ".safetensors" and isinstance(infos, Mapping):
        keys.sort(key=lambda k: getattr(infos.get(k), "start", 0))
    return keys


def gguf_scales(adapter: Adapter, ranks: Mapping[str, int]) -> tuple[float, dict[str, float]]:
    """``adapter.lora.alpha`` and the factors folded into ``lora_b`` that make llama.cpp apply PEFT's scale to every
    module (the module docstring gives the rule).

    Args:
        adapter: the adapter (its config's ``lora_alpha``, ``r``, ``use_rslora``, ``alpha_pattern``).
        ranks: module -> its rank (``lora_A`` rows, as checked against ``r`` / ``rank_pattern``).

    Returns:
        (adapter.lora.alpha as a float32 value, module -> factor for the modules whose ``lora_b`` is scaled).

    Raises:
        GgufAdapterError: LORA-015, an alpha that does not fit float32.
        PatternTimeoutError: LORA-013 (``alpha_pattern``).
    """
    cfg = adapter.config

    def needed(alpha: float, r: int) -> float:
        return alpha * math.sqrt(r) if cfg.use_rslora else float(alpha)

    def f32(value: float, what: str) -> float:
        with np.errstate(over="ignore"):
            out = float(np.float32(value))
        if not math.isfinite(out):
            raise GgufAdapterError(f"the LoRA alpha {what} does not fit the float32 adapter.lora.alpha",
                                   path=cfg.path, expected="at most 3.4e38", found=value, hint=_MERGE_HINT)
        return out

    wanted = {m: needed(cfg.alpha_for(m), r) for m, r in ranks.items()}
    rounded = {m: f32(a, f"of {m}") for m, a in wanted.items()}
    if len(set(rounded.values())) == 1 and 0.0 not in rounded.values():
        return next(iter(rounded.values())), {}
    alpha = f32(needed(cfg.lora_alpha, cfg.r), "") or 1.0
    return alpha, {m: wanted[m] / alpha for m in ranks if rounded[m] != alpha}


class AdapterTensorSource(Source):
    """One adapter tensor as the GGUF adapter holds it, read in chunks from the adapter file (zero-copy): as
    stored, transposed (an Embedding's ``lora_embedding_A``), or multiplied by a module's ``factor``
    (:func:`gguf_scales`: float64 products rounded once to float32); every value checked finite (LORA-014).

    Args:
        record: the adapter tensor (2-D).
        transpose: write it ``[cols, rows]``.
        factor: the scale folded in, or None.
    """

    def __init__(self, record: TensorRecord, *, transpose: bool = False, factor: float | None = None) -> None:
        super().__init__()
        self.record = record
        self.name = record.name
        self.numel = record.numel
        self.in_nbytes = record.nbytes
        self.transpose = transpose
        self.factor = factor
        self.dtype: DType = record.dtype if factor is None else _F32
        rows, cols = record.shape
        self.shape = (cols, rows) if transpose else (rows, cols)
        self.kind = " ".join(w for w in ("copy" if self.dtype == record.dtype else f"{record.dtype.name}->float32",
                                         "transposed" if transpose else "",
                                         f"x {factor!r}" if factor is not None else "") if w)

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        rec = self.record
        if self.transpose:
            cols = self.shape[1]
            r0, r1 = start // cols, -(-stop // cols)
            stored = rec.raw().view(rec.dtype.numpy).reshape(rec.shape)
            values = np.ascontiguousarray(stored[:, r0:r1].T).reshape(-1)[start - r0 * cols : stop - r0 * cols]
        else:
            item = rec.dtype.itemsize
            values = rec.raw(start * item, stop * item).view(rec.dtype.numpy)
        check_finite(rec, values, start)
        if self.factor is not None:
            with np.errstate(over="ignore"):
                values = (values.astype(np.float64) * self.factor).astype(np.float32)
            if not np.isfinite(values).all():
                raise NonFiniteAdapterError(
                    "lora_B times the factor that gives llama.cpp PEFT's scale overflows float32",
                    path=rec.file, tensor=rec.name, expected="finite values", found=f"x {self.factor!r}",
                    hint=_MERGE_HINT)
        return values if values.dtype == dtype.numpy else values.astype(dtype.numpy)

    def release(self, start: int, stop: int) -> None:
        if not self.transpose:
            item = self.record.dtype.itemsize
            self.record.release(start * item, stop * item)

    def finish(self) -> None:
        self.record.release()

    def inputs(self) -> list[Any] | None:
        return [self.record]


@dataclass
class AdapterPlan:
    """A GGUF adapter planned from headers.

    Attributes:
        gguf: the file (names, types, shapes, metadata) for :func:`convert.gguf.encode.write_gguf`.
        tensors: adapter key -> the planned tensor whose source makes it (the file's ``source`` names).
        alpha: ``adapter.lora.alpha``.
        factors: module -> the factor folded into its ``lora_b`` (:func:`gguf_scales`).
        notes: what the user should know.
        scale_notes: the notes on how PEFT's scales became llama.cpp's (:func:`_scale_notes`; none for a plain
            LoRA), also among ``notes``.
    """

    gguf: GGUFPlan
    tensors: dict[str, PlannedTensor]
    alpha: float
    factors: dict[str, float]
    notes: list[str]
    scale_notes: list[str] = field(default_factory=list)


def _refuse(message: str, adapter: Adapter, key: str, **kw: Any) -> GgufAdapterError:
    return GgufAdapterError(message, path=adapter.weights_file, tensor=key, hint=kw.pop("hint", _MERGE_HINT), **kw)


def lora_modules(adapter: Adapter) -> list[AdapterModule]:
    """The LoRA modules in the converter's order, after refusing what a GGUF adapter cannot hold of the adapter
    alone (LORA-015: a DoRA magnitude vector, a full tensor that is not a LoRA module's ``base_layer`` copy)."""
    order: dict[str, AdapterModule] = {}
    for key in adapter_order(adapter):
        ak = parse_adapter_key(key, adapter.weights_file)
        mod = adapter.modules.get(ak.module)
        if mod is None:  # PEFT's copies of a modules_to_save module (formats.peft checked them)
            raise _refuse("adapter holds a modules_to_save module; a GGUF LoRA adapter holds LoRA pairs only",
                          adapter, key)
        if ak.kind == "magnitude":
            raise _refuse("DoRA magnitude vector: a GGUF LoRA adapter has none (llama.cpp applies B @ A alone)",
                          adapter, key)
        if ak.kind in ("full", "base_layer") and mod.full_kind.get(ak.param) != "base_layer":
            what = {"modules_to_save": "a modules_to_save module's trained tensor",
                    "saved_layer": "a full embedding or head saved with the adapter (a resized vocabulary)"}
            raise _refuse(f"adapter holds {what.get(mod.full_kind.get(ak.param, ''), 'a full tensor')}; a GGUF LoRA "
                          "adapter holds LoRA pairs only", adapter, key)
        if mod.has_lora:
            order.setdefault(mod.module, mod)
    return list(order.values())


def _int(hp: Mapping[str, Any], key: str) -> int | None:
    value = hp.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def base_module_shape(module: str, hp: Mapping[str, Any]) -> tuple[int, int] | None:
    """The base weight's ``[out, in]`` of a LoRA module as the base config gives it, or None where it cannot be
    computed from the config alone (other modules, MoE experts and shared experts, per-layer head counts).

    Args:
        module: the PEFT module name (``model.layers.0.self_attn.q_proj``).
        hp: the base's hyperparameters (:func:`convert.gguf.arch.hparams`: ``hidden_size``, ``intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``@head_dim`` (``head_dim`` or hidden / heads),
            ``vocab_size``).

    Returns:
        ``(out, in)`` as ``nn.Linear``'s weight (an embedding's ``(vocab, hidden)``), or None.
    """
    parts = module.split(".")
    leaf, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")
    hidden, inter, vocab = _int(hp, "hidden_size"), _int(hp, "intermediate_size"), _int(hp, "vocab_size")
    heads = _int(hp, "num_attention_heads")
    kv = _int(hp, "num_key_value_heads") or heads
    head_dim = _int(hp, "@head_dim")
    q = heads * head_dim if heads and head_dim else None
    k = kv * head_dim if kv and head_dim else None
    table: dict[str, tuple[int | None, int | None]] = {}
    if parent in ("self_attn", "attention", "attn"):
        table = {"q_proj": (q, hidden), "k_proj": (k, hidden), "v_proj": (k, hidden), "o_proj": (hidden, q)}
    elif parent in ("mlp", "feed_forward") and "experts" not in parts and "shared_expert" not in parts:
        table = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    elif leaf == "lm_head":
        table = {"lm_head": (vocab, hidden)}
    elif leaf == "embed_tokens":
        table = {"embed_tokens": (vocab, hidden)}
    out, inp = table.get(leaf, (None, None))
    return (out, inp) if out is not None and inp is not None else None


def _check_shape(adapter: Adapter, mod: AdapterModule, hp: Mapping[str, Any], cfg_path: str) -> None:
    """LORA-010 when a module's lora_A / lora_B do not fit the base weight the config gives
    (:func:`base_module_shape`): llama.cpp would refuse the file ("tensor ... has incorrect shape")."""
    want = base_module_shape(mod.module, hp)
    a, b = mod.lora_A, mod.lora_B
    if want is None or a is None or b is None:
        return
    found = (a.shape[1], b.shape[0]) if mod.embedding else (b.shape[0], a.shape[1])
    if found == want:
        return
    out_side, in_side = (b, a) if not mod.embedding else (a, b)
    bad = out_side if found[0] != want[0] else in_side
    what = "[num_embeddings, dim] = [A columns, B rows]" if mod.embedding else "[out, in] = [B rows, A columns]"
    raise LoraShapeError(f"LoRA weights do not fit the base model's {mod.module} {what}, as its config.json gives it",
                         path=adapter.weights_file, tensor=bad.name, expected=list(want), found=list(found),
                         hint=f"is this adapter for another model? (base config: {cfg_path})")


def _lora_type(shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType) -> tuple[gguf.GGMLQuantizationType, str]:
    """The converter's type of a LoRA tensor: the asked one; F16 where the rows are not whole blocks of it (gguf-py's
    ``QuantError`` fallback). (Unlike a model's weights, no LoRA tensor is kept F32: ``prepare_tensors`` matches
    its F32 list against ``.weight`` names only.)"""
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return GT.F16, f"row of {shape[-1]} is not a multiple of the {wanted.name} block of {block}: F16"
    return wanted, ""


def _lora_counts(tensors: Sequence[GGUFTensor]) -> tuple[int, int, int, int]:
    """gguf-py's ``GGUFWriter.get_total_parameter_count`` of a LoRA file: each pair counts ``lora_b``'s shape with
    its last dimension taken from ``lora_a``'s; the total is negated (a LoRA), the shared count is not."""
    total = 0
    last_a: GGUFTensor | None = None
    for t in tensors:
        if t.name.endswith(".lora_a"):
            last_a = t
            continue
        assert last_a is not None and last_a.name[:-1] == t.name[:-1]
        total += math.prod((*t.shape[:-1], last_a.shape[-1]))
    return (-total if last_a is not None else total), total, 0, 0


def plan_adapter(adapter: Adapter, base: BaseModel, output_type: str | None = None, *,
                 metadata: str | os.PathLike[str] | None = None, model_id: str | None = None) -> AdapterPlan:
    """Plan the GGUF adapter of ``adapter`` for ``base`` from headers alone (see the module docstring).

    Args:
        adapter: the opened adapter (:func:`formats.peft.open_adapter`).
        base: the base model's config.
        output_type: one of :data:`ADAPTER_TYPES` (default ``f16``).
        metadata: a ``--metadata`` file of ``general.*`` values, or None.
        model_id: the adapter's id for its ``general.*`` keys (:class:`convert.gguf.general.MetadataSource`): a Hub
            repo's ``org/name`` (its ``general.name``, as for a Hub model), or None for the directory's name.

    Returns:
        the :class:`AdapterPlan`; no tensor data has been read.

    Raises:
        GgufTypeError: GGUF-002, a type that is not one of :data:`ADAPTER_TYPES`.
        GgufAdapterError: LORA-015. UnmappedTensorError: GGUF-003.
        UnsupportedArchitectureError, GgufConfigError, RopeScalingError: GGUF-001, 006, 005 (the base's config).
        UsageError: USE-001, a bad ``--metadata`` file.
    """
    out_name = parse_output_type(output_type)
    if out_name not in ADAPTER_TYPES:
        raise GgufTypeError(f"a LoRA adapter is written as {', '.join(ADAPTER_TYPES)} (convert_lora_to_gguf.py's "
                            "--outtype), not as a llama-quantize type", expected=[f"gguf:{t}" for t in ADAPTER_TYPES],
                            found=f"gguf:{out_name}", hint="llama.cpp applies a Q8_0 or float adapter to a base of "
                            "any type")
    wanted, file_type = OUTPUT_TYPES[out_name]
    cfg_path = base.config_path
    arch = find_architecture(base.config, path=cfg_path)
    hp = hparams(base.config, arch, cfg_path)
    name_map = gguf.get_tensor_name_map(arch.model_arch, block_count(hp, cfg_path))
    experts = [re.compile(p) for p in ([arch.experts.pattern] if arch.experts and arch.experts.pattern else [])
               + [f.pattern for f in (arch.experts.fused if arch.experts else ())]]
    vocab = hp.get("vocab_size")
    tied = hp.get("tie_word_embeddings") is True
    wfile = str(adapter.weights_file)
    adapter.check_targets()
    modules = lora_modules(adapter)
    alpha, factors = gguf_scales(adapter, {m.module: m.lora_A.shape[0] for m in modules if m.lora_A is not None})

    planned: list[GGUFTensor] = []
    sources: dict[str, PlannedTensor] = {}
    notes: list[str] = []
    for mod in modules:
        a, b = mod.lora_A, mod.lora_B
        assert a is not None and b is not None
        name = text_name(arch, f"{mod.module}.weight")
        if name is None:
            raise _refuse("LoRA on a vision/audio tower or projector: the text model's GGUF adapter cannot hold it",
                          adapter, a.name)
        if is_skipped(arch, name) or any(p.match(name) for p in experts):
            what = "MoE experts (llama.cpp stacks them into one tensor)" if not is_skipped(arch, name) else \
                f"'{mod.module}', which llama.cpp's {arch.name} file does not hold (a tied head)"
            raise _refuse(f"LoRA on {what}: a GGUF adapter cannot apply it", adapter, a.name)
        gguf_name = gguf_tensor_name(name_map, arch, name, wfile)
        if gguf_name in ("token_embd.weight", "output.weight"):
            rows = a.shape[1] if mod.embedding else b.shape[0]
            if isinstance(vocab, int) and rows != vocab:
                raise _refuse("LoRA on a resized vocabulary: llama.cpp applies it to the base's embedding rows only",
                              adapter, a.name, expected=f"{vocab} rows (the base's vocab_size)", found=rows)
            if tied:
                raise _refuse("LoRA on the embedding or head of a model with tied embeddings: llama.cpp's base file "
                              "has one tensor for both, and would apply the pair to the other use too", adapter,
                              a.name, expected="tie_word_embeddings false", found=True)
        _check_shape(adapter, mod, hp, cfg_path)
        factor = factors.get(mod.module)
        for gname, rec, transpose, scale in ((f"{gguf_name}.lora_a", a, mod.embedding, None),
                                             (f"{gguf_name}.lora_b", b, False, factor)):
            src = AdapterTensorSource(rec, transpose=transpose, factor=scale)
            qtype, why = _lora_type(src.shape, wanted)
            heads = permute_heads(arch, name, src.shape, hp, cfg_path) if gname.endswith(".lora_b") else 0
            planned.append(GGUFTensor(rec.name, gname, src.shape, qtype, tensor_nbytes(src.shape, qtype), heads,
                                      fallback=why))
            sources[rec.name] = PlannedTensor(rec.name, src.dtype, src.shape, src)
        for param, kind in mod.full_kind.items():
            if kind == "base_layer":
                notes.append(f"{mod.module}.base_layer.{param}: PEFT's copy of the unchanged base tensor, not written "
                             "(as the converter)")

    counts = _lora_counts(planned)
    own_config = adapter.path / "config.json"
    source = MetadataSource(adapter.path, model_id or adapter.path.resolve().name,
                            read_config(own_config) if own_config.is_file() else None,
                            Path(metadata) if metadata is not None else None)
    general, general_notes = model_metadata(source, counts)
    scratch = gguf.GGUFWriter(path=None, arch=arch.name)
    scratch.add_type(gguf.GGUFType.ADAPTER)
    scratch.add_string(gguf.Keys.Adapter.TYPE, "lora")
    general.set_gguf_meta_model(scratch)
    scratch.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    scratch.add_quantization_version(gguf.GGML_QUANT_VERSION)
    kv = {k: (v.value, v.type, v.sub_type) for k, v in scratch.kv_data[0].items()
          if k != gguf.Keys.General.ARCHITECTURE}
    naming = GgufNaming(general.name, general.basename, general.finetune, general.version, general.size_label,
                        gguf_encoding(file_type), kind="LoRA")
    scale_notes = _scale_notes(adapter, alpha, factors)
    notes += scale_notes + general_notes
    gplan = GGUFPlan(arch, out_name, file_type, kv, planned, notes=notes, naming=naming)
    return AdapterPlan(gplan, sources, alpha, factors, notes, scale_notes)


def _scale_notes(adapter: Adapter, alpha: float, factors: Mapping[str, float]) -> list[str]:
    """How PEFT's scales became llama.cpp's (only where it differs from writing lora_alpha as it is)."""
    cfg = adapter.config
    if not factors and alpha == float(np.float32(cfg.lora_alpha)):
        return []
    why = "use_rslora (PEFT scales by alpha / sqrt(r), llama.cpp by alpha / r)" if cfg.use_rslora else \
        "alpha_pattern / rank_pattern"
    if not factors:
        return [f"adapter.lora.alpha = {alpha!r} (lora_alpha {cfg.lora_alpha!r}): {why}; convert_lora_to_gguf.py "
                f"writes {float(cfg.lora_alpha)!r}, which llama.cpp would apply with another scale"]
    shown = ", ".join(f"{m} x {f:.6g}" for m, f in list(factors.items())[:3])
    more = f" and {len(factors) - 3} more" if len(factors) > 3 else ""
    return [f"adapter.lora.alpha = {alpha!r}; {len(factors)} modules' scales differ ({why}): their lora_b carries the "
            f"ratio ({shown}{more}), so llama.cpp applies PEFT's scale to each; convert_lora_to_gguf.py writes "
            "lora_alpha alone"]


class GgufAdapterJob(GgufJob):
    """The GGUF LoRA adapter writer of one conversion (a :class:`convert.targets.TargetJob`): planned by
    :func:`plan_adapter`, written, verified and reported as a model's GGUF (:class:`convert.gguf.target.GgufJob`:
    :func:`convert.gguf.encode.write_gguf`, :func:`formats.gguf.verify_gguf`).

    Args:
        adapter: the opened adapter (kept open while the job writes).
        base: the base model's config.
        options: ``to`` (``gguf`` or ``gguf:`` one of :data:`ADAPTER_TYPES`), ``metadata``, ``merge_report`` (exact
            error figures), ``dry_run``.
        model_name: the adapter's id (:func:`plan_adapter`'s ``model_id``): a Hub repo's ``org/name``, or None for
            the directory's name.

    Raises:
        as :func:`plan_adapter`.
    """

    weights = "the adapter's weights"

    def __init__(self, adapter: Adapter, base: BaseModel, options: ConvertOptions, model_name: str | None = None
                 ) -> None:
        assert options.to.gguf_type is not None
        self.adapter = adapter
        self.base = base
        self.sample = 1 if options.merge_report else SUMMARY_SAMPLE
        self.out_type = options.to.gguf_type
        self.to = options.to.name
        self.mmproj = None
        self.split = None
        self.aplan = plan_adapter(adapter, base, self.out_type, metadata=options.metadata, model_id=model_name)
        self.gplan = self.aplan.gguf
        ckpt = Checkpoint(adapter.path, True, [adapter.weights_file], dict(adapter.tensors))
        self.plan = Plan(ckpt, self.to, [self.aplan.tensors[t.source] for t in self.gplan.tensors
                                         if t.source is not None],
                         notes=[f"base model: {base.ref} (config.json alone)"])
        self._sizes(options.dry_run)

    def describe(self) -> str:
        head, _, rest = super().describe().replace(" -> GGUF ", " -> GGUF LoRA adapter for ", 1).partition("\n")
        return f"{head}\n  adapter.lora.alpha = {self.aplan.alpha:g}\n{rest}"

    def adapter_info(self) -> dict[str, Any]:
        """What a plan, a result and a pushed card say of the adapter: ``base`` (its ref), ``base_name`` (the
        folder's name or the repo id), ``base_repo`` (the repo id, or None for a local base), ``alpha``,
        ``factors`` and ``scale_notes`` (:class:`AdapterPlan`)."""
        return {"base": self.base.ref, "base_name": self.base.model_id, "base_repo": self.base.repo_id,
                "alpha": self.aplan.alpha, "factors": dict(self.aplan.factors),
                "scale_notes": list(self.aplan.scale_notes)}

    def plan_dict(self) -> dict[str, Any]:
        return {**super().plan_dict(), "adapter": self.adapter_info()}

    def details(self) -> dict[str, Any]:
        out = super().details()
        out["gguf"]["adapter"] = self.adapter_info()
        return out

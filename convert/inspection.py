"""``convert-bnb inspect SRC [--json] [--stats]``: what a checkpoint holds, before a long run.

Without reading weight data (headers, the QuantState JSON and the 16-value quant_map only), the
report lists (a Hub repo id is read in place, :mod:`convert.hub.shards`: its headers and those few
bytes by HTTP range requests, its small files into the cache, no weights downloaded):

- quantized layers grouped by their settings -- 4-bit: ``quant_type``, ``blocksize``, nested
  (with ``nested_blocksize`` and ``nested_dtype``), the QuantState ``dtype``, the storage dtype of
  the packed codes (``bnb_4bit_quant_storage``) and the absmax dtype; LLM.int8: weight and scale
  dtypes -- with layer and weight counts and bits per weight (every byte a layer stores, times 8,
  over its element count);
- bytes by kind: ``packed`` codes, ``absmax``, ``nested_statistics`` (nested_absmax +
  nested_quant_map), ``quant_map``, ``quant_state`` (the JSON), ``int8_weight``, ``int8_scale``
  (SCB + weight_format) and ``unquantized:<dtype>`` per safetensors dtype code;
- the planned output for each ``--to`` target (tensor bytes and file count, from
  :func:`convert.stream.plan.make_plan`, exactly what the pipeline would write), and for the GGUF types of
  :data:`GGUF_SIZED` (the GGUF writer's plan: its tensor data, or the rule that refuses the checkpoint).

A PEFT LoRA adapter directory (or Hub repo) as SRC gets its own report (:func:`inspect_adapter`): its scale
settings, its modules by rank and PEFT scale, its tensors by dtype, and what the two routes of an adapter do
with it (``--merge-lora`` onto a base; ``--to gguf`` as a GGUF LoRA adapter, or the rule that refuses it).

``--stats`` reads only the absmax vectors (nested quantization undone; for LLM.int8 the per-row
``SCB``) and reports per layer ``max absmax / median absmax`` and the share of blocks whose absmax
exceeds ``outlier_factor`` times the layer's median; a layer whose max/median reaches
``flag_ratio`` is flagged as an outlier layer.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from convert.options import FLOAT_TARGETS, ConvertOptions, target_for
from convert.run.source import resolve_source
from convert.stream.plan import Plan, make_plan
from convert.stream.sources import Dequant4Source
from convert.targets import TARGETS, check_adapter_alone
from convert.units import format_bytes, parse_size
from formats.bnb import Int8Layer, QuantizedLayer, is_int8_config
from formats.bnb_layers import group_layers
from formats.errors import ConvertBnbError, GgufAdapterError, UsageError
from formats.peft import Adapter, open_adapter

if TYPE_CHECKING:  # heavy imports stay inside the functions: this module loads at CLI start-up
    import numpy as np

    from formats.bnb import Int8Layer, QuantizedLayer
    from formats.checkpoint import Checkpoint

__all__ = ["GGUF_SIZED", "InspectOptions", "absmax_stats", "format_adapter_report", "format_report",
           "inspect_adapter", "inspect_checkpoint"]

#: The GGUF targets whose planned size the report gives beside the float ones: llama.cpp's common picks.
GGUF_SIZED = ("gguf:f16", "gguf:q8_0", "gguf:q4_k_m")


@dataclass(frozen=True)
class InspectOptions:
    """Options of :func:`inspect_checkpoint`.

    Attributes:
        stats: read the absmax vectors and report outlier statistics.
        outlier_factor: a block is an outlier when its absmax exceeds this times the layer's median.
        flag_ratio: a layer is flagged when its max absmax / median absmax reaches this.
        max_shard_size: shard limit used for the planned outputs (bytes), as ``--max-shard-size``.
    """

    stats: bool = False
    outlier_factor: float = 4.0
    flag_ratio: float = 8.0
    max_shard_size: int = 5 * 10**9


def _add(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


def _bpw(nbytes: int, elements: int) -> float:
    return round(8.0 * nbytes / elements, 4) if elements else 0.0


def inspect_checkpoint(ckpt: Checkpoint, options: InspectOptions | None = None) -> dict[str, Any]:
    """Describe a checkpoint's quantized layers, bytes and planned outputs, from headers alone.

    Args:
        ckpt: an opened checkpoint (:func:`formats.checkpoint.open_checkpoint`).
        options: what to compute; defaults to :class:`InspectOptions`.

    Returns:
        a JSON-ready dict: ``source``, ``files`` (name, bytes), ``tensors``, ``quantized`` (groups of
        4-bit layers), ``int8`` (groups of LLM.int8 layers), ``unquantized`` (per dtype code),
        ``bytes_by_kind``, ``total_bytes`` (tensor data bytes), ``outputs`` (per target: ``bytes``
        of tensor data and ``files``, or ``error``) and, with ``stats``, ``stats``.

    Raises:
        BnbLayerError: a layer breaks a BNB-xxx rule (as the conversion would report it).
    """

    opts = options or InspectOptions()
    layers, plain = group_layers(ckpt.tensors, ckpt.values,  # type: ignore[arg-type]
                                 int8_model=is_int8_config(ckpt.config))
    by_kind: dict[str, int] = {}
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    int8_groups: dict[tuple[str, str], dict[str, Any]] = {}
    for layer in layers.values():
        if isinstance(layer, QuantizedLayer):
            st = layer.state
            key = (st.quant_type, st.blocksize, st.nested, st.nested_blocksize, st.nested_dtype, st.dtype,
                   layer.packed.dtype.code, layer.absmax.dtype.code)
            g = groups.get(key)
            if g is None:
                g = groups[key] = {
                    "quant_type": st.quant_type, "blocksize": st.blocksize, "nested": st.nested,
                    "nested_blocksize": st.nested_blocksize, "nested_dtype": st.nested_dtype,
                    "dtype": st.dtype, "storage": layer.packed.dtype.code, "absmax_dtype": layer.absmax.dtype.code,
                    "layers": 0, "elements": 0,
                    "bytes": {"packed": 0, "absmax": 0, "nested_statistics": 0, "quant_map": 0, "quant_state": 0},
                    "names": [],
                }
            g["layers"] += 1
            g["elements"] += st.numel
            g["names"].append(layer.name)
            b = g["bytes"]
            b["packed"] += layer.packed.nbytes
            b["absmax"] += layer.absmax.nbytes
            b["quant_map"] += layer.quant_map.nbytes
            nested = sum(t.nbytes for t in (layer.nested_absmax, layer.nested_quant_map) if t is not None)
            b["nested_statistics"] += nested
            known = {layer.name, layer.absmax.name, layer.quant_map.name}
            known |= {t.name for t in (layer.nested_absmax, layer.nested_quant_map) if t is not None}
            b["quant_state"] += sum(ckpt.tensors[c].nbytes for c in layer.components
                                    if c not in known and c in ckpt.tensors)  # (not unpacked pickle values)
        elif isinstance(layer, Int8Layer):
            key8 = (layer.weight.dtype.code, layer.scb.dtype.code)
            g = int8_groups.get(key8)
            if g is None:
                g = int8_groups[key8] = {
                    "weight_dtype": layer.weight.dtype.code, "scale_dtype": layer.scb.dtype.code,
                    "layers": 0, "elements": 0, "bytes": {"int8_weight": 0, "int8_scale": 0}, "names": [],
                }
            g["layers"] += 1
            g["elements"] += layer.weight.numel
            g["names"].append(layer.name)
            g["bytes"]["int8_weight"] += layer.weight.nbytes
            g["bytes"]["int8_scale"] += layer.scb.nbytes + (layer.weight_format.nbytes if layer.weight_format else 0)
    for g in list(groups.values()) + list(int8_groups.values()):
        total = sum(g["bytes"].values())
        g["total_bytes"] = total
        g["bits_per_weight"] = _bpw(total, g["elements"])
        for k, v in g["bytes"].items():
            _add(by_kind, k, v)
    unq: dict[str, dict[str, Any]] = {}
    for name in plain:
        rec = ckpt.tensors[name]
        u = unq.setdefault(rec.dtype.code, {"dtype": rec.dtype.code, "tensors": 0, "elements": 0, "bytes": 0})
        u["tensors"] += 1
        u["elements"] += rec.numel
        u["bytes"] += rec.nbytes
        _add(by_kind, f"unquantized:{rec.dtype.code}", rec.nbytes)

    outputs: dict[str, dict[str, Any]] = {}
    plans: dict[str, Plan] = {}  # (a float target's plan is the one a GGUF target dequantizing to it plans from)
    for to in FLOAT_TARGETS:
        try:
            plans[to] = make_plan(ckpt, to, max_shard_size=opts.max_shard_size)
            outputs[to] = {"bytes": plans[to].out_nbytes, "files": len(plans[to].shards)}
        except ConvertBnbError as exc:
            outputs[to] = {"error": exc.reason}
    for to in GGUF_SIZED:
        target = target_for(to)
        try:  # (a dry run's plan: headers and config.json; the tokenizer's size is not counted, as for the others)
            plan = plans.get(target.dequantize_to) or make_plan(ckpt, target.dequantize_to)
            job = TARGETS["gguf"](plan, ConvertOptions(str(ckpt.source), to=target, dry_run=True), ckpt.source.name)
            outputs[to] = {"bytes": job.out_nbytes, "files": 1}
        except ConvertBnbError as exc:
            outputs[to] = {"error": exc.reason}

    sizes = {r.path: r.file_size for r in ckpt.readers}  # a Hub shard read in place is not on disk
    files: list[dict[str, Any]] = [{"file": f.name, "bytes": sizes[f]} for f in ckpt.files]
    notes = []
    odd = {u["dtype"]: u["tensors"] for u in unq.values() if u["dtype"] in ("F8_E4M3", "F8_E5M2", "F64")}
    if odd:
        kinds = ", ".join(f"{n} {code}" for code, n in sorted(odd.items()))
        notes.append(f"unquantized tensors stored as {kinds}: --to auto keeps them as stored; --to bf16/fp16/fp32 "
                     "cast them (float8 exactly) and a note names them")
    report: dict[str, Any] = {
        "source": str(ckpt.source),
        "config": ckpt.config is not None,
        "files": files,
        "tensors": len(ckpt.tensors),
        "components": _components(layers, plain, ckpt),
        "quantized": sorted(groups.values(), key=lambda g: (-g["layers"], g["quant_type"], g["blocksize"])),
        "int8": list(int8_groups.values()),
        "unquantized": sorted(unq.values(), key=lambda u: u["dtype"]),
        "bytes_by_kind": dict(sorted(by_kind.items())),
        "total_bytes": ckpt.nbytes,
        "outputs": outputs,
        "notes": notes,
    }
    if opts.stats:
        report["stats"] = absmax_stats(layers.values(), opts)
    return report


def inspect_adapter(adapter: Adapter) -> dict[str, Any]:
    """What a PEFT LoRA adapter holds, from its config and tensor headers (no weight data read).

    Returns:
        ``kind`` ``"lora-adapter"``; ``base_model`` (``base_model_name_or_path``, or None); ``r``, ``lora_alpha``,
        ``use_rslora``, ``use_dora``, ``rank_pattern``, ``alpha_pattern`` (as the config gives them),
        ``target_modules``, ``modules_to_save``; ``modules``: LoRA modules; ``ranks`` and ``scales``: modules per
        rank and per PEFT scale (:meth:`formats.peft_config.LoraConfig.scale_for`: ``alpha / r``, or
        ``alpha / sqrt(r)`` with rsLoRA), sorted; ``tensors``, ``tensor_bytes`` and ``dtypes`` (tensors per dtype
        name); ``gguf_adapter``: None when ``--to gguf`` can write it as a GGUF LoRA adapter as far as the adapter
        alone tells (its fit to the base is checked when converting), else ``{"rule", "reason", "tensor"}`` of the
        refusal (LORA-015, :data:`convert.targets.check_adapter_alone`).
    """
    cfg = adapter.config
    lora = [m for m in adapter.modules.values() if m.has_lora]
    ranks = Counter(cfg.rank_for(m.module) for m in lora)
    scales = Counter(cfg.scale_for(m.module) for m in lora)
    dtypes = Counter(rec.dtype.name for rec in adapter.tensors.values())
    refusal = None
    try:
        check_adapter_alone(adapter)
    except GgufAdapterError as exc:
        refusal = {"rule": exc.rule, "reason": exc.reason, "tensor": exc.tensor}
    targets = cfg.target_modules
    return {
        "kind": "lora-adapter",
        "path": str(adapter.path),
        "weights_file": adapter.weights_file.name,
        "base_model": cfg.base_model,
        "r": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "use_rslora": cfg.use_rslora,
        "use_dora": cfg.use_dora,
        "rank_pattern": dict(cfg.rank_pattern),
        "alpha_pattern": dict(cfg.alpha_pattern),
        "target_modules": list(targets) if isinstance(targets, tuple) else targets,
        "modules_to_save": list(cfg.modules_to_save),
        "modules": len(lora),
        "ranks": {str(r): n for r, n in sorted(ranks.items())},
        "scales": {repr(s): n for s, n in sorted(scales.items())},
        "tensors": len(adapter.tensors),
        "tensor_bytes": sum(rec.nbytes for rec in adapter.tensors.values()),
        "dtypes": dict(sorted(dtypes.items())),
        "gguf_adapter": refusal,
    }


def format_adapter_report(report: dict[str, Any]) -> str:
    """:func:`inspect_adapter`'s report as text."""
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} ({n} module{'s' if n != 1 else ''})" for k, n in d.items()) or "none"

    targets = report["target_modules"]
    lines = [
        f"{report['path']}: PEFT LoRA adapter, {report['modules']} LoRA modules, {report['tensors']} tensors, "
        f"{format_bytes(report['tensor_bytes'])} in {report['weights_file']}",
        f"  base model: {report['base_model'] or 'not named (give --base)'}",
        f"  r {report['r']}, lora_alpha {report['lora_alpha']:g}"
        + (", rsLoRA (scale alpha / sqrt(r))" if report["use_rslora"] else " (scale alpha / r)")
        + (", DoRA" if report["use_dora"] else ""),
        f"  ranks: {counts(report['ranks'])}",
        f"  scales: {counts(report['scales'])}",
        "  targets: " + (", ".join(targets) if isinstance(targets, list) else str(targets)),
        "  tensors by dtype: " + ", ".join(f"{k}: {n}" for k, n in report["dtypes"].items()),
    ]
    if report["modules_to_save"]:
        lines.append("  modules_to_save: " + ", ".join(report["modules_to_save"]))
    lines.append("what it can become:")
    lines.append("  convert-bnb BASE --merge-lora ADAPTER --to bf16|nf4|gguf:...   merged into the base")
    refusal = report["gguf_adapter"]
    if refusal is None:
        lines.append("  convert-bnb ADAPTER --to gguf[:f16|f32|bf16|q8_0]           a GGUF LoRA adapter for llama.cpp")
    else:
        lines.append(f"  --to gguf: refused, {refusal['rule']} {refusal['reason']} ({refusal['tensor']}): "
                     "merge it instead")
    return "\n".join(lines)


def _component(name: str, split: set[str]) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in split and len(parts) > 2 else parts[0]


def _components(layers: dict[str, Any], plain: list[str], ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Tensors by the top of their names (``double_blocks``, ``text_encoders.t5xxl``, ``vae``, ``model.layers``):
    4-bit / int8 layers and unquantized tensors by dtype, so a single file holding several models (a diffusion
    checkpoint: transformer, text encoders, VAE) shows what each part is stored as. A first name part is split
    by the second when that names two or more models (names, not block numbers, each with its own tree)."""

    seconds: dict[str, set[str]] = {}
    shallow: set[str] = set()  # first parts with a tensor directly under a second part (``final_layer.linear.weight``)
    for name in ckpt.tensors:
        parts = name.split(".")
        seconds.setdefault(parts[0], set()).add(parts[1] if len(parts) > 1 else "")
        if len(parts) < 4:
            shallow.add(parts[0])
    split = {first for first, sec in seconds.items()
             if first not in shallow and len(sec) >= 2 and not any(x.isdigit() for x in sec)}
    comps: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        key = _component(name, split)
        return comps.setdefault(key, {"name": key, "layers_4bit": 0, "layers_int8": 0, "unquantized": {}})

    for name, layer in layers.items():
        if isinstance(layer, QuantizedLayer):
            entry(name)["layers_4bit"] += 1
        elif isinstance(layer, Int8Layer):
            entry(name)["layers_int8"] += 1
    for name in plain:
        u = entry(name)["unquantized"]
        code = ckpt.tensors[name].dtype.code
        u[code] = u.get(code, 0) + 1
    return [comps[k] for k in sorted(comps)]


def _absmax_of(layer: QuantizedLayer | Int8Layer) -> np.ndarray:


    if isinstance(layer, Int8Layer):
        return np.asarray(layer.scb.array(), dtype=np.float32).reshape(-1)

    return Dequant4Source(layer).absmax()


def absmax_stats(layers: Any, options: InspectOptions | None = None) -> dict[str, Any]:
    """Outlier statistics of each layer's absmax vector (the only data read).

    Args:
        layers: :class:`QuantizedLayer` / :class:`Int8Layer` records.
        options: ``outlier_factor`` and ``flag_ratio``.

    Returns:
        ``{"outlier_factor", "flag_ratio", "layers": [...], "flagged": [names]}``; each layer entry has
        ``name``, ``blocks``, ``min``, ``median``, ``max`` (float32 absmax values as floats),
        ``max_over_median``, ``outlier_blocks`` (count above ``outlier_factor * median``),
        ``outlier_share`` (that count over ``blocks``) and ``flagged``.

    Raises:
        BnbLayerError: BNB-012 when an absmax value is not finite.
    """

    opts = options or InspectOptions()
    out: list[dict[str, Any]] = []
    for layer in layers:
        a = np.abs(_absmax_of(layer).astype(np.float64))
        if a.size == 0:
            continue
        med = float(np.median(a))
        mx = float(a.max())
        ratio = round(mx / med, 4) if med > 0 else None  # None: median 0 (mostly all-zero blocks)
        n_out = int(np.count_nonzero(a > opts.outlier_factor * med))
        out.append({
            "name": layer.name, "blocks": int(a.size), "min": float(a.min()), "median": med, "max": mx,
            "max_over_median": ratio, "outlier_blocks": n_out, "outlier_share": round(n_out / a.size, 6),
            "flagged": bool(mx > 0) if ratio is None else bool(ratio >= opts.flag_ratio),
        })
    return {
        "outlier_factor": opts.outlier_factor, "flag_ratio": opts.flag_ratio, "layers": out,
        "flagged": [e["name"] for e in out if e["flagged"]],
    }



def _ratio(r: float | None) -> str:
    return "inf (median 0)" if r is None else f"{r:.2f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else str(n)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable text of :func:`inspect_checkpoint`'s report."""
    lines = [f"{report['source']}: {len(report['files'])} weight file(s), {report['tensors']} tensors, "
             f"{format_bytes(report['total_bytes'])} of tensor data"]
    hub = report.get("hub")
    if hub is not None:
        lines.insert(0, f"Hub repo {hub['repo']} at {hub['revision'] or 'main'} = commit {hub['commit']}")
    if report["quantized"]:
        lines.append("4-bit layers by settings:")
        for g in report["quantized"]:
            nested = f"nested (blocksize {g['nested_blocksize']}, {g['nested_dtype']})" if g["nested"] else "not nested"
            lines.append(
                f"  {g['quant_type']} blocksize {g['blocksize']}, {nested}, dtype {g['dtype']}, "
                f"storage {g['storage']}, "
                f"absmax {g['absmax_dtype']}: {g['layers']} layers, {_count(g['elements'])} weights, "
                f"{g['bits_per_weight']:.3f} bits/weight"
            )
    if report["int8"]:
        lines.append("LLM.int8 layers:")
        for g in report["int8"]:
            lines.append(f"  weight {g['weight_dtype']}, scale {g['scale_dtype']}: {g['layers']} layers, "
                         f"{_count(g['elements'])} weights, {g['bits_per_weight']:.3f} bits/weight")
    if report["unquantized"]:
        lines.append("unquantized tensors:")
        for u in report["unquantized"]:
            lines.append(f"  {u['dtype']}: {u['tensors']} tensors, {_count(u['elements'])} elements, "
                         f"{format_bytes(u['bytes'])}")
    if not report.get("config", True):
        lines.append("no config.json: a single-file checkpoint (as diffusion tools write them); tensor names are "
                     "kept and no config is written")
        lines.append("parts:")
        for c in report["components"]:
            what = [f"{c['layers_4bit']} 4-bit layers"] if c["layers_4bit"] else []
            what += [f"{c['layers_int8']} int8 layers"] if c["layers_int8"] else []
            what += [f"{n} {code}" for code, n in sorted(c["unquantized"].items())]
            lines.append(f"  {c['name']:<40} {', '.join(what)}")
    lines.append("bytes by kind:")
    for k, v in report["bytes_by_kind"].items():
        lines.append(f"  {k:<22} {v:>14,d}  {format_bytes(v)}")
    lines.append("planned output (tensor data):")
    for to, o in report["outputs"].items():
        if "error" in o:
            lines.append(f"  --to {to:<12} not possible: {o['error']}")
        else:
            lines.append(f"  --to {to:<12} {o['bytes']:>14,d}  {format_bytes(o['bytes'])} in {o['files']} file(s)")
    for n in report.get("notes", []):
        lines.append(f"note: {n}")
    st = report.get("stats")
    if st is not None:
        lines.append(f"absmax statistics (outlier block: absmax > {st['outlier_factor']} x median; "
                     f"flagged layer: max/median >= {st['flag_ratio']}):")
        for e in st["layers"]:
            mark = "  OUTLIER" if e["flagged"] else ""
            lines.append(f"  {e['name']:<52} blocks {e['blocks']:>7}  median {e['median']:.4g}  "
                         f"max {e['max']:.4g}  max/median {_ratio(e['max_over_median'])}  "
                         f"outlier blocks {e['outlier_blocks']} ({100 * e['outlier_share']:.2f}%){mark}")
        lines.append(f"  {len(st['flagged'])} of {len(st['layers'])} layers flagged")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI

DESCRIPTION = ("Show what a bnb checkpoint holds (layers by settings, bytes by kind, planned output sizes) without "
               "reading weight data; --stats reads only the absmax vectors and flags outlier layers.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``convert-bnb inspect``."""

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = """\
examples:
  convert-bnb inspect ./model-bnb-4bit                 layers by settings, bytes by kind, output sizes
  convert-bnb inspect unsloth/llama-3-8b-bnb-4bit --stats --json
"""
    p.add_argument("src", metavar="SRC", help="a .safetensors file, a model directory or a Hub repo id org/name")
    p.add_argument("--revision", default=None, help="with a Hub repo id: branch, tag or commit sha")
    p.add_argument("--stats", action="store_true", help="also read the absmax vectors and flag outlier layers")
    p.add_argument("--outlier-factor", type=float, default=InspectOptions.outlier_factor,
                   help="a block is an outlier when absmax > this x the layer's median (default: %(default)s)")
    p.add_argument("--flag-ratio", type=float, default=InspectOptions.flag_ratio,
                   help="flag a layer when max absmax / median absmax >= this (default: %(default)s)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="shard limit for the planned outputs (default: 5GB)")


def run_command(args: argparse.Namespace) -> int:
    """``convert-bnb inspect``: print the report (``--json``: as JSON)."""

    if args.outlier_factor <= 0 or args.flag_ratio <= 0:
        raise UsageError("--outlier-factor and --flag-ratio must be positive",
                         found=f"{args.outlier_factor}, {args.flag_ratio}")
    src = resolve_source(args.src, args.revision, weights="headers")  # a Hub repo's headers, not its weights
    opts = InspectOptions(args.stats, args.outlier_factor, args.flag_ratio, args.max_shard_size)
    if src.is_adapter:
        if args.stats:
            raise UsageError("--stats reads a 4-bit model's absmax; an adapter has none", path=src.path,
                             found="a PEFT LoRA adapter", hint="inspect the adapter without --stats")
        shards = src.hub.shards if src.hub is not None else None
        with open_adapter(src.path, remote=shards.open if shards is not None else None) as adapter:
            report = inspect_adapter(adapter)
        text = format_adapter_report
    else:
        with src.open() as ckpt:
            report = inspect_checkpoint(ckpt, opts)
        text = format_report
    if src.hub is not None:
        report["hub"] = {"repo": src.hub.repo_id, "revision": src.hub.revision, "commit": src.hub.commit}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(text(report))
    return 0

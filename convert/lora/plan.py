"""Planning LoRA merges: which adapter changes which base tensor, and how (:func:`plan_merge`).

Adapters (:func:`formats.peft.open_adapter`) are checked against the base model's tensor shapes
(LORA-007..LORA-010) and each touched base tensor gets a :class:`~convert.lora.delta.TensorMerge` of its
:class:`~convert.lora.delta.MergeOp` list, in adapter order: a LoRA/DoRA pair on a Linear, fan_in_fan_out or
Embedding weight, or a full tensor (``modules_to_save``, a saved embedding layer, a ``base_layer``
copy) that replaces the tensor and supersedes earlier ops. A full tensor may change only the row
count (a resized vocabulary): :attr:`MergePlan.shape_changes`. The numerics are in :mod:`convert.lora.delta`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from convert.lora.delta import TensorMerge
from convert.lora.ops import MergeOp
from convert.lora.report import MergeStats
from formats.errors import LoraShapeError
from formats.peft import Adapter

__all__ = ["MergePlan", "plan_merge"]


@dataclass
class MergePlan:
    """What a list of adapters does to a base model.

    Attributes:
        tensors: base tensor name -> :class:`TensorMerge`, for every tensor an adapter touches.
        shape_changes: tensor -> (base shape, merged shape) where an adapter's full tensor has another
            shape (a resized vocabulary).
        ignored: (adapter, key, reason) for adapter keys read but not merged.
        adapters: the adapters, in order.
    """

    tensors: dict[str, TensorMerge]
    shape_changes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    ignored: list[tuple[str, str, str]]
    adapters: list[Adapter]

    def get(self, name: str) -> TensorMerge | None:
        """The merge of tensor ``name``, or None when no adapter touches it."""
        return self.tensors.get(name)

    def shape_of(self, name: str, base_shape: Sequence[int]) -> tuple[int, ...]:
        """The tensor's shape after the merge."""
        tm = self.tensors.get(name)
        return tm.shape if tm is not None else tuple(base_shape)

    def new_stats(self) -> MergeStats:
        """A :class:`MergeStats` with this plan's shape changes and notes filled in."""
        stats = MergeStats()
        for tm in self.tensors.values():  # report rows in plan order, whatever order chunks finish in
            for i, op in enumerate(tm.ops):
                stats._get(op, i)
        stats.shape_changes = dict(self.shape_changes)
        for adapter, key, reason in self.ignored:
            stats.notes.append(f"{adapter}: {key}: {reason}")
        for ad in self.adapters:
            if ad.config.target_modules == "all-linear":
                stats.notes.append(
                    f"{ad.path}: target_modules='all-linear': the modules with LoRA weights are "
                    "merged; completeness against the config cannot be checked"
                )
        return stats

    def close(self) -> None:
        """Close every adapter."""
        for ad in self.adapters:
            ad.close()


def plan_merge(adapters: Sequence[Adapter], base: Mapping[str, Sequence[int]]) -> MergePlan:
    """Check adapters against a base model and plan the per-tensor merges.

    Args:
        adapters: opened adapters (:func:`formats.peft.open_adapter`), applied in this order.
        base: base tensor name -> shape (elements), e.g. from the dequantization plan.

    Returns:
        a :class:`MergePlan`.

    Raises:
        AdapterError: LORA-007..LORA-010: a key matching no base tensor, a targeted module without
            weights, LoRA weights on an untargeted module, shapes that do not fit the base.
    """
    shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in base.items()}
    ops: dict[str, list[MergeOp]] = {}
    ignored: list[tuple[str, str, str]] = []
    for ad in adapters:
        ad.check_against(shapes)
        for key, reason in ad.ignored:
            ignored.append((str(ad.path), key, reason))
        cfg = ad.config
        for mod in ad.modules.values():
            for param, rec in mod.full.items():
                name = f"{mod.module}.{param}"
                lst = ops.setdefault(name, [])
                for old in lst:
                    ignored.append(
                        (old.adapter, ", ".join(old.keys), f"superseded by the full tensor of '{ad.path}'")
                    )
                lst.clear()
                lst.append(
                    MergeOp(
                        name,
                        str(ad.path),
                        "replace",
                        mod.full_kind[param],
                        "linear",
                        rec.shape,
                        replacement=rec,
                        keys=(rec.name,),
                    )
                )
            if not mod.has_lora:
                continue
            name = f"{mod.module}.weight"
            lst = ops.setdefault(name, [])
            cur = lst[-1].shape if lst else shapes[name]
            a, b = mod.lora_A, mod.lora_B
            assert a is not None and b is not None
            layout = "embedding" if mod.embedding else ("fan_in_fan_out" if cfg.fan_in_fan_out else "linear")
            want = (a.shape[1], b.shape[0]) if layout != "linear" else (b.shape[0], a.shape[1])
            if cur != want:
                what = {
                    "linear": "[out, in] = [B rows, A columns]",
                    "fan_in_fan_out": "[in, out] (fan_in_fan_out)",
                    "embedding": "[num_embeddings, dim] = [A columns, B rows]",
                }[layout]
                raise LoraShapeError(
                    f"LoRA weights do not fit the base tensor {what}",
                    path=ad.weights_file,
                    tensor=a.name,
                    expected=list(cur),
                    found=list(want),
                    hint="check fan_in_fan_out in adapter_config.json"
                    if sorted(cur) == sorted(want)
                    else "is this adapter for another model?",
                )
            keys = tuple(r.name for r in (a, b, mod.magnitude) if r is not None)
            lst.append(
                MergeOp(
                    name,
                    str(ad.path),
                    "dora" if mod.magnitude is not None else "lora",
                    "lora",
                    layout,
                    cur,
                    rank=a.shape[0],
                    alpha=cfg.alpha_for(mod.module),
                    scale=cfg.scale_for(mod.module),
                    lora_A=a,
                    lora_B=b,
                    magnitude=mod.magnitude,
                    keys=keys,
                )
            )
    tensors: dict[str, TensorMerge] = {}
    changes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, lst in ops.items():
        tm = TensorMerge(name, shapes[name], lst)
        tensors[name] = tm
        if tm.shape != shapes[name]:
            if len(tm.shape) != len(shapes[name]) or tm.shape[1:] != shapes[name][1:]:
                op = lst[0]
                raise LoraShapeError(
                    "adapter's full tensor has another shape than the base tensor, beyond the row count",
                    path=op.adapter,
                    tensor=op.keys[0],
                    expected=list(shapes[name]),
                    found=list(tm.shape),
                    hint="only the vocabulary (rows) may be resized",
                )
            changes[name] = (shapes[name], tm.shape)
    return MergePlan(tensors, changes, ignored, list(adapters))

"""LoRA merges in a plan: ``--merge-lora ADAPTER`` (repeatable), ``--report`` and ``--original BASE16``.

:func:`apply_lora` runs after the dequantization plan is made (:func:`convert.job.convert`, step 4):
every planned tensor an adapter touches gets its source wrapped in a
:class:`LoraSource`, which produces whole rows: it asks the wrapped source for the dequantized base
rows (in the output dtype), merges them with :meth:`convert.lora.delta.TensorMerge.merge_rows` and hands the
merged rows on. The chunk unit becomes a multiple of both the layer's blocksize and whole rows (any row
range of the product has the same bits: :func:`convert.lora.delta.exact_product`), so the pipeline's
memory cap and threading apply to the merge unchanged.

A tensor whose rows the adapter resizes (a resized vocabulary) is taken from the adapter, its new
shape goes into the plan, and ``vocab_size`` in the output ``config.json`` is updated.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convert.dequant.products import PIECE
from convert.lora.delta import ROW_ALIGN, TensorMerge
from convert.lora.plan import MergePlan, plan_merge
from convert.lora.report import MergeStats
from convert.stream.plan import Plan, PlannedTensor
from convert.stream.sources import Source
from formats.bnb import TensorLike
from formats.checkpoint import Checkpoint, open_checkpoint
from formats.dtypes import DType
from formats.errors import LoraShapeError, UsageError
from formats.peft import open_adapter

__all__ = ["LoraRun", "LoraSource", "apply_lora"]


class LoraSource(Source):
    """A planned tensor with one or more adapters merged in, produced in whole-row chunks.

    Args:
        inner: the source of the dequantized (or cast) base tensor.
        merge: the tensor's :class:`~convert.lora.delta.TensorMerge`.
        stats: the run's shared report accumulator, or None when no report is asked for (nothing is
            summed then).
        original: the tensor in the original 16-bit model (for the quantization error), or None.
    """

    writes_in_place = True

    def __init__(self, inner: Source, merge: TensorMerge, stats: MergeStats | None, original: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.merge = merge
        self.name = inner.name
        self.shared_stats = stats
        self.original = original
        self.cols = math.prod(merge.shape[1:]) if len(merge.shape) > 1 else 1
        self.numel = math.prod(merge.shape)
        # whole rows; any row range gives the same bits (exact_product), so a small cap still leaves room
        # for two workers
        self.unit = self.numel if merge.whole_tensor else math.lcm(inner.unit, self.cols)
        adapter_bytes = sum(
            r.nbytes for op in merge.ops for r in (op.lora_A, op.lora_B, op.magnitude, op.replacement) if r is not None
        )
        self.in_nbytes = (inner.in_nbytes if merge.needs_base else 0) + adapter_bytes
        kinds = "+".join(dict.fromkeys(op.kind if op.kind != "replace" else op.source for op in merge.ops))
        self.kind = (f"{inner.kind} + {kinds}" if merge.needs_base else f"{kinds} (from the adapter)")
        self.stats = inner.stats  # fp16 overflow counts of the base pass through
        self._stats_lock = threading.Lock()
        # row ranges already counted in the report: a writer may read the tensor more than once
        # (--to nf4 reads nested layers in a pre-pass, then again for the codes)
        self._counted: list[tuple[int, int]] = []

    def produce(self, start: int, stop: int, dtype: DType) -> np.ndarray:
        out = np.empty(stop - start, dtype=dtype.numpy)
        self.produce_into(start, stop, dtype, out)
        return out

    def produce_into(self, start: int, stop: int, dtype: DType, out: np.ndarray) -> None:
        """Merged elements [start, stop) (whole rows) into ``out`` (``dtype``, flat).

        When the merged tensor has the base's shape (every merge but a resized vocabulary), the base is
        dequantized into ``out`` itself and merged there (each piece read before it is written:
        :meth:`convert.lora.delta.TensorMerge.merge_rows`), :meth:`_run_rows` rows at a time: no base array
        for the chunk (rank 16 on the bench model at 512 MiB: 0.75x the peak RSS, the same time).
        """
        cols = self.cols
        if start % cols or stop % cols:
            raise LoraShapeError("merge chunks must hold whole rows", tensor=self.name,
                                 expected=f"multiples of {cols}", found=[start, stop])
        r0, r1 = start // cols, stop // cols
        rows_out = out.reshape(r1 - r0, -1)
        merge = self.merge
        loss = np.zeros(2, np.int64) if dtype.name == "float16" else None  # fp16 overflow / flush counts
        if not (merge.needs_base and merge.shape == merge.base_shape):  # a resized tensor, or none read
            base = None
            if merge.needs_base:
                base = self.inner.produce(start, stop, dtype).reshape((r1 - r0, *merge.base_shape[1:]))
            self._merge_rows(base, r0, r1, dtype, rows_out, loss)
        else:
            run = self._run_rows()
            cuts = [r0, *range((r0 // run + 1) * run, r1, run), r1]  # runs on a grid from row 0 (sgemm blocks)
            for a, b in itertools.pairwise(cuts):
                dst = rows_out[a - r0 : b - r0]
                self.inner.produce_into(a * cols, b * cols, dtype, dst.reshape(-1))
                self._merge_rows(dst.reshape((b - a, *merge.base_shape[1:])), a, b, dtype, dst, loss)
        self._count_f16(loss)

    def _run_rows(self) -> int:
        """Rows merged at once when the base is dequantized in place: whole chunk units and whole
        :data:`~convert.lora.delta.ROW_ALIGN`-row product blocks, at least ``8 * PIECE`` elements (4 MiB of bf16:
        in L3 when the merge reads it; runs of one ``PIECE`` paid more in per-call overhead than they
        saved: 1.17x the CPU in a paired run); all rows for a merge that needs them at once."""
        if self.merge.whole_tensor:
            return self.merge.shape[0]
        rows = math.lcm(self.unit // self.cols, ROW_ALIGN)
        return rows * max(1, -(-8 * PIECE // (rows * self.cols)))

    def _merge_rows(self, base: np.ndarray | None, r0: int, r1: int, dtype: DType, out: np.ndarray,
                    loss: np.ndarray | None) -> None:
        """Merge rows [r0, r1) of ``base`` (which may be ``out`` itself) into ``out`` (``[r1 - r0, cols]``),
        adding to the report the rows not counted yet (:meth:`_claim`) when a report is asked for."""
        if self.shared_stats is None:  # no report: nothing to count or compare
            self.merge.merge_rows(base, r0, r1, dtype.numpy, f16_loss=loss, out=out)
            return
        orig = None
        if self.original is not None:
            orig = self.original.array()[r0:r1]
        for a, b, new in self._claim(r0, r1):
            local = MergeStats() if new else None
            rows = slice(a - r0, b - r0)
            self.merge.merge_rows(None if base is None else base[rows], a, b, dtype.numpy, local,
                                  None if orig is None else orig[rows], f16_loss=loss, out=out[rows])
            if local is not None:
                with self._stats_lock:
                    self.shared_stats.add(local)

    def _count_f16(self, loss: np.ndarray | None) -> None:
        """Add the merge's own fp16 roundings' losses to :attr:`stats` (shared with the base's source, which
        counts the base's rounding: a value that overflowed there is inf and not counted again here)."""
        if loss is not None:
            self.inner._add_stats(loss)

    def _claim(self, r0: int, r1: int) -> list[tuple[int, int, bool]]:
        """Split rows [r0, r1) into runs not yet counted in the report (claimed now) and runs counted.

        Every element is counted once, whatever the number of passes a writer makes over the tensor.
        Run boundaries are earlier chunk boundaries, so each run is a whole number of chunk units.

        Returns:
            ``(start, stop, new)`` row runs covering [r0, r1) in order.
        """
        out: list[tuple[int, int, bool]] = []
        with self._stats_lock:
            pos = r0
            for a, b in self._counted:
                if b <= pos or a >= r1:
                    continue
                if a > pos:
                    out.append((pos, a, True))
                out.append((max(a, pos), min(b, r1), False))
                pos = min(b, r1)
            if pos < r1:
                out.append((pos, r1, True))
            merged: list[tuple[int, int]] = []
            for a, b in sorted(self._counted + [(a, b) for a, b, new in out if new]):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            self._counted = merged
        return out

    def reads(self) -> list[Source]:
        return [self.inner] if self.merge.needs_base else []

    def release(self, start: int, stop: int) -> None:
        if self.merge.needs_base:
            self.inner.release(start, stop)
        if self.original is not None:
            item = self.original.dtype.itemsize
            self.original.release(start * item, stop * item)

    def finish(self) -> None:
        self.inner.finish()
        self.merge.release()

    def inputs(self) -> list[TensorLike] | None:
        """The base checkpoint's tensors read (the adapters and ``--original`` are other inputs)."""
        return self.inner.inputs() if self.merge.needs_base else []


@dataclass
class LoraRun:
    """The adapters merged into one plan, and the report they fill while it is written.

    Attributes:
        merge: the merge plan (opened adapters).
        stats: the report accumulator, or None when no report is asked for.
        original: the opened ``--original`` model, or None.
    """

    merge: MergePlan
    stats: MergeStats | None
    original: Checkpoint | None

    def report(self, path: Path | None = None) -> dict[str, Any] | None:
        """The merge report (after writing), also written to ``path`` when given; None when the run
        computed no figures (``apply_lora(..., stats=False)``)."""
        if self.stats is None:
            return None
        data = self.stats.to_json()
        data["adapters"] = [str(ad.path) for ad in self.merge.adapters]
        if path is not None:
            path.write_text(json.dumps(data, indent=2) + "\n")
        return data

    def held_nbytes(self, in_flight: int) -> int:
        """Bytes the merges of ``in_flight`` tensors written at once can hold (the largest ones:
        :meth:`convert.lora.delta.TensorMerge.held_nbytes`), which the memory cap keeps free of chunks."""
        sizes = sorted((tm.held_nbytes() for tm in self.merge.tensors.values()), reverse=True)
        return sum(sizes[:in_flight])

    def close(self) -> None:
        """Close the adapters and the original model."""
        self.merge.close()
        if self.original is not None:
            self.original.close()


def apply_lora(plan: Plan, adapter_paths: tuple[Path, ...] | list[Path], original_path: Path | None = None,
               stats: bool = True) -> LoraRun:
    """Wrap the source of every planned tensor the adapters touch in a :class:`LoraSource` (in place).

    Args:
        plan: the dequantization plan; its tensors, notes and config are edited.
        adapter_paths: PEFT adapter directories, merged in this order.
        original_path: the 16-bit model before quantization (the report's quantization error), or None.
        stats: compute the report's figures (norms, quantization error) while the plan is written; False
            skips every sum (they cost more than the merge's matrix products).

    Returns:
        the :class:`LoraRun` (close it when the plan has been written).

    Raises:
        UsageError: a non-float output tensor is touched; ``--original`` matches none of the merged tensors.
        AdapterError, UnsupportedError: the adapters do not fit the model (LORA-xxx).
    """
    adapters = []
    try:
        for p in adapter_paths:
            adapters.append(open_adapter(p))
        merge = plan_merge(adapters, {t.name: t.shape for t in plan.tensors})
    except BaseException:
        for ad in adapters:
            ad.close()
        raise
    acc = merge.new_stats()
    original = open_checkpoint(original_path) if original_path is not None else None
    try:
        _wrap(plan, merge, acc, stats, original, original_path)
    except BaseException:
        merge.close()
        if original is not None:
            original.close()
        raise
    plan.notes.append(
        f"merging {len(adapters)} adapter(s) into {len(merge.tensors)} tensor(s): "
        + ", ".join(str(p) for p in adapter_paths)
    )
    return LoraRun(merge, acc if stats else None, original)


def _wrap(plan: Plan, merge: MergePlan, stats: MergeStats, with_stats: bool, original: Checkpoint | None,
          original_path: Path | None) -> None:
    wrapped: list[tuple[int, PlannedTensor, TensorMerge]] = []
    origs: dict[str, Any] = {}
    unmatched: list[str] = []
    for i, t in enumerate(plan.tensors):
        tm = merge.get(t.name)
        if tm is None:
            continue
        if not t.dtype.is_float:
            raise UsageError("an adapter touches a tensor that is not floating point", tensor=t.name,
                             found=t.dtype.code)
        wrapped.append((i, t, tm))
        if original is not None and tm.needs_base and any(op.kind != "replace" for op in tm.ops):
            rec = original.tensors.get(t.name)
            if rec is None or rec.shape != tuple(tm.base_shape) or not rec.dtype.is_float:
                unmatched.append(t.name)
                stats.notes.append(f"--original has no matching '{t.name}': no quantization error for it")
            else:
                origs[t.name] = rec
    if original is not None and original_path is not None:
        _check_original(original_path, original, plan, unmatched, len(unmatched) + len(origs))
    for i, t, tm in wrapped:
        src = LoraSource(t.source, tm, stats if with_stats else None, origs.get(t.name) if with_stats else None)
        plan.tensors[i] = PlannedTensor(t.name, t.dtype, tm.shape, src)
    if merge.shape_changes and plan.config is not None:
        _update_vocab(plan, merge)
    for name, (a, b) in merge.shape_changes.items():
        plan.notes.append(f"{name}: shape {list(a)} -> {list(b)}, taken from the adapter (resized vocabulary)")
    plan.notes.extend(f"LoRA: {n}" for n in stats.notes)


def _check_original(path: Path, original: Checkpoint, plan: Plan, unmatched: list[str], wanted: int) -> None:
    """Make a ``--original`` that does not fit the model visible.

    Nothing matches (another model, or names from another library): an error before anything is
    written. Some tensors do not match: a plan note (the report's quantization-error column will be
    empty for them).

    Raises:
        UsageError: none of the merged tensors has a float tensor of the same name and shape in BASE16.
    """
    if not unmatched:
        return
    sample = unmatched[0]
    rec = original.tensors.get(sample)
    found = (f"'{sample}' is {list(rec.shape)} {rec.dtype.code} there" if rec is not None
             else f"no tensor named '{sample}' there")
    if len(unmatched) == wanted:
        raise UsageError(
            f"--original {path} matches none of the {wanted} merged tensors",
            expected="float tensors with the merged tensors' names and base shapes (the 16-bit model "
            "the input was quantized from)", found=found,
            hint="give the unquantized model this checkpoint was made from, or leave --original out",
        )
    plan.notes.append(f"--original: {len(unmatched)} of {wanted} merged tensors have no matching tensor in {path} "
                      f"(e.g. {found}); their quantization error is left out of the report")


def _update_vocab(plan: Plan, merge: MergePlan) -> None:
    assert plan.config is not None
    for _name, (a, b) in merge.shape_changes.items():
        for cfg in (plan.config, plan.config.get("text_config")):
            if isinstance(cfg, dict) and cfg.get("vocab_size") == a[0] and a[0] != b[0]:
                cfg["vocab_size"] = b[0]
                plan.notes.append(f"config.json: vocab_size {a[0]} -> {b[0]}")

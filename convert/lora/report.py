"""The LoRA merge report: per tensor and adapter op, ``||B A|| * scale``, ``||W||``, their ratio and the
quantization error ``||W16 - dequant(W4)||`` (``--report merge.json``, ``--original``, ``--json``).

:class:`MergeStats` accumulates the sums of squares :meth:`convert.lora.delta.TensorMerge.merge_rows` feeds it
chunk by chunk (:func:`sum_sq`, float32 per chunk: report precision); :func:`format_table` is the
fixed-width table the CLI prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from convert.lora.ops import MergeOp

__all__ = ["MergeStats", "format_table", "sum_sq"]


def sum_sq(x: np.ndarray) -> float:
    """``sum(x ** 2)`` of a float array as a Python float, accumulated in float32 (``np.einsum``).

    The report's norms only need 3-4 digits: a float32 sum of products over one chunk (at most a few
    million values; NumPy's einsum sums in SIMD lanes) is within 1e-6 relative of the float64 sum on
    4M normal values (measured 5e-7), and the per-chunk sums are added as Python floats. That is
    about 8x cheaper than squaring into float64 first.

    Args:
        x: a float array (bf16 and fp16 are upcast to float32 exactly).

    Returns:
        the sum of squares.
    """
    flat: npt.NDArray[np.float32] = np.asarray(x, dtype=np.float32).reshape(-1)
    return float(np.einsum("i,i->", flat, flat))


@dataclass
class _OpStats:
    delta_sq: float = 0.0
    base_sq: float = 0.0
    quant_err_sq: float = 0.0
    has_original: bool = False


class MergeStats:
    """Per-tensor, per-op figures for the merge report, accumulated over row chunks.

    For each op: ``||B A|| * scale`` (Frobenius norm of the fp32 delta), ``||W||`` of the tensor the
    op is applied to, their ratio, and, when the original 16-bit weights are given, the quantization
    error ``||W16 - dequant(W4)||`` of the base.
    """

    def __init__(self) -> None:
        self._ops: dict[tuple[str, int], tuple[MergeOp, _OpStats]] = {}
        self.shape_changes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.notes: list[str] = []

    def _get(self, op: MergeOp, index: int) -> _OpStats:
        key = (op.tensor, index)
        if key not in self._ops:
            self._ops[key] = (op, _OpStats())
        return self._ops[key][1]

    def add(self, other: MergeStats) -> None:
        """Add another accumulator's figures (one chunk's) to this one."""
        for key, (op, st) in other._ops.items():
            mine = self._get(op, key[1])
            mine.delta_sq += st.delta_sq
            mine.base_sq += st.base_sq
            mine.quant_err_sq += st.quant_err_sq
            mine.has_original = mine.has_original or st.has_original

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (tensor, op): tensor, adapter, kind, source, rank, alpha, scale, delta_norm,
        base_norm, ratio, quant_error (None without an original), quant_error_ratio, shape."""
        out = []
        for (_name, _i), (op, st) in self._ops.items():
            delta = math.sqrt(st.delta_sq)
            base = math.sqrt(st.base_sq)
            qerr = math.sqrt(st.quant_err_sq) if st.has_original else None
            out.append(
                {
                    "tensor": op.tensor,
                    "adapter": op.adapter,
                    "kind": op.kind,
                    "source": op.source,
                    "rank": op.rank,
                    "lora_alpha": op.alpha,
                    "scale": op.scale,
                    "delta_norm": delta if op.kind != "replace" else None,
                    "base_norm": base,
                    "ratio": (delta / base if base else None) if op.kind != "replace" else None,
                    "quant_error": qerr,
                    "quant_error_over_delta": (qerr / delta if qerr is not None and delta else None),
                    "shape": list(op.shape),
                }
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready object (``--report merge.json``)."""
        return {
            "tensors": self.rows(),
            "shape_changes": {
                k: {"base": list(a), "merged": list(b)} for k, (a, b) in self.shape_changes.items()
            },
            "notes": list(self.notes),
        }


def format_table(report: dict[str, Any], limit: int | None = None) -> str:
    """A short fixed-width table of a merge report (:meth:`MergeStats.to_json`; the CLI prints it)."""
    rows = report["tensors"]
    lines = [
        f"{'tensor':<48} {'kind':<8} {'r':>4} {'scale':>8} {'|BA|*s':>10} {'|W|':>10} {'ratio':>9} "
        f"{'|W16-W4|':>10}"
    ]
    for row in rows[:limit] if limit else rows:

        def num(v: Any, w: int = 10) -> str:
            return f"{v:>{w}.4g}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        lines.append(
            f"{row['tensor'][-48:]:<48} {row['kind']:<8} {row['rank']:>4} {num(row['scale'], 8)} "
            f"{num(row['delta_norm'])} {num(row['base_norm'])} {num(row['ratio'], 9)} "
            f"{num(row['quant_error'])}"
        )
    if limit and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in the JSON report")
    for name, change in report["shape_changes"].items():
        lines.append(f"{name}: shape {change['base']} -> {change['merged']} (taken from the adapter)")
    return "\n".join(lines)

"""What one adapter does to one base tensor (:class:`MergeOp`): the record the merge plan
(:mod:`convert.lora.plan`) makes, the delta numerics (:mod:`convert.lora.delta`) apply and the report
(:mod:`convert.lora.report`) measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from formats.checkpoint import TensorRecord

__all__ = ["MergeOp"]


@dataclass(frozen=True)
class MergeOp:
    """One adapter's action on one base tensor.

    Attributes:
        tensor: the base tensor name.
        adapter: the adapter directory (as given).
        kind: ``"lora"``, ``"dora"`` or ``"replace"``.
        source: ``"lora"``, ``"modules_to_save"``, ``"saved_layer"`` or ``"base_layer"``.
        layout: ``"linear"`` (W ``[out, in]``), ``"fan_in_fan_out"`` (W ``[in, out]``) or
            ``"embedding"`` (W ``[num_embeddings, dim]``, delta rounded first).
        shape: the tensor's shape after this op.
        rank: r (0 for replace).
        alpha: lora_alpha (0 for replace).
        scale: the PEFT scaling (a Python double; 0 for replace).
        lora_A: ``[r, in]`` record (``[r, num_embeddings]`` for embeddings).
        lora_B: ``[out, r]`` record (``[dim, r]`` for embeddings).
        magnitude: DoRA ``[out]`` record.
        replacement: the full tensor (replace).
        keys: the adapter keys used.
    """

    tensor: str
    adapter: str
    kind: str
    source: str
    layout: str
    shape: tuple[int, ...]
    rank: int = 0
    alpha: float = 0.0
    scale: float = 0.0
    lora_A: TensorRecord | None = field(default=None, repr=False)
    lora_B: TensorRecord | None = field(default=None, repr=False)
    magnitude: TensorRecord | None = field(default=None, repr=False)
    replacement: TensorRecord | None = field(default=None, repr=False)
    keys: tuple[str, ...] = ()

    @property
    def transposed(self) -> bool:
        """The delta is ``(B @ A).T`` (fan_in_fan_out and embeddings)."""
        return self.layout != "linear"

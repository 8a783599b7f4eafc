"""Merging PEFT LoRA adapters into dequantized weights, streamed by row ranges.

The numerics are PEFT's ``merge_and_unload()`` (``safe_merge=False``) on a base model whose weights
are the dequantized tensors in the output dtype (bnb-format.md section 5), with the adapter weights in
fp32 (PEFT's default ``autocast_adapter_dtype=True``; BF16/F16 adapter tensors are upcast exactly):

==============  ===========================================================================================
Linear          ``W' = round(fp32(W) + fp32(B @ A) * fp32(scale))``: one rounding (``lora.Linear.merge``
                and ``get_delta_weight``: ``(B @ A) * scaling``, then ``weight += delta``).
fan_in_fan_out  the same with the delta transposed: ``W'[in, out] = round(W + (B @ A).T * scale)``.
Embedding       ``W' = round(W + round(fp32(B @ A).T * scale))``: PEFT's ``lora.Embedding.merge`` casts the
                delta to the weight dtype first (``get_delta_weight(...).to(orig_dtype)``), so two roundings.
DoRA            ``V = fp32(W) + delta``, ``n = ||V||_2`` per output feature, ``W' = round((m / n) * V)``
                (``DoraLinearVariant.merge_unsafe``; ``n`` over the input axis, i.e. per row of ``W``, or per
                column when ``fan_in_fan_out``).
full tensor     ``W' = round(T)``: modules_to_save, an embedding layer PEFT saved (resized vocabulary) or
                a ``base_layer`` copy replaces the base tensor whole (its shape may differ: reported).
==============  ===========================================================================================

``round`` is one round-to-nearest-even to the output dtype (:func:`convert.dequant.kernels.round_float32`);
``scale`` is ``lora_alpha / r`` or ``lora_alpha / sqrt(r)`` (rsLoRA), rounded to fp32 by the multiply
as torch does for a Python scalar. Several adapters are applied in order, each rounding to the
output dtype, as merging one adapter and then loading the next onto the merged model does.

``B @ A`` is :func:`exact_product`: exact float64 products summed over the rank in a fixed order and
rounded once to fp32 (computed with a float64 matmul and an error bound that certifies the rounding),
the same bits on every CPU, BLAS kernel, thread count and chunking. PEFT's
sgemm accumulates in fp32 and differs from it by one fp32 ulp in many delta values, which moves 2 to 5
merged bf16 values per million by one ulp (docs/lora.md). The DoRA norm follows torch's fp32 summation
order (:func:`dora_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from convert.dequant.kernels import round_float32
from convert.dequant.kernels_f16 import count_f16_loss
from convert.dequant.products import BF16, PIECE
from convert.lora.ops import MergeOp
from convert.lora.report import MergeStats, _OpStats, sum_sq
from formats.checkpoint import TensorRecord
from formats.errors import LoraShapeError, NonFiniteAdapterError
from formats.peft import check_finite

__all__ = [
    "ROW_ALIGN",
    "MergeOp",
    "TensorMerge",
    "dora_norm",
    "exact_product",
    "lora_delta_rows",
]

#: float64 elements of :func:`exact_product`'s blocks (512 KiB).
_BLOCK_ELEMENTS = 1 << 16
#: Rows of ``B @ A`` per :func:`exact_product` call (its float64 blocks stay in cache; any value gives the same bits).
ROW_ALIGN = 64


def _dtype(name: np.dtype | str) -> np.dtype:
    return BF16 if str(name) == "bfloat16" else np.dtype(name)


def _f32(rec: TensorRecord) -> npt.NDArray[np.float32]:
    return np.asarray(rec.array(), dtype=np.float32)


def lora_delta_rows(
    lora_A: npt.NDArray[np.float32],
    lora_B: npt.NDArray[np.float32],
    scale: float,
    start: int,
    stop: int,
    transposed: bool = False,
    right64: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None,
) -> npt.NDArray[np.float32]:
    """Rows [start, stop) of the LoRA delta ``(B @ A) * scale`` (or of ``(B @ A).T * scale``).

    PEFT ``lora.Linear.get_delta_weight`` / ``lora.Embedding.get_delta_weight`` for fp32 adapter weights
    with the product exact (:func:`exact_product`), then one fp32 multiply by ``fp32(scale)``; the bits
    do not depend on ``start``/``stop``.

    Args:
        lora_A: ``float32[r, in]``.
        lora_B: ``float32[out, r]``.
        scale: the LoRA scaling.
        start, stop: row range of the delta (rows of ``B @ A``, or of its transpose).
        transposed: return rows of ``(B @ A).T`` (``float32[in, out]`` layout).

    Returns:
        ``float32[stop - start, in]`` (``[stop - start, out]`` when transposed), C-contiguous.
    """
    parts = [block for _, block in product_blocks(lora_A, lora_B, start, stop, transposed, right64=right64)]
    out = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))
    out *= np.float32(scale)
    return out


def exact_product(lora_A: npt.NDArray[np.float32], lora_B: npt.NDArray[np.float32], rows: slice,
                  transposed: bool = False, out: npt.NDArray[np.float32] | None = None,
                  right64: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None,
                  ) -> npt.NDArray[np.float32]:
    """Rows ``rows`` of ``B @ A`` (or of ``(B @ A).T``) with the same bits on every CPU.

    Each element is defined as ``fp32(S)``, ``S = sum_k fp64(B[i, k]) * fp64(A[k, j])`` added in the order
    ``k = 0, 1, ...`` in float64 (each product of two float32 values is exact there) and rounded once to
    float32. It is computed without depending on that order: ``D``, a float64 matmul (any BLAS, any
    summation order), and ``S`` are both within ``r * 2^-53 * M`` of the exact sum, ``M = |B| @ |A|``, and
    ``M <= M_i = |B[i]| @ max_j |A[:, j]|`` per row; so where ``D - r * 2^-50 * M_i`` and
    ``D + r * 2^-50 * M_i`` round to the same float32 (rounding is monotonic), that is ``fp32(S)``, and the
    few elements where they do not (cancelling sums, float32 ties) are summed in the fixed order
    (:func:`_ordered_sums`). The result differs from an sgemm's (PEFT's ``B @ A``, float32 accumulation)
    by one float32 ulp in many elements, and moves 2 to 5 merged bf16 values per million by one ulp
    (docs/lora.md).

    Args:
        lora_A: ``float32[r, in]``.
        lora_B: ``float32[out, r]``.
        rows: the rows wanted (of ``B @ A``; of its transpose when ``transposed``), step 1.
        transposed: rows of ``(B @ A).T``, ``float32[in, out]``.
        out: optional C-contiguous float32 array of the result's shape to write it into.
        right64: the right operand (``A``, or ``B.T`` when ``transposed``) in float64 and the largest
            absolute value of each of its rows, when the caller has them (:func:`product_blocks`).

    Returns:
        ``float32[len(rows), cols]``, C-contiguous.
    """
    if transposed:  # row j of the transpose: sum_k A[k, j] * B[:, k]
        left = lora_A.T[rows]
        right = lora_B.T
    else:
        left, right = lora_B[rows], lora_A
    r64, r_max = right64 if right64 is not None else right_operand(lora_A, lora_B, transposed)
    l64 = left.astype(np.float64)  # exact
    n, cols = l64.shape[0], r64.shape[1]
    out = np.empty((n, cols), dtype=np.float32) if out is None else out
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    d_buf, t_buf = np.empty((2, min(step, n), cols), dtype=np.float64)
    lo, hi = np.empty((2, min(step, n), cols), dtype=np.float32)
    # a bound of |D - S| per row: 4x (2 r 2^-53) sum_k |left[i, k]| max_j |right[k, j]| >= 4x (2 r 2^-53) M[i, j]
    width = (np.abs(l64) @ r_max) * (right.shape[0] * 2.0**-50)
    for i in range(0, n, step):  # float64 blocks of at most 512 KiB: in cache, and small beside the memory cap
        m = min(step, n - i)
        rows64, d, t, lo_m, hi_m, w = l64[i : i + m], d_buf[:m], t_buf[:m], lo[:m], hi[:m], width[i : i + m, None]
        np.matmul(rows64, r64, out=d)
        np.copyto(hi_m, np.add(d, w, out=t), casting="same_kind")
        np.copyto(lo_m, np.subtract(d, w, out=t), casting="same_kind")
        o = out[i : i + m]
        np.copyto(o, lo_m)
        near = np.nonzero(lo_m.view(np.uint32) != hi_m.view(np.uint32))  # bits: -0.0 and +0.0 differ too
        if near[0].size:
            o[near] = _ordered_sums(rows64[near[0]], r64[:, near[1]])
    return out


def right_operand(lora_A: npt.NDArray[np.float32], lora_B: npt.NDArray[np.float32], transposed: bool = False,
                  ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """:func:`exact_product`'s right operand (``A``, or ``B.T`` when ``transposed``: ``[r, cols]``) in
    float64, and the largest ``|value|`` of each of its rows (``[r]``): made once per adapter tensor."""
    a64 = np.asarray(lora_B.T if transposed else lora_A, dtype=np.float64)
    return a64, np.abs(a64).max(axis=1, initial=0.0)


def _ordered_sums(left: npt.NDArray[np.float64], right: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
    """``fp32(sum_k left[e, k] * right[k, e])`` for each element ``e``, the terms added in the order
    ``k = 0, 1, ...`` in float64 (element-wise NumPy operations: no BLAS, no fused multiply-add)."""
    acc = np.zeros(left.shape[0], dtype=np.float64)
    for k in range(left.shape[1]):
        acc += left[:, k] * right[k]
    return acc.astype(np.float32)


def product_blocks(
    lora_A: npt.NDArray[np.float32],
    lora_B: npt.NDArray[np.float32],
    start: int,
    stop: int,
    transposed: bool = False,
    scratch: npt.NDArray[np.float32] | None = None,
    right64: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None,
) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
    """Rows [start, stop) of ``B @ A`` (or of ``(B @ A).T``), unscaled, by :func:`exact_product` in blocks
    of at most :data:`ROW_ALIGN` rows (cache-sized float64 sums; the bits do not depend on the blocks).

    Args:
        scratch: optional C-contiguous ``float32[ROW_ALIGN, cols]`` the blocks are computed into (each
            block overwrites the one before; no page faults of a fresh megabyte per block).

    Yields:
        ``(row, block)``: ``block`` is ``float32[k, cols]`` holding rows ``[row, row + k)``, the blocks in
        order and covering [start, stop) once (the caller may overwrite it).
    """
    if right64 is None:
        right64 = right_operand(lora_A, lora_B, transposed)
    for a in range(start, stop, ROW_ALIGN):
        b = min(stop, a + ROW_ALIGN)
        out = None if scratch is None else scratch[: b - a]
        yield a, exact_product(lora_A, lora_B, slice(a, b), transposed, out=out, right64=right64)


def _all_finite(a: npt.NDArray[np.float32]) -> bool:
    """Whether every value of ``a`` is finite: one float32 sum (finite unless some value is inf/NaN or
    the sum itself overflows; only then the element-wise check), a third of ``isfinite().all()``'s time."""
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(float(np.add.reduce(a, axis=None))):
            return True
    return bool(np.isfinite(a).all())


#: A bound on a delta's magnitude under which no value of ``(B @ A) * scale`` can overflow float32: half
#: of float32's largest value, room for the sgemm's and the multiply's roundings (relative 1e-6 each).
_DELTA_BOUND = 2.0**127


def _delta_bounded(lora_A: npt.NDArray[np.float32], lora_B: npt.NDArray[np.float32], scale: float) -> bool:
    """Whether ``|(B @ A) * scale|`` is certainly finite: ``|scale| * max_i sum_k |B[i, k]| * max_j |A[k, j]|``
    (float64, an upper bound of every value) is under :data:`_DELTA_BOUND`. Then the per-chunk finiteness
    check (:func:`_all_finite`, LORA-014) can be skipped; for any real adapter it is, by 30 orders of magnitude.

    Args:
        lora_A: ``float32[r, in]`` (finite).
        lora_B: ``float32[out, r]`` (finite).
        scale: the LoRA scaling as the float32 the delta is multiplied by (inf or NaN: not bounded).
    """
    if lora_A.size == 0 or lora_B.size == 0:
        return True
    a_max = np.abs(lora_A).max(axis=1).astype(np.float64)  # [r]
    bound = float(np.max(np.abs(lora_B).astype(np.float64) @ a_max)) * abs(scale)
    return math.isfinite(bound) and bound < _DELTA_BOUND


def _fold_scale(lora_A: npt.NDArray[np.float32], lora_B: npt.NDArray[np.float32],
                scale: float) -> npt.NDArray[np.float32] | None:
    """``lora_A * scale`` when ``B @ (A * scale)`` gives the bits of PEFT's ``(B @ A) * scale``, else None.

    Multiplying by a power of two is exact while every value stays normal, and scales each rounding of
    the sgemm (products, sums, fused multiply-adds: one order for the same shapes) by the same factor, so
    the two orders agree bit for bit when ``scale = +-2^p`` and no value of either is subnormal. Every
    exact product or sum of the sgemm is a multiple of ``ulp(min|A|) * ulp(min|B|)`` (the smallest
    non-zero magnitudes), at least ``2^(ea + eb - 46)`` with ``ea``, ``eb`` their exponents: the fold is
    taken when that, times ``min(1, |scale|)``, is at least ``2^-124`` (two bits under the smallest normal,
    ``2^-126``, of margin). Overflow is ruled out by the caller (:func:`_delta_bounded`). For a real
    adapter (values above 1e-10) the condition holds by 20 orders of magnitude; it saves a pass over every
    delta value.

    Args:
        lora_A: ``float32[r, in]`` (finite).
        lora_B: ``float32[out, r]`` (finite).
        scale: the LoRA scaling as a float32 value.
    """
    mant, exp = math.frexp(scale)
    if abs(mant) != 0.5:
        return None
    p = exp - 1  # |scale| = 2^p
    if scale == 1.0:
        return lora_A
    nz_a = np.abs(lora_A[lora_A != 0])
    nz_b = np.abs(lora_B[lora_B != 0])
    if nz_a.size and nz_b.size:
        ea = math.frexp(float(nz_a.min()))[1] - 1
        eb = math.frexp(float(nz_b.min()))[1] - 1
        if ea + eb - 46 + min(0, p) < -124 or ea + min(0, p) < -124:
            return None
    return np.multiply(lora_A, np.float32(scale), dtype=np.float32)


#: fp32 lanes of torch's vectorised CPU reduction (AVX2 ``Vectorized<float>``).
TORCH_LANES = 8


def dora_norm(v: npt.NDArray[np.float32], columns: bool = False) -> npt.NDArray[np.float32]:
    """The L2 norm DoRA divides by, in torch's fp32 summation order.

    ``torch.linalg.norm(V, dim=1)`` on CPU (torch 2.13, AVX2 kernels) sums the fp32 squares of a
    contiguous row in :data:`TORCH_LANES` lane accumulators (lane ``l`` takes elements ``l, l + 8, ...``,
    each square rounded, each add rounded), adds the lanes left to right, adds the squares of the
    ``n % 8`` tail elements one by one with a fused multiply-add, and takes an fp32 square root. For a
    norm along the stored columns (``fan_in_fan_out``) it accumulates down the rows one by one.
    This matches PEFT's ``DoraLinearLayer.get_weight_norm`` bit for bit on the shapes tested; on other
    builds it is within a few fp32 ulps.

    Args:
        v: ``float32[rows, n]``.
        columns: norm of each column (``float32[n]``) instead of each row (``float32[rows]``).

    Returns:
        the norms, float32.
    """
    if columns:
        sq = np.multiply(v, v, dtype=np.float32)
        return np.sqrt(np.cumsum(sq, axis=0, dtype=np.float32)[-1])
    rows, n = v.shape
    nf = n - n % TORCH_LANES
    if nf:
        sq = np.multiply(v[:, :nf], v[:, :nf], dtype=np.float32).reshape(rows, nf // TORCH_LANES, TORCH_LANES)
        lanes = np.cumsum(sq, axis=1, dtype=np.float32)[:, -1, :]
        s = np.cumsum(lanes, axis=1, dtype=np.float32)[:, -1]
    else:
        s = np.zeros(rows, dtype=np.float32)
    for j in range(nf, n):  # fma emulated in float64 (the product is exact there)
        x = v[:, j].astype(np.float64)
        s = (x * x + s.astype(np.float64)).astype(np.float32)
    return np.sqrt(s)


class TensorMerge:
    """Every op that applies to one base tensor, and the row-range merge.

    Attributes:
        name: the tensor name.
        base_shape: its shape in the base model.
        shape: its shape after the merge (differs when the adapter resized the vocabulary).
        ops: the ops, in order (ops before the last full replacement are already dropped).
        needs_base: whether the base tensor's values are read (False when the first op replaces it).
        whole_tensor: whether :meth:`merge_rows` must be given all rows at once (DoRA with
            fan_in_fan_out normalises over stored columns).
    """

    def __init__(self, name: str, base_shape: tuple[int, ...], ops: list[MergeOp]) -> None:
        self.name = name
        self.base_shape = base_shape
        self.ops = ops
        self.shape = ops[-1].shape if ops else base_shape
        self.needs_base = not ops or ops[0].kind != "replace"
        self.whole_tensor = any(op.kind == "dora" and op.layout != "linear" for op in ops)
        self._cache: dict[tuple[int, str], npt.NDArray[np.float32]] = {}
        # op index -> (_delta_bounded of its adapter, _fold_scale's A or None), found once
        self._bounded: dict[int, tuple[bool, npt.NDArray[np.float32] | None]] = {}
        # op index -> exact_product's float64 right operand (right_operand), made once per merge
        self._right: dict[int, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}

    def __repr__(self) -> str:
        return f"TensorMerge('{self.name}', {[(op.kind, op.source) for op in self.ops]})"

    def held_nbytes(self) -> int:
        """Bytes this merge holds while its tensor is written, beside the chunks: per adapter op, the fp32
        copies of ``A`` and ``B`` and of the scale-folded ``A``, and :func:`right_operand`'s float64 copy
        (``r x cols``) with its row maxima. The memory cap reserves them
        (:meth:`convert.lora.apply.LoraRun.held_nbytes`)."""
        n = 0
        for op in self.ops:
            if op.lora_A is None or op.lora_B is None:
                continue
            a, b = math.prod(op.lora_A.shape), math.prod(op.lora_B.shape)
            right = b if op.transposed else a
            n += 4 * a + 4 * b + 4 * a + 8 * right + 8 * op.lora_A.shape[0]
        return n

    def release(self) -> None:
        """Drop the cached fp32 copies of the adapter tensors and their pages of the adapter file."""
        self._cache.clear()
        self._bounded.clear()
        self._right.clear()
        for op in self.ops:
            for rec in (op.lora_A, op.lora_B, op.magnitude, op.replacement):
                if rec is not None:
                    rec.release()

    def _arr(self, i: int, what: str, rec: TensorRecord) -> npt.NDArray[np.float32]:
        """The adapter tensor in fp32, read once per merge and checked finite (LORA-014)."""
        key = (i, what)
        if key not in self._cache:
            values = _f32(rec)
            check_finite(rec, values)
            self._cache[key] = values
        return self._cache[key]

    def merge_rows(
        self,
        base_rows: np.ndarray | None,
        start: int,
        stop: int,
        out_dtype: np.dtype | str,
        stats: MergeStats | None = None,
        original_rows: np.ndarray | None = None,
        f16_loss: npt.NDArray[np.int64] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Merged rows [start, stop) of the tensor.

        Args:
            base_rows: rows [start, stop) of the dequantized base, ``[stop - start, *base_shape[1:]]``, in
                any float dtype (upcast exactly to fp32); None when :attr:`needs_base` is False. It may be
                ``out`` itself: only the last op writes ``out``, from an array of its own or, a Linear merge,
                piece by piece, each piece of its input read before that piece is written.
            start, stop: row range (rows of the merged tensor; ``[0, shape[0])`` when :attr:`whole_tensor`).
            out_dtype: ``bfloat16``, ``float16`` or ``float32``: the dtype every op rounds to.
            stats: accumulates the report figures when given (:func:`sum_sq`); None computes none.
            original_rows: the same rows of the original 16-bit model (for the quantization error).
            f16_loss: optional ``int64[2]``; for float16 output, adds the values each rounding overflowed
                to inf and the non-zero values it flushed to zero (:func:`convert.dequant.kernels_f16.count_f16_loss`).
            out: optional C-contiguous ``out_dtype`` array of the result's size to write it into.

        Returns:
            ``out_dtype[stop - start, *shape[1:]]`` (``out``, reshaped, when given).

        Raises:
            AdapterError: the rows given do not fit (wrong shape, partial rows for a whole-tensor merge).
        """
        dt = _dtype(out_dtype)
        count = f16_loss if dt == np.float16 else None

        def rnd(v: npt.NDArray[np.float32]) -> np.ndarray:
            y = round_float32(v, dt)
            if count is not None:
                count_f16_loss(np.asarray(v, dtype=np.float32), y, count)
            return y

        if self.whole_tensor and (start, stop) != (0, self.shape[0]):
            raise LoraShapeError(
                "DoRA with fan_in_fan_out needs the whole tensor in one piece",
                tensor=self.name,
                expected=[0, self.shape[0]],
                found=[start, stop],
            )
        x: np.ndarray | None = None
        if self.needs_base:
            if base_rows is None:
                raise LoraShapeError("base rows are needed for this merge", tensor=self.name)
            want = (stop - start, *self.base_shape[1:])
            if tuple(base_rows.shape) != want:
                raise LoraShapeError(
                    "base rows have the wrong shape",
                    tensor=self.name,
                    expected=list(want),
                    found=list(base_rows.shape),
                )
            x = base_rows
        for i, op in enumerate(self.ops):
            st = stats._get(op, i) if stats is not None else None
            if op.kind == "replace":
                assert op.replacement is not None
                rows = np.asarray(op.replacement.array()[start:stop], dtype=np.float32)
                if st is not None:
                    st.base_sq += sum_sq(rows)
                x = rnd(rows)
                continue
            assert x is not None and op.lora_A is not None and op.lora_B is not None
            a = self._arr(i, "A", op.lora_A)
            b = self._arr(i, "B", op.lora_B)
            if op.kind == "lora" and op.layout == "linear":
                if i not in self._bounded:
                    with np.errstate(over="ignore"):  # (inf for a scale past float32: no bound holds)
                        scale32 = float(np.float32(op.scale))
                        bounded = _delta_bounded(a, b, scale32)
                        self._bounded[i] = (bounded, _fold_scale(a, b, scale32) if bounded else None)
                bounded, folded = self._bounded[i]
                if i not in self._right:
                    self._right[i] = right_operand(a if folded is None else folded, b)
                last = i == len(self.ops) - 1
                x = self._merge_linear(x, a, b, op, start, stop, dt, st, original_rows if i == 0 else None, count,
                                       check=not bounded, folded_A=folded, out=out if last else None,
                                       right64=self._right[i])
                continue
            w = np.asarray(x, dtype=np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                if i not in self._right:
                    self._right[i] = right_operand(a, b, op.transposed)
                delta = lora_delta_rows(a, b, op.scale, start, stop, transposed=op.transposed,
                                        right64=self._right[i])
            if not _all_finite(delta):  # finite A, B and scale whose product overflows float32
                raise NonFiniteAdapterError(
                    "the LoRA delta (B @ A) * scale overflows float32 (merging it would write inf into the model)",
                    path=op.lora_B.file, tensor=self.name, expected="a finite delta",
                    found=f"{int((~np.isfinite(delta)).sum())} non-finite values in rows {start}-{stop} "
                          f"(scale {op.scale:g})")
            if st is not None:
                st.delta_sq += sum_sq(delta)
                st.base_sq += sum_sq(w)
                if original_rows is not None and i == 0:
                    st.has_original = True
                    st.quant_err_sq += sum_sq(np.asarray(original_rows, dtype=np.float32) - w)
            if op.layout == "embedding":
                delta = np.asarray(rnd(delta), dtype=np.float32)
            if op.kind == "dora":
                assert op.magnitude is not None
                v = w + delta
                norm = dora_norm(v, columns=op.transposed)
                mag = self._arr(i, "m", op.magnitude)
                factor = (mag if op.transposed else mag[start:stop]) / norm
                v *= factor[None, :] if op.transposed else factor[:, None]
                x = rnd(v)
            else:
                delta += w
                x = rnd(delta)
        assert x is not None
        if out is None:
            return x if x.dtype == dt else x.astype(dt)
        placed = out.reshape(x.shape)
        if not np.shares_memory(placed, x):
            np.copyto(placed, x, casting="unsafe")  # (a cast as astype's where x is not of dt)
        return placed

    def _merge_linear(self, x: np.ndarray, lora_A: npt.NDArray[np.float32], lora_B: npt.NDArray[np.float32],
                      op: MergeOp, start: int, stop: int, dt: np.dtype, st: _OpStats | None,
                      original_rows: np.ndarray | None, f16_loss: npt.NDArray[np.int64] | None,
                      check: bool, folded_A: npt.NDArray[np.float32] | None = None,
                      out: np.ndarray | None = None,
                      right64: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None) -> np.ndarray:
        """Rows [start, stop) of ``round(fp32(W) + fp32(B @ A) * fp32(scale))`` for a Linear weight ``x``
        (``[stop - start, in]``, any float dtype): PEFT's ``lora.Linear`` merge, each sgemm block of
        :func:`product_blocks` scaled, checked, added and rounded in cache-sized pieces (the operations of
        :func:`lora_delta_rows` then ``+= W`` on every value, in a third of the time of whole-chunk passes).

        ``f16_loss``: as :meth:`merge_rows` (float16 output only). ``check``: test every piece of the
        delta for overflow (False when :func:`_delta_bounded` holds for this adapter). ``folded_A``:
        :func:`_fold_scale`'s ``lora_A * scale``, multiplied by ``lora_B`` in place of scaling each product.
        ``out``: optional C-contiguous ``dt`` array of ``x``'s size the rows are written into (returned).
        ``right64``: :func:`right_operand` of the product's ``A`` (``folded_A`` when given), made once.

        Raises:
            NonFiniteAdapterError: the scaled product overflows float32 (LORA-014).
        """
        m = stop - start
        w = x.reshape(m, -1)
        orig_rows = None if original_rows is None else np.asarray(original_rows).reshape(m, -1)
        out = np.empty(x.shape, dtype=dt) if out is None else out.reshape(x.shape)
        o = out.reshape(m, -1)
        cols = w.shape[1]
        step = max(1, PIECE // max(cols, 1))
        buf = np.empty((min(step, m), cols), dtype=np.float32)
        scratch = np.empty((ROW_ALIGN, cols), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is LORA-014; inf from fp16 rounding is IEEE's
            scale = np.float32(op.scale)
            a = lora_A if folded_A is None else folded_A
            for row, block in product_blocks(a, lora_B, start, stop, scratch=scratch, right64=right64):
                for i in range(0, block.shape[0], step):
                    d = block[i : i + step]
                    r0 = row - start + i
                    r1 = r0 + d.shape[0]
                    if folded_A is None:
                        np.multiply(d, scale, out=d)
                    if check and not _all_finite(d):  # finite A, B and scale whose product overflows float32
                        raise NonFiniteAdapterError(
                            "the LoRA delta (B @ A) * scale overflows float32 (merging it would write inf into "
                            "the model)", path=op.lora_B.file if op.lora_B is not None else None, tensor=self.name,
                            expected="a finite delta",
                            found=f"{int((~np.isfinite(d)).sum())} non-finite values in rows {start + r0}-"
                                  f"{start + r1} (scale {op.scale:g})")
                    base = buf[: r1 - r0]
                    np.copyto(base, w[r0:r1], casting="unsafe")  # bf16/fp16 -> fp32: exact
                    if st is not None:
                        st.delta_sq += sum_sq(d)
                        st.base_sq += sum_sq(base)
                        if orig_rows is not None:  # (this piece's rows widened, not the whole chunk per piece)
                            st.has_original = True
                            st.quant_err_sq += sum_sq(np.asarray(orig_rows[r0:r1], dtype=np.float32) - base)
                    np.add(d, base, out=d)
                    np.copyto(o[r0:r1], d, casting="unsafe")  # one round to nearest even (ml_dtypes / NumPy)
                    if f16_loss is not None:
                        count_f16_loss(d, o[r0:r1], f16_loss)
        return out

    def merge(
        self,
        base: np.ndarray | None,
        out_dtype: np.dtype | str,
        rows_per_chunk: int | None = None,
        stats: MergeStats | None = None,
        original: np.ndarray | None = None,
    ) -> np.ndarray:
        """The whole merged tensor, computed in row chunks (a convenience over :meth:`merge_rows`).

        Args:
            base: the dequantized base ``[*base_shape]`` (None when not :attr:`needs_base`).
            out_dtype: output dtype.
            rows_per_chunk: rows per :meth:`merge_rows` call (default: all).
            stats: report accumulator.
            original: the original 16-bit tensor, for the quantization error.

        Returns:
            ``out_dtype[*shape]``.
        """
        rows = self.shape[0]
        step = rows if rows_per_chunk is None or self.whole_tensor else max(1, rows_per_chunk)
        out = np.empty(self.shape, dtype=_dtype(out_dtype))
        for s in range(0, rows, step):
            e = min(rows, s + step)
            out[s:e] = self.merge_rows(
                None if base is None else base[s:e],
                s,
                e,
                out_dtype,
                stats,
                None if original is None else original[s:e],
            )
        return out

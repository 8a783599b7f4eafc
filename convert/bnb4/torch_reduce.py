"""``torch.sum`` / ``torch.mean`` of a 1-D float32 tensor on CPU, in torch's own summation order.

Pure NumPy, no I/O. bitsandbytes' double quantization subtracts ``torch.mean(absmax)`` (the nested
offset), so reproducing its files byte for byte needs torch's fp32 rounding, which is neither NumPy's
pairwise sum nor a sequential one (NumPy's pairwise mean differs on 2 of the 13 nested reference
files). Verified against torch 2.13 (docs/bnb-format.md section 3, docs/quantize.md):

Sum (``cascade_sum`` in ``aten/src/ATen/native/cpu/SumKernel.cpp``, fp32 accumulators)
    ``vector_width`` fp32 lanes (8 on every x86-64 CPU: torch registers its reduction kernels without
    an AVX512 variant, so an AVX512 machine runs the AVX2 kernel); four interleaved accumulators
    (``row_sum``), each a four-level cascade whose level step is ``2**max(4, ceil(log2(rows)) // 4)``
    rows (``multi_row_sum``); then the scalar tail and the lanes are added in order.

Threads (``parallel_for`` / ``two_pass_reduction``)
    Below ``at::internal::GRAIN_SIZE`` (32768) elements, or on one thread, the sum above runs once.
    Otherwise torch splits the range into ``min(threads, ceil(n / 32768))`` equal chunks, sums each
    into a per-thread buffer of ``threads`` fp32 zeros, then sums that buffer: the result depends on
    the thread count from 32768 elements on.

Mean (``mean_out`` in ``ReduceOps.cpp``)
    ``fp32(sum(x) / fp32(n))``, one fp32 division.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from convert.dequant.products import PIECE

__all__ = [
    "TORCH_GRAIN_SIZE",
    "TORCH_NUM_THREADS",
    "TORCH_SUM_VECTOR_WIDTH",
    "torch_mean_float32",
    "torch_sum_float32",
]

#: fp32 lanes of torch's CPU sum kernel. torch registers its reduction kernels without an AVX512
#: variant, so an AVX512 machine runs the AVX2 kernel: 8 lanes on every x86-64 CPU torch supports.
TORCH_SUM_VECTOR_WIDTH = 8
#: Elements below which torch reduces on one thread (``at::internal::GRAIN_SIZE``).
TORCH_GRAIN_SIZE = 32768
#: torch's intra-op thread count assumed for the mean of 32768 or more absmax values (layers of
#: 2,097,152+ weights at blocksize 64). 2 is the setting the reference files were written with.
TORCH_NUM_THREADS = 2

_F32 = np.float32


def flat_f32(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``x`` as a flat float32 array (no copy when it already is float32)."""
    a = np.asarray(x)
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return a.reshape(-1)


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else (x - 1).bit_length()


def _seq_sum(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """0 + rows[0] + rows[1] + ... in fp32, left to right, elementwise over the trailing axes."""
    # np.add.accumulate is sequential by definition (no pairwise regrouping); "+ 0" turns -0 to +0
    # as torch's zero-initialised accumulator does.
    return np.add.accumulate(rows, axis=0, dtype=_F32)[-1] + _F32(0)


def _multi_row_sum(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """torch ``multi_row_sum``: a 4-level cascade over ``rows[size, ...]`` returning ``rows.shape[1:]``."""
    size = rows.shape[0]
    level_power = max(4, _ceil_log2(size) // 4)
    step = 1 << level_power
    acc = np.zeros((4,) + rows.shape[1:], dtype=_F32)
    i = 0
    n_full = size // step
    if n_full:
        grouped = rows[: n_full * step].reshape((n_full, step) + rows.shape[1:])
        sums = np.empty((n_full,) + rows.shape[1:], dtype=_F32)
        per = max(1, PIECE // max(1, grouped[0].size))  # groups at a time: no n-sized temporary
        for c0 in range(0, n_full, per):
            c1 = min(n_full, c0 + per)
            sums[c0:c1] = np.add.accumulate(grouped[c0:c1], axis=1, dtype=_F32)[:, -1] + _F32(0)
        for c in range(n_full):
            acc[0] = sums[c]
            i += step
            for j in range(1, 4):
                acc[j] += acc[j - 1]
                acc[j - 1] = 0
                if i & ((step - 1) << (j * level_power)):
                    break
    if i < size:
        acc[0] = _seq_sum(rows[i:])
    total = acc[0]
    for j in range(1, 4):
        total = total + acc[j]
    return total


def _row_sum(x: npt.NDArray[np.float32], vector_width: int) -> np.float32:
    """torch's serial CPU sum of a contiguous fp32 vector (``vectorized_inner_sum`` / ``row_sum``)."""
    n = x.size
    if n >= vector_width:
        nvec = n // vector_width
        vecs = x[: nvec * vector_width].reshape(nvec, vector_width)
        n_ilp = nvec // 4
        partial = _multi_row_sum(vecs[: n_ilp * 4].reshape(n_ilp, 4, vector_width))
        p0 = partial[0]
        for v in vecs[n_ilp * 4 :]:
            p0 = p0 + v
        for k in range(1, 4):
            p0 = p0 + partial[k]
        acc = _F32(0)
        for v in x[nvec * vector_width :]:
            acc = _F32(acc + v)
        for v in p0:
            acc = _F32(acc + v)
        return acc
    n_ilp = n // 4
    part = _multi_row_sum(x[: n_ilp * 4].reshape(n_ilp, 4))
    acc = _F32(part[0])
    for v in x[n_ilp * 4 :]:
        acc = _F32(acc + v)
    for k in range(1, 4):
        acc = _F32(acc + part[k])
    return acc


def torch_sum_float32(
    x: npt.ArrayLike,
    *,
    vector_width: int = TORCH_SUM_VECTOR_WIDTH,
    num_threads: int = TORCH_NUM_THREADS,
) -> np.float32:
    """``torch.sum`` of a 1-D contiguous float32 tensor on CPU, bit for bit.

    torch's ``cascade_sum`` (``SumKernel.cpp``) with fp32 accumulators: ``vector_width`` lanes of
    fp32 vectors, four interleaved accumulators (``row_sum``), each a four-level cascade whose level
    step is ``2**max(4, ceil(log2(rows)) // 4)`` rows (``multi_row_sum``); then the scalar tail and
    the lanes are added in order. With ``num_threads > 1`` and ``n >= 32768`` torch splits the range
    into ``min(threads, ceil(n / 32768))`` equal chunks (``parallel_for``), sums each as above into a
    per-thread buffer and then sums the buffer (``two_pass_reduction``). Verified against torch 2.13
    for n = 1..5000 and large n with 1, 2, 3, 4 and 7 threads.

    Args:
        x: ``float32[n]``.
        vector_width: fp32 lanes of the sum kernel (8 on x86-64, AVX2 and AVX512 alike).
        num_threads: torch's intra-op thread count (``torch.get_num_threads()``).

    Returns:
        the sum as ``np.float32``.
    """
    x = flat_f32(x)
    n = x.size
    if n < TORCH_GRAIN_SIZE or num_threads <= 1:
        return _F32(_row_sum(x, vector_width) + _F32(0))
    used = min(num_threads, -(-n // TORCH_GRAIN_SIZE))
    chunk = -(-n // used)
    buf = np.zeros(num_threads, dtype=_F32)
    for t in range(used):
        lo = t * chunk
        if lo < n:
            buf[t] = _row_sum(x[lo : min(n, lo + chunk)], vector_width) + _F32(0)
    return _F32(_row_sum(buf, vector_width) + _F32(0))


def torch_mean_float32(
    x: npt.ArrayLike,
    *,
    vector_width: int = TORCH_SUM_VECTOR_WIDTH,
    num_threads: int = TORCH_NUM_THREADS,
) -> np.float32:
    """``torch.mean`` of a 1-D contiguous float32 tensor on CPU, bit for bit.

    torch computes a CPU mean as ``sum(x) / n`` (``mean_out`` in ``ReduceOps.cpp``): the sum of
    :func:`torch_sum_float32`, then one fp32 division. NumPy's pairwise ``mean`` rounds differently
    (2 of the 13 nested reference files).

    Args:
        x: ``float32[n]``, n >= 1.
        vector_width: fp32 lanes of the sum kernel.
        num_threads: torch's intra-op thread count.

    Returns:
        the mean as ``np.float32``.
    """
    x = flat_f32(x)
    total = torch_sum_float32(x, vector_width=vector_width, num_threads=num_threads)
    return _F32(total / _F32(x.size))

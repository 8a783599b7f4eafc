"""Per-block maxima of integer bit patterns by a pairwise tree of strided NumPy passes.

NumPy reduces a short row (``a.reshape(n, 32).max(axis=1)``) at ~1-2 ns an element, paying a per-row
overhead; halving the whole array at each level (``np.maximum(a[0::2], a[1::2])``) costs ~0.7 ns an
element in all. Callers turn floats into bit patterns that order as the values they need: the magnitudes of a
float's blocks (:func:`block_magnitudes`: a bnb block's absmax, :func:`convert.bnb4.encode.blockwise_absmax`; a
Q8_0 block's, :mod:`convert.gguf.codecs.legacy`), signed float32 keys (:mod:`convert.gguf.codecs.base`). No GGML
or bnb knowledge here, and nothing imported beyond NumPy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["block_magnitudes", "block_max_bits"]

#: Item size of a float -> the unsigned integer of its bits and the mask clearing its sign bit.
_MAGNITUDE = {2: (np.uint16, np.uint16(0x7FFF)), 4: (np.uint32, np.uint32(0x7FFFFFFF))}


def block_max_bits(
    a: npt.NDArray[np.int32] | npt.NDArray[np.uint32] | npt.NDArray[np.uint16], n: int,
    scratch: npt.NDArray[np.int32],
) -> npt.NDArray:
    """Max of each of the ``n`` consecutive equal runs of int32, uint32 or uint16 ``a`` (1-D, ``a.size // n``
    a power of two) -> ``(n,)`` of ``a``'s dtype (a copy).

    NumPy reduces a short row at ~1-2 ns an element (per-row overhead); this is a pairwise tree of
    long strided ``maximum`` passes (~0.7 ns an element in all). The levels alternate between two
    regions of the last ``0.75 * a.size`` elements of ``scratch`` seen as ``a``'s dtype (int32, at
    least ``1.75 * a.nbytes`` bytes), so no output overlaps its input (NumPy would copy the input
    first), and ``a`` may be the first ``a.size`` elements of that view, which are left as they were.
    """
    size = a.size
    buf = scratch.view(a.dtype)
    regions = (buf[size : size + size // 2], buf[size + size // 2 : size + size // 2 + size // 4])
    level = 0
    while a.size > n:
        h = a.size // 2
        a = np.maximum(a[0::2], a[1::2], out=regions[level % 2][:h])
        level += 1
    return a.copy()


def block_magnitudes(
    x: np.ndarray, n: int, scratch: npt.NDArray[np.int32],
) -> tuple[np.ndarray, npt.NDArray[np.float32]]:
    """The magnitudes of float16, bfloat16 or float32 ``x`` (read flat: ``n`` equal runs, a power of two long)
    and the largest of each run: ``(|x|`` as ``x``'s dtype, a view of the start of ``scratch``; float32 ``(n,))``.

    Exact: the sign bits are cleared into ``scratch`` (int32, at least ``1.75 * x.nbytes`` bytes), whose bit
    patterns then order as the magnitudes (inf and NaN above every finite value: a run holding NaN gets a NaN), and
    the runs are reduced by :func:`block_max_bits`.
    """
    unsigned, mask = _MAGNITUDE[x.dtype.itemsize]
    mags = np.bitwise_and(x.reshape(-1).view(unsigned), mask, out=scratch.view(unsigned)[: x.size])
    top = block_max_bits(mags, n, scratch).view(x.dtype).astype(np.float32)
    return mags.view(x.dtype), top

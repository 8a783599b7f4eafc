"""Per-block maxima of integer bit patterns by a pairwise tree of strided NumPy passes.

NumPy reduces a short row (``a.reshape(n, 32).max(axis=1)``) at ~1-2 ns an element, paying a per-row
overhead; halving the whole array at each level (``np.maximum(a[0::2], a[1::2])``) costs ~0.7 ns an
element in all. Callers turn floats into bit patterns that order as the values they need: the float32
magnitudes of a GGML block (:mod:`convert.gguf.codecs.base`), the bfloat16/float16 magnitudes of a bnb block
(:func:`convert.bnb4.encode.blockwise_absmax`). No GGML or bnb knowledge here, and nothing imported beyond NumPy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["block_max_bits"]


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

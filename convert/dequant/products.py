"""What the 4-bit kernels share: the output dtypes, the inner piece, the quad table and the fp32 products.

bitsandbytes' 4-bit value is ``fp32(quant_map[code]) * fp32(absmax[block])`` (docs/bnb-format.md section 2).
Here the codes of two packed bytes are looked up as a quad (:func:`quad_lut`: one 16-byte gather per
two bytes; NumPy's take costs about the same per item for 8 or 16 bytes) and the products are one
multiply on a ``(n_blocks, blocksize)`` view (:func:`products_into`), which may cast them to the output's
dtype in the same ufunc call. :mod:`convert.dequant.kernels` (bf16, fp32) and :mod:`convert.dequant.kernels_f16`
(float16) round them.

Work is cut into pieces of :data:`PIECE` elements; each NumPy call is kept long enough (tens of
microseconds) that two threads overlap their calls: on a virtual machine, handing the GIL over to a
thread that waits for it costs about 10 microseconds, and two threads running calls of a few
microseconds each ran no faster than one.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = ["BF16", "F32", "PIECE", "piece_elements", "products_into", "quad_lut"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
#: Elements per inner piece: the fp32 temporaries (1 MiB) stay in L2 cache, and each NumPy call on a
#: piece takes tens of microseconds: with pieces of 2^16 two threads often ran no faster than one
#: (handing the GIL to a waiting thread costs ~10 us on a virtual machine); 2^18 made every path 4-20%
#: faster end to end on two threads, 2^20 was slower again (docs/performance.md).
PIECE = 1 << 18


def quad_lut(quant_map: npt.NDArray[np.float32]) -> npt.NDArray[np.complex128]:
    """The 65536-entry table two packed bytes -> their four codes' ``quant_map`` values, made once per
    map (3 ms; cached, read-only).

    Args:
        quant_map: ``float32[16]``.

    Returns:
        ``complex128[65536]`` (a 16-byte carrier, never used as numbers): entry ``i`` is the float32
        values of the codes of byte ``i & 255`` (high nibble, low nibble) then of byte ``i >> 8``, so
        ``lut[packed.view("<u2")].view(float32)`` is the flat sequence of table values of ``packed`` (an
        even number of bytes), and ``lut[b]`` for a single byte ``b`` starts with its two values. One
        lookup per two bytes: NumPy's take costs about the same per item for 8 or 16 bytes.
    """
    return _quad_lut(np.asarray(quant_map, dtype=np.float32).reshape(16).tobytes())


@functools.lru_cache(maxsize=8)
def _quad_lut(quant_map: bytes) -> npt.NDArray[np.complex128]:
    qm = np.frombuffer(quant_map, dtype=np.float32)
    idx = np.arange(1 << 16)
    quads = np.empty((1 << 16, 4), dtype=np.float32)
    for j, shift in enumerate((4, 0, 12, 8)):  # byte 0's high and low nibbles, then byte 1's
        quads[:, j] = qm[(idx >> shift) & 15]
    lut = quads.view(np.complex128).reshape(1 << 16)
    lut.flags.writeable = False
    return lut


def piece_elements(blocksize: int) -> int:
    """Elements per inner piece of a 4-bit kernel: :data:`PIECE` rounded down to whole blocks (one at least)."""
    return max(blocksize, (PIECE // blocksize) * blocksize)


def products_into(
    packed: npt.NDArray[np.uint8],
    absmax: npt.NDArray[np.float32],
    lut: npt.NDArray[np.complex128],
    blocksize: int,
    s: int,
    e: int,
    quads: npt.NDArray[np.complex128],
    out: np.ndarray,
) -> None:
    """``out[:e - s] = fp32(quant_map[code] * absmax[block])`` for elements [s, e) (``s`` on a block),
    cast to ``out``'s dtype by the multiply (``casting="unsafe"``); ``quads``: scratch of at least
    ``(e - s) // 4 + 1`` items."""
    m = e - s
    src = packed[s // 2 : (e + 1) // 2]
    k = src.size // 2
    # (every uint16 indexes the 65536 entries: "wrap" changes no index and is NumPy's fastest take mode)
    np.take(lut, src[: 2 * k].view("<u2"), out=quads[:k], mode="wrap")
    if src.size > 2 * k:  # an odd byte at the end: its two values start its entry
        quads[k] = lut[src[-1]]
    vals = quads.view(np.float32)[:m]
    nb_full, b0 = m // blocksize, s // blocksize
    full = nb_full * blocksize
    if nb_full:
        np.multiply(vals[:full].reshape(nb_full, blocksize), absmax[b0 : b0 + nb_full, None],
                    out=out[:full].reshape(nb_full, blocksize), casting="unsafe")
    if m > full:
        np.multiply(vals[full:], absmax[b0 + nb_full], out=out[full:m], casting="unsafe")

"""4-bit quantization in bitsandbytes' layout, byte-identical to ``bitsandbytes.functional.quantize_4bit``.

Pure NumPy, no I/O. Numerics (docs/bnb-format.md section 3, verified byte for byte against files
bitsandbytes 0.50.2 wrote, and against bitsandbytes and torch 2.13 themselves):

4-bit codes (``backends/default/ops.py``, the generic ``quantize_4bit`` kernel)
    The input is upcast to fp32 and cut into flat blocks of ``blocksize`` elements (blocks cross
    rows). ``absmax[b] = max |x|`` over the block. A full block is scaled by the fp32 reciprocal,
    ``s = clip(x * fp32(1 / max(absmax, 1e-38)), -1, 1)``, and stores absmax as is (an all-zero
    block stores 0.0). The partial last block uses a true division ``x / max(absmax, 1e-38)`` and
    stores the clamped value (an all-zero tail stores 1e-38, fp32 bits 0x006ce3ee).
    ``code = searchsorted(midpoints, s, side="left")`` over the fp32 midpoints of the sorted table,
    so a tie goes to the lower code; FP4 maps the sorted index through :data:`FP4_ORDER`
    (:class:`Bnb4Codec`: one class, an instance per type). Byte k
    holds code 2k in its high nibble and code 2k+1 in its low one; an odd count is padded with a
    scaled value of 0.0 (nibble 7 for NF4, 0 for FP4).

The double quantization of absmax (``compress_statistics=True``) is :mod:`convert.bnb4.absmax8`.

Chunking: every function that takes a slice of the flat tensor accepts any slice that starts on a
block boundary; only the slice that ends the tensor may end inside a block (its partial block is the
tensor's tail) or on an odd element. Concatenating the results of consecutive slices gives the
result for the whole tensor, byte for byte (:func:`iter_block_chunks` yields such slices).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from convert.dequant.block_reduce import block_magnitudes
from convert.dequant.kernels import dequantize_4bit
from convert.dequant.products import PIECE
from formats.bnb import BLOCKSIZES, QUANT_TABLES
from formats.errors import BlocksizeOptionError, NonFiniteWeightError, QuantTypeOptionError

__all__ = ["ABSMAX_FLOOR", "CODECS", "FP4_ORDER", "Bnb4Codec", "blockwise_absmax", "check_blocksize", "codec",
           "iter_block_chunks"]

#: The floor bnb clamps absmax to before dividing (``absmax.clamp(min=1e-38)``), fp32 bits 0x006ce3ee.
ABSMAX_FLOOR = np.float32(1e-38)
#: FP4 code of each position of the sorted FP4 table (``torch.argsort(code)`` in bnb, fixed here so
#: that the two +0.0 entries, codes 0 and 8, keep bnb's order).
FP4_ORDER = np.array([11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3], dtype=np.uint8)

_F32 = np.float32


def check_blocksize(blocksize: int) -> None:
    """Check a 4-bit blocksize against :data:`formats.bnb.BLOCKSIZES`.

    Raises:
        BlocksizeOptionError: QNT-002, blocksize is not a power of two from 32 to 4096.
    """
    if blocksize not in BLOCKSIZES:
        raise BlocksizeOptionError("blocksize must be a power of two from 32 to 4096",
                                   expected=list(BLOCKSIZES), found=blocksize)


def _flat_f32(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    a = np.asarray(x)
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return a.reshape(-1)


def _finite_absmax(absmax: npt.NDArray[np.float32]) -> None:
    if not np.isfinite(absmax).all():
        bad = int(np.flatnonzero(~np.isfinite(absmax))[0])
        raise NonFiniteWeightError("the tensor to quantize holds NaN or infinite values",
                                   expected="finite values", found=f"non-finite value in block {bad}",
                                   hint="fix or skip this tensor (--skip-modules)")




def blockwise_absmax(x: npt.ArrayLike, blocksize: int) -> npt.NDArray[np.float32]:
    """Per-block absmax of a block-aligned slice of the flat tensor (pass 1 of two).

    Matches the absmax that bitsandbytes ``quantize_4bit`` (generic kernel) returns: ``max |x|`` in
    fp32 for full blocks; for a partial last block ``max(max |x|, 1e-38)``.

    Args:
        x: ``float16|bfloat16|float32[m]`` (any shape; read flat), starting on a block boundary.
        blocksize: elements per block.

    Returns:
        ``float32[ceil(m / blocksize)]``.

    Raises:
        NonFiniteWeightError: QNT-003, x holds NaN or infinity.
    """
    x = np.asarray(x).reshape(-1)
    m = x.size
    nb_full = m // blocksize
    out = np.empty(-(-m // blocksize), dtype=_F32)
    piece = max(1, PIECE // blocksize)
    if x.dtype.name in ("float16", "bfloat16"):
        # sign-magnitude: |x| orders as the 16-bit pattern without its sign (NaN and inf above every
        # finite value, so the finite check below still sees them); the blocks (a power of two) reduced
        # by block_max_bits' tree of strided maxima: 0.54 ns a value against 0.76 for NumPy's row
        # reduction of the same uint16 patterns (itself ~3x faster than float rows) on the bench's EPYC
        scratch = np.empty(min(nb_full, piece) * blocksize * 7 // 8 + 1, np.int32)  # 1.75x the uint16 piece
        for b in range(0, nb_full, piece):
            e = min(nb_full, b + piece)
            out[b:e] = block_magnitudes(x[b * blocksize : e * blocksize], e - b, scratch)[1]
    else:
        for b in range(0, nb_full, piece):
            e = min(nb_full, b + piece)
            blk = _flat_f32(x[b * blocksize : e * blocksize]).reshape(e - b, blocksize)
            np.max(np.abs(blk), axis=1, out=out[b:e])
    if m > nb_full * blocksize:
        out[-1] = max(np.abs(_flat_f32(x[nb_full * blocksize :])).max(), ABSMAX_FLOOR)
    _finite_absmax(out)
    return out


#: The byte order: the top 16 bits of a float32 are its second uint16 on little-endian machines.
_LITTLE = sys.byteorder == "little"


#: Bits of a float32 that pick its bucket in :func:`_code_table` (the sign, the exponent, 11 mantissa bits).
_BUCKET_BITS = 20
#: :func:`_code_table`'s entry for a bucket that holds a midpoint (or is not finite): search those values.
_SEARCH = 255


@functools.lru_cache(maxsize=4)
def _code_table(mid: bytes) -> npt.NDArray[np.uint8]:
    """The table that replaces ``searchsorted(mid, s, side="left")`` by one lookup on s's top
    :data:`_BUCKET_BITS` bits, for the float32 midpoints ``mid`` (as bytes).

    The float32 values sharing their top bits form one interval ("bucket", 2^12 consecutive patterns).
    Where no midpoint lies in the bucket, the search gives the same answer for every value in it:
    ``count(mid < bucket start)`` is stored. Where one does (one bucket per midpoint and sign, their
    values a fraction of a percent of a weight's; ties ``s == m`` must stay low), or the bucket holds
    inf/NaN, :data:`_SEARCH` is stored and the caller searches those values. Made once per table
    (1 MiB), in pieces (no large temporaries).
    """
    m = np.frombuffer(mid, dtype=np.float32)
    table = np.empty(1 << _BUCKET_BITS, dtype=np.uint8)
    low = 32 - _BUCKET_BITS
    step = 1 << 16
    for h0 in range(0, table.size, step):
        h = np.arange(h0, h0 + step, dtype=np.uint32)
        first = (h << low).view(np.float32)
        last = ((h << low) | ((1 << low) - 1)).view(np.float32)
        start, stop = np.minimum(first, last), np.maximum(first, last)  # negative buckets run downwards
        base = np.searchsorted(m, start, side="left")  # count(mid < start)
        inside = np.searchsorted(m, stop, side="right") - base  # midpoints in [start, stop]
        exact = np.isfinite(start) & np.isfinite(stop) & (inside == 0)
        table[h0 : h0 + step] = np.where(exact, base, _SEARCH)
    table.flags.writeable = False
    return table


def _pack_codes(
    s: npt.NDArray[np.float32],
    mid: npt.NDArray[np.float32],
    order: npt.NDArray[np.uint8] | None,
    out: npt.NDArray[np.uint8],
) -> None:
    """Codes of scaled values ``s`` (float32, contiguous, even count) packed two to a byte into ``out``;
    ``order``: the code of each sorted position (None: the identity, NF4's).

    Any finite ``s`` is fine: values beyond [-1, 1] get the end codes, as bnb's clamp to [-1, 1] gives
    (every midpoint is inside), so callers need not clip.
    """
    # the bucket: the top bits (takes in "wrap" mode: every index is in range, and it is the fastest)
    bucket = np.right_shift(s.view(np.uint32), 32 - _BUCKET_BITS, out=np.empty(s.size, np.intp), casting="unsafe")
    idx = np.take(_code_table(mid.tobytes()), bucket, mode="wrap")
    search = np.flatnonzero(idx == _SEARCH)
    if search.size:  # values in a bucket that holds a midpoint
        idx[search] = np.searchsorted(mid, s[search], side="left")
    codes = idx if order is None else np.take(order, idx, mode="wrap")
    if _LITTLE:  # a uint16 of two codes (< 16) is first | second << 8: byte = (v << 4 | v >> 8) & 0xFF
        v = codes.view(np.uint16)
        packed = np.left_shift(v, 4)
        packed |= v >> 8
        np.copyto(out, packed, casting="unsafe")  # (the cast keeps the low byte)
    else:
        pairs = codes.reshape(-1, 2)
        np.left_shift(pairs[:, 0], 4, out=out)
        np.bitwise_or(out, pairs[:, 1], out=out)


class Bnb4Codec:
    """One bitsandbytes 4-bit type: ``quantize`` float values to packed codes and absmax, ``dequantize``
    them back. NF4 and FP4 differ only in data (:data:`CODECS` holds the two instances): their 16-entry
    table (:data:`formats.bnb.QUANT_TABLES`) and the code of each position of the sorted table (identity
    for NF4; :data:`FP4_ORDER`, ``torch.argsort(code)`` in bnb, for FP4).

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        table: ``float32[16]``, the value of each code.
        order: ``uint8[16]``, the code of each sorted table position.
        midpoints: ``float32[15]``, the decision bounds: each ``fp32((a + b) / 2)`` of neighbours in the
            sorted table (bitsandbytes ``backends/default/ops.py::_get_4bit_quantize_bounds``).
    """

    def __init__(self, quant_type: str, order: npt.NDArray[np.uint8]) -> None:
        self.quant_type = quant_type
        self.table = QUANT_TABLES[quant_type]
        self.order = order
        srt = self.table[order]
        self.midpoints = ((srt[:-1] + srt[1:]) / _F32(2)).astype(_F32)
        self._identity = bool((order == np.arange(16)).all())

    def quantize(self, x: npt.ArrayLike, blocksize: int = 64) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
        """Quantize a tensor (or a block-aligned slice of it) to packed 4-bit codes and absmax.

        Matches bitsandbytes ``functional.quantize_4bit`` (generic kernel, ``compress_statistics=False``)
        byte for byte.

        Args:
            x: ``float16|bfloat16|float32`` of n elements, any shape (quantized flat, row-major).
            blocksize: 32, 64, ..., 4096.

        Returns:
            (``uint8[ceil(n/2)]`` packed codes, ``float32[ceil(n/blocksize)]`` absmax).

        Raises:
            BlocksizeOptionError: QNT-002, a bad blocksize.
            NonFiniteWeightError: QNT-003, x holds NaN or infinity.
        """
        check_blocksize(blocksize)
        absmax = blockwise_absmax(x, blocksize)
        return self.encode(x, absmax, blocksize), absmax

    def encode(self, x: npt.ArrayLike, absmax: npt.NDArray[np.float32], blocksize: int) -> npt.NDArray[np.uint8]:
        """Packed 4-bit codes of a block-aligned slice, given its absmax (pass 2 of two; pass 1 is
        :func:`blockwise_absmax`).

        Matches the codes of bitsandbytes ``quantize_4bit`` (generic kernel): fp32 reciprocal for full
        blocks, true division for a partial last block, ties to the lower code, odd count padded.

        Args:
            x: ``float16|bfloat16|float32[m]`` (any shape; read flat), starting on a block boundary.
            absmax: ``float32[ceil(m / blocksize)]`` from :func:`blockwise_absmax` of the same slice.
            blocksize: elements per block (even).

        Returns:
            ``uint8[ceil(m / 2)]``; byte k = code[2k] << 4 | code[2k+1].
        """
        order = None if self._identity else self.order
        x = np.asarray(x).reshape(-1)
        absmax = np.asarray(absmax, dtype=_F32).reshape(-1)
        m = x.size
        nb_full = m // blocksize
        out = np.empty(-(-m // 2), dtype=np.uint8)
        piece = max(1, PIECE // blocksize)
        with np.errstate(over="ignore"):  # 1/1e-38 is finite; silence the huge-but-finite path
            for b in range(0, nb_full, piece):
                e = min(nb_full, b + piece)
                blk = _flat_f32(x[b * blocksize : e * blocksize]).reshape(e - b, blocksize)
                recip = _F32(1) / np.maximum(absmax[b:e], ABSMAX_FLOOR)
                s: npt.NDArray[np.float32] = np.multiply(blk, recip[:, None], dtype=_F32)  # (no clip: _pack_codes)
                _pack_codes(s.reshape(-1), self.midpoints, order, out[b * blocksize // 2 : e * blocksize // 2])
            if m > nb_full * blocksize:
                tail = _flat_f32(x[nb_full * blocksize :])
                t = np.zeros(tail.size + tail.size % 2, dtype=_F32)  # an odd count pads with 0.0
                np.clip(np.divide(tail, absmax[-1], dtype=_F32), -1, 1, out=t[: tail.size])
                _pack_codes(t, self.midpoints, order, out[nb_full * blocksize // 2 :])
        return out

    def dequantize(self, packed: npt.NDArray[np.uint8], absmax: npt.NDArray[np.float32], blocksize: int, n: int,
                   dtype: str = "float32") -> np.ndarray:
        """The values of ``n`` packed codes: bnb's ``fp32(table[code]) * fp32(absmax)``, rounded once to
        ``dtype`` (:func:`convert.dequant.kernels.dequantize_4bit`, with this type's table)."""
        return dequantize_4bit(packed, absmax, self.table, blocksize, n, dtype)


#: The 4-bit types: ``quant_type`` -> its codec.
CODECS: dict[str, Bnb4Codec] = {"nf4": Bnb4Codec("nf4", np.arange(16, dtype=np.uint8)),
                                "fp4": Bnb4Codec("fp4", FP4_ORDER)}


def codec(quant_type: str) -> Bnb4Codec:
    """The codec of a 4-bit quant type (also :class:`~convert.bnb4.settings.QuantSettings`'s check).

    Raises:
        QuantTypeOptionError: QNT-001, quant_type is not ``"nf4"`` or ``"fp4"``.
    """
    if quant_type not in CODECS:
        raise QuantTypeOptionError("quant_type must be nf4 or fp4", expected="'nf4' or 'fp4'",
                                   found=quant_type)
    return CODECS[quant_type]


def iter_block_chunks(n: int, blocksize: int, max_elements: int) -> Iterator[tuple[int, int]]:
    """Block-aligned [start, stop) element ranges covering n elements, each at most ``max_elements``.

    Args:
        n: elements in the flat tensor.
        blocksize: the 4-bit blocksize (chunks hold whole blocks, except the tail).
        max_elements: upper bound per chunk (rounded down to whole blocks, at least one block).

    Yields:
        (start, stop) in elements.
    """
    step = max(blocksize, (max_elements // blocksize) * blocksize)
    for s in range(0, n, step):
        yield s, min(n, s + step)

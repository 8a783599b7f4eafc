"""What ``--to nf4|fp4`` asks for: quant type, blocksize, double quantization, storage dtype.

The fields of transformers' ``BitsAndBytesConfig`` that shape the saved tensors, checked once
(QNT-001 quant type, QNT-002 blocksize, QNT-004 storage dtype), and what follows from them for one
weight: its :class:`~formats.bnb.QuantState` and the shape of its stored packed codes
(``bnb_4bit_quant_storage``: bnb views the packed bytes as that dtype, ``packed.squeeze().view(...)``;
QNT-005 when the bytes do not fill whole elements).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from convert.bnb4.absmax8 import NESTED_BLOCKSIZE
from convert.bnb4.encode import check_blocksize, codec
from convert.bnb4.torch_reduce import TORCH_NUM_THREADS
from formats.bnb import QuantState
from formats.errors import QuantStorageOptionError, QuantStorageSizeError

__all__ = ["QUANT_STORAGES", "QuantSettings", "storage_dtype"]

#: ``bnb_4bit_quant_storage`` values: the dtype the packed bytes are stored under.
QUANT_STORAGES = ("uint8", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class QuantSettings:
    """What ``--to nf4|fp4`` asks for (``BitsAndBytesConfig`` fields in brackets).

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"`` [bnb_4bit_quant_type].
        blocksize: elements per absmax block, 32..4096 (transformers always uses 64).
        nested: double quantization of absmax [bnb_4bit_use_double_quant].
        quant_storage: dtype the packed bytes are stored under [bnb_4bit_quant_storage].
        num_threads: torch thread count the nested mean is reproduced for.
    """

    quant_type: str = "nf4"
    blocksize: int = 64
    nested: bool = True
    quant_storage: str = "uint8"
    num_threads: int = TORCH_NUM_THREADS

    def __post_init__(self) -> None:
        codec(self.quant_type)  # QNT-001
        check_blocksize(self.blocksize)
        if self.quant_storage not in QUANT_STORAGES:
            raise QuantStorageOptionError("quant storage must be uint8, bfloat16, float16 or float32",
                                          expected=list(QUANT_STORAGES), found=self.quant_storage)

    def state(self, shape: tuple[int, ...], dtype: str, nested_offset: float | None = None) -> QuantState:
        """The :class:`QuantState` of a weight of ``shape`` and torch dtype name ``dtype``."""
        if self.nested:
            return QuantState(self.quant_type, self.blocksize, dtype, tuple(shape), True,
                              NESTED_BLOCKSIZE, "float32", nested_offset)
        return QuantState(self.quant_type, self.blocksize, dtype, tuple(shape))

    def storage_shape(self, n: int, name: str | None = None) -> tuple[int, int]:
        """Shape of the stored ``P.weight`` for n elements: ``[ceil(n/2) / itemsize, 1]``.

        Raises:
            QuantStorageSizeError: QNT-005, ceil(n/2) bytes do not fill whole storage elements (bnb's
                ``packed.squeeze().view(quant_storage)`` fails there too).
        """
        nbytes = -(-n // 2)
        item = np.dtype(storage_dtype(self.quant_storage)).itemsize
        if nbytes % item:
            raise QuantStorageSizeError(
                f"the packed codes cannot be stored as {self.quant_storage}", tensor=name,
                expected=f"ceil(n/2) a multiple of {item} bytes", found=nbytes,
                hint="use --quant-storage uint8, or skip this tensor",
            )
        return (nbytes // item, 1)


def storage_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a ``quant_storage`` name (``bfloat16`` is ml_dtypes')."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)

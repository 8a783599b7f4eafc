"""The one dtype table: safetensors codes, NumPy dtypes and torch/transformers names.

Every other module looks dtypes up here, so the three spellings never drift apart.

==========  ===========================  ===================  ========
safetensors NumPy                         torch name           itemsize
==========  ===========================  ===================  ========
F64         float64                       float64              8
F32         float32                       float32              4
F16         float16                       float16              2
BF16        ml_dtypes.bfloat16            bfloat16             2
I64/I32/    int64/int32/int16/int8        int64/.../int8       8/4/2/1
I16/I8
U8/U16/     uint8/uint16/uint32/uint64    uint8/...            1/2/4/8
U32/U64
BOOL        bool                          bool                 1
F8_E4M3     ml_dtypes.float8_e4m3fn       float8_e4m3fn        1
F8_E5M2     ml_dtypes.float8_e5m2         float8_e5m2          1
==========  ===========================  ===================  ========
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DType", "BY_CODE", "BY_NAME", "FLOAT_OUTPUTS", "by_code", "by_name", "by_numpy", "float_dtype_name"]


@dataclass(frozen=True)
class DType:
    """One row of the dtype table.

    Attributes:
        code: the safetensors header spelling, e.g. ``"BF16"``.
        name: the torch / transformers spelling, e.g. ``"bfloat16"``.
        numpy: the NumPy dtype (bf16 and fp8 come from ml_dtypes).
        itemsize: bytes per element.
        is_float: floating point (eligible as a dequantization output).
    """

    code: str
    name: str
    numpy: np.dtype
    itemsize: int
    is_float: bool


def _row(code: str, name: str, npdt: object, is_float: bool) -> DType:
    dt = np.dtype(npdt)  # type: ignore[call-overload]
    return DType(code, name, dt, dt.itemsize, is_float)


_ROWS = [
    _row("F64", "float64", np.float64, True),
    _row("F32", "float32", np.float32, True),
    _row("F16", "float16", np.float16, True),
    _row("BF16", "bfloat16", ml_dtypes.bfloat16, True),
    _row("F8_E4M3", "float8_e4m3fn", ml_dtypes.float8_e4m3fn, True),
    _row("F8_E5M2", "float8_e5m2", ml_dtypes.float8_e5m2, True),
    _row("I64", "int64", np.int64, False),
    _row("I32", "int32", np.int32, False),
    _row("I16", "int16", np.int16, False),
    _row("I8", "int8", np.int8, False),
    _row("U64", "uint64", np.uint64, False),
    _row("U32", "uint32", np.uint32, False),
    _row("U16", "uint16", np.uint16, False),
    _row("U8", "uint8", np.uint8, False),
    _row("BOOL", "bool", np.bool_, False),
]

BY_CODE: dict[str, DType] = {r.code: r for r in _ROWS}
BY_NAME: dict[str, DType] = {r.name: r for r in _ROWS}
_BY_NUMPY: dict[np.dtype, DType] = {r.numpy: r for r in _ROWS}

#: The dtypes a dequantized tensor may be written in (``--to``).
FLOAT_OUTPUTS = ("bfloat16", "float16", "float32")


def by_code(code: str) -> DType | None:
    """Row for a safetensors dtype code (``"BF16"``), or None if unknown."""
    return BY_CODE.get(code)


def by_name(name: str) -> DType | None:
    """Row for a torch dtype name; accepts ``"torch.bfloat16"`` and ``"bfloat16"``."""
    return BY_NAME.get(name.removeprefix("torch."))


def float_dtype_name(value: Any) -> str | None:
    """The float dtype a config or QuantState names: ``"bfloat16"``, ``"torch.bfloat16"`` -> ``"bfloat16"``.

    Returns:
        One of :data:`FLOAT_OUTPUTS`, or None when ``value`` is not a string naming one of them.
    """
    if not isinstance(value, str):
        return None
    name = str(value).removeprefix("torch.")
    return name if name in FLOAT_OUTPUTS else None


def by_numpy(dtype: np.dtype) -> DType:
    """Row for a NumPy dtype. Raises KeyError for dtypes outside the table."""
    return _BY_NUMPY[np.dtype(dtype)]

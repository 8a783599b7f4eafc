#!/usr/bin/env python3
"""Exhaustive check: NumPy's float32 -> float16 cast equals round-to-nearest-even on every fp32 value.

Runs every one of the 2^32 float32 bit patterns through ``ndarray.astype(np.float16)`` and through the
integer rounding convert-bnb used before (:func:`_round_f16_bits` below, F. Giesen's
``float_to_half_fast3_rtne``, verified bit for bit against bitsandbytes' fp16 output), for every finite
value; infinities must stay infinities and NaNs NaNs. A difference is printed with its bits and the
check exits 1.

    python scripts/check_f16_cast.py              # all 2^32 patterns (about 10 minutes on 2 cores)
    python scripts/check_f16_cast.py --chunks 4   # the first 4 of 256 chunks of 2^24
    python scripts/check_f16_cast.py --normal     # the float16 kernels' integer routes on their domains

``--normal`` checks instead the integer roundings the float16 kernels use on every float32 value of
their domains, from the products of :func:`convert.dequant.kernels_f16.signed_quad_lut` (``x * 2^-112``, or
``x * 2^-80`` for a negative ``x``): :func:`convert.dequant.kernels_f16.f16_bits_of_signed` (``--to fp16``) against
NumPy's float16 cast (``2^-14 <= |x| < 65504``, both signs, 503,300,096 patterns) and
:func:`convert.dequant.kernels_f16.f16_bits_of_bf16` (GGUF F16 of a bf16 layer) of ml_dtypes' bfloat16 cast
against ml_dtypes' bfloat16 cast of ``x`` followed by NumPy's float16 cast (``2^-14 <= |x| < 65280``,
both signs, 503,185,408 patterns), and +0. Run on NumPy 2.4.6 and ml_dtypes 0.6.0, 2026-12-03: all
equal.

This is the evidence behind :func:`convert.dequant.kernels.round_float32` using NumPy's cast for float16. Run
on NumPy 2.4.6, 2026-12-02: all 4,294,967,296 patterns equal (1,645 s on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import numpy.typing as npt

CHUNK = 1 << 24


def _round_f16_bits(u: npt.NDArray[np.uint32], out: npt.NDArray[np.uint16]) -> None:
    """fp32 bits -> IEEE half bits, round to nearest even (overflow -> inf, subnormals exact).

    Finite inputs only. The method of F. Giesen's ``float_to_half_fast3_rtne`` (public domain).
    """
    sign = np.right_shift(u, 16) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    # normal half range: rebias the exponent and round the mantissa to 10 bits
    odd = np.right_shift(a, 13) & np.uint32(1)
    norm = a + np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # wraps for small a: masked below
    norm += odd
    norm >>= np.uint32(13)
    # subnormal half range: let the FPU round x + 0.5 (ulp 2^-24)
    magic = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)
    sub = (a.view(np.float32) + magic.view(np.float32)).view(np.uint32) - magic
    res = np.where(a < np.uint32(113 << 23), sub, norm)
    res = np.where(a >= np.uint32((127 + 16) << 23), np.uint32(0x7C00), res)
    np.bitwise_or(res, sign, out=out, casting="unsafe")


def check_normal() -> int:
    """:func:`convert.dequant.kernels_f16.f16_bits_of_signed` and
    :func:`convert.dequant.kernels_f16.f16_bits_of_bf16` against the casts they replace, on every pattern of
    their domains, both signs, and +0."""
    import ml_dtypes

    from convert.dequant.kernels_f16 import f16_bits_of_bf16, f16_bits_of_signed

    def scaled(u: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
        # the kernels' products: the bits of x * 2^-112 (x > 0) or x * 2^-80 (x < 0), exact for these normal
        # x (the exponent field less 112 or 80; signed_quad_lut)
        neg = u >= np.uint32(0x80000000)
        return u - np.where(neg, np.uint32(80 << 23), np.uint32(112 << 23)).astype(np.uint32)

    def f16(u: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]:
        with np.errstate(over="ignore"):
            return u.view(np.float32).astype(np.float16).view(np.uint16)

    def f16_of_bf16(u: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]:
        return u.view(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32).astype(np.float16).view(np.uint16)

    def signed(u: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]:
        return f16_bits_of_signed(scaled(u), np.empty_like(u), np.empty(u.size, np.uint16))

    def of_bf16(u: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]:
        b = scaled(u).view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)  # the multiply's rounding
        return f16_bits_of_bf16(b, np.empty(u.size, np.uint16))

    t = time.perf_counter()
    # 2^-14 .. 65504 (the largest float16) and .. 65280 (the largest bfloat16 below 65504), both signs
    for fn, ref, lo, hi in ((signed, f16, 0x38800000, 0x477FE000), (signed, f16, 0xB8800000, 0xC77FE000),
                            (of_bf16, f16_of_bf16, 0x38800000, 0x477F0000),
                            (of_bf16, f16_of_bf16, 0xB8800000, 0xC77F0000)):
        for c in range(lo, hi, CHUNK):
            u = np.arange(c, min(hi, c + CHUNK), dtype=np.uint32)
            got, want = fn(u), ref(u)
            bad = np.flatnonzero(got != want)
            if bad.size:
                i = int(bad[0])
                print(f"differs at fp32 bits {int(u[i]):#010x}: reference {int(want[i]):#06x}, "
                      f"{fn.__name__} {int(got[i]):#06x}")
                return 1
        print(f"{fn.__name__}: {hi - lo:,} bit patterns ({lo:#010x} <= bits < {hi:#010x}), equal to {ref.__name__} "
              f"(NumPy {np.__version__}, ml_dtypes {ml_dtypes.__version__})")
    zero = np.zeros(1, np.uint32)  # +0 scales to itself (a -0.0 code is refused by the route)
    if (f16_bits_of_signed(zero, np.empty_like(zero), np.empty(1, np.uint16)).tolist() != [0]
            or f16_bits_of_bf16(np.zeros(1, np.uint16), np.empty(1, np.uint16)).tolist() != [0]):
        print("+0 does not stay +0")
        return 1
    print(f"({time.perf_counter() - t:.0f} s)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=(1 << 32) // CHUNK)
    ap.add_argument("--normal", action="store_true", help="check the float16 kernels' integer routes instead")
    a = ap.parse_args()
    if a.normal:
        return check_normal()
    t = time.perf_counter()
    checked = 0
    for c in range(a.chunks):
        u = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype=np.uint64).astype(np.uint32)
        with np.errstate(over="ignore", invalid="ignore"):
            got = u.view(np.float32).astype(np.float16).view(np.uint16)
        finite = np.isfinite(u.view(np.float32))
        want = np.empty(u.size, dtype=np.uint16)
        with np.errstate(invalid="ignore"):  # NaN inputs take the integer path too; only finite ones count
            _round_f16_bits(u, want)
        x = u.view(np.float32)
        bad = np.flatnonzero(finite & (got != want))
        # NaN -> a NaN, inf -> inf of the same sign (payloads are not part of the contract)
        same_special = np.where(np.isnan(x), np.isnan(got.view(np.float16)), got == (u >> 16) & 0xFC00)
        bad_special = np.flatnonzero(~finite & ~same_special)
        if bad.size or bad_special.size:
            i = int(bad[0] if bad.size else bad_special[0])
            print(f"differs at fp32 bits {int(u[i]):#010x}: NumPy {int(got[i]):#06x}, before {int(want[i]):#06x}")
            return 1
        checked += u.size
    print(f"float32 -> float16: {checked:,} bit patterns, NumPy {np.__version__}'s cast equals the integer rounding "
          f"on every finite value, inf stays inf and NaN NaN ({time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

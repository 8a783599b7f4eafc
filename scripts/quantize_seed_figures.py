"""Print the seed figures of re-quantization: NF4/FP4 error and size on N(0, 0.02) at blocksize 64.

Usage: python scripts/quantize_seed_figures.py [--size 4096] [--seed 0]

Expected for 4096x4096 (issue 7): NF4 relative Frobenius error about 0.092, 4.127 bits per weight
with double quantization (4 + 8/64 + 32/(64*256)).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from convert.bnb4.layer import quantize_layer  # noqa: E402
from convert.bnb4.report import quantization_report  # noqa: E402
from convert.bnb4.settings import QuantSettings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="rows = columns of the matrix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocksize", type=int, default=64)
    args = ap.parse_args(argv)
    x = (np.random.default_rng(args.seed).standard_normal((args.size, args.size)) * 0.02).astype(np.float32)
    print(f"N(0, 0.02) {args.size}x{args.size} float32, blocksize {args.blocksize}, seed {args.seed}")
    print(f"{'setting':<14} {'rel_error':>10} {'bits/weight':>12} {'zero_share':>11} {'seconds':>8}")
    for qt in ("nf4", "fp4"):
        for nested in (True, False):
            t0 = time.perf_counter()
            arrays = quantize_layer(x, "float32", QuantSettings(qt, args.blocksize, nested))
            rep = quantization_report("w", x, arrays)
            dt = time.perf_counter() - t0
            name = f"{qt} {'dq' if nested else 'nodq'}"
            print(f"{name:<14} {rep.rel_error:>10.5f} {rep.bits_per_weight:>12.5f} {rep.zero_share:>11.5f} "
                  f"{dt:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

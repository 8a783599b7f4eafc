"""How often convert-bnb's LoRA merge differs from PEFT's on real-sized layers, and by how much.

For every tensor a PEFT LoRA adapter touches: the base weight as convert-bnb dequantizes it (``--to bf16``,
bit-exact with bnb), merged by convert-bnb (``--to bf16 --merge-lora``) and by PEFT itself (a
``peft.tuners.lora.Linear`` around a bf16 ``torch.nn.Linear`` holding that base weight, the adapter's
A and B loaded, ``merge()``: PEFT's own code path, torch's CPU sgemm). Prints, per tensor and in all,
the values that differ and the largest difference in bf16 ulps (as JSON lines, then a summary table).

    python scripts/bench.py make --packed-gb 0.5 --dir bench-data/m          # 7B-shaped blocks
    python scripts/bench.py make-lora --model bench-data/m --dir bench-data/lora16 --rank 16
    python scripts/peft_diff.py --model bench-data/m --adapter bench-data/lora16 [--alpha 7] [--rslora]

Needs torch and peft (test-time dependencies); ``--alpha`` / ``--rslora`` override the adapter config's
(a copy of the adapter directory is made), to try scales that are not powers of two.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in bf16 ulps (distance on the ordered bf16 bit patterns), uint16 views in, int64 out."""
    def ordered(x: np.ndarray) -> np.ndarray:
        v = x.astype(np.int64)
        return np.where(v & 0x8000, 0x8000 - (v & 0x7FFF), 0x8000 + v)
    return np.abs(ordered(a) - ordered(b))


def _f64(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as float64 values."""
    return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _ulps_at_scale(magnitude: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| (uint16 bf16 views) in bf16 ulps of ``magnitude`` (float64, per element): the size of a
    difference against what was summed, which cancellation can make far larger than the result."""
    _, exp = np.frexp(np.maximum(magnitude, np.finfo(np.float32).tiny))
    return np.abs(_f64(a) - _f64(b)) / np.ldexp(1.0, exp - 8)  # bf16: 8 significant bits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a bnb 4-bit model directory")
    ap.add_argument("--adapter", type=Path, required=True, help="a PEFT LoRA adapter directory")
    ap.add_argument("--alpha", type=float, default=None, help="override lora_alpha")
    ap.add_argument("--rslora", action="store_true", help="set use_rslora")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch  # (test-time dependencies: the reference is PEFT's own merge)
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraConfig

    from formats.safetensors import SafetensorsReader

    with tempfile.TemporaryDirectory(prefix="peft-diff-") as tmp:
        work = Path(tmp)
        adapter = args.adapter
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        if args.alpha is not None or args.rslora:
            adapter = work / "adapter"
            shutil.copytree(args.adapter, adapter)
            cfg.update({k: v for k, v in (("lora_alpha", args.alpha), ("use_rslora", args.rslora or None))
                        if v is not None})
            (adapter / "adapter_config.json").write_text(json.dumps(cfg))
        base_out, merged_out = work / "base", work / "merged"
        for out, extra in ((base_out, []), (merged_out, ["--merge-lora", str(adapter)])):
            subprocess.run([sys.executable, "-m", "convert", str(args.model), "--to", "bf16", "-o", str(out), "-q",
                            "--threads", str(args.threads), *extra], cwd=ROOT, check=True)
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        base = SafetensorsReader(base_out / "model.safetensors")
        merged = SafetensorsReader(merged_out / "model.safetensors")
        ad = SafetensorsReader(adapter / "adapter_model.safetensors")
        total = differ = worst = 0
        worst_scaled = 0.0
        rows = []
        for key in sorted(k for k in ad.tensors if k.endswith(".lora_A.weight")):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            a = torch.from_numpy(np.asarray(ad.array(key), dtype=np.float32).copy())
            b = torch.from_numpy(np.asarray(ad.array(key.replace("lora_A", "lora_B")), dtype=np.float32).copy())
            w = base.array(name)
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight.data = torch.from_numpy(w.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
            rs = bool(cfg.get("use_rslora"))
            layer = LoraLinear(lin, "default", LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs), r=r,
                               lora_alpha=alpha, use_rslora=rs)
            layer.lora_A["default"].weight.data = a
            layer.lora_B["default"].weight.data = b
            layer.merge()
            want = layer.base_layer.weight.data.view(torch.int16).numpy().view(np.uint16)
            got = merged.array(name).view(np.uint16)
            d = _ulps(got, want)
            n_diff = int(np.count_nonzero(d))
            # what the merge sums, |W| and the delta's terms (scale * sum_k |B_ik| |A_kj|, float64), and the result
            scale = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
            terms = scale * (np.abs(b.numpy().astype(np.float64)) @ np.abs(a.numpy().astype(np.float64)))
            result = np.maximum(np.abs(_f64(got)), np.abs(_f64(want)))
            magnitude = np.maximum(np.maximum(np.abs(_f64(w.view(np.uint16))), terms), result)
            scaled = _ulps_at_scale(magnitude, got, want)
            rows.append({"tensor": name, "shape": list(w.shape), "values": int(d.size), "differ": n_diff,
                         "max_ulp": int(d.max()), "max_ulp_at_summed_scale": float(scaled.max())})
            print(json.dumps(rows[-1]), flush=True)
            total += d.size
            differ += n_diff
            worst = max(worst, int(d.max()))
            worst_scaled = max(worst_scaled, float(scaled.max()))
        print(f"r {r}, alpha {alpha:g}, scale {scale:g}: {differ} of {total:,} values differ from PEFT "
              f"({differ / total * 1e6:.2f} per million), largest {worst} bf16 ulp of the result, "
              f"{worst_scaled:g} bf16 ulp at the scale of what is summed (max(|W|, scale * |B| @ |A|, |W'|)); "
              f"torch {torch.__version__}")
        for reader in (base, merged, ad):
            reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

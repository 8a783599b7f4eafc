#!/usr/bin/env python3
"""Error of two routes to a K-quant GGUF, against the exact fp32 dequantized weights.

- direct (convert-bnb): bnb -> fp32 dequantized -> ``--to gguf:TYPE`` (one quantization);
- usual: bnb -> ``--to bf16`` (a 16-bit copy on disk) -> GGUF F16 (``convert_hf_to_gguf.py
  --outtype f16``; our ``--to gguf:f16`` writes the same bytes) -> ``llama-quantize TYPE``
  (``llama_cpp.llama_model_quantize``), so the quantizer sees values rounded twice.

The reference is our ``--to gguf:f32`` (the fp32 dequantized weights in GGUF's layout). For every
quantized tensor both files are decoded (gguf-py) and compared with it; prints one JSON line per
route with the RMS error over all quantized weights, relative to their RMS, and how many tensors the
direct route is closer on. Needs llama-cpp-python.

    python scripts/kquant_routes.py tests/fixtures/models/llama_nf4_dq --type q4_k_m
    python scripts/kquant_routes.py bench-data/1l --type q4_k_m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from make_kquant_goldens import llama_quantize  # noqa: E402  (this folder is on sys.path when run)


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "convert", *args, "-q"], check=True, cwd=ROOT)


def decoded(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1))
            for t in gguf.GGUFReader(path).tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a bnb 4-bit model directory")
    ap.add_argument("--type", default="q4_k_m")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.model.parent) as d:
        tmp = Path(d)
        cli(str(a.model), "--to", "gguf:f32", "-o", str(tmp / "ref.gguf"))
        cli(str(a.model), "--to", f"gguf:{a.type}", "-o", str(tmp / "direct.gguf"))
        cli(str(a.model), "--to", "bf16", "-o", str(tmp / "bf16"))
        cli(str(tmp / "bf16"), "--to", "gguf:f16", "-o", str(tmp / "f16.gguf"))
        llama_quantize(tmp / "f16.gguf", tmp / "usual.gguf", a.type, nthread=2)
        ref = decoded(tmp / "ref.gguf")
        routes = {"direct": decoded(tmp / "direct.gguf"), "usual": decoded(tmp / "usual.gguf")}
    names = [n for n, (_, x) in ref.items() if routes["direct"][n][0] not in ("F32", "F16", "BF16") and x.size]
    sq_ref = sum(float(np.square(ref[n][1], dtype=np.float64).sum()) for n in names)
    per: dict[str, dict[str, float]] = {r: {} for r in routes}
    for r, files in routes.items():
        for n in names:
            per[r][n] = float(np.square(files[n][1] - ref[n][1], dtype=np.float64).sum())
    closer = sum(per["direct"][n] < per["usual"][n] for n in names)
    same = sum(per["direct"][n] == per["usual"][n] for n in names)
    n_el = sum(ref[n][1].size for n in names)
    for r in routes:
        total = sum(per[r].values())
        print(json.dumps({"model": a.model.name, "type": a.type, "route": r, "tensors": len(names),
                          "weights": n_el, "rms_error": float(np.sqrt(total / n_el)),
                          "rel_rms_error": float(np.sqrt(total / sq_ref))}))
    print(json.dumps({"model": a.model.name, "type": a.type, "direct_closer_on": closer, "equal_on": same,
                      "usual_closer_on": len(names) - closer - same}))


if __name__ == "__main__":
    main()

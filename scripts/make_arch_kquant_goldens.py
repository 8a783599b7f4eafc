#!/usr/bin/env python3
"""Golden hashes of llama-quantize's output for each GGUF architecture fixture, for every ``--to gguf:MIX``.

For each ``tests/fixtures/models/<arch>_nf4_dq`` of tests/test_gguf_arch.py and each file type of
:data:`convert.gguf_mix.FILE_TYPES`, runs ``llama_cpp.llama_model_quantize`` (llama.cpp as vendored in
llama-cpp-python 0.3.36; default parameters, one thread) on our ``--to gguf:f32`` of the fixture and
records every tensor's GGML type and the sha256 of its bytes in the fixture's
``reference/gguf_kquant_sha256.json`` (as scripts/make_kquant_goldens.py does for llama_nf4_dq).

    python scripts/make_arch_kquant_goldens.py
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from convert.gguf_mix import FILE_TYPES  # noqa: E402
from convert.gguf_plan import OUTPUT_TYPES  # noqa: E402

ARCHS = ("qwen3", "gemma2", "gemma3", "mistral_hd", "phi3")


def llama_quantize(src: Path, dst: Path, mix: str) -> None:
    """``llama_model_quantize`` with the default parameters, one thread, the mix's ftype."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = int(OUTPUT_TYPES[mix][1])
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {mix}")


def tensor_hashes(path: Path) -> dict[str, list[str]]:
    return {t.name: [t.tensor_type.name, hashlib.sha256(np.asarray(t.data).view(np.uint8).tobytes()).hexdigest()]
            for t in gguf.GGUFReader(path).tensors}


def main() -> None:
    for arch in ARCHS:
        fixture = ROOT / "tests" / "fixtures" / "models" / f"{arch}_nf4_dq"
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / "f32.gguf"
            subprocess.run([sys.executable, "-m", "convert", str(fixture), "--to", "gguf:f32", "-o", str(f32), "-q"],
                           check=True, cwd=ROOT)
            golden = {}
            for mix in FILE_TYPES:
                out = Path(tmp) / f"{mix}.gguf"
                llama_quantize(f32, out, mix)
                golden[mix] = tensor_hashes(out)
        path = fixture / "reference" / "gguf_kquant_sha256.json"
        path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        print(path, len(golden), "file types")


if __name__ == "__main__":
    main()

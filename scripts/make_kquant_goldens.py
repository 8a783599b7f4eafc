#!/usr/bin/env python3
"""Golden hashes of llama-quantize's output for the fixture models, for every ``--to gguf:MIX``.

For each file type of :data:`convert.gguf.types.FILE_TYPES`, runs ``llama_cpp.llama_model_quantize``
(llama.cpp as vendored in llama-cpp-python 0.3.36; default parameters, one thread) on our
``--to gguf:f32`` of a fixture model and records every tensor's GGML type and the sha256 of its bytes:
for ``tests/fixtures/models/llama_nf4_dq`` in ``tests/fixtures/gguf_mix_sha256.json``
(tests/gguf/test_kquant.py), for each architecture fixture ``<arch>_nf4_dq`` of
tests/gguf/test_arch.py in its ``reference/gguf_kquant_sha256.json``. The tests compare our own
``--to gguf:MIX`` files with them where llama_cpp is not installed (and, where it is, with what
llama.cpp makes).

    python scripts/make_kquant_goldens.py            # llama_nf4_dq and every architecture fixture
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

from convert.gguf.types import FILE_TYPES, OUTPUT_TYPES  # noqa: E402
from tests.helpers.fixtures import arch_fixtures  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "models" / "llama_nf4_dq"
GOLDEN = ROOT / "tests" / "fixtures" / "gguf_mix_sha256.json"


def llama_quantize(src: Path, dst: Path, mix: str, nthread: int = 1) -> None:
    """``llama_model_quantize`` with the default parameters, ``nthread`` threads, the mix's ftype."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = nthread
    params.ftype = int(OUTPUT_TYPES[mix][1])
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {mix}")


def tensor_hashes(path: Path) -> dict[str, list[str]]:
    """name -> [GGML type name, sha256 of the tensor's bytes], sorted by name."""
    return {t.name: [t.tensor_type.name, hashlib.sha256(np.asarray(t.data).view(np.uint8).tobytes()).hexdigest()]
            for t in sorted(gguf.GGUFReader(path).tensors, key=lambda t: t.name)}


def mix_hashes(fixture: Path, tmp: Path) -> dict[str, dict[str, list[str]]]:
    """mix -> :func:`tensor_hashes` of llama-quantize's output from our ``--to gguf:f32`` of ``fixture``."""
    f32 = tmp / "f32.gguf"
    subprocess.run([sys.executable, "-m", "convert", str(fixture), "--to", "gguf:f32", "-o", str(f32), "-q",
                    "--overwrite"], check=True, cwd=ROOT)
    out = {}
    for mix in (m for m, ft in FILE_TYPES.items() if not ft.needs_imatrix):  # (q2_k_s: with an imatrix only)
        dst = tmp / f"{mix}.gguf"
        llama_quantize(f32, dst, mix)
        out[mix] = tensor_hashes(dst)
        dst.unlink()
    return out


def main() -> None:
    import llama_cpp

    for arch in arch_fixtures():
        fixture = FIXTURE.parent / f"{arch}_nf4_dq"
        with tempfile.TemporaryDirectory() as d:
            golden = mix_hashes(fixture, Path(d))
        path = fixture / "reference" / "gguf_kquant_sha256.json"
        path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(ROOT)} ({len(golden)} file types)")
    with tempfile.TemporaryDirectory() as d:
        out: dict[str, object] = {"made_by": f"llama_cpp.llama_model_quantize, llama-cpp-python "
                                             f"{llama_cpp.__version__}, nthread 1, default parameters, "
                                             f"on our --to gguf:f32 of {FIXTURE.relative_to(ROOT)}"}
        out.update(mix_hashes(FIXTURE, Path(d)))
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)} ({GOLDEN.stat().st_size} bytes, {len(FILE_TYPES)} file types)")


if __name__ == "__main__":
    main()

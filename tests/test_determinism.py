"""Same input, same bytes, on any CPU: every kind of job (LoRA merges, bf16, nf4, GGUF K-quants) run in
subprocesses under several OpenBLAS kernels (``OPENBLAS_CORETYPE``), with NumPy's SIMD dispatch narrowed
(``NPY_DISABLE_CPU_FEATURES``), with one and two threads, gives the same files byte for byte. (With an
sgemm product, ``Sandybridge`` changed up to 13 of 21 tensors of these merges by one bf16 ulp.)"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.fixtures import ROOT
from tests.lora.test_lora import LORA, MODELS_DIR, attn_adapter, base_tensors, dora_adapter, write_adapter

#: Each a different sgemm kernel of NumPy's bundled OpenBLAS (``Zen`` runs the ``Haswell`` one).
CORETYPES = ["SkylakeX", "Haswell", "Sandybridge", "Nehalem"]
#: NumPy's dispatch limited to its x86-64-v2 baseline (no AVX2, no AVX-512 loops).
NO_AVX = "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("adapters")
    rng = np.random.default_rng(20)
    rslora = write_adapter(tmp / "rslora", {"r": 16, "lora_alpha": 7, "use_rslora": True},
                           attn_adapter(rng, {m: 16 for m in attn_modules()}))
    dora = write_adapter(tmp / "dora", {"use_dora": True}, dora_adapter(rng, base_tensors()))
    return [LORA / "adapter", rslora, dora]


def attn_modules() -> list[str]:
    from tests.lora.test_lora import ATTN

    return ATTN


def _run(args: list[str], out: Path, env: dict[str, str], threads: int) -> dict[str, str]:
    """sha256 of every file of ``convert-bnb llama_nf4_dq ARGS -o OUT`` run in a fresh process under ``env``."""
    cmd = [sys.executable, "-m", "convert", str(MODELS_DIR / "llama_nf4_dq"), *args, "-o", str(out), "-q",
           "--threads", str(threads)]
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    files = sorted(out.iterdir()) if out.is_dir() else [out]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _same_everywhere(args: list[str], tmp_path: Path, thread_counts: tuple[int, ...]) -> None:
    runs = {f"{c} threads={t}": _run(args, tmp_path / f"{c}-{t}" / "out", {"OPENBLAS_CORETYPE": c}, t)
            for c in CORETYPES for t in thread_counts}
    runs["no AVX"] = _run(args, tmp_path / "noavx" / "out", {"NPY_DISABLE_CPU_FEATURES": NO_AVX}, 2)
    first = next(iter(runs.values()))
    assert first
    assert {k: v == first for k, v in runs.items()} == dict.fromkeys(runs, True)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["fixture", "rslora", "dora"])
def test_merge_bytes_do_not_depend_on_the_cpu(adapters: list[Path], tmp_path: Path, which: int) -> None:
    _same_everywhere(["--to", "bf16", "--merge-lora", str(adapters[which])], tmp_path, (1, 2))


@pytest.mark.parametrize("to", ["bf16", "nf4", "gguf:q4_k_m", "gguf:q8_0"])
def test_conversion_bytes_do_not_depend_on_the_cpu(tmp_path: Path, to: str) -> None:
    _same_everywhere(["--to", to], tmp_path, (2,))

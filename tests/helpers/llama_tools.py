"""llama.cpp's command-line tools (llama-quantize, llama-imatrix, llama-gguf-split) for the tests that
compare our output with theirs: built by ``scripts/build_llama_tools.sh`` (CI does), found in
``$LLAMA_CPP_BIN``, on ``PATH`` or in ``.ci-cache/llama-build/bin``; tests needing one skip without it.
Its Python scripts (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``) at the pinned revision are found in
``$LLAMA_CPP_SRC`` or ``.ci-cache/llama_cpp_python-0.3.36/vendor/llama.cpp`` (:func:`llama_script`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def find_tool(name: str) -> Path | None:
    """The path of llama.cpp's tool ``name`` (e.g. ``"llama-gguf-split"``), or None."""
    for d in (os.environ.get("LLAMA_CPP_BIN"), str(ROOT / ".ci-cache" / "llama-build" / "bin")):
        if d and (Path(d) / name).is_file():
            return Path(d) / name
    found = shutil.which(name)
    return Path(found) if found else None


def llama_tool(name: str) -> Path:
    """:func:`find_tool`, or skip the test."""
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} not built (scripts/build_llama_tools.sh)")
    return path


def run_tool(name: str, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """Run tool ``name`` with ``args``; fail the test with its output when it exits non-zero."""
    proc = subprocess.run([str(llama_tool(name)), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{name} {' '.join(map(str, args))}: exit {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def llama_script(name: str) -> Path:
    """llama.cpp's Python script ``name`` (``convert_lora_to_gguf.py``) at the pinned revision, or skip the test."""
    for d in (os.environ.get("LLAMA_CPP_SRC"), str(ROOT / ".ci-cache" / "llama_cpp_python-0.3.36" / "vendor"
                                                    / "llama.cpp")):
        if d and (Path(d) / name).is_file():
            return Path(d) / name
    pytest.skip(f"no llama.cpp source with {name} (LLAMA_CPP_SRC, .ci-cache)")

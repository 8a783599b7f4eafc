"""Fixture paths, readers and bit-exact comparisons shared by the test modules.

Every path of the tests is built from :data:`ROOT` here, so a test module's place under tests/ does not
change where it reads or runs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

#: The repository root: the working directory and PYTHONPATH of the subprocess tests.
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
#: tests/harness: its sitecustomize.py holds a subprocess at a named point (on PYTHONPATH only in tests).
HARNESS = ROOT / "tests" / "harness"
SINGLE = FIXTURES / "single"
MODELS = FIXTURES / "models"
PEER = FIXTURES / "peer"
#: The dequantized reference of each quantized model (nf4_dq variants share one, deduplicated).
REFERENCES = {
    "llama_nf4_dq": MODELS / "llama_nf4_dq/reference/dequantized.safetensors",
    "llama_nf4_dq_sharded": MODELS / "llama_nf4_dq/reference/dequantized.safetensors",
    "llama_nf4_dq_qsbf16": MODELS / "llama_nf4_dq/reference/dequantized.safetensors",
    "llama_nf4_dq_bin": MODELS / "llama_nf4_dq/reference/dequantized.safetensors",
    "llama_fp4_nodq": MODELS / "llama_fp4_nodq/reference/dequantized.safetensors",
    "llama_int8": MODELS / "llama_int8/reference/dequantized.safetensors",
}


def arch_fixtures() -> list[str]:
    """The architecture fixtures (``MODELS/<arch>_nf4_dq`` with llama.cpp's converter output in
    ``reference/``, made by scripts/make_arch_fixtures.py), by name."""
    return sorted(p.parent.parent.name.removesuffix("_nf4_dq") for p in MODELS.glob("*_nf4_dq/reference/gguf_f16.json"))


def plan_inputs(root: Path) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """A model directory's config.json and the (name, shape) of every tensor its dequantization plan writes
    (what :func:`convert.gguf.plan.plan_gguf` is given)."""
    from convert.stream.plan import make_plan
    from formats.checkpoint import open_checkpoint

    shapes = [(t.name, tuple(t.shape)) for t in make_plan(open_checkpoint(root)).tensors]
    return json.loads((root / "config.json").read_text()), shapes


def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


def single_names() -> list[str]:
    return [e["name"] for e in manifest()["single"]]


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float array as unsigned ints of the same width (bit-exact comparison)."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


_NP = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "U8": "u1", "I8": "i1", "I32": "<i4", "I64": "<i8",
       "U16": "<u2", "I16": "<i2", "BOOL": "?"}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A deliberately separate, minimal safetensors reader (not formats.safetensors), so tests do not
    check our reader with itself. bf16 comes back as ml_dtypes.bfloat16."""
    import ml_dtypes

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out: dict[str, np.ndarray] = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        ml = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
        dt = np.dtype(ml[v["dtype"]]) if v["dtype"] in ml else np.dtype(_NP[v["dtype"]])
        b, e = v["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + b : 8 + n + e], dtype=dt).reshape(v["shape"])
    return out


def load_all(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file or of all the .safetensors files of a directory."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(read_safetensors(f))
    return out


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same names, dtypes, shapes and every bit."""
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        mismatches = int(np.count_nonzero(bits(got[k]) != bits(want[k])))
        assert mismatches == 0, f"{k}: {mismatches} mismatching elements"


def rewrite_data(path: Path, names: list[str], fill: int) -> None:
    """Overwrite the data bytes of the named tensors in place, keeping the header."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name in names:
        b, e = header[name]["data_offsets"]
        raw[8 + n + b : 8 + n + e] = bytes([fill]) * (e - b)
    path.write_bytes(bytes(raw))

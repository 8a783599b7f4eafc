"""Importance matrix files as llama-imatrix writes them (its GGUF layout and the legacy ``.dat``), for tests."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

__all__ = ["write_dat_imatrix", "write_gguf_imatrix"]


def write_gguf_imatrix(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]], *,
                       keys: bool = True, datasets: tuple[object, ...] = ("text.txt",), chunks: int = 3) -> Path:
    """An importance matrix in llama-imatrix's GGUF layout: name -> (sums (n_mat, n), counts (n_mat,))."""
    w = gguf.GGUFWriter(str(path), arch="llama")  # (gguf-py always writes general.architecture; llama.cpp ignores it)
    w.add_type("imatrix")
    if keys:
        w.add_array("imatrix.datasets", list(datasets))
        w.add_uint32("imatrix.chunk_count", chunks)
        w.add_uint32("imatrix.chunk_size", 64)
    for name, (sums, counts) in entries.items():
        w.add_tensor(f"{name}.in_sum2", np.asarray(sums, dtype=np.float32))
        w.add_tensor(f"{name}.counts", np.asarray(counts, dtype=np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_dat_imatrix(path: Path, entries: dict[str, tuple[np.ndarray, int]], *, chunks: int | None = 3,
                      dataset: str | None = "text.txt") -> Path:
    """An importance matrix in llama-imatrix's legacy ``.dat`` layout: name -> (values, ncall)."""
    out = struct.pack("<i", len(entries))
    for name, (values, ncall) in entries.items():
        raw = name.encode()
        v = np.asarray(values, dtype="<f4").reshape(-1)
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, v.size) + v.tobytes()
    if chunks is not None:
        out += struct.pack("<i", chunks)
        if dataset is not None:
            out += struct.pack("<i", len(dataset.encode())) + dataset.encode()
    path.write_bytes(out)
    return path

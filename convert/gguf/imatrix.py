"""The importance matrix of ``--imatrix FILE``: what llama-quantize makes of it, for our GGUF plan.

llama-quantize (``tools/quantize/quantize.cpp`` of the llama.cpp revision vendored in llama-cpp-python
0.3.36) reads the file (:func:`formats.imatrix.read_imatrix`), turns each entry into one float32 row per
expert matrix (``load_imatrix``: GGUF sums divided by their count, or all 1 where the count is 0; legacy
values divided by their call count when it is positive), keeps the entries whose name contains an
``--include-weights`` string or drops those containing an ``--exclude-weights`` one (``prepare_imatrix``,
substring match), and, when entries remain, writes the ``quantize.imatrix.*`` keys. ``llama_model_quantize``
then quantizes each weight with its entry's row (its expert's row for an expert tensor), or without one
when the matrix has no entry of that name (:func:`importance_rows`).

Stricter than llama-quantize, which warns and goes on: an entry that names no weight of the output, or
whose size is not the weight's row length times its experts, is refused (IMX-003; llama.cpp refuses a
size mismatch too, except for ``token_embd.weight``, which is quantized without it here as there).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from formats.errors import ImatrixTensorError, ImatrixValuesError
from formats.imatrix import ImatrixFile, read_imatrix

__all__ = ["Importance", "imatrix_keys", "importance_rows", "load_importance"]

#: The largest importance value accepted: a mean of squared activations (legitimate ones stay below about
#: 1e9). Larger values only come from a damaged file, and make the weighted searches overflow to NaN
#: scales, which llama-quantize refuses only after the work (``ggml_validate_row_data``).
MAX_IMPORTANCE = 1e15

#: llama-quantize copies the file name and the first dataset name into 128-byte buffers (127 bytes kept).
_KEY_BYTES = 127


@dataclass(frozen=True)
class Importance:
    """The importance matrix llama-quantize hands to ``llama_model_quantize``.

    Attributes:
        rows: weight GGUF name -> float32 ``(n_mat, n_per_row)`` (one row per expert matrix).
        file: the file name as given on the command line (``quantize.imatrix.file``).
        datasets: the text files it was computed on.
        chunk_count: chunks of text (0: the file does not say).
    """

    rows: dict[str, npt.NDArray[np.float32]]
    file: str
    datasets: tuple[str, ...]
    chunk_count: int


def _normalized(f: ImatrixFile) -> dict[str, npt.NDArray[np.float32]]:
    """``load_imatrix``'s per-entry values, float32 ``(n_mat, n_per_row)``."""
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name, e in f.entries.items():
        if f.legacy:
            ncall = int(e.counts[0])
            out[name] = e.sums / np.float32(ncall) if ncall > 0 else e.sums.copy()
        else:
            counts = e.counts.astype(np.float32)[:, None]  # C: (float) count, then float division
            with np.errstate(divide="ignore", invalid="ignore"):
                out[name] = np.where(counts > 0, e.sums / np.where(counts > 0, counts, np.float32(1)),
                                     np.float32(1)).astype(np.float32)
    return out


def load_importance(path: str | os.PathLike[str], include: Sequence[str] = (),
                    exclude: Sequence[str] = ()) -> Importance | None:
    """Read ``--imatrix`` and filter it as llama-quantize's ``prepare_imatrix`` does.

    Args:
        path: the file, as the user gave it (its string is written as ``quantize.imatrix.file``).
        include: ``--include-weights`` strings: keep only entries whose name contains one.
        exclude: ``--exclude-weights`` strings: drop entries whose name contains one.

    Returns:
        The importance matrix, or None when no entry remains (llama-quantize then quantizes as without
        ``--imatrix`` and writes no ``quantize.imatrix.*`` key).

    Raises:
        ImatrixFormatError: IMX-001. ImatrixValuesError: IMX-002 (:func:`formats.imatrix.read_imatrix`; a
            value above :data:`MAX_IMPORTANCE`).
    """
    f = read_imatrix(path)
    rows = _normalized(f)
    for name, v in rows.items():
        if v.size and float(v.max()) > MAX_IMPORTANCE:
            i = int(np.argmax(v.reshape(-1)))
            raise ImatrixValuesError("an importance value (sum / count) is larger than squared activations can be",
                                     path=os.fspath(path), tensor=name, expected=f"values up to {MAX_IMPORTANCE:g}",
                                     found=f"{float(v.reshape(-1)[i]):g} at index {i}")
    if exclude:
        rows = {k: v for k, v in rows.items() if not any(s in k for s in exclude)}
    if include:
        rows = {k: v for k, v in rows.items() if any(s in k for s in include)}
    if not rows:
        return None
    return Importance(rows, os.fspath(path), f.datasets, f.chunk_count)


def importance_rows(imp: Importance, tensors: Sequence[tuple[str, Sequence[int]]],
                    path: str | None = None) -> dict[str, npt.NDArray[np.float32]]:
    """Each planned weight's importance rows: GGUF name -> float32 ``(n_mat, n_per_row)``.

    Args:
        imp: from :func:`load_importance`.
        tensors: (GGUF name, shape rows first) of every tensor of the output.
        path: the ``--imatrix`` file, for messages.

    Returns:
        The rows of every entry that names a tensor with a matching size (``token_embd.weight`` of another
        size is left out, as llama-quantize leaves it).

    Raises:
        ImatrixTensorError: IMX-003, an entry naming no tensor of the output, or of another size than
            the tensor's row length times its experts (``ne[0] * ne[2]``).
    """
    shapes = {name: tuple(int(d) for d in shape) for name, shape in tensors}
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name, rows in imp.rows.items():
        shape = shapes.get(name)
        if shape is None:
            raise ImatrixTensorError(
                "an importance matrix entry names no weight of this model (made for another model?)",
                path=path, tensor=name, expected="a GGUF tensor name of the output, e.g. "
                + (next(iter(shapes)) if shapes else "blk.0.attn_q.weight"),
                found=f"{len(imp.rows)} entries, this one unknown",
                hint="leave entries out with --exclude-weights NAME")
        n_mat = shape[0] if len(shape) == 3 else 1
        want = shape[-1] * n_mat
        if rows.size != want:
            if name == "token_embd.weight":
                continue
            raise ImatrixTensorError(
                "an importance matrix entry's size is not the weight's row length times its experts "
                "(made for another model?)", path=path, tensor=name,
                expected=f"{shape[-1]} x {n_mat} = {want} values for shape {list(shape)}", found=f"{rows.size}")
        out[name] = rows.reshape(n_mat, shape[-1])
    return out


def imatrix_keys(imp: Importance) -> list[tuple[str, Any, gguf.GGUFValueType]]:
    """The keys llama-quantize adds to its output (``LLM_KV_QUANTIZE_IMATRIX_*``), in its order: the
    file name and the first dataset (each cut to 127 bytes), the entry count and, when the file gives
    one, the chunk count (u32)."""
    def cut(s: str) -> str:
        return s.encode("utf-8")[:_KEY_BYTES].decode("utf-8", "ignore")

    keys: list[tuple[str, Any, gguf.GGUFValueType]] = [
        ("quantize.imatrix.file", cut(imp.file), gguf.GGUFValueType.STRING)]
    if imp.datasets:
        keys.append(("quantize.imatrix.dataset", cut(imp.datasets[0]), gguf.GGUFValueType.STRING))
    keys.append(("quantize.imatrix.entries_count", len(imp.rows), gguf.GGUFValueType.UINT32))
    if imp.chunk_count > 0:
        keys.append(("quantize.imatrix.chunks_count", imp.chunk_count, gguf.GGUFValueType.UINT32))
    return keys

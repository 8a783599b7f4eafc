"""``--split-max-size N(M|G)`` / ``--split-max-tensors N``: a GGUF output written as the parts
``llama-gguf-split --split`` makes of the single file, byte for byte.

llama.cpp's tool (``tools/gguf-split/gguf-split.cpp``, ``split_strategy``) walks the file's tensors in order
and starts a new part before tensor ``i`` when

- by tensors (``--split-max-tensors N``, its default mode): ``i`` is a positive multiple of ``N``;
- by size (``--split-max-size N``): the part's tensor data so far plus tensor ``i``'s, each padded to 32
  bytes, exceeds ``N`` bytes (the header and metadata are not counted). A tensor larger than the limit
  gets a part of its own, except as the file's first tensor, where the tool stops ("one of splits have 0
  tensors"): :func:`plan_split` refuses that limit (USE-001) instead.

``M`` and ``G`` are decimal (10**6, 10**9 bytes) and the number is a positive 32-bit integer, as the tool
reads them; giving both options is refused, as the tool refuses it. The parts are named
``PREFIX-00001-of-0000N.gguf`` (:func:`part_paths`: PREFIX is the output path without ``.gguf``, so the
default output name gets the suffix too) and laid out by :func:`formats.gguf.split_layouts`; they are
written by :class:`formats.gguf.GGUFSplitWriter` and committed together by
:class:`convert.output.OutputClaim` (``parts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf

from formats.errors import UsageError
from formats.gguf import FileLayout, GGUFPart, split_layouts, split_name

__all__ = ["part_paths", "plan_split"]

#: The most parts: ``split.count`` is a 16-bit key.
MAX_PARTS = 0xFFFF


def plan_split(layout: FileLayout, *, max_tensors: int | None = None, max_size: int | None = None
               ) -> list[GGUFPart] | None:
    """Which tensors go into which part, as ``llama-gguf-split --split`` decides it (module docstring), and
    the parts' layouts (:func:`formats.gguf.split_layouts`); None when neither limit is given.

    Args:
        layout: the whole file (a :class:`convert.gguf.plan.GGUFPlan`).
        max_tensors: ``--split-max-tensors``, or None.
        max_size: ``--split-max-size`` in bytes, or None.

    Raises:
        UsageError: USE-001, the first tensor alone is larger than ``max_size`` (the tool fails there), or
            more than 65535 parts.
    """
    if max_tensors is None and max_size is None:
        return None
    tensors = list(layout.tensors)
    counts: list[int] = []
    held = 0  # the current part's tensor bytes, each padded to 32
    for i, t in enumerate(tensors):
        nbytes = gguf.GGUFWriter.ggml_pad(t.nbytes, 32)
        if max_tensors is not None:
            new = i > 0 and i % max_tensors == 0
        else:
            assert max_size is not None
            new = held + nbytes > max_size
            if new and not counts:
                raise UsageError("--split-max-size is smaller than the file's first tensor, which "
                                 "llama-gguf-split cannot put into a part", tensor=t.name,
                                 expected=f"a limit of at least {nbytes} bytes ({-(-nbytes // 10**6)}M)",
                                 found=f"{max_size} bytes")
            held = nbytes if new else held + nbytes
        if new or not counts:
            counts.append(0)
        counts[-1] += 1
    if len(counts) > MAX_PARTS:
        raise UsageError("the split would make more parts than llama.cpp's 16-bit split.count holds",
                         expected=f"at most {MAX_PARTS} parts", found=f"{len(counts)} parts",
                         hint="raise --split-max-tensors or --split-max-size")
    return split_layouts(layout, counts)


def part_paths(out: Path, parts: Sequence[GGUFPart]) -> list[Path]:
    """The parts' paths for the output ``out``: ``OUT.gguf`` -> ``OUT-00001-of-00003.gguf`` ... beside it (the
    prefix is ``out`` without a ``.gguf`` suffix, as llama-gguf-split is given it)."""
    prefix = out.name[: -len(".gguf")] if out.name.lower().endswith(".gguf") else out.name
    return [out.with_name(split_name(prefix, i, len(parts))) for i in range(len(parts))]

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

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import gguf

from formats.errors import UsageError
from formats.gguf import FileLayout, GGUFPart, split_layouts, split_name

if TYPE_CHECKING:
    from convert.options import ConvertOptions

__all__ = ["check_split_options", "parse_split_size", "part_paths", "plan_split"]

#: llama-gguf-split's size units (decimal, upper case only).
_UNITS = {"M": 10**6, "G": 10**9}
#: The largest number the tool reads (``sscanf("%d")`` / ``atoi``).
_INT_MAX = 2**31 - 1
#: The most parts: ``split.count`` is a 16-bit key.
MAX_PARTS = 0xFFFF


def parse_split_size(text: str) -> int:
    """``--split-max-size`` as llama-gguf-split reads it: a positive integer and ``M`` (10**6 bytes) or ``G``
    (10**9 bytes), e.g. ``2G``, ``500M``.

    Returns:
        the limit in bytes.

    Raises:
        UsageError: USE-001, another form (no unit or another one, a fraction, a sign, zero).
    """
    m = re.fullmatch(r"(\d+)([MG])", text.strip())
    if m is None or not 0 < int(m.group(1)) <= _INT_MAX:
        raise UsageError("--split-max-size takes a positive whole number of megabytes or gigabytes, as "
                         "llama-gguf-split does", expected="N(M|G), e.g. 2G or 500M (10**6 / 10**9 bytes)",
                         found=text[:40])
    return int(m.group(1)) * _UNITS[m.group(2)]


def check_split_options(options: ConvertOptions) -> None:
    """The split options against the target and each other, before anything is read.

    Raises:
        UsageError: USE-001: a split option without ``--to gguf[:TYPE]``; both options (llama-gguf-split
            takes one); ``split_max_tensors`` or ``split_max_size`` not a positive integer (up to 2**31 - 1
            tensors).
    """
    given = [f for f, v in (("--split-max-size", options.split_max_size),
                            ("--split-max-tensors", options.split_max_tensors)) if v is not None]
    if not given:
        return
    if options.to.family != "gguf":
        raise UsageError(f"{given[0]} splits a GGUF output and needs --to gguf[:TYPE]", expected="--to gguf...",
                         found=f"--to {options.to.name}")
    if len(given) == 2:
        raise UsageError("give either --split-max-size or --split-max-tensors, not both (as llama-gguf-split)",
                         found="both")
    value = options.split_max_size if options.split_max_size is not None else options.split_max_tensors
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= (
            _INT_MAX if options.split_max_tensors is not None else _INT_MAX * _UNITS["G"]):
        raise UsageError(f"{given[0]} must be a positive whole number", found=repr(value)[:40],
                         expected="a number of tensors >= 1" if options.split_max_tensors is not None
                         else "a size such as 2G or 500M")


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

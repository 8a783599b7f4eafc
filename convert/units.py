"""Byte sizes as users type and read them: the one parser and the one formatter.

- :func:`parse_size` reads ``1GiB``, ``512MiB``, ``5GB`` (decimal, as transformers' ``max_shard_size``),
  ``1000000`` (bytes); units are case-insensitive, ``KiB``/``Ki`` are powers of 1024, ``KB``/``K`` of 1000.
- :func:`format_bytes` writes binary units with two decimals (``1.50 GiB``), whole bytes below 1 KiB
  (``512 B``).
"""

from __future__ import annotations

import argparse
import re

__all__ = ["format_bytes", "format_short_of", "parse_size"]

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)  # (ASCII digits only)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_BINARY = ("KiB", "MiB", "GiB", "TiB")
#: Sizes are below 2**63 bytes (what a file offset can be).
MAX_SIZE = 2**63


def parse_size(text: str) -> int:
    """Parse a byte size: ``1GiB``, ``512MiB``, ``5GB`` (decimal), ``1000000`` (bytes).

    Returns:
        The size in bytes (fractions rounded down: ``1.5KiB`` -> 1536).

    Raises:
        argparse.ArgumentTypeError: not a size, or not below :data:`MAX_SIZE` (argparse turns it into a
            usage error naming the option).
    """
    m = _SIZE_RE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS or (_UNITS[unit] == 1 and "." in m.group(1)):  # (no fraction of a byte)
        raise argparse.ArgumentTypeError(f"not a size: '{text[:40]}' (examples: 1GiB, 512MiB, 5GB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not value < MAX_SIZE:
        raise argparse.ArgumentTypeError(f"not a size: '{text[:40]}' is larger than 2**63 bytes")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.50 KiB``, ..., ``3.25 TiB`` (negative sizes keep their sign)."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in _BINARY:
        n /= 1024
        if abs(n) < 1024 or unit == _BINARY[-1]:
            break
    return f"{n:.2f} {unit}"


def format_short_of(n: int, limit: int) -> str:
    """``n`` bytes found short of ``limit`` (an error's "found" beside its "expected >= limit"): :func:`format_bytes`,
    or the exact bytes where it would read as the limit itself (167772159 against 160 MiB: ``167772159 B``)."""
    shown = format_bytes(n)
    return f"{int(n)} B" if shown == format_bytes(limit) else shown

"""Every error convert-bnb raises on purpose.

One base class, :class:`ConvertBnbError`, and one subclass per failure kind. Each subclass also
derives from the builtin that fits (``ValueError`` for bad content, ``OSError`` for the file
system), so callers that catch builtins keep working.

Every error keeps what it is about as attributes -- ``path`` (the file), ``tensor`` (the tensor
name, when there is one), ``rule`` (the rule id, e.g. ``BNB-003``), ``expected`` and ``found`` --
and renders them into one line::

    Failed to read 'model.safetensors': tensor 'model.layers.0.mlp.down_proj.weight':
    BNB-004 absmax count must be ceil(n / blocksize) (expected 2816, found 2815). Hint: ...

The CLI prints that line and exits with code 2; the library never prints or exits.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "AdapterError",
    "BnbLayerError",
    "CheckpointError",
    "ConvertBnbError",
    "DiskSpaceError",
    "HubError",
    "OutputExistsError",
    "SafetensorsError",
    "TorchPickleError",
    "UnsafePickleError",
    "UnsupportedError",
    "UsageError",
    "VerificationError",
]


class ConvertBnbError(Exception):
    """Base class of every error convert-bnb raises on purpose.

    Args:
        message: the rule that was broken, in words (without file or tensor: those are added).
        path: the file or directory being read or written.
        tensor: the tensor name, when the problem is about one tensor.
        rule: a stable rule id such as ``"ST-005"`` or ``"BNB-003"`` (see docs/errors.md).
        expected: what the rule wants (rendered with ``repr`` for strings).
        found: what was actually read.
        hint: what the user can do about it.
        action: the verb in "Failed to <action> '<path>'" (default "read").
    """

    default_rule: str | None = None

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        tensor: str | None = None,
        rule: str | None = None,
        expected: Any = None,
        found: Any = None,
        hint: str | None = None,
        action: str = "read",
    ) -> None:
        self.reason = message
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        self.rule = rule if rule is not None else self.default_rule
        self.expected = expected
        self.found = found
        self.hint = hint
        self.action = action
        super().__init__(self._render())

    def _render(self) -> str:
        parts: list[str] = []
        if self.path is not None:
            parts.append(f"Failed to {self.action} '{self.path}'")
        if self.tensor is not None:
            parts.append(f"tensor '{self.tensor}'")
        body = f"{self.rule} {self.reason}" if self.rule else self.reason
        if self.expected is not None or self.found is not None:
            body += f" (expected {_show(self.expected)}, found {_show(self.found)})"
        parts.append(body)
        text = ": ".join(parts)
        if self.hint:
            text += f". Hint: {self.hint}"
        return text


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    return str(value)


class UsageError(ConvertBnbError, ValueError):
    """The command line or API call asks for something that cannot be done (bad option value)."""


class SafetensorsError(ConvertBnbError, ValueError):
    """A ``.safetensors`` file breaks the container format (header, dtype, shape, offsets, size)."""


class TorchPickleError(ConvertBnbError, ValueError):
    """A PyTorch ``.bin``/``.pt`` checkpoint breaks the container format (zip, records, pickle, views)."""


class UnsafePickleError(TorchPickleError):
    """A pickle names a global outside the allow-list; nothing was imported or called.

    ``found`` holds the refused ``module.name``.
    """


class CheckpointError(ConvertBnbError, ValueError):
    """A model directory is inconsistent: index JSON, missing shards, no weights, config."""


class BnbLayerError(ConvertBnbError, ValueError):
    """A bitsandbytes layer (packed weight + QuantState) breaks a BNB-xxx rule."""


class AdapterError(ConvertBnbError, ValueError):
    """A PEFT adapter breaks a LORA-xxx rule: its config, its keys, or its fit to the base model."""


class UnsupportedError(ConvertBnbError, ValueError):
    """Valid input that convert-bnb does not handle (yet); the message says what is supported."""


class OutputExistsError(ConvertBnbError, FileExistsError):
    """The output path exists and ``--overwrite`` was not given."""


class DiskSpaceError(ConvertBnbError, OSError):
    """Not enough free space for the planned output."""


class VerificationError(ConvertBnbError, OSError):
    """The written output does not match the plan when re-opened (nothing is renamed into place)."""


class HubError(ConvertBnbError, OSError):
    """A Hugging Face Hub repo cannot be resolved or fetched (not found, gated, offline without a cache)."""

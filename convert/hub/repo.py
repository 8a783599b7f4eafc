"""What names a Hub repo on the command line, and which exceptions are the Hub's.

- :func:`is_repo_id`: SRC ``org/name`` that is not an existing local path;
- :func:`parse_repo_spec`: ``org/name@revision`` split;
- :func:`is_hub_exception`: an exception of huggingface_hub or of the HTTP client under it (the network
  down), which :mod:`convert.hub.download` and :mod:`convert.hub.shards` turn into HUB rules.
"""

from __future__ import annotations

import os
import re

__all__ = ["is_hub_exception", "is_repo_id", "is_repo_name", "parse_repo_spec"]


_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def is_repo_id(text: str) -> bool:
    """Whether SRC means a Hub repo: ``org/name`` that is not an existing local path.

    Args:
        text: the SRC argument (without ``@revision``).
    """
    if os.path.exists(text):
        return False
    if not is_repo_name(text) or ".." in text or text.endswith((".safetensors", ".bin", ".pt")):
        return False
    return True


def parse_repo_spec(spec: str) -> tuple[str, str | None]:
    """Split ``org/name@revision`` into (``org/name``, ``revision`` or None)."""
    if "@" in spec and not os.path.exists(spec):
        repo, _, rev = spec.partition("@")
        return repo, rev or None
    return spec, None


def is_repo_name(text: str) -> bool:
    """Whether ``text`` has the syntax of a Hub repo id, ``org/name`` (whatever is on disk)."""
    return bool(_REPO_RE.match(text))


def is_hub_exception(exc: BaseException) -> bool:
    """Whether ``exc`` is huggingface_hub's own, or its HTTP client's when the network is down
    (``httpx.ConnectError``, ...)."""
    return type(exc).__module__.startswith(("huggingface_hub", "httpx", "httpcore", "requests", "urllib3"))

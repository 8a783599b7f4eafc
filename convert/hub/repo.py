"""What names a Hub repo on the command line, and which exceptions are the Hub's.

- :func:`is_repo_id`: SRC ``org/name`` that is not an existing local path;
- :func:`parse_repo_spec`: ``org/name@revision`` split;
- :func:`is_hub_exception`: an exception of huggingface_hub or of the HTTP client under it (the network
  down), which :mod:`convert.hub.download` and :mod:`convert.hub.shards` turn into HUB rules.
"""

from __future__ import annotations

import os
import re

__all__ = ["is_hub_exception", "is_owner_name", "is_repo_id", "is_repo_name", "output_repo_id",
           "output_repo_name", "parse_repo_spec"]


_OWNER = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
_REPO_RE = re.compile(rf"^{_OWNER}/{_OWNER}$")
_OWNER_RE = re.compile(rf"^{_OWNER}$")


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


def is_owner_name(text: str) -> bool:
    """Whether ``text`` has the syntax of a Hub organisation or user name (the ``org`` of ``org/name``)."""
    return bool(_OWNER_RE.match(text)) and ".." not in text


def output_repo_id(org: str, name: str) -> str:
    """The repo an output named ``name`` is pushed to when only the organisation ``org`` is given:
    ``ORG/`` + :func:`output_repo_name`."""
    return f"{org}/{output_repo_name(name)}"


def output_repo_name(name: str) -> str:
    """The name of the repo an output is pushed to when only the organisation is given (``batch
    --push-to-hub ORG``, several ``--to`` targets): the output's name without a ``.gguf`` or
    ``.safetensors`` extension (a file output: the repo holds it under its own name)."""
    for ext in (".gguf", ".safetensors"):
        if name.endswith(ext) and len(name) > len(ext):
            return name[: -len(ext)]
    return name


def is_hub_exception(exc: BaseException) -> bool:
    """Whether ``exc`` is huggingface_hub's own, or its HTTP client's when the network is down
    (``httpx.ConnectError``, ...)."""
    return type(exc).__module__.startswith(("huggingface_hub", "httpx", "httpcore", "requests", "urllib3"))

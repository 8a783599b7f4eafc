"""What names a Hub repo on the command line, and which exceptions are the Hub's.

- :func:`is_repo_id`: SRC ``org/name`` that is not an existing local path;
- :func:`parse_repo_spec`: ``org/name@revision`` split;
- :func:`check_repo_id`, :func:`check_owner`: a ``--push-to-hub`` repo or owner as the Hub validates it, before
  anything is converted;
- :func:`output_repo_id`: the repo ``ORG/NAME`` of an output pushed to an organisation;
- :func:`is_hub_exception`: an exception of huggingface_hub or of the HTTP client under it (the network
  down), which :mod:`convert.hub.download` and :mod:`convert.hub.shards` turn into HUB rules.
"""

from __future__ import annotations

import os
import re

from formats.errors import UsageError

__all__ = ["check_owner", "check_repo_id", "is_hub_exception", "is_owner_name", "is_repo_id", "is_repo_name",
           "output_repo_id", "output_repo_name", "parse_repo_spec"]


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


def check_owner(org: str) -> None:
    """Refuse ``--push-to-hub ORG`` (several targets, batch) unless ``ORG/<a name>`` is a Hub repo id
    (:func:`check_repo_id`).

    Raises:
        UsageError: USE-001 naming ``org`` and huggingface_hub's reason.
    """
    check_repo_id(f"{org}/x", org, "an organisation or user name")


def check_repo_id(repo_id: str, given: str, expected: str) -> None:
    """Refuse ``repo_id`` unless it is a Hub repo id as huggingface_hub validates it (``validate_repo_id``) and
    has the ``org/name`` form, before anything is converted.

    Raises:
        UsageError: USE-001 naming ``given`` (what ``--push-to-hub`` said) and huggingface_hub's reason.
    """
    # (heavy: huggingface_hub's API takes ~170 ms to import; only a push needs it)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        ok = is_repo_name(repo_id) and is_owner_name(repo_id.split("/")[0])
        reason = "not of the form org/name"
    except HFValidationError as exc:
        ok, reason = False, str(exc).split(":")[0]
    if not ok:
        raise UsageError(f"--push-to-hub needs a Hub repo id ({reason})", expected=expected, found=given)

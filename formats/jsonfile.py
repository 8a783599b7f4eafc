"""The one bounded JSON loader: every JSON file or blob convert-bnb reads from its input goes through here.

``json.loads`` alone lets hostile input crash or stall a reader: an integer of 4,300+ digits raises a
bare ``ValueError`` (Python's integer-string limit), 100,000 nested brackets raise ``RecursionError``,
a gigabyte "config" is read whole, duplicate keys are silently merged (last wins), and ``NaN`` /
``Infinity`` are accepted although JSON has no such tokens. :func:`load_json_file` and
:func:`load_json_bytes` check, in this order, and raise the *caller's* rule class (the rule of the
file the user gave: ST-003 for a safetensors header, CKPT-001 for an index, BNB-009 for a QuantState,
...) with the file, the rule, expected and found:

1. size: at most :attr:`JsonKind.max_bytes` (a file is never read past that);
2. UTF-8;
3. nesting depth: at most :data:`MAX_DEPTH` levels of ``[``/``{``, counted *before* parsing, without
   recursion and in linear time (escapes blanked with ``bytes.replace``, then quotes and brackets
   summed with NumPy in chunks of 4 MiB);
4. parsed: valid JSON, every integer token at most :data:`MAX_INT_DIGITS` digits (checked by a
   ``parse_int`` hook before any ``int()`` conversion), no ``NaN``/``Infinity``/``-Infinity`` where
   the kind forbids them, and no key twice in one object (parsed without a per-object hook, then the
   keys the value holds are compared with the keys the text holds, counted in C; only when they
   differ is the text parsed again with the hook that names the key).

Limits per kind of file (chosen so the largest real files fit with room to spare):

==============  =========  =======  ================================================================
kind            max bytes  NaN/Inf  files
==============  =========  =======  ================================================================
HEADER          100 MiB    refused  a safetensors header (ST-002 bounds it first; Rust safetensors
                                    refuses NaN, as serde_json does)
INDEX           64 MiB     refused  ``*.index.json`` shard indexes (the largest on the Hub, ~100k
                                    tensors, are ~10 MB), local or from the Hub cache
CONFIG          16 MiB     allowed  ``config.json``, ``adapter_config.json`` (a few KB; written by
                                    Python's json, which writes NaN/Infinity)
TOKENIZER       64 MiB     allowed  ``tokenizer.json`` (the largest, Gemma's, is ~33 MB),
                                    ``tokenizer_config.json``, ``added_tokens.json``,
                                    ``chat_template.json``
QUANT_STATE     1 MiB      allowed  a packed QuantState (bnb writes ~200 bytes with ``json.dumps``)
JOBS            16 MiB     refused  a ``convert-bnb batch`` JOBS file
==============  =========  =======  ================================================================

A safetensors header, a shard index and a JOBS file also refuse a string holding a lone UTF-16
surrogate escape (``"\\ud800"`` without its pair: serde_json, which Rust safetensors uses, refuses it,
and no UTF-8 encoder takes it: printing or naming a directory after it failed).

Every kind: depth at most :data:`MAX_DEPTH` (256; real files nest under 20 levels) and integers of
at most :data:`MAX_INT_DIGITS` (100) digits (the longest real one is transformers' ``model_max_length``
of ``int(1e30)``, 31 digits). Floats are not limited: ``float()`` has no digit limit and a huge
exponent gives ``inf``, which the readers' value rules judge.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConvertBnbError

__all__ = [
    "CONFIG",
    "HEADER",
    "INDEX",
    "JOBS",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "QUANT_STATE",
    "TOKENIZER",
    "JsonKind",
    "load_json_bytes",
    "load_json_file",
]

MiB = 1 << 20
#: Deepest nesting of arrays and objects accepted (real files nest under 20 levels; well inside
#: Python's recursion limit, which the C parser counts against).
MAX_DEPTH = 256
#: Most digits of one integer token (Python refuses to convert 4,300+).
MAX_INT_DIGITS = 100


@dataclass(frozen=True)
class JsonKind:
    """The limits for one kind of JSON file.

    Attributes:
        name: what the file is, for the docs (``"config"``).
        max_bytes: the largest file accepted, in bytes.
        allow_nan: whether the ``NaN``, ``Infinity`` and ``-Infinity`` tokens are accepted.
        allow_lone_surrogates: whether a ``\\uD800``..``\\uDFFF`` escape without its pair is accepted
            (a string no UTF-8 encoder takes: printing a tensor name holding one failed).
    """

    name: str
    max_bytes: int
    allow_nan: bool
    allow_lone_surrogates: bool = True


HEADER = JsonKind("safetensors header", 100 * MiB, allow_nan=False, allow_lone_surrogates=False)
INDEX = JsonKind("shard index", 64 * MiB, allow_nan=False, allow_lone_surrogates=False)
CONFIG = JsonKind("config", 16 * MiB, allow_nan=True)
TOKENIZER = JsonKind("tokenizer", 64 * MiB, allow_nan=True)
QUANT_STATE = JsonKind("QuantState", 1 * MiB, allow_nan=True)
JOBS = JsonKind("JOBS file", 16 * MiB, allow_nan=False, allow_lone_surrogates=False)

_CHUNK = 1 << 22
#: per byte: +1 for '[' and '{', -1 for ']' and '}', _QUOTE for '"', 0 for any other
_QUOTE = 2
_CODE = np.zeros(256, dtype=np.int8)
_CODE[[ord("["), ord("{")]] = 1
_CODE[[ord("]"), ord("}")]] = -1
_CODE[ord('"')] = _QUOTE


class _Refused(Exception):
    """Raised inside the parser's hooks; turned into the caller's rule class."""

    def __init__(self, reason: str, expected: Any, found: Any, key: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.expected, self.found, self.key = reason, expected, found, key


def _blank_escapes(raw: bytes) -> bytes:
    """``raw`` with ``\\\\`` then ``\\"`` blanked to ``__`` (left to right, as a JSON parser reads them):
    every quote left opens or closes a string. Same length as ``raw``."""
    return raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def _depth(plain: bytes, limit: int) -> int | None:
    """The byte offset where ``plain`` (text after :func:`_blank_escapes`) first nests deeper than
    ``limit`` (None when it never does), brackets in strings not counted. Linear time, no recursion;
    memory: arrays of one 4 MiB chunk.

    A bracket is inside a string when an odd number of quotes precede it. Where the text is not JSON
    this may miscount, but only past the first error, which the parser stops at before it nests any
    deeper.
    """
    if plain.count(b"[") + plain.count(b"{") <= limit:
        return None
    # first on the quotes and brackets alone (a tenth of a header's bytes); offsets only when too deep
    if _first_too_deep(plain.translate(None, _NOT_STRUCTURE), limit) is None:
        return None
    return _first_too_deep(plain, limit)


#: Every byte but quotes and brackets (deleted before the depth count).
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')


def _first_too_deep(plain: bytes, limit: int) -> int | None:
    """:func:`_depth`'s count over ``plain`` in chunks of 4 MiB: the offset of the first bracket past ``limit``."""
    level, quotes = 0, 0
    for start in range(0, len(plain), _CHUNK):
        arr = np.frombuffer(plain, dtype=np.uint8, count=min(_CHUNK, len(plain) - start), offset=start)
        code = _CODE[arr]
        at = np.flatnonzero(code)  # the quotes and brackets of this chunk
        kind = code[at]
        is_quote = kind == _QUOTE
        inside = ((np.cumsum(is_quote, dtype=np.int32) + quotes) & 1).astype(bool)
        running = np.cumsum(np.where(is_quote | inside, 0, kind), dtype=np.int32)
        running += level
        over = running > limit
        if over.any():
            return start + int(at[np.argmax(over)])
        if running.size:
            level = int(running[-1])
        quotes += int(np.count_nonzero(is_quote))
    return None


#: Every digit to ``9``, every other byte to a space: a run of digits longer than any integer we accept
#: is then a plain substring search (in C, before parsing; 20x faster than a regex on a 10 MB header).
_DIGITS_TO_9 = bytes(0x39 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_DIGITS = b"9" * (MAX_INT_DIGITS + 1)


#: The end of an object key in text after :func:`_blank_escapes`: a closing quote, then ``:``.
_KEY_END = re.compile(rb'"[ \t\n\r]*:')
_SPACED_KEY_END = re.compile(rb'"[ \t\n\r]+:')


def _refuse_constant(token: str) -> float:
    raise _Refused(f"holds {token}, which is not JSON", "finite numbers", token)


def _refuse_long_int(token: str) -> int:
    digits = len(token) - token.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _Refused("holds an integer too long to be a real value",
                       f"at most {MAX_INT_DIGITS} digits", f"{digits} digits ({token[:12]}...)")
    return int(token)


def _decoder(allow_nan: bool, long_digits: bool, pairs: Callable[..., Any] | None = None) -> json.JSONDecoder:
    """A decoder with only the hooks needed: ``parse_int`` when the text holds a run of more than
    :data:`MAX_INT_DIGITS` digits somewhere (else the C parser's own ``int``, several times faster),
    ``parse_constant`` only where NaN/Infinity are refused, ``object_pairs_hook`` only to find a
    duplicate key (a Python call per object: 2.5x slower on a header of 10^5 tensors)."""
    return json.JSONDecoder(
        parse_constant=None if allow_nan else _refuse_constant,
        parse_int=_refuse_long_int if long_digits else None,
        object_pairs_hook=pairs,
    )


#: (allow_nan, long_digits) -> decoder, built once (json.loads with hooks builds one per call).
_DECODERS = {(n, d): _decoder(n, d) for n in (False, True) for d in (False, True)}


def _first_duplicate(text: str, kind: JsonKind, long_digits: bool) -> _Refused | None:
    """Parse again, keeping every object's keys: the first key found twice in one object (objects in
    the order they close), as the refusal to raise; ``key`` is set only when the object is the
    document itself (a safetensors header's tensor names), else the message says which top-level
    entry holds the object."""
    found: list[tuple[str, dict[str, Any]]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(items)
        if len(obj) != len(items) and not found:
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    found.append((key, obj))
                    break
                seen.add(key)
        return obj

    value = _decoder(kind.allow_nan, long_digits, pairs).decode(text)
    if not found:
        return None
    key, obj = found[0]
    if obj is value:
        return _Refused(f"has the key {key!r} twice in one object", "each key once", "twice", key)
    holder = next((k for k, v in value.items() if _holds(v, obj)), None) if isinstance(value, dict) else None
    where = f" (in the value of {holder!r})" if holder is not None else ""
    return _Refused(f"has the key {key!r} twice in one object{where}", "each key once", "twice")


def _holds(value: Any, target: dict[str, Any]) -> bool:
    """Whether ``target`` is ``value`` or inside it (by identity; iterative)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v is target:
            return True
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _count_keys(value: Any) -> int:
    """Keys of every object in a parsed JSON value (iterative: no recursion; only containers are
    pushed, so a header's 10^5 shape and offset lists cost one pass each)."""
    if type(value) is not dict and type(value) is not list:  # a scalar document: no keys
        return 0
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        items: Any = v
        if type(v) is dict:
            count += len(v)
            items = v.values()
        for x in items:
            if type(x) is dict or type(x) is list:
                stack.append(x)
    return count


def _parse(text: str, plain: bytes, kind: JsonKind, long_digits: bool) -> Any:
    """Parse ``text``; a key twice in one object raises :class:`_Refused` naming it.

    Fast path: parse without a per-object hook, then compare the keys the parsed value holds with the
    keys the text holds (the closing quotes followed by ``:`` in ``plain``, exact once escapes are
    blanked). Only when they differ (a key was merged away) is the text parsed again with the
    per-object hook, to name the first duplicate (:func:`_first_duplicate`).
    """
    obj = _DECODERS[kind.allow_nan, long_digits].decode(text)
    spaced = _SPACED_KEY_END.search(plain) is not None  # json.dumps writes none: a count in C suffices
    if _count_keys(obj) != (len(_KEY_END.findall(plain)) if spaced else plain.count(b'":')):
        refused = _first_duplicate(text, kind, long_digits)
        if refused is not None:
            raise refused
    return obj


#: A ``\\u`` escape of a UTF-16 surrogate (a cheap test before looking at the parsed strings).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any) -> None:
    """Raise :class:`_Refused` at the first key or string of ``value`` holding a lone surrogate (JSON's
    escapes allow one; Python keeps it in the ``str``, serde_json - Rust safetensors - refuses it, and
    no UTF-8 encoder takes it). Iterative."""
    stack = [value]
    while stack:
        v = stack.pop()
        texts: list[Any] = [v] if type(v) is str else list(v) if type(v) is dict else []
        for t in texts:
            if type(t) is str:
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError:
                    raise _Refused("holds a lone UTF-16 surrogate escape", "text without lone surrogates",
                                   t[:80]) from None
        if type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)


def load_json_bytes(
    raw: bytes,
    kind: JsonKind,
    error: type[ConvertBnbError],
    what: str,
    *,
    path: str | os.PathLike[str] | None = None,
    tensor: str | None = None,
    hint: str | None = None,
    on_duplicate: Callable[[str], ConvertBnbError] | None = None,
) -> Any:
    """Parse JSON bytes within ``kind``'s limits.

    Args:
        raw: the UTF-8 JSON text.
        kind: the limits (:data:`HEADER`, :data:`INDEX`, :data:`CONFIG`, ...).
        error: the rule class to raise (the reader's own, e.g. ``IndexJsonError``).
        what: the thing read, starting the message (``"the index"``, ``"quant_state"``).
        path: the file, for the message.
        tensor: the tensor, when the JSON is a tensor's bytes (a QuantState).
        hint: added to every message.
        on_duplicate: makes the error for a key seen twice (default: ``error``).

    Returns:
        the parsed value (objects are ``dict``).

    Raises:
        ConvertBnbError: ``error`` (or ``on_duplicate``'s), naming the limit broken, expected and found.
    """

    def fail(reason: str, expected: Any = None, found: Any = None) -> ConvertBnbError:
        return error(f"{what} {reason}", path=path, tensor=tensor, expected=expected, found=found, hint=hint)

    if len(raw) > kind.max_bytes:
        raise fail("is larger than the limit for a JSON " + kind.name, f"at most {kind.max_bytes} bytes",
                   f"{len(raw)} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"is not valid UTF-8 (byte {exc.start})") from None
    if text.startswith("\ufeff"):
        raise fail("is not valid JSON (it starts with a UTF-8 byte order mark)")
    plain = _blank_escapes(raw)
    deep = _depth(plain, MAX_DEPTH)
    if deep is not None:
        raise fail("is nested too deeply", f"at most {MAX_DEPTH} levels", f"level {MAX_DEPTH + 1} at byte {deep}")
    try:
        value = _parse(text, plain, kind, _LONG_DIGITS in raw.translate(_DIGITS_TO_9))
        if not kind.allow_lone_surrogates and _SURROGATE_ESCAPE.search(raw):
            _refuse_lone_surrogates(value)
        return value
    except _Refused as exc:
        if exc.key is not None and on_duplicate is not None:
            raise on_duplicate(exc.key) from None
        raise fail(exc.reason, exc.expected, exc.found) from None
    except json.JSONDecodeError as exc:
        raise fail(f"is not valid JSON ({exc})") from None
    except RecursionError:  # not expected within MAX_DEPTH; a guard, never a crash
        raise fail("is nested too deeply", f"at most {MAX_DEPTH} levels", "more than the parser allows") from None


def load_json_file(
    path: str | os.PathLike[str],
    kind: JsonKind,
    error: type[ConvertBnbError],
    what: str,
    *,
    hint: str | None = None,
    on_duplicate: Callable[[str], ConvertBnbError] | None = None,
) -> Any:
    """Read and parse a JSON file within ``kind``'s limits; never reads more than ``kind.max_bytes + 1`` bytes.

    Args:
        path: the file.
        kind, error, what, hint, on_duplicate: as for :func:`load_json_bytes`.

    Returns:
        the parsed value.

    Raises:
        ConvertBnbError: ``error``, naming the limit broken, expected and found.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        raw = f.read(kind.max_bytes + 1)
        if len(raw) > kind.max_bytes:
            size = os.fstat(f.fileno()).st_size
            raise error(f"{what} is larger than the limit for a JSON {kind.name}", path=path,
                        expected=f"at most {kind.max_bytes} bytes", found=f"{max(size, len(raw))} bytes",
                        hint=hint)
    return load_json_bytes(raw, kind, error, what, path=path, hint=hint, on_duplicate=on_duplicate)

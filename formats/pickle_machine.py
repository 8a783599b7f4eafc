"""A bounded pickle machine: runs pickles of protocols 0-5 without pickle.Unpickler, imports or recursion.

:class:`PickleMachine` interprets every opcode of protocols 0-5 itself. It never imports anything and
calls only what it is given: every global goes to its ``find_class``, every persistent id to its
``persistent_load``, and REDUCE / INST / OBJ call only the stand-ins it was given (``callables``) and
its own for plain Python data (:data:`PLAIN_GLOBALS`: ``collections.OrderedDict``, ``builtins.set`` /
``frozenset``, and ``_codecs.encode``, latin-1 only: how protocol 2 spells ``bytes``). NEWOBJ makes an
:class:`ObjectStandIn` subclass's instance without calling anything and BUILD records its state dict;
BUILD on anything else (a :class:`NoBuild` stand-in, say) is refused. :mod:`formats.torch_pickle` runs
torch checkpoints on it, with torch's allow-list.

Bounds: bad input never crashes, hangs or eats memory. The machine is a loop over a stack (no
recursion, so no RecursionError and no C-stack overflow; SIGINT/SIGTERM land between two opcodes):
every opcode is counted, every length is checked against the bytes that are left before anything is
allocated, every container knows its nesting depth, and only small immutable values may be hashed
(dict keys, set members). Every message that shows pickled data goes through :func:`summary`, which
looks at no more than ~80 items and never prints a big integer in decimal.

The limits, against what a real state dict needs (``torch.save`` of a Llama state dict costs about 30
opcodes, 8 memo entries, 21 container elements and 125 bytes of pickle per tensor; a 70B model's
``pytorch_model.bin`` holds a few thousand tensors, so its pickle is under 1 MB and 150,000 opcodes):

====================  ===========  ========================================================================
MAX_PICKLE_BYTES      64 MiB       data.pkl (declared size checked before inflating; inflating is capped
                                   too), or one legacy pickle (PT-002); ~500,000 tensors
MAX_OPCODES           2,000,000    opcodes per pickle, ~65,000 tensors; bounds the time (a few seconds)
MAX_MEMO              1,000,000    memo entries
MAX_CONTAINER_ITEMS   1,000,000    elements of one list/tuple/dict/set, and values on the machine's stack
MAX_TOTAL_ITEMS       2,000,000    containers and elements made in all, ~95,000 tensors; bounds memory
                                   (a hostile pickle at every limit stays well under 1 GiB)
MAX_DEPTH             100          nesting of containers and of MARKs (a state dict nests < 10 deep)
MAX_INT_BYTES         16           bytes of a LONG1/LONG4 integer (40 digits for text INT/LONG); counts,
                                   offsets, sizes and strides must also fit in int64
MAX_KEY_COST          256          a dict key or set member is a str/bytes/number/None/bool (or of the
                                   machine's ``key_types``), or a tuple of them with at most 256 elements
                                   in all (nothing else is hashed)
====================  ===========  ========================================================================

The limits are read when a pickle runs, so a test may lower them. A broken limit raises :class:`Limit`
(rule PT-010, :class:`~formats.errors.PickleLimitError`, once the reader adds the file) naming the limit
and what was found; MAX_PICKLE_BYTES raises :class:`TooLong` (PT-002). A malformed pickle raises
:class:`Refused` (PT-004), as do the stand-ins when a pickle misuses them.
"""

from __future__ import annotations

import codecs
import collections
import copyreg
import itertools
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "MAX_CONTAINER_ITEMS",
    "MAX_DEPTH",
    "MAX_INT_BYTES",
    "MAX_KEY_COST",
    "MAX_MEMO",
    "MAX_OPCODES",
    "MAX_PICKLE_BYTES",
    "MAX_TOTAL_ITEMS",
    "PLAIN_GLOBALS",
    "Limit",
    "NoBuild",
    "ObjectStandIn",
    "PickleMachine",
    "Refused",
    "TooLong",
    "clip",
    "summary",
]

#: Largest pickle run, in bytes (a 70B-parameter state dict's pickle is about 1 MB) (PT-002).
MAX_PICKLE_BYTES = 64 * 1024 * 1024
#: Limits of the pickle machine (PT-010; see the module docstring for why each is what it is).
MAX_OPCODES = 2_000_000
MAX_MEMO = 1_000_000
MAX_CONTAINER_ITEMS = 1_000_000
MAX_TOTAL_ITEMS = 2_000_000
MAX_DEPTH = 100
MAX_INT_BYTES = 16
MAX_KEY_COST = 256


class Refused(Exception):
    """The pickle is malformed or misuses a stand-in (PT-004); the reader adds the file."""


class Limit(Exception):
    """A parsing limit is exceeded (PT-010); the reader adds the file.

    Attributes:
        expected: the limit, as the message's ``expected`` (``"<= 100 levels"``).
        found: what the pickle has, as the message's ``found``.
    """

    def __init__(self, message: str, expected: Any, found: Any) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class TooLong(Exception):
    """The pickle runs past MAX_PICKLE_BYTES (PT-002)."""


# ---------------------------------------------------------------------------------------------------
# Stand-ins: bases for a reader's, and the machine's own for plain Python data.


class NoBuild:
    """Base of stand-ins that are values the pickle may not modify: BUILD (``__setstate__``) is refused.

    :func:`summary` shows one as its :meth:`label`.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise Refused(f"BUILD on {type(self).__name__.lstrip('_')} is not allowed")

    def label(self) -> str:
        """How :func:`summary` shows this stand-in (``<ClassName>`` unless a subclass says otherwise)."""
        return f"<{type(self).__name__}>"


class ObjectStandIn:
    """Base of the stand-in for an allowed class: the NEWOBJ + BUILD target; records the state dict only.

    A subclass names the class it stands for in :attr:`cls_name` (``"module.name"``). NEWOBJ, REDUCE,
    INST and OBJ on the subclass make an instance with an empty :attr:`state` (no arguments are used,
    nothing is called); BUILD sets :attr:`state` to the pickled attribute dict (``(None, slotstate)`` is
    taken as ``slotstate``) and raises :class:`Refused` for anything that is not a dict.
    """

    cls_name = ""
    state: dict[str, Any]

    def __new__(cls, *args: Any, **kw: Any) -> ObjectStandIn:
        self = super().__new__(cls)
        self.state = {}
        return self

    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slotstate)
        if not isinstance(state, dict):
            raise Refused(f"state of {self.cls_name} is a {type(state).__name__}, not a dict")
        self.state = dict(state)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode(text, "latin1")``: how protocol 2 pickles ``bytes``.

    Raises:
        Refused: ``text`` is not a str, or the encoding is not latin-1.
    """
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise Refused("_codecs.encode is allowed only as encode(str, 'latin1') (protocol 2 bytes)")
    return text.encode("latin-1")


def _plain_set(items: Any = ()) -> set[Any]:
    """Stand-in for ``builtins.set``. The machine builds the set itself (members are checked as keys)."""
    if not isinstance(items, (list, tuple)):
        raise Refused("set() takes a list")
    return set(items)


def _plain_frozenset(items: Any = ()) -> frozenset[Any]:
    """Stand-in for ``builtins.frozenset``; the machine builds it itself, as for :func:`_plain_set`."""
    if not isinstance(items, (list, tuple)):
        raise Refused("frozenset() takes a list")
    return frozenset(items)


#: (module, name) -> the machine's stand-in for a global of plain Python data. A reader's ``find_class``
#: hands these out for the names it allows (formats.torch_pickle allows all four).
PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "set"): _plain_set,
    ("builtins", "frozenset"): _plain_frozenset,
}


# ---------------------------------------------------------------------------------------------------
# The summariser, and the machine (see the module docstring).


class _Text(str):
    """Literal text inside :func:`summary`'s work list (not a value being summarised)."""

    __slots__ = ()


def summary(obj: Any, limit: int = 80) -> str:
    """``repr``-like text of a pickled value, at most about ``limit`` characters.

    Iterative and bounded: looks at no more than ``limit`` items in all, slices strings and bytes
    before ``repr``, and never converts a large integer to decimal, so a value shared 2**60 ways or
    nested 200,000 deep costs no more than a small one.
    """
    parts: list[str] = []
    used = 0
    todo: list[Any] = [obj]
    while todo and used < limit:
        x = todo.pop()
        if type(x) is _Text:
            s = str(x)
        elif isinstance(x, (str, bytes, bytearray)):
            s = repr(x[:limit])
        elif isinstance(x, bool) or x is None or isinstance(x, float):
            s = repr(x)
        elif isinstance(x, int):
            s = repr(x) if x.bit_length() <= 128 else f"<integer of {x.bit_length()} bits>"
        elif isinstance(x, (list, tuple, set, frozenset, dict)):
            brackets = {list: "[]", tuple: "()", dict: "{}"}.get(type(x), "{}")
            opener, closer = brackets[0], brackets[1]
            if isinstance(x, (set, frozenset)) and not x:
                opener, closer = f"{type(x).__name__}(", ")"
            room = max(1, (limit - used) // 2)
            items = list(itertools.islice(x.items() if isinstance(x, dict) else iter(x), room))
            tail: list[Any] = [_Text(closer)]
            if len(x) > len(items):
                tail.append(_Text(", ..."))
            for i in range(len(items) - 1, -1, -1):
                if isinstance(x, dict):
                    tail.extend([items[i][1], _Text(": "), items[i][0]])
                else:
                    tail.append(items[i])
                if i:
                    tail.append(_Text(", "))
            if isinstance(x, tuple) and len(x) == 1:
                tail.insert(1, _Text(","))
            todo.extend(tail)
            s = opener
        elif isinstance(x, NoBuild):
            s = x.label()
        elif isinstance(x, ObjectStandIn):
            s = f"<{x.cls_name}>"
        elif isinstance(x, type):
            s = f"<class {x.__name__}>"
        else:
            s = f"<{type(x).__name__}>"
        if used + len(s) > limit:
            parts.append(s[: limit - used])
            used = limit + 1
            break
        parts.append(s)
        used += len(s)
    if todo or used > limit:
        parts.append("...")
    return "".join(parts)


def clip(text: str, limit: int = 100) -> str:
    """``text`` cut to its first ``limit`` characters, with ``"..."`` after it when it was longer."""
    return text if len(text) <= limit else text[:limit] + "..."


# scalar types that may be hashed (dict keys, set members); each costs 1 toward MAX_KEY_COST
_KEY_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})
_NOT_KEY = -1
_DIGITS = 40  # longest INT/LONG/GET/PUT text argument (protocol 0), in characters


def _decode_long_text(line: bytes) -> int:
    if len(line) > _DIGITS:
        raise Limit("an integer in the pickle is too large", f"<= {_DIGITS} digits",
                    f"{len(line)} characters")
    return int(line)


class PickleMachine:
    """Runs one pickle from ``buf[pos:]`` under the limits; see :meth:`run`.

    Args:
        find_class: ``(module, name) -> stand-in`` for GLOBAL / STACK_GLOBAL / INST / EXT; the only way
            from a pickle to a Python object. It raises for a name it does not allow.
        persistent_load: ``pid -> object`` for PERSID / BINPERSID.
        callables: the stand-ins REDUCE / INST / OBJ may call (compared by identity), besides the
            machine's own (:data:`PLAIN_GLOBALS`, :class:`ObjectStandIn` subclasses). A stand-in may
            raise :class:`Refused`; a TypeError (wrong arguments) becomes :class:`Refused`.
        key_types: types besides str/bytes/int/float/bool/None whose values may be hashed (dict keys,
            set members; exact types, not subclasses), each costing 1 toward MAX_KEY_COST.
    """

    def __init__(
        self,
        find_class: Callable[[str, str], Any],
        persistent_load: Callable[[Any], Any],
        callables: Iterable[Any] = (),
        key_types: Iterable[type] = (),
    ) -> None:
        self.find_class = find_class
        self.persistent_load = persistent_load
        self.callables = (*callables, _codecs_encode)
        self.key_scalars = _KEY_SCALARS | frozenset(key_types)
        # id(container) -> (depth, key cost). Every container the machine makes is entered when it is
        # made (so an entry left by a freed object whose id is reused is overwritten), and any other
        # object it makes or receives (call results, storages, globals) has its id's entry removed.
        self.meta: dict[int, tuple[int, int]] = {}
        self.items = 0  # containers and container elements made so far (MAX_TOTAL_ITEMS)

    # ------------------------------------------------------------------------------ bookkeeping

    def info(self, x: Any) -> tuple[int, int]:
        """``(depth, key cost)`` of a value; cost ``_NOT_KEY`` (-1) for what may not be hashed."""
        if type(x) in self.key_scalars:
            return (0, 1)
        m = self.meta.get(id(x))
        return m if m is not None else (0, _NOT_KEY)

    def note(self, x: Any, depth: int, cost: int, new: bool = False) -> Any:
        """Record a container's depth and key cost (counting it when ``new``); Limit past MAX_DEPTH."""
        if depth > MAX_DEPTH:
            raise Limit("containers are nested too deeply", f"<= {MAX_DEPTH} levels", f"{depth} levels")
        if new:
            self.count(1, 0)
        self.meta[id(x)] = (depth, cost)
        return x

    def plain(self, x: Any) -> Any:
        """An object that is no container of ours (a call result, storage, global): forget its id."""
        self.meta.pop(id(x), None)
        return x

    def count(self, n: int, size: int) -> None:
        """Count ``n`` more elements made, in a container now of ``size``; Limit past the item limits."""
        self.items += n
        if size > MAX_CONTAINER_ITEMS:
            raise Limit("a list, tuple, dict or set has too many elements",
                        f"<= {MAX_CONTAINER_ITEMS}", size)
        if self.items > MAX_TOTAL_ITEMS:
            raise Limit("the pickle's containers hold too many elements in all",
                        f"<= {MAX_TOTAL_ITEMS}", f"more than {MAX_TOTAL_ITEMS}")

    def tuple_of(self, items: Any) -> tuple[Any, ...]:
        """A tuple of ``items``, counted and recorded (depth, key cost) as :meth:`note` would."""
        t = tuple(items)
        n = len(t)
        self.items += n + 1
        if n > MAX_CONTAINER_ITEMS or self.items > MAX_TOTAL_ITEMS:
            self.count(0, n)  # raises
        depth, cost = 0, 1
        meta, scalars = self.meta, self.key_scalars
        for x in t:  # the hot path of a torch pickle: inlined info()
            if type(x) in scalars:
                cost += 1
                continue
            m = meta.get(id(x))
            if m is None:
                cost = _NOT_KEY
                continue
            if m[0] > depth:
                depth = m[0]
            if m[1] == _NOT_KEY:
                cost = _NOT_KEY
            elif cost != _NOT_KEY:
                cost += m[1]
        if cost == _NOT_KEY or cost > MAX_KEY_COST:
            cost = _NOT_KEY if cost == _NOT_KEY else MAX_KEY_COST + 1
        if depth >= MAX_DEPTH:
            self.note(t, depth + 1, cost)  # raises
        meta[id(t)] = (depth + 1, cost)
        return t

    def key(self, k: Any, where: str) -> Any:
        """``k`` if it may be hashed (``where`` names it in the message); else Refused or Limit."""
        cost = self.info(k)[1]
        if cost == _NOT_KEY:
            raise Refused(f"{where} must be a string, number, bytes, None or a tuple of them, "
                          f"got {type(k).__name__}")
        if cost > MAX_KEY_COST:
            raise Limit(f"{where} is too large to hash", f"a tuple of <= {MAX_KEY_COST} elements in all",
                        f"more than {MAX_KEY_COST}")
        return k

    def grow(self, c: Any, children: Any) -> None:
        """Container ``c`` gained ``children``: its depth becomes one more than the deepest child's."""
        depth, cost = self.info(c)
        meta, scalars = self.meta, self.key_scalars
        for x in children:
            if type(x) not in scalars:
                m = meta.get(id(x))
                if m is not None and m[0] >= depth:
                    depth = m[0] + 1
        self.note(c, depth, cost)

    def extend(self, lst: Any, items: list[Any]) -> None:
        """APPEND / APPENDS / LIST: ``lst.extend(items)`` on a list of ours."""
        if type(lst) is not list:
            raise Refused(f"APPEND to a {type(lst).__name__}, not a list")
        lst.extend(items)
        self.count(len(items), len(lst))
        self.grow(lst, items)

    def set_items(self, d: Any, items: list[Any]) -> None:
        """SETITEM / SETITEMS / DICT: ``items`` as key, value, key, value ... into a dict of ours."""
        if not isinstance(d, dict) or type(d) not in (dict, collections.OrderedDict):
            raise Refused(f"SETITEM on a {type(d).__name__}, not a dict")
        if len(items) % 2:
            raise Refused("SETITEMS needs key/value pairs (odd number of items)")
        for i in range(0, len(items), 2):
            d[self.key(items[i], "a dict key")] = items[i + 1]
        self.count(len(items) // 2, len(d))
        self.grow(d, items[1::2])

    def new_dict(self) -> dict[Any, Any]:
        """An empty dict, counted and recorded."""
        return self.note({}, 1, _NOT_KEY, new=True)  # plain: it keeps order, at half OrderedDict's memory

    def new_set(self, kind: type, items: Any, what: str) -> Any:
        """A ``kind`` (set or frozenset) of ``items``, each checked as a key; ``what`` names it."""
        if not isinstance(items, (list, tuple)):
            raise Refused(f"{what} takes a list")
        for x in items:
            self.key(x, f"a {kind.__name__} member")
        s = kind(items)
        self.count(len(s), len(s))
        depth = max((self.info(x)[0] for x in items), default=0) + 1
        return self.note(s, depth, _NOT_KEY, new=True)

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE / INST / OBJ: ``func(*args)`` for the allow-listed stand-ins only."""
        if type(args) is not tuple:
            raise Refused(f"call arguments must be a tuple, got {type(args).__name__}")
        if func is collections.OrderedDict:
            d = self.new_dict()
            if args:
                pairs = args[0]
                if len(args) > 1 or not isinstance(pairs, list) or not all(
                        type(p) is tuple and len(p) == 2 for p in pairs):
                    raise Refused("OrderedDict() takes a list of (key, value) pairs")
                self.set_items(d, [x for p in pairs for x in p])
            return d
        if func is _plain_set or func is _plain_frozenset:
            kind = set if func is _plain_set else frozenset
            if len(args) > 1:
                raise Refused(f"{kind.__name__}() takes one list")
            return self.new_set(kind, args[0] if args else [], f"{kind.__name__}()")
        if isinstance(func, type) and issubclass(func, ObjectStandIn):
            return self.note(func.__new__(func), 1, _NOT_KEY, new=True)
        if any(func is c for c in self.callables):  # `is`: func may be unhashable
            try:
                out = func(*args)
            except TypeError as exc:  # wrong number of arguments
                raise Refused(str(exc)[:200]) from None
            return self.tuple_of(out) if type(out) is tuple else self.plain(out)
        raise Refused(f"{summary(func, 60)} is not callable")

    def new_object(self, cls: Any, args: Any, kwargs: Any = None) -> Any:
        """NEWOBJ / NEWOBJ_EX: ``cls.__new__(cls, *args)`` for an allowed class."""
        if type(args) is not tuple or (kwargs is not None and not isinstance(kwargs, dict)):
            raise Refused("NEWOBJ arguments must be a tuple (and a dict)")
        if cls is collections.OrderedDict:
            return self.new_dict()
        if isinstance(cls, type) and issubclass(cls, ObjectStandIn):
            return self.note(cls.__new__(cls), 1, _NOT_KEY, new=True)
        raise Refused(f"NEWOBJ on {summary(cls, 60)}, which is not an allowed class")

    def build(self, inst: Any, state: Any) -> None:
        """BUILD: an ObjectStandIn takes ``state``; a dict's state (``_metadata``) is dropped; else Refused."""
        if isinstance(inst, ObjectStandIn):
            inst.__setstate__(state)
            self.grow(inst, [state])
        elif type(inst) in (dict, collections.OrderedDict):
            # a state dict's `_metadata` attribute (OrderedDict.__reduce__ state): dropped
            if not (isinstance(state, dict) or (type(state) is tuple and len(state) == 2
                                                and all(s is None or isinstance(s, dict) for s in state))):
                raise Refused(f"state of a dict is a {type(state).__name__}")
        else:
            raise Refused(f"BUILD on {type(inst).__name__.lstrip('_')} is not allowed")

    # ------------------------------------------------------------------------------------- run

    def run(self, buf: Any, pos: int, end: int) -> tuple[Any, int]:
        """Unpickle the pickle at ``buf[pos:end]``; returns the object and the offset after STOP.

        ``buf`` is bytes-like (bytes, or a file's mapping); ``pos`` and ``end`` are byte offsets into it.
        Only ``buf[pos:pos + MAX_PICKLE_BYTES]`` is read.

        Raises:
            Refused: malformed (PT-004). Limit: a limit (PT-010). TooLong: MAX_PICKLE_BYTES (PT-002).
            Whatever ``find_class``, ``persistent_load`` and the stand-ins raise; an IndexError for
            stack underflow, and ValueError, TypeError, KeyError, AttributeError, OverflowError or
            struct.error for some malformed arguments.
        """
        stop = min(end, pos + MAX_PICKLE_BYTES)
        stack: list[Any] = []
        marks: list[int] = []
        memo: dict[int, Any] = {}
        push = stack.append
        spop = stack.pop
        done: list[Any] = []  # STOP puts the result here

        def take(n: int) -> bytes:
            nonlocal pos
            if n < 0 or pos + n > stop:
                if 0 <= n and pos + n <= end:
                    raise TooLong
                raise Refused(f"pickle data was truncated (needs {n} bytes at offset {pos}, "
                              f"{max(0, stop - pos)} left)")
            raw = buf[pos:pos + n]
            pos += n
            return raw

        def u8() -> int:
            nonlocal pos
            if pos >= stop:
                take(1)
            pos += 1
            return buf[pos - 1]

        def line() -> bytes:
            nonlocal pos
            i = buf.find(b"\n", pos, stop)
            if i < 0:
                if stop < end:
                    raise TooLong
                raise Refused("pickle data was truncated (a text argument has no newline)")
            raw = bytes(buf[pos:i])
            pos = i + 1
            return raw

        def text(raw: bytes) -> str:
            return raw.decode("utf-8", "surrogatepass")

        def pop_mark() -> list[Any]:
            if not marks:
                raise Refused("could not find MARK")
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            return items

        def put(idx: int) -> None:
            if not stack:
                raise Refused("PUT with an empty stack")
            if idx not in memo and len(memo) >= MAX_MEMO:
                raise Limit("the pickle's memo has too many entries", f"<= {MAX_MEMO}", f"more than {MAX_MEMO}")
            memo[idx] = stack[-1]

        def get(idx: int) -> None:
            try:
                push(memo[idx])
            except KeyError:
                raise Refused(f"memo key {idx} is not defined") from None

        def too_big(n: int) -> None:
            raise Limit("an integer in the pickle is too large", f"<= {MAX_INT_BYTES} bytes", f"{n} bytes")

        # ---- one small function per opcode (a table lookup costs the same for every opcode)
        def binput() -> None:
            put(u8())

        def binget() -> None:
            nonlocal pos
            if pos >= stop:
                take(1)
            pos += 1
            try:
                push(memo[buf[pos - 1]])
            except KeyError:
                raise Refused(f"memo key {buf[pos - 1]} is not defined") from None

        def long_binput() -> None:
            put(_U32.unpack(take(4))[0])

        def long_binget() -> None:
            get(_U32.unpack(take(4))[0])

        def memoize() -> None:
            put(len(memo))

        def binunicode() -> None:
            push(text(take(_U32.unpack(take(4))[0])))

        def short_binunicode() -> None:
            push(text(take(u8())))

        def binunicode8() -> None:
            push(text(take(_U64.unpack(take(8))[0])))

        def mark() -> None:
            marks.append(len(stack))
            if len(marks) > MAX_DEPTH:
                raise Limit("MARKs are nested too deeply", f"<= {MAX_DEPTH}", len(marks))

        def tuple_() -> None:
            push(self.tuple_of(pop_mark()))

        def tuple_n(n: int) -> Any:
            def op() -> None:
                if len(stack) < n:
                    raise Refused("stack underflow")
                items = stack[-n:]
                del stack[-n:]
                push(self.tuple_of(items))
            return op

        def empty_tuple() -> None:
            push(self.tuple_of(()))

        def binint1() -> None:
            nonlocal pos
            if pos >= stop:
                take(1)
            push(buf[pos])
            pos += 1

        def binint2() -> None:
            push(_U16.unpack(take(2))[0])

        def binint() -> None:
            push(_I32.unpack(take(4))[0])

        def long1() -> None:
            n = u8()
            if n > MAX_INT_BYTES:
                too_big(n)
            push(int.from_bytes(take(n), "little", signed=True))

        def long4() -> None:
            n = _I32.unpack(take(4))[0]
            if n < 0:
                raise Refused("LONG pickle has negative byte count")
            if n > MAX_INT_BYTES:
                too_big(n)
            push(int.from_bytes(take(n), "little", signed=True))

        def binfloat() -> None:
            push(_F64.unpack(take(8))[0])

        def none() -> None:
            push(None)

        def newtrue() -> None:
            push(True)

        def newfalse() -> None:
            push(False)

        def reduce() -> None:
            args = spop()
            stack[-1] = self.call(stack[-1], args)

        def empty_dict() -> None:
            push(self.new_dict())

        def setitems() -> None:
            items = pop_mark()
            self.set_items(stack[-1], items)

        def setitem() -> None:
            v = spop()
            k = spop()
            self.set_items(stack[-1], [k, v])

        def dict_() -> None:
            items = pop_mark()
            d = self.new_dict()
            self.set_items(d, items)
            push(d)

        def empty_list() -> None:
            push(self.note([], 1, _NOT_KEY, new=True))

        def appends() -> None:
            items = pop_mark()
            self.extend(stack[-1], items)

        def append() -> None:
            v = spop()
            self.extend(stack[-1], [v])

        def list_() -> None:
            items = pop_mark()
            lst = self.note([], 1, _NOT_KEY, new=True)
            self.extend(lst, items)
            push(lst)

        def empty_set() -> None:
            push(self.new_set(set, [], "set()"))

        def additems() -> None:
            items = pop_mark()
            s = stack[-1]
            if type(s) is not set:
                raise Refused(f"ADDITEMS to a {type(s).__name__}, not a set")
            for x in items:
                s.add(self.key(x, "a set member"))
            self.count(len(items), len(s))
            self.grow(s, items)

        def frozenset_() -> None:
            push(self.new_set(frozenset, pop_mark(), "frozenset()"))

        def global_() -> None:
            module = text(line())
            push(self.plain(self.find_class(module, text(line()))))

        def stack_global() -> None:
            name = spop()
            module = spop()
            if type(name) is not str or type(module) is not str:
                raise Refused("STACK_GLOBAL requires str module and name")
            push(self.plain(self.find_class(module, name)))

        def binpersid() -> None:
            stack[-1] = self.plain(self.persistent_load(stack[-1]))

        def persid() -> None:
            push(self.plain(self.persistent_load(line().decode("ascii"))))

        def newobj() -> None:
            args = spop()
            stack[-1] = self.new_object(stack[-1], args)

        def newobj_ex() -> None:
            kwargs = spop()
            args = spop()
            stack[-1] = self.new_object(stack[-1], args, kwargs)

        def build() -> None:
            state = spop()
            self.build(stack[-1], state)

        def inst() -> None:
            module = text(line())
            cls = self.find_class(module, text(line()))
            push(self.call(cls, self.tuple_of(pop_mark())))

        def obj() -> None:
            items = pop_mark()
            if not items:
                raise Refused("OBJ without a class")
            push(self.call(items[0], self.tuple_of(items[1:])))

        def proto() -> None:
            p = u8()
            if p > pickle.HIGHEST_PROTOCOL:
                raise Refused(f"unsupported pickle protocol: {p}")

        def frame() -> None:  # a hint for buffered readers; we read from memory
            take(8)

        def stop_() -> None:
            if not stack:
                raise Refused("STOP with an empty stack")
            done.append(spop())

        def pop() -> None:
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                spop()

        def pop_mark_() -> None:
            pop_mark()

        def dup() -> None:
            push(stack[-1])

        def binbytes() -> None:
            push(take(_U32.unpack(take(4))[0]))

        def short_binbytes() -> None:
            push(take(u8()))

        def binbytes8() -> None:
            push(take(_U64.unpack(take(8))[0]))

        def bytearray8() -> None:
            push(self.plain(bytearray(take(_U64.unpack(take(8))[0]))))

        def binstring() -> None:  # protocol 1 str, read as utf-8
            push(take(_I32.unpack(take(4))[0]).decode("utf-8"))

        def short_binstring() -> None:
            push(take(u8()).decode("utf-8"))

        def int_() -> None:
            raw = line()
            push(False if raw == b"00" else True if raw == b"01" else _decode_long_text(raw))

        def long_() -> None:
            raw = line()
            push(_decode_long_text(raw[:-1] if raw.endswith(b"L") else raw))

        def float_() -> None:
            push(float(line()))

        def string() -> None:
            raw = line()
            if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
                raise Refused("the STRING opcode argument must be quoted")
            push(codecs.escape_decode(raw[1:-1])[0].decode("utf-8"))

        def unicode() -> None:
            push(line().decode("raw-unicode-escape"))

        def get_() -> None:
            get(_decode_long_text(line()))

        def put_() -> None:
            put(_decode_long_text(line()))

        def ext(size: int) -> Any:
            def op() -> None:
                raw = take(size)
                code = raw[0] if size == 1 else _U16.unpack(raw)[0] if size == 2 else _I32.unpack(raw)[0]
                pair = copyreg._inverted_registry.get(code)  # type: ignore[attr-defined]
                if pair is None:
                    raise Refused(f"unregistered extension code {code}")
                push(self.plain(self.find_class(*pair)))
            return op

        def buffer() -> None:
            raise Refused("out-of-band buffers (NEXT_BUFFER) are not part of a checkpoint")

        table: list[Any] = [None] * 256
        for code, fn in {
            b"q": binput, b"h": binget, b"r": long_binput, b"j": long_binget, b"\x94": memoize,
            b"X": binunicode, b"\x8c": short_binunicode, b"\x8d": binunicode8, b"(": mark, b"t": tuple_,
            b"\x85": tuple_n(1), b"\x86": tuple_n(2), b"\x87": tuple_n(3), b")": empty_tuple,
            b"K": binint1, b"M": binint2, b"J": binint, b"\x8a": long1, b"\x8b": long4, b"G": binfloat,
            b"N": none, b"\x88": newtrue, b"\x89": newfalse, b"R": reduce, b"}": empty_dict, b"u": setitems,
            b"s": setitem, b"d": dict_, b"]": empty_list, b"e": appends, b"a": append, b"l": list_,
            b"\x8f": empty_set, b"\x90": additems, b"\x91": frozenset_, b"c": global_,
            b"\x93": stack_global, b"Q": binpersid, b"P": persid, b"\x81": newobj, b"\x92": newobj_ex,
            b"b": build, b"i": inst, b"o": obj, b"\x80": proto, b"\x95": frame, b".": stop_, b"0": pop,
            b"1": pop_mark_, b"2": dup, b"B": binbytes, b"C": short_binbytes, b"\x8e": binbytes8,
            b"\x96": bytearray8, b"T": binstring, b"U": short_binstring, b"I": int_, b"L": long_,
            b"F": float_, b"S": string, b"V": unicode, b"g": get_, b"p": put_, b"\x82": ext(1),
            b"\x83": ext(2), b"\x84": ext(4), b"\x97": buffer, b"\x98": buffer,
        }.items():
            table[code[0]] = fn

        ops = 0
        while not done:
            if pos >= stop:
                take(1)  # raises: truncated, or over MAX_PICKLE_BYTES
            handler = table[buf[pos]]
            pos += 1
            if handler is None:
                raise Refused(f"invalid load key {chr(buf[pos - 1])!r} (opcode 0x{buf[pos - 1]:02x}) "
                              f"at offset {pos - 1}")
            handler()
            ops += 1
            if not ops & 1023:
                if ops > MAX_OPCODES:
                    raise Limit("the pickle has too many opcodes", f"<= {MAX_OPCODES}", f"more than {MAX_OPCODES}")
                if len(stack) > MAX_CONTAINER_ITEMS:
                    raise Limit("the pickle's stack holds too many values", f"<= {MAX_CONTAINER_ITEMS}",
                                len(stack))
        return done[0], pos


_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")

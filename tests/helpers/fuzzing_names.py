"""Structure-aware fuzzing of the strings and paths a checkpoint names: pickle strings, index names, shard files.

Where :mod:`tests.helpers.fuzzing` flips bytes, these kinds change one named thing of a real model and write
it back well formed, so the reader sees a structured change and not byte garbage:

- ``struct-pickle-strings``: a real ``torch.save`` checkpoint (``.pt``, ``pytorch_model.bin`` alone or in its
  model directory; zip or legacy layout; the QuantState as torch saves it, as a pickled
  ``bitsandbytes.functional.QuantState`` object or as bnb 0.40's list) decoded into a tree (:func:`decode`:
  ``pickle.Unpickler`` whose globals and persistent ids become inert nodes), one string of it replaced, and
  encoded again (:class:`Encoder`) into a zip with valid CRCs or a legacy file. The strings: tensor names
  (lone surrogates, NUL, invalid UTF-8 through BINUNICODE / SHORT_BINSTRING / BINSTRING, bytes through
  BINBYTES, empty, 100k characters, ``/`` and ``..``, ``__metadata__``, names equal after Unicode
  normalization, duplicate keys, keys that collide once nested dicts are flattened, keys of other types), a
  persistent id's tag, storage key and location (``cuda:0``, ``meta``, ...), the storage class and the
  rebuild function a REDUCE calls, and the strings of a QuantState (its keys, ``quant_type``, its dtype).
- ``struct-index-names``: a sharded model's ``model.safetensors.index.json``: one tensor name or shard name
  set to NUL, a lone surrogate escape, ``..``, ``../x``, an absolute path, a name with ``/`` (to a real
  shard in a subdirectory), a directory, a symlink to outside the directory, a missing file, another
  shard, more than 255 bytes, a Unicode-normalization or case variant, the empty string, a non-string;
  or a shard renamed (spaces, non-ASCII, a newline) with the index following it.
- ``struct-shard-paths``: the files of a model directory themselves (sharded, one ``model.safetensors``,
  or ``pytorch_model.bin``): a weight file, the index or ``config.json`` replaced by a symlink (inside the
  directory, outside it, dangling, a loop, to a device), a directory, a FIFO, a zero-length file, an
  unreadable file (``chmod 000``; skipped as root, where it restricts nothing), or SRC itself a symlink.

Every case is judged by :func:`tests.helpers.fuzzing.judge`: a correct conversion (the output loads with
the safetensors library and equals the independent reference; a pickled-object or list QuantState has no
reference, so there the output must load) or one of our errors with nothing left behind, ``inspect`` and
``--dry-run`` ending in a report or one of our errors, the input unchanged, ``check`` agreeing. A case runs
under the hang guard (a FIFO must be refused before it is opened).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import tempfile
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from tests.helpers.fixtures import FIXTURES, SINGLE
from tests.helpers.fuzzing import NAME_KINDS, judge

SEED_PT = SINGLE / "nf4_bs32_dq_bfloat16_37x51_normal.q.pt"
BIN_DIR = FIXTURES / "models" / "llama_nf4_dq_bin"
MODEL = FIXTURES / "models" / "llama_nf4_dq"
SHARDED = FIXTURES / "models" / "llama_nf4_dq_sharded"
INDEX = "model.safetensors.index.json"

# ------------------------------------------------------------------------------------ a pickle as a tree


class GlobalNode:
    """A global named by a pickle (the class itself: one subclass per module and name, see :func:`_global`),
    or what calling it made: REDUCE (``how == "reduce"``, ``args``) or NEWOBJ then BUILD (``how ==
    "newobj"``, ``args``, ``state``). Nothing is imported or run."""

    module = ""
    name = ""

    def __new__(cls, *args: Any) -> GlobalNode:
        obj = object.__new__(cls)
        obj.args = list(args)
        obj.how = "newobj"
        obj.state = None
        return obj

    def __init__(self, *args: Any) -> None:
        self.how = "reduce"

    def __setstate__(self, state: Any) -> None:
        self.state = state


_GLOBALS: dict[tuple[str, str], type[GlobalNode]] = {}


def _global(module: str, name: str) -> type[GlobalNode]:
    """The node class of ``module.name`` (one per name, so the same global decodes to the same class)."""
    key = (module, name)
    if key not in _GLOBALS:
        _GLOBALS[key] = type("G", (GlobalNode,), {"module": module, "name": name})
    return _GLOBALS[key]


@dataclass
class PersId:
    """A persistent id (torch's storage record): ``['storage', StorageClass, key, location, numel(, view)]``."""

    pid: list[Any]


@dataclass
class Str:
    """A string spelled with a given opcode: ``value`` is the text, or (``BINUNICODE`` with bytes, the
    byte-string opcodes) the raw bytes the opcode carries."""

    value: str | bytes
    opcode: str = "BINUNICODE"


@dataclass
class Pairs:
    """A dict written as SETITEMS of these pairs, in order: duplicate keys and keys of any type."""

    items: list[tuple[Any, Any]] = field(default_factory=list)


class _Decoder(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return PersId(list(pid))


def decode(blob: bytes) -> Any:
    """The tree of a pickle: its containers, with :class:`GlobalNode` / :class:`PersId` for what it names."""
    return _Decoder(io.BytesIO(blob)).load()


#: Opcodes a :class:`Str` may be spelled with (protocol 0-4 strings, and bytes).
STR_OPCODES = ["BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "BINBYTES", "SHORT_BINBYTES"]


class Encoder:
    """Writes a tree back as a protocol 2 pickle (every string as :class:`Str` says, any dict as :class:`Pairs`)."""

    def __init__(self) -> None:
        self.out = io.BytesIO()

    def dumps(self, obj: Any) -> bytes:
        self.out.write(b"\x80\x02")
        self.emit(obj)
        self.out.write(b".")
        return self.out.getvalue()

    def string(self, s: Str) -> None:
        w = self.out.write
        raw = s.value if isinstance(s.value, bytes) else s.value.encode("utf-8", "surrogatepass")
        if s.opcode == "UNICODE":  # protocol 0: raw-unicode-escape up to a newline
            text = s.value if isinstance(s.value, str) else s.value.decode("latin-1")
            w(b"V" + text.replace("\\", "\\u005c").replace("\n", "\\u000a").encode("raw-unicode-escape",
                                                                                 "surrogatepass") + b"\n")
        elif s.opcode == "SHORT_BINUNICODE" and len(raw) < 256:
            w(b"\x8c" + bytes([len(raw)]) + raw)
        elif s.opcode == "BINUNICODE8":
            w(b"\x8d" + struct.pack("<Q", len(raw)) + raw)
        elif s.opcode == "SHORT_BINSTRING" and len(raw) < 256:
            w(b"U" + bytes([len(raw)]) + raw)
        elif s.opcode == "BINSTRING":
            w(b"T" + struct.pack("<i", len(raw)) + raw)
        elif s.opcode == "SHORT_BINBYTES" and len(raw) < 256:
            w(b"C" + bytes([len(raw)]) + raw)
        elif s.opcode == "BINBYTES":
            w(b"B" + struct.pack("<I", len(raw)) + raw)
        else:
            w(b"X" + struct.pack("<I", len(raw)) + raw)

    def emit(self, obj: Any) -> None:
        w = self.out.write
        if obj is None:
            w(b"N")
        elif obj is True or obj is False:
            w(b"\x88" if obj else b"\x89")
        elif isinstance(obj, int):
            if -(2**31) <= obj < 2**31:
                w(b"J" + struct.pack("<i", obj))
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                w(b"\x8a" + bytes([len(raw)]) + raw)
        elif isinstance(obj, float):
            w(b"G" + struct.pack(">d", obj))
        elif isinstance(obj, str):
            self.string(Str(obj))
        elif isinstance(obj, bytes):
            self.string(Str(obj, "BINBYTES"))
        elif isinstance(obj, Str):
            self.string(obj)
        elif isinstance(obj, tuple):
            w(b"(")
            for x in obj:
                self.emit(x)
            w(b"t")
        elif isinstance(obj, list):
            w(b"]")
            if obj:
                w(b"(")
                for x in obj:
                    self.emit(x)
                w(b"e")
        elif isinstance(obj, (dict, Pairs)):
            items = obj.items if isinstance(obj, Pairs) else list(obj.items())
            w(b"}")
            if items:
                w(b"(")
                for k, v in items:
                    self.emit(k)
                    self.emit(v)
                w(b"u")
        elif isinstance(obj, type) and issubclass(obj, GlobalNode):
            w(b"c" + obj.module.encode("utf-8", "surrogatepass") + b"\n" + obj.name.encode("utf-8", "surrogatepass")
              + b"\n")
        elif isinstance(obj, GlobalNode):
            self.emit(type(obj))
            self.emit(tuple(obj.args))
            w(b"R" if obj.how == "reduce" else b"\x81")
            if obj.state is not None:
                self.emit(obj.state)
                w(b"b")
        elif isinstance(obj, PersId):
            self.emit(tuple(obj.pid))
            w(b"Q")
        else:
            raise TypeError(type(obj))


# ------------------------------------------------------------------------------------ torch files


@dataclass
class TorchFile:
    """A torch checkpoint taken apart: the pickle's tree and each storage's bytes by key."""

    archive: str
    tree: Any
    storages: dict[str, bytes]
    extra: dict[str, bytes]  # other zip members (byteorder, version, ...) by name under the archive


def load_zip(path: Path) -> TorchFile:
    """A torch zip checkpoint as a :class:`TorchFile`."""
    with zipfile.ZipFile(path) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        archive = pkl.split("/")[0]
        storages, extra = {}, {}
        for info in zf.infolist():
            rel = info.filename[len(archive) + 1:]
            if rel.startswith("data/"):
                storages[rel[len("data/"):]] = zf.read(info)
            elif rel != "data.pkl":
                extra[rel] = zf.read(info)
        return TorchFile(archive, decode(zf.read(pkl)), storages, extra)


def save_zip(tf: TorchFile, path: Path) -> None:
    """Write ``tf`` as torch.save's zip layout (members stored, valid CRCs)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{tf.archive}/data.pkl", Encoder().dumps(tf.tree))
        for rel, blob in tf.extra.items():
            zf.writestr(f"{tf.archive}/{rel}", blob)
        for key, blob in tf.storages.items():
            zf.writestr(f"{tf.archive}/data/{key}", blob)


def _pids(tree: Any) -> list[PersId]:
    """Every persistent id of a tree, in order (iterative walk; each once)."""
    out: list[PersId] = []
    seen: set[int] = set()
    todo = [tree]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, PersId):
            out.append(x)
            todo.extend(reversed(x.pid))
        elif isinstance(x, (list, tuple)):
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            todo.extend(reversed([v for kv in x.items() for v in kv]))
        elif isinstance(x, Pairs):
            todo.extend(reversed([v for kv in x.items for v in kv]))
        elif isinstance(x, GlobalNode):
            todo.extend(reversed([*x.args, x.state]))
    return out


_ITEMSIZE = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
             "Byte": 1, "Bool": 1, "Untyped": 1}


def save_legacy(tf: TorchFile, path: Path) -> None:
    """Write ``tf`` as torch.save's legacy layout: magic, protocol, sys info, the pickle (persistent ids
    with a ``None`` view), the storage key list, then each storage as its element count and bytes."""
    for pid in _pids(tf.tree):
        if len(pid.pid) == 5:
            pid.pid.append(None)
    keys = list(dict.fromkeys(p.pid[2] for p in _pids(tf.tree) if len(p.pid) > 2 and isinstance(p.pid[2], str)))
    with open(path, "wb") as f:
        f.write(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
        f.write(pickle.dumps(1001, protocol=2))
        f.write(pickle.dumps({"protocol_version": 1001, "little_endian": True,
                              "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2))
        f.write(Encoder().dumps(tf.tree))
        f.write(Encoder().dumps(keys))
        for key in keys:
            blob = tf.storages.get(key, b"")
            pid = next(p for p in _pids(tf.tree) if len(p.pid) > 2 and p.pid[2] == key)
            stype = pid.pid[1]
            item = _ITEMSIZE.get(stype.name.removesuffix("Storage"), 1) if isinstance(stype, type) else 1
            f.write(struct.pack("<q", len(blob) // item))
            f.write(blob)


# ------------------------------------------------------------------------------------ hostile strings

#: Names a file may hold where a tensor name or file name is expected.
HOSTILE_NAMES = [
    "\ud800", "a\ud800b", "\udfff", "x.weight\udc80", "\x00", "a\x00b", "layer.weight\x00", "", " ", "/", "a/b",
    "/abs/x", "../x", "..", ".", "x.", ".x", "a..b", "\n", "a\nb", "\t", "caf\u00e9", "cafe\u0301", "\u0130", "\u00df",
    "\U0001f999", "\u202e", "\ufeff", "\uffff", "__metadata__", "x" * 100_000, "\u00e9" * 300, "a" * 256,
    "model.safetensors", "layer.weight.quant_state.bitsandbytes__nf4", "layer.weight.absmax",
]
#: Invalid UTF-8 and other raw bytes a byte-string opcode may carry.
RAW_BYTES = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x80b", b"\xf8\x88\x80\x80\x80", b"\x00", b"", b"layer.weight"]


def _variants(name: str) -> list[str]:
    """Names a real one turns into: other normalizations, case, padding, a suffix, a prefix, a slash."""
    return [unicodedata.normalize("NFD", name + "\u00e9"), name + "\u00e9", name.upper(), name.title(), " " + name,
            name + " ", name + "\x00", name + "\ud800", name.replace(".", "/"), name.replace(".", ".."),
            "." + name, name + ".", "model." + name, name + ".absmax"]


def hostile_name(data: st.DataObject, original: str, label: str) -> str:
    """One hostile replacement of the name ``original``."""
    return data.draw(st.one_of(st.sampled_from(HOSTILE_NAMES), st.sampled_from(_variants(original)),
                               st.text(max_size=8)), label=label)


def hostile_str(data: st.DataObject, original: str, label: str) -> Any:
    """A replacement for a pickle string: a hostile text in a drawn opcode, raw bytes, or another type."""
    how = data.draw(st.sampled_from(["text", "text", "text", "bytes", "type"]), label=f"{label} how")
    if how == "text":
        return Str(hostile_name(data, original, label), data.draw(st.sampled_from(STR_OPCODES), label=f"{label} op"))
    if how == "bytes":
        raw = data.draw(st.sampled_from(RAW_BYTES), label=f"{label} bytes")
        return Str(raw, data.draw(st.sampled_from(["BINUNICODE", "SHORT_BINSTRING", "BINSTRING", "BINBYTES",
                                                   "SHORT_BINBYTES"]), label=f"{label} op"))
    return data.draw(st.sampled_from([0, -1, 2**40, 1.5, None, True, (original,), (original, 1), ()]),
                     label=f"{label} value")


# ------------------------------------------------------------------------------------ struct-pickle-strings


def _quant_state_forms(tf: TorchFile, form: str) -> None:
    """Replace the seed's JSON QuantState tensor by the same state as a pickled QuantState object, as bnb
    0.40's list, or unpacked into Python values (``form``)."""
    top: dict[str, Any] = tf.tree
    key = next(k for k in top if ".quant_state." in k)
    weight = key.split(".quant_state.")[0]
    qs_node = top.pop(key)
    pid = next(x for x in qs_node.args if isinstance(x, PersId))
    state = json.loads(tf.storages.pop(pid.pid[2]))
    absmax, code = top.pop(f"{weight}.absmax"), top.pop(f"{weight}.quant_map")
    a2, code2 = top.pop(f"{weight}.nested_absmax", None), top.pop(f"{weight}.nested_quant_map", None)
    size = _global("torch", "Size")(tuple(state["shape"]))
    dtype = _global("torch", state["dtype"])
    nested_dtype = _global("torch", state.get("nested_dtype", "float32"))
    offset = state.get("nested_offset")
    if form == "object":
        qs = _global("bitsandbytes.functional", "QuantState").__new__(_global("bitsandbytes.functional", "QuantState"))
        state2 = None
        if a2 is not None:
            state2 = _global("bitsandbytes.functional", "QuantState").__new__(
                _global("bitsandbytes.functional", "QuantState"))
            state2.state = {"absmax": a2, "code": code2, "blocksize": state["nested_blocksize"], "dtype": nested_dtype,
                            "quant_type": None, "offset": None, "state2": None, "nested": False}
        qs.state = {"absmax": absmax, "shape": size, "code": code, "dtype": dtype, "blocksize": state["blocksize"],
                    "quant_type": state["quant_type"], "offset": offset, "state2": state2, "nested": a2 is not None}
        top[f"{weight}.quant_state"] = qs
    elif form == "list":
        compressed = None if a2 is None else [offset, [a2, code2, state["nested_blocksize"], False, nested_dtype,
                                                       None, None]]
        top[f"{weight}.quant_state"] = [absmax, size, dtype, state["blocksize"], compressed, state["quant_type"]]
    else:  # unpacked: the JSON's fields as Python values beside the tensors
        top[f"{weight}.absmax"], top[f"{weight}.quant_map"] = absmax, code
        if a2 is not None:
            top[f"{weight}.nested_absmax"], top[f"{weight}.nested_quant_map"] = a2, code2
        for k, v in state.items():
            top[f"{weight}.{k}"] = v if k != "shape" else size


def _strings(tree: Any) -> list[tuple[Any, Any]]:
    """Every (container, index or key) holding a str inside ``tree``, values and dict keys (("key", dict, k))."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    todo = [tree]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (PersId, list)):
            items = x.pid if isinstance(x, PersId) else x
            out += [(items, i) for i, v in enumerate(items) if isinstance(v, str)]
            todo += [v for v in items if not isinstance(v, str)]
        elif isinstance(x, dict):
            out += [(("key", x), k) for k in x if isinstance(k, str)]
            out += [(x, k) for k, v in x.items() if isinstance(v, str)]
            todo += [v for v in x.values() if not isinstance(v, str)]
        elif isinstance(x, tuple):
            todo += list(x)
        elif isinstance(x, GlobalNode):
            todo += [x.args, x.state]
    return out


def _replace_key(d: dict[str, Any], key: str, new: Any) -> Pairs:
    """``d`` as :class:`Pairs` with ``key`` replaced by ``new`` in place (order kept)."""
    return Pairs([(new if k == key else k, v) for k, v in d.items()])


def mut_pickle_strings(data: st.DataObject, work: Path) -> tuple[Path, bool]:
    """A real torch checkpoint with one of its pickle strings replaced; (SRC, whether the value reference
    applies: not to a QuantState pickled as an object, a list or values)."""
    seed = data.draw(st.sampled_from(["pt", "pt", "bin", "bin-dir"]), label="seed")
    form = data.draw(st.sampled_from(["json", "json", "object", "list", "unpacked"]) if seed == "pt"
                     else st.just("json"), label="quant state")
    tf = load_zip(SEED_PT if seed == "pt" else BIN_DIR / "pytorch_model.bin")
    if form != "json":
        _quant_state_forms(tf, form)
    top: dict[str, Any] = tf.tree
    op = data.draw(st.sampled_from(["name", "name", "name-extra", "name-extra", "name-duplicate", "name-nested",
                                    "pid-key", "pid-key",
                                    "pid-location", "pid-tag", "storage-class", "rebuild", "archive",
                                    "any-string", "any-string"]), label="op")
    names = list(top)
    name = data.draw(st.sampled_from(names), label="tensor")
    if op == "name":
        tf.tree = _replace_key(top, name, hostile_str(data, name, "name"))
    elif op == "name-extra":  # one more (plain) tensor under a hostile name, the layers left whole
        tf.tree = Pairs([*top.items(), (hostile_str(data, name, "name"), top[name])])
    elif op == "name-duplicate":  # the same key twice (the later wins, as in torch.load) or another's name
        other = data.draw(st.sampled_from(names), label="other")
        pairs = list(top.items())
        if data.draw(st.booleans(), label="append"):
            pairs.append((other, top[name]))
        else:
            pairs = [(other if k == name else k, v) for k, v in pairs]
        tf.tree = Pairs(pairs)
    elif op == "name-nested":  # {a: {b: t}} flattened to "a.b": the same name as a top-level one, or a new one
        head, _, tail = name.partition(".")
        inner: Any = {tail or "": top[name]}
        if data.draw(st.booleans(), label="keep"):
            pairs = [*top.items(), (head, inner)]  # "head.tail" twice after flattening
        else:
            pairs = [(k, v) for k, v in top.items() if k != name] + [(head, inner)]
        tf.tree = Pairs(pairs)
    elif op in ("pid-key", "pid-location", "pid-tag"):
        pids = _pids(top)
        pid = data.draw(st.sampled_from(pids), label="pid")
        i = {"pid-key": 2, "pid-location": 3, "pid-tag": 0}[op]
        old = pid.pid[i]
        if op == "pid-location":
            new: Any = data.draw(st.one_of(st.sampled_from(["cuda:0", "cuda", "cuda:99", "meta", "mps", "cpu:0",
                                                            "xla:0", "", "CPU"]),
                                           st.just(hostile_str(data, old, "location"))), label="location")
        elif op == "pid-tag":
            new = data.draw(st.sampled_from(["module", "", "Storage", b"storage", Str("storage", "SHORT_BINSTRING"),
                                             Str("storage", "UNICODE"), Str(b"storage", "SHORT_BINBYTES")]),
                            label="tag")
        else:
            new = data.draw(st.one_of(st.sampled_from([pp.pid[2] for pp in pids] + ["", "../0", "0/..", "k" * 300]),
                                      st.just(hostile_str(data, old, "key"))), label="key")
            # the storage record follows the new key (when it can be a zip member name) or stays
            if (isinstance(new, str) and data.draw(st.booleans(), label="rename record") and "\0" not in new
                    and all(not 0xD800 <= ord(c) <= 0xDFFF for c in new) and new not in tf.storages):
                tf.storages[new] = tf.storages.pop(old)
        every = op != "pid-key" and data.draw(st.booleans(), label="every pid")  # torch memoizes 'cpu'
        for pp in pids:
            if pp is pid or (every and pp.pid[i] == old):
                pp.pid[i] = new
    elif op == "storage-class":
        pid = data.draw(st.sampled_from(_pids(top)), label="pid")
        module, cname = data.draw(st.sampled_from([
            ("torch", "FloatStorage"), ("torch", "HalfStorage"), ("torch", "BFloat16Storage"), ("torch", "ByteStorage"),
            ("torch", "UntypedStorage"), ("torch.cuda", "BFloat16Storage"), ("torch.cuda", "ByteStorage"),
            ("torch", "Float8_e4m3fnStorage"), ("torch", "QInt8Storage"), ("torch", "ComplexFloatStorage"),
            ("torch", "FooStorage"), ("torch", "storage"), ("torch", ""), ("torch.cuda", "UntypedStorage"),
            ("torch", "Float\ud800Storage"), ("torch\x00", "FloatStorage")]), label="class")
        pid.pid[1] = _global(module, cname)
    elif op == "rebuild":  # the function a tensor's REDUCE calls
        calls = [v for v in top.values() if isinstance(v, GlobalNode) and v.how == "reduce"]
        if calls:
            module, fname = data.draw(st.sampled_from([
                ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_parameter"),
                ("torch._utils", "_rebuild_qtensor"), ("torch._utils", "_rebuild_meta_tensor_no_storage"),
                ("torch._utils", "_rebuild_device_tensor_from_numpy"), ("torch._utils", "_rebuild_tensor_v3"),
                ("torch._tensor", "_rebuild_from_type_v2"), ("torch._utils", ""), ("", "_rebuild_tensor_v2")]),
                label="function")
            data.draw(st.sampled_from(calls), label="call").__class__ = _global(module, fname)
    elif op == "archive":
        tf.archive = data.draw(st.sampled_from(["", "a b", "caf\u00e9", "x" * 300, "..", "data", "archive.pt"]),
                               label="archive")
    else:  # any string of the tree: a QuantState's keys and values, a dtype spelled as text, ...
        places = _strings(top)
        if places:
            where, key = data.draw(st.sampled_from(places), label="where")
            if isinstance(where, tuple) and where and where[0] == "key":
                d = where[1]
                new_key = hostile_str(data, key, "key")
                items = [(new_key if k == key else k, v) for k, v in d.items()]
                d.clear()
                d.update({k: v for k, v in items if isinstance(k, str)})  # non-str keys: written as Pairs below
                if not isinstance(new_key, str):
                    if d is top:
                        tf.tree = Pairs(items)
                    else:
                        d[key] = Pairs(items)  # (a nested dict stays a dict; its replaced key is written as Pairs)
            else:
                where[key] = hostile_str(data, where[key], "value")
    layout = data.draw(st.sampled_from(["zip", "zip", "legacy"]), label="layout")
    if seed == "bin-dir":
        src = work / "in" / "model"
        shutil.copytree(BIN_DIR, src)
        target = src / "pytorch_model.bin"
        target.unlink()
    else:
        src = work / "in" / ("model.pt" if seed == "pt" else "model.bin")
        src.parent.mkdir(parents=True)
        target = src
    (save_legacy if layout == "legacy" else save_zip)(tf, target)
    return src, form == "json"


# ------------------------------------------------------------------------------------ struct-index-names


def _outside(work: Path, shard: Path) -> Path:
    """A copy of ``shard`` outside the model directory."""
    far = work / "outside" / shard.name
    far.parent.mkdir(exist_ok=True)
    if not far.exists():
        shutil.copy(shard, far)
    return far


def mut_index_names(data: st.DataObject, work: Path, root: Path) -> None:
    """One tensor name or shard name of the index set to a hostile value (with the file it needs, if any),
    or a shard renamed on disk with the index following it."""
    path = root / INDEX
    index = json.loads(path.read_text())
    wmap: dict[str, Any] = index["weight_map"]
    shards = list(dict.fromkeys(wmap.values()))
    op = data.draw(st.sampled_from(["key", "key", "value", "value", "value", "shard-all", "rename", "duplicate-key"]),
                   label="op")
    name = data.draw(st.sampled_from(sorted(wmap)), label="tensor")
    if op == "key":
        new = hostile_name(data, name, "name")
        wmap = {(new if k == name else k): v for k, v in wmap.items()}
    elif op in ("value", "shard-all"):
        shard = wmap[name] if op == "value" else data.draw(st.sampled_from(shards), label="shard")
        how = data.draw(st.sampled_from(["name", "name", "absolute", "subdir", "directory", "symlink-outside",
                                         "symlink-inside", "missing", "other-shard", "long", "variant",
                                         "non-string"]), label="how")
        if how == "name":
            new = hostile_name(data, shard, "shard name")
        elif how == "absolute":
            new = str(root / shard)
        elif how == "subdir":  # a real shard, but in a subdirectory
            (root / "sub").mkdir(exist_ok=True)
            shutil.copy(root / shard, root / "sub" / shard)
            new = f"sub/{shard}"
        elif how == "directory":
            new = data.draw(st.sampled_from(["sub", "shard.safetensors"]), label="dir name")
            (root / new).mkdir(exist_ok=True)
        elif how == "symlink-outside":  # as the Hub cache's snapshot links to its blobs: a real file
            new = "link.safetensors"
            (root / new).symlink_to(_outside(work, root / shard))
            if data.draw(st.booleans(), label="drop original"):
                (root / shard).unlink()
        elif how == "symlink-inside":
            new = "link.safetensors"
            (root / new).symlink_to(shard)
        elif how == "missing":
            new = "model-00009-of-00009.safetensors"
        elif how == "other-shard":
            new = data.draw(st.sampled_from(shards), label="other")
        elif how == "long":
            new = data.draw(st.sampled_from(["m" * 251 + ".safetensors", "\u00e9" * 130 + ".safetensors",
                                             "m" * 5000]), label="long")
        elif how == "variant":
            new = data.draw(st.sampled_from([shard.upper(), unicodedata.normalize("NFD", shard), shard + " ",
                                             " " + shard, shard.replace(".safetensors", ".SAFETENSORS"),
                                             "./" + shard, shard + "/", shard + "\x00"]), label="variant")
        else:
            new = data.draw(st.sampled_from([None, 0, 1.5, True, [shard], {"file": shard}]), label="value")
        if op == "value":
            wmap[name] = new
        else:
            wmap = {k: (new if v == shard else v) for k, v in wmap.items()}
    elif op == "rename":  # the file renamed and the index following it: a clean conversion expected
        shard = data.draw(st.sampled_from(shards), label="shard")
        new = data.draw(st.sampled_from(["model 00001.safetensors", "mod\u00e8le.safetensors",
                                         unicodedata.normalize("NFD", "mod\u00e8le.safetensors"), "a\nb.safetensors",
                                         "-x.safetensors", " .safetensors", "\U0001f999.safetensors",
                                         "m" * 240 + ".safetensors", "x.SAFETENSORS"]), label="new name")
        (root / shard).rename(root / new)
        if data.draw(st.integers(0, 3), label="index follows") > 0:
            wmap = {k: (new if v == shard else v) for k, v in wmap.items()}
    index["weight_map"] = wmap
    text = json.dumps(index)
    if op == "duplicate-key":  # the same tensor name twice in the JSON text, to the same or another shard
        other = data.draw(st.sampled_from(shards), label="shard")
        text = text.replace('"weight_map": {', '"weight_map": {' + json.dumps(name) + ": " + json.dumps(other) + ", ",
                            1)
    path.write_text(text)


# ------------------------------------------------------------------------------------ struct-shard-paths


def mut_shard_paths(data: st.DataObject, work: Path, root: Path) -> Path:
    """One to three files of a model directory each replaced by something that is not a plain file, made
    empty or unreadable, or renamed; returns SRC (the directory, or a symlink to it)."""
    weights = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))
    files = [*weights, INDEX, "config.json", "tokenizer.json"]
    targets = data.draw(st.lists(st.sampled_from(files), min_size=1, max_size=3, unique=True), label="files")
    for target in targets[:-1]:
        _replace_file(data, work, root, target)
    return _replace_file(data, work, root, targets[-1])


def _replace_file(data: st.DataObject, work: Path, root: Path, target: str) -> Path:
    """:func:`mut_shard_paths` for one file ``target`` of ``root``; returns SRC."""
    path = root / target
    how = data.draw(st.sampled_from(["symlink-inside", "symlink-outside", "symlink-relative-outside", "dangling",
                                     "loop", "self-loop", "device", "directory", "directory-holding", "fifo",
                                     "empty", "unreadable", "rename", "src-symlink", "src-loop"]), label="how")
    if how == "unreadable" and os.geteuid() == 0:
        how = "empty"  # chmod 000 restricts nothing for root
    exists = path.exists()
    if how == "symlink-inside" and exists:  # the Hub cache's layout, within the directory
        (root / ".blobs").mkdir(exist_ok=True)
        path.rename(root / ".blobs" / "0123abcd")
        path.symlink_to(Path(".blobs") / "0123abcd")
    elif how in ("symlink-outside", "symlink-relative-outside") and exists:
        far = _outside(work, path)
        path.unlink()
        path.symlink_to(far if how == "symlink-outside" else os.path.relpath(far, root))
    elif how == "dangling":
        path.unlink(missing_ok=True)
        path.symlink_to("nowhere.safetensors")
    elif how == "loop":
        path.unlink(missing_ok=True)
        path.symlink_to(f"{target}-b")
        (root / f"{target}-b").symlink_to(target)
    elif how == "self-loop":
        path.unlink(missing_ok=True)
        path.symlink_to(target)
    elif how == "device":
        path.unlink(missing_ok=True)
        path.symlink_to(data.draw(st.sampled_from(["/dev/null", "/dev/zero"]), label="device"))
    elif how in ("directory", "directory-holding"):
        blob = path.read_bytes() if exists else b""
        path.unlink(missing_ok=True)
        path.mkdir()
        if how == "directory-holding":
            (path / target).write_bytes(blob)
    elif how == "fifo":
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "unreadable" and exists:
        path.chmod(0)
    elif how == "rename" and exists:  # a name with spaces, non-ASCII or a newline; the index follows where there is one
        new = data.draw(st.sampled_from(["model 1.safetensors", "mod\u00e8le.safetensors", "a\nb.safetensors",
                                         "\U0001f999.safetensors", "model-00001-of-00001.safetensors"]), label="name")
        if not (root / new).exists():
            path.rename(root / new)
            index = root / INDEX
            if index.is_file() and not index.is_symlink() and data.draw(st.booleans(), label="index follows"):
                text = index.read_text()
                index.write_text(text.replace(json.dumps(target), json.dumps(new)))
    elif how == "src-symlink" and not (root.parent / "link").exists():
        link = root.parent / "link"
        link.symlink_to(root.name)
        return link
    elif how == "src-loop" and not os.path.lexists(root.parent / "loop"):
        link = root.parent / "loop"
        link.symlink_to("loop")
        return link
    return root


# ------------------------------------------------------------------------------------ running


def run_names(kind: str, data: st.DataObject) -> str:
    """One case of a kind of this module (:data:`~tests.helpers.fuzzing.NAME_KINDS`), in a fresh temporary
    directory."""
    assert kind in NAME_KINDS, kind
    with tempfile.TemporaryDirectory(prefix="convert-bnb-nfuzz-") as d:
        work = Path(d)
        if kind == "struct-pickle-strings":
            src, oracle = mut_pickle_strings(data, work)
            if src.is_dir() and data.draw(st.integers(0, 3), label="to gguf") == 0:  # tensor names as GGUF names
                from tests.helpers.fuzzing_struct import _judge_any

                return _judge_any(kind, src, work, "gguf:q8_0", one_problem=False)  # (a name breaks 5 parts)
            return judge(kind, src, work, oracle=oracle)
        src = work / "in" / "model"
        if kind == "struct-index-names":
            shutil.copytree(SHARDED, src)
            mut_index_names(data, work, src)
            return judge(kind, src, work)
        seed = data.draw(st.sampled_from([SHARDED, SHARDED, MODEL, BIN_DIR]), label="seed")
        shutil.copytree(seed, src, ignore=shutil.ignore_patterns("reference"))
        return judge(kind, mut_shard_paths(data, work, src), work)

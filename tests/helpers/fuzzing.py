"""Property-based fuzzing of real fixture files: mutate, convert, and judge the outcome.

Each *kind* of mutation takes a real file written by bitsandbytes (tests/fixtures) and damages it
the way files get damaged in the wild: flipped bytes in the header or the data, truncation,
changed fields of the header JSON or of the QuantState JSON, renamed/dropped/duplicated tensors,
and for a sharded model directory, a changed index, config or shard; and (kind ``gguf-config``) the
config.json, RoPE and tokenizer values ``--to gguf`` reads, set to edge or hostile values (judged by
:func:`judge_gguf`: a GGUF that re-opens, or one of our errors with nothing left behind). Every
other outcome must be either

- a correct conversion: the output equals an independent NumPy reference computed here from the
  mutated input (bnb-format.md section 2, not our kernels) bit for bit, or
- one of our errors (:class:`~formats.errors.ConvertBnbError`) with a rule id and a one-line message,
  and then no output and no temporary exist;

never another exception and never a hang (a per-case alarm turns a hang into a failure); the
input is never modified (hashed before and after); and ``convert-bnb check`` agrees with the
conversion: clean exactly when it succeeds, and naming the rule it failed on. A finished output must
also load with the reference readers (:func:`assert_loadable`: the safetensors library, gguf-py), and
``inspect`` and ``--dry-run`` on the same input (:func:`probe_commands`) must end in a report or one of
our errors, succeeding whenever the conversion does.

Used by tests/test_fuzz.py (a fixed number of cases per kind in CI) and scripts/fuzz.py (as many
as asked). Outcomes are tallied in :data:`OUTCOMES` (kind -> Counter of "ok" / rule id).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import signal
import stat
import struct
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from convert.check import check_source
from convert.output import TMP_MARK
from formats.errors import ConvertBnbError
from tests.helpers.fixtures import FIXTURES
from tests.helpers.malformed import convert

#: Seed files: every single-layer fixture (nf4/fp4, nested or not, every dtype and blocksize) and
#: the real Hub slices (4-bit and LLM.int8).
SEED_FILES: list[Path] = sorted((FIXTURES / "single").glob("*.q.safetensors")) + sorted(
    (FIXTURES / "peer").glob("*.q.safetensors"))
SEED_4BIT = [p for p in SEED_FILES if "int8" not in p.name]
SEED_DIR = FIXTURES / "models" / "llama_nf4_dq_sharded"
#: A torch.save zip written by torch itself (the same layer as its .q.safetensors).
SEED_PT = FIXTURES / "single" / "nf4_bs32_dq_bfloat16_37x51_normal.q.pt"
#: kind -> Counter of outcomes ("ok" or the rule id of the error).
OUTCOMES: dict[str, Counter[str]] = defaultdict(Counter)
#: Seconds after which one case counts as a hang (a guard, not a speed test: cases take milliseconds).
HANG_SECONDS = 60

_SEED_BYTES: dict[Path, bytes] = {}


def seed_bytes(path: Path) -> bytes:
    if path not in _SEED_BYTES:
        _SEED_BYTES[path] = path.read_bytes()
    return _SEED_BYTES[path]


# ------------------------------------------------------------------------------ safetensors bytes


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header dict, data area) of a valid file."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict[str, Any], data: bytes, raw: str | None = None) -> bytes:
    text = with_raw(json.dumps(header), raw).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def tensors_of(raw: bytes) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], bytes]]]:
    header, data = split(raw)
    meta = header.pop("__metadata__", None)
    out = {}
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e2 = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[b:e2])
    return ({"__metadata__": meta} if meta is not None else {}), out


def rebuild(meta: dict[str, Any], tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    header = dict(meta)
    data = b""
    for name, (code, shape, raw) in tensors.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return join(header, data)


# ------------------------------------------------------------------------------------ strategies

#: JSON values a damaged or hostile file might hold where a field is expected.
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 3, 16, 31, 32, 33, 48, 63, 64, 256, 4096, 8192, 2**31, 2**32, 2**63, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 1e-45, 0.5, 64.0]),
    st.text(max_size=12),
    st.sampled_from(["nf4", "fp4", "int4", "", "NF4", "float16", "bfloat16", "float32", "torch.bfloat16",
                     "float64", "F32", "U8", "BF16", "I64", "F8_E4M3", "BOOL"]),
    st.lists(st.integers(min_value=-3, max_value=5000), max_size=4),
    st.lists(st.one_of(st.integers(-(2**65), 2**65), st.floats(allow_nan=False), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


#: JSON texts ``json.dumps`` cannot write, put in place of a value (issue 12): integers Python refuses to
#: convert or that are too long to be real, deep nesting, NaN and Infinity. :data:`RAW` marks the place.
HOSTILE_RAW = ["1" * 5000, "-" + "9" * 101, "[" * 20_000 + "]" * 20_000, '{"a": ' * 3000 + "1" + "}" * 3000,
               "NaN", "-Infinity"]
RAW = "\x00raw\x00"


def with_raw(text: str, raw: str | None) -> str:
    """``text`` (JSON) with the :data:`RAW` string value replaced by the raw JSON ``raw``."""
    return text if raw is None else text.replace(json.dumps(RAW), raw, 1)


def _pick_seed(data: st.DataObject, seeds: list[Path] | None = None) -> bytes:
    return seed_bytes(data.draw(st.sampled_from(seeds or SEED_FILES), label="seed"))


def _header_len(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0]


def mut_header_flip(data: st.DataObject) -> bytes:
    raw = bytearray(_pick_seed(data))
    end = _header_len(raw)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, end - 1), label="pos")
        raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    return bytes(raw)


_SPECIAL_F32 = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.4e38, 1e-45, 65504.0, 1e30]


def mut_data_flip(data: st.DataObject) -> bytes:
    raw = bytearray(_pick_seed(data))
    start = _header_len(raw)
    if start >= len(raw):
        return bytes(raw)
    if data.draw(st.integers(0, 3), label="special") == 0:  # a special value in a float32 tensor (absmax, maps)
        header, _ = split(bytes(raw))
        floats = sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"
                        and v["data_offsets"][1] > v["data_offsets"][0])
        if floats:
            b, e = header[data.draw(st.sampled_from(floats), label="tensor")]["data_offsets"]
            i = start + b + 4 * data.draw(st.integers(0, (e - b) // 4 - 1), label="index")
            raw[i : i + 4] = struct.pack("<f", data.draw(st.sampled_from(_SPECIAL_F32), label="value"))
            return bytes(raw)
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        i = data.draw(st.integers(start, len(raw) - 1), label="pos")
        raw[i] = data.draw(st.integers(0, 255), label="byte")
    return bytes(raw)


def mut_truncate(data: st.DataObject) -> bytes:
    raw = _pick_seed(data)
    cut = data.draw(st.one_of(st.integers(0, len(raw) - 1), st.integers(max(0, len(raw) - 64), len(raw) - 1)),
                    label="length")
    extra = data.draw(st.sampled_from([b"", b"", b"\0" * 3, b"garbage!"]), label="append")
    return raw[:cut] + extra


def mut_header_json(data: st.DataObject) -> bytes:
    raw = _pick_seed(data)
    header, body = split(raw)
    names = [k for k in header if k != "__metadata__"]
    name = data.draw(st.sampled_from(names), label="tensor")
    op = data.draw(st.sampled_from(["set", "set", "set", "delete-field", "drop-entry", "metadata", "shape-same-size",
                                    "offsets-shift", "dtype-same-size", "raw"]), label="op")
    entry = header[name]
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="field")
    raw = None
    if op == "set":
        entry[field] = data.draw(HOSTILE, label="value")
    elif op == "raw":
        raw = data.draw(st.sampled_from(HOSTILE_RAW), label="raw")
        entry[field] = data.draw(st.sampled_from([RAW, [RAW], [1, RAW]]), label="where")
    elif op == "delete-field":
        entry.pop(field)
    elif op == "drop-entry":
        del header[name]
    elif op == "metadata":
        header["__metadata__"] = data.draw(st.one_of(HOSTILE, st.dictionaries(st.text(max_size=3), HOSTILE,
                                                                              max_size=2)), label="metadata")
    elif op == "shape-same-size":
        n = math.prod(entry["shape"])
        entry["shape"] = data.draw(st.sampled_from([[n], [n, 1], [1, n], [1, 1, n], [n, 0] if n == 0 else [n]]),
                                   label="shape")
    elif op == "offsets-shift":
        d = data.draw(st.integers(-8, 8), label="delta")
        b, e = entry["data_offsets"]
        entry["data_offsets"] = data.draw(st.sampled_from([[b + d, e + d], [b, e + d], [b + d, e]]), label="offs")
    else:
        codes = {1: ["U8", "I8", "BOOL", "F8_E4M3", "F8_E5M2"], 2: ["F16", "BF16", "I16", "U16"],
                 4: ["F32", "I32", "U32"], 8: ["F64", "I64", "U64"]}
        size = {c: k for k, v in codes.items() for c in v}.get(entry["dtype"], 1)
        entry["dtype"] = data.draw(st.sampled_from(codes[size]), label="dtype")
    return join(header, body, raw)


def mut_quant_state(data: st.DataObject) -> bytes:
    raw = _pick_seed(data, SEED_4BIT)
    meta, tensors = tensors_of(raw)
    key = next(k for k in tensors if ".quant_state." in k)
    code, shape, blob = tensors[key]
    state = json.loads(blob)
    op = data.draw(st.sampled_from(["set", "set", "set", "delete", "add", "valid", "garbage", "key", "raw"]),
                   label="op")
    fields = ["quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"]
    field = data.draw(st.sampled_from(fields), label="field")
    raw = None
    if op == "set":
        state[field] = data.draw(HOSTILE, label="value")
    elif op == "raw":
        raw = data.draw(st.sampled_from(HOSTILE_RAW), label="raw")
        state[field] = data.draw(st.sampled_from([RAW, [RAW, 32]]), label="where")
    elif op == "delete":
        state.pop(field, None)
    elif op == "add":
        state[data.draw(st.text(max_size=8), label="new")] = data.draw(HOSTILE, label="value")
    elif op == "valid":  # values bnb could have written: conversions that must still be right
        choice = data.draw(st.sampled_from(["dtype", "shape", "offset", "qt", "nested_dtype"]), label="what")
        if choice == "dtype":
            state["dtype"] = data.draw(st.sampled_from(["float16", "bfloat16", "float32", "torch.float16"]))
        elif choice == "shape":
            n = math.prod(state["shape"])
            state["shape"] = data.draw(st.sampled_from([[n], [1, n], [n, 1], list(reversed(state["shape"]))]))
        elif choice == "offset" and "nested_offset" in state:
            state["nested_offset"] = data.draw(st.floats(-1, 1, width=32))
        elif choice == "nested_dtype" and "nested_dtype" in state:
            state["nested_dtype"] = data.draw(st.sampled_from(["float16", "bfloat16", "float32"]))
        else:
            state["quant_type"] = {"nf4": "fp4", "fp4": "nf4"}[state["quant_type"]]
    if op == "garbage":
        new_blob = data.draw(st.binary(max_size=40), label="blob")
    else:
        new_blob = with_raw(json.dumps(state), raw).encode()
    if op == "key":
        tensors = {(k.replace("bitsandbytes__nf4", "bitsandbytes__fp4") if "bitsandbytes__nf4" in k else
                    k.replace("bitsandbytes__fp4", "bitsandbytes__nf4")): v for k, v in tensors.items()}
        key = next(k for k in tensors if ".quant_state." in k)
    tensors[key] = (code, [len(new_blob)], new_blob)
    return rebuild(meta, tensors)


def mut_tensors(data: st.DataObject) -> bytes:
    raw = _pick_seed(data)
    meta, tensors = tensors_of(raw)
    names = list(tensors)
    name = data.draw(st.sampled_from(names), label="tensor")
    op = data.draw(st.sampled_from(["drop", "rename", "prefix", "duplicate", "swap", "resize"]), label="op")
    if op == "drop":
        del tensors[name]
    elif op in ("rename", "prefix"):
        new = (data.draw(st.text(min_size=1, max_size=10), label="name") if op == "rename"
               else name.replace("layer", data.draw(st.sampled_from(["layers", "model.layer", "lay", "x"]))))
        if new != "__metadata__":
            tensors = {(new if k == name else k): v for k, v in tensors.items()}
    elif op == "duplicate":
        tensors[name + data.draw(st.sampled_from([".absmax", ".quant_map", ".weight", ".SCB", "_copy"]))] = \
            tensors[name]
    elif op == "swap":
        other = data.draw(st.sampled_from(names), label="other")
        tensors[name], tensors[other] = tensors[other], tensors[name]
    else:
        code, shape, blob = tensors[name]
        k = data.draw(st.integers(-3, 3), label="delta")
        item = {"F32": 4, "F16": 2, "BF16": 2}.get(code, 1)
        n = max(0, len(blob) // item + k)
        blob = (blob + b"\0" * (4 * item))[: n * item]
        tensors[name] = (code, [n], blob)
    return rebuild(meta, tensors)


def mut_directory(data: st.DataObject, root: Path) -> None:
    """Damage a copy of the sharded model in place."""
    op = data.draw(st.sampled_from(["index", "index", "drop-shard", "config", "shard-bytes", "rename-shard",
                                    "stray"]), label="op")
    index_path = root / "model.safetensors.index.json"
    shards = sorted(root.glob("*.safetensors"))
    if op == "index":
        index = json.loads(index_path.read_text())
        wmap = index["weight_map"]
        name = data.draw(st.sampled_from(sorted(wmap)), label="tensor")
        sub = data.draw(st.sampled_from(["drop", "move", "add", "value", "garbage", "weight_map", "raw"]), label="sub")
        if sub == "drop":
            del wmap[name]
        elif sub == "move":
            wmap[name] = data.draw(st.sampled_from([s.name for s in shards] + ["../x.safetensors", ""]))
        elif sub == "add":
            wmap[name + ".extra"] = data.draw(st.sampled_from([s.name for s in shards]))
        elif sub == "value":
            wmap[name] = data.draw(HOSTILE, label="value")
        elif sub == "weight_map":
            index["weight_map"] = data.draw(HOSTILE, label="value")
        raw = None
        if sub == "raw":
            index["metadata"]["total_size"] = RAW
            raw = data.draw(st.sampled_from(HOSTILE_RAW), label="raw")
        text = with_raw(json.dumps(index), raw)
        if sub == "garbage":
            text = text[: data.draw(st.integers(0, len(text) - 1), label="cut")]
        index_path.write_text(text)
    elif op == "drop-shard":
        data.draw(st.sampled_from(shards), label="shard").unlink()
    elif op == "config":
        (root / "config.json").write_text(data.draw(st.sampled_from(
            ["", "[]", "{", '{"a": 1}', "null", *('{"vocab_size": ' + r + "}" for r in HOSTILE_RAW)])))
    elif op == "shard-bytes":
        shard = data.draw(st.sampled_from(shards), label="shard")
        raw = bytearray(shard.read_bytes())
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="pos")
            raw[i] ^= data.draw(st.integers(1, 255), label="xor")
        shard.write_bytes(bytes(raw))
    elif op == "rename-shard":
        shard = data.draw(st.sampled_from(shards), label="shard")
        shard.rename(root / data.draw(st.sampled_from(["model-00009-of-00009.safetensors", "other.safetensors"])))
    else:
        shutil.copy(shards[0], root / "model-00005-of-00005.safetensors")


def mut_torch_pickle(data: st.DataObject) -> bytes:
    """Damage a real torch.save zip: its pickle (re-zipped with a valid CRC, so the unpickler sees the
    damage), its byteorder/storage records, raw bytes anywhere, or truncate it; or put a hostile pickle
    in it (:func:`hostile_pickle`), or deflate its data.pkl."""
    import io
    import zipfile

    raw = seed_bytes(SEED_PT)
    op = data.draw(st.sampled_from(["pickle", "pickle", "pickle", "record", "anywhere", "truncate", "hostile",
                                    "deflate"]), label="op")
    if op == "hostile":
        return hostile_pickle(data, raw)
    if op == "deflate":  # the same file with data.pkl deflated: still read (within the limits)
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            members = [(i.filename, zf.read(i)) for i in zf.infolist()]
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as zf:
            for name, blob in members:
                zf.writestr(name, blob, compress_type=zipfile.ZIP_DEFLATED if name.endswith("/data.pkl")
                            else zipfile.ZIP_STORED)
        return out.getvalue()
    if op == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    if op == "anywhere":
        buf = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            buf[data.draw(st.integers(0, len(buf) - 1), label="pos")] ^= data.draw(st.integers(1, 255), label="xor")
        return bytes(buf)
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    names = [n for n, _ in members]
    target = (next(n for n in names if n.endswith("/data.pkl")) if op == "pickle"
              else data.draw(st.sampled_from(names), label="member"))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, blob in members:
            if name == target:
                buf = bytearray(blob)
                how = data.draw(st.sampled_from(["flip", "flip", "cut", "drop"]), label="how")
                if how == "drop":
                    continue
                if how == "cut" or not buf:
                    buf = buf[: data.draw(st.integers(0, max(0, len(buf) - 1)), label="length")]
                else:
                    for _ in range(data.draw(st.integers(1, 3), label="flips")):
                        i = data.draw(st.integers(0, len(buf) - 1), label="pos")
                        buf[i] = data.draw(st.integers(0, 255), label="byte")
                blob = bytes(buf)
            zf.writestr(name, blob)
    return out.getvalue()


def hostile_pickle(data: st.DataObject, raw: bytes) -> bytes:
    """One of the classes of hostile pickle of issue 12 (tests/helpers/torchsave.py), at a drawn size, as
    the seed's data.pkl (or a whole legacy file): each must end at PT-010 / PT-004 / PT-009, in a blink."""
    import io
    import pickle
    import zipfile

    from tests.helpers import torchsave as h

    how = data.draw(st.sampled_from(["long-int", "tuple-key", "tuple-set", "tuple-pid", "deep-lists", "deep-marks",
                                     "deep-mutation", "legacy-deep"]), label="hostile")
    if how == "long-int":
        blob = h.tensor_with_numel(h.huge_long4(10 ** data.draw(st.integers(39, 6000), label="digits")))
    elif how in ("tuple-key", "tuple-set", "tuple-pid"):
        build = {"tuple-key": h.shared_tuple_key, "tuple-set": h.shared_tuple_set, "tuple-pid": h.shared_tuple_pid}
        blob = build[how](data.draw(st.integers(9, 200), label="levels"))
    else:
        depth = data.draw(st.integers(101, 100_000), label="depth")
        if how == "legacy-deep":
            return h.LEGACY_HEADER + h.nested_lists(depth) + pickle.dumps([], protocol=2)
        blob = {"deep-lists": lambda: b"\x80\x02}" + h._u("x") + h.nested_lists(depth)[2:-1] + b"s.",
                "deep-marks": lambda: h.nested_marks(depth),
                "deep-mutation": lambda: h.deep_by_mutation(min(depth, 5000))}[how]()
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        members = [(i.filename, blob if i.filename.endswith("/data.pkl") else zf.read(i)) for i in zf.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, member in members:
            zf.writestr(name, member)
    return out.getvalue()


#: The GGUF seed: the tiny Llama directory (config.json, tokenizer.model, tokenizer.json, tokenizer_config.json).
SEED_GGUF = FIXTURES / "models" / "llama_nf4_dq"
#: config.json keys the GGUF writer reads, and RoPE keys per type.
GGUF_CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "num_hidden_layers", "max_position_embeddings", "vocab_size", "rms_norm_eps", "rope_theta",
                    "rope_parameters", "rope_scaling", "text_config", "bos_token_id", "eos_token_id", "pad_token_id",
                    "original_max_position_embeddings", "architectures", "is_causal"]
ROPE_KEYS = ["rope_type", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
             "beta_fast", "beta_slow", "attention_factor", "extrapolation_factor", "rope_theta"]
#: Values next to the GGUF rules' edges.
GGUF_EDGES = st.one_of(HOSTILE, st.sampled_from([2**32 - 1, 2**32, 10**12, 10**7, -256, 4.0, 1e39, 3.4e38, 0.0, "x",
                                                 "yarn", "llama3", "linear", "default", "longrope", [1, 2], {}]))


def _json_paths(doc: Any, prefix: tuple[Any, ...] = (), limit: int = 40) -> list[tuple[Any, ...]]:
    """Paths to values of a JSON document (the first ``limit`` entries of each object/array)."""
    out = [prefix]
    items = list(doc.items())[:limit] if isinstance(doc, dict) else list(enumerate(doc[:limit])) if isinstance(
        doc, list) else []
    for k, v in items:
        out += _json_paths(v, (*prefix, k), limit)
    return out


def mut_gguf_config(data: st.DataObject, root: Path) -> None:
    """Damage the values ``--to gguf`` reads: a config.json key (or RoPE key), or any value of the
    tokenizer JSON files, set to an edge or hostile value."""
    op = data.draw(st.sampled_from(["config", "config", "rope", "tokenizer_config.json", "tokenizer.json"]),
                   label="op")
    if op in ("config", "rope"):
        path = root / "config.json"
        cfg = json.loads(path.read_text())
        if op == "config":
            cfg[data.draw(st.sampled_from(GGUF_CONFIG_KEYS), label="key")] = data.draw(GGUF_EDGES, label="value")
        else:
            rope = {"rope_type": data.draw(st.sampled_from(["yarn", "llama3", "linear"]), label="type"),
                    "factor": 4.0, "original_max_position_embeddings": 64}
            rope[data.draw(st.sampled_from(ROPE_KEYS), label="key")] = data.draw(GGUF_EDGES, label="value")
            cfg["rope_parameters"] = rope
        path.write_text(json.dumps(cfg))
        return
    path = root / op
    doc = json.loads(path.read_text())
    where = data.draw(st.sampled_from(_json_paths(doc)), label="path")
    value = data.draw(GGUF_EDGES, label="value")
    if not where:
        doc = value
    else:
        target = doc
        for k in where[:-1]:
            target = target[k]
        target[where[-1]] = value
    path.write_text(json.dumps(doc))


def judge_gguf(src: Path, workdir: Path) -> str:
    """``--to gguf:q8_0`` of ``src``: a GGUF that re-opens (the job verifies it against its plan) or
    one of our errors with nothing left at the output; never another exception, never a hang."""
    import gguf

    out = workdir / "outdir" / "m.gguf"
    before = tree_hash(src)
    inspected, planned = probe_commands(src, out, "gguf:q8_0") if probing("gguf-config") else ("ok", "ok")
    try:
        with hang_guard():
            convert(src, out, to="gguf:q8_0")
    except ConvertBnbError as exc:
        outcome = clean_error(exc, out)
    else:
        assert len(gguf.GGUFReader(out).tensors) > 0
        assert_loadable(out)
        assert (inspected, planned) == ("ok", "ok"), f"converted, but inspect: {inspected}, --dry-run: {planned}"
        outcome = "ok"
    assert tree_hash(src) == before, "the input was modified"
    OUTCOMES["gguf-config"][outcome] += 1
    return outcome


FILE_KINDS: dict[str, Callable[[st.DataObject], bytes]] = {
    "header-bytes": mut_header_flip,
    "data-bytes": mut_data_flip,
    "truncate": mut_truncate,
    "header-json": mut_header_json,
    "quant-state-json": mut_quant_state,
    "tensors": mut_tensors,
    "torch-pickle": mut_torch_pickle,
}
#: The structure-aware kinds of tests/helpers/fuzzing_struct.py (fields of parsed JSON and companion tensors).
#: Those of tests/helpers/fuzzing_names.py (pickle strings, index names, the files of a model directory).
NAME_KINDS = ["struct-pickle-strings", "struct-index-names", "struct-shard-paths"]
STRUCT_KINDS = ["struct-quant-state", "struct-companions", "struct-gguf-config", "struct-adapter", *NAME_KINDS]
KINDS = [*FILE_KINDS, "directory", "gguf-config", *STRUCT_KINDS]
#: Cases per kind in CI (tests/test_fuzz.py): 2,160 byte-level and field-level, 2,350 structure-aware.
CI_CASES = {"header-bytes": 360, "data-bytes": 360, "truncate": 260, "header-json": 360,
            "quant-state-json": 360, "tensors": 160, "torch-pickle": 200, "directory": 60, "gguf-config": 40,
            "struct-quant-state": 700, "struct-companions": 500, "struct-gguf-config": 500, "struct-adapter": 300,
            "struct-pickle-strings": 150, "struct-index-names": 100, "struct-shard-paths": 100}


# ------------------------------------------------------------------------------------ the oracle


def tree_hash(root: Path) -> dict[str, str]:
    """What ``root`` holds, to compare before and after a case: a regular file's sha256, a symlink's
    target (never followed), the kind of anything else (a FIFO is never opened, so never waited on)."""

    def entry(p: Path) -> str:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return "symlink -> " + os.readlink(p)
        if stat.S_ISREG(st.st_mode):
            try:
                return hashlib.sha256(p.read_bytes()).hexdigest()
            except PermissionError:  # chmod 000 (not as root): its mode and size stand for it
                return f"unreadable {st.st_mode:o} {st.st_size}"
        return f"{stat.S_IFMT(st.st_mode):o} {stat.S_IMODE(st.st_mode):o}"

    if not os.path.lexists(root):
        return {}
    out = {str(root): entry(root)}
    if stat.S_ISDIR(os.lstat(root).st_mode):
        for d, dirs, files in os.walk(root, followlinks=False):
            for name in sorted(dirs + files):
                out[os.path.join(d, name)] = entry(Path(d) / name)
    return out


def clean_error(exc: ConvertBnbError, out: Path) -> str:
    """Assert ``exc`` is a clean failure (its rule in a one-line message, nothing at ``out`` or beside
    it) and return its rule."""
    message = str(exc)
    assert exc.rule and exc.rule in message and "\n" not in message, message
    assert not out.exists(), f"output left behind after {exc.rule}"
    leftovers = list(out.parent.iterdir()) if out.parent.exists() else []
    assert leftovers == [], f"temporaries left behind after {exc.rule}: {leftovers}"
    return exc.rule


class Hang(Exception):
    """A case ran longer than :data:`HANG_SECONDS`."""


@contextlib.contextmanager
def hang_guard(seconds: int = HANG_SECONDS) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"a case ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_ROUND = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
_OUT_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
Raw = tuple[str, list[int], bytes]


def read_raw(path: Path) -> dict[str, Raw]:
    """name -> (dtype code, shape, bytes): a minimal reader of our own, separate from formats/."""
    header, data = split(path.read_bytes())
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items()}


def _floats(t: Raw) -> np.ndarray:
    return np.frombuffer(t[2], dtype=_FLOATS[t[0]]).astype(np.float32)


def reference_4bit(inp: dict[str, Raw], name: str, state: dict[str, Any]) -> Raw:
    """bnb-format.md section 2, written again from the spec, independent of convert.dequant.kernels."""
    dtype = state["dtype"].removeprefix("torch.")
    n = math.prod(state["shape"])
    bs = state["blocksize"]
    packed = np.frombuffer(inp[name][2], dtype=np.uint8)
    codes = np.empty(2 * packed.size, dtype=np.uint8)
    codes[0::2] = packed >> 4
    codes[1::2] = packed & 0x0F
    codes = codes[:n]
    table = _floats(inp[f"{name}.quant_map"])
    with np.errstate(all="ignore"):
        if "nested_blocksize" in state:
            nd = _ROUND[state["nested_dtype"].removeprefix("torch.")]
            u8 = np.frombuffer(inp[f"{name}.absmax"][2], dtype=np.uint8)
            q = _floats(inp[f"{name}.nested_quant_map"])[u8]
            scale = _floats(inp[f"{name}.nested_absmax"])
            j = np.arange(q.size) // state["nested_blocksize"]
            step = (q * scale[j]).astype(nd).astype(np.float32)
            absmax = (step + np.float32(state["nested_offset"])).astype(nd).astype(np.float32)
        else:
            absmax = _floats(inp[f"{name}.absmax"])
        y = (table[codes] * absmax[np.arange(n) // bs]).astype(_ROUND[dtype])
    return (_OUT_CODE[dtype], list(state["shape"]), y.tobytes())


def reference_int8(inp: dict[str, Raw], name: str, out_code: str) -> Raw:
    """bnb-format.md section 4: ``dtype(fp32(fp32(int8 * SCB[row]) * fp32(1/127)))``."""
    code, shape, raw = inp[name]
    w = np.frombuffer(raw, dtype=np.int8).reshape(shape).astype(np.float32)
    scb = _floats(inp[name[: -len(".weight")] + ".SCB"])
    with np.errstate(all="ignore"):
        y = ((w * scb[:, None]).astype(np.float32) * np.float32(7.874015718698502e-3)).astype(np.float32)
        out_name = {v: k for k, v in _OUT_CODE.items()}[out_code]
        y = y.astype(_ROUND[out_name])  # (to float16: overflow to inf is the IEEE result, as the converter's)
    return (out_code, list(shape), y.tobytes())


def input_files(src: Path) -> list[Path]:
    """The weight files of ``src`` as transformers finds them, independently of formats/: the file itself,
    or a directory's index's shards (in index order, each once), or its single weight file."""
    if src.is_file():
        return [src]
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (src / index).is_file():
            return [src / s for s in dict.fromkeys(json.loads((src / index).read_text())["weight_map"].values())]
        if (src / single).is_file():
            return [src / single]
    return []


def read_input(src: Path) -> dict[str, Raw]:
    """The input's tensors: safetensors through :func:`read_raw`; a torch pickle through our reader
    (the container is not under test there, only that every outcome is clean)."""
    inp: dict[str, Raw] = {}
    for f in input_files(src):
        if f.suffix in (".pt", ".bin"):
            from formats.torch_pickle import TorchPickleReader

            r = TorchPickleReader(f)
            try:
                inp.update({n: (i.dtype.code, list(i.shape), bytes(r.raw(n))) for n, i in r.tensors.items()})
            finally:
                r.close()
        else:
            inp.update(read_raw(f))
    return inp


def check_output(src: Path, out: Path) -> None:
    """A successful conversion must equal the reference computed from the (mutated) input."""
    inp = read_input(src)
    got: dict[str, Raw] = {}
    for f in ([out] if out.is_file() else sorted(out.glob("*.safetensors"))):
        got.update(read_raw(f))
    states = {}
    for k, v in inp.items():
        if ".quant_state.bitsandbytes__" in k:
            states[k.split(".quant_state.")[0]] = json.loads(v[2])
    companions = {f"{w}.{c}" for w in states for c in ("absmax", "quant_map", "nested_absmax", "nested_quant_map")}
    companions |= {k for k in inp if ".quant_state." in k}
    int8 = {k[: -len(".SCB")] + ".weight" for k in inp if k.endswith(".SCB")}
    companions |= {w[: -len(".weight")] + ".SCB" for w in int8} | {w + "_format" for w in int8}
    assert set(got) == set(inp) - companions, (sorted(got), sorted(inp))
    for name, t in got.items():
        if name in states:
            want = reference_4bit(inp, name, states[name])
        elif name in int8:
            want = reference_int8(inp, name, t[0])
        else:
            want = inp[name]
        assert t[0] == want[0] and list(t[1]) == list(want[1]), (name, t[:2], want[:2])
        if name in states and states[name].get("nested_dtype", "float32").removeprefix("torch.") != "float32":
            continue  # a nested_dtype other than float32 has no bnb-written fixture to pin its roundings
        assert t[2] == want[2], f"{name}: output differs from the reference"


def assert_loadable(out: Path) -> None:
    """A finished output loads with the reference readers, not only with ours: every safetensors file
    with the safetensors library (``safe_open`` for names, dtypes and shapes, every tensor read: through
    NumPy where it has the dtype, else as bytes from the Rust ``deserialize``), every GGUF with gguf-py's
    ``GGUFReader`` (every tensor's data read)."""
    files = [out] if out.is_file() else sorted(p for p in out.iterdir() if p.suffix in (".safetensors", ".gguf"))
    assert files, f"no weight file in {out}"
    for f in files:
        if f.suffix == ".gguf":
            import gguf

            reader = gguf.GGUFReader(f)
            for t in reader.tensors:
                assert np.ascontiguousarray(t.data).nbytes == t.n_bytes, (f.name, t.name)
            continue
        import safetensors

        raw = {name: spec for name, spec in safetensors.deserialize(f.read_bytes())}
        with safetensors.safe_open(f, framework="numpy") as g:
            assert sorted(g.keys()) == sorted(raw), f.name
            for name in g.keys():
                code, shape = g.get_slice(name).get_dtype(), g.get_slice(name).get_shape()
                if code in _NUMPY_CODES:
                    assert g.get_tensor(name).shape == tuple(shape), (f.name, name)
                assert len(raw[name]["data"]) == math.prod(shape) * _ITEMSIZE[code], (f.name, name, code, shape)


#: safetensors dtype codes the library's NumPy framework reads (bf16 and float8 it cannot: read as bytes).
_NUMPY_CODES = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


#: In CI, :func:`probe_commands` runs on one case in this many of these kinds (each probe costs about a
#: conversion's planning, which doubles these kinds' cases); on every case of the others and in scripts/fuzz.py.
CI_PROBE_EVERY = {"struct-quant-state": 4, "struct-companions": 4, "struct-gguf-config": 4, "struct-adapter": 2}
_probe_every: dict[str, int] = {}


def probing(kind: str) -> bool:
    """Whether this case of ``kind`` runs :func:`probe_commands` (see :data:`CI_PROBE_EVERY`)."""
    return sum(OUTCOMES[kind].values()) % _probe_every.get(kind, 1) == 0


def probe_commands(src: Path, out: Path, to: str = "auto", extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """``convert-bnb inspect SRC`` and ``convert-bnb SRC --to TO -o OUT --dry-run`` through the command
    line with ``--debug`` (so that any exception propagates), printing to a strict UTF-8 stream as a
    terminal would: each must end in its report or one of our errors, write nothing and never hang.

    Returns:
        each command's outcome, ``"ok"`` or the rule id of its error.
    """
    from convert.cli import main

    outcomes = []
    for argv in (["inspect", str(src), "--debug"],
                 [str(src), "--to", to, "-o", str(out), "--dry-run", "--debug", *extra]):
        stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
        try:
            with hang_guard(), contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                code = main(argv)
                stream.flush()
        except ConvertBnbError as exc:
            message = str(exc)
            assert exc.rule and exc.rule in message and "\n" not in message, message
            outcomes.append(exc.rule)
        else:
            assert code == 0, (argv[0], code)
            outcomes.append("ok")
        assert not os.path.lexists(out), f"{argv[0]} wrote {out}"
    return outcomes[0], outcomes[1]


def judge(kind: str, src: Path, workdir: Path, *, oracle: bool = True) -> str:
    """Convert ``src`` and check the outcome; returns "ok" or the rule id (tallied in OUTCOMES).

    ``inspect`` and ``--dry-run`` (:func:`probe_commands`) must end in a report or one of our errors, and
    succeed whenever the conversion does; a finished output must load with the reference libraries
    (:func:`assert_loadable`) and (``oracle``) equal the independent reference."""
    out = workdir / "outdir" / ("out" if src.is_dir() else "out.safetensors")
    before = tree_hash(src)
    inspected, planned = probe_commands(src, out) if probing(kind) else ("ok", "ok")
    try:
        with hang_guard():
            convert(src, out)
    except ConvertBnbError as exc:
        outcome = clean_error(exc, out)
    else:
        assert out.exists()
        assert not [p for p in out.parent.iterdir() if TMP_MARK in p.name]
        assert_loadable(out)
        if oracle:
            check_output(src, out)
        outcome = "ok"
        assert (inspected, planned) == ("ok", "ok"), f"converted, but inspect: {inspected}, --dry-run: {planned}"
    # `convert-bnb check` agrees: clean exactly when the conversion succeeds, and it names the same rule
    with hang_guard():
        report = check_source(src)
    found = [p.rule for p in report.problems]
    assert report.ok == (outcome == "ok"), (outcome, found)
    assert outcome == "ok" or outcome in found, (outcome, found)
    assert tree_hash(src) == before, "the input was modified"
    OUTCOMES[kind][outcome] += 1
    return outcome


def run_one(kind: str, data: st.DataObject) -> str:
    if kind in NAME_KINDS:
        from tests.helpers.fuzzing_names import run_names

        return run_names(kind, data)
    if kind in STRUCT_KINDS:
        from tests.helpers.fuzzing_struct import run_struct

        return run_struct(kind, data)
    with tempfile.TemporaryDirectory(prefix="convert-bnb-fuzz-") as d:
        work = Path(d)
        if kind == "gguf-config":
            src = work / "in" / "model"
            shutil.copytree(SEED_GGUF, src, ignore=shutil.ignore_patterns("reference"))
            mut_gguf_config(data, src)
            return judge_gguf(src, work)
        if kind == "directory":
            src = work / "in" / "model"
            shutil.copytree(SEED_DIR, src)
            mut_directory(data, src)
        else:
            src = work / "in" / ("model.pt" if kind == "torch-pickle" else "model.safetensors")
            src.parent.mkdir()
            src.write_bytes(FILE_KINDS[kind](data))
        return judge(kind, src, work)


def property_test(kind: str, cases: int, *, derandomize: bool, seed: int | None = None,
                  shrink: bool = True, probe_every: int = 1) -> Callable[[], None]:
    """A hypothesis test running ``cases`` mutations of one kind (``shrink=False``: report the first
    failing case as found, without minimising it; for slow cases; ``probe_every``: :func:`probe_commands`
    on one case in this many)."""
    _probe_every[kind] = probe_every
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]

    @settings(max_examples=cases, deadline=None, derandomize=derandomize, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck), phases=phases)
    @given(st.data())
    def test(data: st.DataObject) -> None:
        run_one(kind, data)

    if seed is not None:
        from hypothesis import seed as hseed

        test = hseed(seed)(test)
    return test

"""Structure-aware fuzzing: mutate the *fields* of the JSON and the companion tensors a real model
directory holds, not its bytes.

Where :mod:`tests.helpers.fuzzing` flips bytes, these kinds change one field of a parsed structure to an
extreme value or a wrong type, then write the structure back as a well-formed file:

- ``struct-quant-state``: a field of one layer's QuantState JSON, the safetensors header, ``config.json``
  or the shard index of a real model directory (huge integers of thousands of digits, 100k-deep
  nesting, NaN tokens, negative and 2**64 sizes, wrong types);
- ``struct-companions``: a layer's QuantState companions swapped with another layer's, or an absmax
  stored in another dtype (reinterpreted, resized or converted);
- ``struct-gguf-config``: ``config.json`` / ``tokenizer.json`` / ``tokenizer_config.json`` fields a GGUF
  conversion reads (hidden sizes, heads, rope scaling, vocab, added tokens);
- ``struct-adapter``: ``adapter_config.json`` fields (rank, alpha, patterns including catastrophic
  regular expressions) and non-finite or reshaped adapter tensors, merged with ``--merge-lora``.

The judge is :func:`tests.helpers.fuzzing.judge` for the first two kinds (a correct conversion, bit-exact with
the independent reference, or one of our errors with nothing left behind, and ``check`` agreeing);
GGUF and adapter cases have no value oracle, so there the outcome must be a finished output or one of
our errors with nothing left behind and the input unchanged; for GGUF, ``check --to gguf:q8_0`` must
agree (clean exactly when the conversion succeeds, else the same rule). ``check`` does not read
adapters. Every case runs under the hang guard; scripts/fuzz.py also caps the address space.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from convert.check import check_source
from convert.output import TMP_MARK
from formats.errors import ConvertBnbError
from tests.helpers.fixtures import FIXTURES
from tests.helpers.fuzzing import (
    HOSTILE,
    OUTCOMES,
    assert_loadable,
    clean_error,
    hang_guard,
    judge,
    probe_commands,
    probing,
    tree_hash,
)

MODEL = FIXTURES / "models" / "llama_nf4_dq"
SHARDED = FIXTURES / "models" / "llama_nf4_dq_sharded"
ADAPTER = FIXTURES / "lora" / "adapter"

#: Placeholders replaced in the JSON text after json.dumps: what json.dumps cannot write or would
#: refuse (integers past Python's 4,300-digit limit, nesting past its recursion limit, NaN tokens).
_RAW = {
    "@@BIG@@": "9" * 5000,
    "@@NEGBIG@@": "-" + "9" * 5000,
    "@@DEEP@@": "[" * 100_000 + "]" * 100_000,
    "@@DEEPOBJ@@": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "@@NAN@@": "NaN",
    "@@INF@@": "Infinity",
    "@@EXP@@": "1e999999",
}
#: Extreme values for any field, on top of :data:`tests.helpers.fuzzing.HOSTILE`.
EXTREME = st.one_of(HOSTILE, st.sampled_from(sorted(_RAW)),
                    st.sampled_from([-256, -1, 0, 2**31 - 1, 2**32, 2**53 + 1, 10**12, 10**19, 0.0, -0.0, 1e-300,
                                     4.0, 3.5, True, False, None, "", "x", [], {}, [[[]]], {"": {}}]))


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` with the :data:`_RAW` placeholders put in as raw text."""
    text = json.dumps(obj)
    for k, v in _RAW.items():
        text = text.replace(json.dumps(k), v)
    return text


def _set_path(data: st.DataObject, obj: Any, label: str) -> Any:
    """``obj`` with one value somewhere inside it (a key of a dict, an item of a list, recursively)
    replaced by an extreme value, or a key added or removed."""
    if isinstance(obj, dict) and obj:
        key = data.draw(st.sampled_from(sorted(obj, key=str)), label=f"{label} key")
        op = data.draw(st.sampled_from(["set", "set", "deeper", "delete", "add"]), label=f"{label} op")
        if op == "delete":
            del obj[key]
        elif op == "add":
            obj[data.draw(st.sampled_from(["x", "vocab_size", "rope_scaling", "r", "type"]))] = data.draw(EXTREME)
        elif op == "deeper" and isinstance(obj[key], (dict, list)) and obj[key]:
            obj[key] = _set_path(data, obj[key], label)
        else:
            obj[key] = data.draw(EXTREME, label=f"{label} value")
        return obj
    if isinstance(obj, list) and obj:
        i = data.draw(st.integers(0, len(obj) - 1), label=f"{label} index")
        obj[i] = _set_path(data, obj[i], label) if data.draw(st.booleans()) else data.draw(EXTREME)
        return obj
    return data.draw(EXTREME, label=f"{label} value")


# ------------------------------------------------------------------------------------ safetensors helpers

def _read_st(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_st(path: Path, header_text: str, data: bytes) -> None:
    raw = header_text.encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _tensors(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], bytes]]]:
    header, data = _read_st(path)
    meta = header.pop("__metadata__", None)
    return meta, {k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]])
                  for k, v in header.items()}


def _rebuild(path: Path, meta: Any, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header: dict[str, Any] = {} if meta is None else {"__metadata__": meta}
    data = b""
    for name, (code, shape, raw) in tensors.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    _write_st(path, json.dumps(header), data)


# ------------------------------------------------------------------------------------ mutations

def mut_quant_state_fields(data: st.DataObject, root: Path) -> None:
    """One field of a QuantState JSON, the safetensors header, config.json or the index."""
    targets = ["quant_state", "quant_state", "header", "config"]
    if (root / "model.safetensors.index.json").exists():
        targets.append("index")
    target = data.draw(st.sampled_from(targets), label="file")
    if target == "index":
        path = root / "model.safetensors.index.json"
        path.write_text(dumps(_set_path(data, json.loads(path.read_text()), "index")))
        return
    if target == "config":
        path = root / "config.json"
        path.write_text(dumps(_set_path(data, json.loads(path.read_text()), "config")))
        return
    shard = data.draw(st.sampled_from(sorted(root.glob("*.safetensors"))), label="shard")
    if target == "header":
        header, body = _read_st(shard)
        _write_st(shard, dumps(_set_path(data, header, "header")), body)
        return
    meta, tensors = _tensors(shard)
    keys = sorted(k for k in tensors if ".quant_state." in k)
    if not keys:
        return
    key = data.draw(st.sampled_from(keys), label="layer")
    code, _shape, blob = tensors[key]
    text = dumps(_set_path(data, json.loads(blob), "quant_state")).encode("utf-8")
    tensors[key] = (code, [len(text)], text)
    _rebuild(shard, meta, tensors)


_COMPONENTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def mut_companions(data: st.DataObject, root: Path) -> None:
    """Swap a layer's QuantState companions with another layer's, or store an absmax in another dtype."""
    shard = root / "model.safetensors"
    meta, tensors = _tensors(shard)
    weights = sorted(k[: -len(".absmax")] for k in tensors if k.endswith(".weight.absmax"))
    a, b = data.draw(st.sampled_from(weights), label="a"), data.draw(st.sampled_from(weights), label="b")
    op = data.draw(st.sampled_from(["swap", "swap-state", "absmax-dtype", "absmax-convert"]), label="op")
    if op == "swap":
        c = data.draw(st.sampled_from(_COMPONENTS), label="component")
        ka, kb = f"{a}.{c}", f"{b}.{c}"
        if ka in tensors and kb in tensors:
            tensors[ka], tensors[kb] = tensors[kb], tensors[ka]
    elif op == "swap-state":
        ka = next(k for k in tensors if k.startswith(a + ".quant_state."))
        kb = next(k for k in tensors if k.startswith(b + ".quant_state."))
        tensors[ka], tensors[kb] = tensors[kb], tensors[ka]
    else:
        code, shape, blob = tensors[f"{a}.absmax"]
        new = data.draw(st.sampled_from(["F32", "F16", "BF16", "U8", "I8", "I32", "F64"]), label="dtype")
        item = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "F64": 8}[new]
        if op == "absmax-dtype":  # the same bytes reinterpreted, the count following the bytes
            tensors[f"{a}.absmax"] = (new, [len(blob) // item], blob[: len(blob) // item * item])
        else:  # the same count, values converted from the stored ones (U8 codes become floats or ints)
            src = np.frombuffer(blob, dtype={"F32": "<f4", "U8": "u1"}.get(code, "u1")).astype(np.float64)
            npdt = {"F32": "<f4", "F16": "<f2", "BF16": "<f4", "U8": "u1", "I8": "i1", "I32": "<i4", "F64": "<f8"}[new]
            with np.errstate(all="ignore"):
                arr = src.astype(npdt)
            raw = arr.tobytes() if new != "BF16" else (arr.view("<u4") >> 16).astype("<u2").tobytes()
            tensors[f"{a}.absmax"] = (new, list(shape), raw)
    _rebuild(shard, meta, tensors)


def mut_gguf_config(data: st.DataObject, root: Path) -> None:
    """A field of config.json (often rope_scaling; or a plausible head count / size that need not fit the
    weights), tokenizer.json or tokenizer_config.json."""
    which = data.draw(st.sampled_from(["config", "config", "rope", "shape", "tokenizer", "tokenizer_config"]),
                      label="file")
    if which in ("config", "rope", "shape"):
        path = root / "config.json"
        cfg = json.loads(path.read_text())
        if which == "shape":  # a valid value the weights may not fit: GGUF-006 (llama.cpp's loader shapes)
            for key in data.draw(st.lists(st.sampled_from(["num_attention_heads", "num_key_value_heads", "head_dim",
                                                           "intermediate_size", "hidden_size"]),
                                          min_size=1, max_size=3, unique=True), label="keys"):
                cfg[key] = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 48, 64, 100, 128, 256, 704]), label=key)
        elif which == "rope":
            rope_type = data.draw(st.sampled_from(["linear", "yarn", "llama3", "dynamic", "longrope", "x"]))
            cfg["rope_scaling"] = {"rope_type": rope_type, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            cfg["rope_scaling"] = _set_path(data, cfg["rope_scaling"], "rope")
        else:
            key = data.draw(st.sampled_from(["hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "num_hidden_layers", "vocab_size",
                                             "max_position_embeddings", "rope_theta", "rms_norm_eps",
                                             "head_dim", "architectures", "tie_word_embeddings",
                                             "bos_token_id", "eos_token_id"]), label="key")
            cfg[key] = data.draw(EXTREME, label="value")
        path.write_text(dumps(cfg))
    else:
        path = root / f"{which}.json"
        path.write_text(dumps(_set_path(data, json.loads(path.read_text()), which)))


_PATTERNS = ["(.*.*)*x", "(a+)+$", "(q|q)*_proj$", ".*", "[", "q_proj", "model\\.layers\\.0\\..*", "(?<=x", ""]


def mut_adapter(data: st.DataObject, root: Path) -> None:
    """A field of adapter_config.json (rank, alpha, patterns) or a non-finite / reshaped adapter tensor."""
    adapter = root / "adapter"
    op = data.draw(st.sampled_from(["config", "config", "pattern", "tensor"]), label="op")
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    if op == "config":
        key = data.draw(st.sampled_from(["r", "lora_alpha", "use_rslora", "fan_in_fan_out", "use_dora",
                                         "target_modules", "modules_to_save", "peft_type", "bias",
                                         "layers_to_transform", "rank_pattern", "alpha_pattern"]), label="key")
        cfg[key] = data.draw(EXTREME, label="value")
    elif op == "pattern":
        pattern = data.draw(st.sampled_from(_PATTERNS), label="pattern")
        where = data.draw(st.sampled_from(["target_modules", "rank_pattern", "alpha_pattern", "exclude_modules"]))
        cfg[where] = {pattern: 4} if where.endswith("_pattern") else pattern
    else:
        meta, tensors = _tensors(adapter / "adapter_model.safetensors")
        name = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
        code, shape, blob = tensors[name]
        arr = np.frombuffer(blob, dtype="<f4" if code == "F32" else "<u2").copy()
        how = data.draw(st.sampled_from(["nan", "inf", "shape"]), label="how")
        if how == "shape":
            tensors[name] = (code, [shape[-1], shape[0]] if len(shape) == 2 else shape + [1], blob)
        else:
            i = data.draw(st.integers(0, arr.size - 1), label="at")
            if code == "F32":
                arr[i] = np.nan if how == "nan" else np.inf
            else:  # bf16 / f16 bit patterns of NaN and +inf
                arr[i] = {"BF16": {"nan": 0x7FC0, "inf": 0x7F80}, "F16": {"nan": 0x7E00, "inf": 0x7C00}}.get(
                    code, {"nan": 0x7FC0, "inf": 0x7F80})[how]
            tensors[name] = (code, shape, arr.tobytes())
        _rebuild(adapter / "adapter_model.safetensors", meta, tensors)
    path.write_text(dumps(cfg))


# ------------------------------------------------------------------------------------ running and judging

def _judge_any(kind: str, src: Path, work: Path, to: str, merge_lora: tuple[Path, ...] = (), *,
               one_problem: bool = True) -> str:
    """Without a value oracle: a finished output that loads (:func:`~tests.helpers.fuzzing.assert_loadable`)
    or one of our errors with nothing left behind; the inputs unchanged. For GGUF, ``check`` agrees: clean
    exactly when the conversion succeeds, else it names the same rule (``one_problem``: and only that one)."""
    from convert.job import convert
    from convert.options import ConvertOptions

    out = work / "outdir" / ("out.gguf" if to.startswith("gguf") else "out")
    before = {p: tree_hash(p) for p in (src, *merge_lora)}
    lora_args = tuple(a for p in merge_lora for a in ("--merge-lora", str(p)))
    inspected, planned = probe_commands(src, out, to, lora_args) if probing(kind) else ("ok", "ok")
    try:
        with hang_guard():
            convert(ConvertOptions(str(src), to=to, output=out, threads=1, max_memory=64 << 20,
                                   merge_lora=merge_lora))
    except ConvertBnbError as exc:
        outcome = clean_error(exc, out)
    else:
        assert out.exists() and not [p for p in out.parent.iterdir() if TMP_MARK in p.name]
        assert_loadable(out)
        assert (inspected, planned) == ("ok", "ok"), f"converted, but inspect: {inspected}, --dry-run: {planned}"
        outcome = "ok"
    assert {p: tree_hash(p) for p in before} == before, "an input was modified"
    if to.startswith("gguf"):
        with hang_guard():
            report = check_source(src, to)
        found = [p.rule for p in report.problems]
        agrees = (found == [outcome] if one_problem else outcome in found) if outcome != "ok" else found == []
        assert agrees, f"check --to {to} says {found}, convert {outcome}"
    OUTCOMES[kind][outcome] += 1
    return outcome


def run_struct(kind: str, data: st.DataObject) -> str:
    """One case of a structure-aware kind, in a fresh temporary directory."""
    with tempfile.TemporaryDirectory(prefix="convert-bnb-sfuzz-") as d:
        work = Path(d)
        src = work / "in" / "model"
        if kind == "struct-quant-state":
            seed = data.draw(st.sampled_from([MODEL, SHARDED]), label="seed")
            shutil.copytree(seed, src, ignore=shutil.ignore_patterns("reference"))
            mut_quant_state_fields(data, src)
            return judge(kind, src, work)
        shutil.copytree(MODEL, src, ignore=shutil.ignore_patterns("reference"))
        if kind == "struct-companions":
            mut_companions(data, src)
            return judge(kind, src, work)
        if kind == "struct-gguf-config":
            mut_gguf_config(data, src)
            return _judge_any(kind, src, work, "gguf:q8_0")
        shutil.copytree(ADAPTER, work / "adapter")
        mut_adapter(data, work)
        return _judge_any(kind, src, work, "bf16", (work / "adapter",))



"""Layout variants seen in the wild: unpacked QuantState, storage dtypes, packed shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convert.cli import main
from formats.dtypes import BY_CODE
from formats.safetensors import SafetensorsWriter
from tests.helpers.fixtures import SINGLE, bits, load_all

NESTED = "nf4_bs64_dq_float16_3x40x72_outliers"
PLAIN = "fp4_bs128_nodq_float32_96x100_mixed"
CODES = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}


def write(path: Path, tensors: dict[str, np.ndarray], codes: dict[str, str] | None = None) -> None:
    codes = codes or {}
    entries = [(k, BY_CODE[codes.get(k) or CODES[v.dtype]], v.shape) for k, v in tensors.items()]
    w = SafetensorsWriter(path, entries)
    for v in tensors.values():
        w.write(v)
    w.close()


def reference(name: str) -> np.ndarray:
    return load_all(SINGLE / f"{name}.dq.safetensors")["layer.weight"]


def convert(src: Path, tmp_path: Path) -> np.ndarray:
    out = tmp_path / "o.safetensors"
    assert main([str(src), "-o", str(out), "-q"]) == 0
    return load_all(out)["layer.weight"]


@pytest.mark.parametrize("name", [NESTED, PLAIN])
def test_unpacked_quant_state(name: str, tmp_path: Path) -> None:
    """QuantState.as_dict(packed=False): the JSON's fields as separate entries (tensors here)."""
    q = load_all(SINGLE / f"{name}.q.safetensors")
    key = next(k for k in q if ".quant_state." in k)
    state = json.loads(bytes(q.pop(key)))
    for field, value in state.items():
        if isinstance(value, str):
            q[f"layer.weight.{field}"] = np.frombuffer(value.encode(), np.uint8)
        elif isinstance(value, list):
            q[f"layer.weight.{field}"] = np.array(value, np.int64)
        elif isinstance(value, int):
            q[f"layer.weight.{field}"] = np.array(value, np.int64)
        else:
            q[f"layer.weight.{field}"] = np.array(value, np.float32)
    src = tmp_path / "unpacked.safetensors"
    write(src, q)
    assert np.array_equal(bits(convert(src, tmp_path)), bits(reference(name)))


@pytest.mark.parametrize("storage", ["F32", "BF16", "F16", "U8-1xN", "U8-flat"])
def test_packed_storage_dtype_and_shape(storage: str, tmp_path: Path) -> None:
    """bnb_4bit_quant_storage and other packed shapes: the same bytes, reinterpreted."""
    q = load_all(SINGLE / f"{PLAIN}.q.safetensors")
    packed = np.ascontiguousarray(q["layer.weight"]).reshape(-1)
    codes = {}
    if storage == "U8-1xN":
        q["layer.weight"] = packed.reshape(1, -1)
    elif storage == "U8-flat":
        q["layer.weight"] = packed
    else:
        item = BY_CODE[storage].itemsize
        q["layer.weight"] = packed.view({4: np.float32, 2: np.uint16}[item]).reshape(-1, 1)
        codes["layer.weight"] = storage
    src = tmp_path / "storage.safetensors"
    write(src, q, codes)
    assert np.array_equal(bits(convert(src, tmp_path)), bits(reference(PLAIN)))


def test_layer_split_across_shards(tmp_path: Path) -> None:
    """A layer's parts in different shards of an indexed directory."""
    q = load_all(SINGLE / f"{NESTED}.q.safetensors")
    names = list(q)
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    for i, chunk in enumerate((names[:2], names[2:4], names[4:])):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        write(model / shard, {k: q[k] for k in chunk})
        weight_map.update({k: shard for k in chunk})
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "out"
    assert main([str(model), "-o", str(out), "-q"]) == 0
    assert np.array_equal(bits(load_all(out)["layer.weight"]), bits(reference(NESTED)))

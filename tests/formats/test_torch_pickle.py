"""formats.torch_pickle: torch.save files read without torch and without running code."""

from __future__ import annotations

import copyreg
import json
import mmap
import os
import pickle
import pickletools
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import formats.pickle_machine as pm
import formats.torch_pickle as tp
from convert.cli import main
from formats.bnb import BnbLayerError, QuantizedLayer
from formats.bnb_layers import group_layers
from formats.checkpoint import open_checkpoint
from formats.errors import (
    ConvertBnbError,
    MalformedPickleError,
    NotStateDictError,
    NotTorchCheckpointError,
    PickleLimitError,
    PickleTooLargeError,
    TorchPickleError,
    UnsafePickleError,
)
from formats.safetensors import SafetensorsReader
from formats.torch_pickle import PickledObject, TensorRef, TorchPickleReader
from tests.helpers.bnb import dequant
from tests.helpers.fixtures import FIXTURES, ROOT, assert_same_tensors, bits, load_all
from tests.helpers.rss import run_measured
from tests.helpers.torchsave import (
    Emitter,
    Global,
    NewObj,
    Reduce,
    Tensor,
    deep_by_mutation,
    dtype_global,
    huge_long4,
    nested_lists,
    nested_marks,
    save_legacy,
    save_legacy_raw,
    save_zip,
    save_zip_deflated_pickle,
    save_zip_raw_pickle,
    shared_tuple_key,
    shared_tuple_pid,
    shared_tuple_set,
    shared_tuples,
    size,
    tensor_with_numel,
)

SINGLE = FIXTURES / "single"
NAME = "nf4_bs32_dq_bfloat16_37x51_normal"
MODELS = FIXTURES / "models"


def _q(name: str) -> SafetensorsReader:
    return SafetensorsReader(SINGLE / f"{name}.q.safetensors")


def _dq(name: str) -> np.ndarray:
    return SafetensorsReader(SINGLE / f"{name}.dq.safetensors").array("layer.weight")


# ------------------------------------------------------------------------------------ real files


def test_q_pt_holds_the_same_tensors_as_the_safetensors_file():
    pt = TorchPickleReader(SINGLE / f"{NAME}.q.pt")
    st = _q(NAME)
    assert pt.layout == "zip"
    assert sorted(pt.tensors) == sorted(st.tensors)
    assert pt.values == {}
    for name, info in st.tensors.items():
        got = pt.tensors[name]
        assert (got.dtype, got.shape, got.nbytes) == (info.dtype, info.shape, info.nbytes)
        assert bytes(pt.raw(name)) == bytes(st.raw(name))


def test_q_pt_dequantizes_bit_for_bit_to_its_dq():
    with open_checkpoint(SINGLE / f"{NAME}.q.pt") as ckpt:
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
        assert plain == []
        layer = layers["layer.weight"]
        assert isinstance(layer, QuantizedLayer) and layer.state.nested and layer.warnings == ()
        got = dequant(layer, "bfloat16")
    want = _dq(NAME)
    assert got.shape == want.shape == (37, 51)
    assert np.array_equal(bits(got), bits(want))


def test_tensor_data_is_a_zero_copy_view_of_the_file():
    pt = TorchPickleReader(SINGLE / f"{NAME}.q.pt")
    arr = pt.array("layer.weight.quant_map")
    assert not arr.flags.writeable and not arr.flags.owndata
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert isinstance(getattr(base, "obj", base), mmap.mmap)
    # the bytes sit where the zip local header says: offset + 30 + name + extra
    info = pt.tensors["layer.weight.quant_map"]
    with zipfile.ZipFile(pt.path) as zf:
        member = zf.getinfo(f"{NAME}.q/data/2")
        assert bytes(pt.raw("layer.weight.quant_map")) == zf.read(member)
    assert info.contiguous and info.storage == "2"
    pt.release("layer.weight.quant_map")
    pt.close()


def test_llama_bin_equals_the_safetensors_model_tensor_for_tensor():
    with open_checkpoint(MODELS / "llama_nf4_dq_bin") as ckpt:
        assert [p.name for p in ckpt.files] == ["pytorch_model.bin"]
        st = SafetensorsReader(MODELS / "llama_nf4_dq" / "model.safetensors")
        assert sorted(ckpt.tensors) == sorted(st.tensors)
        for name, info in st.tensors.items():
            rec = ckpt.tensors[name]
            assert (rec.dtype, rec.shape) == (info.dtype, info.shape), name
            assert bytes(rec.raw()) == bytes(st.raw(name)), name


def test_llama_bin_dequantizes_bit_for_bit_to_the_reference():
    ref = SafetensorsReader(MODELS / "llama_nf4_dq" / "reference" / "dequantized.safetensors")
    with open_checkpoint(MODELS / "llama_nf4_dq_bin") as ckpt:
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
        assert len(layers) == 14
        assert sorted(list(layers) + plain) == sorted(ref.tensors)
        for name, layer in layers.items():
            assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(ref.array(name))), name
        for name in plain:
            assert bytes(ckpt.tensors[name].raw()) == bytes(ref.raw(name)), name


# -------------------------------------------------------------------------- built containers

ARR = np.arange(24, dtype=np.float32).reshape(4, 6)


def _state() -> dict:
    return {
        "a": Tensor(ARR),
        "t": Tensor(ARR, shape=(6, 4), stride=(1, 6)),  # a transposed view: copied
        "rows": Tensor(ARR, shape=(2, 6), offset=12),  # a view into the same storage
        "col": Tensor(ARR, shape=(4, 1), stride=(6, 1)),  # non-contiguous as pickled? no: size-1 dim
        "b": Tensor(np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)),
        "n": 7, "s": "text", "d": dtype_global("bfloat16"), "z": size(4, 6), "f": 0.25,
        "nested": {"inner": Tensor(np.array([3], dtype=np.int64)), "k": [1, 2]},
    }


@pytest.mark.parametrize("saver", [save_zip, save_legacy], ids=["zip", "legacy"])
def test_views_values_and_nested_dicts(tmp_path, saver):
    r = TorchPickleReader(saver(tmp_path / "m.pt", _state()))
    assert r.layout == ("zip" if saver is save_zip else "legacy")
    assert set(r.tensors) == {"a", "t", "rows", "col", "b", "nested.inner"}
    assert np.array_equal(r.array("a"), ARR)
    assert np.array_equal(r.array("t"), ARR.T) and not r.tensors["t"].contiguous
    assert np.array_equal(r.array("rows"), ARR[2:]) and r.tensors["rows"].contiguous
    assert np.array_equal(r.array("col"), ARR[:, :1])
    assert bytes(r.raw("t", 4, 12)) == ARR.T.tobytes()[4:12]
    assert r.array("b").dtype == ml_dtypes.bfloat16 and r.array("b").tolist() == [1.5, -2.0]
    assert r.array("nested.inner").tolist() == [3]
    assert r.values == {"n": 7, "s": "text", "d": "torch.bfloat16", "z": (4, 6), "f": 0.25,
                        "nested.k": [1, 2]}
    assert r.values["d"].dtype.code == "BF16"
    assert r.tensors["rows"].storage == r.tensors["a"].storage


def test_large_non_contiguous_view_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tp, "MAX_COPY_BYTES", 64)
    path = save_zip(tmp_path / "m.pt", {"t": Tensor(ARR, shape=(6, 4), stride=(1, 6))})
    with pytest.raises(TorchPickleError) as ei:
        TorchPickleReader(path)
    assert ei.value.rule == "PT-007" and ei.value.tensor == "t" and ei.value.found == 96


def test_view_past_its_storage_is_refused(tmp_path):
    path = save_zip(tmp_path / "m.pt", {"w": Tensor(ARR, shape=(4, 6), offset=1)})
    with pytest.raises(TorchPickleError) as ei:
        TorchPickleReader(path)
    assert ei.value.rule == "PT-006" and ei.value.tensor == "w"
    assert "reaches past its storage" in str(ei.value) and "found 24" in str(ei.value)


def test_sharded_bin_with_index(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    save_zip(d / "pytorch_model-00001-of-00002.bin", {"x.weight": Tensor(ARR)})
    save_zip(d / "pytorch_model-00002-of-00002.bin", {"y.weight": Tensor(ARR[:1].copy())})
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "x.weight": "pytorch_model-00001-of-00002.bin", "y.weight": "pytorch_model-00002-of-00002.bin"}}))
    (d / "config.json").write_text("{}")
    with open_checkpoint(d) as ckpt:
        assert [p.name for p in ckpt.files] == ["pytorch_model-00001-of-00002.bin",
                                               "pytorch_model-00002-of-00002.bin"]
        assert np.array_equal(ckpt.tensors["y.weight"].array(), ARR[:1])


def test_safetensors_preferred_when_both_are_present(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    save_zip(d / "pytorch_model.bin", {"x": Tensor(ARR)})
    (d / "model.safetensors").write_bytes((SINGLE / f"{NAME}.q.safetensors").read_bytes())
    with open_checkpoint(d) as ckpt:
        assert [p.name for p in ckpt.files] == ["model.safetensors"]


def _expect(path: Path, rule: str, *parts: str, cls: type = TorchPickleError) -> TorchPickleError:
    with pytest.raises(cls) as ei:
        TorchPickleReader(path)
    assert ei.value.rule == rule, str(ei.value)
    assert ei.value.path == os.fspath(path)
    for p in parts:
        assert p in str(ei.value), str(ei.value)
    return ei.value


def test_malformed_containers(tmp_path, monkeypatch):
    _expect(save_zip(tmp_path / "c.pt", {"w": Tensor(ARR)}, compress_data=True), "PT-005",
            "is compressed", "expected 'stored (method 0)', found 'method 8'")
    _expect(save_zip(tmp_path / "be.pt", {"w": Tensor(ARR)}, byteorder=b"big"), "PT-008",
            "little-endian", "found 'big'")
    _expect(save_zip(tmp_path / "list.pt", [Tensor(ARR)]), "PT-009", "not a state dict", "found 'list'")
    _expect(save_zip(tmp_path / "one.pt", Tensor(ARR)), "PT-009", "found 'a single tensor'")
    _expect(save_zip(tmp_path / "keys.pt", {1: Tensor(ARR)}), "PT-009", "keys must be strings")

    # storage record missing / wrong size
    data = Emitter().dumps({"w": Tensor(ARR)})
    _expect(save_zip_raw_pickle(tmp_path / "missing.pt", data), "PT-005", "'data/0' is missing")
    with zipfile.ZipFile(tmp_path / "short.pt", "w") as zf:
        zf.writestr("a/data.pkl", data)
        zf.writestr("a/data/0", ARR.tobytes()[:-4])
    _expect(tmp_path / "short.pt", "PT-005", "wrong size", "expected 96, found 92")

    # truncated zip, random bytes, tar-format legacy, a zip that is not torch.save's
    good = save_zip(tmp_path / "good.pt", {"w": Tensor(ARR)}).read_bytes()
    (tmp_path / "trunc.pt").write_bytes(good[: len(good) // 2])
    _expect(tmp_path / "trunc.pt", "PT-001", "not a readable zip archive")
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01junk" * 10)
    _expect(tmp_path / "junk.bin", "PT-001", "not a PyTorch checkpoint")
    (tmp_path / "old.pt").write_bytes(b"\x00" * 257 + b"ustar" + b"\x00" * 300)
    _expect(tmp_path / "old.pt", "PT-001", "tar-format")
    with zipfile.ZipFile(tmp_path / "other.zip.pt", "w") as zf:
        zf.writestr("readme.txt", "hi")
    _expect(tmp_path / "other.zip.pt", "PT-001", "not a torch.save checkpoint")

    # a plain (non-torch) pickle of harmless data is still refused: no magic number
    (tmp_path / "plain.bin").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    _expect(tmp_path / "plain.bin", "PT-001", "no torch magic number")

    # data.pkl over the limit
    monkeypatch.setattr(pm, "MAX_PICKLE_BYTES", 16)
    _expect(tmp_path / "good.pt", "PT-002", "larger than the limit")


def test_legacy_truncated_and_wrong_count(tmp_path):
    path = save_legacy(tmp_path / "l.pt", {"w": Tensor(ARR)})
    raw = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[:-8])
    _expect(tmp_path / "cut.pt", "PT-005", "runs past the end of the file")
    i = raw.rindex(struct.pack("<q", 24))
    (tmp_path / "count.pt").write_bytes(raw[:i] + struct.pack("<q", 23) + raw[i + 8:])
    _expect(tmp_path / "count.pt", "PT-005", "wrong element count", "expected 24, found 23")


def test_reader_through_checkpoint_registry(tmp_path):
    for suffix in (".bin", ".pt", ".pth"):
        path = save_zip(tmp_path / f"w{suffix}", {"w": Tensor(ARR), "step": 3})
        with open_checkpoint(path) as ckpt:
            assert list(ckpt.tensors) == ["w"] and ckpt.values == {"step": 3}


# -------------------------------------------------------------------------------- hostile pickles


class _Payload:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: Path) -> dict[str, object]:
    """Each payload writes ``marker`` when unpickled by a plain pickle.load."""
    return {
        "posix.system": _Payload(os.system, (f"touch '{marker}'",)),
        "builtins.eval": _Payload(eval, (f"open({str(marker)!r}, 'w').write('pwned')",)),
        "builtins.exec": _Payload(exec, (f"open({str(marker)!r}, 'w').write('pwned')",)),
        "subprocess.Popen": _Payload(subprocess.Popen, (["touch", str(marker)],)),
        "builtins.open": _Payload(open, (str(marker), "w")),
    }


@pytest.mark.parametrize("glob", ["posix.system", "builtins.eval", "builtins.exec", "subprocess.Popen",
                                  "builtins.open"])
@pytest.mark.parametrize("carrier", ["zip", "legacy-magic", "legacy-main", "plain-pickle", "inside-dict"])
def test_hostile_pickles_are_refused_and_run_nothing(tmp_path, glob, carrier):
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[glob]
    blob = pickle.dumps(payload, protocol=2)
    # control: the payload is live -- a plain unpickler writes the marker
    obj = pickle.loads(blob)
    if isinstance(obj, subprocess.Popen):
        obj.wait()
    elif hasattr(obj, "close"):
        obj.close()
    assert marker.exists()
    marker.unlink()

    path = tmp_path / "evil.bin"
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    proto = pickle.dumps(1001, protocol=2)
    info = pickle.dumps({"little_endian": True}, protocol=2)
    if carrier == "zip":
        save_zip_raw_pickle(path, blob)
    elif carrier == "legacy-magic":
        path.write_bytes(blob + proto)
    elif carrier == "legacy-main":
        path.write_bytes(magic + proto + info + blob)
    elif carrier == "plain-pickle":
        path.write_bytes(blob)
    else:
        mod, name = glob.split(".")
        args = (["touch", str(marker)],) if name == "Popen" else payload.args
        evil = Emitter().dumps({"w": Tensor(ARR), "x": Reduce(Global(mod, name), args)})
        save_zip_raw_pickle(path, evil)
    # the name as the pickle spells it (protocol 2 writes py2 names such as __builtin__.eval)
    spelled = next(arg for op, arg, _ in pickletools.genops(blob) if op.name == "GLOBAL").replace(" ", ".")
    if carrier == "inside-dict":
        spelled = glob
    err = _expect(path, "PT-003", f"found '{spelled}'", "nothing was imported or run", cls=UnsafePickleError)
    assert isinstance(err, ConvertBnbError) and isinstance(err, ValueError)
    assert not marker.exists()


def test_extension_registry_opcodes_go_through_the_allow_list(tmp_path):
    marker = tmp_path / "pwned"
    blob = b"\x80\x02\x82\xf0(" + pickle.dumps(f"touch '{marker}'", protocol=2)[2:-1] + b"tR."
    copyreg.add_extension("posix", "system", 0xF0)
    try:
        path = save_zip_raw_pickle(tmp_path / "ext.pt", blob)
        _expect(path, "PT-003", "found 'posix.system'", cls=UnsafePickleError)
    finally:
        copyreg.remove_extension("posix", "system", 0xF0)
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [
    ("torch", "load"),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    ("torch.serialization", "_get_layout"),
    ("collections", "namedtuple"),
    ("collections", "OrderedDict.fromkeys"),
    ("builtins", "getattr"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("bitsandbytes.nn.modules", "Params4bit"),
])
def test_near_miss_globals_are_refused(tmp_path, module, name):
    evil = Emitter().dumps({"x": Reduce(Global(module, name), ())})
    _expect(save_zip_raw_pickle(tmp_path / "e.pt", evil), "PT-003", f"found '{module}.{name}'",
            cls=UnsafePickleError)


@pytest.mark.parametrize("obj,part", [
    (Reduce(Global("_codecs", "encode"), ("x", "zlib_codec")), "encode(str, 'latin1')"),
    (Reduce(Global("torch._utils", "_rebuild_tensor_v2"), ("storage", 0, (1,), (1,))),
     "storage must come from a persistent id"),
    (Reduce(Global("torch", "FloatStorage"), ()), "calling storage type FloatStorage"),
    (Reduce(Global("torch", "bfloat16"), ()), "not callable"),
    (Reduce(Global("torch", "Size"), ("abc",)), "torch.Size must be"),
    (Reduce(Global("builtins", "set"), (7,)), "set() takes a list"),
])
def test_allowed_globals_refuse_hostile_arguments(tmp_path, obj, part):
    evil = Emitter().dumps({"x": obj})
    _expect(save_zip_raw_pickle(tmp_path / "e.pt", evil), "PT-004", part)


def test_hostile_persistent_ids_are_refused(tmp_path):
    blob = b"\x80\x02}(X\x01\x00\x00\x00x(X\x06\x00\x00\x00moduleNNtQu."
    _expect(save_zip_raw_pickle(tmp_path / "p.pt", blob), "PT-004", "persistent id must be")


# ------------------------------------------------------------------------ legacy list QuantState


def _layer_tensors(name: str) -> dict[str, np.ndarray]:
    q = _q(name)
    return {n: np.array(q.array(n)) for n in q.tensors}


def _offset(name: str) -> float:
    q = _q(name)
    key = next(k for k in q.tensors if "quant_state" in k)
    return json.loads(bytes(q.raw(key)))["nested_offset"]


def _state2(kind: str, t: dict[str, np.ndarray]):
    a2, code = Tensor(t["layer.weight.nested_absmax"]), Tensor(t["layer.weight.nested_quant_map"])
    if kind == "list7":  # bnb 0.40 quantize_blockwise state
        return [a2, code, 256, False, dtype_global("float32"), None, None]
    if kind == "tuple2":  # bnb 0.39: (absmax, code)
        return (a2, code)
    return NewObj(Global("bitsandbytes.functional", "QuantState"),
                  {"absmax": a2, "code": code, "blocksize": 256, "dtype": dtype_global("float32"),
                   "quant_type": None, "offset": None, "state2": None, "nested": False})


@pytest.mark.parametrize("kind", ["list7", "tuple2", "object"])
@pytest.mark.parametrize("saver", [save_zip, save_legacy], ids=["zip", "legacy"])
def test_legacy_list_quant_state_nested(tmp_path, kind, saver):
    t = _layer_tensors(NAME)
    off = np.array(np.float32(_offset(NAME)))  # a 0-dim fp32 tensor, as absmax.mean() gave
    state = [Tensor(t["layer.weight.absmax"]), size(37, 51), dtype_global("bfloat16"), 32,
             [Tensor(off), _state2(kind, t)], "nf4"]
    path = saver(tmp_path / "legacy.pt", {"layer.weight": Tensor(t["layer.weight"]),
                                          "layer.weight.quant_state": state})
    with open_checkpoint(path) as ckpt:
        assert isinstance(ckpt.values["layer.weight.quant_state"][0], TensorRef)
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
        assert plain == []
        layer = layers["layer.weight"]
        want_json = bytes(_q(NAME).raw("layer.weight.quant_state.bitsandbytes__nf4")).decode()
        assert layer.state.to_json() == want_json
        assert "legacy list QuantState" in layer.warnings[0]
        assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(_dq(NAME)))


def test_legacy_list_quant_state_plain_fp4(tmp_path):
    name = "fp4_bs128_nodq_float32_96x100_mixed"
    t = _layer_tensors(name)
    state = [Tensor(t["layer.weight.absmax"]), size(96, 100), dtype_global("float32"), 128, None, "fp4"]
    path = save_zip(tmp_path / "legacy.pt",
                    {"layer.weight": Tensor(t["layer.weight"]), "layer.quant_state": state})
    with open_checkpoint(path) as ckpt:
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
    assert plain == [] and layers["layer.weight"].state.quant_type == "fp4"
    assert np.array_equal(bits(dequant(layers["layer.weight"], "float32")), bits(_dq(name)))


def test_pickled_quant_state_object(tmp_path):
    t = _layer_tensors(NAME)
    qs = NewObj(Global("bitsandbytes.functional", "QuantState"), {
        "absmax": Tensor(t["layer.weight.absmax"]), "shape": size(37, 51),
        "code": Tensor(t["layer.weight.quant_map"]),
        "dtype": dtype_global("bfloat16"), "blocksize": 32, "quant_type": "nf4",
        "offset": Tensor(np.array(np.float32(_offset(NAME)))), "state2": _state2("object", t), "nested": True,
    })
    path = save_zip(tmp_path / "obj.pt",
                    {"layer.weight": Tensor(t["layer.weight"]), "layer.weight.quant_state": qs})
    with open_checkpoint(path) as ckpt:
        assert isinstance(ckpt.values["layer.weight.quant_state"], PickledObject)
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
    assert plain == []
    assert "pickled QuantState object" in layers["layer.weight"].warnings[0]
    assert np.array_equal(bits(dequant(layers["layer.weight"], "bfloat16")), bits(_dq(NAME)))


def test_unpacked_quant_state_with_python_values(tmp_path):
    t = _layer_tensors(NAME)
    obj = {k: Tensor(v) for k, v in t.items() if "quant_state" not in k}
    obj.update({"layer.weight.quant_type": "nf4", "layer.weight.blocksize": 32,
                "layer.weight.dtype": "bfloat16",
                "layer.weight.shape": size(37, 51), "layer.weight.nested_blocksize": 256,
                "layer.weight.nested_dtype": "float32", "layer.weight.nested_offset": _offset(NAME)})
    with open_checkpoint(save_zip(tmp_path / "u.pt", obj)) as ckpt:
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
    assert plain == []
    assert np.array_equal(bits(dequant(layers["layer.weight"], "bfloat16")), bits(_dq(NAME)))


def _quant_state_as(form: str, t: dict[str, np.ndarray]) -> dict[str, Any]:
    """A state dict of NAME's layer with its QuantState as a pickled object, bnb 0.40's list, or unpacked values."""
    off = np.array(np.float32(_offset(NAME)))
    if form == "object":
        return {"layer.weight": Tensor(t["layer.weight"]), "layer.weight.quant_state": NewObj(
            Global("bitsandbytes.functional", "QuantState"), {
                "absmax": Tensor(t["layer.weight.absmax"]), "shape": size(37, 51),
                "code": Tensor(t["layer.weight.quant_map"]), "dtype": dtype_global("bfloat16"), "blocksize": 32,
                "quant_type": "nf4", "offset": Tensor(off), "state2": _state2("object", t), "nested": True})}
    if form == "list":
        return {"layer.weight": Tensor(t["layer.weight"]), "layer.weight.quant_state": [
            Tensor(t["layer.weight.absmax"]), size(37, 51), dtype_global("bfloat16"), 32,
            [Tensor(off), _state2("list7", t)], "nf4"]}
    obj: dict[str, Any] = {k: Tensor(v) for k, v in t.items() if "quant_state" not in k}
    obj.update({"layer.weight.quant_type": "nf4", "layer.weight.blocksize": 32, "layer.weight.dtype": "bfloat16",
                "layer.weight.shape": size(37, 51), "layer.weight.nested_blocksize": 256,
                "layer.weight.nested_dtype": "float32", "layer.weight.nested_offset": _offset(NAME)})
    return obj


@pytest.mark.parametrize("form", ["object", "list", "unpacked"])
def test_inspect_reads_every_quant_state_form_as_convert_does(tmp_path, capsys, form):
    """Issue 39 (struct-pickle-strings fuzzer): inspect grouped layers without the pickle's values, so a
    QuantState pickled as an object, as a list or unpacked was BNB-011 there while convert and check read it
    (and, given the values, an unpacked one's fields were 'internal error: KeyError')."""
    path = save_zip(tmp_path / "m.pt", _quant_state_as(form, _layer_tensors(NAME)))
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [g["layers"] for g in report["quantized"]] == [1] and report["unquantized"] == []
    assert main([str(path), "--dry-run", "-q", "-o", str(tmp_path / "o.safetensors")]) == 0
    assert main(["check", str(path), "-q"]) == 0


@pytest.mark.parametrize("state,part", [
    ([None, size(37, 51), dtype_global("bfloat16"), 32, None, "nf4"], "absmax must be a tensor"),
    (["A", size(37, 51), dtype_global("bfloat16"), "32", None, "nf4"], "blocksize must be an integer"),
    (["A", size(37, 51), dtype_global("bfloat16"), 32, [1.0], "nf4"], "compressed statistics must be"),
    (["A", size(37, 51), dtype_global("bfloat16"), 32, [1.0, [1, 2, 3]], "nf4"], "state2 must be"),
])
def test_malformed_legacy_quant_state(tmp_path, state, part):
    t = _layer_tensors(NAME)
    state = [Tensor(t["layer.weight.absmax"]) if x == "A" else x for x in state]
    path = save_zip(tmp_path / "bad.pt",
                    {"layer.weight": Tensor(t["layer.weight"]), "layer.weight.quant_state": state})
    with open_checkpoint(path) as ckpt, pytest.raises(BnbLayerError) as ei:
        group_layers(ckpt.tensors, ckpt.values)
    assert ei.value.rule == "BNB-017" and part in str(ei.value)
    assert ei.value.tensor == "layer.weight.quant_state"


# ------------------------------------------------------------------------------------ CLI


def test_cli_converts_llama_nf4_dq_bin_bit_for_bit(tmp_path):
    out = tmp_path / "out"
    src = MODELS / "llama_nf4_dq_bin"
    assert main([str(src), "--to", "bf16", "-o", str(out), "-q"]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert_same_tensors(load_all(out), load_all(MODELS / "llama_nf4_dq" / "reference" / "dequantized.safetensors"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not (out / "pytorch_model.bin").exists()


def test_cli_converts_the_q_pt_file(tmp_path):
    out = tmp_path / "o.safetensors"
    assert main([str(SINGLE / f"{NAME}.q.pt"), "--to", "bf16", "-o", str(out), "-q"]) == 0
    got = load_all(out)["layer.weight"]
    assert got.shape == (37, 51) and np.array_equal(bits(got), bits(_dq(NAME)))


def test_cli_legacy_list_quant_state_and_notes(tmp_path, capsys):
    t = _layer_tensors(NAME)
    state = [Tensor(t["layer.weight.absmax"]), size(37, 51), dtype_global("bfloat16"), 32,
             [Tensor(np.array(np.float32(_offset(NAME)))), _state2("list7", t)], "nf4"]
    src = save_legacy(tmp_path / "old.pt", {"layer.weight": Tensor(t["layer.weight"]),
                                            "layer.weight.quant_state": state})
    out = tmp_path / "o.safetensors"
    assert main([str(src), "-o", str(out)]) == 0  # --to auto: the QuantState dtype (bf16)
    got = load_all(out)
    assert list(got) == ["layer.weight"] and np.array_equal(bits(got["layer.weight"]), bits(_dq(NAME)))
    err = capsys.readouterr().err
    assert "note: QuantState read from a legacy list QuantState (bitsandbytes < 0.41) (1 layer, e.g. " \
           "layer.weight)" in err


def test_cli_refuses_a_hostile_bin_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    d = tmp_path / "model"
    d.mkdir()
    save_zip_raw_pickle(d / "pytorch_model.bin", pickle.dumps(_Payload(os.system, (f"touch '{marker}'",)),
                                                              protocol=2))
    (d / "config.json").write_text("{}")
    assert main([str(d), "--to", "bf16", "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "PT-003" in err and "found 'posix.system'" in err and "pytorch_model.bin" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_build_on_a_rebuilt_tensor_is_refused(tmp_path):
    em = Emitter()
    em.out.write(b"\x80\x02}(")
    em.emit("w")
    em.emit_tensor(Tensor(ARR))
    em.emit({"size": "not a size"})
    em.out.write(b"bu.")
    path = save_zip(tmp_path / "ok.pt", {"w": Tensor(ARR)})  # for the storage record
    with zipfile.ZipFile(path) as zf:
        storage = zf.read("archive/data/0")
    with zipfile.ZipFile(tmp_path / "b.pt", "w") as zf:
        zf.writestr("archive/data.pkl", em.out.getvalue())
        zf.writestr("archive/data/0", storage)
    _expect(tmp_path / "b.pt", "PT-004", "BUILD on Tensor is not allowed")


def test_self_referencing_and_exponentially_shared_values_are_refused(tmp_path):
    loop = b"\x80\x02}(X\x01\x00\x00\x00x]q\x00h\x00au."
    _expect(save_zip_raw_pickle(tmp_path / "loop.pt", loop), "PT-009", "nested too deeply")
    blob = b"\x80\x02}(X\x01\x00\x00\x00x]K\x01aq\x000"
    for i in range(1, 41):  # list i = [list i-1, list i-1]: 2**40 leaves
        blob += b"](h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"eq" + bytes([i]) + b"0"
    blob += b"h\x28u."
    _expect(save_zip_raw_pickle(tmp_path / "bomb.pt", blob), "PT-009", "too many values")


def test_torchscript_archive_is_named(tmp_path):
    with zipfile.ZipFile(tmp_path / "ts.pt", "w") as zf:
        zf.writestr("m/data.pkl", b"\x80\x02}.")
        zf.writestr("m/constants.pkl", b"\x80\x02).")
        zf.writestr("m/code/__torch__.py", "")
    _expect(tmp_path / "ts.pt", "PT-001", "TorchScript archive")


def test_safetensors_index_preferred_over_bin_index(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    save_zip(d / "pytorch_model-00001-of-00001.bin", {"x": Tensor(ARR)})
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"x": "pytorch_model-00001-of-00001.bin"}}))
    (d / "model.safetensors").write_bytes((SINGLE / f"{NAME}.q.safetensors").read_bytes())
    with open_checkpoint(d) as ckpt:
        assert [p.name for p in ckpt.files] == ["model.safetensors"]
    (d / "model.safetensors").unlink()
    with open_checkpoint(d) as ckpt:
        assert [p.name for p in ckpt.files] == ["pytorch_model-00001-of-00001.bin"]


# ------------------------------------------------------------------ hostile pickles (issue 12)
# Each class an independent fuzzer found to crash (internal error), hang (ignoring SIGINT/SIGTERM) or
# eat memory before the reader ran its own bounded pickle machine. Each now ends at a named rule.

_LIMIT_HINT = "Hint: a torch.save state dict is far within it; this file is damaged or hostile"
HOSTILE: dict[str, tuple[Any, type, str, list[str]]] = {
    # a storage's element count as LONG4 of 10**5000: was "internal error: ValueError: Exceeds the limit
    # (4300 digits) for integer string conversion"
    "long4-numel": (lambda p: save_zip_raw_pickle(p, tensor_with_numel(huge_long4())), PickleLimitError, "PT-010",
                    ["an integer in the pickle is too large", "expected '<= 16 bytes', found '2077 bytes'",
                     _LIMIT_HINT]),
    # a dict key shared 2**60 ways: hashing it was exponential (a hang that ignored SIGINT/SIGTERM)
    "shared-tuple-key": (lambda p: save_zip_raw_pickle(p, shared_tuple_key(60)), PickleLimitError, "PT-010",
                         ["a dict key is too large to hash",
                          "expected 'a tuple of <= 256 elements in all', found 'more than 256'"]),
    "shared-tuple-set": (lambda p: save_zip_raw_pickle(p, shared_tuple_set(60)), PickleLimitError, "PT-010",
                         ["a set member is too large to hash"]),
    # a persistent id shared 2**60 ways: its repr in the message grew to 959 MB
    "shared-tuple-pid": (lambda p: save_zip_raw_pickle(p, shared_tuple_pid(60)), MalformedPickleError, "PT-004",
                         ["malformed pickle: persistent id must be ('storage', type, key, location, numel), "
                          "got ((((((((((", "(1,), (1,))", "..."]),
    # 250 MiB of pickle deflated into a small zip member: reached 554 MB RSS
    "deflated-250MiB": (lambda p: save_zip_deflated_pickle(p, 250 << 20), PickleTooLargeError, "PT-002",
                        ["data.pkl is larger than the limit", "expected '<= 67108864 bytes', found 262144000"]),
    # 200,000-deep legacy pickles: RecursionError, exit 1
    "deep-legacy": (lambda p: save_legacy_raw(p, nested_lists(200_000)), PickleLimitError, "PT-010",
                    ["containers are nested too deeply", "expected '<= 100 levels', found '101 levels'"]),
    "deep-legacy-magic": (lambda p: p.write_bytes(nested_lists(200_000)) and p, PickleLimitError, "PT-010",
                          ["containers are nested too deeply"]),
    "deep-legacy-marks": (lambda p: save_legacy_raw(p, nested_marks(200_000)), PickleLimitError, "PT-010",
                          ["MARKs are nested too deeply", "expected '<= 100', found 101"]),
    # deep only after placement (each list appended to after it was placed): the flattening walk stops it
    "deep-by-mutation": (lambda p: save_zip_raw_pickle(p, deep_by_mutation(5000)), NotStateDictError, "PT-009",
                         ["tensor 'x'", "values are nested too deeply", "expected '<= 100 levels'"]),
}
#: The five classes of the fuzzer's report, also run through the command line.
HOSTILE_CLI = ["long4-numel", "shared-tuple-key", "shared-tuple-pid", "deflated-250MiB", "deep-legacy"]


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {name: build(d / f"{name}.bin") for name, (build, *_) in HOSTILE.items()}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_pickles_end_at_a_named_rule(hostile_files, name):
    _, cls, rule, parts = HOSTILE[name]
    err = _expect(hostile_files[name], rule, *parts, cls=cls)
    assert type(err) is cls
    assert len(str(err)) < 400 and "\n" not in str(err)


def _cli(*argv: str) -> dict:
    """``python -m convert ARGV`` in a subprocess; its exit code, output and peak RSS in bytes (its own)."""
    return run_measured([sys.executable, "-m", "convert", *argv], cwd=ROOT)


@pytest.mark.parametrize("name", HOSTILE_CLI)
def test_hostile_pickles_through_the_cli(hostile_files, tmp_path, name):
    _, _, rule, parts = HOSTILE[name]
    src, out = hostile_files[name], tmp_path / "out.safetensors"
    r = _cli(str(src), "--to", "bf16", "-o", str(out))
    assert r["rc"] == 2, r
    assert r["err"].startswith("convert-bnb: error: Failed to read ") and r["err"].count("\n") == 1, r["err"]
    assert rule in r["err"] and all(p in r["err"] for p in parts), r["err"]
    assert "Traceback" not in r["err"] and r["out"] == ""
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert r["rss"] < 1 << 30, r["rss"]
    c = _cli("check", str(src))
    assert c["rc"] == 2 and c["err"] == "", c
    assert rule in c["out"] and all(p in c["out"] for p in parts), c["out"]
    assert c["rss"] < 1 << 30, c["rss"]


_SLOW_PARSE = """
import sys
import formats.pickle_machine as pm
pm.MAX_OPCODES = 10**9  # a pickle that parses for a long time, to be interrupted while it does
run = pm.PickleMachine.run
def announced(self, *args):
    print("parsing", flush=True)
    return run(self, *args)
pm.PickleMachine.run = announced
from convert.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["convert", "check"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_parse_at_once(tmp_path, command, sig):
    src = save_zip_raw_pickle(tmp_path / "slow.bin", b"\x80\x02" + b"N0" * 25_000_000 + b"}.")
    out = tmp_path / "out.safetensors"
    argv = ["check", str(src)] if command == "check" else [str(src), "--to", "bf16", "-o", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PARSE, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "parsing\n"
        time.sleep(0.2)
        proc.send_signal(sig)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.startswith("convert-bnb: interrupted") and err.count("\n") == 1, err
    assert stopped < 2.0, stopped
    assert not out.exists()


@pytest.mark.parametrize("limit,value,blob,parts", [
    ("MAX_OPCODES", 5000, b"\x80\x02" + b"N0" * 6000 + b"}.", ["too many opcodes", "expected '<= 5000'"]),
    ("MAX_MEMO", 10, b"\x80\x02}" + b"".join(b"K\x01r" + struct.pack("<I", i) + b"0" for i in range(11)) + b".",
     ["memo has too many entries", "expected '<= 10'"]),
    ("MAX_CONTAINER_ITEMS", 10, b"\x80\x02}(" + b"".join(b"K" + bytes([i]) + b"N" for i in range(11)) + b"u.",
     ["a list, tuple, dict or set has too many elements", "expected '<= 10', found 11"]),
    ("MAX_TOTAL_ITEMS", 10, b"\x80\x02}" + b"K\x01\x850" * 6 + b".", ["too many elements in all"]),
    ("MAX_DEPTH", 5, b"\x80\x02}" + b")" + b"\x85" * 5 + b"0.", ["nested too deeply", "found '6 levels'"]),
    ("MAX_INT_BYTES", 16, b"\x80\x02}\x8a\x11" + b"\x01" * 17 + b"0.", ["expected '<= 16 bytes', found '17 bytes'"]),
    ("MAX_INT_BYTES", 16, b"\x80\x02}L" + b"9" * 41 + b"L\n0.", ["expected '<= 40 digits'"]),
    ("MAX_KEY_COST", 8, b"\x80\x02}" + shared_tuples(3) + b"Ns.", ["a dict key is too large to hash"]),
])
def test_each_limit_is_pt_010(tmp_path, monkeypatch, limit, value, blob, parts):
    monkeypatch.setattr(pm, limit, value)
    _expect(save_zip_raw_pickle(tmp_path / "l.pt", blob), "PT-010", *parts, cls=PickleLimitError)


def test_pickle_over_the_byte_limit_is_pt_002_in_both_layouts(tmp_path, monkeypatch):
    blob = b"\x80\x02}" + b"N0" * 100 + b"."
    monkeypatch.setattr(pm, "MAX_PICKLE_BYTES", 64)
    _expect(save_zip_raw_pickle(tmp_path / "z.pt", blob), "PT-002", "data.pkl is larger than the limit",
            cls=PickleTooLargeError)
    _expect(save_legacy_raw(tmp_path / "l.pt", blob), "PT-002", "pickle data is larger than the limit",
            cls=PickleTooLargeError)


@pytest.mark.parametrize("blob,part", [
    (tensor_with_numel(b"\x8a\x09" + (2**64).to_bytes(9, "little")), "storage numel must fit in 64 bits"),
    (tensor_with_numel(b"K\x18").replace(b"K\x18\x85", b"(" + b"K\x01" * 65 + b"t"),
     "tensor size has 65 dimensions (at most 64)"),
    (b"\x80\x02}]Ns.", "a dict key must be a string, number, bytes, None or a tuple of them, got list"),
    (b"\x80\x02}" + b"K\x01" * 3 + b"u.", "could not find MARK"),
    (b"\x80\x02}(K\x01u.", "odd number of items"),
    (b"\x80\x02}X\x00\x00\x00\x01", "pickle data was truncated"),
    (b"\x80\x02\xff.", "invalid load key"),
    (b"\x80\x02a.", "stack underflow"),
    (b"\x80\x02}])R.", "[] is not callable"),
    (b"\x80\x02}]]R.", "call arguments must be a tuple, got list"),
    (b"\x80\x02]\x97.", "out-of-band buffers"),
])
def test_malformed_opcodes_are_pt_004(tmp_path, blob, part):
    _expect(save_zip_raw_pickle(tmp_path / "m.pt", blob), "PT-004", "malformed pickle", part,
            cls=MalformedPickleError)


def test_the_summary_of_a_value_is_bounded():
    blob = b"\x80\x02" + shared_tuples(90) + b"."  # 2**90 leaves
    obj, _ = pm.PickleMachine(None, None).run(blob, 0, len(blob))
    text = pm.summary(obj)
    assert len(text) < 120 and text.startswith("((((") and text.endswith("...")
    deep: list = []
    for _ in range(200_000):
        deep = [deep]
    assert len(pm.summary(deep)) < 120
    assert pm.summary(10**5000) == "<integer of 16610 bits>"
    assert pm.summary("x" * 10**6) == "'" + "x" * 79 + "..."
    assert pm.summary({"a": [1, (2,)], "b": set()}) == "{'a': [1, (2,)], 'b': set()}"


def test_protocol_0_and_5_pickles_read_as_pickle_does(tmp_path):
    """The machine runs every protocol's opcodes, as the stdlib writes them (plain values here)."""
    value = {"i": [1, -2, 2**40, -(2**70)], "f": 0.5, "s": "t\u00e9xt", "b": b"\x00\xff", "t": (1, "a", None),
             "n": None, "bool": [True, False], "d": {"k": ((1, 2), frozenset({3}))}, "set": {4, 5}}
    for proto in range(6):
        blob = pickle.dumps(value, protocol=proto, fix_imports=False)  # builtins.set, not __builtin__.set
        obj, end = pm.PickleMachine(lambda m, n: pm.PLAIN_GLOBALS[(m, n)], None).run(blob, 0, len(blob))
        assert obj == value and end == len(blob), proto


def test_a_zip_with_too_many_members_is_refused_before_its_directory_is_read(tmp_path, monkeypatch):
    path = save_zip(tmp_path / "m.pt", {"w": Tensor(ARR)})
    with zipfile.ZipFile(path, "a") as zf:
        for i in range(20):
            zf.writestr(f"archive/extra/{i}", b"")
    monkeypatch.setattr(tp, "MAX_ZIP_MEMBERS", 10)
    _expect(path, "PT-001", "more members than a torch checkpoint can", "expected '<= 10 (one per storage)', found 24",
            cls=NotTorchCheckpointError)
    monkeypatch.setattr(tp, "MAX_ZIP_MEMBERS", 24)
    assert list(TorchPickleReader(path).tensors) == ["w"]

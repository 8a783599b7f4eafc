"""LLM.int8 layers: grouping, validation and the dequantization kernel, bit for bit."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from convert.cli import main
from convert.dequant.kernels import INT8_SCALE, dequantize_int8
from convert.stream.sources import Int8Source
from formats.bnb import BnbLayerError, ConstTensor, Int8Layer
from formats.bnb_layers import group_layers
from formats.checkpoint import open_checkpoint
from formats.dtypes import BY_NAME
from formats.errors import UnsupportedError
from formats.safetensors import SafetensorsReader
from tests.helpers.bnb import dequant
from tests.helpers.fixtures import FIXTURES, assert_same_tensors, bits, load_all
from tests.helpers.torchsave import Tensor, save_zip

PEER = FIXTURES / "peer"
MODEL = FIXTURES / "models" / "llama_int8"


def test_scale_is_bnbs_fp32_spelling_of_one_over_127():
    assert INT8_SCALE.dtype == np.float32
    assert INT8_SCALE.view(np.uint32) == np.float32(7.874015718698502e-3).view(np.uint32) == 0x3C010204


@pytest.mark.parametrize("dtype,key", [("bfloat16", "layer.weight"), ("float32", "layer.weight.f32")])
def test_peer_llama_1b_int8_equals_bnb_cuda_bit_for_bit(dtype, key):
    q = SafetensorsReader(PEER / "llama_1b_int8.q.safetensors")
    want = SafetensorsReader(PEER / "llama_1b_int8.dq.safetensors").array(key)
    layers, plain = group_layers({n: _rec(q, n) for n in q.tensors})
    assert plain == []
    layer = layers["layer.weight"]
    assert isinstance(layer, Int8Layer) and layer.shape == (256, 256)
    assert layer.components == ("layer.weight", "layer.SCB", "layer.weight_format")
    got = dequant(layer, dtype)
    assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want))


def test_other_orders_of_operations_differ_from_bnb():
    q = SafetensorsReader(PEER / "llama_1b_int8.q.safetensors")
    w, scb = q.array("layer.weight").astype(np.float32), q.array("layer.SCB")
    want = SafetensorsReader(PEER / "llama_1b_int8.dq.safetensors").array("layer.weight.f32")
    scale_first = w * (scb * INT8_SCALE)[:, None]
    divide = w * scb[:, None] / np.float32(127)
    assert (bits(scale_first) != bits(want)).sum() == 17299
    assert (bits(divide) != bits(want)).sum() == 2929
    assert np.array_equal(bits(dequantize_int8(q.array("layer.weight"), scb, "float32")), bits(want))


def test_row_pieces_and_out_buffer():
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, size=(300, 7), dtype=np.int8)
    scb = rng.uniform(0.01, 3, size=300).astype(np.float32)
    out = np.empty((300, 7), dtype=ml_dtypes.bfloat16)
    got = dequantize_int8(w, scb, "bfloat16", out=out)
    assert got is out
    ref = ((w.astype(np.float32) * scb[:, None]) * INT8_SCALE).astype(ml_dtypes.bfloat16)
    assert np.array_equal(bits(got), bits(ref))
    f16 = dequantize_int8(w, scb, "float16")
    ref16 = (w.astype(np.float32) * scb[:, None] * INT8_SCALE).astype(np.float16)
    assert np.array_equal(bits(f16), bits(ref16))


def test_llama_int8_model_equals_the_reference_bit_for_bit():
    ref = SafetensorsReader(MODEL / "reference" / "dequantized.safetensors")
    with open_checkpoint(MODEL) as ckpt:
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
        assert len(layers) == 14 and all(isinstance(v, Int8Layer) for v in layers.values())
        assert sorted(list(layers) + plain) == sorted(ref.tensors)
        for name, layer in layers.items():
            assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(ref.array(name))), name
        for name in plain:
            assert bytes(ckpt.tensors[name].raw()) == bytes(ref.raw(name)), name


def test_int8_layer_in_a_torch_pickle(tmp_path):
    q = SafetensorsReader(PEER / "llama_1b_int8.q.safetensors")
    obj = {n: Tensor(np.array(q.array(n))) for n in q.tensors}
    with open_checkpoint(save_zip(tmp_path / "int8.bin", obj)) as ckpt:
        assert ckpt.tensors["layer.weight_format"].shape == ()
        layers, _ = group_layers(ckpt.tensors, ckpt.values)
        got = dequant(layers["layer.weight"], "bfloat16")
    want = SafetensorsReader(PEER / "llama_1b_int8.dq.safetensors").array("layer.weight")
    assert np.array_equal(bits(got), bits(want))


# ------------------------------------------------------------------------------- validation

W = np.arange(-6, 6, dtype=np.int8).reshape(3, 4)
SCB = np.array([1.0, 2.0, 127.0], dtype=np.float32)


def _rec(reader, name):
    return ConstTensor(name, np.array(reader.array(name)), str(reader.path))


def _layers(**extra):
    tensors = {"m.weight": ConstTensor("m.weight", W, "f"), "m.SCB": ConstTensor("m.SCB", SCB, "f")}
    values = {}
    for k, v in extra.items():
        name = "m." + k
        if isinstance(v, np.ndarray):
            tensors[name] = ConstTensor(name, v, "f")
        else:
            values[name] = v
    return group_layers(tensors, values)


def test_missing_weight_format_means_row():
    layers, plain = _layers()
    assert plain == [] and layers["m.weight"].weight_format is None
    assert dequant(layers["m.weight"], "float32")[2].tolist() == [
        np.float32(np.float32(v * 127.0) * INT8_SCALE) for v in (2, 3, 4, 5)]


@pytest.mark.parametrize("fmt", [np.array(0, np.uint8), 0, "row"])
def test_row_format_accepted(fmt):
    layers, plain = _layers(weight_format=fmt)
    assert plain == [] and isinstance(layers["m.weight"], Int8Layer)


@pytest.mark.parametrize("fmt,found", [
    (np.array(1, np.uint8), "1 (col32)"), (np.array(2, np.uint8), "2 (col_turing)"),
    (np.array(3, np.uint8), "3 (col_ampere)"), ("col32", "'col32'"), (7, "7 (unknown)"),
])
def test_non_row_formats_are_refused(fmt, found):
    with pytest.raises(UnsupportedError) as ei:
        _layers(weight_format=fmt)
    assert ei.value.rule == "BNB-016" and ei.value.tensor == "m.weight_format"
    assert ei.value.expected == "0 (row)" and ei.value.found == found


def test_bad_int8_shapes_and_dtypes():
    with pytest.raises(BnbLayerError) as ei:
        group_layers({"m.weight": ConstTensor("m.weight", W.astype(np.uint8), "f"),
                      "m.SCB": ConstTensor("m.SCB", SCB, "f")})
    assert ei.value.rule == "BNB-015" and "found 'U8 [3, 4]'" in str(ei.value)
    with pytest.raises(BnbLayerError) as ei:
        group_layers({"m.weight": ConstTensor("m.weight", W, "f"),
                      "m.SCB": ConstTensor("m.SCB", SCB[:2], "f")})
    assert ei.value.rule == "BNB-015" and ei.value.tensor == "m.SCB"
    assert ei.value.expected == "F32 [3]" and ei.value.found == "F32 [2]"
    with pytest.raises(BnbLayerError) as ei:
        group_layers({"m.SCB": ConstTensor("m.SCB", SCB, "f")})
    assert ei.value.rule == "BNB-010"


# ------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("to", ["bf16", "auto"])
def test_cli_converts_llama_int8_bit_for_bit(tmp_path, to):
    out = tmp_path / "out"
    assert main([str(MODEL), "--to", to, "-o", str(out), "-q"]) == 0
    assert_same_tensors(load_all(out), load_all(MODEL / "reference" / "dequantized.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (MODEL / "tokenizer.json").read_bytes()


def test_cli_int8_single_file_fp32(tmp_path):
    out = tmp_path / "peer.safetensors"
    q = PEER / "llama_1b_int8.q.safetensors"
    assert main([str(q), "--to", "fp32", "-o", str(out), "-q", "--threads", "2"]) == 0
    want = SafetensorsReader(PEER / "llama_1b_int8.dq.safetensors").array("layer.weight.f32")
    got = load_all(out)
    assert list(got) == ["layer.weight"]
    assert np.array_equal(bits(got["layer.weight"]), bits(want))


def test_int8_source_row_chunks_and_fp16_stats():
    w = np.array([[127, -127, 1], [0, 5, -5], [100, 100, 100]], dtype=np.int8)
    scb = np.array([70000.0, 1.0, 1e-9], dtype=np.float32)
    layer = group_layers({"m.weight": ConstTensor("m.weight", w, "f"),
                          "m.SCB": ConstTensor("m.SCB", scb, "f")})[0]["m.weight"]
    src = Int8Source(layer)
    assert (src.unit, src.numel, src.kind) == (3, 9, "dequant int8 row")
    f16 = BY_NAME["float16"]
    got = np.concatenate([src.produce(0, 3, f16), src.produce(3, 9, f16)])
    assert np.array_equal(bits(got), bits(dequantize_int8(w, scb, "float16").reshape(-1)))
    assert src.stats.tolist() == [2, 3]  # +-70000 overflow; 1e-9 * 100 / 127 flushes to zero
    src.finish()


def test_cli_dry_run_names_the_int8_kind(tmp_path, capsys):
    assert main([str(MODEL), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    hows = {t["name"]: t["how"] for f in plan["files"] for t in f["tensors"]}
    assert hows["model.layers.0.mlp.down_proj.weight"] == "dequant int8 row"
    assert "model.layers.0.mlp.down_proj.SCB" not in hows


def test_cli_refuses_col_formats(tmp_path, capsys):
    q = SafetensorsReader(PEER / "llama_1b_int8.q.safetensors")
    obj = {n: Tensor(np.array(q.array(n))) for n in q.tensors}
    obj["layer.weight_format"] = Tensor(np.array(2, np.uint8))
    path = save_zip(tmp_path / "col.bin", obj)
    assert main([str(path), "--to", "bf16", "-o", str(tmp_path / "o.safetensors"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "BNB-016" in err and "2 (col_turing)" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_missing_scb_is_reported_by_check_and_refused_by_convert(tmp_path, capsys):
    """An int8 model whose SCB tensors were dropped: not copied as raw codes (BNB-020), and check says so."""
    import shutil

    from convert.check import check_source
    from formats.errors import Int8ScaleMissingError
    from tests.helpers.malformed import st_bytes

    src = tmp_path / "m"
    shutil.copytree(MODEL, src)
    q = SafetensorsReader(MODEL / "model.safetensors")
    kept = {n: (q.tensors[n].dtype.code, list(q.tensors[n].shape), bytes(q.raw(n))) for n in q.tensors
            if n != "model.layers.1.self_attn.o_proj.SCB"}
    q.close()
    (src / "model.safetensors").write_bytes(st_bytes(kept, {"format": "pt"}))
    rep = check_source(src)
    assert [p.rule for p in rep.problems] == ["BNB-020"]
    assert rep.problems[0].tensor == "model.layers.1.self_attn.o_proj.weight"
    assert type(rep.problems[0]) is Int8ScaleMissingError
    assert main(["check", str(src)]) == 2
    assert "BNB-020" in capsys.readouterr().out
    out = tmp_path / "o"
    assert main([str(src), "--to", "bf16", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BNB-020" in err and "no SCB row scales" in err and "o_proj.weight'" in err
    assert not out.exists()

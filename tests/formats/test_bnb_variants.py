"""Damaged-looking but valid bnb layers (bnb-format.md section 1): BF16/F16 absmax, a transposed 2-D
absmax (written by bitsandbytes after a CPU forward), and nested_dtype other than float32."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from formats.bnb import BnbLayerError, ConstTensor, QuantizedLayer
from formats.bnb_layers import group_layers
from formats.checkpoint import open_checkpoint
from formats.safetensors import SafetensorsReader
from tests.helpers.bnb import dequant
from tests.helpers.fixtures import FIXTURES, bits
from tests.helpers.torchsave import Tensor, save_zip

FP4 = FIXTURES / "models" / "llama_fp4_nodq"
NF4DQ = FIXTURES / "models" / "llama_nf4_dq"
W = "model.layers.0.mlp.gate_proj.weight"  # (704, 256), blocksize 64: absmax (704 * 4,)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _tensors(model) -> dict[str, ConstTensor]:
    r = SafetensorsReader(model / "model.safetensors")
    return {n: ConstTensor(n, np.array(r.array(n)), str(r.path)) for n in r.tensors if n.startswith(W)}


def _ref(model) -> np.ndarray:
    return SafetensorsReader(model / "reference" / "dequantized.safetensors").array(W)


def _independent(layer: QuantizedLayer, absmax_f32: np.ndarray) -> np.ndarray:
    """bnb-format.md section 2 written out plainly: round(fp32(table[code]) * fp32(absmax))."""
    packed = layer.packed.raw()
    codes = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)[: layer.state.numel]
    vals = layer.quant_map.array()[codes] * absmax_f32[np.arange(codes.size) // layer.state.blocksize]
    return vals.astype(np.float32).astype(BF16).reshape(layer.state.shape)


def _group(t: dict[str, ConstTensor]) -> QuantizedLayer:
    layers, _ = group_layers(t)
    layer = layers[W]
    assert isinstance(layer, QuantizedLayer)
    return layer


def _with_absmax(arr: np.ndarray) -> dict[str, ConstTensor]:
    t = _tensors(FP4)
    t[W + ".absmax"] = ConstTensor(W + ".absmax", arr, "f")
    return t


def test_plain_layer_has_no_warnings():
    layer = _group(_tensors(FP4))
    assert layer.warnings == () and not layer.absmax_transposed
    assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(_ref(FP4)))


def test_transposed_absmax_is_read_in_flat_order():
    flat = _tensors(FP4)[W + ".absmax"].array()
    layer = _group(_with_absmax(flat.reshape(704, 4).T.copy()))  # (K/blocksize, N)
    assert layer.absmax_transposed
    assert len(layer.warnings) == 1 and "(K/blocksize, N)" in layer.warnings[0]
    assert "absmax.T.reshape(-1)" in layer.warnings[0]
    assert np.array_equal(layer.absmax_flat(), flat)
    assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(_ref(FP4)))


def test_row_major_2d_absmax_is_flat_without_warning():
    flat = _tensors(FP4)[W + ".absmax"].array()
    layer = _group(_with_absmax(flat.reshape(704, 4)))
    assert not layer.absmax_transposed and layer.warnings == ()
    assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(_ref(FP4)))


def test_other_2d_absmax_shapes_are_refused():
    flat = _tensors(FP4)[W + ".absmax"].array()
    with pytest.raises(BnbLayerError) as ei:
        _group(_with_absmax(flat.reshape(8, 352)))
    assert ei.value.rule == "BNB-004" and ei.value.tensor == W + ".absmax"
    assert ei.value.expected == "[4, 704]" and ei.value.found == [8, 352]


@pytest.mark.parametrize("dt", [BF16, np.dtype(np.float16)], ids=["bf16", "f16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["flat", "transposed"])
def test_half_precision_absmax_is_upcast_exactly(dt, transposed):
    flat = _tensors(FP4)[W + ".absmax"].array().astype(dt)
    layer = _group(_with_absmax(flat.reshape(704, 4).T.copy() if transposed else flat))
    name = "bfloat16" if dt == BF16 else "float16"
    assert any(f"absmax is stored as {name}" in w for w in layer.warnings)
    assert len(layer.warnings) == 1 + transposed
    want = _independent(layer, flat.astype(np.float32))
    got = dequant(layer, "bfloat16")
    assert np.array_equal(bits(got), bits(want))
    # and close to the fp32-absmax reference
    assert np.allclose(got.astype(np.float32), _ref(FP4).astype(np.float32), rtol=1e-2, atol=1e-3)


def test_nested_dtype_bfloat16_rounds_each_step():
    t = _tensors(NF4DQ)
    key = W + ".quant_state.bitsandbytes__nf4"
    obj = json.loads(bytes(t[key].raw()))
    obj["nested_dtype"] = "bfloat16"
    t[key] = ConstTensor(key, np.frombuffer(json.dumps(obj).encode(), np.uint8), "f")
    nabs_bf16 = t[W + ".nested_absmax"].array().astype(BF16)
    t[W + ".nested_absmax"] = ConstTensor(W + ".nested_absmax", nabs_bf16, "f")
    layer = _group(t)
    assert layer.state.nested_dtype == "bfloat16"
    assert any("nested_dtype is bfloat16" in w for w in layer.warnings)
    assert any("nested_absmax is stored as bfloat16" in w for w in layer.warnings)
    codes = t[W + ".absmax"].array()
    nabs = t[W + ".nested_absmax"].array().astype(np.float32)
    qm = t[W + ".nested_quant_map"].array()
    prod = (qm[codes] * np.repeat(nabs, 256)[: codes.size]).astype(BF16).astype(np.float32)
    off = np.float32(np.float32(obj["nested_offset"]).astype(BF16))
    absmax = (prod + off).astype(BF16).astype(np.float32)
    assert np.array_equal(bits(dequant(layer, "bfloat16")), bits(_independent(layer, absmax)))


def test_cpu_forward_file_through_a_torch_pickle(tmp_path):
    """A .bin as bitsandbytes writes it after a CPU forward: BF16 absmax of shape (K/blocksize, N)."""
    t = _tensors(FP4)
    flat = t[W + ".absmax"].array().astype(BF16)
    obj = {n: Tensor(v.array()) for n, v in t.items()}
    obj[W + ".absmax"] = Tensor(flat.reshape(704, 4).T.copy())
    with open_checkpoint(save_zip(tmp_path / "pytorch_model.bin", obj)) as ckpt:
        layers, plain = group_layers(ckpt.tensors, ckpt.values)
        layer = layers[W]
        assert plain == [] and layer.absmax_transposed and len(layer.warnings) == 2
        got = dequant(layer, "bfloat16")
        assert np.array_equal(bits(got), bits(_independent(layer, flat.astype(np.float32))))

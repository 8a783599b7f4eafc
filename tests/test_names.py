"""The single owners of small facts: bnb's on-disk names (formats.bnb), float dtype names
(formats.dtypes) and byte sizes (convert.units), checked against what bitsandbytes/transformers write."""

from __future__ import annotations

import argparse

import pytest

from convert.units import format_bytes, format_short_of, parse_size
from formats.bnb import component_name, int8_scale_name, is_component, split_component, state_key
from formats.dtypes import float_dtype_name
from tests.helpers.fixtures import MODELS, read_safetensors


def test_bnb_names_match_a_real_transformers_checkpoint() -> None:
    names = set(read_safetensors(MODELS / "llama_nf4_dq" / "model.safetensors"))
    w = "model.layers.0.self_attn.q_proj.weight"
    parts = [component_name(w, c) for c in ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
                                             state_key("nf4"))]
    assert parts[-1] == "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"
    assert {w, *parts} <= names
    assert [split_component(p) for p in parts] == [
        (w, "absmax"), (w, "quant_map"), (w, "nested_absmax"), (w, "nested_quant_map"),
        (w, "quant_state.bitsandbytes__nf4")]
    assert split_component(w) is None and not is_component(w)
    assert all(is_component(p) for p in parts)
    quantized = {n for n in names if split_component(n) is None and component_name(n, "absmax") in names}
    assert w in quantized and "model.embed_tokens.weight" not in quantized


def test_int8_names() -> None:
    assert int8_scale_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.SCB"
    assert is_component("model.layers.0.mlp.up_proj.SCB")
    assert is_component("model.layers.0.mlp.up_proj.weight_format")
    assert not is_component("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize(("value", "name"), [
    ("bfloat16", "bfloat16"), ("torch.float16", "float16"), ("float32", "float32"),
    ("torch.torch.float16", None), ("int8", None), ("fp16", None), (16, None), (None, None)])
def test_float_dtype_name(value: object, name: str | None) -> None:
    assert float_dtype_name(value) == name


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (3 * 2**30 // 2, "1.50 GiB"),
    (5 * 2**40, "5.00 TiB"), (2**60, "1048576.00 TiB"), (-2048, "-2.00 KiB")])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_a_size_short_of_a_limit_never_reads_as_the_limit() -> None:
    """One byte under 160 MiB rounds to '160.00 MiB': the error's "found" says the bytes instead."""
    assert format_short_of((160 << 20) - 1, 160 << 20) == "167772159 B"
    assert format_short_of(150 << 20, 160 << 20) == "150.00 MiB"


@pytest.mark.parametrize(("text", "n"), [
    ("1GiB", 2**30), ("512mib", 512 * 2**20), ("5GB", 5 * 10**9), ("1000000", 10**6), ("1.5KiB", 1536),
    (" 2 Gi ", 2 * 2**30)])
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "1 XB", "-1GiB", "1e9", "9" * 400, "8EiB", "9223372036854775808",
                                  "1.5", "1.5B", "\u0661\u0666\u0660MiB"])  # (a fraction of a byte; not ASCII digits)
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)

"""``--to nf4`` of dense and multimodal classes: the file transformers + bitsandbytes write, byte for byte.

Optional (torch, transformers, bitsandbytes): each class is built tiny on CPU, quantized and saved by
transformers + bnb, and our ``--to nf4`` of its bf16 save must equal that save (weights and config.json)
and load in transformers. Multimodal classes check what the header-only rules must get right beyond a
text model: the vision tower's Linear layers are quantized like the text model's, a SigLIP pooling head's
``nn.MultiheadAttention.out_proj`` (not exactly ``nn.Linear``) stays 16-bit, and every sub-config carries
the model's ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from convert.bnb4.select import multihead_out_projs, should_quantize
from convert.cli import main
from formats.dtypes import BY_NAME
from tests.helpers.tiny_models import DENSE_CLASSES, build


@pytest.mark.parametrize("name", sorted(DENSE_CLASSES))
def test_nf4_equals_transformers_and_bnb(name: str, tmp_path: Path) -> None:
    torch, transformers = build(name, tmp_path)
    assert main([str(tmp_path / "bf16"), "--to", "nf4", "--torch-threads", str(torch.get_num_threads()),
                 "-o", str(tmp_path / "ours"), "-q"]) == 0
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "bnb" / f).read_bytes(), f
    model_cls = getattr(transformers, DENSE_CLASSES[name][1])
    model_cls.from_pretrained(tmp_path / "ours", device_map="cpu")  # no size mismatch, nothing missing


def test_a_multihead_attention_out_proj_stays_16_bit() -> None:
    names = ["vision_tower.vision_model.head.attention.in_proj_weight",
             "vision_tower.vision_model.head.attention.out_proj.weight",
             "vision_tower.vision_model.encoder.layers.0.self_attn.out_proj.weight"]
    mha = multihead_out_projs(names)
    assert mha == {"vision_tower.vision_model.head.attention.out_proj"}
    bf16 = BY_NAME["bfloat16"]
    assert should_quantize(names[1], (64, 64), bf16, mha=mha) == (
        False, "nn.MultiheadAttention's out_proj (transformers keeps it 16-bit)")
    assert should_quantize(names[2], (64, 64), bf16, mha=mha) == (True, "Linear weight")


def test_a_2_d_norm_stays_16_bit() -> None:
    bf16 = BY_NAME["bfloat16"]
    assert should_quantize("model.layers.0.self_attn.q_norm.weight", (4, 64), bf16) == (
        False, "a norm (not an nn.Linear)")

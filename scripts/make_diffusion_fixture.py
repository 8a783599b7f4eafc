"""Make the tiny diffusion single-file checkpoint fixture, shaped as Forge / ComfyUI share Flux NF4 files.

    python scripts/make_diffusion_fixture.py [OUT_DIR]     (default: tests/fixtures/diffusion)

What such a file is: one ``.safetensors`` with no config.json beside it; the diffusion transformer's
Linear weights as bitsandbytes NF4 layers (``W``, ``W.absmax``, ``W.quant_map``, ``W.nested_absmax``,
``W.nested_quant_map``, ``W.quant_state.bitsandbytes__nf4``: the companions transformers writes) under
the original, non-transformers names (``double_blocks.0.img_attn.qkv.weight``, ...); biases, norms and
embedders in bf16; text encoders stored as ``F8_E4M3`` / ``F8_E5M2``, with ``I64`` position ids; a VAE
in bf16, and a ``BOOL`` mask.

How it is made: a float checkpoint of that shape (seeded N(0, 0.02) values, written with
:mod:`formats.safetensors`) is re-quantized by convert-bnb's own ``--to nf4`` writer, whose layers are
byte-identical to ``bitsandbytes.functional.quantize_4bit`` + transformers' serialization (tests/bnb4/test_requant.py
checks that against files bitsandbytes wrote), with the text encoders and the VAE kept as they are
(``--skip-modules``). Writes:

- ``flux_tiny_bf16.safetensors``: the float checkpoint (the reference: every tensor that is not a 4-bit
  layer must come back from the NF4 file byte for byte);
- ``flux_tiny_nf4.safetensors``: the NF4 file the tests convert.

The output is deterministic (fixed seed, fixed order): running the script again gives the same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from convert.job import convert  # noqa: E402
from convert.options import ConvertOptions, QuantOptions  # noqa: E402
from formats.dtypes import BY_NAME  # noqa: E402
from formats.safetensors import SafetensorsWriter  # noqa: E402

HIDDEN = 64
#: (name, numpy dtype name, shape) in file order: a Flux transformer's kinds of tensors, tiny.
TENSORS: list[tuple[str, str, tuple[int, ...]]] = [
    ("img_in.weight", "bfloat16", (HIDDEN, 16)),
    ("img_in.bias", "bfloat16", (HIDDEN,)),
    ("time_in.in_layer.weight", "bfloat16", (HIDDEN, 32)),
    ("time_in.in_layer.bias", "bfloat16", (HIDDEN,)),
    ("double_blocks.0.img_attn.qkv.weight", "bfloat16", (3 * HIDDEN, HIDDEN)),
    ("double_blocks.0.img_attn.qkv.bias", "bfloat16", (3 * HIDDEN,)),
    ("double_blocks.0.img_attn.norm.query_norm.scale", "bfloat16", (16,)),
    ("double_blocks.0.img_attn.proj.weight", "bfloat16", (HIDDEN, HIDDEN)),
    ("double_blocks.0.img_mlp.0.weight", "bfloat16", (4 * HIDDEN, HIDDEN)),
    ("double_blocks.0.img_mlp.2.weight", "bfloat16", (HIDDEN, 4 * HIDDEN)),
    ("double_blocks.0.img_mod.lin.weight", "bfloat16", (6 * HIDDEN, HIDDEN)),
    ("single_blocks.0.linear1.weight", "bfloat16", (7 * HIDDEN, HIDDEN)),
    ("single_blocks.0.linear2.weight", "bfloat16", (HIDDEN, 5 * HIDDEN)),
    ("single_blocks.0.modulation.lin.weight", "bfloat16", (3 * HIDDEN, HIDDEN)),
    ("final_layer.linear.weight", "bfloat16", (16, HIDDEN)),
    ("final_layer.adaLN_modulation.1.weight", "bfloat16", (2 * HIDDEN, HIDDEN)),
    # text encoders, stored in 8-bit floats (as the fp8 T5 / CLIP shipped with Flux all-in-one files)
    ("text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight", "float8_e4m3fn", (32, 32)),
    ("text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.k.weight", "float8_e4m3fn", (32, 32)),
    ("text_encoders.t5xxl.transformer.shared.weight", "float8_e4m3fn", (100, 32)),
    ("text_encoders.clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight", "float8_e5m2", (64, 32)),
    ("text_encoders.clip_l.transformer.text_model.embeddings.position_ids", "int64", (1, 77)),
    ("text_encoders.clip_l.transformer.text_model.attention_mask", "bool", (8, 8)),
    ("vae.decoder.conv_in.weight", "bfloat16", (32, 16, 3, 3)),
    ("vae.decoder.conv_in.bias", "bfloat16", (32,)),
]
#: Kept as they are by the NF4 conversion (as Forge keeps text encoders and VAE).
SKIP = ("text_encoders", "vae")


def _values(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "int64":
        return np.arange(n, dtype=np.int64).reshape(shape)
    if dtype == "bool":
        return (np.tril(np.ones(shape)) > 0).reshape(shape)
    x = rng.normal(0.0, 0.02, n).astype(np.float32)
    if dtype == "float8_e4m3fn":
        x = x * 20.0  # fp8 weights are stored scaled into the format's range
    return x.astype(getattr(ml_dtypes, dtype) if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
                    else np.dtype(dtype)).reshape(shape)


def make(out_dir: Path) -> tuple[Path, Path]:
    """Write the float reference and the NF4 file into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261201)
    base = out_dir / "flux_tiny_bf16.safetensors"
    nf4 = out_dir / "flux_tiny_nf4.safetensors"
    for p in (base, nf4):
        p.unlink(missing_ok=True)
    values = [(name, _values(rng, dt, shape)) for name, dt, shape in TENSORS]
    writer = SafetensorsWriter(base, [(n, BY_NAME[str(v.dtype)], v.shape) for n, v in values], {"format": "pt"})
    for _, v in values:
        writer.write(np.ascontiguousarray(v))
    writer.close()
    convert(ConvertOptions(src=str(base), to="nf4", output=nf4, threads=1,
                           quant=QuantOptions(skip_modules=SKIP)))
    return base, nf4


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "fixtures" / "diffusion"
    for p in make(target):
        print(f"{p} ({p.stat().st_size} bytes)")

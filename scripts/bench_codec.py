#!/usr/bin/env python3
"""Time one GGML encoder, ours against llama.cpp's, as whole processes for ``farm-bench``.

``codec``: quantize a float32 matrix (default 4096 x 4096, N(0, 0.02), seed 0) once, with our NumPy codec
(``--impl ours``) or with ``ggml_quantize_chunk`` of the libggml-base.so llama-cpp-python installs
(``--impl ggml``, one thread, the function llama-quantize calls); ``--imatrix`` gives both the same
importance-matrix row (``llama-quantize --imatrix``'s path).

``model``: a one-block Llama of 7B widths (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008,
vocabulary 256, float32; made once in ``--dir``), written as a GGUF file of the type: ``--impl ours``
is ``convert-bnb DIR --to gguf:TYPE --threads N`` from the float32 safetensors, ``--impl llama`` is
``llama_model_quantize`` (``nthread`` N) of our ``gguf:f32`` of it, as llama-quantize runs.

    farm-bench -n 3 --vs 'python scripts/bench_codec.py codec --type iq4_xs --impl ggml' -- \\
        python scripts/bench_codec.py codec --type iq4_xs --impl ours
    python scripts/bench_codec.py make --dir bench-data/iq
    farm-bench -n 3 --timeout 900 --vs 'python scripts/bench_codec.py model --dir bench-data/iq --type iq4_xs \\
        --impl llama --threads 2' -- python scripts/bench_codec.py model --dir bench-data/iq --type iq4_xs \\
        --impl ours --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: The block's matrices (rows, columns) at 7B widths.
SHAPES = {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (4096, 4096), "self_attn.v_proj": (4096, 4096),
          "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (11008, 4096), "mlp.up_proj": (11008, 4096),
          "mlp.down_proj": (4096, 11008)}


def _ggml() -> ctypes.CDLL:
    """libggml-base.so of the installed llama_cpp package, ``ggml_quantize_chunk`` typed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise SystemExit("llama_cpp (llama-cpp-python) is not installed")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(spec.origin), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def codec(type_name: str, impl: str, rows: int, cols: int, imatrix: bool = False) -> None:
    t = gguf.GGMLQuantizationType[type_name.upper()]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02))
    # an importance row as llama-imatrix gives it: means of squared activations, log-normal across columns
    w = np.exp(rng.standard_normal(cols)).astype(np.float32) if imatrix else None
    if impl == "ours":
        from convert.gguf.codecs import codec as ours

        ours(t).quantize(x, w)
    else:
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        out = np.empty((rows, cols // bs * ts), np.uint8)
        _ggml().ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, rows, cols,
                                    None if w is None else w.ctypes.data)


def make(d: Path) -> None:
    """The one-block float32 Llama in ``d/model`` (safetensors, config, the fixture's tokenizer) and our gguf:f32
    of it, ``d/f32.gguf``."""
    import shutil

    from safetensors.numpy import save_file

    fixture = ROOT / "tests" / "fixtures" / "models" / "llama_nf4_dq"
    src = d / "model"
    src.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.model", "tokenizer_config.json", "tokenizer.json"):
        shutil.copy(fixture / f, src / f)
    cfg = json.loads((fixture / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.update(num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=32, hidden_size=4096,
               intermediate_size=11008, head_dim=128, vocab_size=1000, tie_word_embeddings=False, dtype="float32")
    (src / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    w = {f"model.layers.0.{k}.weight": rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
         for k, s in SHAPES.items()}
    w |= {"model.embed_tokens.weight": rng.standard_normal((1000, 4096), dtype=np.float32) * np.float32(0.02),
          "lm_head.weight": rng.standard_normal((1000, 4096), dtype=np.float32) * np.float32(0.02),
          "model.layers.0.input_layernorm.weight": np.ones(4096, np.float32),
          "model.layers.0.post_attention_layernorm.weight": np.ones(4096, np.float32),
          "model.norm.weight": np.ones(4096, np.float32)}
    save_file(w, str(src / "model.safetensors"), metadata={"format": "pt"})
    subprocess.run([sys.executable, "-m", "convert", str(src), "--to", "gguf:f32", "-o", str(d / "f32.gguf"), "-q",
                    "--overwrite"], cwd=ROOT, check=True)


def model(d: Path, type_name: str, impl: str, threads: int) -> None:
    out = d / f"{impl}-{type_name}.gguf"
    if impl == "ours":
        subprocess.run([sys.executable, "-m", "convert", str(d / "model"), "--to", f"gguf:{type_name}", "-o",
                        str(out), "-q", "--overwrite", "--threads", str(threads)], cwd=ROOT, check=True)
        return
    import llama_cpp

    from convert.gguf.types import OUTPUT_TYPES

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = int(OUTPUT_TYPES[type_name][1])
    if llama_cpp.llama_model_quantize(str(d / "f32.gguf").encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit("llama_model_quantize failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("codec")
    c.add_argument("--type", required=True)
    c.add_argument("--impl", choices=["ours", "ggml"], required=True)
    c.add_argument("--rows", type=int, default=4096)
    c.add_argument("--cols", type=int, default=4096)
    c.add_argument("--imatrix", action="store_true", help="with an importance-matrix row (log-normal)")
    m = sub.add_parser("make")
    m.add_argument("--dir", type=Path, required=True)
    r = sub.add_parser("model")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--type", required=True)
    r.add_argument("--impl", choices=["ours", "llama"], required=True)
    r.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.cmd == "codec":
        codec(a.type, a.impl, a.rows, a.cols, a.imatrix)
    elif a.cmd == "make":
        make(a.dir)
    else:
        model(a.dir, a.type, a.impl, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

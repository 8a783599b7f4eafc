"""bitsandbytes -> float numerics, pure NumPy, bit-exact with bitsandbytes: no I/O, nothing of ``convert``.

- :mod:`~convert.dequant.products`: what the 4-bit kernels share (the quad table, the fp32 products);
- :mod:`~convert.dequant.kernels`: 4-bit, nested absmax and LLM.int8 dequantization, rounding;
- :mod:`~convert.dequant.kernels_f16`: float16 output (integer rounding routes, tables, bf16 -> fp16);
- :mod:`~convert.dequant.block_reduce`: per-block maxima of bit patterns (used by the encoders too).
"""

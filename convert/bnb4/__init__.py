"""``--to nf4|fp4``: any float model (or bnb checkpoint, merges applied) re-quantized in bitsandbytes'
layout, byte-identical to what transformers + bitsandbytes save.

- :mod:`~convert.bnb4.target`: :class:`~convert.bnb4.target.Bnb4Job`, the target's job;
- :mod:`~convert.bnb4.plan`: the dequantization plan -> the 4-bit plan (which tensors, in which order);
- :mod:`~convert.bnb4.select`: which modules transformers + bnb quantize, the ``quantization_config``;
- :mod:`~convert.bnb4.settings`: quant type, blocksize, double quantization, storage dtype;
- :mod:`~convert.bnb4.encode`: the NF4/FP4 codec (:class:`~convert.bnb4.encode.Bnb4Codec`), pure NumPy;
- :mod:`~convert.bnb4.absmax8`, :mod:`~convert.bnb4.torch_reduce`: nested 8-bit absmax, torch's sum order;
- :mod:`~convert.bnb4.passes`, :mod:`~convert.bnb4.sources`: the passes over a weight under the memory
  cap and the stream sources of its tensors;
- :mod:`~convert.bnb4.layer`: one weight quantized in memory (the reference); :mod:`~convert.bnb4.report`:
  what the quantization cost.
"""

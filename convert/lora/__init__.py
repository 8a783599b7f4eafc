"""``--merge-lora``: PEFT LoRA adapters merged into the dequantized weights as they stream, bit-exact with
PEFT's ``merge_and_unload``.

- :mod:`~convert.lora.apply`: the adapters into a plan (each merged tensor a stream source);
- :mod:`~convert.lora.plan`: which adapter changes which base tensor, and how (:class:`~convert.lora.ops.MergeOp`);
- :mod:`~convert.lora.delta`: the per-tensor LoRA / DoRA delta by row ranges;
- :mod:`~convert.lora.report`: the merge report.
"""

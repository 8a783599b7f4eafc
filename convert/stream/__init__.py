"""What every target streams: the float plan, the sources that make its tensors, and the one ordered,
bounded chunk loop.

- :mod:`~convert.stream.plan`: an opened checkpoint -> the planned output tensors, shards, config;
- :mod:`~convert.stream.sources`: what makes each tensor's values, chunk by chunk;
- :mod:`~convert.stream.pipeline`: run settings, chunk sizing under the memory cap,
  :func:`~convert.stream.pipeline.ordered_chunks` (the loop every writer runs);
- :mod:`~convert.stream.safetensors_job`: a plan written as safetensors (``--to auto|bf16|fp16|fp32``).
"""

"""convert-bnb's container formats: one module per format (safetensors, bnb layout, checkpoint
discovery, ...), with readers that validate headers and hand out zero-copy memory-mapped views,
and streaming writers. Never imports :mod:`convert`.
"""

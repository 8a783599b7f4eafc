"""``--to nf4|fp4``: re-quantization in bitsandbytes' layout."""

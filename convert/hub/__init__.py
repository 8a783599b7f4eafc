"""Hugging Face Hub repos as SRC.

- :mod:`~convert.hub.repo`: repo id syntax, and which exceptions are the Hub's;
- :mod:`~convert.hub.download`: what a conversion needs of a repo, into the HF cache (or a low-disk
  folder), the disk pre-flight, the cached snapshot when the Hub cannot be reached;
- :mod:`~convert.hub.shards`: safetensors weights read in place (headers over HTTP, one shard at a time).
"""

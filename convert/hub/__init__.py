"""Hugging Face Hub repos as SRC: repo ids, downloads, remote shards."""

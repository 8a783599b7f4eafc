"""``--to gguf[:TYPE]``: GGUF files for llama.cpp."""

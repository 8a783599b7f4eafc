"""Tests of convert/gguf/codecs/: the GGML block encoders."""

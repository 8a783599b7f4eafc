"""Tests of convert/gguf/: GGUF output."""

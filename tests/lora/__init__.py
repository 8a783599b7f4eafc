"""Tests of convert/lora/: merging LoRA adapters."""

"""Tests of convert/dequant/: 4-bit and int8 dequantization."""

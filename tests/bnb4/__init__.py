"""Tests of convert/bnb4/: quantizing to bitsandbytes NF4/FP4."""

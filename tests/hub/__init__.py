"""Tests of convert/hub/: Hugging Face Hub input."""

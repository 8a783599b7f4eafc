"""Tests of convert/stream/."""

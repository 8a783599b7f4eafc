"""Tests of convert/batch/: ``convert-bnb batch``."""

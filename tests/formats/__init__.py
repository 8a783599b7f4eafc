"""Tests of formats/: the readers and writers of each file format."""

"""Helpers shared by the test modules: fixture paths, readers, fakes and sources."""

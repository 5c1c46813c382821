"""Tests of blockdraft.data (a package, so this conftest does not shadow tests/conftest.py)."""

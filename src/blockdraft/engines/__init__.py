"""Serving engines run from blockdraft (optional installs, imported lazily)."""

"""Drafter checkpoints: native save/load (format conversion tables live beside it)."""

from .native import load_drafter, save_drafter

__all__ = ["load_drafter", "save_drafter"]

"""The drafter (clauses 2, 4, 5). Never imports train/ or generate/."""

from ..config import DrafterConfig
from .attention import BlockLayout
from .drafter import DFlashDrafter

__all__ = ["DrafterConfig", "DFlashDrafter", "BlockLayout"]

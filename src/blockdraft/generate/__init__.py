"""Speculative generation with a DFlash drafter (clause 8)."""

from .acceptance import accept_greedy, accept_sampled, sampling_probs
from .speculative import GenerationResult, speculative_generate

__all__ = ["GenerationResult", "accept_greedy", "accept_sampled", "sampling_probs", "speculative_generate"]

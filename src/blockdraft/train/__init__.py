"""Training: anchors (clause 6), loss and metrics (clause 7), the training step."""

from .anchors import eligible_anchors, sample_anchors
from .loss import accepted_lengths, default_gamma, dflash_loss, slot_weights
from .step import Batch, compute_loss, prepare, train_step

__all__ = ["Batch", "accepted_lengths", "compute_loss", "default_gamma", "dflash_loss", "eligible_anchors",
           "prepare", "sample_anchors", "slot_weights", "train_step"]

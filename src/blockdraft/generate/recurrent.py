"""Rolling back a target cache with recurrent layers after a rejected draft (clause 8 on hybrids).

Legend: L committed tokens before a verify step, b tokens verified, m accepted drafts.

transformers' cache crop (5.24) rolls back attention K/V, and with past recording the
convolution states of Mamba / Gated DeltaNet layers, but leaves their recurrent state as the
verify forward left it: folded over all b verified tokens, rejected ones included. The next
step then reads a state the target never has on its own text and generation departs from the
target's greedy decoding (measured: tests/generate/test_generate.py; a crop-only loop departs
within ~25 tokens on tiny Qwen3-Next, Qwen3.5, Nemotron-H and Falcon-H1 targets).

`RecurrentRollback` keeps a copy of those layers' states from before each verify. When every
verified token is kept nothing is restored; otherwise the copy is put back, the attention layers
are cropped to the tokens before the block, and the kept m + 1 tokens are run through the target
again (one more forward of m + 1 tokens), which moves every state exactly as the target's own
decoding of those tokens does. Re-running the whole committed text instead (no copies) measured
slower from short contexts on (benchmarks/recurrent_rollback.py).
"""

from __future__ import annotations

import torch


def recurrent_layers(cache) -> list:
    """The cache layers that hold conv / recurrent states (transformers' LinearAttention layers)."""
    return [layer for layer in getattr(cache, "layers", []) if hasattr(layer, "recurrent_states")]


class RecurrentRollback:
    """Snapshot-and-restore of a cache's recurrent layers around one verify forward."""

    def __init__(self, target, cache):
        self.target, self.cache = target, cache
        self.layers = recurrent_layers(cache)
        self.saved = None
        self.reruns = 0  # verify steps that needed the kept tokens run again

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def save(self) -> None:
        """Copy the conv and recurrent states as they are before a verify forward."""
        if not self.layers:
            return
        self.saved = [({i: _clone(s) for i, s in layer.conv_states.items()},
                       {i: _clone(s) for i, s in layer.recurrent_states.items()},
                       dict(layer.has_previous_state)) for layer in self.layers]

    def keep(self, length: int, block: torch.Tensor, kept: int) -> None:
        """After a verify of `block` (b tokens at positions length - kept .. ): keep the first `kept`
        of them, i.e. `length` tokens in all. Attention layers are cropped; recurrent layers are
        restored and run over the kept tokens again unless all b were kept."""
        b = int(block.shape[0])
        if not self.layers or kept >= b:
            self.target.crop_cache(self.cache, length)
            return
        start = length - kept  # position of the block's first token
        self.target.crop_cache(self.cache, start)  # attention back to before the block (conv states are restored)
        for layer, (conv, rec, prev) in zip(self.layers, self.saved):
            layer.conv_states.update(conv)
            layer.recurrent_states.update(rec)
            layer.has_previous_state.update(prev)
        if kept > 0:
            pos = torch.arange(start, length, device=block.device)[None]
            t = self.target
            t.model(input_ids=block[None, :kept], position_ids=pos, use_cache=True, logits_to_keep=1,
                    **{t._cache_kwarg(): self.cache})
            self.reruns += 1


def _clone(t):
    return None if t is None else t.clone()

"""Rolling back a target cache with recurrent layers after a rejected draft (clause 8 on hybrids).

Legend: b tokens verified in one forward, kept of them committed.

A Mamba / Gated DeltaNet layer folds every verified token into its state, rejected ones included.
Cropping attention K/V is not enough: the next step would read a state the target never has on
its own text, and generation departs from the target's greedy decoding (measured: a crop that
leaves the state alone departs within ~25 tokens on tiny Qwen3-Next, Qwen3.5, Nemotron-H and
Falcon-H1 targets, tests/generate/test_generate.py).

Since transformers 5.25 a cache that records its past keeps, per recurrent layer, the state before
a forward and after each of its first `recurrent_states_to_keep - 1` tokens, and its crop puts back
the one the kept tokens end on (conv states as well). `TargetModel.new_cache(rollback=B)` asks for
B states, the longest verify. Nothing is copied or run again (blockdraft's own snapshot and
re-run of the kept tokens, which older transformers needed, cost one more target forward per
rejected step: benchmarks/recurrent_rollback.py).

`RecurrentRollback` checks, before each crop, that the forward recorded the states the crop reads:
a model whose forward ignores the request would otherwise be restored to a wrong state silently.
The cache is cropped after every forward (the prefill included), so what a layer recorded is
exactly what the last forward left.
"""

from __future__ import annotations

import torch

MIN_TRANSFORMERS = "5.25"  # the first with recurrent_states_to_keep


def recurrent_layers(cache) -> list:
    """The cache layers that hold conv / recurrent states (transformers' LinearAttention layers)."""
    return [layer for layer in getattr(cache, "layers", []) if hasattr(layer, "recurrent_states")]


class RecurrentRollback:
    """The crop after one verify forward, for a cache that may hold recurrent layers."""

    def __init__(self, target, cache):
        self.target, self.cache = target, cache
        self.layers = recurrent_layers(cache)
        if self.layers and not all(hasattr(layer, "recurrent_states_history")
                                   and getattr(layer, "recurrent_states_to_keep", 0) for layer in self.layers):
            import transformers

            raise RuntimeError(
                f"{type(target.model).__name__} has recurrent layers, and transformers {transformers.__version__}'s "
                f"cache cannot take rejected drafts out of them: install transformers>={MIN_TRANSFORMERS} and "
                "make the cache with TargetModel.new_cache(rollback=block_size)")

    def keep(self, length: int, block: torch.Tensor, kept: int) -> None:
        """After a verify of `block` (b tokens at positions length - kept .. ): keep the first `kept`
        of them, i.e. `length` tokens in all, attention and recurrent layers alike."""
        b = int(block.shape[0])
        if kept < b:
            self._check_recorded(b)
        self.target.crop_cache(self.cache, length)

    def _check_recorded(self, b: int) -> None:
        """Each recurrent state's record holds what the verify of b tokens left: the state before it
        and after each of its first b - 1 tokens."""
        for layer in self.layers:
            for i, ready in layer.is_recurrent_states_initialized.items():
                if ready and len(layer.recurrent_states_history[i]) < b:
                    raise RuntimeError(
                        f"{type(self.target.model).__name__}'s forward recorded {len(layer.recurrent_states_history[i])}"
                        f" recurrent states for a {b}-token verify (transformers' recurrent_states_to_keep): "
                        "its rejected drafts cannot be rolled back")

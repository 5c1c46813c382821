"""Drafts copied from the text so far (prompt lookup), as a second proposer beside the drafter.

A model's output often repeats its prompt or itself (numbers restated in a word problem, names
in code). When the last n tokens (n = max_n down to 1) occurred earlier, the tokens that followed
their latest earlier occurrence are a cheap draft. They are verified like any other draft, so the
output is unchanged; for sampling the draft distribution is one-hot on the copied token.
"""

from __future__ import annotations


class NgramIndex:
    """The sequence so far and, for n = 1..max_n, where each n-gram last ended.

    Only n-grams ending before the last token are indexed, so a lookup never finds the sequence's
    own suffix; the index grows incrementally (each position is indexed once)."""

    def __init__(self, tokens: list[int], max_n: int = 3):
        if max_n < 1:
            raise ValueError(f"the lookup n-gram length must be >= 1, got {max_n}")
        self.max_n = max_n
        self.seq: list[int] = list(tokens)
        self._last_end: list[dict[tuple, int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # n-grams ending at positions < this are in the tables

    def extend(self, tokens: list[int]) -> None:
        self.seq.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix (max_n tokens first); [] when not even the last token occurred before."""
        seq, L = self.seq, len(self.seq)
        for end in range(self._indexed, L - 1):
            for n in range(1, min(self.max_n, end + 1) + 1):
                self._last_end[n][tuple(seq[end - n + 1:end + 1])] = end
        self._indexed = L - 1
        if k <= 0:
            return []
        for n in range(min(self.max_n, L), 0, -1):
            end = self._last_end[n].get(tuple(seq[L - n:]))
            if end is not None:
                return seq[end + 1:end + 1 + k]
        return []

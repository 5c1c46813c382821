"""Whether a drafter fits a target: the one compatibility check used by train, generate and doctor."""

from __future__ import annotations


def pair_problems(target, drafter) -> list[str]:
    """What differs between the target a drafter was trained for and this one (empty: they fit)."""
    c = drafter.config
    problems = []
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"hidden size {c.target_hidden_size} vs target {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {c.vocab_size} vs target {target.vocab_size}")
    if c.target_num_layers != target.num_layers:
        problems.append(f"{c.target_num_layers} target layers vs {target.num_layers}")
    if list(c.target_layer_ids) != list(target.layer_ids):
        problems.append(f"feature layers {c.target_layer_ids} vs the target's hooks {target.layer_ids}")
    if c.tokenizer_hash and target.tokenizer_hash and c.tokenizer_hash != target.tokenizer_hash:
        problems.append("tokenizer differs")
    return problems


def check_pair(target, drafter) -> None:
    """A drafter trained for another target is refused with the mismatch named."""
    problems = pair_problems(target, drafter)
    if problems:
        raise ValueError("this drafter was trained for another target: " + "; ".join(problems))

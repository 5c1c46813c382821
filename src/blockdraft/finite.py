"""Non-finite values (NaN, +-Inf) found and named where they would otherwise pass on silently: a
drafter's weights (saved, exported, checked by doctor), the features a cache hands training, a
step's loss and gradient norm, and every record written as JSON (`json.dumps` writes a bare
`NaN`, which no JSON reader accepts).

Each check is a one-line ValueError naming what was not finite and where (the tensor, the cache
shard and row, the step), or, in doctor, a FAIL line.
"""

from __future__ import annotations

import json
import math

import torch


def count(t: torch.Tensor) -> str:
    """'' for a finite tensor, else e.g. '3 NaN, 1 Inf of 4096'."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return ""
    bad = int((~torch.isfinite(t)).sum())
    nan = int(torch.isnan(t).sum())
    parts = [f"{nan} NaN"] * bool(nan) + [f"{bad - nan} Inf"] * bool(bad - nan)
    return f"{', '.join(parts)} of {t.numel()}"


def nonfinite(named: dict) -> list[str]:
    """'name (3 NaN of 4096)' for each floating-point tensor of `named` holding a non-finite value."""
    out = []
    for name, t in named.items():
        found = count(t.detach()) if torch.is_tensor(t) else ""
        if found:
            out.append(f"{name} ({found})")
    return out


def require_finite(named: dict, what: str, fix: str = "") -> None:
    """ValueError naming the non-finite tensors of `named` (what: 'the drafter to save in DIR', ...)
    and, if given, what to do."""
    bad = nonfinite(named)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{what}: non-finite values in {', '.join(bad[:3])}{more}" + (f"; {fix}" if fix else ""))


def _leaves(obj, path: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def dumps_finite(record, what: str, **kw) -> str:
    """`json.dumps(record, allow_nan=False)`, or a ValueError naming the non-finite entries."""
    try:
        return json.dumps(record, allow_nan=False, **kw)
    except ValueError:
        bad = [f"{k} = {v}" for k, v in _leaves(record) if isinstance(v, float) and not math.isfinite(v)]
        raise ValueError(f"{what}: {', '.join(bad[:4]) or 'a value'} is not finite (a record must be valid JSON)") \
            from None


def check_step(step: int, loss: float, grad_norm: float, rows: list[int]) -> None:
    """A step whose loss or gradient is not finite stops the run before the optimizer applies it."""
    for name, v in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(v):
            shown = ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")
            raise ValueError(f"step {step}: the {name} is {v} (rows {shown} of this rank's micro-batches); the step "
                             "was not applied: check those rows' data or features, or lower --lr, then --resume")


# ---------------------------------------------------------------------------------------- doctor
def check_weights(drafter):
    """doctor: every weight of the drafter is finite."""
    from .doctor import FAIL, PASS, Check

    sd = drafter.state_dict()
    bad = nonfinite(sd)
    if bad:
        return Check("finite weights", FAIL, f"{len(bad)} tensors hold non-finite values: {', '.join(bad[:3])}"
                     + (" ..." if len(bad) > 3 else ""), "the checkpoint is damaged or its training diverged: "
                     "retrain (or resume from an earlier checkpoint with a lower --lr)")
    return Check("finite weights", PASS, f"all {sum(t.numel() for t in sd.values()):,} values of {len(sd)} tensors "
                 "are finite")


@torch.no_grad()
def check_logits(target, drafter, sample_ids: torch.Tensor):
    """doctor: the drafter's logits on the check batch (and the target features they come from) are finite."""
    from .doctor import FAIL, PASS, Check
    from .train import Batch, prepare

    ids = sample_ids[:, : max(drafter.block_size + 2, min(sample_ids.shape[1], 256))]
    p = prepare(target, drafter, Batch(ids, torch.ones_like(ids)), max_anchors=32,
                generator=torch.Generator().manual_seed(0))
    dt = drafter.fc.weight.dtype
    found = {"target features": count(p.features)}
    if not found["target features"]:
        hidden = drafter(p.features.to(dt), p.block_embeds.to(dt), p.layout)  # [N, B, Hd]
        found["drafter logits"] = count(target.head(hidden.to(target.dtype), drafter.vocab_rows))
    bad = [f"{k} ({v})" for k, v in found.items() if v]
    if bad:
        return Check("finite logits", FAIL, f"non-finite values on the check batch: {', '.join(bad)}",
                     "non-finite weights (see 'finite weights') or a target that overflows in its dtype")
    return Check("finite logits", PASS, f"the drafter's logits on {p.anchors.numel()} check blocks are finite")

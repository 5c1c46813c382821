"""Non-finite values (NaN, +-Inf) found and named where they would otherwise pass on silently: a
drafter's weights (saved, exported, checked by doctor), the features a cache hands training, a
step's loss and gradient norm, and every record written as JSON (`json.dumps` writes a bare
`NaN`, which no JSON reader accepts).

Each check is a one-line ValueError naming what was not finite and where (the tensor, the cache
shard and row, the step); doctor's "finite weights" and "finite logits" lines read `nonfinite` and
`count`. A low module: it imports nothing of blockdraft.
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

"""Linear layers for the few-row products of drafting, decoding and verification.

Not a different function: `few_rows_linear` equals `F.linear` up to float rounding; it only picks
a faster CPU kernel for 1-8 input rows. Both the target and the drafter route their `nn.Linear`
layers through it (`use_few_rows_linears`), so a baseline decode and a speculative step share it.
"""

from __future__ import annotations

import torch
from torch import nn


def few_rows_limit() -> int:
    """Most input rows for which `few_rows_linear` takes its own path: 4 on one thread, 8 on more
    (measured on SmolLM2's layers; past that MKL's own product is as fast or faster)."""
    return 4 if torch.get_num_threads() == 1 else 8


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for the 1-8 row products of decoding and verification, faster on the CPU.

    For so few rows MKL's fp32 `x @ W.T` is slow: one row goes to a GEMV that uses a single
    thread, 2-8 rows to a GEMM that packs the whole weight on every call. `W @ x.T` with `x`
    contiguous reads each weight once, on every thread (SmolLM2 on 2 threads: a decode step
    39 -> 24 ms, a 2-token verify 64 -> 27 ms; `benchmarks/verify_step.py`). A single row is
    doubled, since the two-row product beats the GEMV. The output is made contiguous: a transposed
    view would reach the next layer as a transposed input and lose the gain there."""
    n = x.numel() // max(1, x.shape[-1])
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not 0 < n <= few_rows_limit()):
        return nn.functional.linear(x, weight, bias)
    rows = x.reshape(n, x.shape[-1]).contiguous()
    if n == 1:
        rows = torch.cat([rows, rows])
    y = (weight @ rows.T).T[:n].contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` whose forward is `few_rows_linear` (same weights, same results up to float
    rounding). Swapped in by class, so copies and pickles of the model stay self-contained."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias)


def use_few_rows_linears(model: nn.Module) -> int:
    """Route every plain `nn.Linear` of a model through `few_rows_linear`; layers behind
    accelerate's dispatch hooks keep their own forward. Returns how many were routed."""
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear and not hasattr(m, "_hf_hook"):
            m.__class__ = FewRowsLinear
            count += 1
    return count

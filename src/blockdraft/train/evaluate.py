"""Held-out evaluation (clause 7's figures on rows no step trained on), at training's precision,
its batches split across the ranks and summed in one collective.

Legend: R held-out packed rows, B block size.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from .distributed import all_reduce_sum, world
from .train_options import TrainConfig
from .step import Batch, compute_loss


def rows_batch(rows: dict, idx: torch.Tensor) -> Batch:
    return Batch(rows["input_ids"][idx], rows["loss_mask"][idx], rows["position_ids"][idx],
                 rows["document_ids"][idx])


def autocast_for(device: torch.device | str):
    """The precision training runs at, and evaluation with it: bf16 autocast on CUDA, none elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def usable_rows(rows: dict, idx: torch.Tensor, block_size: int) -> bool:
    """Whether these rows can give a block to learn (a loss-mask token with a supervised slot after
    it in its document), checked on the host before anything runs."""
    from .anchors import eligible_anchors

    for r in idx.tolist():
        if eligible_anchors(rows["document_ids"][r], rows["loss_mask"][r], block_size).any():
            return True
    return False


def eval_batches(rows: dict, rows_per_batch: int, block_size: int) -> list[torch.Tensor]:
    """The held-out micro-batches (row indices) that have something to learn."""
    R = rows["input_ids"].shape[0]
    out = [torch.arange(s, min(R, s + rows_per_batch)) for s in range(0, R, rows_per_batch)]
    return [idx for idx in out if usable_rows(rows, idx, block_size)]


def eval_order(rows: dict, rows_per_batch: int, block_size: int, *, collective_forward: bool = False
               ) -> list[tuple[int, torch.Tensor, bool]]:
    """This rank's held-out forwards in the order `evaluate` runs them: (batch number, rows, counted).
    Every rank takes batches rank, rank + W, ...; with `collective_forward` (a sharded drafter or target,
    whose forward is itself a collective) every rank runs the same number of forwards, the last ones
    repeated and not counted."""
    rank, W = world()
    batches = eval_batches(rows, rows_per_batch, block_size)
    mine = list(range(rank, len(batches), W))
    n_runs = math.ceil(len(batches) / W) if collective_forward else len(mine)
    out = []
    for i in range(n_runs):
        if not mine:
            if not batches:
                break
            out.append((0, batches[0], False))  # this rank has no batch: one for the collective's sake
        else:
            k = mine[i] if i < len(mine) else mine[-1]
            out.append((k, batches[k], i < len(mine)))
    return out


@torch.no_grad()
def evaluate(target, drafter, rows: dict, cfg: TrainConfig, rows_per_batch: int, features=None, *,
             collective_forward: bool = False) -> dict:
    """Held-out loss, exact mean accepted length (tau) and per-slot accuracy, with fixed anchors
    (batch k's from seed 12345 + k), at training's precision.

    Under torch.distributed every rank evaluates its share of the batches (k = rank, rank + W, ...)
    and one collective sums the results: the same figures as one process, none of the ranks
    working alone. `collective_forward` (a sharded drafter or target, whose forward is itself a
    collective): every rank runs the same number of forwards, the last ones repeated and not counted."""
    B = drafter.block_size
    drafter.eval()
    dev = target.device
    acc = torch.zeros(4 + 2 * B, dtype=torch.float64, device=dev)  # blocks, sum of lengths, loss sum, slots, hits [B], counts [B]
    with autocast_for(dev):
        for k, idx, count in eval_order(rows, rows_per_batch, B, collective_forward=collective_forward):
            loss, m = compute_loss(target, drafter, rows_batch(rows, idx), max_anchors=cfg.eval_anchors, gamma=cfg.gamma,
                                   loss=cfg.loss, generator=torch.Generator().manual_seed(12345 + k),
                                   backend=cfg.backend, cached=features(idx) if features else None,
                                   sync_metrics=False)
            if count:
                t = m["totals"]
                acc += torch.cat([t["blocks_lengths_loss_slots"], t["slot_hits"], t["slot_counts"]]).to(acc)
    drafter.train()
    acc = all_reduce_sum(acc).tolist()
    blocks, lengths, loss_sum, slots = acc[:4]
    hits, counts = acc[4:4 + B], acc[4 + B:]
    if not blocks:
        return {}
    return {"eval_tau": lengths / blocks, "eval_loss": loss_sum / slots,
            "eval_slot_accuracy": [h / max(c, 1.0) for h, c in zip(hits, counts)], "eval_blocks": int(blocks)}

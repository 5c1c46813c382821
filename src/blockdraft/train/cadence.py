"""When a run stops training to checkpoint or evaluate. On a CPU: every N steps, as asked. On a GPU a
step takes a second and a checkpoint of an 8B-sized drafter (11.7 GiB with AdamW's moments) or 256
held-out rows far longer, so there the periodic work is also bounded to a share of the wall time:
it is put off while the last one took more than `share` of the time since it began, and one line
says so with the reason (`say`). The last step always saves and evaluates, so nothing finished is
lost by a skipped one."""

from __future__ import annotations

import time


class Cadence:
    def __init__(self, every: int, share: float | None, *, first: bool = False, clock=time.perf_counter,
                 agree=None, what: str = "the work", say=None):
        """`every`: the period in steps; `share`: the most of the wall time the work may take (None: no
        bound); `first`: also due after step 1 (a write that fails, fails early); `agree`: makes one
        decision of every rank's (their clocks differ, and the work is collective: `rank0_says`);
        `what` names the work and `say` (rank 0's; None: silent) gets one line for each time it is put
        off."""
        self.every, self.share, self.first, self.clock = every, share, first, clock
        self.agree = agree or (lambda flag: flag)
        self.what, self.say = what, say
        self.cost = 0.0  # seconds the last one took
        self.ended = None  # when it ended

    def due(self, step: int, total: int) -> bool:
        if step == total:
            return True
        if not (step % self.every == 0 or (self.first and step == 1)):
            return False
        if self.share is None or self.ended is None:
            return True
        since = self.clock() - self.ended
        go = self.agree(self.cost <= self.share * (since + self.cost))
        if not go and self.say is not None:
            self.say(f"{self.what} of step {step} put off: the last one took {self.cost:.1f} s, more than "
                     f"{self.share:.0%} of the {since + self.cost:.1f} s since it began (on a GPU, periodic "
                     f"work is bounded to {self.share:.0%} of the wall time; the last step always runs it)")
        return go

    def run(self, fn):
        """Run the work and time it."""
        t = self.clock()
        try:
            return fn()
        finally:
            self.ended = self.clock()
            self.cost = self.ended - t


def rank0_says(flag: bool) -> bool:
    """Rank 0's `flag` on every rank (itself outside a process group): a collective."""
    import torch
    import torch.distributed as dist

    from .distributed import comm_device, grouped

    if not grouped():
        return flag
    t = torch.tensor([int(flag)], device=comm_device())
    dist.broadcast(t, 0)
    return bool(t.item())


def poll(stop: bool, timed: bool) -> tuple[bool, bool]:
    """(whether any rank was asked to stop, rank 0's `timed`: a time-based save is due): one
    all-reduce of two numbers a step under a process group (the others' `timed` is not read), so
    every rank stops and saves at the same step (`blockdraft.preempt`); the values themselves
    outside one."""
    import torch
    import torch.distributed as dist

    from .distributed import comm_device, grouped, world

    if not grouped():
        return stop, timed
    t = torch.tensor([int(stop), int(timed and world()[0] == 0)], dtype=torch.int32, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    got = t.tolist()
    return bool(got[0]), bool(got[1])

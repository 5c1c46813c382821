"""Reading stored target outputs one micro-batch ahead, off the training thread.

A feature cache on disk is read row by row through a memory map; done on the training thread
the GPU waits for every read. `Prefetcher` reads the next micro-batch on one background thread
while the current one trains, keeps the stored precision (a bf16 cache stays bf16 until the
drafter's own cast) and, for a CUDA run, puts the tensors in pinned host memory so the copy to
the device can overlap.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Prefetcher:
    def __init__(self, source, *, pin: bool = False):
        """`source`: idx -> StoredOutputs (a DiskFeatures); `pin`: page-locked results (CUDA runs)."""
        self.source, self.pin = source, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockdraft-prefetch")
        self._pending: tuple[tuple, Future] | None = None

    def _read(self, idx: torch.Tensor):
        got = self.source(idx)
        if self.pin:
            for name in ("features", "final_hidden", "top"):
                t = getattr(got, name)
                if t is not None:
                    setattr(got, name, t.pin_memory())
        return got

    def ask(self, idx: torch.Tensor) -> None:
        """Start reading `idx` in the background (replaces an unclaimed earlier request)."""
        self._pending = (tuple(idx.tolist()), self._pool.submit(self._read, idx.clone()))

    def get(self, idx: torch.Tensor):
        """The outputs of `idx`: the background read if it was asked for, else read now."""
        key = tuple(idx.tolist())
        if self._pending is not None and self._pending[0] == key:
            fut, self._pending = self._pending[1], None
            return fut.result()  # a read error surfaces here, on the training thread
        return self._read(idx)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending = None

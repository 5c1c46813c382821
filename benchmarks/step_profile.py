"""One training step at SmolLM2's shapes from stored outputs (no target layer runs): its CPU time, and
optionally torch's profile of it (where the time goes).

Sequence 1024, 64 anchors, block 16, a 1-layer drafter on the full vocabulary, one thread; the drafter
starts from a fixed seed, so two commits' loss and gradient norm can be compared as well as their time.

    python benchmarks/step_profile.py [dflash|dspark|dflash2] [hard|soft|kl] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    import torch

    from blockdraft.data.features import StoredOutputs
    from blockdraft.target import TargetModel
    from blockdraft.train import compute_loss
    from blockdraft.train.build import DrafterOptions, build_drafter
    from blockdraft.train.step import Batch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", nargs="?", default="dflash")
    p.add_argument("loss", nargs="?", default="hard")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    target = TargetModel.head_only("smollm2", num_features=5)
    T, H = 1024, target.hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, T), generator=g)
    rows = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    torch.manual_seed(0)
    drafter = build_drafter(DrafterOptions(draft_vocab="full", kind=a.kind, init_from_target=False), target, rows, "cpu")
    feats = torch.randn(1, T, len(target.layer_ids) * H, generator=g)
    final = torch.randn(1, T, H, generator=g)
    with torch.no_grad():
        top = target.head(final[0]).argmax(-1)[None]
    cached, batch = StoredOutputs(feats, final, top), Batch(ids, torch.ones_like(ids))

    def step():
        loss, _ = compute_loss(target, drafter, batch, max_anchors=64, loss=a.loss, cached=cached,
                               generator=torch.Generator().manual_seed(0))
        loss.backward()
        norm = sum(float(q.grad.double().norm() ** 2) for q in drafter.parameters() if q.grad is not None) ** 0.5
        drafter.zero_grad(set_to_none=True)
        return float(loss.detach()), norm

    step()
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    times = []
    for _ in range(a.repeats):
        t0 = time.process_time()
        loss, norm = step()
        times.append(time.process_time() - t0)
    print(json.dumps({"kind": a.kind, "loss": a.loss, "step_cpu_s": sorted(times)[len(times) // 2],
                      "loss_value": loss, "grad_norm": norm}))


if __name__ == "__main__":
    main()

"""How speculative generation rolls back a hybrid target's recurrent layers after a rejected draft,
measured: the states transformers (>= 5.25) records during the verify, put back by its crop
(blockdraft's way: generate/recurrent.py), against the snapshot-and-re-run blockdraft needed before
(copy the conv/recurrent states once per verify; on a rejection restore them and run the kept
tokens through the target again).

    python benchmarks/recurrent_rollback.py                      # tiny and moderate configs, 1 thread
    python benchmarks/recurrent_rollback.py --arch qwen3_5 --prompt 512 --new 48

Each strategy generates from the same random drafter (almost every draft is rejected: the worst
case for a rollback) and is compared with the target's own greedy decoding. Prints one JSON line
per (config, strategy): seconds per generated token and whether the output is the target's. The
old way is emulated on today's cache: its copy is taken after the verify instead of before (the
same cost), and its restore is the crop's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockdraft.config import DrafterConfig
from blockdraft.generate import speculative_generate
from blockdraft.generate import recurrent as rec
from blockdraft.generate.baseline import target_greedy
from blockdraft.model import DFlashDrafter
from blockdraft.target import TargetModel
from blockdraft.target.tiny import tiny_causal_lm

SHAPES = {"tiny": dict(vocab=160, layers=6, hidden=32, heads=4, kv_heads=2),
          "moderate": dict(vocab=4096, layers=12, hidden=512, heads=8, kv_heads=4, intermediate=1024)}


class SnapshotRerun(rec.RecurrentRollback):
    """blockdraft before transformers 5.25: a copy of the states per verify, the kept tokens re-run."""

    reruns = 0

    def keep(self, length, block, kept):
        _copy = [[s.clone() for s in layer.recurrent_states.values() if s is not None] for layer in self.layers]
        b = int(block.shape[0])
        if kept >= b:
            self.target.crop_cache(self.cache, length)
            return
        start = length - kept
        self.target.crop_cache(self.cache, start)  # back to before the block: the state the copy held
        if kept > 0:
            t = self.target
            t.model(input_ids=block[None, :kept], position_ids=torch.arange(start, length, device=block.device)[None],
                    use_cache=True, logits_to_keep=1, **{t._cache_kwarg(): self.cache})
            t.crop_cache(self.cache, length)
            self.reruns += 1


def run(arch: str, shape: str, prompt_len: int, new: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    kw = SHAPES[shape]
    model = tiny_causal_lm(arch, **kw, max_positions=prompt_len + new + 64)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    t = TargetModel(model, None, [0, 1], mask_token_id=kw["vocab"] - 1, name=arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    ids = torch.randint(0, kw["vocab"] - 1, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    ref = target_greedy(t, ids, max_new_tokens=new).tokens
    rows = []
    real = rec.RecurrentRollback
    import blockdraft.generate.speculative as spec
    for name, cls in (("recorded states", real), ("snapshot + re-run", SnapshotRerun)):
        spec.RecurrentRollback = cls
        best = None
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = speculative_generate(t, d, ids, max_new_tokens=new)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
        finally:
            spec.RecurrentRollback = real
        rows.append(dict(arch=arch, shape=shape, prompt=prompt_len, new=new, strategy=name,
                         s_per_token=round(best / new, 5), tau=round(res.tau, 3), identical=res.tokens == ref))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3_5,nemotron_h")
    ap.add_argument("--shape", default="tiny,moderate", help=f"of {list(SHAPES)}")
    ap.add_argument("--prompt", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for arch in a.arch.split(","):
        for shape in a.shape.split(","):
            for p in a.prompt:
                for row in run(arch, shape, p, a.new, a.repeats):
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

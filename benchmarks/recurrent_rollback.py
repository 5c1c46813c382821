"""How speculative generation rolls back a hybrid target's recurrent layers after a rejected draft,
measured: blockdraft's snapshot-and-restore (copy the conv/recurrent states before each verify; on
a rejection put them back and run the kept tokens again: generate/recurrent.py) against re-running
the whole committed text into the emptied cache (no copies), and the crop-only loop transformers'
cache offers (wrong: the recurrent state keeps the rejected tokens).

    python benchmarks/recurrent_rollback.py                      # tiny and moderate configs, 1 thread
    python benchmarks/recurrent_rollback.py --arch qwen3_5 --prompt 512 --new 48

Each strategy generates the same tokens from the same random drafter (almost every draft is
rejected: the worst case for a rollback) and is compared with the target's own greedy decoding.
Prints one JSON line per (config, strategy): seconds per generated token and whether the output
is the target's.
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
from blockdraft.tiny import tiny_causal_lm

SHAPES = {"tiny": dict(vocab=160, layers=6, hidden=32, heads=4, kv_heads=2),
          "moderate": dict(vocab=4096, layers=12, hidden=512, heads=8, kv_heads=4, intermediate=1024)}


class Reprefill(rec.RecurrentRollback):
    """No copies: on a rejection the cache is emptied and the whole committed text run again."""

    def __init__(self, target, cache, prompt):
        super().__init__(target, cache)
        self.history = prompt[0].tolist()

    def save(self) -> None:
        pass

    def keep(self, length, block, kept):
        start = length - kept
        self.history = self.history[:start] + block[:kept].tolist()
        if not self.layers or kept >= block.shape[0]:
            self.target.crop_cache(self.cache, length)
            return
        self.target.crop_cache(self.cache, 0)
        for layer in self.layers:
            for i in layer.recurrent_states:
                layer.recurrent_states[i] = None if layer.recurrent_states[i] is None else \
                    torch.zeros_like(layer.recurrent_states[i])
            layer.has_previous_state = dict.fromkeys(layer.has_previous_state, False)
        ids = torch.tensor([self.history], device=block.device)
        t = self.target
        t.model(input_ids=ids, position_ids=torch.arange(length, device=block.device)[None], use_cache=True,
                logits_to_keep=1, **{t._cache_kwarg(): self.cache})
        self.reruns += 1


class CropOnly(rec.RecurrentRollback):
    """What transformers' crop alone does (the loop before this change)."""

    def save(self) -> None:
        pass

    def keep(self, length, block, kept):
        self.target.crop_cache(self.cache, length)


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
    for name, cls in (("snapshot-restore", real), ("re-prefill", Reprefill), ("crop-only (wrong)", CropOnly)):
        spec.RecurrentRollback = (lambda target, cache, cls=cls: cls(target, cache, ids)) if cls is Reprefill \
            else cls
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

"""Every-turn regeneration against last-turn-only, measured: held-out tau on multi-turn conversations.

Two-turn conversations are made from the bundled prompt set (never the evaluation sets): each pairs
two of its single-turn prompts, [user a, assistant, user b, assistant]. Two training sets are written
from the same conversations by SmolLM2 (transformers, on this CPU):

* last-turn-only (what `regenerate` did before): the first answer is the data's own, here SmolLM2
  sampled at temperature 1 (seeded per batch: the stand-in for an answer some other model wrote);
  only the last turn is the target's greedy answer to that history;
* every-turn (`regenerate` now): both answers are the target's greedy ones, the second written after
  the first (`blockdraft.data.regenerate.regenerate`, the command's own code).

Held-out conversations (other prompts) are regenerated every turn (they are what the target writes).
The bundled drafter is trained on each set for the same steps from the same start
(`--init-drafter default`), evaluated on the same held-out rows (teacher-forced tau over every
assistant turn).

    python benchmarks/multiturn_tau.py --out runs/multiturn --json benchmarks/results/multiturn-tau.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def conversations(n_train: int, n_held: int) -> tuple[list, list]:
    from blockdraft.data.prompt_set import read_prompts

    singles = [m for _, m in read_prompts() if len(m) == 1 and m[0]["role"] == "user"]
    pairs = [[singles[2 * k][0], {"role": "assistant", "content": ""}, singles[2 * k + 1][0]]
             for k in range(len(singles) // 2)]
    return pairs[:n_train], pairs[n_train:n_train + n_held]


def generate(a) -> None:
    """The three answer files (each skipped when already written: a rerun resumes)."""
    import torch

    from blockdraft.data.chat import encode_prompt
    from blockdraft.data.regenerate import regenerate
    from blockdraft.engines.transformers import TransformersGenerator
    from blockdraft.target import TargetModel, stop_token_ids

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    train, held = conversations(a.train, a.held)
    target = TargetModel.from_pretrained("smollm2")
    tok, model = target.tokenizer, target.model
    for name, convs in (("every-turn", train), ("held", held)):
        regenerate(TransformersGenerator(target), list(enumerate(convs)), out / f"{name}.jsonl",
                   max_new_tokens=a.max_new_tokens, batch_size=a.batch, progress=True,
                   keep_cut=True)  # measured with cut answers kept (before regenerate dropped them)
    if (out / "last-turn.jsonl").exists():
        return
    stop, pad = stop_token_ids(tok), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def answers(prompts, sample: bool) -> list[str]:
        got = []
        for s in range(0, len(prompts), a.batch):
            ids = [encode_prompt(tok, m)[0].tolist() for m in prompts[s:s + a.batch]]
            if sample:  # one seed per batch, batched (regenerate samples one prompt at a time)
                torch.manual_seed(1000 + s)
                width = max(len(r) for r in ids)
                x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
                with torch.no_grad():
                    rows = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=a.max_new_tokens,
                                          do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad,
                                          eos_token_id=stop)[:, width:].tolist()
            else:
                rows = [r for r, _ in TransformersGenerator(target).generate(ids, max_tokens=a.max_new_tokens,
                                                                            stop_token_ids=stop)]
            for r in rows:
                r = r[:next((i for i, t in enumerate(r) if t in stop), len(r))]
                got.append(tok.decode(r, skip_special_tokens=True).strip())
            print(f"last-turn data: {len(got)} of {len(prompts)} answers", flush=True)
        return got

    old = answers([[c[0]] for c in train], sample=True)
    hist = [[c[0], {"role": "assistant", "content": o}, c[2]] for c, o in zip(train, old)]
    last = answers(hist, sample=False)
    with open(out / "last-turn.jsonl", "w") as f:
        for h, ans in zip(hist, last):
            f.write(json.dumps({"messages": h + [{"role": "assistant", "content": ans}]}) + "\n")


def train(a, name: str) -> dict:
    out = Path(a.out)
    run = out / f"run-{name}"
    cmd = [sys.executable, "-m", "blockdraft", "train", "--data", str(out / f"{name}.jsonl"), "--eval-data",
           str(out / "held.jsonl"), "--init-drafter", "default", "--steps", str(a.steps), "--eval-every",
           str(a.steps), "--max-rows", "0", "--max-eval-rows", "0", "--threads", str(a.threads), "--out", str(run),
           "--overwrite", "--no-progress"]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    evals = [m for m in lines if "eval_tau" in m]
    return {"steps": lines[-1]["step"], "eval_tau": evals[-1]["eval_tau"],
            "evals": [[m["step"], m["eval_tau"]] for m in evals]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/multiturn")
    p.add_argument("--train", type=int, default=128)
    p.add_argument("--held", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    generate(a)
    res = {"command": "python benchmarks/multiturn_tau.py " + " ".join(sys.argv[1:]),
           "conversations": {"train": a.train, "held": a.held}, "max_new_tokens": a.max_new_tokens,
           "steps": a.steps, "last_turn_only": train(a, "last-turn"), "every_turn": train(a, "every-turn")}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

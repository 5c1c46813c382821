"""One training step of blockdraft, SpecForge 0.2.0 and speculators 0.9.0 side by side, in one run.

Each trainer runs in its own environment (blockdraft: the project's; SpecForge: `.venv-ref-spec`, installed there --no-deps;
speculators: `.venv-ref-spec`), in a fresh process per configuration, on one thread, with the same
shapes: SmolLM2-135M's (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49,152),
features from 5 target layers, block 16, one packed sequence of random tokens, every token learned.
A step is the drafter's forward and backward from stored target outputs (features and the final
state; no target layer runs), with each trainer's own loss code; the optimizer is left out (it is the
same AdamW-sized update for all three). Timed in CPU seconds (process_time), median of the timed
steps after one warm-up step; peak memory is the process's peak resident set during the timed steps
above what it held before them (VmHWM after a reset through /proc/self/clear_refs).

Configurations (what users run, scaled to a 2-core CPU): sequence 1024 with 64 and 512 anchors
(512 anchors put 8,192 block positions on 1,024 tokens: the density of speculators' default, 512
per 8,192 tokens, times 8), 1 and 5 drafter layers, the full vocabulary and a 32k draft vocabulary,
hard labels (the target's argmax; SpecForge: the data's next token) and a target-logit loss (the
target's distribution: blockdraft's KL, speculators' KL; SpecForge has none).

* blockdraft: `train`'s step (`compute_loss`) on a drafter `train` builds (first layer sliding, the
  rest full); labels from the stored final state and argmax.
* SpecForge: its `DFlashDraftModel` in its `OnlineDFlashModel` wrapper with `attention_backend="sdpa"`
  (its flex-attention path compiles per shape on a CPU), `loss_type="dflash"`, gamma 7, the same
  layer types; it has no draft vocabulary and no target-logit loss.
* speculators: its `DFlashDraftModel.from_training_args` at its training defaults (D-PACE weighting,
  its sliding window), the loss `ce` (hard: the verifier's argmax) or `kl`, eager loss kernels
  (its fused ones need Triton); labels from the stored final state through the verifier's head.

    python benchmarks/vs_peers.py --json benchmarks/results/vs-peers.json --plot benchmarks/results/vs-peers.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
PYTHONS = {"blockdraft": Path(sys.executable), "specforge": ROOT / ".venv-ref-spec" / "bin" / "python",
           "speculators": ROOT / ".venv-ref-spec" / "bin" / "python"}
H, HEADS, KV, HEAD_DIM, MLP, V, TARGET_LAYERS, F, B = 576, 9, 3, 64, 1536, 49152, 30, 5, 16
FEATURE_LAYERS = [1, 8, 15, 22, 28]  # blockdraft's ids (transformers' hidden_states[L + 1])


def inputs(cfg: dict):
    import torch

    g = torch.Generator().manual_seed(0)
    T = cfg["seq"]
    ids = torch.randint(0, V - 1, (1, T), generator=g)
    return ids, torch.randn(1, T, F * H, generator=g), torch.randn(1, T, H, generator=g)


def build_blockdraft(cfg: dict):
    import torch

    from blockdraft.data.features import StoredOutputs
    from blockdraft.target import TargetModel
    from blockdraft.train import compute_loss
    from blockdraft.train.build import DrafterOptions, build_drafter
    from blockdraft.train.step import Batch

    target = TargetModel.head_only("smollm2", layer_ids=FEATURE_LAYERS, dtype=torch.float32, device="cpu")
    ids, feats, final = inputs(cfg)
    rows = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    torch.manual_seed(0)
    vocab = "full" if cfg["vocab"] == "full" else str(cfg["vocab"])
    drafter = build_drafter(DrafterOptions(draft_layers=cfg["layers"], draft_vocab=vocab, init_from_target=False),
                            target, rows, "cpu")
    with torch.no_grad():
        top = target.head(final[0]).argmax(-1)[None]
    cached, batch = StoredOutputs(feats, final, top), Batch(ids, torch.ones_like(ids))
    kind = "hard" if cfg["loss"] == "hard" else "kl"

    def step():
        loss, _ = compute_loss(target, drafter, batch, max_anchors=cfg["anchors"], loss=kind, cached=cached,
                               generator=torch.Generator().manual_seed(0))
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def build_specforge(cfg: dict):
    import torch
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    if cfg["vocab"] != "full" or cfg["loss"] != "hard":
        raise NotImplementedError("SpecForge 0.2.0 trains DFlash on the full vocabulary with hard labels only")
    L = cfg["layers"]
    c = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=MLP, num_hidden_layers=L, num_attention_heads=HEADS,
                    num_key_value_heads=KV, head_dim=HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=8192,
                    layer_types=["sliding_attention"] + ["full_attention"] * (L - 1), sliding_window=32,
                    use_sliding_window=True)
    c._attn_implementation = "sdpa"
    c.block_size, c.num_target_layers = B, TARGET_LAYERS
    c.dflash_config = {"target_layer_ids": FEATURE_LAYERS, "mask_token_id": V - 1}
    torch.manual_seed(0)
    draft = DFlashDraftModel(c).float().train()
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    embed = torch.nn.Embedding(V, H).requires_grad_(False)
    model = OnlineDFlashModel(draft, head, embed, mask_token_id=V - 1, block_size=B, attention_backend="sdpa",
                              num_anchors=cfg["anchors"], loss_decay_gamma=7.0, loss_type="dflash")
    ids, feats, _ = inputs(cfg)
    mask = torch.ones_like(ids)

    def step():
        loss, _, _ = model(ids, feats, mask)
        loss.backward()
        draft.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def build_speculators(cfg: dict):
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import TrainConfig as SpecConfig

    from blockdraft.checkpoint.native import default_verifier

    d = SpecConfig(speculator_type="dflash", verifier_name_or_path="-").flatten()
    verifier = default_verifier("smollm2")
    layer_cfg = create_transformer_layer_config(verifier, cfg["layers"], d["draft_arch"], d["draft_hidden_act"],
                                                d["sliding_window"], d["full_attention_indices"])
    maps = {}
    if cfg["vocab"] != "full":  # its vocabulary maps: t2d marks the draft ids, d2t their offsets (EAGLE's)
        ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:int(cfg["vocab"])]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        maps = {"t2d": t2d, "d2t": ids - torch.arange(len(ids))}
    torch.manual_seed(0)
    model = DFlashDraftModel.from_training_args(
        layer_cfg, **maps, draft_vocab_size=V if cfg["vocab"] == "full" else int(cfg["vocab"]), block_size=B,
        verifier_name_or_path=verifier, mask_token_id=V - 1, target_layer_ids=[i + 1 for i in FEATURE_LAYERS],
        sliding_window_non_causal=d["sliding_window_non_causal"], sample_from_anchor=d["sample_from_anchor"],
        draft_attn_impl="sdpa")
    model.verifier_norm = torch.nn.Identity()  # the stored final state is normed already
    model.float().train()
    loss_config = resolve_loss_config("ce" if cfg["loss"] == "hard" else "kl_div", "eager")
    ids, feats, final = inputs(cfg)
    T = cfg["seq"]
    b = dict(hidden_states=feats, input_ids=ids, loss_mask=torch.ones_like(ids), verifier_last_hidden_states=final,
             document_ids=torch.zeros_like(ids), position_ids=torch.arange(T)[None])

    def step():
        _, loss, _ = model(**b, loss_config=loss_config, gamma=d["dflash_decay_gamma"], max_anchors=cfg["anchors"],
                           per_position_loss_weight=d["per_position_loss_weight"], dpace_alpha=d["dpace_alpha"])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def worker(cfg: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "src"))
    try:
        step = {"blockdraft": build_blockdraft, "specforge": build_specforge,
                "speculators": build_speculators}[cfg["trainer"]](cfg)
    except NotImplementedError as e:
        return {**cfg, "skipped": str(e)}
    step()  # warm-up
    before = rss_kib()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
    times, loss = [], None
    for _ in range(cfg["repeats"]):
        t0 = time.process_time()
        loss = step()
        times.append(time.process_time() - t0)
    s = sorted(times)[len(times) // 2]
    return {**cfg, "step_s": round(s, 3), "steps_s": [round(t, 3) for t in times],
            "peak_mib": round((hwm_kib() - before) / 1024, 1), "tokens_per_s": round(cfg["seq"] / s, 1), "loss_value": loss}


def configs(a) -> list[dict]:
    out = []
    for anchors, layers, vocab, loss in itertools.product(a.anchors, a.layers, a.vocab, ("hard", "target")):
        for trainer in a.trainers:
            out.append({"trainer": trainer, "seq": a.seq, "anchors": anchors, "layers": layers,
                        "vocab": vocab if vocab == "full" else int(vocab), "loss": loss,
                        "repeats": a.repeats if anchors <= 128 else 1})
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["anchors"], r["layers"], str(r["vocab"]), r["loss"]) for r in results})
    trainers = ["blockdraft", "specforge", "speculators"]
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 0.9), 4.5))
    width = 0.27
    for j, t in enumerate(trainers):
        xs, ys = [], []
        for i, k in enumerate(keys):
            r = next((r for r in results if (r["anchors"], r["layers"], str(r["vocab"]), r["loss"]) == k
                      and r["trainer"] == t and "step_s" in r), None)
            if r:
                xs.append(i + (j - 1) * width)
                ys.append(r["step_s"])
        ax.bar(xs, ys, width, label=t)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{a}a {l}L\n{v} {lo}" for a, l, v, lo in keys], fontsize=7)
    ax.set_ylabel("CPU seconds per step (1 thread)")
    ax.set_yscale("log")
    ax.set_title("Training step, SmolLM2 shapes, sequence 1024, block 16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(results: list[dict]) -> list[dict]:
    """Per configuration: blockdraft's speed over the faster peer's, and its peak memory against theirs."""
    rows = []
    keys = sorted({(r["anchors"], r["layers"], str(r["vocab"]), r["loss"]) for r in results})
    for k in keys:
        got = {r["trainer"]: r for r in results if (r["anchors"], r["layers"], str(r["vocab"]), r["loss"]) == k
               and "step_s" in r}
        if "blockdraft" not in got:
            continue
        peers = {t: r for t, r in got.items() if t != "blockdraft"}
        row = {"anchors": k[0], "layers": k[1], "vocab": k[2], "loss": k[3],
               "blockdraft_s": got["blockdraft"]["step_s"], "blockdraft_peak_mib": got["blockdraft"]["peak_mib"]}
        for t, r in peers.items():
            row[f"{t}_s"], row[f"{t}_peak_mib"] = r["step_s"], r["peak_mib"]
        if peers:
            fastest = min(peers.values(), key=lambda r: r["step_s"])
            row["speed_vs_faster_peer"] = round(fastest["step_s"] / got["blockdraft"]["step_s"], 2)
            row["faster_peer"] = fastest["trainer"]
            row["peak_vs_that_peer"] = round(got["blockdraft"]["peak_mib"] / max(fastest["peak_mib"], 1e-9), 2)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    del sub
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--anchors", type=lambda s: [int(x) for x in s.split(",")], default=[64, 512])
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5])
    p.add_argument("--vocab", type=lambda s: s.split(","), default=["full", "32768"])
    p.add_argument("--trainers", type=lambda s: s.split(","), default=list(PYTHONS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return
    results = []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for cfg in configs(a):
        t0 = time.perf_counter()
        proc = subprocess.run([str(PYTHONS[cfg["trainer"]]), __file__, "--worker", json.dumps(cfg)], env=env,
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {**cfg, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        results.append(r)
        print(json.dumps({k: r.get(k) for k in ("trainer", "anchors", "layers", "vocab", "loss", "step_s", "peak_mib",
                                                "skipped", "error")}) + f"  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    table = summary(results)
    for row in table:
        print(json.dumps(row))
    if a.json:
        Path(a.json).write_text(json.dumps({"command": " ".join(sys.argv), "results": results, "summary": table},
                                           indent=1) + "\n")
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()

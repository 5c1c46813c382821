"""Benchmark: target greedy vs speculative vs prompt-lookup decoding, interleaved prompt by prompt.

All three run in one process on the same prompts, so ratios are taken under the same load.
The ceiling of a set is tau * t_step / (t_verify(B) + t_draft): the speedup that perfect
bookkeeping would give at the measured acceptance and forward costs.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from ..generate.baseline import target_greedy
from ..generate.speculative import speculative_generate
from ..target import stop_token_ids
from ..data.chat import encode_prompt as encode
from ..data.eval_prompts import check_sets, load_prompt_set


@torch.no_grad()
def hf_lookup_generate(target, ids, max_new_tokens, stops, hf_lookup_tokens):
    """transformers' own prompt-lookup decoding (the baseline beside ours, `lookup`)."""
    t0 = time.perf_counter()
    out = target.model.generate(ids.to(target.device), max_new_tokens=max_new_tokens, do_sample=False,
                                prompt_lookup_num_tokens=hf_lookup_tokens, eos_token_id=stops,
                                pad_token_id=stops[0])
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0


def bench_set(target, drafter, name: str, n: int, *, max_new_tokens: int, block_size: int | None,
              hf_lookup_tokens: int = 10, progress: bool = True, draft_threshold: float = 0.0,
              lookup: int = 0, verify_chunk: int = 0) -> dict:
    from tqdm.auto import tqdm

    prompts = load_prompt_set(name, n)
    stops = stop_token_ids(target.tokenizer)
    agg = Counter()
    hist: Counter = Counter()
    identical = True
    for msgs in tqdm(prompts, desc=f"bench {name}", disable=not progress):
        ids = encode(target.tokenizer, msgs)
        base = target_greedy(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        spec = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                    block_size=block_size, draft_threshold=draft_threshold, lookup=lookup,
                                    verify_chunk=verify_chunk)
        look, t_look = hf_lookup_generate(target, ids, max_new_tokens, stops, hf_lookup_tokens)
        identical &= base.tokens == spec.tokens
        hist.update(spec.accepted)
        agg["base_tokens"] += len(base.tokens) - 1  # decode phase only: the prefill is common to all
        agg["base_time"] += base.time_total - base.time_prefill
        agg["base_steps"] += len(base.accepted)
        agg["spec_tokens"] += len(spec.tokens) - 1
        agg["spec_time"] += spec.time_total - spec.time_prefill
        agg["spec_steps"] += len(spec.accepted)
        agg["verified"] += sum(spec.verified)
        agg["copied_steps"] += spec.lookup_steps
        agg["t_draft"] += spec.time_draft
        agg["t_verify"] += spec.time_verify
        # decode phase only, as for the other two: its prefill is the target's, timed in the baseline
        agg["look_tokens"] += len(look) - 1
        agg["look_time"] += max(1e-9, t_look - base.time_prefill)
    steps = max(1, agg["spec_steps"])
    tau = agg["spec_tokens"] / steps
    t_step = agg["base_time"] / max(1, agg["base_steps"])
    t_verify, t_draft = agg["t_verify"] / steps, agg["t_draft"] / steps
    base_tps = agg["base_tokens"] / max(1e-9, agg["base_time"])
    spec_tps = agg["spec_tokens"] / max(1e-9, agg["spec_time"])
    other = agg["spec_time"] - agg["t_draft"] - agg["t_verify"]
    return {
        "set": name, "n_prompts": len(prompts), "block_size": block_size or drafter.block_size, "tau": tau,
        "draft_threshold": draft_threshold, "mean_verified": agg["verified"] / steps,
        "lookup": lookup, "copied_step_frac": agg["copied_steps"] / steps,
        "target_tok_s": base_tps, "spec_tok_s": spec_tps, "speedup": spec_tps / max(1e-9, base_tps),
        "identical": bool(identical),
        "hf_lookup_speedup": (agg["look_tokens"] / max(1e-9, agg["look_time"])) / max(1e-9, base_tps),
        "t_step_ms": 1e3 * t_step, "t_verify_ms": 1e3 * t_verify, "t_draft_ms": 1e3 * t_draft,
        "bookkeeping_frac": other / max(1e-9, agg["spec_time"]),
        "ceiling": tau * t_step / max(1e-9, t_verify + t_draft),
        "accepted_hist": {int(k): int(v) for k, v in sorted(hist.items())},
    }


PNG_MARK = "blockdraft bench"  # the PNG's Software entry: a plot bench wrote, which a rerun may replace


def plot_hist(results: list[dict], path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..rundir.ownership import replace_bytes

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        h = r["accepted_hist"]
        ax.bar(list(h), list(h.values()))
        ax.set(title=f"{r['set']}: tau {r['tau']:.2f}, {r['speedup']:.2f}x", xlabel="tokens committed per step",
               ylabel="steps")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png", metadata={"Software": PNG_MARK})
    plt.close(fig)
    replace_bytes(path, png.getvalue())  # whole or not at all, never through a link


def bench_json(path) -> bool:
    """Whether a file holds results as `run_bench` writes them (a list of per-set records)."""
    try:
        got = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(got, list) and all(isinstance(r, dict) and {"set", "tau", "speedup"} <= set(r) for r in got)


def bench_plot(path) -> bool:
    """Whether a file is a PNG `plot_hist` wrote (its Software entry, a PNG text chunk near the start)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + PNG_MARK.encode() in head


def check_outputs(json_path=None, plot_path=None) -> None:
    """--json and --plot, before the bench runs: a new file, or one bench wrote (never a link)."""
    from ..rundir.ownership import check_file

    if json_path:
        check_file(json_path, "bench", bench_json, "a bench result")
    if plot_path:
        check_file(plot_path, "bench", bench_plot, "a bench plot")


def run_bench(target, drafter, sets: list[str], n: int, *, max_new_tokens: int = 256, block_size=None,
              json_path=None, plot_path=None, progress: bool = True, draft_threshold: float = 0.0,
              lookup: int = 0, verify_chunk: int = 0) -> list[dict]:
    from ..rundir.ownership import replace_text

    check_sets(",".join(sets))  # an empty list would print an empty table and pass
    check_outputs(json_path, plot_path)
    results = [bench_set(target, drafter, s, n, max_new_tokens=max_new_tokens, block_size=block_size,
                         progress=progress, draft_threshold=draft_threshold, lookup=lookup,
                         verify_chunk=verify_chunk) for s in sets]
    if json_path:
        replace_text(json_path, json.dumps(results, indent=1))
    if plot_path:
        plot_hist(results, plot_path)
    return results

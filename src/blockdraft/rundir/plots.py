"""PNG plots of a run from its metrics.jsonl: loss curve, accepted length, per-slot accuracy."""

from __future__ import annotations

import json
from pathlib import Path


def _save(fig, path: Path) -> None:
    """A PNG in a run directory, never written through a link there."""
    from .ownership import open_private

    with open_private(path, "wb") as f:
        fig.savefig(f, dpi=110, format="png")


def plot_run(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Writes loss.png and slot_accuracy.png (if evaluated); returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in Path(metrics_path).read_text().splitlines() if ln.strip()]
    out_dir = Path(out_dir)
    written: list[Path] = []
    if not recs:
        return written
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = [r["tokens"] / 1e6 for r in recs]
    ax1.plot(tokens, [r["loss"] for r in recs], lw=0.8, label="train")
    ev = [r for r in recs if "eval_tau" in r]
    if ev:
        ax1.plot([r["tokens"] / 1e6 for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out")
    ax1.set(xlabel="training tokens (M)", ylabel="loss", title="loss")
    ax1.legend()
    ax2.plot(tokens, [r["tau"] for r in recs], lw=0.8, label="train")
    if ev:
        ax2.plot([r["tokens"] / 1e6 for r in ev], [r["eval_tau"] for r in ev], "o-", label="held-out")
    ax2.set(xlabel="training tokens (M)", ylabel="mean accepted length", title="accepted length (tau)")
    ax2.legend()
    fig.tight_layout()
    p = out_dir / "loss.png"
    _save(fig, p)
    plt.close(fig)
    written.append(p)
    if ev:
        acc = ev[-1]["eval_slot_accuracy"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(range(1, len(acc)), acc[1:])
        ax.set(xlabel="block slot k", ylabel="accuracy", title=f"held-out per-slot accuracy (step {ev[-1]['step']})")
        fig.tight_layout()
        p = out_dir / "slot_accuracy.png"
        _save(fig, p)
        plt.close(fig)
        written.append(p)
    return written

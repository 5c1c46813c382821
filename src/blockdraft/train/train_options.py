"""TrainConfig: the optimisation, evaluation and run-control settings of a training run, with the
only definition of their defaults (the CLI's flags and help are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import opt
from .loss import LOSSES


@dataclass
class TrainConfig:
    out: str = opt("runs/default", "run directory: drafter/, checkpoint/, metrics.jsonl, plots")
    epochs: float = opt(3.0, "passes over the training rows", above=0)
    steps: int | None = opt(None, "optimizer steps (overrides --epochs)", min=1)
    lr: float = opt(6e-4, "peak learning rate (AdamW; warmup then cosine to a tenth)", above=0)
    warmup: float = opt(0.05, "warmup steps, or a fraction of all steps if < 1")
    batch_tokens: int = opt(2048, "tokens per micro-batch (whole packed rows)", min=1)
    grad_accum: int = opt(1, "micro-batches per optimizer step", min=1)
    max_anchors: int = opt(128, "anchors (blocks) per packed row", min=1)
    loss: str = opt("kl", "kl or soft cross-entropy against the target's distribution, or hard (its argmax)",
                    choices=LOSSES)
    gamma: float | None = opt(None, "slot weights exp(-(k-1)/gamma) (default: the paper's, 7 at block 16)", above=0)
    gamma_schedule: str = opt("acceptance", "acceptance: gamma follows the training acceptance, tau - 1/2 (at "
                                            "least 0.5, at most --gamma or the paper's), so the weight moves to the "
                                            "far slots as the drafter reaches them; fixed: --gamma throughout; "
                                            "dpace: speculators' D-PACE weights, from the drafter's own confidence "
                                            "per slot (--gamma unused)",
                              choices=("fixed", "acceptance", "dpace"))
    dpace_alpha: float = opt(0.5, "--gamma-schedule dpace: the confidence smoothing, in (0, 1] (speculators' 0.5)",
                             above=0, max=1)
    eval_every: int = opt(50, "evaluate the held-out rows every N steps (and at the end); on a GPU one is put off, "
                              "with a line saying why, while the last took over 5% of the wall time since it "
                              "began (never with --save-best)", min=1)
    save_every: int = opt(25, "checkpoint every N steps (and after the last; on a CPU also after the first); on a "
                              "GPU one is put off, with a line saying why, while the last took over 5% of the wall "
                              "time since it began", min=1)
    save_every_min: float | None = opt(None, "also checkpoint when M minutes passed since the last one, whichever "
                                             "of it and --save-every comes first (rank 0's clock decides for all "
                                             "ranks)", above=0, metavar="M")
    keep_checkpoints: int = opt(1, "resumable checkpoints kept: checkpoint/ the newest, the N-1 before it in "
                                   "checkpoints/step-N/", min=1, metavar="N")
    save_best: bool = opt(False, "also keep the drafter of the best held-out tau in best/ (best.json: its step and "
                                 "tau); every --eval-every evaluation runs, none put off")
    seed: int = opt(0, "seed of the drafter's initialisation, the data order, the anchors and the split")
    gradient_checkpointing: bool = opt(False, "recompute the drafter layers in backward (less memory)")
    fsdp: bool = opt(False, "under torchrun: shard the drafter's parameters, gradients and optimizer state over "
                            "the ranks (FSDP2) instead of replicating them")
    resume: bool = opt(False, "continue the run in --out exactly")
    overwrite: bool = opt(False, "replace the run in --out (its drafter, checkpoint and metrics); without it or "
                                 "--resume, a directory holding a run is refused")
    progress: bool = opt(True, "show a progress bar")
    report_to: str = opt("none", "experiment trackers that also get every metrics.jsonl figure and the run's settings, "
                                 "comma-separated: tensorboard, trackio, wandb (offline), mlflow (a file store), each "
                                 "writing inside --out (pip install 'blockdraft[trackers]'); none: only metrics.jsonl")
    report_required: bool = opt(False, "a --report-to tracker that cannot start or write stops the run with an error "
                                       "(default: a warning, and the run goes on without it)")
    # library-only settings (no flag)
    min_lr_ratio: float = opt(0.1, "cosine floor as a fraction of lr", hidden=True, max=1)
    weight_decay: float = opt(0.01, "AdamW weight decay", hidden=True)
    grad_clip: float = opt(1.0, "gradient norm clip", hidden=True)
    log_every: int = opt(1, "metrics.jsonl line every N steps", hidden=True, min=1)
    eval_anchors: int = opt(256, "anchors per held-out row", hidden=True, min=1)
    backend: str = opt("auto", "attention backend", hidden=True)
    row_shards: int | None = opt(None, "fixed parts the training rows are split into, micro-batch g reading part "
                                       "g % row_shards (default: one per rank, so a rank's stored outputs hold "
                                       "its part only)", hidden=True, min=1)
    dist_timeout_min: float = opt(60.0, "under torchrun: minutes a collective waits for a rank working alone "
                                        "(writing a checkpoint, compiling) before the run is stopped", above=0)

    def validate(self) -> None:
        from ..options import check_fields

        if self.lr <= 0 or self.grad_accum < 1 or self.batch_tokens < 1 or self.max_anchors < 1:
            raise ValueError("lr, grad_accum, batch_tokens and max_anchors must be positive")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.steps is None and self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.row_shards is not None and self.row_shards < 1:
            raise ValueError(f"row_shards must be >= 1, got {self.row_shards}")
        if self.dist_timeout_min <= 0:
            raise ValueError(f"--dist-timeout-min must be > 0, got {self.dist_timeout_min}")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"--dpace-alpha must be in (0, 1], got {self.dpace_alpha}")
        if self.eval_every < 1 or self.save_every < 1:
            raise ValueError("--eval-every and --save-every must be >= 1")
        from ..rundir.trackers import parse_report_to

        parse_report_to(self.report_to)
        check_fields(self, environment=False)  # and every field: its type, a finite number, its bounds


DEFAULTS = TrainConfig()

"""The training loop: AdamW with warmup + cosine decay, clipping, accumulation, held-out
evaluation with the exact accepted length, atomic checkpoints and exact resume.

Legend: R packed rows of L tokens each; a batch takes `rows_per_batch` rows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from ..checkpoint.native import save_drafter
from ..finite import check_step
from ..preempt import Preempted, StepLost, StopSignals, trained
from .distributed import (all_gather_floats, all_reduce_mean, average_gradients, barrier, check_same, clip_grad_norm,
                          gradient_sync, grouped, world)
from .cadence import Cadence, poll, rank0_says
from .evaluate import autocast_for, evaluate, rows_batch
from .train_options import TrainConfig
from ..rundir.directory import RunDir
from .step import compute_loss, plan_host

# on a GPU, the most of the wall time checkpoints and evaluations may each take (train.cadence)
GPU_WORK_SHARE = 0.05


def optimizer_options(device: torch.device) -> dict:
    """AdamW's implementation: fused (one kernel for every parameter) on CUDA; the default elsewhere."""
    return {"fused": True} if torch.device(device).type == "cuda" else {}


def memory_peaks(device: torch.device) -> dict:
    """This rank's peak allocated and reserved (the caching allocator's, fragmentation included) memory
    since the last call, in GiB, on CUDA; nothing elsewhere."""
    if torch.device(device).type != "cuda":
        return {}
    got = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return got


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio."""
    warm = int(cfg.warmup * total) if cfg.warmup < 1 else int(cfg.warmup)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def feature_scale_from(features: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """1 / RMS of every feature dimension (the target's outlier dimensions reach RMS ~10^2-10^3) over the
    positions `keep` marks ([n, L]; the data's, not the padding's, which an engine never computes)."""
    rows = features.float()[keep] if keep is not None else features.float().flatten(0, 1)
    return 1.0 / rows.pow(2).mean(dim=0).sqrt().clamp(min=1e-2)


def rows_per_batch(cfg: TrainConfig, train_rows: dict) -> int:
    """Whole packed rows per micro-batch (training and its held-out evaluation alike)."""
    return max(1, cfg.batch_tokens // train_rows["input_ids"].shape[1])


ENGINE_SIGNALLED = "a stop signal to the vLLM engines"  # the stop's name when only the engines got it


class Trainer:
    trackers = None  # --report-to's (train.trackers), on rank 0

    def __init__(self, target, drafter, train_rows: dict, eval_rows: dict | None, cfg: TrainConfig, *,
                 train_features=None, eval_features=None, keep_function: bool = False, run_config: dict | None = None):
        """`train_features`/`eval_features`: optional idx -> (features, final_hidden) of stored target
        outputs (FeatureMemo, DiskFeatures); without them the target runs in the loop. `keep_function`:
        the drafter is already trained, so rescaling its features must leave its outputs unchanged."""
        cfg.validate()
        # what train_config.json records (a RunConfig's dict; default: cfg); a resumed run keeps its own
        self.record = run_config or {"train": dataclasses.asdict(cfg)}
        self.train_features, self.eval_features = train_features, eval_features
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.keep_function = keep_function
        self.run = RunDir(cfg.out)  # everything written into --out goes through it
        self.out = self.run.path
        self.rows_per_batch = rows_per_batch(cfg, train_rows)
        R = train_rows["input_ids"].shape[0]
        self.rank, self.world = world()
        # one optimizer step takes grad_accum micro-batches on every rank
        self.micro_per_step = cfg.grad_accum * self.world
        self.steps_per_epoch = max(1, math.ceil(R / (self.rows_per_batch * self.micro_per_step)))
        self.total = cfg.steps or max(1, int(round(cfg.epochs * self.steps_per_epoch)))
        # outside a process group there is nothing to shard over (under torchrun a group of one GPU
        # still shards, so that one GPU runs FSDP's code path)
        self.fsdp = cfg.fsdp and grouped()
        # a sharded drafter's or target's forward is a collective: every rank runs the same forwards
        self.collective_forward = self.fsdp or getattr(target, "sharded", False)
        self.opt = self._optimizer()
        self.progress = {"step": 0, "tokens": 0, "elapsed": 0.0}
        self.saved_step = 0  # the step of the last complete checkpoint (0: none yet)
        self.best: dict | None = None  # --save-best: {"step", "eval_tau"} of the drafter in best/
        self._saved_at = time.monotonic()  # when the last checkpoint was written (--save-every-min)
        # the rows are split into `row_shards` fixed parts (default: one per rank), and rank r draws
        # only from part r: a rank's stored target outputs (the memo) hold its part, not every row
        self.row_shards = cfg.row_shards or self.world
        if self.row_shards > R:
            raise ValueError(f"{R} training rows cannot feed {self.row_shards} ranks; use more data or fewer ranks")
        self._order: dict[int, tuple[int, torch.Tensor]] = {}
        self._prefetch = None  # a feature cache is read one micro-batch ahead (prefetch.Prefetcher)
        drafter.gradient_checkpointing = cfg.gradient_checkpointing
        gpu = target.device.type == "cuda"
        # the next micro-batch's host bookkeeping is made on a thread while the device runs this one
        self.plan_ahead = gpu
        self._planned: dict = {}
        self._planner = None
        self.save_cadence, self.eval_cadence = self.cadences(cfg, gpu, self._note if self.rank == 0 else None)

    @staticmethod
    def cadences(cfg: TrainConfig, gpu: bool, say=None) -> tuple[Cadence, Cadence]:
        """(checkpoints', evaluations') cadence: on a GPU each bounded to GPU_WORK_SHARE of the wall time,
        except the evaluations of --save-best, which promises the best of every --eval-every one."""
        share = GPU_WORK_SHARE if gpu else None
        return (Cadence(cfg.save_every, share, first=not gpu, agree=rank0_says, what="checkpoint", say=say),
                Cadence(cfg.eval_every, None if cfg.save_best else share, agree=rank0_says,
                        what="held-out evaluation", say=say))

    @staticmethod
    def _note(line: str) -> None:
        """One line on stderr, below the progress bar rather than through it."""
        import sys

        from tqdm.auto import tqdm

        tqdm.write(f"blockdraft train: {line}", file=sys.stderr)

    def gamma(self):
        """This step's slot weighting (`gamma_schedule`): a fixed gamma, one following the acceptance,
        or D-PACE's (`loss.DPace`: the weights come from the step's own drafts)."""
        cfg = self.cfg
        if cfg.gamma_schedule == "fixed":
            return cfg.gamma
        from .loss import DPace, default_gamma

        if cfg.gamma_schedule == "dpace":
            return DPace(cfg.dpace_alpha)

        top = cfg.gamma if cfg.gamma is not None else default_gamma(self.drafter.block_size)
        return min(top, max(0.5, self.progress.get("tau_ema", 1.0) - 0.5))

    def _optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.95),
                                 **optimizer_options(self.target.device))

    def _shard(self) -> None:
        """FSDP2: shard the drafter once its feature scale and any resumed state are in place; the
        optimizer is rebuilt on the shards and given the (full) resumed optimizer state."""
        from .distributed import load_full_optimizer_state, shard_drafter

        resumed = self.opt.state_dict()
        shard_drafter(self.drafter, device=self.target.device)
        self.opt = self._optimizer()
        if resumed["state"]:
            load_full_optimizer_state(self.drafter, self.opt, resumed)

    def plain_drafter(self):
        """The drafter as one module with full tensors (gathered from the shards under FSDP: a
        collective, every rank calls it; only rank 0 gets the drafter, the others None)."""
        if not self.fsdp:
            return self.drafter
        from ..model import DFlashDrafter
        from .distributed import full_model_state

        sd = full_model_state(self.drafter)
        if self.rank != 0:
            return None
        plain = DFlashDrafter(self.drafter.config, initialize=False)  # every weight comes from the shards
        plain.load_state_dict(sd)
        plain.feature_scale.copy_(self.drafter.feature_scale.cpu())
        return plain

    @torch.no_grad()
    def feature_scale(self, n_rows: int = 4) -> torch.Tensor:
        """The per-dimension feature scale, from the first few training rows (the same rows on every
        rank, so every rank starts the same drafter; a memo does not keep them: they may be another
        rank's)."""
        from ..data.packing import padding

        idx = torch.arange(min(n_rows, self.train_rows["input_ids"].shape[0]))
        keep = ~padding({k: self.train_rows[k][idx] for k in ("loss_mask", "document_ids")})
        if self.train_features is not None:
            self._at(self.progress["step"])
            read = getattr(self.train_features, "compute", self.train_features)
            return feature_scale_from(read(idx).features, keep)
        b = rows_batch(self.train_rows, idx)
        dev = self.target.device
        return feature_scale_from(self.target(b.input_ids.to(dev), position_ids=b.position_ids.to(dev),
                                              return_logits=False).features, keep.to(dev))

    # ----------------------------------------------------------------- data order
    def global_micro(self, step: int, micro: int) -> int:
        """Index of a micro-batch in the run: rank r takes micro-batches r, r + W, ... of a step, so
        W processes with accumulation A see exactly the batches of one process with accumulation W*A."""
        return step * self.micro_per_step + micro * self.world + self.rank

    def anchor_generator(self, g: int) -> torch.Generator:
        """Anchors of micro-batch g come from their own seed: the same on any world size and after resume."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + g)

    def shard_rows(self, shard: int) -> torch.Tensor:
        """The training rows of one part: every `row_shards`-th row from `shard` on."""
        return torch.arange(shard, self.train_rows["input_ids"].shape[0], self.row_shards)

    def batch_indices(self, step: int, micro: int) -> torch.Tensor:
        """Rows of micro-batch `micro` of optimizer step `step` on this rank: micro-batch g of the run
        reads part g % row_shards, in a fixed permutation of that part per epoch (one part: a
        permutation of all rows, as before parts existed)."""
        g = self.global_micro(step, micro)
        shard, local = g % self.row_shards, g // self.row_shards
        rows = self.shard_rows(shard)
        epoch, start = divmod(local * self.rows_per_batch, rows.numel())
        return rows[self.epoch_order(epoch, shard)[start:start + self.rows_per_batch]]

    def epoch_order(self, epoch: int, shard: int = 0) -> torch.Tensor:
        """The permutation of a part's rows in an epoch, derived from (seed, epoch, part) and kept."""
        kept = self._order.get(shard)
        if kept is None or kept[0] != epoch:
            n = self.shard_rows(shard).numel()
            gen = torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch + 7919 * shard)
            kept = self._order[shard] = (epoch, torch.randperm(n, generator=gen))
        return kept[1]

    def schedule(self, start: int):
        """This rank's micro-batches from step `start` on, in the order it trains them: (step, slot, rows),
        slot the micro-batch's place among every rank's micro-batches of its step (a source that computes
        the target's outputs as they are reached asks for them in this order: train.online)."""
        for step in range(start, self.total):
            for micro in range(self.cfg.grad_accum):
                yield step, micro * self.world + self.rank, self.batch_indices(step, micro)

    def _begin_eval(self, step: int) -> None:
        """A source that computes held-out outputs on demand (train.online) is told this evaluation's
        reading order, so it can ask for all of it at once."""
        if hasattr(self.eval_features, "begin"):
            from .evaluate import eval_order

            order = eval_order(self.eval_rows, self.rows_per_batch, self.drafter.block_size,
                               collective_forward=self.collective_forward)
            self.eval_features.begin(((step, j, idx) for j, (_, idx, _) in enumerate(order)), phase=0)

    def _at(self, step: int) -> None:
        """Tell sources that compute on demand (train.online) which step reads what comes next."""
        for source in (self.train_features, self.eval_features):
            if hasattr(source, "at"):
                source.at(step)

    def micro_batch(self, step: int, micro: int):
        """(row indices, stored target outputs or None) of a micro-batch; a feature cache on disk is
        read one micro-batch ahead on a background thread while this one trains."""
        idx = self.batch_indices(step, micro)
        if self.train_features is None:
            return idx, None
        if not getattr(self.train_features, "prefetch", False):
            return idx, self.train_features(idx)
        from ..data.prefetch import Prefetcher

        if self._prefetch is None:
            self._prefetch = Prefetcher(self.train_features, pin=self.target.device.type == "cuda")
        nxt = (step, micro + 1) if micro + 1 < self.cfg.grad_accum else (step + 1, 0)
        got = self._prefetch.get(idx)
        if nxt[0] < self.total:
            self._prefetch.ask(self.batch_indices(*nxt))
        return idx, got

    def host_plan(self, step: int, micro: int, batch):
        """This micro-batch's host bookkeeping (step.plan_host), made ahead on a thread where
        `plan_ahead`; then the next one's is started. The anchors come from the micro-batch's own
        seed, so the plan is the same made here or there."""
        fut = self._planned.pop((step, micro), None)
        plan = fut.result() if fut is not None else self._plan(batch, step, micro)
        if self.plan_ahead:
            nxt = (step, micro + 1) if micro + 1 < self.cfg.grad_accum else (step + 1, 0)
            if nxt[0] < self.total:
                if self._planner is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._planner = ThreadPoolExecutor(1, thread_name_prefix="blockdraft-plan")
                idx = self.batch_indices(*nxt)  # here: the epoch orders are kept in a dict
                self._planned[nxt] = self._planner.submit(
                    lambda: self._plan(rows_batch(self.train_rows, idx), *nxt))
        return plan

    def _plan(self, batch, step: int, micro: int):
        return plan_host(batch, self.drafter.block_size, max_anchors=self.cfg.max_anchors,
                         generator=self.anchor_generator(self.global_micro(step, micro)))

    # --------------------------------------------------------------- checkpoints
    @property
    def ckpt_dir(self) -> Path:
        return self.run.checkpoint

    def checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: the drafter and AdamW's two moments, in fp32."""
        return self.run.checkpoint_bytes(sum(p.numel() for p in self.drafter.parameters()))

    def save(self) -> None:
        states: dict = {}
        if self.fsdp:  # gathered by every rank, written by one
            from .distributed import full_state

            states = dict(zip(("drafter_state", "optimizer_state"), full_state(self.drafter, self.opt)))
        if self.rank != 0:  # written once, atomically, by rank 0
            barrier()
            return
        step = self.progress["step"]
        keep = self.cfg.keep_checkpoints
        try:  # a swap holds the old checkpoint until the new one is complete: room for two
            self.run.save(drafter=self.drafter, optimizer=self.opt, progress=self.progress, keep=keep,
                          need_bytes=2 * self.checkpoint_bytes(), settings=self.record, **states)
        except (OSError, ValueError) as e:
            kept = self.saved_step
            raise ValueError(f"could not write the checkpoint of step {step} in {self.ckpt_dir} "
                             f"({getattr(e, 'strerror', None) or e}); "
                             + (f"the checkpoint of step {kept} is kept: free space and rerun with --resume"
                                if kept else "no earlier checkpoint exists: free space and rerun")) from None
        self.saved_step = step
        if self.trackers:  # the steps up to this checkpoint: those a --resume keeps
            self.trackers.flush()
        barrier()

    def resume(self) -> None:
        """From the newest complete checkpoint (`RunDir.load`), saying which (rank 0)."""
        import sys

        barrier()  # every rank reads the checkpoint rank 0 finished writing
        say = (lambda line: print(f"blockdraft train: warning: {line}", file=sys.stderr)) if self.rank == 0 else None
        path, self.progress = self.run.load(drafter=self.drafter, optimizer=self.opt, say=say)
        self.saved_step = self.progress["step"]
        if self.rank == 0:
            print(f"train: resuming from {path} (step {self.saved_step})", flush=True)
        if self.rank == 0:  # one writer (docs/scale.md, rule 5); the others wait below
            self.run.truncate_metrics(self.progress["step"])
        barrier()

    def log(self, record: dict) -> None:
        if self.rank == 0:
            self.run.append_metrics(record, kept=self.saved_step)  # never through a link
            if self.trackers:
                self.trackers.report(record)

    # ---------------------------------------------------------------------- loop
    def step(self) -> dict:
        cfg, s = self.cfg, self.progress["step"]
        t_start = time.perf_counter()
        rng = torch.get_rng_state()  # put back if the step is thrown away (StepLost)
        lr = lr_at(s, self.total, cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.drafter.train()
        self.drafter.train_progress = s / self.total  # where a kind's schedule stands (Domino's lambda)
        self.opt.zero_grad(set_to_none=True)
        agg: dict = {"loss": 0.0, "tau": 0.0, "accuracy": 0.0}
        gamma = self.gamma()
        dev, tokens, rows = self.target.device, 0, []
        waited = 0.0
        for micro in range(cfg.grad_accum):
            t_wait = time.perf_counter()
            idx, cached = self.micro_batch(s, micro)
            waited += time.perf_counter() - t_wait
            rows += idx.tolist()
            b = rows_batch(self.train_rows, idx)
            plan = self.host_plan(s, micro, b)
            if self.fsdp:  # reduce-scatter the gradients once, after the step's last micro-batch
                gradient_sync(self.drafter, micro == cfg.grad_accum - 1)
            with autocast_for(dev):
                loss, m = compute_loss(self.target, self.drafter, b, max_anchors=cfg.max_anchors, gamma=gamma,
                                       loss=cfg.loss, backend=cfg.backend, cached=cached, host_plan=plan)
            (loss / cfg.grad_accum).backward()
            for k in agg:
                agg[k] += m[k] / cfg.grad_accum
            tokens += int(b.input_ids.numel()) * self.world
        if not self.fsdp:  # FSDP has already reduce-scattered (averaged) the gradients
            average_gradients(self.drafter.parameters())
        agg["lost"] = float(bool(getattr(self.train_features, "lost", False)))  # a stopped engine's zeros read
        agg = all_reduce_mean(agg)
        if agg.pop("lost") > 0:  # on some rank: every rank throws the step away, as if it never started
            self.opt.zero_grad(set_to_none=True)
            torch.set_rng_state(rng)
            raise StepLost(f"step {s + 1} read features a stopped engine never made")
        self.progress["tokens"] += tokens
        agg["grad_norm"] = clip_grad_norm(self.drafter.parameters(), cfg.grad_clip)
        check_step(s + 1, agg["loss"], agg["grad_norm"], rows)  # the same on every rank (reduced): all stop
        self.opt.step()
        self.progress["step"] = s + 1
        # the training acceptance, smoothed (gamma_schedule "acceptance" follows it; saved, so resume is exact)
        self.progress["tau_ema"] = 0.9 * self.progress.get("tau_ema", agg["tau"]) + 0.1 * agg["tau"]
        step_s = time.perf_counter() - t_start  # the loss's host read above waited for the device
        agg.update(step=s + 1, lr=lr, tokens=self.progress["tokens"], step_s=step_s, feature_wait_s=waited,
                   gamma="dpace" if cfg.gamma_schedule == "dpace" else gamma,
                   tokens_per_s=tokens / step_s)
        peaks = memory_peaks(dev)  # this step's peaks on every rank, in GiB (CUDA): one collective for both
        if peaks:
            got = all_gather_floats(list(peaks.values()))  # rank 0's values, then rank 1's, ...
            agg.update({k: got[i::len(peaks)] for i, k in enumerate(peaks)})
        return agg

    def train(self, resume: bool = False) -> dict:
        from tqdm.auto import tqdm

        lead = self.rank == 0
        with StopSignals(lead) as signals:  # SIGTERM, SIGUSR1, a first Ctrl-C: save this step and stop
            if poll(signals.got is not None, False)[0]:  # asked while starting up: stop before writing anything
                self._close_helpers()
                raise Preempted(self.progress["step"], signals.got or "a signal another rank received", self.ckpt_dir,
                                starting=True, resumed=resume)
            self._start(resume, lead)
            if hasattr(self.train_features, "begin"):
                self.train_features.begin(self.schedule(self.progress["step"]))
            bar = tqdm(total=self.total, initial=self.progress["step"], disable=not (self.cfg.progress and lead),
                       desc="train", unit="step", dynamic_ncols=True)
            last_eval: dict = {}
            t0 = time.time() - self.progress["elapsed"]
            self._saved_at = time.monotonic()
            last_eval = self._owed_eval(bar)
            while self.progress["step"] < self.total:
                try:
                    m = self.step()
                except StepLost:  # the engines were stopped mid-step: the last whole step is saved
                    bar.close()
                    self._stop(None, signals.got or ENGINE_SIGNALLED)
                self.progress["elapsed"] = time.time() - t0
                m["elapsed"] = self.progress["elapsed"]
                step = self.progress["step"]
                stop, timed = poll(signals.got is not None, self._timed_save_due())  # every rank's, agreed
                if stop and step < self.total:
                    bar.close()
                    self._stop(m, signals.got)
                try:
                    got = self._evaluate(step, m, bar)
                except StepLost:  # during the held-out evaluation: this step is whole, and saved
                    bar.close()
                    self._stop(m, signals.got or ENGINE_SIGNALLED)
                last_eval = last_eval if got is None else got
                if step % self.cfg.log_every == 0 or "eval_tau" in m:
                    self.log(m)
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['accuracy']:.3f}", tau=f"{m['tau']:.2f}",
                                **({"eval_tau": f"{last_eval['eval_tau']:.2f}"} if last_eval else {}))
                bar.update(1)
                if self.save_cadence.due(step, self.total) or timed:
                    self._save_now()
            bar.close()
            self._finish(lead)
        trained()  # a stop signal from here on has nothing to stop (`preempt.starting_up`)
        return {"step": self.progress["step"], "tokens": self.progress["tokens"], **last_eval}

    def _owed_eval(self, bar) -> dict:
        """The evaluation a stop put off (`_stop`), run before a resumed run's first step: its figures
        join the step's line in metrics.jsonl (rewritten whole), and go to the trackers under that step
        (the training figures they already have are not sent again)."""
        owed = self.progress.pop("owed_eval", None)
        if owed is None:
            return {}
        step = self.progress["step"]
        got = self._evaluate(step, owed, bar, owed=True) or {}
        if got and self.rank == 0:
            self.run.truncate_metrics(step - 1)  # the step's line without its evaluation, when logged
            self.run.append_metrics(owed, kept=self.saved_step)
            if self.trackers:
                self.trackers.report({"step": step, **got} if step % self.cfg.log_every == 0 else owed)
        return got

    def _evaluate(self, step: int, m: dict, bar, owed: bool = False) -> dict | None:
        """The held-out evaluation where due (None where not; `owed`: one a stop put off, due now):
        every rank evaluates its share, rank 0 logs; then --save-best's drafter."""
        if self.eval_rows is None or not (owed or self.eval_cadence.due(step, self.total)):
            return None
        bar.set_description("train (evaluating)")
        self._begin_eval(step)
        got = self.eval_cadence.run(lambda: evaluate(
            self.target, self.drafter, self.eval_rows, self.cfg, self.rows_per_batch, self.eval_features,
            collective_forward=self.collective_forward))
        bar.set_description("train")
        if getattr(self.eval_features, "lost", None) is not None and all_reduce_mean(
                {"lost": float(self.eval_features.lost)})["lost"] > 0:  # a stopped engine's zeros: not logged
            raise StepLost(f"the evaluation after step {step} read features a stopped engine never made")
        m.update(got)
        if self.cfg.save_best and "eval_tau" in got:
            self._keep_best(step, got["eval_tau"])
        return got

    def _keep_best(self, step: int, tau: float) -> None:
        """--save-best: a held-out tau above the best so far puts this drafter in best/, swapped in
        whole with best.json (the same verdict on every rank: the tau is all-reduced; gathering a
        sharded drafter is a collective)."""
        if self.best is not None and tau <= self.best["eval_tau"]:
            return
        plain = self.plain_drafter()
        if self.rank == 0:
            save_drafter(plain, self.run.best, owner=self.run.owner, head_rows=self._head_rows(plain),
                         extra=self.run.best_files(step, tau))
        self.best = {"step": step, "eval_tau": tau}
        barrier()

    def _head_rows(self, drafter):
        return self.target.head_rows(drafter.draft_vocab) if drafter.config.draft_vocab_size else None

    def _timed_save_due(self) -> bool:
        """--save-every-min: this rank's clock says a save is due (rank 0's decides for all: `poll`)."""
        every = self.cfg.save_every_min
        return every is not None and time.monotonic() - self._saved_at >= 60 * every

    def _save_now(self) -> None:
        self.save_cadence.run(self.save)
        self._saved_at = time.monotonic()

    def _stop(self, m: dict | None, signame: str | None) -> None:
        """A stop was asked on some rank: this step logged (its held-out evaluation, if due, owed to
        --resume: the save comes first) and saved by every rank, the helper threads stopped; raises Preempted.
        `m` None: the step was thrown away (StepLost), the last whole one is saved."""
        step = self.progress["step"]
        if m is not None and step % self.cfg.log_every == 0:
            self.log(m)
        if m is not None and self.eval_rows is not None and "eval_tau" not in m and step % self.cfg.eval_every == 0:
            # the evaluation due here is owed: the checkpoint keeps this step's record, and --resume
            # evaluates first and completes the step's line (`_owed_eval`), as a run never stopped has it
            self.progress["owed_eval"] = m
        if self.saved_step != step or "owed_eval" in self.progress:
            self._save_now()
        self.progress.pop("owed_eval", None)
        self._close_helpers()
        if self.trackers:  # what they hold up to the checkpoint was flushed by the save
            self.trackers.close()
        raise Preempted(step, signame or "a signal another rank received", self.ckpt_dir)

    def _start(self, resume: bool, lead: bool) -> None:
        """Before the first step: room for the checkpoints, the resumed or fresh state, one drafter on
        every rank (then sharded), the run's config written."""
        self.out.mkdir(parents=True, exist_ok=True)
        if lead:  # found now, not after hours: the checkpoints kept and one more (the swap), the drafters
            self.run.check_space(self.run.run_bytes(sum(p.numel() for p in self.drafter.parameters()),
                                                    self.cfg.keep_checkpoints, self.cfg.save_best),
                                 "the checkpoints and the final drafter")
        if resume:
            self.resume()
            self.best = self.run.read_best() if self.cfg.save_best else None
        else:
            self.drafter.set_feature_scale(self.feature_scale(), keep_function=self.keep_function)
            if lead:
                self.run.start_metrics()
        # replicated and sharded training alike assume one drafter on every rank
        check_same(list(self.drafter.parameters()), "initial drafters")
        if self.fsdp:
            self._shard()
        if lead:  # whole or not at all; a resumed run records its own settings, not this command's
            if resume:
                self.record = self.run.resumed_settings(self.run.saved_settings()[0], self.record)
            self.run.write_settings(self.record)
            self.trackers = self.run.open_trackers(self.cfg, self.record, self.progress["step"] if resume else None)

    def _finish(self, lead: bool) -> None:
        """After the last step: the helper threads stopped, the final drafter written (rank 0)."""
        self._close_helpers()
        final = self.plain_drafter()
        if lead:
            try:
                save_drafter(final, self.out / "drafter", owner=self.run.owner, head_rows=self._head_rows(final))
            except OSError as e:
                raise ValueError(f"could not write the final drafter in {self.out / 'drafter'} ({e.strerror}); "
                                 f"the checkpoint of step {self.saved_step} is kept: free space and rerun with "
                                 "--resume to write it") from None
            if self.trackers:
                self.trackers.close()
        barrier()

    def _close_helpers(self) -> None:
        """The feature prefetcher and the planning thread stopped (after the last step or a stop)."""
        if self._prefetch is not None:
            self._prefetch.close()
        if self._planner is not None:
            self._planner.shutdown()

"""transformers as what runs the target, in this process (the default runner): its `generate` for
`regenerate` and `prompts`, its forward for `train` (the target loaded whole; its outputs computed by the
trainer each step, or once and kept: `features`) and for `extract` (one rank per shard set under torchrun).
"""

from __future__ import annotations

import torch

from .runners import Features, Runner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # "auto" is absent


def context_length(config, max_length: int | None = None) -> int | None:
    """The tokens a prompt and its answer may take: `max_length` where given, else the target's own
    context (its config's `max_position_embeddings`); one line where it asks for more than the target's."""
    config = getattr(config, "text_config", None) or config
    own = getattr(config, "max_position_embeddings", None) if config is not None else None
    if max_length and own and max_length > own:
        raise ValueError(f"--max-length {max_length} is longer than the target's context ({own} tokens, its "
                         "max_position_embeddings); pass at most that")
    return max_length or own


class TransformersGenerator:
    """The target's own `generate`: greedy in left-padded batches, sampled one prompt at a time, each from
    its own seed."""

    name = "transformers"

    def __init__(self, target, max_length: int | None = None):
        """`max_length`: the prompt and answer tokens one turn may take (default, and at most: the target's
        own context, `max_position_embeddings`)."""
        self.target, self.tokenizer = target, target.tokenizer
        self.context = context_length(getattr(target.model, "config", None), max_length)

    def check_sampling(self, sampling: dict) -> None:
        return None  # transformers samples anywhere

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_tokens: int | list[int], temperature: float = 0.0, top_p: float = 1.0,
                 seeds: list[int] | None = None,
                 stop_token_ids: list[int] | None = None) -> list[tuple[list[int], str]]:
        """(generated ids, finish reason: 'stop' where a stop token ends them, else 'length') per prompt; the
        ids run on past the stop and a prompt's own `max_tokens` (the caller cuts them)."""
        if isinstance(max_tokens, list):
            max_tokens = max(max_tokens)
        model, tok, stop = self.target.model, self.tokenizer, stop_token_ids
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if temperature > 0:
            rows = []
            for row, seed in zip(prompts, seeds):
                torch.manual_seed(seed)
                x = torch.tensor([row], device=model.device)
                gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                     do_sample=True, temperature=temperature, top_p=top_p, top_k=0, pad_token_id=pad,
                                     eos_token_id=stop)
                rows.append(gen[0, len(row):].tolist())
        else:
            width = max(len(r) for r in prompts)
            x = torch.tensor([[pad] * (width - len(r)) + r for r in prompts], device=model.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in prompts], device=model.device)
            gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=stop)
            rows = gen[:, width:].tolist()
        return [(r, "stop" if any(t in (stop or ()) for t in r) else "length") for r in rows]


class TransformersRunner(Runner):
    name = "transformers"
    title = "transformers"
    in_process = True

    def generator(self, target: str, *, device: str | None = None, spread: dict | None = None,
                  max_length: int | None = None, **_) -> TransformersGenerator:
        from ..target import TargetModel

        return TransformersGenerator(TargetModel.from_pretrained(target, device=device, **(spread or {})),
                                     max_length=max_length)

    def sampler(self, target: str, batch: int = 32):
        """Magpie's sampling function on the target's own `generate` (32 samples a call)."""
        from ..target import TargetModel, stop_token_ids

        model = TargetModel.from_pretrained(target)
        stop = stop_token_ids(model.tokenizer)

        def generate(prefix, n, max_tokens, temperature, top_p, seed):
            torch.manual_seed(seed)
            ids = torch.tensor([prefix])
            for s in range(0, n, batch):
                k = min(batch, n - s)
                out = model.model.generate(ids, do_sample=True, temperature=temperature, top_p=top_p,
                                           max_new_tokens=max_tokens, num_return_sequences=k, eos_token_id=stop,
                                           pad_token_id=stop[0])
                for row in out[:, len(prefix):].tolist():
                    cut = next((i for i, t in enumerate(row) if t in stop), None)
                    yield (row if cut is None else row[:cut]), cut is not None

        return generate, model.tokenizer

    def load_target(self, cfg, device: str):
        """The whole target, on `device` or spread and sharded as the run's target options say."""
        from ..target import TargetModel, spread_kwargs

        t = cfg.target
        return TargetModel.from_pretrained(t.target, layer_ids=t.layer_ids, num_features=t.num_features,
                                           device=device, shard=t.target_fsdp, **spread_kwargs(t, device))

    def features(self, cfg, target, train_rows: dict, eval_rows: dict | None, rank: int, world: int) -> Features:
        """The target's outputs computed once and kept (`--memo-features`: on, or auto under 4 GiB), else
        none: the trainer runs the target every step."""
        from ..data.features import FeatureMemo, memo_bytes

        memo = cfg.data.memo_features
        if getattr(target, "sharded", False):
            # a sharded target's forward is a collective: a rank that found a row in its memo would skip a
            # forward the others run (use `extract` once instead, and train from the cache); preflight
            # refuses --memo-features on here
            return Features()
        if memo == "on" or (memo == "auto" and memo_bytes(target, train_rows) < 4 * 2**30):
            return Features(FeatureMemo(target, train_rows), FeatureMemo(target, eval_rows) if eval_rows else None)
        return Features()

    def extract(self, target_opts, data, opts, engine, join) -> str:
        """The target in this process, one rank per shard set under torchrun (`join`), --out claimed by
        rank 0 before any rank writes."""
        from ..data.features import OWNER
        from ..process_group import barrier
        from ..rundir.directory import RunDir
        from ..target import pick_device

        rank, world_size, device = join(pick_device(target_opts.device))
        with RunDir(opts.out, OWNER).claim(lead=rank == 0):
            barrier()  # the other ranks write their shards once rank 0 owns the directory
            return extract_shards(target_opts, data, opts, rank, world_size, device)


def extract_shards(target_opts, data, opts, rank: int, world_size: int, device: str) -> str:
    """This rank's shards of `extract` (its share of the rows), the target's outputs at --dtype."""
    import dataclasses
    import time

    from ..data.features import auto_shard_rows, extract, throughput
    from ..data.pipeline import conversation_rows
    from ..process_group import barrier
    from ..target import TargetModel, spread_kwargs

    target = TargetModel.from_pretrained(target_opts.target, layer_ids=target_opts.layer_ids,
                                         num_features=target_opts.num_features, device=device,
                                         dtype=DTYPES.get(opts.target_dtype), **spread_kwargs(target_opts))
    rows, _ = conversation_rows(target.tokenizer, dataclasses.replace(data, eval_fraction=0.0), opts.seed)
    dtype = DTYPES.get(opts.dtype, target.dtype)
    shard_rows = opts.shard_rows or auto_shard_rows(target, rows["input_ids"].shape[1], dtype)
    t0 = time.perf_counter()
    out = extract(target, rows, opts.out, shard_rows=shard_rows, dtype=dtype, rank=rank, world=world_size,
                  batch_tokens=opts.batch_tokens or (16384 if target.device.type == "cuda" else 2048),
                  identity={"target_dtype": str(target.dtype).replace("torch.", "")})
    if rank == 0:
        throughput(rows["input_ids"].numel() // world_size, time.perf_counter() - t0, "this rank's share")
    barrier()  # the cache is complete once every rank has written its shards
    return str(out)


RUNNER = TransformersRunner()

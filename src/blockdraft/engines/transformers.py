"""transformers as what runs the target, in this process (the default engine): its `generate` for
`regenerate` and `prompts`, its forward for `train` and `extract` (which run it themselves: `in_process`).
"""

from __future__ import annotations

import torch

from .runners import Runner


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


RUNNER = TransformersRunner()

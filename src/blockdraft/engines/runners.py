"""What runs the target for a command, one `Runner` per engine (`engines.runner(name)`): transformers in
this process (`engines.transformers`), or vLLM in engine processes (`engines.vllm.runner`). A command
resolves its runner once and asks it for what it needs, never branching on its name:

* `options`: its options class (`engines.options.RunnerOptions` or a subclass holding its own settings),
  `flags(command)` the ones a command takes, `check(opts, command)` what it refuses of them;
* `in_process`: whether the target's layers run in this process (else only its embedding, final norm and
  head are loaded here, and the engine hands over the layer states);
* `generator(...)`: what writes answers for `regenerate` (`generate(prompt ids, ...) -> [(ids, reason)]`);
* `sampler(...)`: what samples Magpie prompts for `prompts`;
* `check_train(cfg)`, `load_target(cfg, device)`, `features(...)` (a `Features`), `trainer_gpu_offset(...)`,
  `trainer_memory_fraction(...)`: what `train` needs of it;
* `extract(...)`: `extract`'s shards.

A runner names no consumer: what reads blockdraft's files is a `base.Consumer` (`engines.consumer(name)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .options import RunnerOptions, own_fields


class EngineFailed(RuntimeError):
    """An engine (a process or server that runs the target) failed: one line naming why and its log."""


@dataclass
class Features:
    """What a training run reads the target's outputs from: `train_features` and `eval_features` (None: the
    trainer runs the target in this process), `served` what the engines served (summary.json records it;
    None: nothing to record), `close(ok)` when the run ends (engines stopped)."""

    train_features: object = None
    eval_features: object = None
    served: object = None

    def close(self, ok: bool) -> None:
        return None


class Runner:
    name = ""
    title = ""  # as a sentence names it
    in_process = True
    serves = False  # whether `blockdraft engine` runs its server for train on other nodes
    options = RunnerOptions

    def flags(self, command: str) -> tuple[str, ...]:
        """The names of this runner's own options that `command` takes as flags (default: all for train)."""
        return own_fields(self.options) if command == "train" else ()

    def add_flags(self, parser, command: str) -> None:
        """Its own flags for `command`, in a group of their own."""
        from ..options import add_options

        names = self.flags(command)
        if names:
            add_options(parser.add_argument_group(f"--engine {self.name}"), self.options, only=names)

    def check(self, opts, command: str) -> None:
        """Its settings against each other and the command, before any work (one line each)."""
        return None

    def generator(self, target: str, **options):
        raise NotImplementedError

    def sampler(self, target: str, batch: int = 32):
        raise NotImplementedError

    def check_train(self, cfg) -> None:
        return None

    def load_target(self, cfg, device: str):
        raise NotImplementedError

    def features(self, cfg, target, train_rows: dict, eval_rows: dict | None, rank: int, world: int) -> Features:
        raise NotImplementedError

    def trainer_gpu_offset(self, opts) -> int:
        return 0

    def trainer_memory_fraction(self, opts) -> float | None:
        return None

    def extract(self, target_opts, data, opts, engine, join) -> str:
        """`extract`'s shards written to `opts.out`; `join(device)`: how the command joins its ranks
        (rank, world size, device), for a runner that runs one process per rank."""
        raise NotImplementedError

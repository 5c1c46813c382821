"""What runs the target, as a command's options: `--engine` (the runner's name) is the one setting every
runner shares (`RunnerOptions`); each runner adds its own in a subclass it owns (`Runner.options`: vLLM's
are `vllm.engine_options.VllmOptions`). A run carries its runner's options and no other runner's: a
transformers run holds a `RunnerOptions`, a vLLM run a `VllmOptions`.

`engines.runner_options(values, command)` is the one way a command's engine settings are made, from its flags or
from a saved run configuration (train_config.json writes them as one `engine` section): the runner named
by `engine` takes its own fields; another runner's field set away from its default is refused in one
line naming the flags, and one at its default (a configuration written before the split) is dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..options import opt

RUNNERS = ("transformers", "vllm")  # what may run the target (--engine)


@dataclass
class RunnerOptions:
    """What runs the target."""

    engine: str = opt("transformers", "what runs the target: transformers (in this process; one rank per shard set "
                                      "under torchrun) or vllm (vLLM's own kernels and parallelism in engine "
                                      "processes beside this one; with train, features stream from it, no cache)",
                      choices=RUNNERS)


def own_fields(cls) -> tuple[str, ...]:
    """The fields a runner's options class adds to `RunnerOptions` (its own flags)."""
    shared = {f.name for f in dataclasses.fields(RunnerOptions)}
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in shared)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")

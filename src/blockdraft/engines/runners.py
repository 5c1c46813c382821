"""What runs the target for a command, one `Runner` per engine (`engines.runner(name)`): transformers in
this process (`engines.transformers`), or vLLM in engine processes (`engines.vllm.runner`). Commands ask it
for what they need and never branch on its name:

* `in_process`: whether the target's layers run in this process (else only its embedding, final norm and
  head are loaded here, and the engine hands over the layer states);
* `generator(...)`: what writes answers for `regenerate` (`generate(prompt ids, ...) -> [(ids, reason)]`);
* `sampler(...)`: what samples Magpie prompts for `prompts`;
* `check_train(cfg)`, `features(...)`, `trainer_gpu_offset(...)`, `trainer_memory_fraction(...)`: what
  `train` needs of an engine that runs elsewhere (none for one in this process);
* `extract(...)`: `extract`'s shards written from the engine (None: the caller runs the target itself).
"""

from __future__ import annotations


class Runner:
    name = ""
    in_process = True

    def generator(self, target: str, **options):
        raise NotImplementedError

    def sampler(self, target: str, batch: int = 32):
        raise NotImplementedError

    def check_train(self, cfg) -> None:
        return None

    def features(self, cfg, target, train_rows: dict, eval_rows: dict | None, rank: int, world: int):
        return None

    def trainer_gpu_offset(self, opts) -> int:
        return 0

    def trainer_memory_fraction(self, opts) -> float | None:
        return None

    def extract(self, target_opts, data, opts, engine) -> str | None:
        return None

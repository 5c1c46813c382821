"""Everything blockdraft knows about vLLM and runs of it, in one package:

- `consumer`: vLLM as a consumer of blockdraft's drafters (formats it reads, kinds it serves, which
  target classes it serves and captures), read from vLLM's own source;
- `job`: one vLLM engine per process (regeneration, serving a drafter), its log and its failures;
- `runner`: vLLM as what runs the target for a command (`engines.runner("vllm")`), through `online`
  (train's features) and `extract` (extract's shards);
- `engine_options`: `VllmOptions`, the runner's own options (`--engine vllm`), and their machine defaults;
- `cores`: each CPU engine rank on cores of its own; `states`: a document's states file (one copy each way);
- `spool`, `feed`, `launch`: engine replicas that capture the target's states into a bounded spool,
  and how they are started, joined, watched and stopped;
- `capture`: the readers' side (aux ids, documents, states put together in reading order);
- `connector`: the hidden-states connector blockdraft's engines write those states with;
- `plugin`: layer states for target classes vLLM wrote without them (GLM-4.x MoE first).

(What an engine GPU holds, estimated, is benchmarks/engine_plan.py's: benchmarks/online.py is its user.)

Nothing here imports vLLM at import time: an engine runs in its own process, possibly in another
environment (`--engine-python`), where `feed`, `spool`, `connector` and `plugin` are what it imports.
"""

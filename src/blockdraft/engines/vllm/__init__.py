"""Everything blockdraft knows about vLLM and runs of it, in one package:

- `consumer`: vLLM as a consumer of blockdraft's drafters (formats it reads, kinds it serves, which
  target classes it can capture), read from vLLM's own source;
- `job`: one vLLM engine per process (regeneration, serving a drafter), its log and its failures;
- `capture`: `extract --engine vllm`: vLLM's `extract_hidden_states` writes the target's states;
- `connector`: the hidden-states connector blockdraft's engines write those states with;

Nothing here imports vLLM at import time: an engine runs in its own process.
"""

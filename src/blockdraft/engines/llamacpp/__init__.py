"""Everything blockdraft knows about llama.cpp and runs of it, in one package:

- `consumer`: llama.cpp as a consumer of blockdraft's drafters (the GGUF it reads, the kinds it serves
  and how llama-server is told each, which targets its graph can capture), read from its source;
- `server`: llama-server run on a target GGUF with and without a drafter GGUF, and what it computes
  compared with blockdraft's own drafter.
"""

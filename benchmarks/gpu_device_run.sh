#!/usr/bin/env bash
# The GPU check as the lent GPU machine runs it, from the repo root, in one command:
#   bash benchmarks/gpu_device_run.sh [--cpu] [gpu_check flags...]
# OUT (default runs/gpu-check) receives at most 8 files of at most 16 MiB: env.txt (the machine),
# gpu-check.json (the report, rewritten after every part), gpu-check-logs.txt (each part's log
# tail) and run.log (this run's own output). GPU_CHECK_BUDGET_S bounds the check (default 420 s);
# a timeout 60 s later stops it with SIGTERM, which still leaves the report of the parts done.
# PYTHON (default python3: on the GPU image, the one with torch) runs it; blockdraft comes from src/.
# The random targets' tokenizer travels in .gpu/tokenizer (benchmarks/gpu_prepare.sh makes it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-check}"
BUDGET="${GPU_CHECK_BUDGET_S:-420}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
{
  echo "date: $(date -u +%FT%TZ)"; echo "uname: $(uname -a)"; echo "nproc: $(nproc)"
  echo "--- python"; "$PY" -c 'import sys; print(sys.version)'
  echo "--- packages"
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|triton|accelerate|safetensors|tqdm|numpy|gguf) ' || true
  echo "--- disk"; df -h . "${TMPDIR:-/tmp}" 2>&1
  echo "--- memory"; free -g 2>&1 || true
  echo "--- nvidia-smi"; nvidia-smi 2>&1 || echo "no nvidia-smi"
} > "$OUT/env.txt" 2>&1
TOK=()
[ -d .gpu/tokenizer ] && TOK=(--tokenizer .gpu/tokenizer)
PYTHONUNBUFFERED=1 timeout -k 30 $((BUDGET + 60)) "$PY" benchmarks/gpu_check.py --out "$OUT" --budget-s "$BUDGET" \
  "${TOK[@]}" "$@" > "$OUT/run.log" 2>&1
code=$?
tail -c 20000 "$OUT/run.log"
# what comes back: at most 16 MiB a file (keep the end of a longer one)
for f in "$OUT"/*; do
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 16000000 ]; then
    tail -c 15000000 "$f" > "$f.cut" && mv "$f.cut" "$f"
  fi
done
ls -l "$OUT"
exit $code

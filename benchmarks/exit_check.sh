#!/usr/bin/env bash
# Does a finished torchrun run exit 0 every time? The GPU check's CPU-mode quick run (2 gloo ranks, a
# random tiny target, --fsdp --target-fsdp, 3 steps) N times with blockdraft's exit after leaving the
# group and N times with the interpreter's full teardown (BLOCKDRAFT_FULL_TEARDOWN=1, the control),
# alternated so both see the same load; counts the exit codes and SIGABRTs and writes a JSON report.
#   PYTHON     an interpreter with torch (default .venv-gpu-image/bin/python, the GPU image's versions)
#   TOKENIZER  random targets' tokenizer files (default .gpu/tokenizer: benchmarks/gpu_prepare.sh)
#   usage: bash benchmarks/exit_check.sh N [report.json]
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:-20}"; REPORT="${2:-benchmarks/results/exit-check.json}"
PY="${PYTHON:-.venv-gpu-image/bin/python}"; TOK="${TOKENIZER:-.gpu/tokenizer}"
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
"$PY" - "$WORK/data.jsonl" <<'PY'
import gzip, sys
with gzip.open("src/blockdraft/assets/data/default.jsonl.gz", "rt") as f, open(sys.argv[1], "w") as g:
    for i, line in zip(range(120), f):
        g.write(line)
PY
declare -A ok abort other
for mode in exit teardown; do ok[$mode]=0; abort[$mode]=0; other[$mode]=0; done
for i in $(seq 1 "$N"); do
  for mode in exit teardown; do
    rm -rf "$WORK/out"
    flag=""; [ "$mode" = teardown ] && flag=1
    env -u PYTHONPATH PYTHONPATH="$PWD/src" BLOCKDRAFT_TOKENIZER="$TOK" BLOCKDRAFT_FULL_TEARDOWN="$flag" OMP_NUM_THREADS=1 \
      "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 -m blockdraft train --target random:tiny \
      --max-length 256 --draft-layers 1 --block-size 8 --max-anchors 16 --draft-vocab 4096 --batch-tokens 512 \
      --grad-accum 2 --fsdp --target-fsdp --gradient-checkpointing --max-eval-rows 4 --threads 1 --device cpu \
      --steps 3 --eval-every 3 --save-every 3 --data "$WORK/data.jsonl" --out "$WORK/out" --no-progress \
      > "$WORK/log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then ok[$mode]=$((ok[$mode] + 1))
    elif grep -q "exitcode: -6" "$WORK/log"; then abort[$mode]=$((abort[$mode] + 1))
    else other[$mode]=$((other[$mode] + 1)); tail -5 "$WORK/log"; fi
  done
  echo "run $i: exit ${ok[exit]} ok ${abort[exit]} aborted; teardown ${ok[teardown]} ok ${abort[teardown]} aborted"
done
torch=$("$PY" -c 'import torch; print(torch.__version__)')
cat > "$REPORT" <<JSON
{"command": "bash benchmarks/exit_check.sh $N", "torch": "$torch", "runs_each": $N,
 "exit_after_group": {"exit_0": ${ok[exit]}, "sigabrt": ${abort[exit]}, "other": ${other[exit]}},
 "full_teardown": {"exit_0": ${ok[teardown]}, "sigabrt": ${abort[teardown]}, "other": ${other[teardown]}}}
JSON
cat "$REPORT"

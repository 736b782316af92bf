#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install, run the CUDA checks (oracle, out of memory) and the bench,
# printing one table each. Nothing here runs on CPU-only machines; until it has run on a GPU, the CUDA
# paths are unverified.
#
#   scripts/gpu_check.sh [MODEL]     (default: the embedded smollm2-135m)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "no NVIDIA GPU here (nvidia-smi -L failed)" >&2; exit 2; }
MODEL=${1:-smollm2-135m}
bash scripts/install.sh            # with nvidia-smi present it installs PyPI's CUDA torch
.venv/bin/python scripts/gpu_check.py "$MODEL"
.venv/bin/tokenflow bench --model "$MODEL" --engines paged --concurrency 16,1 --requests 32 --rounds 1 \
    --dtype bfloat16 --settings '{"device": "cuda"}' --json gpu_bench.json

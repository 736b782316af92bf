#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install tokenflow, then run the CUDA checks of scripts/gpu_check.py (load,
# oracle against transformers, device sampling, real-size shapes against the roofline and transformers' fast
# paths, out of memory under a real allocation limit, speed with and without CUDA graphs) and print one table.
# Arguments go to gpu_check.py, e.g. --json FILE.
#
#   scripts/gpu_check.sh [MODEL] [--json FILE]          (default MODEL: the embedded smollm2-135m)
#   scripts/gpu_check.sh --dry-run [--json FILE]        (no GPU: the same code on the CPU, tiny shapes; CI runs it)
#
# Offline (no package index): make tokenflow and its dependencies importable by some python (e.g. wheels
# installed with `pip install --no-index --target DIR` and DIR on PYTHONPATH) and name it:
#   GPU_CHECK_PYTHON=python3 scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in
    *" --dry-run "*) ;;
    *) nvidia-smi -L || { echo "no NVIDIA GPU here (nvidia-smi -L failed); --dry-run runs on the CPU" >&2; exit 2; } ;;
esac
python=${GPU_CHECK_PYTHON:-}
if [ -z "$python" ]; then
    bash scripts/install.sh            # with nvidia-smi present it installs PyPI's CUDA torch
    python=.venv/bin/python
fi
PYTHONUNBUFFERED=1 "$python" scripts/gpu_check.py "$@"

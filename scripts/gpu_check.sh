#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install tokenflow, then run the CUDA checks of scripts/gpu_check.py (load,
# oracle against transformers, device sampling, real-size shapes against the roofline and transformers' fast
# paths, out of memory under a real allocation limit, speed with and without CUDA graphs) and print one table.
# Arguments go to gpu_check.py, e.g. --json FILE.
#
#   scripts/gpu_check.sh [MODEL] [--json FILE]          (default MODEL: the embedded smollm2-135m)
#   scripts/gpu_check.sh --dry-run [--json FILE]        (no GPU: the same code on the CPU, tiny shapes; CI runs it)
#
# Offline (no package index): with .gpu-wheels/ from scripts/gpu_wheels.sh carried beside it, the image's python3
# runs it with those wheels installed into .gpu-site/; or make tokenflow and its dependencies importable by some
# python yourself and name it:
#   GPU_CHECK_PYTHON=python3 scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in
    *" --dry-run "*) ;;
    *) nvidia-smi -L || { echo "no NVIDIA GPU here (nvidia-smi -L failed); --dry-run runs on the CPU" >&2; exit 2; } ;;
esac
python=${GPU_CHECK_PYTHON:-}
if [ -z "$python" ] && [ -d .gpu-wheels ]; then  # carried from scripts/gpu_wheels.sh: the image's python3 + them
    python3 -m pip install --quiet --no-index --no-deps --upgrade --target .gpu-site .gpu-wheels/*.whl
    export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
    python=python3
elif [ -z "$python" ]; then
    bash scripts/install.sh            # with nvidia-smi present it installs PyPI's CUDA torch
    python=.venv/bin/python
fi
PYTHONUNBUFFERED=1 "$python" scripts/gpu_check.py "$@"

#!/usr/bin/env bash
# Create .venv and install tokenflow (distribution `tokenflow-engine`) from this checkout.
#
#   scripts/install.sh            the slim core: enough for `tokenflow generate` and the Python API; no sudo
#   scripts/install.sh --dev      the core, the test extras, the redact and Redis plugins under plugins/, and
#                                 redis-server (from apt when missing): what `python -m pytest` needs
#   scripts/install.sh --dev-all  also the heavy test tools and the tests that need them (conftest.py): the Ray
#                                 plugin (Ray, pyarrow), Playwright with Debian's chromium, lm-eval, and the docs
#                                 site's tools (docs/requirements.txt); what CI runs
#
# On a machine without an NVIDIA GPU it installs the CPU build of torch 2.13
# (set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where PyPI's
# default torch wheel would be the multi-GB CUDA build); with a GPU, plain
# `torch` from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=core
case "${1:-}" in
    "") ;;
    --dev) MODE=dev ;;
    --dev-all) MODE=dev-all ;;
    *) echo "usage: $0 [--dev | --dev-all]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
source scripts/torch.sh
install_torch "${PIP[@]}"
if [ "$MODE" = core ]; then
    "${PIP[@]}" -e .
else
    # The plugins are installed from their folders in the same command, so `tokenflow-engine[...]`
    # and the plugins' own `tokenflow-engine` requirement resolve to this checkout, not to an index.
    PROGRAMS=(redis-server)  # the shared-tier tests
    if [ "$MODE" = dev ]; then
        "${PIP[@]}" -e ".[dev]" -e plugins/tokenflow-redact -e plugins/tokenflow-redis
    else
        "${PIP[@]}" -e ".[dev-all]" -e plugins/tokenflow-redact -e plugins/tokenflow-redis -e plugins/tokenflow-ray \
            -r docs/requirements.txt
        PROGRAMS+=(chromium)  # the dashboard test (Playwright drives it)
    fi
    MISSING=()
    for program in "${PROGRAMS[@]}"; do command -v "$program" >/dev/null 2>&1 || MISSING+=("$program"); done
    if [ ${#MISSING[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
        SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
        $SUDO apt-get install -y -qq "${MISSING[@]}" >/dev/null 2>&1 \
            || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${MISSING[@]}" >/dev/null; }
    fi
fi
.venv/bin/python - "$MODE" <<'PY'
import sys

import torch

kind = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
print(f"tokenflow ({sys.argv[1]}) installed in .venv (torch {torch.__version__}, {kind} build)")
PY

#!/usr/bin/env bash
# Build tokenflow's wheel and sdist, and the plugins' wheels, into dist/; check them with `twine check --strict`;
# install the wheel into a fresh venv as a user would and run the quickstart's first command from it; then
# show that a missing extra is one line and that a plugin extra resolves from the wheels in dist/.
#
#   scripts/check_wheel.sh          needs `build` and `twine` in .venv (scripts/install.sh --dev installs them)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch.sh
PY=${PYTHON:-.venv/bin/python}
rm -rf dist
"$PY" -m build --outdir dist . >/dev/null
for plugin in plugins/*/; do "$PY" -m build --wheel --outdir dist "$plugin" >/dev/null; done
ls -l dist
"$PY" -m twine check --strict dist/*

VENV=$(mktemp -d)/venv
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)  # .pyc at first import
started=$(date +%s)
install_torch "${PIP[@]}"
"${PIP[@]}" --find-links dist tokenflow-engine
echo "wheel installed into a fresh venv in $(( $(date +%s) - started )) s ($(du -sh "$VENV" | cut -f1))"
answer=$("$VENV/bin/tokenflow" generate "What is the capital of France? Answer in one sentence." --temperature 0)
echo "$answer"
grep -q "Paris" <<<"$answer"

# the slim install has no server: `tokenflow serve` says which extra to install, in one line
if "$VENV/bin/tokenflow" serve --port 0 2>"$VENV/serve.err"; then echo "serve ran without the server extra"; exit 1; fi
cat "$VENV/serve.err"
[ "$(wc -l <"$VENV/serve.err")" -eq 1 ] && grep -q "pip install 'tokenflow-engine\[server\]'" "$VENV/serve.err"

# a plugin extra resolves from the wheels built beside the engine's
"${PIP[@]}" --find-links dist "tokenflow-engine[redis]"
"$VENV/bin/tokenflow" plugins | grep -E "^kv tier +redis "
rm -rf "$(dirname "$VENV")"
echo "wheel check passed"

#!/usr/bin/env bash
# Wheels for the lent GPU machine, which has no package index: tokenflow itself and the dependencies its image
# lacks (it holds torch, triton, tokenizers, accelerate, numpy, psutil, anyio; see the device tool's KINDS.md),
# for its Python (3.12 unless GPU_PYTHON says otherwise), into .gpu-wheels/ (git ignores it, ~18 MB). Carry that
# folder with the device tool's `run` (carry: [".gpu-wheels"]); scripts/gpu_check.sh installs it there:
#
#   bash scripts/gpu_wheels.sh            # here, with the package registries
#   bash scripts/gpu_check.sh --json $OUT/gpu_check.json       # there
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
pip=${PIP:-.venv/bin/pip}
rm -rf "$dest"
mkdir -p "$dest"
platforms=()
for tag in manylinux2014 manylinux_2_17 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
"$pip" download --quiet --dest "$dest" --only-binary=:all: --no-deps --implementation cp \
    --python-version "${GPU_PYTHON:-3.12}" "${platforms[@]}" \
    "transformers>=5.23,<5.25" "msgspec>=0.18" "diskcache>=5.6" "cachetools>=5.3" "llguidance>=1.7,<2" "gguf>=0.10"
"$pip" wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dest" .  # tokenflow: its entry points find the stages
ls -1 "$dest"
du -sh "$dest"

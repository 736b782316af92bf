# Sourced by the install scripts: install_torch PIP_COMMAND... installs the torch a machine should get.
# Without an NVIDIA GPU the CPU build of torch 2.13 (set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# where PyPI's default torch wheel would be the multi-GB CUDA build); with a GPU, plain `torch` from PyPI.
install_torch() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$@" torch
    else
        "$@" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
}

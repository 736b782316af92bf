"""Tests whose tools are heavy (Ray, Playwright with Chromium, lm-eval with pyarrow and pandas) run where
`scripts/install.sh --dev-all` installed them; with `--dev` they are left out of collection, said once in the
report header. CI sets TFTESTS_ALL=1, so there a missing tool is an error, never a silent gap."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# test file or folder -> the modules it needs that `--dev` does not install
NEEDS_DEV_ALL = {
    "tests/serve/test_dashboard.py": ("playwright",),
    "tests/serve/test_lm_eval.py": ("lm_eval",),
    "tests/runtime/test_triton_decode.py": ("triton",),  # the GPU kernels on Triton's interpreter
    "tests/runtime/test_triton_pointwise.py": ("triton",),
    "tests/runtime/test_triton_varlen.py": ("triton",),
    "tests/runtime/test_triton_compile.py": ("triton",),  # and compiled for sm_80 / sm_90
    "plugins/tokenflow-ray/tests": ("ray", "tokenflow_ray"),
}


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


# Where no GPU is, Triton kernels (tests/runtime/test_triton_decode.py) run on Triton's interpreter, which has to be
# chosen before triton is imported (its own library's functions are compiled or interpreted from then on), and
# test modules import it through transformers and torchao.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LEFT_OUT = {path: missing for path, modules in NEEDS_DEV_ALL.items() if (missing := _missing(modules))}
_ROOT = Path(__file__).parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out what LEFT_OUT names, even where it is a `testpaths` entry (which `collect_ignore` keeps)."""
    left_out = any(collection_path == _ROOT / path or (_ROOT / path) in collection_path.parents for path in LEFT_OUT)
    return True if left_out else None


def pytest_configure(config: pytest.Config) -> None:
    if LEFT_OUT and os.environ.get("TFTESTS_ALL") == "1":
        raise pytest.UsageError(f"TFTESTS_ALL=1 but these tests cannot run: {LEFT_OUT} "
                                "(install them with scripts/install.sh --dev-all)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"not collected, needs scripts/install.sh --dev-all: {path} ({', '.join(missing)} missing)"
            for path, missing in LEFT_OUT.items()]

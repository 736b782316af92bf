"""scripts/gpu_check.sh --dry-run: the GPU check a lent machine runs, run here end to end on the CPU.

A GPU is lent to some sessions only, for minutes: the script it gets must already work. The dry run takes the
same code paths with tiny shapes (decode steps at fixed shapes run eagerly, as the graphs record them), so a
broken import, a renamed setting or a wrong table column fails here, not on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tokenflow.runtime.gpu.triton_launch import triton_available

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "PATH": os.environ.get("PATH", "")}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert results["oracle_tiny"]["identical"] == results["oracle_tiny"]["of"] == 10
    sampling = results["sampling"]
    assert sampling["identical"] == 16 and sampling["device_sampled_steps"] > 0
    assert sampling["host_run_device_sampled_steps"] == 0
    for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"):
        shape = results[f"shape {name}"]
        for figures in shape["decode"].values():
            assert 0 < figures["of_roofline"] < 1
            assert figures["step_ms_device_greedy"] > 0 and figures["step_ms_logits_to_host"] > 0
            if triton_available():  # the Triton decode kernel, on its interpreter here (conftest.py)
                triton = figures["triton"]
                assert triton["step_ms_device_greedy"] > 0 and 0 < triton["of_roofline"] < 1
                assert triton["max_logit_diff"] <= 0.02 * triton["max_logit"]
        assert 0 < shape["prefill"]["of_roofline"] < 1
        assert shape["transformers_static_b1"]["tokens_per_s"] > 0
        assert shape["transformers_generate_batch_c16"]["tokens"] == 4 * 8  # every request its 8 tokens
        assert shape["graphs"]["device_sampled_steps"] > 0
    goals = results["goals"]  # the goals this run measured, each with its verdict
    assert {"llama-3.1-8b: batch-1 decode of the roofline", "llama-3.1-8b: 2k prefill of the roofline",
            "llama-3.1-8b: batch 1 vs transformers' compiled static cache"} <= set(goals)
    assert all(isinstance(goal["met"], bool) for goal in goals.values())


def test_without_a_gpu_the_real_check_refuses_to_start() -> None:
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_CHECK_PYTHON": sys.executable})
    assert done.returncode == 2 and "--dry-run runs on the CPU" in done.stderr

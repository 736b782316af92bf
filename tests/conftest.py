"""Shared fixtures: a tiny random-weight model (fast, no download) and the real
embedded default model (slow tests only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from tokenflow.testing import build_tiny_model

# CI machines are small and shared: judge properties, not per-example speed.
settings.register_profile("tokenflow", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tokenflow")

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with GQA and a trained byte-level BPE tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an 8k context: for prompts and streams longer than 2,048 tokens."""
    return build_tiny_model(tmp_path_factory.mktemp("models-8k") / "tiny-llama", max_position_embeddings=8192)


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The embedded default (SmolLM2-135M-Instruct), fetched and converted once per machine."""
    from tokenflow.hub import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def real_hf_model(real_model: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(real_model)


@pytest.fixture(autouse=True)
def _clean_tokenflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine settings from the developer's shell must not leak into tests. The suite's oracle is
    transformers in fp32, so engines default to fp32 here (what dtype="auto" picks is tested itself,
    in tests/runtime/test_dtype_auto.py); subprocesses (`tokenflow serve`) inherit it."""
    import os

    for key in list(os.environ):
        if key.startswith("TOKENFLOW_") and key not in ("TOKENFLOW_HOME",):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TOKENFLOW_DTYPE", "float32")


_REAL_MODEL_FIXTURES = {"real_model", "real_hf_model", "real_tokenizer"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need the real model are slow (first use fetches and converts it)."""
    for item in items:
        if _REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

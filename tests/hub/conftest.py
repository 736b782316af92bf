"""Fixtures for model-resolution tests: tiny models built once per session, a throwaway home."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _tiny_models as tiny


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.make_hf_folder(tmp_path_factory.mktemp("tiny-hf") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.make_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty tokenflow home; $TOKENFLOW_HOME points at it too, so nothing touches the user's cache."""
    path = tmp_path / "home"
    monkeypatch.setenv("TOKENFLOW_HOME", str(path))
    return path

"""A pytest plugin (entry point `pytest11`) so an app's asyncio tests get an engine in one line.

Fixtures:
- `tokenflow_model`: the model path the engine loads. By default a tiny
  random-weight Llama with a real trained tokenizer, built once per session in
  a temporary folder (milliseconds per step, the same code paths as a real
  model, no download). `--tokenflow-model=smollm2-135m` (or any model tokenflow
  resolves), or the `TOKENFLOW_TEST_MODEL` environment variable, points the
  same tests at a real model.
- `tokenflow_settings`: engine settings for the fixture (override it in a
  conftest to change them).
- `tokenflow_engine`: a started `Engine`, closed after the test, for
  pytest-asyncio tests (asyncio).
- `tokenflow_anyio_engine`: the same for tests that run under anyio's pytest
  plugin (`@pytest.mark.anyio`), on whichever backend `anyio_backend` names:
  asyncio or trio.

    async def test_four_tokens(tokenflow_engine):
        done = await tokenflow_engine.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4

    @pytest.fixture(params=["asyncio", "trio"])
    def anyio_backend(request):
        return request.param

    @pytest.mark.anyio
    async def test_on_trio_too(tokenflow_anyio_engine):
        done = await tokenflow_anyio_engine.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4

Importing this module (pytest does, in every run of an environment that has
tokenflow) loads no torch: the engine's modules load when a fixture starts one.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

try:  # strict-mode pytest-asyncio needs its own decorator for async fixtures
    from pytest_asyncio import fixture as _async_fixture
except ImportError:  # anyio's plugin (or pytest-asyncio's auto mode) handles plain ones
    _async_fixture = pytest.fixture


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokenflow")
    group.addoption("--tokenflow-model", default=None,
                    help="model for the tokenflow_engine fixture (default: a tiny random-weight model)")


@pytest.fixture(scope="session")
def tokenflow_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    chosen = request.config.getoption("--tokenflow-model") or os.environ.get("TOKENFLOW_TEST_MODEL")
    if chosen:
        return str(chosen)
    from tokenflow.testing import build_tiny_model

    return str(build_tiny_model(Path(tmp_path_factory.mktemp("tokenflow")) / "tiny-llama"))


@pytest.fixture
def tokenflow_settings() -> dict[str, Any]:
    return {"max_num_seqs": 8}


@_async_fixture
async def tokenflow_engine(tokenflow_model: str, tokenflow_settings: dict[str, Any]) -> AsyncIterator[Any]:
    from tokenflow.engine import Engine

    async with Engine(tokenflow_model, **tokenflow_settings) as engine:
        yield engine


@pytest.fixture
async def tokenflow_anyio_engine(
    anyio_backend: Any, tokenflow_model: str, tokenflow_settings: dict[str, Any]
) -> AsyncIterator[Any]:
    """Run by anyio's plugin (it requests `anyio_backend`), so it starts in the test's own event loop."""
    from tokenflow.engine import Engine

    async with Engine(tokenflow_model, **tokenflow_settings) as engine:
        yield engine

"""A pytest plugin (entry point `pytest11`) so an app's async tests get an engine in one line.

It needs no configuration: the same tests run under pytest-asyncio's strict mode (its default: no
`asyncio_mode` set, no `@pytest.mark.asyncio` needed on them), its auto mode, and anyio's plugin.

Fixtures:
- `tokenflow_model` (session): the model path the engines load. By default a tiny
  random-weight Llama with a real trained tokenizer, built once per session in
  a temporary folder (milliseconds per step, the same code paths as a real
  model, no download). `--tokenflow-model=smollm2-135m` (or any model tokenflow
  resolves), or the `TOKENFLOW_TEST_MODEL` environment variable, points the
  same tests at a real model.
- `tokenflow_session_settings` (session): engine settings (`Engine` keywords) for
  `tokenflow_session_engine`, and the defaults of `tokenflow_settings`. Override it in a conftest.
- `tokenflow_settings`: engine settings for the per-test engines (a copy of
  `tokenflow_session_settings` unless overridden).
- `tokenflow_engine`: a started `Engine`, closed after the test (pytest-asyncio).
- `tokenflow_session_engine`: one started `Engine` for the whole session (the
  model loads once), on pytest-asyncio's session event loop; closed at the end.
  Its state (requests in flight, caches, adapters loaded) carries from test to test.
  Without pytest-asyncio, anyio's plugin runs it too, given a session-scoped
  `anyio_backend` fixture (anyio's rule for session-scoped async fixtures).
- `tokenflow_anyio_engine`: like `tokenflow_engine`, for tests run by anyio's
  pytest plugin (it requests `anyio_backend`, so such a test is anyio's, marked
  `@pytest.mark.anyio` or not), on whichever backend `anyio_backend` names:
  asyncio or trio. Not under pytest-asyncio's auto mode, which claims every
  async test, anyio's too (its rule, not ours).

    async def test_four_tokens(tokenflow_engine):
        done = await tokenflow_engine.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4

    async def test_on_the_shared_engine(tokenflow_session_engine):
        done = await tokenflow_session_engine.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4

    @pytest.fixture(params=["asyncio", "trio"])
    def anyio_backend(request):
        return request.param

    @pytest.mark.anyio
    async def test_on_trio_too(tokenflow_anyio_engine):
        done = await tokenflow_anyio_engine.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4

How: where pytest-asyncio is active, an `async def` test that uses `tokenflow_engine` or
`tokenflow_session_engine` (directly or through fixtures of its own) and carries no asyncio, anyio
or trio marker gets `@pytest.mark.asyncio` at collection, before pytest-asyncio decides how to run
it; with `loop_scope="session"` when it uses `tokenflow_session_engine`, since an engine serves
only the event loop that started it (a bare `@pytest.mark.asyncio` on such a test is widened to the
session loop too; an explicit other `loop_scope` is left alone and the engine refuses the call).
Tests that use `anyio_backend` (so `tokenflow_anyio_engine`) are anyio's and left alone. Don't use
`tokenflow_engine` and `tokenflow_session_engine` in one test: they live on different loops.

Importing this module (pytest does, in every run of an environment that has
tokenflow) loads no torch: the engine's modules load when a fixture starts one.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Callable, Generator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

# The fixtures that need pytest-asyncio's event loop, and the loop scope their tests run in (None: the
# test's default, `asyncio_default_test_loop_scope`, which is also the function-scoped fixture's).
_ASYNCIO_ENGINES: dict[str, str | None] = {"tokenflow_engine": None, "tokenflow_session_engine": "session"}
_OTHER_RUNNERS = ("anyio", "trio")  # markers of plugins that run a test on their own loop
_F = TypeVar("_F", bound=Callable[..., Any])


def _asyncio_fixture(*, loop_scope: Any = None, **kwargs: Any) -> Callable[[_F], _F]:
    """`pytest_asyncio.fixture` (strict mode runs only async fixtures made with it), else
    `pytest.fixture` (anyio's plugin, or none)."""
    try:
        from pytest_asyncio import fixture
    except ImportError:
        return cast("Callable[[_F], _F]", pytest.fixture(**kwargs))
    return cast("Callable[[_F], _F]", fixture(loop_scope=loop_scope, **kwargs))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokenflow")
    group.addoption("--tokenflow-model", default=None,
                    help="model for the tokenflow_engine fixtures (default: a tiny random-weight model)")


def _asyncio_plugin_active(config: pytest.Config) -> bool:
    return any(config.pluginmanager.has_plugin(name) for name in ("asyncio", "pytest_asyncio.plugin"))


def _is_async_test(function: Any) -> bool:
    inner = getattr(getattr(function, "hypothesis", None), "inner_test", function)  # @hypothesis.given
    return inspect.iscoroutinefunction(inner)


@pytest.hookimpl(wrapper=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> Generator[None, None, None]:
    """Mark the async tests that use our asyncio engines for pytest-asyncio. A wrapper runs before
    every plain implementation (pytest-asyncio's `tryfirst` one reads the marker here), and the mark
    goes on the function as `@pytest.mark.asyncio` would, so the items made after this hook carry it
    when pytest-asyncio's collection wrapper decides whether to run them."""
    used = [name for name in _ASYNCIO_ENGINES if name in metafunc.fixturenames]
    definition = metafunc.definition
    if (
        used
        and _is_async_test(metafunc.function)
        and _asyncio_plugin_active(metafunc.config)
        and "anyio_backend" not in metafunc.fixturenames
        and not any(definition.get_closest_marker(name) for name in _OTHER_RUNNERS)
    ):
        loop_scope = "session" if any(_ASYNCIO_ENGINES[name] == "session" for name in used) else None
        present = definition.get_closest_marker("asyncio")
        if present is None or (loop_scope and not ({"loop_scope", "scope"} & set(present.kwargs))):
            _mark_closest(metafunc.function, definition,
                          pytest.mark.asyncio(loop_scope=loop_scope) if loop_scope else pytest.mark.asyncio)
    return (yield)


def _mark_closest(function: Any, definition: pytest.Function, mark: pytest.MarkDecorator) -> None:
    """Put `mark` first on the test function (whose items pytest makes next) and on the definition
    pytest-asyncio's `pytest_generate_tests` reads: first, so it is the closest of its name."""
    target = getattr(function, "__func__", function)  # a method: its function
    marks = getattr(target, "pytestmark", [])
    target.pytestmark = [mark.mark, *(marks if isinstance(marks, list) else [marks])]
    definition.add_marker(mark, append=False)


@pytest.fixture(scope="session")
def tokenflow_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    chosen = request.config.getoption("--tokenflow-model") or os.environ.get("TOKENFLOW_TEST_MODEL")
    if chosen:
        return str(chosen)
    from tokenflow.testing import build_tiny_model

    return str(build_tiny_model(Path(tmp_path_factory.mktemp("tokenflow")) / "tiny-llama"))


@pytest.fixture(scope="session")
def tokenflow_session_settings() -> dict[str, Any]:
    return {"max_num_seqs": 8}


@pytest.fixture
def tokenflow_settings(tokenflow_session_settings: dict[str, Any]) -> dict[str, Any]:
    return dict(tokenflow_session_settings)


@_asyncio_fixture()
async def tokenflow_engine(tokenflow_model: str, tokenflow_settings: dict[str, Any]) -> AsyncIterator[Any]:
    from tokenflow.engine import Engine

    async with Engine(tokenflow_model, **tokenflow_settings) as engine:
        yield engine


@_asyncio_fixture(scope="session", loop_scope="session")
async def tokenflow_session_engine(
    tokenflow_model: str, tokenflow_session_settings: dict[str, Any]
) -> AsyncIterator[Any]:
    """Started on pytest-asyncio's session loop; the tests that use it are marked to run there."""
    from tokenflow.engine import Engine

    async with Engine(tokenflow_model, **tokenflow_session_settings) as engine:
        yield engine


@pytest.fixture
async def tokenflow_anyio_engine(
    anyio_backend: Any, tokenflow_model: str, tokenflow_settings: dict[str, Any]
) -> AsyncIterator[Any]:
    """Run by anyio's plugin (it requests `anyio_backend`), so it starts in the test's own event loop."""
    from tokenflow.engine import Engine

    async with Engine(tokenflow_model, **tokenflow_settings) as engine:
        yield engine

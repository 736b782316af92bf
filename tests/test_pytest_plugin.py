"""The pytest plugin as an app's test suite meets it: a real inner pytest run in a fresh folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ASYNCIO_TEST = """
import pytest

@pytest.mark.asyncio
async def test_four_tokens(tokenflow_engine):
    done = await tokenflow_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

async def test_unmarked(tokenflow_engine):
    done = await tokenflow_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
"""


def test_engine_fixture_on_the_default_tiny_model(pytester: pytest.Pytester) -> None:
    """No configuration at all: pytest-asyncio's strict mode, and an unmarked test runs too."""
    pytester.makepyfile(ASYNCIO_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    _assert_fresh_project(result, pytester, "strict")
    result.assert_outcomes(passed=2)


# A fresh app project's suite: no ini file, no markers, its own fixture over ours, and a counter of
# engine starts (one per engine: the model loads at start).
APP_CONFTEST = """
import pytest
from tokenflow.engine import Engine

STARTS = []
_start = Engine.start

async def _counting_start(self):
    STARTS.append(self)
    await _start(self)

Engine.start = _counting_start

@pytest.fixture
def app_engine(tokenflow_engine):
    return tokenflow_engine
"""

APP_FUNCTION_ENGINE_TESTS = """
import pytest
from conftest import STARTS

async def test_unmarked(tokenflow_engine):
    done = await tokenflow_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

async def test_through_a_fixture_of_the_app(app_engine):
    done = await app_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

@pytest.mark.asyncio
async def test_marked(tokenflow_engine):
    assert STARTS.count(tokenflow_engine) == 1
    done = await tokenflow_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
"""

APP_SESSION_ENGINE_TESTS = """
import asyncio
import pytest
from conftest import STARTS

FIRST = {}

async def test_first(tokenflow_session_engine):
    FIRST.update(engine=tokenflow_session_engine, id=id(tokenflow_session_engine), loop=asyncio.get_running_loop())
    tokenflow_session_engine.set_by_the_first_test = True
    done = await tokenflow_session_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

@pytest.mark.asyncio  # a bare marker: widened to the session loop the engine lives on
async def test_second(tokenflow_session_engine):
    assert id(tokenflow_session_engine) == FIRST["id"]
    assert tokenflow_session_engine.set_by_the_first_test
    assert asyncio.get_running_loop() is FIRST["loop"]
    done = await tokenflow_session_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

class TestInAClass:
    async def test_third(self, tokenflow_session_engine):
        assert tokenflow_session_engine is FIRST["engine"]
        assert STARTS.count(tokenflow_session_engine) == 1  # started (its model loaded) once
        done = await tokenflow_session_engine.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4
"""

# Under pytest-asyncio, a test anyio runs keeps to anyio (no asyncio marker added to it).
APP_ANYIO_MARKED_TEST = """
import pytest
import sniffio

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param

@pytest.mark.anyio
async def test_on_each_backend(tokenflow_anyio_engine, anyio_backend):
    assert sniffio.current_async_library() == anyio_backend
    done = await tokenflow_anyio_engine.generate("Hello", max_tokens=4, ignore_eos=True, temperature=0)
    assert len(done.token_ids) == 4
    async for chunk in tokenflow_anyio_engine.stream("Hello", max_tokens=3, ignore_eos=True):
        assert chunk.text is not None
"""

# TOKENFLOW_TEST_MODEL (it used to make every Engine raise ConfigError, an unknown setting)
MODEL_FROM_THE_ENVIRONMENT_TEST = """
def test_the_model_is_the_one_named(tokenflow_model):
    import os
    assert tokenflow_model == os.environ["TOKENFLOW_TEST_MODEL"]
"""

# anyio's plugin alone, as where pytest-asyncio is not installed (a `-p` plugin makes it unimportable).
NO_PYTEST_ASYNCIO = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "pytest_asyncio":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _NotInstalled())
"""

# Unmarked (`anyio_backend` comes with the fixture, so anyio runs it) and marked.
APP_ANYIO_TESTS = """
import sys
import pytest
import sniffio

async def test_unmarked(tokenflow_anyio_engine, anyio_backend):
    assert "pytest_asyncio" not in sys.modules
    assert sniffio.current_async_library() == anyio_backend
    done = await tokenflow_anyio_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

@pytest.mark.anyio
async def test_marked(tokenflow_anyio_engine):
    done = await tokenflow_anyio_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
"""

# The session engine under anyio: anyio's plugin runs a session-scoped async fixture given a
# session-scoped `anyio_backend`.
APP_ANYIO_SESSION_TESTS = """
import pytest
from conftest import STARTS

@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"

FIRST = []

@pytest.mark.anyio
async def test_first(tokenflow_session_engine):
    FIRST.append(tokenflow_session_engine)
    done = await tokenflow_session_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4

@pytest.mark.anyio
async def test_second(tokenflow_session_engine):
    assert FIRST == [tokenflow_session_engine]
    assert STARTS.count(tokenflow_session_engine) == 1
    done = await tokenflow_session_engine.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
"""


def _assert_fresh_project(result: pytest.RunResult, pytester: pytest.Pytester, asyncio_mode: str | None) -> None:
    """The inner run is the app's: rooted in its own folder, with no ini file (so none of this repo's
    pytest settings, asyncio_mode="auto" among them), pytest-asyncio in `asyncio_mode` (None: off)."""
    result.stdout.fnmatch_lines([f"rootdir: {pytester.path}"])
    result.stdout.no_fnmatch_line("configfile:*")
    if asyncio_mode is None:
        result.stdout.no_re_match_line(r"plugins:.*\basyncio-")
        result.stdout.no_re_match_line(r"asyncio: mode=")
    else:
        result.stdout.re_match_lines([r"plugins:.*\basyncio-", rf"(?i)asyncio: mode=(mode\.)?{asyncio_mode}\b"])


@pytest.mark.parametrize("asyncio_mode", ["strict", "auto"])
def test_unmarked_async_tests_run_under_pytest_asyncio(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tiny_model: Path, asyncio_mode: str
) -> None:
    """An app's `async def` tests that use the engines run without a marker in either mode, and the
    session engine is one engine on one loop for all of its tests. Strict mode also runs anyio's tests
    (on asyncio and trio) beside them; the auto run takes its model from TOKENFLOW_TEST_MODEL."""
    pytester.makeconftest(APP_CONFTEST)
    files = {"test_function_engine": APP_FUNCTION_ENGINE_TESTS, "test_session_engine": APP_SESSION_ENGINE_TESTS}
    model_flags = [f"--tokenflow-model={tiny_model}"]
    if asyncio_mode == "strict":  # (auto mode claims every async test, anyio's too: pytest-asyncio's rule)
        files["test_anyio_marked"] = APP_ANYIO_MARKED_TEST
    else:
        files["test_model_from_the_environment"] = MODEL_FROM_THE_ENVIRONMENT_TEST
        monkeypatch.setenv("TOKENFLOW_TEST_MODEL", str(tiny_model))
        model_flags = []
    pytester.makepyfile(**files)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", f"asyncio_mode={asyncio_mode}", *model_flags, "-v")
    _assert_fresh_project(result, pytester, asyncio_mode)
    result.assert_outcomes(passed=8 if asyncio_mode == "strict" else 7)
    if asyncio_mode == "strict":
        result.stdout.fnmatch_lines(["*test_on_each_backend?asyncio? PASSED*", "*test_on_each_backend?trio? PASSED*"])
    result.stdout.fnmatch_lines([
        "*test_session_engine.py::test_first PASSED*",
        "*test_session_engine.py::test_second PASSED*",
        "*test_session_engine.py::TestInAClass::test_third PASSED*",
    ])


def test_anyio_alone_runs_the_anyio_and_session_fixtures(pytester: pytest.Pytester, tiny_model: Path) -> None:
    """No pytest-asyncio (off, and unimportable as if not installed): anyio's plugin runs the tests."""
    pytester.makeconftest(APP_CONFTEST)
    pytester.makepyfile(no_pytest_asyncio=NO_PYTEST_ASYNCIO, test_anyio_engine=APP_ANYIO_TESTS,
                        test_anyio_session_engine=APP_ANYIO_SESSION_TESTS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", "-p", "no_pytest_asyncio", f"--tokenflow-model={tiny_model}",
        "-v")
    _assert_fresh_project(result, pytester, None)
    result.assert_outcomes(passed=6)  # each test_anyio_engine test on asyncio and trio (anyio's default backends)
    result.stdout.fnmatch_lines(["*test_unmarked?asyncio? PASSED*", "*test_unmarked?trio? PASSED*"])
    result.stdout.fnmatch_lines(["*test_anyio_session_engine.py::test_second PASSED*"])


@pytest.mark.parametrize("code", [
    "import tokenflow",
    "import tokenflow.pytest_plugin",
    "from tokenflow.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "from tokenflow.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass",
])
def test_light_entry_points_load_no_torch(code: str) -> None:
    probe = code + "\nimport sys\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"

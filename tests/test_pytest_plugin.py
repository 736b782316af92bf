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
"""

ANYIO_TEST = """
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


def test_engine_fixture_on_the_default_tiny_model(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ASYNCIO_TEST)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_the_documented_environment_variable_picks_the_model(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    """TOKENFLOW_TEST_MODEL used to make every Engine raise ConfigError (an unknown setting)."""
    monkeypatch.setenv("TOKENFLOW_TEST_MODEL", str(tiny_model))
    pytester.makepyfile(ASYNCIO_TEST + """
def test_the_model_is_the_one_named(tokenflow_model):
    import os
    assert tokenflow_model == os.environ["TOKENFLOW_TEST_MODEL"]
""")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_anyio_fixture_runs_on_asyncio_and_trio(pytester: pytest.Pytester, tiny_model: Path) -> None:
    pytester.makepyfile(ANYIO_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--tokenflow-model={tiny_model}", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_on_each_backend?asyncio? PASSED*", "*test_on_each_backend?trio? PASSED*"])


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

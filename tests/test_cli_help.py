"""The command line explains itself: every flag has help and shows its default; a missing extra is one line."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tokenflow import registry
from tokenflow.cli import _BENCHES, HelpFormatter, build_parser
from tokenflow.errors import PluginError
from tokenflow.extras import MissingExtra, check_installed, require

COMMANDS = ["generate", "chat", "serve", "plugins", "pull", "list", "rm", *_BENCHES]


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_that_shows_its_default(command: str) -> None:
    parser = _subparser(command)
    formatter = parser._get_formatter()
    assert isinstance(formatter, HelpFormatter)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{command} {action.option_strings or action.dest}: no help"
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if action.option_strings and not switch:
            shown = formatter._get_help_string(action) or ""
            assert "default" in shown, f"{command} {action.option_strings}: the default is not shown"


def _options_help(text: str) -> dict[str, str]:
    """`--flag` -> its help, whitespace joined, from the options section of a --help text."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = " ".join(line.split()[1:])
        elif flag is not None:
            entries[flag] += " " + " ".join(line.split())
    return entries


def test_serve_help_lists_each_flag_with_its_default() -> None:
    entries = _options_help(_subparser("serve").format_help())
    for flag, default in [("--port", "8000"), ("--host", "127.0.0.1"), ("--max-request-bytes", "4194304"),
                          ("--log-level", "info"), ("--dtype", "auto"), ("--model", "smollm2-135m"),
                          ("--backend", "paged")]:
        assert f"(default: {default}" in entries[flag], (flag, entries[flag])
    assert all(flag in entries for flag in ("--api-key", "--cors-origin", "--trust-client-field", "--set"))


def test_the_command_list_names_every_benchmark() -> None:
    text = build_parser().format_help()
    for command in COMMANDS:
        assert command in text, command


BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # as if not installed\n"


def _run_without(names: list[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK.format(names=names) + code],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("missing", ["uvicorn", "starlette", "prometheus_client"])
def test_serve_without_the_server_extra_prints_one_line_naming_it(missing: str) -> None:
    done = _run_without([missing], "from tokenflow.cli import main\nraise SystemExit(main(['serve', '--port', '0']))")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"tokenflow: MissingExtra: tokenflow serve needs the `server` extra ({missing} is not installed): "
        "pip install 'tokenflow-engine[server]'"]


def test_importing_the_http_app_without_the_server_extra_names_it() -> None:
    done = _run_without(["starlette"], "import tokenflow.serve.openai_app")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenflow.extras.MissingExtra: tokenflow.serve") and "[server]" in last


def test_plots_without_matplotlib_name_the_plot_extra(tmp_path) -> None:
    (tmp_path / "r.json").write_text('{"results": []}')
    done = _run_without(["matplotlib"], "from tokenflow.cli import main\n"
                        f"raise SystemExit(main(['bench-plot', {str(tmp_path / 'r.json')!r}, 'out.png']))")
    assert done.returncode == 2 and "pip install 'tokenflow-engine[plot]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_require_and_check_installed() -> None:
    assert require("json", "server", "x").dumps([]) == "[]"
    with pytest.raises(MissingExtra, match=r"needs the `plot` extra \(no_such_module_x is not installed\)") as info:
        require("no_such_module_x", "plot", "thing")
    assert info.value.extra == "plot" and isinstance(info.value, ImportError)
    with pytest.raises(MissingExtra, match=r"pip install 'tokenflow-engine\[ray\]'"):
        check_installed("ray", "thing", "json", "no_such_module_y")


def test_an_uninstalled_plugin_names_the_extra_that_brings_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "entry_points", lambda group: [])  # as in an environment without the plugin
    with pytest.raises(PluginError, match=r"it comes with the `redis` extra: pip install 'tokenflow-engine\[redis\]'"):
        registry.find(registry.TIERS, "redis")

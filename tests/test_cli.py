"""The `tokenflow` command on a tiny model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tokenflow.cli import main


def test_generate_prints_the_completion(tiny_model, capsys) -> None:
    assert main(["generate", "hello", "--model", str(tiny_model), "--max-tokens", "5", "--temperature", "0",
                 "--ignore-eos", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert len(done["token_ids"]) == 5 and done["finish_reason"] == "length"


def test_generate_stream_matches_non_stream(tiny_model, capsys) -> None:
    args = ["generate", "hello", "--model", str(tiny_model), "--max-tokens", "6", "--temperature", "0", "--raw"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == plain


def test_bad_parameter_is_a_clear_error(tiny_model, capsys) -> None:
    assert main(["generate", "hello", "--model", str(tiny_model), "--top-p", "3"]) == 2
    err = capsys.readouterr().err
    assert "InvalidRequest" in err and "top_p" in err


def test_chat_answers_each_line_until_an_empty_one(tiny_model, capsys, monkeypatch) -> None:
    lines = iter(["hello", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(tiny_model), "--max-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("bot> ") == 2


def test_chat_trims_the_oldest_turns_to_fit_the_context(tiny_model, capsys, monkeypatch) -> None:
    """A history past the context used to end the chat (exit 2); now the oldest turns go, with a notice."""
    long = "word " * 12
    lines = iter([long, long, long, long, ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code = main(["chat", "--model", str(tiny_model), "--max-model-len", "128", "--max-tokens", "8",
                 "--temperature", "0", "--ignore-eos", "--system", "be brief"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.count("bot> ") == 4
    assert "oldest messages to fit the 128-token context" in captured.err


def test_fit_history_keeps_the_system_prompt_and_starts_at_a_user_turn(tiny_model) -> None:
    from transformers import AutoTokenizer

    from tokenflow.cli import fit_history

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    history = [{"role": "system", "content": "sys"}]
    for n in range(6):
        history += [{"role": "user", "content": f"question {n} " * 5}, {"role": "assistant", "content": "ok " * 5}]
    history.append({"role": "user", "content": "last"})
    kept, dropped = fit_history(tokenizer, history, budget=60)
    assert kept[0]["role"] == "system" and kept[1]["role"] == "user" and kept[-1]["content"] == "last"
    assert dropped > 0 and len(kept) + dropped == len(history)
    text = tokenizer.apply_chat_template(kept, tokenize=False, add_generation_prompt=True)
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 60
    alone, _ = fit_history(tokenizer, [{"role": "user", "content": "x " * 500}], budget=60)
    assert alone == []  # the caller says it does not fit


@pytest.mark.parametrize(("flag", "message"), [
    ("max_num_seqs=", "has no value"),
    ("=8", "expects KEY=VALUE"),
    ("novalue", "expects KEY=VALUE"),
    ("length_buckets=[1,", "not valid JSON"),
    ("no_such_setting=1", "no_such_setting"),
])
def test_bad_set_flags_are_one_line_errors(tiny_model, capsys, flag, message) -> None:
    assert main(["generate", "hi", "--model", str(tiny_model), "--set", flag]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_every_command_takes_a_log_level(capsys) -> None:
    for command in ("generate", "chat", "serve", "plugins", "pull", "list", "rm", "bench", "bench-prefix"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--log-level" in capsys.readouterr().out, command


# -- fail fast: a mistake costs a second, not the minutes of loading a model ------------------------
# `python -m tokenflow ARGS` in a fresh interpreter with a fresh, empty TOKENFLOW_HOME; when it ends (however it
# ends) it writes which heavy modules it imported. Failing fast means failing before any model work: no torch or
# transformers import, nothing fetched or converted into the home folder.
_RUN_AND_REPORT = """
import json, runpy, sys
report, *args = sys.argv[1:]
sys.argv = ["tokenflow", *args]
try:
    runpy.run_module("tokenflow", run_name="__main__", alter_sys=True)
finally:
    with open(report, "w", encoding="utf-8") as out:
        json.dump({name: name in sys.modules for name in ("torch", "transformers")}, out)
"""


def _tokenflow(tmp_path: Path, *args: str) -> tuple[int, str]:
    """The real command in a fresh interpreter and an empty `TOKENFLOW_HOME`: (exit status, stderr), once it is
    checked to have stopped before loading a model. The model index is a closed port, so a run that does go on
    to fetch the default model fails quickly instead of downloading it."""
    home, report = tmp_path / "home", tmp_path / "imported.json"
    env = {**os.environ, "TOKENFLOW_HOME": str(home), "TOKENFLOW_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    done = subprocess.run([sys.executable, "-c", _RUN_AND_REPORT, str(report), *args], capture_output=True,
                          text=True, timeout=300, env=env)  # a hang guard only: a hang fails, not sticks
    assert report.is_file(), done.stderr
    imported = json.loads(report.read_text(encoding="utf-8"))
    assert imported == {"torch": False, "transformers": False}, (imported, done.stderr)
    models = home / "models"
    assert not models.exists() or not any(models.iterdir()), sorted(p.name for p in models.iterdir())
    return done.returncode, done.stderr


def test_serve_on_a_busy_port_fails_before_loading_the_model(tmp_path: Path) -> None:
    """The default model takes minutes to fetch and load: a busy port is reported before any of it starts."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, err = _tokenflow(tmp_path, "serve", "--port", str(port))
    assert code == 2, (code, err)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err and err.count("\n") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--set", "max_num_seq=4"], "did you mean 'max_num_seqs'?"),
    (["chat", "--model", "smollm2-13m"], "Did you mean 'smollm2-135m'?"),
    (["serve", "--set", "kv_cache_byts=1000"], "did you mean 'kv_cache_bytes'?"),
    (["serve", "--model", "./no/such/folder"], "does not exist"),
    (["serve", "--max-request-bytes", "0"], "--max-request-bytes must be positive"),
])
def test_bad_flags_fail_before_loading_a_model_with_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """A mistake in the flags is one line on stderr and exit 2, found before any model is fetched, converted or
    loaded (no torch import, an empty model cache)."""
    code, err = _tokenflow(tmp_path, *args)
    assert code == 2, (code, err)
    assert message in err and err.count("\n") == 1, err

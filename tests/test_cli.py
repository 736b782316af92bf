"""The `tokenflow` command on a tiny model."""

from __future__ import annotations

import json

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

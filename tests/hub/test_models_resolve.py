"""resolve_model dispatch: aliases, local folders, files, hub ids, and the errors for everything else."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest

from tokenflow.errors import ModelLoadError
from tokenflow.hub import DEFAULT_MODEL, ResolvedModel, resolve_model, tokenflow_home
from tokenflow.hub import resolve as resolve_mod


def test_public_names() -> None:
    assert DEFAULT_MODEL == "smollm2-135m"
    assert DEFAULT_MODEL in resolve_mod.EMBEDDED
    resolved = ResolvedModel("x", Path("/x"))
    with pytest.raises(AttributeError):
        resolved.name = "y"  # type: ignore[misc]


def test_tokenflow_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path / "h"))
    assert tokenflow_home() == tmp_path / "h"
    monkeypatch.delenv("TOKENFLOW_HOME")
    assert tokenflow_home().name == "tokenflow"


def test_home_defaults_to_tokenflow_home(home: Path, tiny_gguf: Path) -> None:
    resolved = resolve_model(tiny_gguf, progress=False)
    assert resolved.path.parent == home / "models"


def test_local_folder_returned_as_is(hf_folder: Path, tmp_path: Path) -> None:
    for spec in (hf_folder, str(hf_folder)):
        resolved = resolve_model(spec, home=tmp_path)
        assert resolved == ResolvedModel("tiny-llama", hf_folder)
    assert not (tmp_path / "models").exists()  # nothing cached or converted


def test_local_folder_loads(hf_folder: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model(hf_folder, home=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(resolved.path)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert model.config.num_hidden_layers == 2
    assert tokenizer.chat_template


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(tmp_path / "empty", home=tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model(tmp_path / "weights.bin", home=tmp_path)


@pytest.mark.parametrize(
    "spec", ["smollm2-1.7b", "./no/such/dir", "/no/such/model.gguf", "a/b/c", "bad name"]
)
def test_unknown_spec_names_it_and_lists_aliases(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model(spec, home=tmp_path)
    assert repr(spec) in str(info.value)
    assert "smollm2-135m" in str(info.value)


def test_missing_pathlike_is_not_treated_as_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve_mod, "_hub_download", pytest.fail)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(Path("org/name"), home=tmp_path)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("org/name.v2", True),
        ("./org/name", False),
        ("../x/y", False),
        ("org/name/extra", False),
        ("org/model.gguf", False),
        ("/abs/path", False),
    ],
)
def test_hub_id_detection(spec: str, expected: bool) -> None:
    assert resolve_mod._looks_like_hub_id(spec) is expected


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Make huggingface_hub fail fast: offline mode and an empty cache (constants are read at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


@pytest.mark.usefixtures("offline_hub")
def test_unreachable_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model("some-org/some-model", home=tmp_path)
    message = str(info.value)
    assert "'some-org/some-model'" in message
    assert "could not be reached" in message and "not found" in message
    assert ".gguf" in message and "smollm2-135m" in message
    assert info.value.__cause__ is not None


def test_hub_snapshot_is_used(monkeypatch: pytest.MonkeyPatch, hf_folder: Path, tmp_path: Path) -> None:
    calls: list[tuple[str, dict]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append((repo_id, kwargs))
        return str(hf_folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    resolved = resolve_model("org/tiny", home=tmp_path)
    assert resolved == ResolvedModel("org/tiny", hf_folder)
    assert calls[0][0] == "org/tiny"
    assert "*.safetensors" in calls[0][1]["allow_patterns"]


def test_hub_repo_without_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "snap").mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(tmp_path / "snap"))
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model("org/gguf-only", home=tmp_path)

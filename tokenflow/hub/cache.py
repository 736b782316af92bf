"""The on-disk model cache: where it lives and how a folder in it gets built safely.

A converted model is a folder `<home>/models/<key>/`. It counts as complete only
when it holds a marker file naming the hash of what it was built from; the
marker is written last inside a temporary sibling folder that is then renamed
into place, so readers never see half a model. Builders take an exclusive file
lock first, so two processes that start together convert once, not twice.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenflow.errors import ModelLoadError

try:  # POSIX only; elsewhere the atomic rename alone keeps the cache consistent.
    import fcntl
except ImportError:  # pragma: no cover - not reachable on Linux/macOS
    fcntl = None  # type: ignore[assignment]

__all__ = (
    "MARKER", "CachedModel", "cached_folder", "ensure_folder", "file_lock", "list_models", "models_root",
    "remove_model", "tokenflow_home",
)

MARKER = "tokenflow-model.json"
MARKER_FORMAT = 1

log = logging.getLogger(__name__)


def tokenflow_home() -> Path:
    """`$TOKENFLOW_HOME` if set, else the per-user cache folder (models are re-creatable, so cache)."""
    env = os.environ.get("TOKENFLOW_HOME")
    if env:
        return Path(env).expanduser()
    return _user_cache_root() / "tokenflow"


def _user_cache_root() -> Path:
    """The per-user cache folder of this OS (what platformdirs answers, without the dependency)."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def models_root(home: Path | None = None) -> Path:
    return (home if home is not None else tokenflow_home()) / "models"


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker's contents, or None when the folder is not a complete build."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def cached_folder(folder: Path, source_sha256: str) -> bool:
    """True when `folder` is a complete build of the source with this hash (the fast path)."""
    marker = read_marker(folder)
    return marker is not None and marker.get("source_sha256") == source_sha256


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block.

    The lock file is left behind on purpose: deleting it would let a waiter and a
    newcomer hold locks on two different inodes at once.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("waiting for another process to finish preparing %s", path.name)
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_folder(
    dest: Path,
    source_sha256: str,
    build: Callable[[Path], None],
    *,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Return `dest` once it is a complete build of `source_sha256`, calling `build(tmp)` if not.

    `build` fills an empty temporary folder; on success the marker is written
    and the folder renamed to `dest`. A `dest` without a matching marker (a crash
    mid-way, or an older source) is replaced.
    """
    if cached_folder(dest, source_sha256):
        return dest
    try:
        return _build_locked(dest, source_sha256, build, meta)
    except OSError as exc:
        raise ModelLoadError(
            f"could not prepare the model cache folder {dest}: {exc}. Check free disk space and "
            "permissions, or point $TOKENFLOW_HOME at a writable folder."
        ) from exc


def _build_locked(
    dest: Path, source_sha256: str, build: Callable[[Path], None], meta: dict[str, Any] | None
) -> Path:
    root = dest.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{dest.name}.lock"):
        if cached_folder(dest, source_sha256):  # another process finished while we waited
            return dest
        _remove_leftovers(root, dest.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=root))
        try:
            build(tmp)
            _make_readable(tmp)
            marker = {
                "format": MARKER_FORMAT,
                "source_sha256": source_sha256,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **(meta or {}),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            _publish(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("model cached at %s", dest)
    return dest


def _publish(tmp: Path, dest: Path) -> None:
    """Move the finished `tmp` to `dest`, setting any stale `dest` aside first (rename is atomic)."""
    old: Path | None = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp and some writers create owner-only files; a cache folder may be shared, so open reads up."""
    folder.chmod(0o755)
    for item in folder.rglob("*"):
        item.chmod(0o755 if item.is_dir() else 0o644)


def _remove_leftovers(root: Path, name: str) -> None:
    """Delete temp folders of earlier builds of `name` that died; safe because we hold its lock."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*", f".{name}.fetch-*"):
        for stale in root.glob(pattern):
            log.debug("removing leftover %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


@dataclass(frozen=True)
class CachedModel:
    """A complete build in the cache, as `tokenflow list` shows it."""

    name: str
    path: Path
    size_bytes: int
    created: str
    source: str


def list_models(root: Path) -> list[CachedModel]:
    """The complete builds under `root`, by name (half-built and temporary folders are not listed)."""
    models = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        marker = read_marker(folder) if folder.is_dir() and not folder.name.startswith(".") else None
        if marker is None:
            continue
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        models.append(CachedModel(folder.name, folder, size, str(marker.get("created", "?")),
                                  str(marker.get("source", marker.get("title", "?")))))
    return models


def remove_model(root: Path, name: str) -> int:
    """Delete the build `name` under its lock (a process converting it finishes first); bytes freed."""
    folder = root / name
    if name.startswith(".") or "/" in name or read_marker(folder) is None:
        known = ", ".join(m.name for m in list_models(root)) or "none"
        raise ModelLoadError(f"no converted model named {name!r} in {root} (there are: {known})")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    with file_lock(root / f".{name}.lock"):
        shutil.rmtree(folder)
    return size

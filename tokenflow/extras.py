"""The optional parts of tokenflow and the `pip install` that provides each, so a missing one is one clear line.

Every optional import on a user path goes through `require` (or `check_installed` for a whole package's
imports); the error is `MissingExtra`, an `ImportError` that is also a `TokenflowError`, and `tokenflow`
commands print it as one line.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from tokenflow.errors import TokenflowError

__all__ = ("PLUGIN_DISTRIBUTIONS", "MissingExtra", "check_installed", "install_hint", "require")

# (entry-point group, plugin name) -> the extra whose plugin distribution provides it
PLUGIN_DISTRIBUTIONS = {
    ("tokenflow.kv_tiers", "redis"): "redis",
}


class MissingExtra(TokenflowError, ImportError):
    """An optional part of tokenflow is not installed; the message names the `pip install` that adds it."""

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


def install_hint(extra: str) -> str:
    """The command that installs `extra`, from an index or from a checkout's built wheels alike."""
    return f"pip install 'tokenflow-engine[{extra}]'"


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or raise `MissingExtra` saying that `what` needs `extra` and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the module is there but one of its own imports is broken: that traceback says more
        raise _missing(what, extra, exc.name) from None


def check_installed(extra: str, what: str, *modules: str) -> None:
    """Raise `MissingExtra` when any of `modules` cannot be found, without importing them."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: blocked in sys.modules (set to None)
            found = False
        if not found:
            raise _missing(what, extra, module)


def _missing(what: str, extra: str, module: str) -> MissingExtra:
    return MissingExtra(f"{what} needs the `{extra}` extra ({module} is not installed): {install_hint(extra)}",
                        extra=extra)

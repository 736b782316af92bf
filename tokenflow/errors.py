"""Typed errors raised to callers of the engine.

Every request ends with a result or exactly one of these. Callers can catch
`TokenflowError` for all of them.
"""

from __future__ import annotations

__all__ = (
    "ConfigError",
    "DeadlineExceeded",
    "EngineClosed",
    "EngineError",
    "InvalidRequest",
    "ModelLoadError",
    "Overloaded",
    "PluginError",
    "TokenflowError",
    "WrongEventLoop",
)


class TokenflowError(Exception):
    """Base of every error tokenflow raises on purpose."""


class ConfigError(TokenflowError, ValueError):
    """An engine setting is unknown or invalid; `field` names it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidRequest(TokenflowError, ValueError):
    """The request cannot be served as given (bad parameter, prompt too long, ...).

    `field` names the offending parameter when there is one.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Overloaded(TokenflowError):
    """Admission refused: the queue is full or the circuit breaker is open."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(TokenflowError, TimeoutError):
    """The request's deadline passed before it finished; it was aborted."""


class EngineClosed(TokenflowError):
    """The engine is closed (or dead) and takes no more requests."""


class EngineError(TokenflowError):
    """The model stage failed while this request was in its step."""


class ModelLoadError(TokenflowError):
    """The model could not be found, fetched, converted or loaded."""


class PluginError(TokenflowError):
    """A plugin failed to import or does not implement its protocol."""


class WrongEventLoop(TokenflowError, RuntimeError):
    """The engine was called from an event loop or thread it does not belong to. An engine serves the
    loop that started it; other threads use `engine.portal()` or `tokenflow.SyncEngine`."""

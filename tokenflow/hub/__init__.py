"""Model specs → local Hugging Face folders, including the embedded default model.

`resolve_model(spec)` is the one entry point; the engine calls it and then
loads the returned folder with transformers.
"""

from __future__ import annotations

from tokenflow.hub.cache import tokenflow_home
from tokenflow.hub.resolve import DEFAULT_MODEL, ResolvedModel, resolve_model

__all__ = ("DEFAULT_MODEL", "ResolvedModel", "resolve_model", "tokenflow_home")

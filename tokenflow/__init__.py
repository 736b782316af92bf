"""tokenflow: an embedded, async LLM inference engine for Python apps.

    async with tokenflow.Engine("smollm2-135m") as engine:
        done = await engine.generate("Why is the sky blue?", max_tokens=64, temperature=0.0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenflow import errors
from tokenflow.config import EngineConfig
from tokenflow.noise import filter_third_party_noise
from tokenflow.params import Chunk, Completion, SamplingParams, TokenLogprob, Usage

if TYPE_CHECKING:
    from tokenflow.engine import Engine
    from tokenflow.sync_engine import SyncEngine

__version__ = "0.1.0"

filter_third_party_noise()  # before anything of ours imports torch (and, through transformers, torchao)

__all__ = (
    "Chunk",
    "Completion",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "SyncEngine",
    "TokenLogprob",
    "Usage",
    "__version__",
    "errors",
)


def __getattr__(name: str) -> Any:
    """`tokenflow.Engine` (and `SyncEngine`) load torch and transformers on first use, so `import tokenflow` (and the
    pytest plugin, in every test run of an environment that has tokenflow) costs no torch import."""
    if name == "Engine":
        from tokenflow.engine import Engine

        return Engine
    if name == "SyncEngine":
        from tokenflow.sync_engine import SyncEngine

        return SyncEngine
    raise AttributeError(f"module 'tokenflow' has no attribute {name!r}")

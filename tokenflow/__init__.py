"""tokenflow: an embedded, async LLM inference engine for Python apps.

    async with tokenflow.Engine("smollm2-135m") as engine:
        done = await engine.generate("Why is the sky blue?", max_tokens=64, temperature=0.0)
"""

from tokenflow import errors
from tokenflow.config import EngineConfig
from tokenflow.engine import Engine
from tokenflow.params import Chunk, Completion, SamplingParams, TokenLogprob, Usage

__version__ = "0.1.0"

__all__ = (
    "Chunk",
    "Completion",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
    "__version__",
    "errors",
)

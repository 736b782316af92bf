"""Third-party log lines that say nothing to a tokenflow user, dropped from `import tokenflow` on.

Each is matched narrowly (logger and message), so the same libraries' other warnings still show:
- torchao (installed for `cuda-int8`, imported by transformers' quantizers whenever a model loads) logs
  "Failed to load .../torchao/_C_*.so" for its CUDA-only kernels on every CPU-only machine;
- torch's pytree module logs a deprecation for the Enum constants torchao registers, a call we never make.
"""

from __future__ import annotations

import logging

__all__ = ("NOISE", "filter_third_party_noise")

# logger name -> message fragments whose records are dropped
NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _DropMatching(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def filter_third_party_noise() -> None:
    """Install the filters (once per process; the loggers keep them)."""
    for name, fragments in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(fragments))

"""Keep Python's cyclic garbage collector off the objects an engine's start leaves alive.

A loaded engine's process holds ~400,000 long-lived objects (torch, transformers, the tokenizer). Every
full collection walks all of them: a pause of ~0.2 s that holds the GIL, so the event loop streams
nothing meanwhile and the step loop's Python waits. Once an engine has started, `gc.freeze()` moves
every object then alive out of the collector's scans, as vLLM does after its start; the last engine to
close unfreezes them, so what becomes garbage later is still collected then. `EngineConfig.freeze_gc`
turns it off.
"""

from __future__ import annotations

import gc
import threading

__all__ = ("freeze_heap", "release_heap")

_lock = threading.Lock()
_holders = 0  # started engines that froze the heap and have not closed


def freeze_heap() -> None:
    """Collect the young generations (fresh garbage is not frozen), then freeze everything alive."""
    global _holders
    with _lock:
        gc.collect(1)
        gc.freeze()
        _holders += 1


def release_heap() -> None:
    """One engine that froze the heap closed; the last one unfreezes it."""
    global _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if _holders == 0:
            gc.unfreeze()

"""Let glibc keep freed memory for reuse, so each step's activations stop faulting in fresh pages.

Why: by default glibc hands large freed blocks back to the kernel (blocks above a size it
serves with `mmap`, and free space at the top of a heap once it passes a trim threshold).
A CPU step allocates and frees the same activation sizes every time, so every step then
faults the pages back in and the kernel zeroes them again, kernel CPU time that grows with the
step's activations; with the thresholds below the pages stay mapped and are reused.

The settings are process-wide (`mallopt`), which is what a CPU inference process wants; the
cost is that memory freed after a peak stays with the process (`EngineConfig.cpu_keep_freed_memory`
turns this off). When an engine closes, `return_freed_memory` hands what it freed back to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

__all__ = ("keep_freed_memory", "return_freed_memory")

log = logging.getLogger("tokenflow")

# mallopt parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Blocks up to this size come from the heap and are reused: glibc's largest allowed value (64-bit).
MMAP_THRESHOLD_BYTES = 32 * 2**20
# Free space at the top of a heap is returned to the kernel only past this.
TRIM_THRESHOLD_BYTES = 2**30


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds, once per process; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # musl and others
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and ok
    if not ok:
        log.warning("mallopt refused the mmap/trim thresholds; freed memory goes back to the kernel")
    return ok


def return_freed_memory() -> bool:
    """Give the free memory of every malloc arena back to the kernel (`malloc_trim(0)`): a closed engine's
    model, KV cache and activations, which the raised thresholds would otherwise keep with the process (each
    engine's model thread has an arena of its own, which the next engine's does not reuse)."""
    libc = _glibc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return bool(trim(0))

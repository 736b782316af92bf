"""Release the OpenMP helper threads a caller's thread keeps, so the model thread runs at full speed.

Why: torch's OpenMP runtime (libgomp) keeps a team of helper threads for every thread that
has run a parallel op, for the life of that thread. Once the helpers of all teams outnumber
the cores, libgomp stops spin-waiting between parallel regions and puts its threads to sleep
instead, and every region of the model thread then pays a wake-up. A program that used torch
on its main thread before starting an engine (loading another model, a reference `generate`
in a test) leaves such a team behind, and it slows every later step until `Engine.start`
releases it.

`omp_pause_resource_all` (OpenMP 5.0) lets the calling thread's helpers exit; its next
parallel op starts a new team, so the call only costs that thread a thread start later.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

__all__ = ("loaded_libgomp_paths", "release_openmp_team")

log = logging.getLogger("tokenflow")

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: drop the threads, keep nothing that must be rebuilt


def loaded_libgomp_paths() -> set[str]:
    """Files of every libgomp mapped into this process (empty off Linux or without one)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's libgomp, if this process has one loaded (Linux builds); None otherwise."""
    paths = sorted(loaded_libgomp_paths())
    import torch

    torch_dir = str(Path(torch.__file__).parent)
    paths.sort(key=lambda p: not p.startswith(torch_dir))  # torch's own copy first
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # already loaded: this returns the same library
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = (ctypes.c_int,)
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_openmp_team() -> bool:
    """Let the calling thread's OpenMP helper threads exit; False where torch does not use libgomp."""
    lib = _libgomp()
    if lib is None:
        return False
    if lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) != 0:
        log.debug("libgomp refused to release this thread's OpenMP team")
        return False
    return True

"""Hand the pages of tensors no one reads again back to the kernel, while their storage lives on.

Why: a safetensors checkpoint is memory-mapped, and every tensor loaded from it keeps the whole mapping alive. When
the fused layers run packed copies of the linear weights, dropping the HF modules' tensors frees nothing: the
embedding still holds the mapping, and the weights' pages (touched once, to pack them) stay resident, a model-sized
share of the process's RSS. `madvise(MADV_DONTNEED)` on the released tensors' whole pages takes them out of the
process (file pages stay in the page cache, where the kernel may reclaim them); a page shared with a live tensor is
left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

__all__ = ("drop_resident_pages",)

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def drop_resident_pages(tensors: list[torch.Tensor]) -> int:
    """Drop the resident pages that lie wholly inside `tensors`' bytes (CPU tensors their caller is about to let
    go and nothing reads again); returns the bytes advised. Does nothing off Linux."""
    madvise = _madvise()
    if madvise is None:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    dropped = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        begin = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        if end > begin and madvise(begin, end - begin, _MADV_DONTNEED) == 0:
            dropped += end - begin
    return dropped

"""`keep_freed_memory`: large blocks come from the heap and stay there when freed, for the next step."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates and frees a 24 MiB tensor (a step's activations) and prints, from glibc's mallinfo2,
# the bytes in mmap'd blocks while it lives and the free bytes the heap keeps after it is freed.
_PROBE = """
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    from tokenflow.runtime.cpu.malloc_tuning import keep_freed_memory
    assert keep_freed_memory()
mapped_before = libc.mallinfo2().hblkhd
x = torch.ones(6 * 2**20)
mapped = libc.mallinfo2().hblkhd - mapped_before
del x
print(mapped, libc.mallinfo2().fordblks)
"""

MIB = 2**20


def _probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    mapped, kept = out.stdout.split()
    return int(mapped), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's")
def test_freed_activations_stay_with_the_process() -> None:
    # Default glibc: a block this large is its own mmap, unmapped on free, so the next step faults
    # its pages in again (and the kernel zeroes them).
    mapped, kept = _probe("default")
    assert mapped >= 24 * MIB and kept < 24 * MIB
    # Tuned: it comes from the heap, and the heap keeps it when freed.
    mapped, kept = _probe("tuned")
    assert mapped == 0 and kept >= 24 * MIB

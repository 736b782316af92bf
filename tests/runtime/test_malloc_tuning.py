"""`keep_freed_memory`: repeated large allocations stop faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates and frees an 8 MiB tensor 25 times (as each step does with its activations) and
# prints the minor page faults of the last 20 rounds.
_PROBE = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from tokenflow.runtime.cpu.malloc_tuning import keep_freed_memory
    assert keep_freed_memory()
def round_():
    x = torch.ones(2 * 2**20)
    del x
for _ in range(5):
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_freed_memory_is_reused_without_page_faults() -> None:
    # By default glibc gives part of each freed block back to the kernel (measured here: 200 to 512
    # of its 2,048 pages a round, by machine), and the next round faults them in again.
    assert _faults("default") >= 20 * 64
    assert _faults("tuned") < 50

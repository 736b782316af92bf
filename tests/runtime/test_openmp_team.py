"""`release_openmp_team`: the calling thread's OpenMP helper threads exit."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from tokenflow.runtime.cpu.openmp_team import release_openmp_team


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def native_threads() -> int:
    """OS threads of this process that are not Python threads (OpenMP helpers among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python)


def settled_threads(expected: int, count: Callable[[], int] = _threads, timeout_s: float = 5.0) -> int:
    """`count()` once it reaches `expected` (helpers exit asynchronously) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while (found := count()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux and two cores (an OpenMP team of one has no helper threads)")
def test_release_lets_the_calling_threads_openmp_helpers_exit() -> None:
    seen: dict[str, object] = {}

    def fresh_thread() -> None:
        before = _threads()
        x = torch.randn(512, 512)
        x @ x  # a parallel op: this thread now keeps an OpenMP team
        seen["with_team"] = _threads()
        seen["released"] = release_openmp_team()
        seen["after"] = settled_threads(before)
        seen["before"] = before
        x @ x  # still computes: the next parallel op builds a new team
        seen["team_again"] = _threads()

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen["released"] is True
    assert seen["with_team"] > seen["before"]
    assert seen["after"] == seen["before"]
    assert seen["team_again"] > seen["before"]

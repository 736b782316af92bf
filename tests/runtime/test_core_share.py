"""The adaptive CPU thread count: fewer threads while other processes hold the cores, more once they leave.

Decisions are checked on constructed samples; the measurement (schedstat, /proc/stat) on a real engine
beside real busy-looping processes.
"""

from __future__ import annotations

import subprocess
import sys
import time

import anyio
import pytest

from tests.engines import running_engine
from tokenflow.runtime.cpu import core_share
from tokenflow.runtime.cpu.core_share import CoreSample, CoreSharing, decide_threads

CONTENDED = CoreSample(contention=0.4, idle_cores=0.0, busy=True)
QUIET = CoreSample(contention=0.01, idle_cores=1.0, busy=True)
FULL = CoreSample(contention=0.02, idle_cores=0.1, busy=True)  # one thread, the other core taken
IDLE_MODEL = CoreSample(contention=0.9, idle_cores=2.0, busy=False)
OWN_THREADS = CoreSample(contention=0.15, idle_cores=0.0, busy=True, external_cores=0.05)  # waits for our own


def test_decisions() -> None:
    assert decide_threads(2, 2, CONTENDED) == 1
    assert decide_threads(1, 2, CONTENDED) == 1  # never below one
    assert decide_threads(1, 2, QUIET) == 2
    assert decide_threads(2, 2, QUIET) == 2  # never above the configured count
    assert decide_threads(1, 2, FULL) == 1  # the other core is still taken: stay
    assert decide_threads(1, 4, IDLE_MODEL) == 1 and decide_threads(4, 4, IDLE_MODEL) == 4  # idle: no news
    assert decide_threads(2, 2, OWN_THREADS) == 2  # no other process holds a core: keep them


def _governor(samples: list[CoreSample], monkeypatch: pytest.MonkeyPatch) -> tuple[CoreSharing, list[float]]:
    """A CoreSharing fed `samples`, one per interval, on a clock the test moves."""
    clock = [1000.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: clock[0])
    sharing = CoreSharing(2, 0, interval_s=0.5)
    sharing._enabled = True
    feed = iter(samples)
    monkeypatch.setattr(sharing, "_sample", lambda now: (setattr(sharing, "_at", now), next(feed))[1])
    return sharing, clock


def test_a_raise_waits_out_the_cooldown_and_a_reverted_raise_doubles_it(monkeypatch) -> None:
    sharing, clock = _governor([CONTENDED, QUIET, QUIET, QUIET, QUIET, QUIET, CONTENDED, QUIET, QUIET, QUIET] * 3,
                               monkeypatch)
    seen = []
    for _ in range(12):
        clock[0] += 0.5
        seen.append(sharing.poll())
    # lowered at once; raised only after the 2 s cooldown; the raise taken back at once: 4 s before the next
    assert seen[:7] == [1, 1, 1, 1, 2, 2, 1]
    assert sharing.cooldown_s == 4.0
    assert sharing.num_lowered == 2 and sharing.num_raised == 1


def test_between_intervals_nothing_is_measured(monkeypatch) -> None:
    sharing, clock = _governor([CONTENDED], monkeypatch)
    clock[0] += 0.1
    assert sharing.poll() == 2  # too soon: no sample taken (the feed would have said: lower)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat and /proc/stat are Linux's")
async def test_busy_processes_take_threads_away_and_give_them_back(tiny_model) -> None:
    """Beside as many busy-looping processes as there are cores, the model's threads wait for cores and the
    engine drops to one thread; once they exit, it comes back to the configured two."""
    async with running_engine(tiny_model, num_threads=2, max_model_len=512, num_kv_blocks=64) as engine:
        running = True

        async def keep_busy() -> None:
            while running:
                await engine.generate("keep the model busy", max_tokens=200, ignore_eos=True)

        async def until(threads: int, limit_s: float) -> float:
            started = time.monotonic()
            with anyio.fail_after(limit_s):
                while engine.stats()["cpu_threads"] != threads:
                    await anyio.sleep(0.1)
            return time.monotonic() - started

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_busy)
            await anyio.sleep(1.5)
            # quiet: all of them (a host busy with other work may hold one back for a while first)
            await until(2, 40)
            cores = len(core_share.os.sched_getaffinity(0))
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
            try:
                lowered_after = await until(1, 20)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            raised_after = await until(2, 40)
            running = False
        stats = engine.stats()
        print(f"\n[cores] lowered after {lowered_after:.1f} s, raised after {raised_after:.1f} s; "
              f"lowered {stats['cpu_threads_lowered']}x, raised {stats['cpu_threads_raised']}x")
        assert stats["cpu_threads_lowered"] >= 1 and stats["cpu_threads_raised"] >= 1

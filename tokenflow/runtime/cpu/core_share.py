"""How many threads the model's CPU work runs on, while other work takes and gives back the host's cores.

Why: the model's OpenMP threads meet at a barrier after every parallel region, so one thread that waits
for a core another process holds stalls all of them: beside one busy-looping process on a 2-core host,
a batch-1 decode step took 231 ms on 2 threads and 32 ms on 1. An embedded engine shares its cores with
its app and whatever else the host runs, so on the CPU the thread count follows the load
(`thread_policy="adaptive"`, the default):

- **one thread fewer** when, over the last interval, the model's threads (the model thread and the
  OpenMP helpers it leads: the process's threads that Python does not know) spent more than
  `CONTENDED` of the time they wanted a core waiting in the run queue for one (Linux schedstat), and
  other processes kept at least `EXTERNAL` of a core busy (the host's busy time less this process's):
  waits for this process's own threads (its event loop beside a tiny model's spinning helpers) are not
  a reason to shed a thread;
- **one thread more** (up to the configured `num_threads`) when the host's cores this process may use
  had at least `IDLE_CORE` of a core idle while the model was busy, and no fewer-threads decision was
  taken in the last `cooldown` seconds (doubled each time a raise is taken back, up to `MAX_COOLDOWN_S`).

Nothing changes while the model is idle (its threads then say nothing about the cores). Without
`/proc` (not Linux) the policy keeps the configured count.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ("CoreSample", "CoreSharing", "decide_threads")

INTERVAL_S = 0.5  # seconds between two looks at the cores
CONTENDED = 0.12  # share of the model threads' wanted time spent waiting for a core: one thread fewer
EXTERNAL = 0.4  # ... while other processes keep at least this share of a core busy
IDLE_CORE = 0.75  # idle share of a core while the model is busy: one thread more
BUSY = 0.3  # the model thread ran at least this share of the interval: the model was busy
COOLDOWN_S = 2.0
MAX_COOLDOWN_S = 32.0


@dataclass(frozen=True)
class CoreSample:
    """What one interval saw: the model threads' run-queue share, the idle cores, whether it was busy."""

    contention: float  # wait / (run + wait) of the model's threads
    idle_cores: float  # cores (of those this process may use) idle over the interval
    busy: bool  # the model thread ran for at least `BUSY` of the interval
    external_cores: float = 1.0  # cores other processes kept busy


def decide_threads(threads: int, max_threads: int, sample: CoreSample) -> int:
    """The thread count after `sample` (without the cooldown, which `CoreSharing` applies to raises)."""
    if not sample.busy:
        return threads
    if threads > 1 and sample.contention > CONTENDED and sample.external_cores >= EXTERNAL:
        return threads - 1
    if threads < max_threads and sample.idle_cores >= IDLE_CORE:
        return threads + 1
    return threads


class CoreSharing:
    """Call `poll()` on the event loop before a step: the thread count the model should run on now (the step
    loop hands it to the model thread, which applies it with `torch.set_num_threads`)."""

    def __init__(self, max_threads: int, model_thread_native_id: int, *, interval_s: float = INTERVAL_S) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.model_thread = model_thread_native_id
        self.interval_s = interval_s
        self.cooldown_s = COOLDOWN_S
        self.num_lowered = 0
        self.num_raised = 0
        self.last: CoreSample | None = None
        self._hold_until = 0.0  # no raise before this (time.monotonic)
        self._raised_at = -1e9
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._enabled = Path("/proc/self/task").is_dir() and Path("/proc/stat").is_file() and bool(self._cpus)
        self._at = time.monotonic()
        self._threads_cpu = self._read_threads() if self._enabled else {}
        self._cores = self._read_cores() if self._enabled else (0.0, 0.0)
        self._process_s = _process_cpu_s()
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def poll(self) -> int:
        if not self._enabled or self.max_threads == 1:
            return self.threads
        now = time.monotonic()
        if now - self._at < self.interval_s:
            return self.threads
        sample = self._sample(now)
        self.last = sample
        wanted = decide_threads(self.threads, self.max_threads, sample)
        if wanted < self.threads:
            if now - self._raised_at < 3 * self.interval_s:  # the last raise was taken back: wait longer
                self.cooldown_s = min(self.cooldown_s * 2, MAX_COOLDOWN_S)
            self._hold_until = now + self.cooldown_s
            self.num_lowered += 1
        elif wanted > self.threads:
            if now < self._hold_until:
                return self.threads
            self._raised_at = now
            self.num_raised += 1
        self.threads = wanted
        return wanted

    # -- measurements ------------------------------------------------------------------------
    def _sample(self, now: float) -> CoreSample:
        wall = max(now - self._at, 1e-6)
        threads_cpu = self._read_threads()
        cores = self._read_cores()
        run = wait = model_run = 0.0
        for tid, (run_ns, wait_ns) in threads_cpu.items():
            before = self._threads_cpu.get(tid)
            if before is None:
                continue
            run += run_ns - before[0]
            wait += wait_ns - before[1]
            if tid == self.model_thread:
                model_run = (run_ns - before[0]) / 1e9
        busy, total = cores[0] - self._cores[0], cores[1] - self._cores[1]
        idle_cores = (total - busy) / total * len(self._cpus) if total > 0 else 0.0
        process_s = _process_cpu_s()
        external = max(busy / self._tick - (process_s - self._process_s), 0.0) / wall
        self._at, self._threads_cpu, self._cores, self._process_s = now, threads_cpu, cores, process_s
        return CoreSample(contention=wait / (run + wait) if run + wait > 0 else 0.0, idle_cores=idle_cores,
                          busy=model_run >= BUSY * wall, external_cores=external)

    def _read_threads(self) -> dict[int, tuple[int, int]]:
        """(run ns, run-queue wait ns) of the model thread and of the threads Python does not know (its
        OpenMP helpers)."""
        known = {t.native_id for t in threading.enumerate()} - {self.model_thread}
        found: dict[int, tuple[int, int]] = {}
        for entry in os.scandir("/proc/self/task"):
            tid = int(entry.name)
            if tid in known:
                continue
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run_ns, wait_ns, _ = f.read().split()
            except (OSError, ValueError):
                continue
            found[tid] = (int(run_ns), int(wait_ns))
        return found

    def _read_cores(self) -> tuple[float, float]:
        """(busy, total) jiffies of the cores this process may use, from /proc/stat."""
        wanted = {f"cpu{c}" for c in self._cpus}
        busy = total = 0.0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                fields = line.split()
                if fields[0] not in wanted:
                    continue
                values = [float(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
                total += sum(values)
                busy += sum(values) - values[3] - values[4]
        return busy, total

    def stats(self) -> dict[str, object]:
        last = self.last
        return {
            "cpu_threads": self.threads,
            "cpu_threads_lowered": self.num_lowered,
            "cpu_threads_raised": self.num_raised,
            "cpu_run_queue_share": round(last.contention, 3) if last else None,
            "cpu_idle_cores": round(last.idle_cores, 2) if last else None,
            "cpu_other_processes_cores": round(last.external_cores, 2) if last else None,
        }


def _process_cpu_s() -> float:
    """CPU seconds every thread of this process has used."""
    times = os.times()
    return times.user + times.system

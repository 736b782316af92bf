"""Device out-of-memory in a step: make the next step smaller before failing anyone.

The step is retried smaller (the scheduler's `RecoveringScheduler.shrink`: the worse-placed half of its
requests preempted; alone, a halved token budget) until it fits, and the smaller limits stay, since the
device fits no more. When the failure repeats (a second out-of-memory step in a row) the KV pool also
gives a quarter of its blocks back, once per streak and never below half its size at start: their
holders are preempted, cached ones evicted (a tier copies them out), then the worker frees the memory.
Only a request that runs out of memory alone fails, with an `EngineError` saying so: its size, not an
engine fault, so the step loop does not count it towards the engine's death, and the limits shrunk for it
come back.
"""

from __future__ import annotations

import logging

from tokenflow.errors import EngineError
from tokenflow.protocols import (
    DeviceOutOfMemory,
    KVPool,
    RecoveringScheduler,
    Scheduler,
    ShrinkableBackend,
    ShrinkablePool,
    StaticScheduler,
    StepPlan,
)
from tokenflow.request import Request
from tokenflow.runtime.worker import ModelWorker

__all__ = ("KV_SHRINK_FLOOR", "KV_SHRINK_FRACTION", "OutOfMemoryRecovery")

log = logging.getLogger("tokenflow")

KV_SHRINK_FRACTION = 0.25
KV_SHRINK_FLOOR = 0.5


class OutOfMemoryRecovery:
    def __init__(self, scheduler: Scheduler | StaticScheduler, pool: KVPool | None, worker: ModelWorker) -> None:
        self.scheduler = scheduler if isinstance(scheduler, RecoveringScheduler) else None  # its hooks, checked once
        self.pool = pool
        self.worker = worker
        self.floor = int(pool.num_blocks * KV_SHRINK_FLOOR) if pool is not None else 0
        self.streak = 0  # out-of-memory steps since the last step that ran
        self.num_recoveries = 0
        self.num_failures = 0  # requests that ran out of memory even alone
        self.num_pool_shrinks = 0

    async def recover(self, plan: StepPlan, exc: DeviceOutOfMemory) -> list[tuple[Request, Exception]]:
        """After `plan` ran out of memory: [] when the next step was made smaller (try again), else the
        requests that cannot run even alone, each with its error."""
        if self.scheduler is not None and self.scheduler.shrink(plan):
            self.num_recoveries += 1
            self.streak += 1
            log.warning("out of memory in a step of %d tokens; shrinking the batch: %s", plan.num_tokens, exc)
            if self.streak == 2:  # the failure repeats: the KV pool gives memory back too
                await self._shrink_pool()
            return []
        self.num_failures += 1
        self.streak = 0
        failed: list[tuple[Request, Exception]] = []
        for chunk in plan.chunks:
            request = chunk.request
            error = EngineError(f"out of memory running request {request.request_id} alone "
                                f"({request.num_tokens} tokens, {plan.num_tokens} in its step); lower its prompt "
                                f"or max_tokens, or give the device more memory: {exc}")
            error.__cause__ = exc
            log.error("%s", error)
            failed.append((request, error))
        if self.scheduler is not None:
            self.scheduler.oom_gave_up()
        return failed

    def step_ran(self) -> None:
        """A step ran: the limits a streak of out-of-memory steps shrank are what the device fits."""
        if self.streak:
            self.streak = 0
            if self.scheduler is not None:
                self.scheduler.oom_recovered()

    async def _shrink_pool(self) -> None:
        """Free the KV memory of the pool's last blocks: their holders are preempted (they recompute),
        cached ones are evicted (tiers copy them out), then the backend frees the memory."""
        pool = self.pool
        if (not isinstance(pool, ShrinkablePool) or not isinstance(self.worker.backend, ShrinkableBackend)
                or self.scheduler is None or pool is None):
            return
        target = max(pool.num_blocks - int(pool.num_blocks * KV_SHRINK_FRACTION), self.floor, 1)
        if target >= pool.num_blocks:
            return
        self.scheduler.vacate_blocks_from(target)
        before = pool.num_blocks
        pool.truncate(target)
        await self.worker.shrink_kv(target)
        self.num_pool_shrinks += 1
        log.warning("out of memory again: the KV pool gave %d of its %d blocks back", before - target, before)

    def stats(self) -> dict[str, int]:
        return {"num_oom_recoveries": self.num_recoveries, "num_oom_failures": self.num_failures,
                "num_kv_pool_shrinks": self.num_pool_shrinks}

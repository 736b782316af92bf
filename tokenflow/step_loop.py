"""The step loop: the one task that drives the model.

    scheduler.schedule() -> worker.step(plan) -> scheduler.update_from_output(plan, output, sink) -> observers
                            (model thread)       the output processor: text chunks to callers

Each step: hand aborted requests back to the scheduler (their blocks go back to
the pool), ask it for a plan, let the model worker (`runtime/worker.py`) run it
on the model thread, then let the scheduler take the step's tokens, which the
output processor turns into text chunks on the event loop. Request objects are
only mutated on the event loop, and, planned one at a time, between steps, so
the worker never sees a request change under it (an abort only marks the
request ended, which the worker ignores). This module imports no torch: the
worker is the seam.

With `async_scheduling`, decode steps chain: as soon as a step is queued on the
model thread, the scheduler plans the next from it (`schedule_ahead`) and that
is queued too, so the model thread goes from one to the next while the event
loop applies the first one's output. The ahead plan carries what the worker
reads of its requests that changes (position, block table; `AheadInput`), so
the event loop may update them meanwhile; the worker fills in each input token
from the step before, and skips the plan (`AheadSkipped`) when that step drew
none. Where the step before drew its tokens on the device (CUDA graphs), they
stay there: the worker queues the ahead plan before they reach the host, its
inputs taken on the device (`AheadInput.device_row`), and the step's output
waits for them off the model thread (`StepOutput.pending`); a row that drew
none then fails its request, and the token the queued step drew for it is
dropped.

A failed step fails the requests of that step with `EngineError`; after
`MAX_CONSECUTIVE_FAILURES` failed steps in a row the engine is dead and every
pending caller gets `EngineError`. A failing `schedule()` counts the same way,
but fails every pending request: the scheduler's view of all of them is
suspect, and failing them is the only way to be sure no caller waits on a
request that it dropped mid-schedule.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import anyio
import anyio.from_thread

from tokenflow.errors import EngineError
from tokenflow.out_of_memory import OutOfMemoryRecovery
from tokenflow.output.processor import OutputProcessor
from tokenflow.protocols import (
    AheadScheduler,
    AheadSkipped,
    DeviceOutOfMemory,
    EngineObserver,
    KVPool,
    RowFailure,
    Scheduler,
    StaticScheduler,
    StepOutput,
    StepPlan,
    notify_request_end,
)
from tokenflow.rates import DecodeStepTimes, RateWindow
from tokenflow.request import Request, RequestStatus
from tokenflow.runtime.model_thread import ModelJob
from tokenflow.runtime.worker import ModelWorker

__all__ = ("MAX_CONSECUTIVE_FAILURES", "KVLeakError", "StepLoop")

log = logging.getLogger("tokenflow")

MAX_CONSECUTIVE_FAILURES = 3


class KVLeakError(RuntimeError):
    """An idle engine still references KV blocks (raised only with `debug_leaks`)."""


class StepLoop:
    def __init__(
        self, worker: ModelWorker, scheduler: Scheduler | StaticScheduler, output: OutputProcessor,
        observers: list[EngineObserver], *, pool: KVPool | None = None, debug_leaks: bool = False,
        async_scheduling: bool = False,
    ) -> None:
        self.observers = observers
        self.debug_leaks = debug_leaks
        # Requests handed to the scheduler that are unfinished or still hold blocks (pruned as they
        # end, amortised O(1)): the leak check names holders from it, and a broken scheduler's
        # requests can be failed even when it lost track of them.
        self._tracked: dict[Request, None] = {}
        self._prune_at = 64
        self.worker = worker
        self.scheduler = scheduler
        self.out_of_memory = OutOfMemoryRecovery(scheduler, pool, worker)
        self.pool = pool
        self.output = output
        self.static = worker.static
        # Plan each decode step while the one before runs (`async_scheduling`), where scheduler and backend can
        self.async_scheduling = (async_scheduling and not self.static and worker.runs_ahead
                                 and isinstance(scheduler, AheadScheduler))
        if async_scheduling and not self.async_scheduling:
            log.warning("async_scheduling needs the paged backend and a scheduler with schedule_ahead; "
                        "steps are planned one at a time")
        self.dead = False
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._aborted: list[Request] = []
        self._failures = 0
        self.num_steps = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0
        self.num_ahead_steps = 0  # steps planned while the one before ran (async scheduling)
        self.num_ahead_skipped = 0  # ... that did not run: the step before drew no token for a request
        self.last_step_ms = 0.0
        self._tokens = RateWindow()  # generated tokens, for tokens/s
        self._decode_steps = DecodeStepTimes()  # decode-only steps' times by batch size, for stats

    @property
    def backend(self) -> Any:
        """The model worker's backend (tests and tools reach it here)."""
        return self.worker.backend

    # -- called from callers' tasks -------------------------------------------
    def add(self, request: Request) -> None:
        self.scheduler.add(request)  # may raise InvalidRequest: the caller gets it
        self._tracked[request] = None
        if len(self._tracked) > self._prune_at:
            self._tracked = {r: None for r in self._tracked if r.block_table or not r.finished}
            self._prune_at = 2 * len(self._tracked) + 64
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    def abort(self, request: Request, outcome: str = "aborted") -> None:
        """Mark `request` finished now; its blocks are released at the next step boundary."""
        if request.status is RequestStatus.FINISHED:
            return
        queued = request.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
        request.status = RequestStatus.FINISHED
        self.output.finish_aborted(request)
        self.num_aborted += 1
        self._notify_end(request, outcome)
        if queued:
            self._aborted.append(request)
            self._wake.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def fail_all(self, error: Exception) -> None:
        for request in self._pending():
            self._fail(request, error)

    def _pending(self) -> list[Request]:
        """Requests not yet finished: the scheduler's, and any it may have lost."""
        found = [*self.scheduler.waiting, *self.scheduler.running, *self._tracked]
        return [r for r in dict.fromkeys(found) if r.status is not RequestStatus.FINISHED]

    # -- the loop -------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            try:
                while True:
                    self._reap_aborted()
                    if self.dead or not self.scheduler.has_work():
                        break
                    if self.static:
                        await self._run_static_batch()
                    else:
                        await self._run_step()
                    await anyio.lowlevel.checkpoint()
            except Exception as exc:  # a bug in scheduling or output handling: fail loudly, never hang
                log.exception("tokenflow step loop crashed")
                self._die(exc)
            self._check_idle_leak()
            self._idle.set()

    async def _run_step(self) -> None:
        scheduler = self.scheduler
        assert isinstance(scheduler, Scheduler)
        try:
            plan = scheduler.schedule()
        except Exception as exc:
            log.exception("scheduler.schedule() failed")
            self._step_failed(self._pending(), exc, what="scheduling")
            return
        for request, error in plan.rejected:
            self._fail(request, error)
        if not plan.chunks and not plan.compressions:
            await anyio.sleep(0.001)  # waiting for blocks that an abort will free
            return
        job = self.worker.submit(plan)
        started = time.perf_counter()
        while True:  # with async scheduling, decode steps chain: each planned and queued while the one before runs
            ahead = self._plan_ahead(plan)
            if ahead is None:
                output = await self._await_step(plan, job, started, None)
                if output is not None:
                    self._apply(plan, output, started)
                return
            ahead_job = self.worker.submit(ahead)
            self.num_ahead_steps += 1
            output = await self._await_step(plan, job, started, ahead_job)
            ahead_started = time.perf_counter()  # the model thread went on to the ahead plan
            if output is None:  # `plan` did not run: the ahead plan, already settled, had no tokens to run on
                return
            self._apply(plan, output, started)  # while the ahead plan runs
            self._reap_aborted()
            await anyio.lowlevel.checkpoint()  # callers its chunks woke send their next request before the next plan
            plan, job, started = ahead, ahead_job, ahead_started

    def _plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """With async scheduling, the next decode step planned while `plan` runs (`AheadScheduler`)."""
        if not self.async_scheduling or self.dead:
            return None
        try:
            ahead = cast(AheadScheduler, self.scheduler).schedule_ahead(plan)
        except Exception:  # a scheduler bug: the next step is planned the usual way
            log.exception("scheduler.schedule_ahead() failed")
            return None
        if ahead is not None and any(c.ahead is None for c in ahead.chunks):  # would read requests as they change
            log.error("scheduler.schedule_ahead() returned a chunk without an AheadInput; planning as usual")
            return None
        return ahead

    async def _await_step(self, plan: StepPlan, job: ModelJob, started: float,
                          ahead_job: ModelJob | None) -> StepOutput | None:
        """The output of `plan`'s step; None when it did not run (its requests were failed, or, after a device
        out-of-memory, the next step made smaller). An ahead plan queued behind a step that did not run
        finds no tokens and is skipped (one chained on the device ran: its output is dropped, as its requests are
        those failed): that is awaited first, so nothing runs on the model thread meanwhile."""
        try:
            return await self.worker.result(job)
        except Exception as exc:
            error = exc
        if ahead_job is not None:
            try:
                await self.worker.result(ahead_job)
            except AheadSkipped:
                self.num_ahead_skipped += 1
            except Exception:  # it cannot have run without tokens; whatever it raised, it did nothing
                log.exception("a step planned ahead failed to skip")
        if isinstance(error, AheadSkipped):  # its requests carry on from the step before, planned afresh
            self.num_ahead_skipped += 1
            return None
        # An ahead plan's requests may have ended while it ran (stopped by the step before, aborted): not theirs
        live = [c for c in plan.chunks if not c.request.finished]
        if isinstance(error, DeviceOutOfMemory):  # a smaller step, before failing anyone (`out_of_memory.py`)
            if not live and plan.chunks:
                return None
            if len(live) < len(plan.chunks):
                plan = StepPlan(live, compressions=plan.compressions)
            failed = await self.out_of_memory.recover(plan, error)
            if failed:  # its size, not an engine fault: not counted towards the engine's death
                self._notify_step(time.perf_counter() - started, False)
                for request, failure in failed:
                    self._fail(request, failure)
            return None
        self._notify_step(time.perf_counter() - started, False)
        self._step_failed([c.request for c in live], error)
        return None

    def _apply(self, plan: StepPlan, output: StepOutput, started: float) -> None:
        """Hand a step's output to the scheduler (tokens to the output processor), and count the step."""
        scheduler = self.scheduler
        assert isinstance(scheduler, Scheduler)
        self._notify_step(time.perf_counter() - started, True)
        self._failures = 0
        self.num_steps += 1
        self.out_of_memory.step_ran()
        for request, first, entries in output.prompt_logprobs:  # positions not yet scored (a recompute repeats them)
            have = len(request.prompt_logprobs)
            request.prompt_logprobs.extend(entries[max(0, have - 1 - first):])
        result = scheduler.update_from_output(plan, output, self.output)
        for request, error in [*result.failed, *self.output.take_failures()]:
            self._fail(request, error)
        self._ended(result.finished, result.num_tokens)
        self.last_step_ms = (time.perf_counter() - started) * 1e3
        if plan.chunks and plan.num_tokens == len(plan.chunks) and not plan.compressions:  # decode-only: by batch
            self._decode_steps.add(len(plan.chunks), self.last_step_ms, output.forward_ms)

    async def _run_static_batch(self) -> None:
        scheduler = self.scheduler
        assert isinstance(scheduler, StaticScheduler)
        try:
            batch = scheduler.take_batch()
        except Exception as exc:
            log.exception("scheduler.take_batch() failed")
            self._step_failed(self._pending(), exc, what="scheduling")
            return
        if not batch:
            return

        def take(items: list[tuple[Request, int, Any]], failed: list[tuple[Request, RowFailure]]) -> None:
            finished = scheduler.accept_tokens([(request, token, logprob, False) for request, token, logprob in items],
                                               self.output)
            self._ended(finished, len(items))
            for request, failure in failed:
                self._fail(request, failure.error())

        def on_tokens(items: list[tuple[Request, int, Any]], failed: list[tuple[Request, RowFailure]]) -> None:
            anyio.from_thread.run_sync(take, items, failed)

        started = time.perf_counter()
        try:
            await self.worker.run_batch(batch, on_tokens)
            self._failures = 0
            self._notify_step(time.perf_counter() - started, True)
        except Exception as exc:
            self._notify_step(time.perf_counter() - started, False)
            self._step_failed([r for r in batch if not r.finished], exc)
        for request in batch:
            if not request.finished:  # generate hit its token budget first: a length finish
                self.output.finish_length(request)
                self._ended([request], 0)
            scheduler.finish(request)
        self.num_steps += 1
        self.last_step_ms = (time.perf_counter() - started) * 1e3

    def _ended(self, finished: list[Request], num_tokens: int) -> None:
        """Count the step's tokens, and tell observers of the requests that completed."""
        self._tokens.add(num_tokens)
        for request in finished:
            self.num_finished += 1
            self._notify_end(request, "completed")

    def _reap_aborted(self) -> None:
        aborted, self._aborted = self._aborted, []
        for request in aborted:
            self.scheduler.finish(request)

    # -- failures ---------------------------------------------------------------
    def _fail(self, request: Request, error: Exception) -> None:
        if request.status is not RequestStatus.FINISHED:
            self.num_failed += 1
            self._notify_end(request, "failed" if isinstance(error, EngineError) else "rejected")
        try:
            self.scheduler.finish(request)
        except Exception:  # a broken scheduler must not keep the caller waiting; the leak check reports blocks
            log.exception("scheduler.finish() failed for %s", request.request_id)
            request.status = RequestStatus.FINISHED
        request.collector.fail(error)

    def _notify_end(self, request: Request, outcome: str) -> None:
        notify_request_end(self.observers, request, outcome)

    def _notify_step(self, duration_s: float, ok: bool) -> None:
        for observer in self.observers:
            try:
                observer.on_step(duration_s, ok)
            except Exception:  # an observer's bug must not stop the loop (or skip the other observers)
                log.exception("observer %r failed in on_step", observer)

    def _step_failed(self, requests: list[Request], exc: Exception, what: str = "the model step") -> None:
        self._failures += 1
        log.error("%s failed (%d in a row): %r", what, self._failures, exc)
        error = EngineError(f"{what} failed: {exc!r}")
        error.__cause__ = exc
        for request in requests:
            self._fail(request, error)
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        self.dead = True
        error = EngineError(f"the engine died: {exc!r}")
        self.fail_all(error)

    def _check_idle_leak(self) -> None:
        """Nothing waits or runs: no KV block may be referenced. Name the holders; die with `debug_leaks`."""
        if self.scheduler.has_work():
            return
        self._tracked = {r: None for r in self._tracked if r.block_table or not r.finished}
        pool = self.pool
        if pool is None or not pool.num_used:
            return
        holders = [r for r in self._tracked if r.block_table]
        held = sum(len(r.block_table) for r in holders)
        names = ", ".join(f"{r.request_id} ({len(r.block_table)} blocks, {r.status.value})" for r in holders)
        message = f"idle engine still holds {pool.num_used} KV blocks: {names or 'no live request'}"
        if pool.num_used > held:
            message += f"; {pool.num_used - held} held by no live request"
        log.error(message)
        if self.debug_leaks:
            self._die(KVLeakError(message))

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "num_steps": self.num_steps,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_failed": self.num_failed,
            "num_ahead_steps": self.num_ahead_steps,
            "num_ahead_skipped": self.num_ahead_skipped,
            **self.out_of_memory.stats(),
            "step_time_ms": round(self.last_step_ms, 2),
            "tokens_per_s": round(self._tokens.rates()[1], 1),
            "dead": self.dead,
        }
        stats["decode_step_ms_by_batch"] = self._decode_steps.medians()
        stats.update(self.scheduler.stats())
        stats.update(self.worker.stats())
        return stats

"""The step loop: the one task that owns the model.

Each step: reap aborted requests (their blocks go back to the pool), ask the
batcher for a plan, run the model and sampler in a worker thread, then turn
the sampled tokens into chunks on the event loop. Request objects are only
mutated on the event loop, between steps, so the worker never sees a request
change under it (an abort only flips its status, which the worker ignores).

A failed step fails the requests of that step with `EngineError`; after
`MAX_CONSECUTIVE_FAILURES` failed steps in a row the engine is dead and every
pending caller gets `EngineError`. A failing `batcher.schedule()` counts the
same way, but fails every pending request: the batcher's view of all of them
is suspect, and failing them is the only way to be sure no caller waits on a
request that the batcher dropped mid-schedule.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import torch

from tokenflow.errors import EngineError, InvalidRequest
from tokenflow.output.processor import OutputProcessor
from tokenflow.protocols import StepPlan, notify_request_end
from tokenflow.request import Request, RequestStatus
from tokenflow.runtime.loader import LoadedModel
from tokenflow.runtime.model_thread import ModelThread
from tokenflow.runtime.sampler import RowFailure, Sampler, SamplerOutput, row_of
from tokenflow.scheduler.ngram import accepted_tokens

__all__ = ("MAX_CONSECUTIVE_FAILURES", "KVLeakError", "StepLoop", "sampling_error")

log = logging.getLogger("tokenflow")

MAX_CONSECUTIVE_FAILURES = 3
_RATE_WINDOW_S = 10.0


@dataclass(slots=True)
class StepTokens:
    """What the model thread returns for a step."""

    sampled: SamplerOutput  # one token per sampling chunk
    draft_argmax: list[list[int]]  # per sampling chunk: the argmax after each of its draft tokens


# (request, token, logprob, in_cache): a taken token, and whether its K/V is already in the cache
# (an accepted draft token, computed in the step that verified it).
TokenItem = tuple[Request, int, Any, bool]


def sampling_error(failure: RowFailure) -> Exception:
    """A row that drew no token fails its own request: an engine fault, or the caller's parameters."""
    if failure.model_fault:
        return EngineError(f"sampling failed: {failure.reason}")
    return InvalidRequest(f"sampling failed: {failure.reason}", field="params")


class KVLeakError(RuntimeError):
    """An idle engine still references KV blocks (raised only with `debug_leaks`)."""


class StepLoop:
    def __init__(
        self, backend: Any, batcher: Any, output: OutputProcessor, loaded: LoadedModel, observers: list[Any],
        *, model_thread: ModelThread, debug_leaks: bool = False,
    ) -> None:
        self.observers = observers
        self.model_thread = model_thread
        self.debug_leaks = debug_leaks
        # Requests handed to the batcher that are unfinished or still hold blocks (pruned as they
        # end, amortised O(1)): the leak check names holders from it, and a broken batcher's
        # requests can be failed even when it lost track of them.
        self._tracked: dict[Request, None] = {}
        self._prune_at = 64
        self.backend = backend
        self.batcher = batcher
        self.output = output
        self.sampler = Sampler(loaded.vocab_size, loaded.eos_token_ids)
        self.static = bool(getattr(backend, "static", False))
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
        self.num_oom_recoveries = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.last_step_ms = 0.0
        self.last_forward_ms = 0.0
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._decode_step_ms: dict[int, collections.deque[tuple[float, float]]] = {}

    # -- called from callers' tasks -------------------------------------------
    def add(self, request: Request) -> None:
        self.batcher.add(request)  # may raise InvalidRequest: the caller gets it
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
        """Requests not yet finished: the batcher's, and any it may have lost."""
        found = [*self.batcher.waiting, *self.batcher.running, *self._tracked]
        return [r for r in dict.fromkeys(found) if r.status is not RequestStatus.FINISHED]

    # -- the loop -------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            try:
                while True:
                    self._reap_aborted()
                    if self.dead or not self.batcher.has_work():
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
        try:
            plan = self.batcher.schedule()
        except Exception as exc:
            log.exception("batcher.schedule() failed")
            self._step_failed(self._pending(), exc, what="scheduling")
            return
        for request, error in plan.rejected:
            self._fail(request, error)
        if not plan.chunks:
            await anyio.sleep(0.001)  # waiting for blocks that an abort will free
            return
        started = time.perf_counter()
        try:
            result = await self.model_thread.run(self._execute, plan)
        except torch.OutOfMemoryError as exc:  # CUDA OOM: a smaller step, before failing anyone
            shrink = getattr(self.batcher, "shrink", None)
            if shrink is not None and shrink(plan):
                self.num_oom_recoveries += 1
                log.warning("out of memory in a step of %d tokens; shrinking the batch: %s", plan.num_tokens, exc)
                return
            self._notify_step(time.perf_counter() - started, False)
            self._step_failed([c.request for c in plan.chunks], exc)
            return
        except Exception as exc:
            self._notify_step(time.perf_counter() - started, False)
            self._step_failed([c.request for c in plan.chunks], exc)
            return
        self._notify_step(time.perf_counter() - started, True)
        self._failures = 0
        self.num_steps += 1
        items: list[TokenItem] = []
        j = 0  # index of the sampling chunk
        for chunk in plan.chunks:
            request = chunk.request
            samples = chunk.samples  # read before the request advances
            # Draft positions count as computed only as their tokens are taken (in _accept_tokens).
            request.num_computed_tokens += chunk.num_tokens - len(chunk.draft)
            if not samples:
                continue
            sampled = result.sampled
            failure = sampled.failed.get(j)
            if failure is not None:
                self._fail(request, sampling_error(failure))
                j += 1
                continue
            logprob = sampled.logprobs[j] if sampled.logprobs is not None else None
            tokens = [sampled.token_ids[j]]
            if chunk.draft:
                tokens = accepted_tokens(tokens[0], chunk.draft, result.draft_argmax[j])
                self.num_draft_tokens += len(chunk.draft)
                self.num_accepted_draft_tokens += len(tokens) - 1
            # Every taken token but the last was also a draft position: its K/V is in the cache.
            items.extend((request, token, logprob if k == 0 else None, k < len(tokens) - 1)
                         for k, token in enumerate(tokens))
            j += 1
        self._accept_tokens(items)
        self.last_step_ms = (time.perf_counter() - started) * 1e3
        if plan.num_tokens == len(plan.chunks):  # a decode-only step: track its time by batch size
            recent = self._decode_step_ms.setdefault(len(plan.chunks), collections.deque(maxlen=256))
            recent.append((self.last_step_ms, self.last_forward_ms))

    def _execute(self, plan: StepPlan) -> StepTokens:
        """Model thread: forward + sample (+ the argmax after each draft token)."""
        t0 = time.perf_counter()
        logits = self.backend.execute(plan)
        self.last_forward_ms = (time.perf_counter() - t0) * 1e3
        sampling = [c for c in plan.chunks if c.samples]
        rows = [row_of(c.request) for c in sampling]
        if not rows:
            return StepTokens(SamplerOutput(token_ids=[], logprobs=None), [])
        if not any(c.draft for c in sampling):
            return StepTokens(self.sampler.sample(logits, rows), [[] for _ in rows])
        argmax = logits[:, : self.sampler.vocab_size].argmax(-1).tolist()  # columns past the vocab are padding
        first: list[int] = []  # each sampling chunk's row of logits for its known token
        row = 0
        for c in sampling:
            first.append(row)
            row += 1 + len(c.draft)
        after_draft = [argmax[r + 1:r + 1 + len(c.draft)] for r, c in zip(first, sampling)]
        return StepTokens(self.sampler.sample(logits[first], rows), after_draft)

    async def _run_static_batch(self) -> None:
        try:
            batch = self.batcher.take_batch()
        except Exception as exc:
            log.exception("batcher.take_batch() failed")
            self._step_failed(self._pending(), exc, what="scheduling")
            return
        if not batch:
            return

        def on_tokens(items: list[tuple[Request, int, Any]], failed: list[tuple[Request, RowFailure]]) -> None:
            taken = [(request, token, logprob, False) for request, token, logprob in items]
            anyio.from_thread.run_sync(self._accept_tokens, taken)
            for request, failure in failed:
                anyio.from_thread.run_sync(self._fail, request, sampling_error(failure))

        started = time.perf_counter()
        try:
            await self.model_thread.run(self.backend.run_batch, batch, on_tokens)
            self._failures = 0
            self._notify_step(time.perf_counter() - started, True)
        except Exception as exc:
            self._notify_step(time.perf_counter() - started, False)
            self._step_failed([r for r in batch if not r.finished], exc)
        for request in batch:
            if not request.finished:  # generate hit its token budget first: a length finish
                self.output.finish_length(request)
                self.num_finished += 1
                self._notify_end(request, "completed")
            self.batcher.finish(request)
        self.num_steps += 1
        self.last_step_ms = (time.perf_counter() - started) * 1e3

    def _accept_tokens(self, items: list[TokenItem]) -> None:
        now = time.monotonic()
        count = 0
        for request, token, logprob, in_cache in items:
            if request.status is RequestStatus.FINISHED:
                continue  # aborted while the step ran, or ended by an earlier token of its draft
            count += 1
            if in_cache:
                request.num_computed_tokens += 1
            if self.output.append(request, token, logprob):
                self.batcher.finish(request)
                self.num_finished += 1
                self._notify_end(request, "completed")
        self._recent_tokens.append((now, count))
        while self._recent_tokens and now - self._recent_tokens[0][0] > _RATE_WINDOW_S:
            self._recent_tokens.popleft()

    def _reap_aborted(self) -> None:
        aborted, self._aborted = self._aborted, []
        for request in aborted:
            self.batcher.finish(request)

    # -- failures ---------------------------------------------------------------
    def _fail(self, request: Request, error: Exception) -> None:
        if request.status is not RequestStatus.FINISHED:
            self.num_failed += 1
            self._notify_end(request, "failed" if isinstance(error, EngineError) else "rejected")
        try:
            self.batcher.finish(request)
        except Exception:  # a broken batcher must not keep the caller waiting; the leak check reports blocks
            log.exception("batcher.finish() failed for %s", request.request_id)
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
        if self.batcher.has_work():
            return
        self._tracked = {r: None for r in self._tracked if r.block_table or not r.finished}
        pool = getattr(self.batcher, "pool", None)
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
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent_tokens if now - t <= _RATE_WINDOW_S]
        span = (now - recent[0][0]) if recent else 0.0
        stats = {
            "num_steps": self.num_steps,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_failed": self.num_failed,
            "num_oom_recoveries": self.num_oom_recoveries,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "step_time_ms": round(self.last_step_ms, 2),
            "forward_time_ms": round(self.last_forward_ms, 2),
            "tokens_per_s": round(sum(n for _, n in recent) / span, 1) if span > 0 else 0.0,
            "dead": self.dead,
        }
        stats["decode_step_ms_by_batch"] = {
            size: {"step": round(statistics.median(s for s, _ in times), 2),
                   "forward": round(statistics.median(f for _, f in times), 2), "count": len(times)}
            for size, times in sorted(self._decode_step_ms.items())
        }
        stats.update(self.batcher.stats())
        stats.update(self.backend.stats())
        return stats

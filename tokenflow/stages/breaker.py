"""The `breaker` stage: admission control, first on the request path.

An engine that shares a process with its app must refuse work early and say
when to come back, rather than queue without bound or keep feeding a failing
model. Two guards, both answered with `Overloaded(retry_after=...)`:

* **A bounded waiting queue**, by requests (`max_queue`) and by prompt tokens
  (`max_queue_tokens`). "Queued" is every request this stage let through
  that is still on the request path (tokenizing, ...) plus the batcher's
  waiting list, so a burst of callers cannot all slip past while the
  tokenizer is busy. The token bound needs token counts, which exist only
  after the tokenizer (later on the path): a text prompt is refused up front
  only when queued tokens already fill the bound, and counted exactly once
  `call_next` returns. At that moment the request sits in the waiting queue
  but the step loop has not run (nothing awaits between the enqueue and the
  return, for the built-in stages), so a refusal aborts it before it can
  reach the model; the tokenizer's work for it is the price of an exact
  count (estimates from text length are off by 2-4x across scripts and
  tokenizers). An empty queue always admits one request, so a prompt larger
  than the bound is not refused forever. `retry_after` is the time the
  engine needs, at its recent completion rate, to make room.
* **A circuit breaker**: *closed* -> *open* when, over the last
  `breaker_window` outcomes, the share of `EngineError` failures exceeds
  `breaker_error_rate`, or the p95 step duration over the last
  `breaker_window` steps exceeds `breaker_step_p95_ms`. Both need half a
  window of samples (at least 4) first: one early failure must not trip it.
  *Open* refuses everything for `breaker_open_s` (`retry_after` = the time
  left), then *half-open* lets `breaker_probes` probe requests through; when
  they all complete on healthy steps it closes, and any failure re-opens it.

The stage sees outcomes and step durations as an `EngineObserver`
(registered in `ctx.observers` at start); caller-side endings (cancel,
deadline) are neutral: they say nothing about the engine's health.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from tokenflow.config import EngineConfig
from tokenflow.errors import Overloaded
from tokenflow.protocols import EngineContext, NextStage, Scheduler, StaticScheduler
from tokenflow.rates import RateWindow
from tokenflow.request import Request, RequestSlot

__all__ = ("BreakerStage", "create")

log = logging.getLogger("tokenflow")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_RATE_WINDOW_S = 10.0  # completions counted for the throughput behind retry-after hints
_MIN_RETRY_S = 0.05
_MAX_RETRY_S = 60.0
_FALLBACK_RETRY_S = 1.0  # no throughput measured yet


class BreakerStage:
    """Request stage and engine observer. `clock` is injectable for tests."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queue = config.max_queue
        self.max_queue_tokens = config.max_queue_tokens
        self.error_rate = config.breaker_error_rate
        self.step_p95_s = config.breaker_step_p95_ms / 1e3 if config.breaker_step_p95_ms else None
        self.window = config.breaker_window
        self.min_samples = max(4, config.breaker_window // 2)
        self.open_s = config.breaker_open_s
        self.num_probes = config.breaker_probes
        self._clock = clock
        self._admitted_at = RequestSlot[float]("breaker admission time")  # for the latency behind retry hints
        self.scheduler: Scheduler | StaticScheduler | None = None
        self.state = CLOSED
        self.opened_at = 0.0
        self.trip_reason = ""
        self.history: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=32)  # (wall, state, why)
        self._outcomes: collections.deque[bool] = collections.deque(maxlen=self.window)  # True = failed
        self._num_failed = 0
        self._steps: collections.deque[float] = collections.deque(maxlen=self.window)
        self._num_slow = 0
        self._probes: set[Request] = set()
        self._probe_successes = 0
        self._admitting = 0
        self._completions = RateWindow(_RATE_WINDOW_S, clock)  # completed requests, by prompt tokens
        self._latency_s: float | None = None  # moving average of completed requests' latency
        self.breaker_rejections = 0
        self.breaker_trips = 0
        self.queue_rejections = 0

    async def start(self, ctx: EngineContext) -> None:
        self.scheduler = ctx.scheduler
        self._completions = RateWindow(_RATE_WINDOW_S, self._clock)
        ctx.observers.append(self)

    # -- the request path -------------------------------------------------------
    async def handle(self, request: Request, call_next: NextStage) -> None:
        now = self._clock()
        probe = self._check_breaker(now)
        self._check_queue(request)
        if probe:
            self._probes.add(request)
        self._admitted_at.set(request, now)
        self._admitting += 1
        try:
            await call_next(request)
        finally:
            self._admitting -= 1
        if self.max_queue_tokens is not None:
            mine = _backlog(request)
            others = self.waiting_tokens() - mine
            if others > 0 and others + mine > self.max_queue_tokens:
                self._refuse_tokens(others + mine)

    def _check_queue(self, request: Request) -> None:
        queued = self.queued()
        if queued >= self.max_queue:
            self.queue_rejections += 1
            raise Overloaded(
                f"the waiting queue is full ({queued} of {self.max_queue} requests)",
                retry_after=_drain_time(queued + 1 - self.max_queue, self._rates()[0]),
            )
        if self.max_queue_tokens is None:
            return
        tokens = self.waiting_tokens()
        known = _backlog(request) if request.prompt_token_ids is not None else 1
        if tokens > 0 and tokens + known > self.max_queue_tokens:
            self._refuse_tokens(tokens + known)

    def _refuse_tokens(self, total: int) -> None:
        assert self.max_queue_tokens is not None
        self.queue_rejections += 1
        raise Overloaded(
            f"the waiting queue is full ({total} prompt tokens with this request; "
            f"bound {self.max_queue_tokens})",
            retry_after=_drain_time(total - self.max_queue_tokens, self._rates()[1]),
        )

    def _check_breaker(self, now: float) -> bool:
        """Raise when the breaker refuses; True when the request goes through as a half-open probe."""
        self._refresh(now)
        if self.state == CLOSED:
            return False
        if self.state == OPEN:
            self.breaker_rejections += 1
            raise Overloaded(f"the circuit breaker is open ({self.trip_reason})",
                             retry_after=max(self.opened_at + self.open_s - now, 0.01))
        if len(self._probes) >= self.num_probes:
            self.breaker_rejections += 1
            hint = self._latency_s if self._latency_s is not None else min(_FALLBACK_RETRY_S, self.open_s)
            raise Overloaded("the circuit breaker is half-open and its probe requests are running",
                             retry_after=_clamp(hint))
        return True

    # -- queue accounting -------------------------------------------------------
    def queued(self) -> int:
        """Requests let through and not yet running: on the request path or in the scheduler's queue."""
        return self._admitting + (len(self.scheduler.waiting) if self.scheduler is not None else 0)

    def waiting_tokens(self) -> int:
        """Tokens the waiting queue still has to prefill (O(queue); only with `max_queue_tokens`)."""
        return sum(_backlog(r) for r in self.scheduler.waiting) if self.scheduler is not None else 0

    # -- the observer ------------------------------------------------------------
    def on_step(self, duration_s: float, ok: bool) -> None:
        steps = self._steps
        if len(steps) == steps.maxlen and self._is_slow(steps[0]):
            self._num_slow -= 1
        steps.append(duration_s)
        if self._is_slow(duration_s):
            self._num_slow += 1
        if self.state == CLOSED and self._latency_exceeded(self.min_samples):
            self._trip(f"p95 step time {self.step_p95_ms():.1f} ms > {self.step_p95_s * 1e3:.1f} ms")

    def on_request_end(self, request: Request, outcome: str) -> None:
        now = self._clock()
        if outcome == "completed":
            self._note_completion(request, now)
        elif outcome != "failed":  # cancelled, timed out or refused: says nothing about health
            self._probes.discard(request)  # frees a probe's slot for another
            return
        failed = outcome == "failed"
        self._refresh(now)
        if self.state == CLOSED:
            self._record_outcome(failed)
            n = len(self._outcomes)
            if n >= self.min_samples and self._num_failed > self.error_rate * n:
                self._trip(f"{self._num_failed} of the last {n} requests failed")
        elif self.state == HALF_OPEN:
            probe = request in self._probes
            self._probes.discard(request)
            if failed:
                self._trip("a request failed while half-open")
            elif probe and self._latency_exceeded(1):
                self._trip(f"probe steps still slow (p95 {self.step_p95_ms():.1f} ms)")
            elif probe:
                self._probe_successes += 1
                if self._probe_successes >= self.num_probes:
                    self._close()

    def _note_completion(self, request: Request, now: float) -> None:
        self._completions.add(request.num_prompt_tokens)
        t0 = self._admitted_at.pop(request)
        if t0 is not None:
            latency = now - t0
            average = self._latency_s
            self._latency_s = latency if average is None else 0.8 * average + 0.2 * latency

    def _record_outcome(self, failed: bool) -> None:
        outcomes = self._outcomes
        if len(outcomes) == outcomes.maxlen and outcomes[0]:
            self._num_failed -= 1
        outcomes.append(failed)
        self._num_failed += failed

    def _is_slow(self, duration_s: float) -> bool:
        return self.step_p95_s is not None and duration_s > self.step_p95_s

    def _latency_exceeded(self, min_samples: int) -> bool:
        """Nearest-rank p95 > threshold  <=>  more than 5% of the window is slower than it: O(1)."""
        n = len(self._steps)
        return self.step_p95_s is not None and n >= min_samples and self._num_slow > 0.05 * n

    # -- transitions ---------------------------------------------------------------
    def _refresh(self, now: float) -> None:
        if self.state == OPEN and now >= self.opened_at + self.open_s:
            self.state = HALF_OPEN
            self.history.append((time.time(), HALF_OPEN, "open period over: probing"))
            self._probes.clear()
            self._probe_successes = 0
            self._reset_windows()  # probes are judged on fresh steps only

    def _trip(self, reason: str) -> None:
        self.state = OPEN
        self.opened_at = self._clock()
        self.trip_reason = reason
        self.breaker_trips += 1
        self.history.append((time.time(), OPEN, reason))
        self._probes.clear()
        log.warning("circuit breaker open for %.1f s: %s", self.open_s, reason)

    def _close(self) -> None:
        self.state = CLOSED
        self.history.append((time.time(), CLOSED, f"{self._probe_successes} probe requests succeeded"))
        self._probes.clear()
        self._reset_windows()
        log.warning("circuit breaker closed: %d probe requests succeeded", self._probe_successes)

    def _reset_windows(self) -> None:
        self._outcomes.clear()
        self._num_failed = 0
        self._steps.clear()
        self._num_slow = 0

    # -- hints and stats -------------------------------------------------------------
    def _rates(self) -> tuple[float, float]:
        """Recent completions per second, and their prompt tokens per second."""
        return self._completions.rates()

    def step_p95_ms(self) -> float | None:
        if not self._steps:
            return None
        ordered = sorted(self._steps)
        return ordered[math.ceil(0.95 * len(ordered)) - 1] * 1e3

    def stats(self) -> dict[str, Any]:
        self._refresh(self._clock())
        p95 = self.step_p95_ms()
        n = len(self._outcomes)
        return {
            "breaker_state": self.state,
            "breaker_rejections": self.breaker_rejections,
            "breaker_trips": self.breaker_trips,
            "queue_rejections": self.queue_rejections,
            "breaker_error_rate": round(self._num_failed / n, 3) if n else 0.0,
            "breaker_step_p95_ms": round(p95, 2) if p95 is not None else None,
            "breaker_history": [list(entry) for entry in self.history],
        }


def _backlog(request: Request) -> int:
    """Tokens a waiting request still has to prefill (its prompt; more after a preemption)."""
    return request.num_tokens - request.num_computed_tokens


def _drain_time(excess: float, rate: float) -> float:
    """Seconds to serve `excess` more requests (or tokens) at `rate` per second."""
    return _clamp(excess / rate) if rate > 0 else _FALLBACK_RETRY_S


def _clamp(seconds: float) -> float:
    return min(max(seconds, _MIN_RETRY_S), _MAX_RETRY_S)


def create(config: EngineConfig) -> BreakerStage:
    return BreakerStage(config)

"""Per-second rates over a sliding time window (recent throughput for stats and retry-after hints), and
the recent decode step times by batch size."""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

__all__ = ("DecodeStepTimes", "RateWindow")


class RateWindow:
    """Events with an amount each, over the last `window_s` seconds: `add` is amortised O(1)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._total = 0.0

    def add(self, amount: float = 1.0) -> None:
        now = self._clock()
        self._events.append((now, amount))
        self._total += amount
        self._prune(now)

    def rates(self) -> tuple[float, float]:
        """(events, amount) per second over the window, or over the time since start while shorter."""
        now = self._clock()
        self._prune(now)
        span = min(self.window_s, now - self._started)
        if not self._events or span <= 0:
            return 0.0, 0.0
        return len(self._events) / span, self._total / span

    def _prune(self, now: float) -> None:
        events = self._events
        while events and now - events[0][0] > self.window_s:
            self._total -= events.popleft()[1]


class DecodeStepTimes:
    """The last `keep` decode-only steps' (step, forward) milliseconds per batch size, as medians."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._times: dict[int, collections.deque[tuple[float, float]]] = {}

    def add(self, batch: int, step_ms: float, forward_ms: float) -> None:
        self._times.setdefault(batch, collections.deque(maxlen=self.keep)).append((step_ms, forward_ms))

    def medians(self) -> dict[int, dict[str, float]]:
        return {size: {"step": round(statistics.median(s for s, _ in times), 2),
                       "forward": round(statistics.median(f for _, f in times), 2), "count": len(times)}
                for size, times in sorted(self._times.items())}

"""The engine's live dashboard: `GET /dashboard` (one self-contained page, no CDN) polls
`GET /v1/engine/stats` (this module's JSON) once a second.

The JSON is `engine.stats()` plus what a snapshot of counters cannot show, kept by `DashboardFeed`, an
engine observer: the distributions of recent step times and times to first token, request outcomes, and
the latest errors by type. Rates and "over time" charts are drawn by the page from successive polls.

Both routes sit behind the API key (`openai_app._authorized`: `Authorization: Bearer <key>`, or Basic auth
with the key as the password). The page builds every URL it fetches from `location.origin`, never from its
own URL, which may carry `user:key@` (a browser refuses a fetch to a URL with credentials); the key reaches
those fetches as the Basic-auth identity the browser logged in to the page with (from the URL or its login
prompt), which it sends again to the same origin, or as the Bearer header a proxy or extension adds to every
request.
"""

from __future__ import annotations

import bisect
import collections
import time
from importlib import resources
from typing import Any

from tokenflow.request import Request

__all__ = ("STEP_MS_EDGES", "TTFT_S_EDGES", "DashboardFeed", "dashboard_html")

STEP_MS_EDGES = (5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000)  # histogram bucket upper edges
TTFT_S_EDGES = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_RECENT = 2048  # steps and requests the distributions cover
_ERRORS = 20  # latest errors listed
_MESSAGE_CHARS = 200  # an error's message, cut (the page wraps it, however long its words)


def _histogram(values: collections.deque[float], edges: tuple[float, ...]) -> dict[str, Any]:
    counts = [0] * (len(edges) + 1)  # the last bucket: above the last edge
    for value in values:
        counts[bisect.bisect_left(edges, value)] += 1
    return {"edges": list(edges), "counts": counts}


class DashboardFeed:
    """Engine observer keeping the recent step times, times to first token, outcomes and errors."""

    def __init__(self) -> None:
        self.step_ms: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self.ttft_s: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.error_counts: collections.Counter[str] = collections.Counter()
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=_ERRORS)

    # EngineObserver
    def on_step(self, duration_s: float, ok: bool) -> None:
        self.step_ms.append(duration_s * 1e3)

    def on_request_end(self, request: Request, outcome: str) -> None:
        self.outcomes[outcome] += 1
        if request.first_token_time is not None:
            self.ttft_s.append(max(0.0, request.first_token_time - request.created_at))

    def record_error(self, error: BaseException) -> None:
        """An error an HTTP caller got (the routes report each one, wherever it was raised)."""
        kind = type(error).__name__
        self.error_counts[kind] += 1
        message = str(error)
        if len(message) > _MESSAGE_CHARS:
            message = message[:_MESSAGE_CHARS - 1] + "…"
        self.errors.appendleft({"time": time.time(), "type": kind, "message": message})

    def snapshot(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The JSON of `GET /v1/engine/stats`."""
        return {
            "time": time.time(),
            "recent": _RECENT,  # how many of the latest steps and requests the histograms count
            "stats": stats,
            "step_ms": _histogram(self.step_ms, STEP_MS_EDGES),
            "ttft_s": _histogram(self.ttft_s, TTFT_S_EDGES),
            "outcomes": dict(self.outcomes),
            "error_counts": dict(self.error_counts),
            "errors": list(self.errors),
        }


def dashboard_html() -> bytes:
    """The page, from the package's static files."""
    return resources.files("tokenflow.serve").joinpath("static/dashboard.html").read_bytes()

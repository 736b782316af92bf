"""Progress of the slow one-time steps (model download and conversion, kernel build, warm-up).

On a terminal they draw a tqdm bar on stderr; anywhere else (a service's log, CI, a pipe) each step
is one plain log line instead, because a redrawn bar in a log file is noise.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

from tqdm import tqdm

__all__ = ("ByteBar", "StageBar", "on_terminal", "quiet_transformers", "steps")

log = logging.getLogger("tokenflow.progress")

T = TypeVar("T")


def on_terminal() -> bool:
    """True when stderr is an interactive terminal (where a redrawn bar reads well)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class StageBar:
    """Counts through the named `stages` of one job; nothing at all when `enabled` is false."""

    def __init__(self, title: str, stages: Sequence[str], *, enabled: bool = True) -> None:
        self.stages = tuple(stages)
        self.enabled = enabled
        self._title = title
        self._done = 0
        self._started = time.perf_counter()
        self._bar = tqdm(
            total=len(self.stages), desc=title, unit="stage", file=sys.stderr, leave=True,
            bar_format="{desc}: {n_fmt}/{total_fmt} stages |{bar:20}| {elapsed}",
        ) if enabled and on_terminal() else None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Show `name` while the block runs, then count it as done."""
        if self._bar is not None:
            self._bar.set_description_str(f"{self._title} ({name})", refresh=True)
        elif self.enabled:
            log.info("%s: %s (%d/%d)", self._title, name, self._done + 1, len(self.stages))
        yield
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self, *, failed: bool = False) -> None:
        outcome = "failed" if failed else "done"
        if self._bar is not None:
            self._bar.set_description_str(f"{self._title} ({outcome})", refresh=False)
            self._bar.close()
        elif self.enabled:
            log.info("%s: %s in %.1f s", self._title, outcome, time.perf_counter() - self._started)

    def __enter__(self) -> StageBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(failed=exc_type is not None)


class ByteBar:
    """Bytes of a download: a bar on a terminal, else a log line at each quarter."""

    def __init__(self, title: str, total: int | None, *, enabled: bool = True) -> None:
        self.title, self.total, self.enabled = title, total, enabled
        self.done = 0
        self._logged_quarter = 0
        self._bar = tqdm(total=total, desc=title, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         leave=True) if enabled and on_terminal() else None

    def update(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self.enabled and self.total:
            quarter = min(4, self.done * 4 // self.total)
            if quarter > self._logged_quarter:
                self._logged_quarter = quarter
                log.info("%s: %d%% of %.1f MiB", self.title, quarter * 25, self.total / 2**20)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> ByteBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def steps(items: Iterable[T], title: str, *, total: int | None = None) -> Iterator[T]:
    """Iterate `items` under a bar (terminal) or one log line per item (elsewhere)."""
    if on_terminal():
        yield from tqdm(items, desc=title, total=total, file=sys.stderr, leave=False)
        return
    items = list(items)
    for n, item in enumerate(items, 1):
        log.info("%s %d/%d", title, n, len(items))
        yield item


@contextmanager
def quiet_transformers(quiet: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (loading, converting) where ours are off or not drawn.

    Its "Loading weights"/"Writing model shards" bars obey a process-wide switch,
    which is restored afterwards; the GGUF dequantisation bar is created
    unconditionally, so its module-level `tqdm` is swapped for a disabled one
    (skipped if a transformers version moves it).
    """
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - layout changed
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()

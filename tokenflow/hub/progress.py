"""A single progress bar over the named stages of a model conversion.

Preparing the embedded model takes up to a minute in steps of very different
length (fetch, verify, convert, save), so users see one bar that names the step
it is in and how long it has been running, instead of wondering whether the
process hung.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tqdm import tqdm

__all__ = ("StageBar",)


class StageBar:
    """Counts through `stages` on stderr; a no-op when `enabled` is false."""

    def __init__(self, title: str, stages: Sequence[str], *, enabled: bool = True) -> None:
        self.stages = tuple(stages)
        self.enabled = enabled
        self._title = title
        self._bar = tqdm(
            total=len(self.stages),
            desc=title,
            unit="stage",
            file=sys.stderr,
            disable=not enabled,
            leave=True,
            bar_format="{desc}: {n_fmt}/{total_fmt} stages |{bar:20}| {elapsed}",
        )

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Show `name` while the block runs, then count it as done."""
        self._bar.set_description_str(f"{self._title} ({name})", refresh=True)
        yield
        self._bar.update(1)

    def close(self, *, failed: bool = False) -> None:
        self._bar.set_description_str(f"{self._title} ({'failed' if failed else 'done'})", refresh=False)
        self._bar.close()

    def __enter__(self) -> StageBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(failed=exc_type is not None)

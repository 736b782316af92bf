"""Stop-string matching over streamed text deltas, with minimal hold-back.

Text that could still turn out to be the start of a stop string is held back
(never shown, then retracted); everything else is released at once.

Invariants, with `T` = the concatenation of all deltas fed so far:

* Match rule: the stop occurrence in `T` that *ends* first wins; among those
  ending at the same place, the one that starts first (the longer one). So for
  stops ["ab", "abc"] the text "abc" stops at "ab", and for ["bc", "abc"] it stops at "abc".
* On a match, `feed` returns ``(T[:start] + (stop if include_stop else ""))[already_emitted:]``
  and the stop; the matcher is then done (later feeds return ("", None)).
* Without a match, the text emitted so far is `T` minus its longest suffix that
  is a proper prefix of some stop string (so held text is shorter than the
  longest stop), and `flush()` returns that held suffix.

Cost per feed: O(len(delta) + L) string work per stop, L = the longest stop,
independent of the length of `T`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ("StopStringMatcher",)


class StopStringMatcher:
    """Finds the earliest stop string in text fed in pieces; see the module doc."""

    __slots__ = ("_done", "_firsts", "_held", "_include", "_max_held", "_prefixes", "_stops", "matched")

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single str")
        stops = tuple(dict.fromkeys(stop))
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty str")
        self._stops = stops
        self._include = include_stop
        # Every proper prefix of every stop: the only suffixes worth holding back.
        self._prefixes = frozenset(s[:k] for s in stops for k in range(1, len(s)))
        self._firsts = tuple({p[0] for p in self._prefixes})  # chars a held suffix can start with
        self._max_held = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self._done = False
        self.matched: str | None = None  # the stop that ended the text, once found

    @property
    def done(self) -> bool:
        """True once a stop string matched; the stream should end."""
        return self._done

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add a delta; return (text safe to show now, matched stop or None)."""
        if self._done or not delta:
            return "", None
        buf = self._held + delta if self._held else delta
        # `_held` contains no complete stop (it would have matched earlier), and no
        # occurrence can start before it (it is the longest stop-prefix suffix), so
        # the earliest match in `buf` is the earliest match in the whole text.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        if best is not None:
            _, start, stop = best
            self._done = True
            self._held = ""
            self.matched = stop
            return (buf[:start] + stop if self._include else buf[:start]), stop
        keep = self._held_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop."""
        start = max(0, len(buf) - self._max_held)
        tail = buf[start:]
        for c in self._firsts:
            if c in tail:
                break
        else:
            return 0  # the common case: no stop can start in the tail
        prefixes = self._prefixes
        for i in range(start, len(buf)):
            if buf[i:] in prefixes:
                return len(buf) - i
        return 0

    def flush(self) -> str:
        """End of text without a match: release what was held back."""
        held, self._held = self._held, ""
        return "" if self._done else held

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

How: an Aho–Corasick automaton over the stops (a trie with failure links, and
output links to the longest stop ending at each state). Its state after `T` is
the longest suffix of `T` that is a prefix of some stop, which is exactly the
held-back text when nothing matched, so a feed resumes from the saved state and
walks only the delta. (pyahocorasick cannot resume a search from a saved state
across deltas, hence this small one.)

Cost: construction and memory O(total characters of the stops), about 30 bytes a
character, with the trie appended in bulk (C loops); failure links are computed
on first use, each once, so a long stop costs Python work only for the states a
text actually reaches. `feed` is O(len(delta)) amortised plus the length of the
text it returns, independent of the length of `T` and of the stop lengths.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_right
from collections.abc import Sequence

__all__ = ("StopStringMatcher",)

_MAX_REGEX_FIRSTS = 256  # more distinct first characters than this: step the root per char (re caches patterns)
_NEVER = re.compile(r"[^\s\S]")  # no stops: nothing can start one


class StopStringMatcher:
    """Finds the earliest stop string in text fed in pieces; see the module doc.

    States are ints, 0 the root. The trie nodes a stop adds get consecutive ids (a
    "run"), so most edges are chain edges v -> v + 1 (``_chain[v]`` set, character
    ``_label[v + 1]``); edges out of the root live in ``_root`` and the one edge that
    starts each later run in ``_branch``. A state's text is a prefix of the stop
    that created its run (``_owners``), so held text is never stored, only sliced.
    Failure and output links are -1 until `_fail_of` / `_out_of` first need them.
    """

    __slots__ = (
        "_branch", "_chain", "_depth", "_done", "_fail", "_first", "_include", "_label", "_out",
        "_owners", "_parents", "_root", "_run_starts", "_state", "_terminal", "matched",
    )

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single str")
        stops = tuple(dict.fromkeys(stop))
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty str")
        self._include = include_stop
        self._build_trie(stops)
        root = self._root
        if not root:
            self._first: re.Pattern[str] | None = _NEVER
        elif len(root) <= _MAX_REGEX_FIRSTS:
            self._first = re.compile("[" + "".join(map(re.escape, root)) + "]")
        else:
            self._first = None
        self._state = 0
        self._done = False
        self.matched: str | None = None  # the stop that ended the text, once found

    def _build_trie(self, stops: tuple[str, ...]) -> None:
        """Insert the stops; each one's new nodes are appended as one run, in bulk."""
        self._root: dict[str, int] = {}
        self._branch: dict[tuple[int, str], int] = {}
        self._parents: dict[int, int] = {}  # the parent of each run's first node (chain nodes: v - 1)
        self._chain = bytearray(1)  # _chain[v]: v + 1 is v's child (same run); never set for the root
        self._depth = array("q", [0])  # length of each state's text
        self._run_starts: list[int] = []  # first id of each run, ascending...
        self._owners: list[str] = []  # ...and the stop that created it
        self._terminal: dict[int, str] = {}  # state -> the stop it spells
        labels = ["\0"]  # the root has no incoming edge; this placeholder is never read
        for s in stops:
            v = k = 0
            owner = ""  # the stop that created v's run
            while k < len(s):  # walk the part of `s` already in the trie
                c = s[k]
                if v and self._chain[v] and owner[k] == c:
                    v += 1
                else:
                    nxt = self._branch.get((v, c)) if v else self._root.get(c)
                    if nxt is None:
                        break
                    v, owner = nxt, self._owner(nxt)
                k += 1
            if k == len(s):
                self._terminal[v] = s  # a prefix of an earlier stop
                continue
            first = len(self._depth)
            if v:
                self._branch[(v, s[k])] = first
            else:
                self._root[s[k]] = first
            self._parents[first] = v
            self._chain += b"\x01" * (len(s) - k - 1) + b"\x00"
            self._depth.extend(range(k + 1, len(s) + 1))
            labels.append(s[k:])
            self._run_starts.append(first)
            self._owners.append(s)
            self._terminal[len(self._depth) - 1] = s
        self._label = "".join(labels)  # _label[v]: the character on the edge into v
        # Failure and output links, -1 until first used (see `_fail_of`, `_out_of`): a text reaches few
        # states of a long stop, and computing them all up front is a Python loop over every character.
        n = len(self._depth)
        self._fail = array("q", [-1]) * n  # the longest proper suffix of v's text that is a state
        self._out = array("q", [-1]) * n  # the deepest stop state on v's failure chain (v included), or 0
        self._fail[0] = self._out[0] = 0
        for u in self._root.values():
            self._fail[u] = 0
        for u in self._terminal:
            self._out[u] = u

    def _edge(self, state: int, c: str) -> int | None:
        """The trie edge out of `state` on `c`, if any."""
        if not state:
            return self._root.get(c)
        if self._chain[state] and self._label[state + 1] == c:
            return state + 1
        return self._branch.get((state, c))

    def _fail_of(self, u: int) -> int:
        """`u`'s failure link, computed on first use with those it needs (shallower ones), each once."""
        fail, label = self._fail, self._label
        todo = [(u, -1)]  # (state, where its search resumes; -1: at its parent's failure link)
        while todo:
            v, x = todo.pop()
            if x < 0:
                parent = v - 1 if self._chain[v - 1] else self._parents[v]
                x = fail[parent]
                if x < 0:
                    todo += ((v, -1), (parent, -1))
                    continue
            c = label[v]
            while (f := self._edge(x, c)) is None and x:
                if fail[x] < 0:
                    todo += ((v, x), (x, -1))
                    break
                x = fail[x]
            else:
                fail[v] = f or 0
        return fail[u]

    def _out_of(self, u: int) -> int:
        """The deepest stop state on `u`'s failure chain (`u` included), or 0; computed on first use."""
        out, fail = self._out, self._fail
        unknown: list[int] = []
        while (o := out[u]) < 0:
            unknown.append(u)
            u = fail[u] if fail[u] >= 0 else self._fail_of(u)
        for v in unknown:
            out[v] = o
        return o

    def _owner(self, state: int) -> str:
        """The stop that created `state`'s run: the state's text is its prefix."""
        return self._owners[bisect_right(self._run_starts, state) - 1]

    @property
    def done(self) -> bool:
        """True once a stop string matched; the stream should end."""
        return self._done

    @property
    def num_states(self) -> int:
        """Automaton size, root included: at most the stops' total characters + 1."""
        return len(self._depth)

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add a delta; return (text safe to show now, matched stop or None)."""
        if self._done or not delta:
            return "", None
        start = state = self._state
        first, root, out = self._first, self._root, self._out
        chain, label, branch, fail = self._chain, self._label, self._branch, self._fail
        i, n = 0, len(delta)
        while i < n:
            if state:  # the transition: follow failure links until an edge on c, else the root
                c = delta[i]
                while state:
                    if chain[state] and label[state + 1] == c:
                        state += 1
                        break
                    nxt = branch.get((state, c))
                    if nxt is not None:
                        state = nxt
                        break
                    f = fail[state]
                    state = f if f >= 0 else self._fail_of(state)
                else:
                    state = root.get(c, 0)
            elif first is None:
                state = root.get(delta[i], 0)
            else:  # at the root, skip straight to the next character that can start a stop
                hit = first.search(delta, i)
                if hit is None:
                    break
                i = hit.start()
                state = root[delta[i]]
            i += 1
            found = out[state]  # -1: not computed yet
            if found and (found > 0 or (found := self._out_of(state))):
                # the first end with a stop; the output link gives the longest one ending there
                stop = self._terminal[found]
                end = self._depth[start] + i  # in (held text + delta)
                self._done = True
                self._state = 0
                self.matched = stop
                return self._head(start, delta, end if self._include else end - len(stop)), stop
        self._state = state
        return self._head(start, delta, self._depth[start] + n - self._depth[state]), None

    def _head(self, state: int, delta: str, k: int) -> str:
        """The first `k` characters of (the text held in `state`) + `delta`."""
        held = self._depth[state]
        if not held:
            return delta[:k]
        if k <= held:
            return self._owner(state)[:k]
        return self._owner(state)[:held] + delta[: k - held]

    def flush(self) -> str:
        """End of text without a match: release what was held back."""
        state, self._state = self._state, 0
        return "" if self._done or not state else self._owner(state)[: self._depth[state]]

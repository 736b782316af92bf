"""StopStringMatcher against hostile stops and text: a brute-force reference of the documented
rule over random alphabets, stop sets and delta splits; linear automaton size for a
1,000,000-character stop (asserted on the state count, not on time); near-miss text."""

from __future__ import annotations

import random
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflow.output.stops import StopStringMatcher


def brute_force(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The documented rule, literally: of all occurrences, the least (end, start) wins."""
    hits = [
        (start + len(s), start, s) for s in set(stops) for start in range(len(text)) if text.startswith(s, start)
    ]
    if not hits:
        return text, None
    end, start, stop = min(hits)
    return text[: end if include else start], stop


def held_back(seen: str, stops: list[str]) -> int:
    """Length of the longest suffix of `seen` that is a proper prefix of some stop."""
    return max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)


def feed_all(m: StopStringMatcher, deltas: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Feed `deltas`, checking minimal hold-back after each unmatched feed; flush at the end."""
    shown, seen = "", ""
    for d in deltas:
        text, matched = m.feed(d)
        shown += text
        seen += d
        if matched is not None:
            assert m.done and m.matched == matched
            assert m.feed("more") == ("", None) and m.flush() == ""
            return shown, matched
        assert shown == seen[: len(seen) - held_back(seen, stops)]
    return shown + m.flush(), None


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in pairwise(points)]


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[str], str, list[int]]:
    alphabet = draw(st.lists(st.characters(codec="utf-8"), min_size=1, max_size=4, unique=True))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=8), max_size=6))
    text = draw(st.text(alphabet, max_size=40))
    if stops and draw(st.booleans()):  # plant a stop (or a near miss of one) so matches are common
        s = draw(st.sampled_from(stops))
        at = draw(st.integers(0, len(text)))
        text = text[:at] + s[: draw(st.integers(1, len(s)))] + text[at:]
    return stops, text, draw(st.lists(st.integers(0, 60), max_size=12))


@settings(max_examples=600, deadline=None)
@given(case=cases(), include=st.booleans())
def test_matches_brute_force_over_random_alphabets_stops_and_splits(
    case: tuple[list[str], str, list[int]], include: bool
) -> None:
    stops, text, cuts = case
    deltas = split(text, cuts)
    assert "".join(deltas) == text
    got = feed_all(StopStringMatcher(stops, include_stop=include), deltas, stops)
    assert got == brute_force(text, stops, include)


def test_million_char_stop_builds_linear_automaton_and_matches() -> None:
    long = "x" * 999_999 + "y"
    m = StopStringMatcher([long, "xy"])
    assert m.num_states <= len(long) + len("xy") + 1
    assert m.feed("x" * 1000) == ("", None)  # all of it may still be the long stop
    assert m.feed("y") == ("x" * 999, "xy")  # "xy" ends first
    # Only the states the text reached got failure links (computed lazily, each once).
    m = StopStringMatcher([long])
    m.feed("x" * 300 + "z")
    assert sum(f >= 0 for f in m._fail) <= 300 + 2


def test_state_count_is_the_number_of_distinct_prefixes() -> None:
    # root, a, ab, abc, abd, b, bc
    assert StopStringMatcher(["abc", "abd", "ab", "bc"]).num_states == 7
    stops = ["".join(random.Random(i).choice("ab") for _ in range(256)) for i in range(16)]
    m = StopStringMatcher(stops)
    assert m.num_states == 1 + len({s[:k] for s in stops for k in range(1, 257)}) <= 16 * 256 + 1


def test_near_miss_text_held_then_released() -> None:
    stops = ["a" * 20_000 + "b", "a" * 5_000 + "c"]
    m = StopStringMatcher(stops)
    rng = random.Random(0)
    seen = shown = ""
    while len(seen) < 30_000:
        d = "a" * rng.randint(1, 6)
        seen += d
        shown += m.feed(d)[0]
        assert len(seen) - len(shown) == min(len(seen), 20_000)  # a^20000 is a proper prefix of the long stop
    assert m.feed("c") == ("a" * (len(seen) - 5_000 - len(shown)), "a" * 5_000 + "c")


def test_near_miss_periodic_text_against_brute_force() -> None:
    """Failure-link-heavy text: periodic stops that almost match over and over."""
    rng = random.Random(1)
    stops = ["ab" * 300 + "c", "aba" * 100 + "d", "b" * 50 + "ab"]
    for trial in range(4):
        text = ("ab" * 299 + "a") * 3 + "aba" * 99 + "ab" * 299 + "b" * 49 + rng.choice(["ab", "c", "", "ba"])
        deltas = split(text, [rng.randint(0, len(text)) for _ in range(200)])
        assert feed_all(StopStringMatcher(stops, include_stop=bool(trial % 2)), deltas, stops) == brute_force(
            text, stops, bool(trial % 2)
        )


def test_many_stops_with_distinct_first_chars_against_brute_force() -> None:
    """More distinct first characters than the root regex takes: the root steps per character."""
    rng = random.Random(2)
    stops = [chr(0x400 + i) + rng.choice("xyz") * rng.randint(0, 3) for i in range(300)]
    alphabet = [chr(0x400 + i) for i in range(0, 300, 7)] + list("xyz ")
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(200))
        deltas = split(text, [rng.randint(0, len(text)) for _ in range(60)])
        assert feed_all(StopStringMatcher(stops), deltas, stops) == brute_force(text, stops, False)


def test_sixteen_long_stops_against_brute_force() -> None:
    rng = random.Random(3)
    stops = ["".join(rng.choice("ab") for _ in range(256)) for _ in range(16)]
    for _ in range(3):
        text = "".join(rng.choice("ab") for _ in range(1500)) + rng.choice(stops)[: rng.randint(1, 256)]
        deltas = split(text, [rng.randint(0, len(text)) for _ in range(150)])
        assert feed_all(StopStringMatcher(stops, include_stop=True), deltas, stops) == brute_force(text, stops, True)

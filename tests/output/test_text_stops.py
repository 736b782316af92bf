"""StopStringMatcher: stops across real token deltas, hold-back, and a property test
against a plain whole-string reference."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflow.output.detokenizer import IncrementalDetokenizer
from tokenflow.output.stops import StopStringMatcher


def real_deltas(tokenizer: Any, text: str) -> list[str]:
    det = IncrementalDetokenizer(tokenizer)
    return [det.push(i) for i in tokenizer.encode(text, add_special_tokens=False)] + [det.flush()]


def run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    shown: list[str] = []
    for d in deltas:
        text, matched = matcher.feed(d)
        shown.append(text)
        if matched is not None:
            return shown, matched
    shown.append(matcher.flush())
    return shown, None


def spanned(deltas: list[str], text: str, stop: str) -> int:
    """How many non-empty deltas the first occurrence of `stop` touches."""
    start = text.index(stop)
    end, pos, n = start + len(stop), 0, 0
    for d in deltas:
        if d and pos < end and pos + len(d) > start:
            n += 1
        pos += len(d)
    return n


@pytest.mark.parametrize(
    ("text", "stop", "min_span"),
    [
        ("The answer is 42. More text follows here.", "answer is", 2),
        ("Observation: done\nUser: hi there", "\nUser:", 3),
        ("x </answer> y and more", "</answer>", 3),
        ("你好世界，再见朋友", "世界", 2),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_across_real_deltas(
    real_tokenizer: Any, text: str, stop: str, min_span: int, include: bool
) -> None:
    deltas = real_deltas(real_tokenizer, text)
    assert "".join(deltas) == text
    assert spanned(deltas, text, stop) >= min_span
    shown, matched = run(StopStringMatcher([stop, "never-there"], include_stop=include), deltas)
    assert matched == stop
    head = text[: text.index(stop)]
    assert "".join(shown) == (head + stop if include else head)


def test_no_stop_passes_everything_through(real_tokenizer: Any) -> None:
    text = "Plain text, with a partial </answ and END-ish words, 你好."
    deltas = real_deltas(real_tokenizer, text)
    shown, matched = run(StopStringMatcher(["</answer>", "END\n", "你好!"]), deltas)
    assert matched is None and "".join(shown) == text


def test_stop_that_is_a_prefix_of_another() -> None:
    m = StopStringMatcher(["abc", "ab"])
    assert m.feed("xa") == ("x", None)
    assert m.feed("bc") == ("", "ab")  # "ab" ends first
    assert m.done and m.matched == "ab"
    assert m.feed("more") == ("", None) and m.flush() == ""


def test_same_end_prefers_earlier_start() -> None:
    assert StopStringMatcher(["bc", "abc"], include_stop=True).feed("zabcd") == ("zabc", "abc")


def test_earliest_end_wins_over_earlier_start() -> None:
    # "bcdef" starts first but "cd" ends first.
    assert StopStringMatcher(["bcdef", "cd"]).feed("abcdefg") == ("ab", "cd")


def test_hold_back_released_unchanged() -> None:
    m = StopStringMatcher(["STOP!"])
    assert m.feed("hello ST") == ("hello ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P?") == ("STOP?", None)  # not a stop after all: shown as it came
    assert m.feed(" STOP") == (" ", None)
    assert m.flush() == "STOP"


def test_include_stop_and_text_after_stop_dropped() -> None:
    assert StopStringMatcher(["\n\n"], include_stop=True).feed("a\n\nb") == ("a\n\n", "\n\n")
    assert StopStringMatcher(["\n\n"]).feed("a\n\nb") == ("a", "\n\n")


def test_bad_stops() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopStringMatcher("stop")  # type: ignore[arg-type]
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None) and m.flush() == ""


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan end positions left to right; at the first end where some stop ends, take the longest."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end - len(s)] + (s if include else ""), s
    return text, None


def longest_held(seen: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text("abc\u00e9", min_size=1, max_size=4), max_size=4),
    deltas=st.lists(st.text("abc\u00e9", max_size=6), max_size=8),
    include=st.booleans(),
)
def test_matches_reference(stops: list[str], deltas: list[str], include: bool) -> None:
    """Property: the shown text and the match equal `reference` on the joined text, and
    while nothing has matched the shown text is exactly the seen text minus its longest
    suffix that is a proper prefix of a stop (minimal hold-back)."""
    m = StopStringMatcher(stops, include_stop=include)
    shown, seen, matched = "", "", None
    for d in deltas:
        text, matched = m.feed(d)
        shown += text
        seen += d
        if matched is not None:
            break
        assert shown == seen[: len(seen) - longest_held(seen, stops)]
    if matched is None:
        shown += m.flush()
    assert (shown, matched) == reference("".join(deltas), stops, include)

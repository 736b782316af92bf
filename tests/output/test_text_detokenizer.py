"""IncrementalDetokenizer: exact equality with the full decode on the real byte-level
tokenizer, and the documented window invariant on SentencePiece-style tokenizers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tokenflow.output.detokenizer import (
    _CHAR_TO_BYTE,
    _SLIDE_AFTER,
    CONTEXT_TOKENS,
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
)

FFFD = "\ufffd"
VOCAB = 49152

TEXTS = {
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "japanese": "こんにちは、世界。東京は今日も晴れです。カタカナとひらがな。",
    "korean": "안녕하세요 세계",
    "emoji": "ok 😀👍🏽 family 👨‍👩‍👧‍👦 rainbow 🏳️‍🌈 flags 🇯🇵🇫🇷🇺🇸 keycap 1️⃣",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0335\u0327\u0301 क्षि ผู้ 각",
    "mixed": " Leading space. Ça coûte 5 € — «quote» naïve café ∑∫ 𝔘𝔫𝔦 日本語 mixed😀end\n\ttabs",
    "arabic_rtl": "مرحبا بالعالم שלום",
}


def stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [det.push(i) for i in ids] + [det.flush()]


def test_real_tokenizer_uses_byte_path(real_tokenizer: Any) -> None:
    assert len(real_tokenizer) == VOCAB
    assert IncrementalDetokenizer(real_tokenizer).mode == "bytes"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_unicode_text_streams_exactly(real_tokenizer: Any, name: str) -> None:
    text = TEXTS[name]
    ids = real_tokenizer.encode(text, add_special_tokens=False)
    full = real_tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text  # the tokenizer round-trips these texts
    deltas = stream(IncrementalDetokenizer(real_tokenizer, prompt_token_ids=ids[:3]), ids)
    assert "".join(deltas) == full
    assert not any(FFFD in d for d in deltas)
    if name in ("chinese", "japanese", "emoji"):
        assert "" in deltas[:-1]  # some character really is split across tokens


def test_every_token_piece_matches_single_id_decode(real_tokenizer: Any) -> None:
    backend = real_tokenizer.backend_tokenizer
    det = IncrementalDetokenizer(real_tokenizer)
    pieces = det._impl._pieces
    assert len(pieces) == VOCAB
    singles = backend.decode_batch([[i] for i in range(VOCAB)], skip_special_tokens=False)
    assert [p.decode("utf-8", "replace") for p in pieces] == singles


@pytest.mark.parametrize("skip", [True, False])
def test_chat_markup_and_special_tokens(real_tokenizer: Any, skip: bool) -> None:
    ids = real_tokenizer.encode("<|im_start|>assistant\nSure! 你好 😀<|im_end|>\n<|endoftext|>")
    full = real_tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(IncrementalDetokenizer(real_tokenizer, skip_special_tokens=skip), ids)) == full
    assert ("<|im_end|>" in full) is not skip


def test_special_token_inside_a_character(real_tokenizer: Any) -> None:
    ni = real_tokenizer.encode("你", add_special_tokens=False)
    assert len(ni) == 2
    ids = [ni[0], real_tokenizer.convert_tokens_to_ids("<|im_end|>"), ni[1]]
    # Skipped specials vanish before the bytes are joined; kept ones break the character.
    assert "".join(stream(IncrementalDetokenizer(real_tokenizer, skip_special_tokens=True), ids)) == "你"
    kept = stream(IncrementalDetokenizer(real_tokenizer, skip_special_tokens=False), ids)
    assert "".join(kept) == real_tokenizer.decode(ids) == f"{FFFD}<|im_end|>{FFFD}"


def test_prompt_ending_mid_character_does_not_leak(real_tokenizer: Any) -> None:
    first, second = real_tokenizer.encode("你", add_special_tokens=False)
    det = IncrementalDetokenizer(real_tokenizer, prompt_token_ids=[first])
    assert "".join(stream(det, [second])) == real_tokenizer.decode([second]) == FFFD


def test_incomplete_character_at_end_comes_out_of_flush(real_tokenizer: Any) -> None:
    first, _ = real_tokenizer.encode("你", add_special_tokens=False)
    det = IncrementalDetokenizer(real_tokenizer)
    assert det.push(first) == ""
    assert det.flush() == FFFD == real_tokenizer.decode([first])
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.push(first)


def test_bad_ids(real_tokenizer: Any) -> None:
    det = IncrementalDetokenizer(real_tokenizer)
    with pytest.raises(ValueError):
        det.push(-1)
    assert det.push(VOCAB + 5) == "" == real_tokenizer.decode([VOCAB + 5])
    with pytest.raises(TypeError):
        IncrementalDetokenizer(object())


def _single_byte_ids(real_tokenizer: Any) -> list[int]:
    ids = (real_tokenizer.backend_tokenizer.token_to_id(c) for c in _CHAR_TO_BYTE)
    return sorted(i for i in ids if i is not None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_like_full_decode(real_tokenizer: Any, data: st.DataObject, skip: bool) -> None:
    """Random ids (whole vocab, unknown ids, specials, and single bytes that form invalid
    UTF-8). Property, with D = tokenizer.decode(..., skip_special_tokens=skip):

    1. "".join(pushes) + flush() == D(out), so every U+FFFD a delta holds is at a place
       where D(out) has one (each delta is a slice of D(out) at its own offset);
    2. after k pushes the emitted text is D(out[:k]) minus at most one trailing U+FFFD
       (an incomplete character): nothing shown early, nothing held back longer.
    """
    byte_ids = _single_byte_ids(real_tokenizer)
    token = st.one_of(
        st.integers(0, VOCAB + 3), st.sampled_from(byte_ids), st.sampled_from(byte_ids), st.integers(0, 16)
    )
    out = data.draw(st.lists(token, max_size=24), label="out")
    prompt = data.draw(st.lists(token, max_size=4), label="prompt")
    det = IncrementalDetokenizer(real_tokenizer, prompt_token_ids=prompt, skip_special_tokens=skip)
    emitted = ""
    for k, tid in enumerate(out, 1):
        emitted += det.push(tid)
        partial = real_tokenizer.decode(out[:k], skip_special_tokens=skip)
        assert partial.startswith(emitted)
        assert partial[len(emitted) :] in ("", FFFD)
    full = real_tokenizer.decode(out, skip_special_tokens=skip)
    assert emitted + det.flush() == full


# --- window strategy (decoders that are not byte level) ---------------------------------------


def test_window_keeps_leading_space_after_prompt(llama_like_tokenizer: Tokenizer) -> None:
    tok = llama_like_tokenizer
    prompt, out = tok.encode("hi there").ids, tok.encode("the cat").ids
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert det.mode == "window"
    assert "".join(stream(det, out)) == " the cat"  # continues the prompt
    assert tok.decode(out) == "the cat"  # a standalone decode strips the space
    assert "".join(stream(IncrementalDetokenizer(tok), out)) == "the cat"  # no prompt: == decode(out)


def test_window_through_transformers_wrapper(llama_like_tokenizer: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=llama_like_tokenizer)
    ids = llama_like_tokenizer.encode("the 你好 😀 é!").ids
    assert "".join(stream(IncrementalDetokenizer(wrapped), ids)) == wrapped.decode(ids) == "the 你好 😀 é!"


def test_window_long_byte_run_and_bounded_window(llama_like_tokenizer: Tokenizer) -> None:
    tok = llama_like_tokenizer
    text = "the " + "😀é中" * 12 + " the" * 200  # 108 byte tokens in one run, then many ordinary ones
    ids = tok.encode(text).ids
    for prompt in ([], tok.encode("a cat").ids):
        det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
        deltas = stream(det, ids)
        assert "".join(deltas) == (" " if prompt else "") + text
        assert not any(FFFD in d for d in deltas)
        run = [k for k, i in enumerate(ids) if tok.id_to_token(i).startswith("<0x")]
        assert len(run) == 108 and run == list(range(run[0], run[0] + 108))
        # Not held back to the end of the run: emitted in pieces at least every MAX_HELD_TOKENS ids.
        assert sum(1 for k in run if deltas[k]) >= len(run) // (MAX_HELD_TOKENS + 1)
        assert len(det._impl._ids) <= _SLIDE_AFTER + 1


def _toy_ids(tok: Tokenizer) -> st.SearchStrategy[int]:
    size = tok.get_vocab_size()
    byte_ids = [i for t, i in tok.get_vocab().items() if t.startswith("<0x")]
    return st.one_of(st.integers(0, size + 1), *([st.sampled_from(byte_ids)] if byte_ids else []))


@pytest.mark.parametrize("name", ["llama_like_tokenizer", "metaspace_tokenizer", "wordpiece_tokenizer"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_window_invariant(request: pytest.FixtureRequest, name: str, data: st.DataObject, skip: bool) -> None:
    """Window property: "".join(pushes) + flush() == D(c + out)[len(D(c)):] with
    c = det.context_ids, and == D(out) when there is no prompt. Outputs are at most
    MAX_HELD_TOKENS long so no unsettled run is force-emitted."""
    tok: Tokenizer = request.getfixturevalue(name)
    ids = _toy_ids(tok)
    out = data.draw(st.lists(ids, max_size=MAX_HELD_TOKENS), label="out")
    prompt = data.draw(st.lists(ids, max_size=6), label="prompt")
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
    c = list(det.context_ids)
    assert c == prompt[-CONTEXT_TOKENS:][: len(c)]  # the prompt's tail, minus unsettled ids at its end
    before, after = tok.decode(c, skip_special_tokens=skip), tok.decode(c + out, skip_special_tokens=skip)
    assert after.startswith(before)
    assert "".join(stream(det, out)) == after[len(before) :]
    if not prompt:
        plain = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(stream(plain, out)) == tok.decode(out, skip_special_tokens=skip)

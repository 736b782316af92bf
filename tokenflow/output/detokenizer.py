"""Incremental, UTF-8-safe detokenization: one cheap `push` per generated token.

Re-decoding a request's whole output every step is O(n) per token, and decoding
each token alone is wrong: a character split across tokens shows up as U+FFFD,
and SentencePiece-style decoders drop a token's leading space at the start of a
sequence. Two strategies, picked once per tokenizer:

* byte level (decoder is `ByteLevel`, e.g. GPT-2/Llama-3/SmolLM2 BPE): each id maps
  to a fixed byte string and the full decode is the lossy UTF-8 decode of the
  concatenated bytes. We keep a per-tokenizer id -> bytes table and decode
  incrementally, holding back only the <= 3 bytes of an incomplete trailing
  character. O(1) per token, no window, no call into the tokenizer.
* window (any other decoder): decode a short window of recent ids (the prompt's
  last few ids first) and emit only the new suffix once it has settled, i.e. it
  does not end in U+FFFD and, for `ByteFallback` decoders, no `<0xNN>` run is open
  (ByteFallback turns a whole run into U+FFFDs if any byte in it is invalid). The
  window slides, so each push decodes at most ~16 ids: O(1) per token.

Invariants (`out` = ids pushed, `D(ids)` = `tokenizer.decode(ids, skip_special_tokens=...)`):

* byte level: ``"".join(pushes) + flush() == D(out)`` exactly, whatever the ids
  (invalid UTF-8, special tokens in the middle of a character, unknown ids).
  The prompt is ignored: bytes decode the same in any context. After k pushes the
  text emitted so far is ``D(out[:k])`` minus at most one trailing U+FFFD that
  stands for an incomplete character, so nothing is held back longer than needed
  and no U+FFFD is ever emitted that the full decode does not have at that place.
* window: ``"".join(pushes) + flush() == D(c + out)[len(D(c)):]`` where
  `c = self.context_ids` (the last <= 4 prompt ids, minus trailing ids whose decode
  is unsettled). That is the text the output adds to the prompt: it differs from
  `D(out)` only where a decoder treats the start of a sequence specially (Metaspace
  and `Strip` drop the first token's leading space; with a prompt we keep it,
  because the output continues the prompt). With no prompt, ``c == ()`` and the
  stream equals `D(out)`. Tested for Metaspace, Replace+ByteFallback+Fuse+Strip
  (Llama-2 style) and WordPiece decoders. Bounded cost has one price: when more than
  `MAX_HELD_TOKENS` ids stay unsettled (a long `<0xNN>` run), the run is cut at its
  last character boundary and the rest decoded on its own; that is still exact for
  valid UTF-8 but not if the run also holds invalid bytes (D would show the whole
  run as U+FFFDs, we have shown its valid start).
"""

from __future__ import annotations

import functools
import re
import weakref
from codecs import utf_8_decode as _utf8_decode
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel

__all__ = ("MAX_HELD_TOKENS", "IncrementalDetokenizer")

_FFFD = "\ufffd"
CONTEXT_TOKENS = 4  # prompt ids decoded ahead of the output (window strategy)
_SLIDE_AFTER = 12  # window length (ids) after which its start slides forward
MAX_HELD_TOKENS = 16  # window strategy: most ids held back while the text is unsettled
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _gpt2_char_to_byte() -> dict[str, int]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the
    other 68 bytes are shifted to code points 256.. in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_CHAR_TO_BYTE = _gpt2_char_to_byte()


def _token_bytes(token: str) -> bytes:
    """Bytes that the `ByteLevel` decoder makes of one token string (a token with a
    character outside the byte alphabet, e.g. an added token, is taken as UTF-8)."""
    try:
        return bytes([_CHAR_TO_BYTE[c] for c in token])
    except KeyError:
        return token.encode("utf-8")


@dataclass(frozen=True)
class _TokenizerInfo:
    """What we precompute once per backend tokenizer (shared by all streams)."""

    byte_level: bool
    pieces: tuple[bytes, ...]  # byte level only: id -> bytes (b"" for ids without a token)
    special_ids: frozenset[int]  # ids removed by skip_special_tokens=True
    byte_fallback_ids: frozenset[int]  # ids of `<0xNN>` tokens when a ByteFallback decoder is used
    size: int  # 1 + the largest id that has a token; larger ids decode to nothing


_INFO: weakref.WeakKeyDictionary[Tokenizer, _TokenizerInfo] = weakref.WeakKeyDictionary()


def _uses_byte_fallback(backend: Tokenizer) -> bool:
    """Whether the decoder (or one inside a Sequence) is ByteFallback: its serialized
    config is compact serde JSON, so the type tag appears verbatim."""
    decoder = backend.decoder
    return decoder is not None and b'"type":"ByteFallback"' in decoder.__getstate__()


def _tokenizer_info(backend: Tokenizer) -> _TokenizerInfo:
    info = _INFO.get(backend)
    if info is not None:
        return info
    vocab = backend.get_vocab(with_added_tokens=False)
    tokens: dict[int, str] = {i: t for t, i in vocab.items()}
    added = backend.get_added_tokens_decoder()
    for i in added:
        # Added tokens win over the model vocabulary, in the form the decoder sees.
        tokens[i] = backend.id_to_token(i) or added[i].content
    special = {a.content for a in added.values() if a.special}
    special_ids = frozenset(i for i, t in tokens.items() if t in special)
    byte_level = isinstance(backend.decoder, ByteLevel)
    size = max(tokens, default=-1) + 1
    pieces: tuple[bytes, ...] = ()
    if byte_level:
        table = [b""] * size
        for i, t in tokens.items():
            table[i] = _token_bytes(t)
        pieces = tuple(table)
    fallback: frozenset[int] = frozenset()
    if _uses_byte_fallback(backend):
        fallback = frozenset(i for i, t in tokens.items() if _BYTE_TOKEN.match(t))
    info = _TokenizerInfo(byte_level, pieces, special_ids, fallback, size)
    _INFO[backend] = info
    return info


def _wrapper_cleans_up(tokenizer: Any, backend: Tokenizer) -> bool:
    """Whether transformers' `decode` post-processes the backend's text (it skips
    `clean_up_tokenization_spaces` for BPE models, as of transformers 5)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    flag = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    forced = getattr(tokenizer, flag, False)
    return type(backend.model).__name__ != "BPE" or bool(forced)


class _BytePath:
    """Byte-level strategy: id -> bytes -> incremental UTF-8 decode (errors="replace").

    `_pending` holds the bytes of an incomplete trailing character (at most 3).
    """

    __slots__ = ("_pending", "_pieces", "_skip")

    def __init__(self, info: _TokenizerInfo, skip_special_tokens: bool) -> None:
        self._pieces = info.pieces
        self._skip = info.special_ids if skip_special_tokens else frozenset()
        self._pending = b""

    def push(self, token_id: int) -> str:
        if token_id in self._skip or token_id >= len(self._pieces):
            return ""  # the full decode drops these ids without breaking a byte sequence
        data = self._pending + self._pieces[token_id] if self._pending else self._pieces[token_id]
        text, used = _utf8_decode(data, "replace", False)
        pending = self._pending = data[used:]
        if len(pending) > 1 and pending[0] == 0xED and pending[1] >= 0xA0:
            # Python waits for a third byte before rejecting a surrogate (ED A0..BF);
            # it can never become valid, and the full decode shows it at once.
            text += _utf8_decode(pending, "replace", True)[0]
            self._pending = b""
        return text

    def flush(self) -> str:
        pending, self._pending = self._pending, b""
        return _utf8_decode(pending, "replace", True)[0]


class _WindowPath:
    """Window strategy (prefix/read offsets) for decoders that are not byte level."""

    __slots__ = (
        "_clean",
        "_clean_len",
        "_context",
        "_decode",
        "_fallback",
        "_ids",
        "_open_run",
        "_size",
        "_skip",
    )

    def __init__(
        self, decode: Callable[[list[int]], str], context: Sequence[int], info: _TokenizerInfo, skip: bool
    ) -> None:
        self._decode = decode
        self._fallback = info.byte_fallback_ids
        self._skip = info.special_ids if skip else frozenset()
        self._size = info.size
        self._open_run = False  # the last id the decoder sees is a `<0xNN>` byte token
        ctx = list(context)[-CONTEXT_TOKENS:] if CONTEXT_TOKENS else []
        # A prompt that ends mid-character (or in an open byte run) would let the
        # output rewrite text we treat as already shown: drop those ids.
        while ctx and (self._ends_in_run(ctx) or decode(ctx).endswith(_FFFD)):
            ctx.pop()
        self._context: tuple[int, ...] = tuple(ctx)
        self._ids = ctx  # window: context ids, then output ids not yet slid out
        self._clean = len(ctx)  # ids[:clean] are decoded and their text emitted
        self._clean_len = len(decode(ctx)) if ctx else 0  # len(decode(ids[:clean]))

    def _visible(self, token_id: int) -> bool:
        """Whether the decoder sees this id (skipped specials and unknown ids are dropped first)."""
        return token_id < self._size and token_id not in self._skip

    def _ends_in_run(self, ids: list[int]) -> bool:
        for i in reversed(ids):
            if self._visible(i):
                return i in self._fallback
        return False

    def push(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        if self._visible(token_id):
            # ByteFallback decodes a run of byte tokens all at once (one U+FFFD per
            # byte if any is invalid), so text inside an open run may still change.
            self._open_run = token_id in self._fallback
        text = self._decode(ids)
        if not (self._open_run or text.endswith(_FFFD)):
            return self._settle(text)
        if len(ids) - self._clean <= MAX_HELD_TOKENS:
            return ""
        return self._force(text)

    def _settle(self, text: str) -> str:
        """All ids decode to `text` and nothing is pending: emit the new part, slide."""
        ids = self._ids
        delta = text[self._clean_len :]
        self._clean = len(ids)
        self._clean_len = len(text)
        if self._clean > _SLIDE_AFTER:
            # Keep CONTEXT_TOKENS settled ids as left context; the text they decode
            # to is context only, never emitted again.
            del ids[: self._clean - CONTEXT_TOKENS]
            self._clean = len(ids)
            self._clean_len = len(self._decode(ids))
        return delta

    def _force(self, text: str) -> str:
        """Too many ids pending (a long byte run, or bytes that never become valid).
        Emit up to the last cut that still leaves some ids pending and whose text does
        not end in U+FFFD (a character boundary), then restart the window at that cut
        so emitted bytes are never decoded again; with no such cut, emit everything."""
        ids = self._ids
        for cut in range(len(ids) - 1, self._clean, -1):
            head = self._decode(ids[:cut])
            if not head.endswith(_FFFD):
                delta = head[self._clean_len :]
                del ids[:cut]
                self._clean = self._clean_len = 0
                return delta
        return self._settle(text)

    def flush(self) -> str:
        text = self._decode(self._ids)
        delta = text[self._clean_len :]
        self._clean = len(self._ids)
        self._clean_len = len(text)
        return delta


class IncrementalDetokenizer:
    """Streams the text of one request's output ids; see the module doc for the invariants.

    `tokenizer` is a transformers fast tokenizer (anything with `.backend_tokenizer`)
    or a `tokenizers.Tokenizer`. Create one per request; not thread-safe.
    """

    __slots__ = ("_done", "_impl", "mode")

    def __init__(
        self, tokenizer: Any, *, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        if isinstance(tokenizer, Tokenizer):
            backend, wrapper = tokenizer, None
        elif isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer):
            backend, wrapper = tokenizer.backend_tokenizer, tokenizer
        else:
            raise TypeError(f"need a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
        info = _tokenizer_info(backend)
        cleans = wrapper is not None and _wrapper_cleans_up(wrapper, backend)
        self._done = False
        self._impl: _BytePath | _WindowPath
        if info.byte_level and not cleans:
            self.mode = "bytes"
            self._impl = _BytePath(info, skip_special_tokens)
            return
        self.mode = "window"
        source = wrapper if cleans else backend
        decode = functools.partial(source.decode, skip_special_tokens=skip_special_tokens)
        self._impl = _WindowPath(decode, prompt_token_ids, info, skip_special_tokens)

    @property
    def context_ids(self) -> tuple[int, ...]:
        """Prompt ids the output is decoded after (window mode); () in bytes mode."""
        return self._impl._context if isinstance(self._impl, _WindowPath) else ()

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never a partial character)."""
        if self._done:
            raise RuntimeError("push() after flush()")
        if token_id < 0:
            raise ValueError(f"token ids are non-negative, got {token_id}")
        return self._impl.push(token_id)

    def flush(self) -> str:
        """End of output: return the held-back rest, as the full decode shows it (idempotent)."""
        if self._done:
            return ""
        self._done = True
        return self._impl.flush()

"""The `tokenizer` stage: prompt text -> token ids, off the event loop.

Encodes in worker threads; prompts that arrive within `tokenizer_window_ms`
of each other are coalesced into one batch call, which the Rust tokenizer
runs in parallel. The batches run in the stage's own background task, never
in a caller's: a caller cancelled while its prompt waits only leaves (its
prompt is skipped if its batch has not started). An LRU cache keyed by (text, special-tokens flag) skips
repeated prompts; it keeps only encodings that fit the context, bounded by
`tokenizer_cache_bytes`. Chat messages are rendered with the model's chat
template in the same worker call; text in a message that spells one of the
model's special tokens (`<|im_end|>`, ...) is encoded as plain text, so a
caller cannot close its turn and open a system one (unless
`allow_special_tokens_in_chat`). The stage also validates the ids it
produces (or was given) against the vocabulary and the model's context length.
"""

from __future__ import annotations

import json
import re
import secrets
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import cachetools

from tokenflow.background import BackgroundTask, spawn
from tokenflow.config import EngineConfig
from tokenflow.errors import EngineClosed, EngineError, InvalidRequest
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request

__all__ = ("TokenizerStage", "create")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How a chat's messages are rendered (vLLM's options): the assistant's turn opened after them, or the last
    message (an assistant's partial answer) continued, left open."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


class _Job:
    """One prompt waiting in a coalesced batch."""

    __slots__ = ("abandoned", "add_special", "done", "error", "messages", "result", "template", "text", "tools")

    def __init__(self, text: str | None, messages: Sequence[dict[str, Any]] | None, add_special: bool,
                 tools: list[dict[str, Any]] | None = None, template: ChatTemplate | None = None) -> None:
        self.text = text
        self.messages = messages
        self.tools = tools
        self.template = template or ChatTemplate()
        self.add_special = add_special
        self.result: list[int] | None = None
        self.error: BaseException | None = None
        self.done = anyio.Event()
        self.abandoned = False  # its caller left (cancelled): skipped if its batch has not started


class _Cached:
    """An encoding in the LRU, with its share of `tokenizer_cache_bytes` (the text key counts too)."""

    __slots__ = ("ids", "size")

    def __init__(self, text: str, ids: list[int]) -> None:
        self.ids = array("l", ids)
        self.size = len(text) + self.ids.itemsize * len(ids) + 200  # + the entry's own overhead


class TokenizerStage:
    def __init__(self, config: EngineConfig) -> None:
        self._window_s = config.tokenizer_window_ms / 1000.0
        self._cache: cachetools.LRUCache[tuple[str, bool], _Cached] = cachetools.LRUCache(
            maxsize=max(config.tokenizer_cache_bytes, 1), getsizeof=lambda entry: entry.size
        )
        self._cache_entries = config.tokenizer_cache_size
        self._cache_enabled = config.tokenizer_cache_size > 0 and config.tokenizer_cache_bytes > 0
        self._special_in_chat = config.allow_special_tokens_in_chat
        self._special_texts: tuple[str, ...] = ()  # the texts of the tokenizer's special tokens
        self._pending: list[_Job] = []
        self._wake: anyio.Event | None = None
        self._batcher: BackgroundTask | None = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.num_batches = 0
        self.num_encoded = 0
        self.cache_hits = 0

    async def start(self, ctx: EngineContext) -> None:
        self.tokenizer = ctx.tokenizer
        self.max_model_len = ctx.max_model_len
        self.vocab_size = ctx.vocab_size
        self._special_texts = special_token_texts(ctx.tokenizer)
        if self._batcher is None:
            self._wake = anyio.Event()
            self._batcher = spawn(self._batches, "tokenflow-tokenizer")

    async def stop(self) -> None:
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            await batcher.stop()

    async def handle(self, request: Request, call_next: NextStage) -> None:
        await self.prepare(request)
        await call_next(request)

    async def prepare(self, request: Request) -> None:
        """Give `request` its prompt ids (unless it came with them) and check them: the engine calls this
        for every request, so an engine configured without this stage still tokenizes and validates."""
        if request.prompt_token_ids is None:
            if request.messages is not None:
                params = request.params
                template = ChatTemplate(params.add_generation_prompt, params.continue_final_message)
                request.prompt_token_ids = await self._encode(None, request.messages, add_special=False,
                                                              tools=request.tools, template=template)
            else:
                text = request.prompt or ""
                _check_text(text)
                request.prompt_token_ids = await self._encode(text, None, add_special=True)
        self._validate_ids(request)

    def _validate_ids(self, request: Request) -> None:
        ids = request.prompt_token_ids or []
        if not ids:
            raise InvalidRequest("the prompt is empty", field="prompt")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", field="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; the model allows at most {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len}, one token must remain to generate)",
                field="prompt",
            )

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Encode one text through the coalescing path (public for other stages)."""
        _check_text(text)
        return await self._encode(text, None, add_special=add_special_tokens)

    async def encode_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          template: ChatTemplate | None = None) -> list[int]:
        """The prompt ids of `messages` (and `tools`) through the chat template, as a chat request gets them."""
        return await self._encode(None, messages, add_special=False, tools=tools, template=template)

    async def _encode(
        self, text: str | None, messages: Sequence[dict[str, Any]] | None, *, add_special: bool,
        tools: list[dict[str, Any]] | None = None, template: ChatTemplate | None = None,
    ) -> list[int]:
        if text is not None and self._cache_enabled:
            hit = self._cache.get((text, add_special))
            if hit is not None:
                self.cache_hits += 1
                return hit.ids.tolist()
        if self._batcher is None:
            raise EngineClosed("the tokenizer is not started (or was stopped)")
        job = _Job(text, messages, add_special, tools, template)
        self._pending.append(job)
        self._wake.set()
        try:
            await job.done.wait()  # the batch runs in the stage's own task: leaving here strands nobody
        except BaseException:
            job.abandoned = True  # not encoded if its batch has not started
            raise
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return list(job.result)

    async def _batches(self) -> None:
        """The stage's task: wait for a first prompt, let the window fill, encode the batch; repeat."""
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                while self._pending:
                    if self._window_s > 0:
                        await anyio.sleep(self._window_s)
                    jobs, self._pending = [j for j in self._pending if not j.abandoned], []
                    if jobs:
                        await self._run_batch(jobs)
        finally:  # stopped: nobody may wait for a batch that will not run
            jobs, self._pending = self._pending, []
            for job in jobs:
                job.error = job.error or EngineClosed("the engine closed before this prompt was tokenized")
                job.done.set()

    async def _run_batch(self, jobs: list[_Job]) -> None:
        try:
            try:
                results = await anyio.to_thread.run_sync(self._encode_jobs, jobs)
            except BaseException as exc:  # one bad prompt must not fail its neighbours: encode each alone
                if not isinstance(exc, Exception) and not _is_tokenizer_panic(exc):
                    raise
                results = await anyio.to_thread.run_sync(self._encode_each, jobs)
        except Exception as exc:  # a tokenizer bug (not a bad prompt: those are per job)
            for job in jobs:
                job.error = EngineError(f"tokenizing failed: {exc!r}")
                job.done.set()
            return
        except BaseException:  # the engine stops: the jobs fail with EngineClosed (`_batches`)
            self._pending[:0] = jobs
            raise
        self.num_batches += 1
        for job, result in zip(jobs, results):
            if isinstance(result, BaseException):
                job.error = result
            else:
                job.result = result
                self.num_encoded += 1
                if job.text is not None and len(result) < self.max_model_len:  # only what can be served
                    self._remember(job.text, job.add_special, result)
            job.done.set()

    def _remember(self, text: str, add_special: bool, ids: list[int]) -> None:
        if not self._cache_enabled:
            return
        entry = _Cached(text, ids)
        if entry.size > self._cache.maxsize:
            return
        while len(self._cache) >= self._cache_entries:
            self._cache.popitem()
        self._cache[(text, add_special)] = entry

    def _encode_jobs(self, jobs: list[_Job]) -> list[list[int] | BaseException]:
        """Runs in a worker thread: render chat templates, then one batch encode per flag."""
        texts: list[str | BaseException] = []
        results: list[list[int] | BaseException | None] = [None] * len(jobs)
        for i, job in enumerate(jobs):
            if job.messages is None:
                texts.append(job.text or "")
                continue
            try:
                if self._spells_special(job.messages):  # rare: encoded on its own, texts kept as plain text
                    results[i] = self._encode_chat_literally(job.messages, job.tools, job.template)
                    texts.append("")
                else:
                    texts.append(self.render_chat(job.messages, job.tools, job.template))
            except InvalidRequest as exc:
                texts.append(exc)
            except Exception as exc:
                texts.append(InvalidRequest(f"chat messages could not be rendered: {exc}", field="messages"))
        for i, text in enumerate(texts):
            if isinstance(text, BaseException):
                results[i] = text
        for flag in (True, False):
            idx = [i for i, job in enumerate(jobs) if job.add_special == flag and results[i] is None]
            if not idx:
                continue
            encoded = self.tokenizer([texts[i] for i in idx], add_special_tokens=flag)["input_ids"]
            for i, ids in zip(idx, encoded):
                results[i] = list(ids)
        return results  # type: ignore[return-value]

    def _encode_each(self, jobs: list[_Job]) -> list[list[int] | BaseException]:
        results: list[list[int] | BaseException] = []
        for job in jobs:
            try:
                results.extend(self._encode_jobs([job]))
            except BaseException as exc:  # the Rust tokenizer's panics are BaseExceptions
                if not isinstance(exc, Exception) and not _is_tokenizer_panic(exc):
                    raise
                results.append(InvalidRequest(f"the prompt could not be tokenized: {exc!r}", field="prompt"))
        return results

    # -- role boundaries ----------------------------------------------------------------
    def _spells_special(self, messages: Sequence[dict[str, Any]]) -> bool:
        if self._special_in_chat or not self._special_texts:
            return False
        return any(s in text for m in messages for text in _message_texts(m) for s in self._special_texts)

    def _encode_chat_literally(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                               template: ChatTemplate | None = None) -> list[int]:
        """Encode a chat whose message texts spell special tokens: those texts with special tokens split
        into plain text, the template's own text with its control tokens.

        The template is rendered with a unique placeholder in place of each such text, so where the text
        sits is known exactly; the prompt is cut only there, and the rest tokenizes as usual."""
        marker = f"TFLITERAL{secrets.token_hex(8)}X"
        literal: dict[str, str] = {}
        substituted = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) and any(s in content for s in self._special_texts):
                name = f"{marker}{len(literal)}X"
                literal[name] = content
                message = {**message, "content": name}
            substituted.append(message)
        rendered = self.render_chat(substituted, tools, template)
        ids: list[int] = []
        for n, piece in enumerate(re.split(f"({marker}\\d+X)", rendered)):
            if n % 2:  # a placeholder
                text = literal.get(piece)
                if text is None:
                    raise InvalidRequest("the chat template changed a message's text", field="messages")
                ids.extend(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            elif piece:
                ids.extend(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
        if rendered.count(marker) != len(literal):  # a template that drops or repeats a message
            raise InvalidRequest("the chat template changed a message's text", field="messages")
        return ids

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: ChatTemplate | None = None) -> str:
        template = template or ChatTemplate()
        if not isinstance(messages, Sequence) or not messages:
            raise InvalidRequest("`messages` must be a non-empty list of {role, content} dicts", field="messages")
        if template.continue_final_message:
            if template.add_generation_prompt:
                raise InvalidRequest("continue_final_message continues the last message: set add_generation_prompt "
                                     "to false", field="continue_final_message")
            last = messages[-1]
            if not isinstance(last, dict) or last.get("role") != "assistant":
                raise InvalidRequest("continue_final_message needs an assistant message last", field="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str
            ):
                raise InvalidRequest("each message must be a dict with string `role` and `content`", field="messages")
            if m["content"] or not m.get("tool_calls"):  # an assistant turn that only called tools has no text
                _check_text(m["content"], field="messages")
            if not self._special_in_chat and any(s in m["role"] for s in self._special_texts):
                raise InvalidRequest("a message role spells one of the model's control tokens", field="messages")
            calls = m.get("tool_calls")
            if calls and not self._special_in_chat and any(s in json.dumps(calls) for s in self._special_texts):
                raise InvalidRequest("a message's tool call spells one of the model's control tokens",
                                     field="messages")
        if tools and not self._special_in_chat and any(t in json.dumps(tools) for t in self._special_texts):
            raise InvalidRequest("a tool definition spells one of the model's control tokens", field="tools")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use generate() with a prompt", field="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message, **({"tools": tools} if tools else {}))
        except Exception as exc:
            raise InvalidRequest(f"chat messages could not be rendered: {exc}", field="messages") from None
        _check_text(text, field="messages")
        return text

    def stats(self) -> dict[str, Any]:
        return {
            "tokenizer_batches": self.num_batches,
            "tokenizer_encoded": self.num_encoded,
            "tokenizer_cache_hits": self.cache_hits,
        }


def _check_text(text: object, field: str = "prompt") -> None:
    if not isinstance(text, str):
        raise InvalidRequest(f"the prompt must be a str or a list of token ids, got {type(text).__name__}",
                             field=field)
    if not text:
        raise InvalidRequest("the prompt is empty", field=field)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"the prompt is not valid Unicode text ({exc.reason} at {exc.start})",
                             field=field) from None


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The spellings of the tokenizer's special (control) tokens, longest first."""
    texts = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))


def _message_texts(message: Any) -> list[str]:
    """The caller-written strings of a message (its content, or its text parts)."""
    if not isinstance(message, dict):
        return []
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _is_tokenizer_panic(exc: BaseException) -> bool:
    """pyo3 turns a Rust panic into `PanicException`, a BaseException: treat it as a bad input."""
    return type(exc).__name__ == "PanicException"


def create(config: EngineConfig) -> TokenizerStage:
    return TokenizerStage(config)

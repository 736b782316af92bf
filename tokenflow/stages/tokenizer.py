"""The `tokenizer` stage: prompt text -> token ids, off the event loop.

Encodes in worker threads; prompts that arrive within `tokenizer_window_ms`
of each other are coalesced into one batch call, which the Rust tokenizer
runs in parallel. An LRU cache keyed by (text, special-tokens flag) skips
repeated prompts. Chat messages are rendered with the model's chat template
in the same worker call. The stage also validates the ids it produces (or
was given) against the vocabulary and the model's context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import cachetools

from tokenflow.config import EngineConfig
from tokenflow.errors import InvalidRequest
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request

__all__ = ("TokenizerStage", "create")


class _Job:
    """One prompt waiting in a coalesced batch."""

    __slots__ = ("add_special", "done", "error", "messages", "result", "text")

    def __init__(self, text: str | None, messages: Sequence[dict[str, Any]] | None, add_special: bool) -> None:
        self.text = text
        self.messages = messages
        self.add_special = add_special
        self.result: list[int] | None = None
        self.error: BaseException | None = None
        self.done = anyio.Event()


class TokenizerStage:
    def __init__(self, config: EngineConfig) -> None:
        self._window_s = config.tokenizer_window_ms / 1000.0
        self._cache: cachetools.LRUCache[tuple[str, bool], list[int]] = cachetools.LRUCache(
            maxsize=max(config.tokenizer_cache_size, 1)
        )
        self._cache_enabled = config.tokenizer_cache_size > 0
        self._pending: list[_Job] = []
        self._leader_active = False
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

    async def handle(self, request: Request, call_next: NextStage) -> None:
        if request.prompt_token_ids is None:
            if request.messages is not None:
                request.prompt_token_ids = await self._encode(None, request.messages, add_special=False)
            else:
                text = request.prompt or ""
                _check_text(text)
                request.prompt_token_ids = await self._encode(text, None, add_special=True)
        self._validate_ids(request)
        await call_next(request)

    def _validate_ids(self, request: Request) -> None:
        ids = request.prompt_token_ids or []
        if not ids:
            raise InvalidRequest("the prompt is empty", field="prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
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

    async def _encode(
        self, text: str | None, messages: Sequence[dict[str, Any]] | None, *, add_special: bool
    ) -> list[int]:
        if text is not None and self._cache_enabled:
            hit = self._cache.get((text, add_special))
            if hit is not None:
                self.cache_hits += 1
                return list(hit)
        job = _Job(text, messages, add_special)
        self._pending.append(job)
        if not self._leader_active:
            self._leader_active = True
            # The first job of a window leads the batch; shielded so that
            # cancelling the leader's caller never strands the followers.
            with anyio.CancelScope(shield=True):
                await self._run_batch()
        else:
            await job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return list(job.result)

    async def _run_batch(self) -> None:
        try:
            if self._window_s > 0:
                await anyio.sleep(self._window_s)
            jobs, self._pending = self._pending, []
        finally:
            self._leader_active = False
        try:
            results = await anyio.to_thread.run_sync(self._encode_jobs, jobs)
        except Exception:  # one bad prompt must not fail its neighbours: encode each alone
            results = await anyio.to_thread.run_sync(self._encode_each, jobs)
        self.num_batches += 1
        for job, result in zip(jobs, results):
            if isinstance(result, BaseException):
                job.error = result
            else:
                job.result = result
                self.num_encoded += 1
                if job.text is not None and self._cache_enabled:
                    self._cache[(job.text, job.add_special)] = result
            job.done.set()

    def _encode_jobs(self, jobs: list[_Job]) -> list[list[int] | BaseException]:
        """Runs in a worker thread: render chat templates, then one batch encode per flag."""
        texts: list[str | BaseException] = []
        for job in jobs:
            if job.messages is None:
                texts.append(job.text or "")
                continue
            try:
                texts.append(self.render_chat(job.messages))
            except Exception as exc:
                texts.append(InvalidRequest(f"chat messages could not be rendered: {exc}", field="messages"))
        results: list[list[int] | BaseException] = [exc for exc in texts]  # type: ignore[misc]
        for flag in (True, False):
            idx = [i for i, job in enumerate(jobs) if job.add_special == flag and isinstance(texts[i], str)]
            if not idx:
                continue
            batch = [texts[i] for i in idx]
            encoded = self.tokenizer(batch, add_special_tokens=flag)["input_ids"]
            for i, ids in zip(idx, encoded):
                results[i] = list(ids)
        return results

    def _encode_each(self, jobs: list[_Job]) -> list[list[int] | BaseException]:
        results: list[list[int] | BaseException] = []
        for job in jobs:
            try:
                results.extend(self._encode_jobs([job]))
            except Exception as exc:
                results.append(exc)
        return results

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        if not isinstance(messages, Sequence) or not messages:
            raise InvalidRequest("`messages` must be a non-empty list of {role, content} dicts", field="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str
            ):
                raise InvalidRequest("each message must be a dict with string `role` and `content`", field="messages")
            _check_text(m["content"])
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use generate() with a prompt", field="messages")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise InvalidRequest(f"chat messages could not be rendered: {exc}", field="messages") from None
        try:
            _check_text(text)
        except InvalidRequest as exc:
            raise InvalidRequest(str(exc), field="messages") from None
        return text

    def stats(self) -> dict[str, Any]:
        return {
            "tokenizer_batches": self.num_batches,
            "tokenizer_encoded": self.num_encoded,
            "tokenizer_cache_hits": self.cache_hits,
        }


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise InvalidRequest(f"the prompt must be a str or a list of token ids, got {type(text).__name__}",
                             field="prompt")
    if not text:
        raise InvalidRequest("the prompt is empty", field="prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"the prompt is not valid Unicode text ({exc.reason} at {exc.start})",
                             field="prompt") from None


def create(config: EngineConfig) -> TokenizerStage:
    return TokenizerStage(config)

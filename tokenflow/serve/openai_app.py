"""An OpenAI-compatible ASGI app around an Engine (Starlette; mounts into FastAPI too).

    app = create_app("smollm2-135m", max_num_seqs=16, api_key="...")   # owns an Engine through its lifespan
    app = create_app(engine=my_engine)                                 # or serves one the caller owns

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or
server-sent events with `stream: true`, usage in the last event when
`stream_options.include_usage`), `POST /tokenize`, `POST /detokenize` (vLLM's
bodies), `GET /v1/models`, `GET /health` (200 once the
model is loaded; never behind the key), `GET /metrics` (Prometheus), `GET /dashboard` (a live page
over `GET /v1/engine/stats`, see `dashboard.py`; a browser may send the key as a Basic-auth password).

Everything a caller sends is untrusted (`HTTPSettings`): with an `api_key`
every route but `/health` wants `Authorization: Bearer <key>` (401
otherwise); a body over `max_request_bytes` is refused with 413 before it is
read whole; a malformed body is a 400 naming the field
(`openai_protocol.py`); `priority` and `cache_salt` are the operator's to
set (through `request_policy`), not the client's; `cached_tokens` is
reported only when enabled, since it tells a caller which prefixes other
callers sent. A client that disconnects aborts its request, whether it
streams or waits, and also while it is queued. An error after the first
streamed event is sent as an OpenAI error event, then `[DONE]`.

Errors are OpenAI-style JSON bodies: 400 `InvalidRequest`, 401, 413, 429
`Overloaded` (with `Retry-After`), 503 closed or dead engine (`EngineClosed`,
`EngineError`), 504 `DeadlineExceeded`.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import inspect
import json
import logging
import math
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tokenflow.engine import Engine
from tokenflow.errors import DeadlineExceeded, EngineClosed, EngineError, InvalidRequest, Overloaded, TokenflowError
from tokenflow.params import Chunk, Completion, TokenLogprob, Usage
from tokenflow.serve.dashboard import DashboardFeed, dashboard_html
from tokenflow.serve.metrics import EngineMetrics
from tokenflow.serve.openai_protocol import (
    PASSTHROUGH,
    ChatCompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    decode_as,
    decode_body,
    engine_kwargs,
    prompts_of,
    to_engine_kwargs,
)
from tokenflow.serve.responses_api import StoredResponses, responses
from tokenflow.structured.tools import ToolCallStream, content_besides_calls

__all__ = ("PASSTHROUGH", "HTTPSettings", "RequestPolicy", "completion_body", "create_app", "engine_lifespan",
           "error_body", "openai_routes", "parse_request", "response_id", "retry_after_s")

log = logging.getLogger("tokenflow.http")

API_KEY_ENV = "TOKENFLOW_API_KEY"
CLIENT_SETTABLE = frozenset({"priority", "cache_salt"})  # fields the operator may let clients set

# (http request, the request's Engine keywords) -> keywords to override (tenant salt, priority, limits);
# may be async, may raise a TokenflowError (e.g. InvalidRequest -> 400) to refuse the request.
RequestPolicy = Callable[[Request, dict[str, Any]], "Mapping[str, Any] | Awaitable[Mapping[str, Any] | None] | None"]


@dataclass(frozen=True)
class HTTPSettings:
    """What the HTTP layer enforces before a request reaches the engine. Defaults are the safe ones."""

    api_key: str | None = None  # Bearer key for every route but /health; None: no auth (bind to 127.0.0.1)
    max_request_bytes: int = 4 * 2**20
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; none by default
    request_policy: RequestPolicy | None = None
    trusted_client_fields: frozenset[str] = frozenset()  # of CLIENT_SETTABLE: clients may send these themselves
    report_cached_tokens: bool = False  # usage.prompt_tokens_details.cached_tokens (a cross-tenant signal)

    def __post_init__(self) -> None:
        unknown = set(self.trusted_client_fields) - CLIENT_SETTABLE
        if unknown:
            raise ValueError(f"trusted_client_fields may name only {sorted(CLIENT_SETTABLE)}, not {sorted(unknown)}")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be positive")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **settings: Any) -> HTTPSettings:
        """Settings with `api_key` from `TOKENFLOW_API_KEY` when not given."""
        environ = os.environ if environ is None else environ
        if settings.get("api_key") is None and environ.get(API_KEY_ENV):
            settings["api_key"] = environ[API_KEY_ENV]
        settings["cors_origins"] = tuple(settings.get("cors_origins") or ())
        settings["trusted_client_fields"] = frozenset(settings.get("trusted_client_fields") or ())
        return cls(**settings)


def engine_lifespan(
    model: str | None = None, *, engine: Engine | None = None, http: HTTPSettings | None = None, **settings: Any
) -> Any:
    """A Starlette/FastAPI lifespan that puts a started Engine on `app.state.engine` (and closes it
    at shutdown when it created it), and the HTTP settings on `app.state.http_settings`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        owned = engine is None
        current = engine if engine is not None else Engine(model, **settings)
        await current.start()
        app.state.engine = current
        app.state.metrics = EngineMetrics(current)
        app.state.http_settings = http if http is not None else HTTPSettings.from_env()
        current.add_observer(app.state.metrics)
        app.state.responses = StoredResponses()  # `previous_response_id`: the newest responses, in memory
        app.state.dashboard = DashboardFeed()
        current.add_observer(app.state.dashboard)
        try:
            yield
        finally:
            if owned:
                await current.aclose()

    return lifespan


def openai_routes() -> list[Route]:
    """The routes, for an app that has its own (e.g. `fastapi_app.router.routes.extend(openai_routes())`,
    with `lifespan=engine_lifespan(..., http=HTTPSettings(...))`)."""
    return [
        Route("/v1/completions", _guarded(partial(_serve, chat=False)), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(partial(_serve, chat=True)), methods=["POST"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/v1/embeddings", _guarded(embeddings), methods=["POST"]),
        Route("/v1/responses", _guarded(responses), methods=["POST"]),
        Route("/tokenize", _guarded(tokenize), methods=["POST"]),
        Route("/detokenize", _guarded(detokenize), methods=["POST"]),
        Route("/health", _guarded(health, auth=False), methods=["GET"]),
        Route("/metrics", _guarded(metrics), methods=["GET"]),
        Route("/dashboard", _guarded(dashboard, basic=True), methods=["GET"]),
        Route("/v1/engine/stats", _guarded(engine_stats, basic=True), methods=["GET"]),
    ]


def create_app(
    model: str | None = None, *, engine: Engine | None = None, api_key: str | None = None,
    max_request_bytes: int = HTTPSettings.max_request_bytes, cors_origins: tuple[str, ...] | list[str] = (),
    request_policy: RequestPolicy | None = None, trusted_client_fields: tuple[str, ...] | list[str] = (),
    report_cached_tokens: bool = False, **settings: Any,
) -> Starlette:
    """A Starlette app with only the OpenAI routes, owning an Engine of `model` (or serving `engine`).
    Keywords other than the HTTP ones (`HTTPSettings`) are engine settings."""
    http = HTTPSettings.from_env(
        api_key=api_key, max_request_bytes=max_request_bytes, cors_origins=cors_origins,
        request_policy=request_policy, trusted_client_fields=trusted_client_fields,
        report_cached_tokens=report_cached_tokens,
    )
    middleware = [Middleware(CORSMiddleware, allow_origins=list(http.cors_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"])] if http.cors_origins else []
    return Starlette(routes=openai_routes(), middleware=middleware,
                     lifespan=engine_lifespan(model, engine=engine, http=http, **settings))


# -- the guard every route goes through ------------------------------------------------------
class _TooLarge(Exception):
    """The body passed `max_request_bytes`."""


def _guarded(endpoint: Callable[..., Awaitable[Response]], *, auth: bool = True, basic: bool = False
             ) -> Callable[[Request], Any]:
    """Auth, then the endpoint, with every failure turned into an OpenAI error body (never a bare 500).
    `basic`: a browser's page, whose 401 asks for the key as a Basic-auth password (any user name)."""

    async def run(request: Request) -> Response:
        settings: HTTPSettings = getattr(request.app.state, "http_settings", None) or HTTPSettings.from_env()
        if auth and not _authorized(request, settings.api_key):
            return _json_error(401, "a valid API key is needed: send `Authorization: Bearer <key>`",
                               "invalid_request_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": 'Basic realm="tokenflow"' if basic else "Bearer"})
        try:
            return await endpoint(request, settings)
        except TokenflowError as exc:
            _report(request, exc)
            return _error(exc)
        except _TooLarge:
            return _json_error(413, f"the request body is larger than {settings.max_request_bytes} bytes",
                               "invalid_request_error", code="request_too_large")
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return _json_error(500, "internal server error", "server_error")

    return run


def _authorized(request: Request, api_key: str | None) -> bool:
    """`Authorization: Bearer <key>`, or Basic auth with the key as password (what a browser sends)."""
    if api_key is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    scheme, given = scheme.lower(), given.strip()
    if scheme == "basic":
        try:
            given = base64.b64decode(given, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
    elif scheme != "bearer":
        return False
    return hmac.compare_digest(given.encode(), api_key.encode())


def _report(request: Request, error: BaseException) -> None:
    """Tell the dashboard which error a caller got."""
    feed = getattr(request.app.state, "dashboard", None)
    if feed is not None:
        feed.record_error(error)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (`_TooLarge`) as soon as it is known to pass `limit`: by Content-Length, or while read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


_DISCONNECTED = object()


async def _unless_disconnected(request: Request, call: Callable[[], Awaitable[Any]]) -> Any:
    """`await call()`, cancelled (returning `_DISCONNECTED`) if the client hangs up meanwhile: a caller
    that left must not keep its request queued or generating."""
    result: Any = _DISCONNECTED
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await call()
        except Exception as exc:  # raised after the group, unwrapped
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


class _EventStream(StreamingResponse):
    """Server-sent events that stop (and close their generator, aborting the request) when the client
    leaves, whatever ASGI version the server speaks."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the connection broke while sending
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]


# -- routes ------------------------------------------------------------------------------
async def health(request: Request, settings: HTTPSettings) -> Response:
    engine: Engine | None = getattr(request.app.state, "engine", None)
    stats = engine.stats() if engine is not None else {"state": "starting"}
    state, dead = stats.get("state"), stats.get("dead", False)
    ok = state == "running" and not dead
    return JSONResponse({"status": "ok" if ok else (state if not dead else "dead")}, status_code=200 if ok else 503)


async def models(request: Request, settings: HTTPSettings) -> Response:
    """The model, then each LoRA adapter served (`parent`: the model, as vLLM lists them)."""
    engine: Engine = request.app.state.engine
    base = {"object": "model", "created": 0, "owned_by": "tokenflow",
            "max_model_len": engine.loaded.max_model_len}  # vLLM's field: the context the engine serves
    adapters = [{"id": name, **base, "parent": engine.model_name, "root": adapter.path}
                for name, adapter in sorted(engine.adapters.items())]
    return JSONResponse({"object": "list", "data": [{"id": engine.model_name, **base}, *adapters]})


def _served_as(body: Any, engine: Engine, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The model name a response reports, and the request's keywords with the LoRA adapter `model` names."""
    if body.model is not None and body.model in engine.adapters:
        return body.model, {**kwargs, "lora": body.model}
    return engine.model_name, kwargs


async def tokenize(request: Request, settings: HTTPSettings) -> Response:
    """vLLM's body: `{"prompt"}` or `{"messages"}` -> `{"tokens", "count", "max_model_len"}`."""
    engine: Engine = request.app.state.engine
    body = decode_as(await _read_body(request, settings.max_request_bytes), TokenizeRequest)
    if (unknown := _unknown_model(body.model, engine)) is not None:
        return unknown
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of `prompt` and `messages`", field="prompt")
    if body.messages is not None:
        tools = [t.to_dict() for t in body.tools] if body.tools else None
        tokens = await engine.tokenize([m.to_dict() for m in body.messages], tools=tools,
                                       add_generation_prompt=body.add_generation_prompt,
                                       continue_final_message=body.continue_final_message)
    else:
        tokens = await engine.tokenize(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.loaded.max_model_len})


async def embeddings(request: Request, settings: HTTPSettings) -> Response:
    """OpenAI's body -> `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
    "usage"}`; with `encoding_format: "base64"` each embedding is its little-endian float32 bytes in base64."""
    engine: Engine = request.app.state.engine
    body = decode_as(await _read_body(request, settings.max_request_bytes), EmbeddingRequest)
    if (unknown := _unknown_model(body.model, engine)) is not None:
        return unknown
    vectors, tokens = await engine.embed_with_usage(body.input, pooling=body.pooling, normalize=body.normalize)
    if body.dimensions is not None and body.dimensions != len(vectors[0]):
        raise InvalidRequest(f"this model's embeddings have {len(vectors[0])} dimensions; `dimensions` may only "
                             "say so (no truncation)", field="dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
             if body.encoding_format == "base64" else v}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": engine.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def detokenize(request: Request, settings: HTTPSettings) -> Response:
    """`{"tokens"}` -> `{"prompt"}`."""
    engine: Engine = request.app.state.engine
    body = decode_as(await _read_body(request, settings.max_request_bytes), DetokenizeRequest)
    if (unknown := _unknown_model(body.model, engine)) is not None:
        return unknown
    return JSONResponse({"prompt": await engine.detokenize(body.tokens)})


def _unknown_model(model: str | None, engine: Engine) -> Response | None:
    """The 404 of a request for a model this server does not serve (as OpenAI and vLLM: no silent fallback);
    a LoRA adapter's name is a model too (vLLM's convention)."""
    if model is None or model == engine.model_name or model in engine.adapters:
        return None
    return _json_error(404, f"The model `{model}` does not exist; this server serves `{engine.model_name}`.",
                       "invalid_request_error", code="model_not_found", param="model")


async def dashboard(request: Request, settings: HTTPSettings) -> Response:
    return Response(dashboard_html(), media_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-store", "Content-Security-Policy": _DASHBOARD_CSP})


async def engine_stats(request: Request, settings: HTTPSettings) -> Response:
    engine: Engine = request.app.state.engine
    return JSONResponse(request.app.state.dashboard.snapshot(engine.stats()), headers={"Cache-Control": "no-store"})


# The page loads nothing from elsewhere and talks only to this server.
_DASHBOARD_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                  "connect-src 'self'; img-src 'self' data:")


async def metrics(request: Request, settings: HTTPSettings) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _serve(request: Request, settings: HTTPSettings, *, chat: bool) -> Response:
    engine: Engine = request.app.state.engine
    body = decode_body(await _read_body(request, settings.max_request_bytes), chat)
    if (unknown := _unknown_model(body.model, engine)) is not None:
        return unknown
    prompts = prompts_of(body)
    if body.stream:
        return await _serve_stream(request, settings, body, prompts, chat=chat)
    if len(prompts) > 1 or body.n > 1:
        return await _serve_many(request, settings, body, prompts, chat=chat)
    prompt, kwargs = to_engine_kwargs(body)
    served, kwargs = _served_as(body, engine, await _apply_policy(request, kwargs, settings))
    rid = response_id(chat)
    started = time.perf_counter()
    call = engine.chat(prompt, **kwargs) if chat else engine.generate(prompt, **kwargs)
    done = await _unless_disconnected(request, lambda: call)
    if done is _DISCONNECTED:
        return Response(status_code=499)
    request.app.state.metrics.latency.observe(time.perf_counter() - started)
    return JSONResponse(completion_body(
        done, chat=chat, model=served, rid=rid, logprobs=kwargs.get("logprobs") is not None,
        tokenizer=engine.loaded.tokenizer, report_cached_tokens=settings.report_cached_tokens,
        echo=_echo_texts(body, [prompt], engine.loaded.tokenizer), prompt_logprobs=body.prompt_logprobs is not None,
    ))


async def _serve_stream(request: Request, settings: HTTPSettings, body: Any, prompts: list[Any], *,
                        chat: bool) -> Response:
    """Server-sent events of every choice (`n` per prompt, choice `p * n + i` being sample `i` of prompt
    `p`), interleaved as they are generated; an error before the first token still gets its status code."""
    engine: Engine = request.app.state.engine
    served, kwargs = _served_as(body, engine, await _apply_policy(request, engine_kwargs(body), settings))
    n = body.n
    started = time.perf_counter()
    if len(prompts) == 1 and n == 1:
        one = engine.stream_chat(prompts[0], **kwargs) if chat else engine.stream(prompts[0], **kwargs)
        items = _indexed(one)
    elif chat:
        items = engine.stream_chat_many(prompts[0], n, **kwargs)
    else:
        items = engine.stream_batch(prompts, n, **kwargs)
    try:
        first = await _unless_disconnected(request, partial(anext, items, None))
    except BaseException:
        with anyio.CancelScope(shield=True):
            await items.aclose()  # type: ignore[attr-defined]
        raise
    if first is _DISCONNECTED:
        await items.aclose()  # type: ignore[attr-defined]
        return Response(status_code=499)  # nobody reads it; the requests are aborted
    request.app.state.metrics.ttft.observe(time.perf_counter() - started)
    choices = [p for p in prompts for _ in range(n)]
    tools, tool_choice = kwargs.get("tools"), kwargs.get("tool_choice") or "auto"
    return _EventStream(_events(
        request, items, first, response_id(chat), chat, body.stream_options is not None
        and body.stream_options.include_usage, started, settings, n=n,
        logprobs=kwargs.get("logprobs") is not None, echo=_echo_texts(body, choices, engine.loaded.tokenizer),
        prompt_ids=[p if isinstance(p, list) and not chat else None for p in choices],
        calls=[ToolCallStream(tools, tool_choice) for _ in choices] if tools else None, model=served))


async def _indexed(stream: AsyncIterator[Chunk]) -> AsyncIterator[tuple[int, Chunk]]:
    """One request's chunks as choice 0's."""
    try:
        async for chunk in stream:
            yield 0, chunk
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _apply_policy(request: Request, kwargs: dict[str, Any], settings: HTTPSettings) -> dict[str, Any]:
    """Fields only the operator may set are refused from clients; then the app's policy has its say."""
    for name in sorted(CLIENT_SETTABLE - settings.trusted_client_fields):
        if name in kwargs:
            raise InvalidRequest(f"`{name}` is set by this server, not by clients", field=name)
    if settings.request_policy is not None:
        overrides = settings.request_policy(request, dict(kwargs))
        if inspect.isawaitable(overrides):
            overrides = await overrides
        kwargs.update(overrides or {})
    return kwargs


async def _serve_many(request: Request, settings: HTTPSettings, body: Any, prompts: list[Any], *,
                      chat: bool) -> Response:
    """Several choices: `n` samples of each prompt (the prompt prefilled once, see `Engine.generate_many`),
    choice `p * n + i` being sample `i` of prompt `p`."""
    engine: Engine = request.app.state.engine
    served, kwargs = _served_as(body, engine, await _apply_policy(request, engine_kwargs(body), settings))
    n = body.n
    results: list[list[Completion] | Exception] = [[] for _ in prompts]
    started = time.perf_counter()

    async def one(index: int, prompt: Any) -> None:
        many = engine.chat_many if chat else engine.generate_many
        try:
            results[index] = await many(prompt, n, **kwargs)
        except Exception as exc:  # the first prompt's error (by prompt order) is the answer
            results[index] = exc

    async def every() -> bool:
        async with anyio.create_task_group() as tg:
            for index, prompt in enumerate(prompts):
                tg.start_soon(one, index, prompt)
        return True

    if await _unless_disconnected(request, every) is _DISCONNECTED:
        return Response(status_code=499)
    for result in results:
        if isinstance(result, Exception):
            raise result
    request.app.state.metrics.latency.observe(time.perf_counter() - started)
    return JSONResponse(completion_body(
        [c for group in results if isinstance(group, list) for c in group], chat=chat, model=served, n=n,
        logprobs=kwargs.get("logprobs") is not None, tokenizer=engine.loaded.tokenizer,
        report_cached_tokens=settings.report_cached_tokens,
        echo=_echo_texts(body, [p for p in prompts for _ in range(n)], engine.loaded.tokenizer),
        prompt_logprobs=body.prompt_logprobs is not None))


async def _events(request: Request, items: AsyncIterator[tuple[int, Chunk]], first: tuple[int, Chunk] | None,
                  rid: str, chat: bool, include_usage: bool, started: float, settings: HTTPSettings, *, n: int = 1,
                  logprobs: bool = False, echo: list[str] | None = None,
                  prompt_ids: list[list[int] | None] | None = None,
                  calls: list[ToolCallStream] | None = None, model: str | None = None) -> AsyncIterator[str]:
    """The SSE events of `(choice index, chunk)` items: per choice, chat's role delta (or the echoed prompt)
    first, then its deltas; usage (each prompt counted once) after the last."""
    engine: Engine = request.app.state.engine
    app_metrics: EngineMetrics = request.app.state.metrics
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    tokenizer = engine.loaded.tokenizer
    model = model or engine.model_name
    usages: dict[int, Usage] = {}
    text_offset: dict[int, int] = {}

    def event(choice: dict[str, Any]) -> str:
        return _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]})

    try:
        item = first
        while item is not None:
            index, chunk = item
            if index not in text_offset:  # the choice's first chunk
                text_offset[index] = 0
                if chat:  # with `echo`, the continued assistant message's text first (vLLM's)
                    opening = echo[index] if echo is not None else ""
                    yield event({"index": index, "delta": {"role": "assistant", "content": opening},
                                 "finish_reason": None})
                elif echo is not None:  # the prompt first, scored when logprobs were asked for
                    echoed: dict[str, Any] = {"index": index, "text": echo[index], "finish_reason": None,
                                              "logprobs": None}
                    if logprobs and chunk.prompt_logprobs is not None:
                        ids = (prompt_ids[index] if prompt_ids is not None else None) \
                            or await engine.tokenize(echo[index])
                        echoed["logprobs"] = prompt_logprobs_body(ids, chunk.prompt_logprobs, tokenizer)
                    yield event(echoed)
                    text_offset[index] = len(echo[index])
            if chunk.usage is not None:
                usages[index] = chunk.usage
            finish = chunk.finish_reason
            deltas: list[dict[str, Any]] = []
            stream_calls = calls[index] if calls is not None else None
            if stream_calls is not None:  # tools: content and tool-call deltas; the finish reason comes with the last
                deltas = stream_calls.feed(chunk.text) + (stream_calls.finish() if finish is not None else [])
                if finish not in (None, "length") and stream_calls.num_calls:  # a call cut short keeps "length"
                    finish = "tool_calls"
            elif chat:
                deltas = [{"content": chunk.text}] if chunk.text else []
            if chat:
                deltas = deltas or [{}]
                choices: list[dict[str, Any]] = [{"index": index, "delta": delta, "finish_reason": None}
                                                 for delta in deltas]
                choices[-1]["finish_reason"] = finish
            else:
                choices = [{"index": index, "text": chunk.text, "finish_reason": finish, "logprobs": None}]
            if logprobs and chunk.logprobs:
                choices[0]["logprobs"] = logprobs_body(chunk.logprobs, chat=chat, tokenizer=tokenizer,
                                                       text_offset=text_offset[index])
                text_offset[index] += len(chunk.text)
            for choice in choices:
                yield event(choice)
            item = await anext(items, None)
    except TokenflowError as exc:  # after the first event the status is sent: the error goes in the stream
        _report(request, exc)
        yield _sse(error_body(exc)[1])
    except Exception as exc:
        log.exception("stream %s failed", rid)
        yield _sse(error_body(EngineError(f"the stream failed: {type(exc).__name__}"))[1])
    else:
        app_metrics.latency.observe(time.perf_counter() - started)
        if include_usage and usages:
            done = [usages[i] for i in sorted(usages)]
            usage = Usage(prompt_tokens=sum(u.prompt_tokens for i, u in sorted(usages.items()) if i % n == 0),
                          completion_tokens=sum(u.completion_tokens for u in done),
                          cached_tokens=sum(u.cached_tokens for u in done))
            yield _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                        "usage": _usage(usage, settings.report_cached_tokens)})
    finally:
        with anyio.CancelScope(shield=True):
            await items.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"


# -- mapping ---------------------------------------------------------------------------
def parse_request(body: Any, chat: bool) -> tuple[Any, dict[str, Any]]:
    """`(prompt or messages, Engine keyword arguments)` of a request body (a decoded JSON object or its
    bytes); `InvalidRequest` naming the field if it is malformed. No trust policy is applied here."""
    return to_engine_kwargs(decode_body(body, chat))


def _echo_texts(body: Any, prompts: Sequence[Any], tokenizer: Any) -> list[str] | None:
    """With `echo`, each prompt's text (a token-id prompt decoded); else None."""
    if not getattr(body, "echo", False):
        return None
    if isinstance(body, ChatCompletionRequest):  # vLLM's: the last message's text when it is the assistant's
        last = body.messages[-1].to_dict()
        return [last["content"] if last["role"] == "assistant" else "" for _ in prompts]
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


def _usage(usage: Usage, report_cached_tokens: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                           "total_tokens": usage.total_tokens}
    if report_cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def completion_body(
    done: Completion | Sequence[Completion], *, chat: bool, model: str, rid: str | None = None,
    logprobs: bool = False, tokenizer: Any = None, report_cached_tokens: bool = False, n: int = 1,
    echo: Sequence[str] | None = None, prompt_logprobs: bool = False,
) -> dict[str, Any]:
    """The OpenAI response body of finished requests, one choice each in order (`n` choices per prompt:
    usage counts each prompt once); logprobs need the tokenizer to spell tokens. `echo`: each choice's
    prompt text, put before its completion (with its prompt logprobs when the request has them).
    `prompt_logprobs` (vLLM's): each choice's (completions) or the response's (chat) `prompt_logprobs`."""
    dones = [done] if isinstance(done, Completion) else list(done)
    choices = []
    for index, one in enumerate(dones):
        choice: dict[str, Any] = {"index": index, "finish_reason": one.finish_reason, "logprobs": None}
        prefix = echo[index] if echo is not None else ""
        if logprobs and one.logprobs is not None:
            choice["logprobs"] = logprobs_body(one.logprobs, chat=chat, tokenizer=tokenizer, text_offset=len(prefix))
            if echo is not None and not chat and one.prompt_logprobs is not None:
                scored = prompt_logprobs_body(one.prompt_token_ids or [], one.prompt_logprobs, tokenizer)
                choice["logprobs"] = {key: scored[key] + choice["logprobs"][key] for key in scored}
        if chat and one.tool_calls:
            if one.finish_reason != "length":  # a call cut short by max_tokens keeps "length", its arguments partial
                choice["finish_reason"] = "tool_calls"
            choice["message"] = {"role": "assistant", "content": content_besides_calls(one.text), "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in one.tool_calls]}
        elif chat:
            choice["message"] = {"role": "assistant", "content": prefix + one.text}
        else:
            choice["text"] = prefix + one.text
        if prompt_logprobs and not chat:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(one, tokenizer)
        choices.append(choice)
    usage = Usage(prompt_tokens=sum(d.usage.prompt_tokens for d in dones[::n]),
                  completion_tokens=sum(d.usage.completion_tokens for d in dones),
                  cached_tokens=sum(d.usage.cached_tokens for d in dones))
    body = {"id": rid or response_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(usage, report_cached_tokens)}
    if prompt_logprobs and chat:  # vLLM puts a chat's at the top: every choice shares the prompt
        body["prompt_logprobs"] = vllm_prompt_logprobs(dones[0], tokenizer)
    return body


def vllm_prompt_logprobs(done: Completion, tokenizer: Any) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, then `{token id: {"logprob",
    "decoded_token"}}` for the token itself and the top alternatives asked for."""
    if done.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": _finite(v), "decoded_token": tokenizer.decode([t])}
                                        for t, v in entry.items()}
            for entry in done.prompt_logprobs]


def logprobs_body(logprobs: Sequence[TokenLogprob], *, chat: bool, tokenizer: Any, text_offset: int = 0
                  ) -> dict[str, Any]:
    """OpenAI's `logprobs` object of some tokens: chat's `content` list, or the completions arrays
    (`text_offset` continues from `text_offset` characters, for a stream's later chunks)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    if chat:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            spelled = text(token_id)
            return {"token": spelled, "logprob": _finite(value), "bytes": list(spelled.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in logprobs]}
    offsets, at = [], text_offset
    for lp in logprobs:
        offsets.append(at)
        at += len(text(lp.token_id))
    return {
        "tokens": [text(lp.token_id) for lp in logprobs],
        "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
        # the sampled token and the alternatives asked for (OpenAI's legacy API and vLLM: with logprobs=0, the
        # sampled token alone)
        "top_logprobs": [{text(lp.token_id): _finite(lp.logprob), **{text(t): _finite(v) for t, v in lp.top.items()}}
                         for lp in logprobs],
        "text_offset": offsets,
    }


def prompt_logprobs_body(prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[dict[int, float] | None],
                         tokenizer: Any) -> dict[str, Any]:
    """The completions `logprobs` arrays of an echoed prompt, `None` for its first token (as OpenAI's echo)."""
    tokens = [tokenizer.decode([t]) for t in prompt_token_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e[t]) if e else None for e, t in zip(prompt_logprobs, prompt_token_ids)],
        "top_logprobs": [{tokenizer.decode([k]): _finite(v) for k, v in e.items()} if e else None
                         for e in prompt_logprobs],
        "text_offset": offsets,
    }


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_body(exc: TokenflowError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a typed engine error."""
    status, kind = 500, "server_error"
    if isinstance(exc, InvalidRequest):
        status, kind = 400, "invalid_request_error"
    elif isinstance(exc, Overloaded):
        status, kind = 429, "rate_limit_error"
    elif isinstance(exc, (EngineClosed, EngineError)):
        status, kind = 503, "service_unavailable"
    elif isinstance(exc, DeadlineExceeded):
        status, kind = 504, "timeout"
    return status, {"error": {"message": str(exc), "type": kind, "param": getattr(exc, "field", None), "code": None}}


def retry_after_s(exc: Overloaded) -> int:
    return max(1, math.ceil(exc.retry_after or 1.0))


def _error(exc: TokenflowError) -> JSONResponse:
    status, body = error_body(exc)
    headers = {"Retry-After": str(retry_after_s(exc))} if isinstance(exc, Overloaded) else {}
    return JSONResponse(body, status_code=status, headers=headers)


def _json_error(status: int, message: str, kind: str, *, code: str | None = None, param: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)

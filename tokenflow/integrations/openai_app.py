"""An OpenAI-compatible ASGI app around an Engine (Starlette; mounts into FastAPI too).

    app = create_app("smollm2-135m", max_num_seqs=16)      # owns an Engine through its lifespan
    app = create_app(engine=my_engine)                     # or serves one the caller owns

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or
server-sent events with `stream: true`, usage in the last event when
`stream_options.include_usage`), `GET /v1/models`, `GET /health` (200 once the
model is loaded), `GET /metrics` (Prometheus). A client that disconnects
mid-stream cancels the response task, which aborts its request: its KV blocks
are freed at the next step. Errors are OpenAI-style JSON bodies: 400
`InvalidRequest`, 429 `Overloaded` (with `Retry-After`), 503 closed or dead
engine (`EngineClosed`, `EngineError`), 504 `DeadlineExceeded`.

Request fields map to `SamplingParams`: `max_tokens` (or
`max_completion_tokens`), `temperature`, `top_p`, `stop`, `seed`,
`presence_penalty`, `frequency_penalty`, `logprobs` / `top_logprobs`, and the
non-OpenAI `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `priority`,
`cache_salt` (through the client's `extra_body`). `n` must be 1.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenflow.engine import Engine
from tokenflow.errors import DeadlineExceeded, EngineClosed, EngineError, InvalidRequest, Overloaded, TokenflowError
from tokenflow.integrations.metrics import EngineMetrics
from tokenflow.params import Chunk, Completion

__all__ = ("PASSTHROUGH", "completion_body", "create_app", "engine_lifespan", "error_body", "openai_routes",
           "parse_request", "response_id", "retry_after_s")

# Body fields passed to the engine as they are (the non-OpenAI ones through a client's `extra_body`).
PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "ignore_eos", "priority", "cache_salt", "min_tokens", "stop_token_ids")


def engine_lifespan(model: str | None = None, *, engine: Engine | None = None, **settings: Any) -> Any:
    """A Starlette/FastAPI lifespan that puts a started Engine on `app.state.engine` (and closes it
    at shutdown when it created it)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        owned = engine is None
        current = engine if engine is not None else Engine(model, **settings)
        await current.start()
        app.state.engine = current
        app.state.metrics = EngineMetrics(current)
        current.add_observer(app.state.metrics)
        try:
            yield
        finally:
            if owned:
                await current.aclose()

    return lifespan


def openai_routes() -> list[Route]:
    """The routes, for an app that has its own (e.g. `fastapi_app.router.routes.extend(openai_routes())`,
    with `lifespan=engine_lifespan(...)`)."""
    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def create_app(model: str | None = None, *, engine: Engine | None = None, **settings: Any) -> Starlette:
    """A Starlette app with only the OpenAI routes, owning an Engine of `model` (or serving `engine`)."""
    return Starlette(routes=openai_routes(), lifespan=engine_lifespan(model, engine=engine, **settings))


# -- routes ------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    engine: Engine | None = getattr(request.app.state, "engine", None)
    stats = engine.stats() if engine is not None else {"state": "starting"}
    state, dead = stats.get("state"), stats.get("dead", False)
    ok = state == "running" and not dead
    return JSONResponse({"status": "ok" if ok else (state if not dead else "dead")}, status_code=200 if ok else 503)


async def models(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    return JSONResponse({"object": "list", "data": [
        {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "tokenflow"}]})


async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


async def _serve(request: Request, chat: bool) -> Response:
    engine: Engine = request.app.state.engine
    try:
        body = await request.json()
        prompt, kwargs = parse_request(body, chat)
    except json.JSONDecodeError:
        return _error(InvalidRequest("the request body is not valid JSON"))
    except TokenflowError as exc:
        return _error(exc)
    rid = response_id(chat)
    started = time.perf_counter()
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = engine.stream_chat(prompt, **kwargs) if chat else engine.stream(prompt, **kwargs)
        try:
            first = await anext(aiter(stream))  # errors before the first token still get a status code
        except StopAsyncIteration:
            first = None
        except TokenflowError as exc:
            return _error(exc)
        request.app.state.metrics.ttft.observe(time.perf_counter() - started)
        events = _events(request, stream, first, rid, chat, include_usage, started)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        done = await (engine.chat(prompt, **kwargs) if chat else engine.generate(prompt, **kwargs))
    except TokenflowError as exc:
        return _error(exc)
    request.app.state.metrics.latency.observe(time.perf_counter() - started)
    body_out = completion_body(done, chat=chat, model=engine.model_name, rid=rid,
                               logprobs=kwargs.get("logprobs") is not None, tokenizer=engine.loaded.tokenizer)
    return JSONResponse(body_out)


async def _events(request: Request, stream: AsyncIterator[Chunk], first: Chunk | None, rid: str, chat: bool,
                  include_usage: bool, started: float) -> AsyncIterator[str]:
    engine: Engine = request.app.state.engine
    app_metrics: EngineMetrics = request.app.state.metrics
    created = int(time.time())
    usage = None
    if chat:
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    chunk = first
    while chunk is not None:
        usage = chunk.usage or usage
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": chunk.text} if chunk.text else {},
                                      "finish_reason": chunk.finish_reason}
        else:
            choice = {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason, "logprobs": None}
        yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": engine.model_name, "choices": [choice]})
        chunk = await anext(stream, None)
    app_metrics.latency.observe(time.perf_counter() - started)
    if include_usage and usage is not None:
        yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": engine.model_name, "choices": [], "usage": _usage(usage)})
    yield "data: [DONE]\n\n"


# -- mapping ---------------------------------------------------------------------------
def parse_request(body: Any, chat: bool) -> tuple[Any, dict[str, Any]]:
    """`(prompt or messages, Engine keyword arguments)` of a request body; `InvalidRequest` if malformed.

    Parameter values are checked by the engine itself (`SamplingParams`)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise InvalidRequest("only n=1 is supported", field="n")
    if chat:
        prompt = body.get("messages")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise InvalidRequest("`messages` must be a non-empty list of message objects", field="messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, (str, list)):
            raise InvalidRequest("`prompt` must be a string or a list of token ids", field="prompt")
    kwargs: dict[str, Any] = {k: body[k] for k in PASSTHROUGH if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    kwargs["max_tokens"] = max_tokens if max_tokens is not None else (512 if chat else 16)
    if body.get("stop") is not None:
        kwargs["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    if chat and body.get("logprobs"):
        kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif not chat and body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    return prompt, kwargs


def _usage(usage: Any) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def completion_body(
    done: Completion, *, chat: bool, model: str, rid: str | None = None, logprobs: bool = False,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The OpenAI response body of a finished request (logprobs need the tokenizer to spell tokens)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
    if logprobs and done.logprobs is not None:
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id])

        if chat:
            choice["logprobs"] = {"content": [
                {"token": text(lp.token_id), "logprob": _finite(lp.logprob), "bytes": None,
                 "top_logprobs": [{"token": text(t), "logprob": _finite(v), "bytes": None} for t, v in lp.top.items()]}
                for lp in done.logprobs]}
        else:
            offsets, at = [], 0
            for lp in done.logprobs:
                offsets.append(at)
                at += len(text(lp.token_id))
            choice["logprobs"] = {
                "tokens": [text(lp.token_id) for lp in done.logprobs],
                "token_logprobs": [_finite(lp.logprob) for lp in done.logprobs],
                "top_logprobs": [{text(t): _finite(v) for t, v in lp.top.items()} for lp in done.logprobs],
                "text_offset": offsets,
            }
    if chat:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    return {"id": rid or response_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(done.usage)}


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

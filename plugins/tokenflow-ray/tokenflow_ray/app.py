"""The Ray Serve application: N engine replicas behind a prefix-affinity router, one HTTP ingress.

    app = build_app("smollm2-135m", num_replicas=2, max_num_seqs=16)
    serve.run(app)        # POST /v1/completions, POST /v1/chat/completions on Serve's HTTP port

The ingress is a cheap FastAPI replica that validates bodies and calls the
engine deployment through its `DeploymentHandle`, passing the body as the
call's argument: the handle's request router (ours, `PrefixAffinityRouter`)
runs in the ingress process and reads the prompt from that argument. Each
engine replica owns one started `tokenflow.Engine`.
"""

import json
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

import tokenflow
from tokenflow.plugin_api import EngineClosed, InvalidRequest, Overloaded, TokenflowError
from tokenflow_ray.protocol import completion_body, error_body, parse_request
from tokenflow_ray.routing import DEFAULT_MAX_IMBALANCE, DEFAULT_PREFIX_CHARS, PrefixAffinityRouter

__all__ = ("EngineServer", "HTTPIngress", "build_app")


@serve.deployment(name="TokenflowEngine", max_ongoing_requests=64, graceful_shutdown_timeout_s=30)
class EngineServer:
    """One replica: a started `tokenflow.Engine`, answering OpenAI-style bodies with JSON-able dicts.

    Call it through a handle: `await handle.generate.remote({"prompt": ...})`
    or `await handle.chat.remote({"messages": [...]})`. Results carry
    `replica_id` (this replica's Serve id), and `usage.prompt_tokens_details.cached_tokens` when
    `report_cached_tokens` (off by default: it tells a caller which prefixes other callers sent).
    """

    async def __init__(self, model: str, settings: dict[str, Any] | None = None,
                       report_cached_tokens: bool = False) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.report_cached_tokens = report_cached_tokens
        self.engine = tokenflow.Engine(model, **(settings or {}))
        await self.engine.start()  # the replica counts as started only once the model is loaded

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """A `/v1/completions` body in, the response (or error) body out."""
        return await self._answer(body, chat=False)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A `/v1/chat/completions` body in, the response (or error) body out."""
        return await self._answer(body, chat=True)

    def stats(self) -> dict[str, Any]:
        """The engine's `stats()` with this replica's id."""
        return {"replica_id": self.replica_id, **self.engine.stats()}

    async def check_health(self) -> None:
        """Serve replaces a replica whose engine died or closed instead of sending it more requests."""
        stats = self.engine.stats()
        if stats.get("state") != "running" or stats.get("dead"):
            raise EngineClosed(f"engine is {'dead' if stats.get('dead') else stats.get('state')}")

    async def __del__(self) -> None:
        """Serve awaits this at replica shutdown: drain running requests, flush caches, free the model."""
        await self.engine.aclose()

    async def _answer(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        try:
            prompt, kwargs = parse_request(body, chat)
            if chat:
                done = await self.engine.chat(prompt, **kwargs)
            else:
                done = await self.engine.generate(prompt, **kwargs)
        except TokenflowError as exc:
            return {**error_body(exc), "replica_id": self.replica_id}
        return completion_body(done, chat=chat, model=self.engine.model_name, replica_id=self.replica_id,
                               report_cached_tokens=self.report_cached_tokens)


def _respond(body: dict[str, Any]) -> JSONResponse:
    """A JSON response whose status is `error.code` for error bodies (with `Retry-After` on 429)."""
    error = body.get("error")
    if not isinstance(error, dict):
        return JSONResponse(body)
    headers = {"Retry-After": str(error["retry_after"])} if "retry_after" in error else None
    return JSONResponse(body, status_code=int(error.get("code") or 500), headers=headers)


# `serve.ingress` pickles `api` (so the route methods, with only the module globals their code uses) when
# the class below is defined: every helper they call must be defined above it, and this module must not
# use `from __future__ import annotations` (FastAPI could not resolve `request: Request` and answers 422).
api = FastAPI(title="tokenflow on Ray Serve")


# The ingress only awaits handles: many requests in flight cost it little, and the engines do the queueing.
@serve.deployment(name="TokenflowIngress", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class HTTPIngress:
    """OpenAI-style HTTP front: bad bodies get a 400 here, good ones go to an engine replica."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        return await self._forward(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        return await self._forward(request, chat=True)

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def _forward(self, request: Request, chat: bool) -> JSONResponse:
        try:
            body = await request.json()
            parse_request(body, chat)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _respond(error_body(InvalidRequest("the request body is not valid JSON")))
        except InvalidRequest as exc:
            return _respond(error_body(exc))
        method = self.engine.chat if chat else self.engine.generate
        try:
            result = await method.remote(body)
        except BackPressureError as exc:  # every engine replica's queue is full (`max_queued_requests`)
            return _respond(error_body(Overloaded(str(exc))))
        except RayTaskError:  # a bug, not the client's fault: the traceback is in the engine replica's log
            return _respond(error_body(TokenflowError("the engine replica failed on this request")))
        except RayError as exc:  # the replica died or is unreachable
            return _respond(error_body(EngineClosed(f"engine replica unavailable: {type(exc).__name__}")))
        return _respond(result)


def build_app(
    model: str | os.PathLike[str], num_replicas: int = 2, *, prefix_chars: int = DEFAULT_PREFIX_CHARS,
    max_imbalance: int = DEFAULT_MAX_IMBALANCE, ray_actor_options: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None, report_cached_tokens: bool = False, **engine_settings: Any,
) -> Application:
    """The Serve application: `num_replicas` engine replicas of `model` (each `tokenflow.Engine(model,
    **engine_settings)`) routed by prompt prefix, behind one HTTP ingress.

    `prefix_chars`: how many leading prompt characters decide the replica;
    `max_imbalance`: how many more queued requests than the least-loaded
    replica the preferred one may have before a request goes elsewhere;
    `ray_actor_options`: per engine replica (default one CPU, e.g.
    `{"num_gpus": 1}` on a GPU node); `max_ongoing_requests`: per engine
    replica (Serve's backpressure; the default 64 lets the engine batch);
    `report_cached_tokens`: put `usage.prompt_tokens_details.cached_tokens` in answers.
    Raises `tokenflow.errors.ConfigError` for an unknown or invalid engine setting.
    """
    model = os.fspath(model)
    tokenflow.EngineConfig.load(model=model, **engine_settings)  # a bad setting fails here, not in every replica
    options: dict[str, Any] = {
        "num_replicas": num_replicas,
        "request_router_config": RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"prefix_chars": prefix_chars, "max_imbalance": max_imbalance},
        ),
    }
    if ray_actor_options is not None:
        options["ray_actor_options"] = ray_actor_options
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    engine = EngineServer.options(**options).bind(model, engine_settings, report_cached_tokens)
    return HTTPIngress.bind(engine)

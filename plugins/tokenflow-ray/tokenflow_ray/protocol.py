"""OpenAI-style request and response bodies for the deployment (non-streaming).

Both deployments use these: the ingress validates a body before it spends a
call on an engine replica, and the engine replica turns the body into
`Engine` arguments. Results are plain JSON-able dicts so they cross Ray's
process boundary without pickling tokenflow types, and errors come back as
OpenAI-style error bodies whose `code` is the HTTP status (as vLLM does)
rather than as exceptions wrapped in Ray's task errors.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from tokenflow import Completion
from tokenflow.errors import DeadlineExceeded, EngineClosed, EngineError, InvalidRequest, Overloaded, TokenflowError

__all__ = ("completion_body", "error_body", "parse_request")

# Body fields passed to the engine as they are (the non-OpenAI ones through a client's `extra_body`).
PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "ignore_eos", "priority", "cache_salt", "min_tokens", "stop_token_ids")


def parse_request(body: Any, chat: bool) -> tuple[Any, dict[str, Any]]:
    """`(prompt or messages, Engine keyword arguments)` for a request body; `InvalidRequest` if it is malformed.

    Parameter values are checked by the engine itself (`SamplingParams`), which
    also answers with `InvalidRequest`.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise InvalidRequest("streaming is not supported by this deployment", field="stream")
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
    kwargs = {name: body[name] for name in PASSTHROUGH if body.get(name) is not None}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    kwargs["max_tokens"] = max_tokens if max_tokens is not None else (512 if chat else 16)
    if body.get("stop") is not None:
        kwargs["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    return prompt, kwargs


def completion_body(done: Completion, *, chat: bool, model: str, replica_id: str) -> dict[str, Any]:
    """The OpenAI response body, plus `replica_id` (which engine replica answered)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    usage = done.usage
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}},
        "replica_id": replica_id,
    }


def error_body(exc: TokenflowError) -> dict[str, Any]:
    """An OpenAI-style error body; `error.code` is the HTTP status to answer with."""
    status, kind = 500, "server_error"
    if isinstance(exc, InvalidRequest):
        status, kind = 400, "invalid_request_error"
    elif isinstance(exc, Overloaded):
        status, kind = 429, "rate_limit_error"
    elif isinstance(exc, (EngineClosed, EngineError)):
        status, kind = 503, "service_unavailable"
    elif isinstance(exc, DeadlineExceeded):
        status, kind = 504, "timeout"
    error: dict[str, Any] = {"message": str(exc), "type": kind, "param": getattr(exc, "field", None), "code": status}
    if isinstance(exc, Overloaded):
        error["retry_after"] = max(1, math.ceil(exc.retry_after or 1.0))
    return {"error": error}

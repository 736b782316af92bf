"""OpenAI-style request and response bodies for the deployment (non-streaming).

Both deployments use these: the ingress validates a body before it spends a
call on an engine replica, and the engine replica turns the body into
`Engine` arguments. Results are plain JSON-able dicts so they cross Ray's
process boundary without pickling tokenflow types, and errors come back as
OpenAI-style error bodies whose `code` is the HTTP status (as vLLM does)
rather than as exceptions wrapped in Ray's task errors.
"""

from __future__ import annotations

from typing import Any

from tokenflow import plugin_api
from tokenflow.plugin_api import Completion, InvalidRequest, Overloaded, TokenflowError

__all__ = ("completion_body", "error_body", "parse_request")


def parse_request(body: Any, chat: bool) -> tuple[Any, dict[str, Any]]:
    """`(prompt or messages, Engine keyword arguments)` for a request body; `InvalidRequest` if it is malformed.

    tokenflow's OpenAI routes' parsing, less what this deployment does not
    answer: streams, and logprobs (the bodies carry no token texts).
    """
    if isinstance(body, dict) and body.get("stream"):
        raise InvalidRequest("streaming is not supported by this deployment", field="stream")
    prompt, kwargs = plugin_api.parse_request(body, chat)
    kwargs.pop("logprobs", None)
    return prompt, kwargs


def completion_body(done: Completion, *, chat: bool, model: str, replica_id: str,
                    report_cached_tokens: bool = False) -> dict[str, Any]:
    """The OpenAI response body, plus `replica_id` (which engine replica answered)."""
    body = plugin_api.completion_body(done, chat=chat, model=model, report_cached_tokens=report_cached_tokens)
    return {**body, "replica_id": replica_id}


def error_body(exc: TokenflowError) -> dict[str, Any]:
    """An OpenAI-style error body; `error.code` is the HTTP status to answer with."""
    status, body = plugin_api.error_body(exc)
    body["error"]["code"] = status
    if isinstance(exc, Overloaded):
        body["error"]["retry_after"] = plugin_api.retry_after_s(exc)
    return body

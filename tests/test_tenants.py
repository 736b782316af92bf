"""The trust boundary: the operator's `request_policy` decides tenant (`cache_salt`), priority and limits
from the caller's identity. Two tenants never share a cached prefix or a cached response, and
`cached_tokens` (which tells a caller what others sent) is absent unless the operator enables it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import Server
from tokenflow.errors import InvalidRequest

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
POLICIES = {"tenant-a": {"priority": 0}, "tenant-b": {"priority": 5, "max_tokens_cap": 6}}
PROMPT = "Shared system prompt for everyone. " * 6 + "Question?"


def tenant_policy(request: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The operator's policy: the tenant comes from the API key, never from the body."""
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    tenant = KEYS.get(key)
    if tenant is None:
        raise InvalidRequest("unknown tenant")
    policy = POLICIES[tenant]
    overrides: dict[str, Any] = {"cache_salt": tenant, "priority": policy["priority"]}
    cap = policy.get("max_tokens_cap")
    if cap is not None:
        overrides["max_tokens"] = min(params.get("max_tokens") or cap, cap)
    return overrides


def _server(tiny_model: Any, **http: Any) -> Server:
    return Server(tiny_model, max_model_len=256, num_kv_blocks=64, response_cache=True,
                  request_policy=tenant_policy, **http)


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    with _server(tiny_model) as running:
        yield running


def _complete(server: Server, key: str, **body: Any) -> dict[str, Any]:
    payload = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    response = httpx.post(server.url + "/v1/completions", json=payload, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def _hits(server: Server) -> tuple[int, int]:
    stats = server.stats()
    return stats["prefix_cache_hit_tokens"], stats["response_cache_memory_hits"]


def test_tenants_share_no_prefix_and_no_response(server: Server) -> None:
    first = _complete(server, "key-a")
    prefix_hits, response_hits = _hits(server)
    other = _complete(server, "key-b")  # the same prompt, the same greedy parameters, another tenant
    assert _hits(server) == (prefix_hits, response_hits)  # neither its prefix nor its answer came from a
    assert other["usage"]["completion_tokens"] == 6  # tenant b's own cap applied
    again = _complete(server, "key-a")  # the same tenant again: served from its own cache (the test can fail)
    assert _hits(server)[1] == response_hits + 1 and again["choices"] == first["choices"]
    near = _complete(server, "key-a", prompt=PROMPT + " Another one?")  # a shared prefix, within the tenant
    assert _hits(server)[0] > prefix_hits
    for body in (first, other, again, near):
        assert "prompt_tokens_details" not in body["usage"]


def test_the_policy_refuses_unknown_callers_and_clients_cannot_pick_their_tenant(server: Server) -> None:
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30,
                          headers={"Authorization": "Bearer key-x"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "unknown tenant"
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "cache_salt": "tenant-b"},
                          timeout=30, headers={"Authorization": "Bearer key-a"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_cached_tokens_only_when_the_operator_enables_it(tiny_model) -> None:
    with _server(tiny_model, report_cached_tokens=True) as server:
        _complete(server, "key-a")
        again = _complete(server, "key-a", prompt=PROMPT + " More?")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = _complete(server, "key-b", prompt=PROMPT + " More?")
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

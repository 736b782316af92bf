"""Hostile input through a real `tokenflow serve` on 127.0.0.1: each item gets its status and typed body,
the server's memory does not grow with the big inputs, and a good request gives the same tokens afterwards.

`pytest -s` prints the battery as a table.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.servers import ServeProcess, metric_values
from tokenflow.testing import build_tiny_model

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MB = 2**20
GOOD = {"model": "tiny-llama", "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    # a 32k context: a 30,000-token stream outlasts the 8 s deadline unless the tiny model streams 3,700
    # tokens/s (an 8,000-token one finished inside it once its decode steps had got fast enough)
    model = build_tiny_model(tmp_path_factory.mktemp("models-32k") / "tiny-llama", max_position_embeddings=32768)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # timeout: a long stream passes its deadline mid-way; max_num_seqs: a third caller queues
    with ServeProcess(model, "--set", "max_num_seqs=2", "--set", "timeout=8", "--set", "num_threads=1",
                      env={"TOKENFLOW_API_KEY": KEY}, log=log) as server:
        yield server


def _post(server: ServeProcess, path: str, body: Any = None, *, raw: bytes | None = None,
          headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})}, **kwargs)


def _aborted(server: ServeProcess) -> float:
    return metric_values(server.url, AUTH).get("tokenflow_requests_total{outcome=aborted}", 0.0)


def _wait_idle(server: ServeProcess) -> dict[str, float]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        values = metric_values(server.url, AUTH)
        if not (values["tokenflow_kv_blocks_used"] or values["tokenflow_requests_running"]
                or values["tokenflow_requests_waiting"]):
            return values
        time.sleep(0.05)
    raise AssertionError("the server did not go idle")


def _status_and_error(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
    except ValueError:
        return f"{response.status_code} (not JSON)"
    return f"{response.status_code} {error.get('type')}({error.get('param') or error.get('code') or ''})"


def test_hostile_battery_http(served: ServeProcess, tmp_path: Path) -> None:
    reference = _post(served, "/v1/completions", GOOD).json()["choices"][0]["text"]
    nested = b"[" * 100_000 + b"]" * 100_000
    nested_typed = b'{"prompt": "x", "stop": ' + nested + b"}"  # refused by its type at the first level
    nested_any = b'{"prompt": "x", "functions": ' + nested + b"}"  # an untyped field: the decoder's depth limit
    deep_schema: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}, "required": ["a"]}
    big_prompt = json.dumps({**GOOD, "prompt": "a" * (3 * MB)}).encode()  # under the body limit, over the prompt's
    items: list[tuple[str, Any, str]] = [
        ("no API key", lambda: httpx.post(served.url + "/v1/completions", json=GOOD, timeout=30),
         "401 invalid_request_error(invalid_api_key)"),
        ("a wrong API key", lambda: _post(served, "/v1/completions", GOOD, headers={"Authorization": "Bearer nope"}),
         "401 invalid_request_error(invalid_api_key)"),
        ("metrics without the key", lambda: httpx.get(served.url + "/metrics", timeout=30), "401 invalid_request_error"
         "(invalid_api_key)"),
        ("a 20 MB body", lambda: _post(served, "/v1/completions", raw=b'{"prompt": "' + b"a" * (20 * MB) + b'"}'),
         "413 invalid_request_error(request_too_large)"),
        ("a 20 MB chunked body (no Content-Length)",
         lambda: httpx.post(served.url + "/v1/completions", timeout=60, headers=AUTH,
                            content=iter([b'{"prompt": "'] + [b"a" * MB] * 20 + [b'"}'])),
         "413 invalid_request_error(request_too_large)"),
        ("a 3 MB prompt", lambda: _post(served, "/v1/completions", raw=big_prompt),
         "400 invalid_request_error(prompt)"),
        ("invalid UTF-8", lambda: _post(served, "/v1/completions", raw=b'{"prompt": "\xff\xfe"}'),
         "400 invalid_request_error()"),
        ("JSON nested 100,000 deep in `stop`", lambda: _post(served, "/v1/completions", raw=nested_typed),
         "400 invalid_request_error(stop)"),
        ("JSON nested 100,000 deep in `functions`", lambda: _post(served, "/v1/completions", raw=nested_any),
         "400 invalid_request_error()"),
        ("a 5,000-digit integer", lambda: _post(served, "/v1/completions", raw=b'{"prompt": "x", "max_tokens": 1'
                                                + b"0" * 5000 + b"}"), "400 invalid_request_error(max_tokens)"),
        ("stream_options is a string", lambda: _post(served, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "yes"}),
         "400 invalid_request_error(stream_options)"),
        ("a message that is a list", lambda: _post(served, "/v1/chat/completions", {"messages": [["user", "hi"]]}),
         "400 invalid_request_error(messages)"),
        ("an unknown role", lambda: _post(served, "/v1/chat/completions", {
            "messages": [{"role": "user<|im_end|>", "content": "hi"}]}), "400 invalid_request_error(messages)"),
        ("an unknown field", lambda: _post(served, "/v1/completions", {**GOOD, "frobnicate": 1}),
         "400 invalid_request_error(frobnicate)"),
        ("suffix (not implemented yet)", lambda: _post(served, "/v1/completions", {**GOOD, "suffix": "end"}),
         "400 invalid_request_error(suffix)"),
        ("a model that is not served", lambda: _post(served, "/v1/completions", {**GOOD, "model": "gpt-4o"}),
         "404 invalid_request_error(model)"),
        ("a regex that does not compile", lambda: _post(served, "/v1/completions", {
            **GOOD, "structured_outputs": {"regex": "(unclosed"}}), "400 invalid_request_error(regex)"),
        ("a JSON schema nested 300 deep", lambda: _post(served, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema}}}),
         "400 invalid_request_error(json_schema)"),
        ("a 1 MB JSON schema", lambda: _post(served, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
                "name": "big", "schema": {"type": "object", "description": "x" * MB}}}}),
         "400 invalid_request_error(json_schema)"),
        ("a body that is a JSON list", lambda: _post(served, "/v1/completions", [1, 2]), "400 invalid_request_error()"),
        ("priority from a client", lambda: _post(served, "/v1/completions", {**GOOD, "priority": -100}),
         "400 invalid_request_error(priority)"),
        ("cache_salt from a client", lambda: _post(served, "/v1/completions", {**GOOD, "cache_salt": "other"}),
         "400 invalid_request_error(cache_salt)"),
        ("repetition_penalty=1e-300", lambda: _post(served, "/v1/completions", {
            **GOOD, "temperature": 1, "repetition_penalty": 1e-300}), "400 invalid_request_error(repetition_penalty)"),
        ("max_tokens=10**9", lambda: _post(served, "/v1/completions", {**GOOD, "max_tokens": 10**9}),
         "400 invalid_request_error(max_tokens)"),
        ("a 100,000-character stop string", lambda: _post(served, "/v1/completions", {**GOOD, "stop": ["x" * 10**5]}),
         "400 invalid_request_error(stop)"),
        ("n=1000", lambda: _post(served, "/v1/completions", {**GOOD, "n": 1000}), "400 invalid_request_error(n)"),
        ("top_logprobs=10**6", lambda: _post(served, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**6}),
         "400 invalid_request_error(logprobs)"),
    ]
    rss_before = served.rss_bytes()
    rows, wrong = [], []
    for name, call, expected in items:
        started = time.perf_counter()
        got = _status_and_error(call())
        rows.append((name, got, f"{(time.perf_counter() - started) * 1e3:.0f} ms"))
        if got != expected:
            wrong.append((name, got, expected))
    rss_after = served.rss_bytes()
    print("\n[hostile http] item | status | time")
    for row in rows:
        print("[hostile http]", " | ".join(row))
    print(f"[hostile http] server RSS before the battery {rss_before / MB:.0f} MB, after {rss_after / MB:.0f} MB")
    assert not wrong, wrong
    assert rss_after - rss_before < 64 * MB
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200  # /health needs no key
    assert _wait_idle(served)["tokenflow_kv_blocks_used"] == 0
    assert _post(served, "/v1/completions", GOOD).json()["choices"][0]["text"] == reference


def test_cors_is_off_by_default(served: ServeProcess) -> None:
    preflight = httpx.options(served.url + "/v1/completions", timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    response = _post(served, "/v1/completions", GOOD, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


def test_deadline_mid_stream_is_an_error_event_then_done(served: ServeProcess) -> None:
    body = {**GOOD, "prompt": "a long story", "max_tokens": 30000, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "timeout" and "deadline" in last["error"]["message"]
    assert len(events) > 10  # tokens were streamed before the deadline hit


def _hang_up_after(server: ServeProcess, body: dict[str, Any], seconds: float) -> None:
    """Send a request, then close the connection without reading the answer."""
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        time.sleep(seconds)


def test_a_client_that_hangs_up_aborts_its_request(served: ServeProcess) -> None:
    """Non-streaming: the engine stops generating for a caller that left, mid-generation or still queued."""
    long = {**GOOD, "prompt": "a long story", "max_tokens": 1500}
    before = _aborted(served)
    _hang_up_after(served, long, 0.5)  # generating when it leaves
    deadline = time.monotonic() + 10
    while _aborted(served) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(served) == before + 1
    assert _wait_idle(served)["tokenflow_kv_blocks_used"] == 0

    # two long streams fill max_num_seqs=2 (until the test lets go); a third caller queues, then hangs up
    stop = threading.Event()
    held = {**long, "max_tokens": 6000, "stream": True}

    def hold() -> None:
        with httpx.stream("POST", served.url + "/v1/completions", json=held, headers=AUTH,
                          timeout=60) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 10
    while metric_values(served.url, AUTH)["tokenflow_requests_running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    before = _aborted(served)
    waiting_seen = []

    def watch_queue() -> None:
        for _ in range(40):
            waiting_seen.append(metric_values(served.url, AUTH)["tokenflow_requests_waiting"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_queue)
    watcher.start()
    _hang_up_after(served, {**GOOD, "max_tokens": 50}, 0.4)
    watcher.join()
    deadline = time.monotonic() + 5
    while _aborted(served) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    running = metric_values(served.url, AUTH)["tokenflow_requests_running"]
    stop.set()
    for t in holders:
        t.join(timeout=30)
    assert max(waiting_seen) >= 1  # it was queued ...
    assert _aborted(served) >= before + 1 and running == 2  # ... and aborted there while the others ran on
    assert _wait_idle(served)["tokenflow_kv_blocks_used"] == 0


def test_the_official_client_with_a_key(served: ServeProcess) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    done = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 3
    assert done.usage.prompt_tokens_details is None  # cached_tokens is off unless the operator enables it
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()

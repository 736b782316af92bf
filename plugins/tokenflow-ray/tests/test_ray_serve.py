"""The Serve application on a local Ray cluster: 2 engine replicas of a tiny model, answering over HTTP.

One cluster for the module (starting Ray and two replicas is most of the
cost), torn down whatever happens, and the whole module must finish in
`MODULE_BUDGET_S`: starting the app has its own timeout, every HTTP call too.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

import tokenflow
from tokenflow.testing import build_tiny_model
from tokenflow_ray import build_app, replica_order, routing_key

pytestmark = pytest.mark.slow

MODULE_BUDGET_S = 120.0
START_TIMEOUT_S = 90.0
PREFIX_CHARS = 64
MAX_ONGOING = 4  # per engine replica: small, so a burst fills the preferred replica
SETTINGS: dict[str, Any] = {"num_threads": 1}  # two replicas share two cores


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _call_with_timeout(fn: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a daemon thread; `TimeoutError` if it has not returned in `timeout` s."""
    results: queue.Queue[tuple[bool, Any]] = queue.Queue()

    def run() -> None:
        try:
            results.put((True, fn(*args, **kwargs)))
        except BaseException as exc:
            results.put((False, exc))

    threading.Thread(target=run, daemon=True).start()
    try:
        ok, value = results.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"{fn.__name__} did not return within {timeout:.0f} s") from None
    if not ok:
        raise value
    return value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ray") / "tiny-llama")


@pytest.fixture(scope="module")
def client(model: Path) -> Iterator[httpx.Client]:
    """An HTTP client for the app, served by 2 engine replicas on a fresh local Ray cluster."""
    started = time.monotonic()
    port = _free_port()
    # Replica logs stay in Ray's session folder (/tmp/ray/session_latest/logs), not in pytest's output.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(model, num_replicas=2, prefix_chars=PREFIX_CHARS, ray_actor_options={"num_cpus": 0},
                        report_cached_tokens=True,
                        max_ongoing_requests=MAX_ONGOING, **SETTINGS)
        # serve.run waits until every replica is up, retrying failed constructors: bound it.
        _call_with_timeout(serve.run, app, name="tokenflow", timeout=START_TIMEOUT_S)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0) as http:
            yield http
    finally:
        serve.shutdown()
        ray.shutdown()
    elapsed = time.monotonic() - started
    assert elapsed < MODULE_BUDGET_S, f"the Ray Serve tests took {elapsed:.0f} s"


def complete(client: httpx.Client, prompt: str, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def test_answers_match_a_local_engine(client: httpx.Client, model: Path) -> None:
    prompts = ["The quick brown fox", "What is the capital of France?"]
    messages = [{"role": "user", "content": "Tokenflow runs language models"}]
    async with tokenflow.Engine(model, **SETTINGS) as engine:
        expected = [await engine.generate(p, max_tokens=8, temperature=0.0) for p in prompts]
        expected_chat = (await engine.chat(messages, max_tokens=8, temperature=0.0)).text
    for prompt, done in zip(prompts, expected):
        body = complete(client, prompt, max_tokens=8)
        assert body["choices"][0]["text"] == done.text
        assert body["usage"]["completion_tokens"] == len(done.token_ids) and body["replica_id"]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": expected_chat}


def test_shared_prefixes_stick_to_one_replica_and_both_replicas_serve(client: httpx.Client) -> None:
    prefixes = [f"Document {i}: " + f"paragraph {i} of a long shared context. " * 3 for i in range(16)]
    served_by: dict[str, set[str]] = {}
    for prefix in prefixes:
        for question in ("Summarize it.", "Who wrote it?", "Translate it."):
            served_by.setdefault(prefix, set()).add(complete(client, prefix + question, max_tokens=2)["replica_id"])
    assert all(len(replicas) == 1 for replicas in served_by.values()), served_by
    replicas = set().union(*served_by.values())
    assert len(replicas) == 2  # 16 random prefixes all on one of 2 replicas: odds 1 in 32768
    for prefix, (replica,) in served_by.items():  # and exactly where rendezvous hashing puts them
        assert replica == replica_order(routing_key({"prompt": prefix}, PREFIX_CHARS), replicas)[0]


def test_second_request_of_a_prefix_reuses_its_cached_kv(client: httpx.Client) -> None:
    prefix = "A system prompt that many requests share, long enough to fill several KV blocks. " * 2
    first = complete(client, prefix + "First question?")
    second = complete(client, prefix + "Second question?")
    assert second["replica_id"] == first["replica_id"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_python_handle_routes_like_http(client: httpx.Client) -> None:
    """A handle in this process runs its own router, and rendezvous hashing agrees across processes."""
    prefix = "Calls from Python and over HTTP that share this prefix meet on one replica. "
    over_http = complete(client, prefix + "One?")
    handle = serve.get_deployment_handle("TokenflowEngine", app_name="tokenflow")
    direct = handle.generate.remote({"prompt": prefix + "Two?", "max_tokens": 4}).result(timeout_s=30)
    assert direct["replica_id"] == over_http["replica_id"]
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "error" in handle.chat.remote({"messages": []}).result(timeout_s=30)


async def test_a_full_preferred_replica_spills_over_to_the_other(client: httpx.Client) -> None:
    prefix = "A prefix that every request in this burst shares, so they all prefer one replica. "
    body = {"max_tokens": 48, "ignore_eos": True, "temperature": 0.0}
    async with httpx.AsyncClient(base_url=client.base_url, timeout=60.0) as http:
        requests = [{**body, "prompt": f"{prefix}Question {i}?"} for i in range(3 * MAX_ONGOING)]
        responses = await asyncio.gather(*(http.post("/v1/completions", json=request) for request in requests))
    assert all(response.status_code == 200 for response in responses)
    served = Counter(response.json()["replica_id"] for response in responses)
    assert len(served) == 2, served
    assert max(served.values()) >= MAX_ONGOING  # the preferred replica was filled first


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b'["a list"]', None),
    ("/v1/completions", b'{"max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', "n"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', "temperature"),  # checked by the engine replica
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}', "stream"),
])
def test_bad_requests_get_a_400(client: httpx.Client, path: str, body: bytes, param: str | None) -> None:
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]

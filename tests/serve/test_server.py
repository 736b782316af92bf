"""The OpenAI-compatible app under uvicorn on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import ServeProcess, Server


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    with Server(tiny_model, max_num_seqs=8) as running:
        yield running


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.openai_client()


def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_chat_completion(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 7 and done.usage.prompt_tokens > 0
    assert isinstance(done.choices[0].message.content, str) and done.choices[0].message.role == "assistant"


def test_completion_and_max_tokens(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny-llama", prompt="the engine", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5


def test_streaming_equals_non_streaming_and_ends_with_usage(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny-llama", messages=[{"role": "user", "content": "tell me"}],
                                  max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    events = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 12
    streamed = list(client.completions.create(model="tiny-llama", prompt="abc", max_tokens=4, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True}))
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny-llama", prompt="river", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    assert stop, base
    cut = client.completions.create(model="tiny-llama", prompt="river", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny-llama", prompt="music", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_bad_parameters_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=5, temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=5, n=17)  # past MAX_N
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=5)


def test_overloaded_is_429_with_retry_after(tiny_model) -> None:
    with Server(tiny_model, max_num_seqs=1, max_queue=1) as small:
        client = small.openai_client()

        def call(i: int) -> Any:
            try:
                return client.completions.create(model="tiny-llama", prompt=f"q{i}", max_tokens=64, temperature=0,
                                                 extra_body={"ignore_eos": True})
            except openai.RateLimitError as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(8)))
        limited = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert limited and len(limited) < 8
        assert int(limited[0].response.headers["Retry-After"]) >= 1
        assert limited[0].body["type"] == "rate_limit_error"


def test_client_disconnect_aborts_and_frees_blocks(server: Server) -> None:
    aborted = server.stats()["num_aborted"]
    body = {"model": "tiny-llama", "prompt": "a long story", "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.stats()["num_running"] == 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and server.stats()["num_aborted"] == aborted:
        time.sleep(0.001)
    steps_at_abort = server.stats()["num_steps"]
    while time.monotonic() < deadline and server.stats()["kv_blocks_used"]:
        time.sleep(0.001)
    stats = server.stats()
    assert stats["num_aborted"] == aborted + 1
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["num_steps"] - steps_at_abort <= 2  # released at the next step boundary


def test_metrics_parse(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny-llama", prompt="count me", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("tokenflow_requests", "tokenflow_requests_waiting", "tokenflow_requests_running",
                 "tokenflow_kv_blocks_used", "tokenflow_kv_blocks_cached", "tokenflow_kv_blocks_free",
                 "tokenflow_prefix_cache_hit_rate", "tokenflow_generation_tokens_per_second",
                 "tokenflow_time_to_first_token_seconds", "tokenflow_request_latency_seconds",
                 "tokenflow_breaker_state"):
        assert name in families, name
    completed = [s for s in families["tokenflow_requests"].samples
                 if s.name == "tokenflow_requests_total" and s.labels["outcome"] == "completed"]
    assert completed and completed[0].value >= 1
    latency = [s for s in families["tokenflow_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert latency[0].value >= 1
    closed = [s for s in families["tokenflow_breaker_state"].samples if s.labels["state"] == "closed"]
    assert closed[0].value == 1.0


def test_tokenflow_serve_command(tiny_model) -> None:
    with ServeProcess(tiny_model, "--set", "max_num_seqs=4") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)  # greedy: the top token
    done = client.completions.create(model="tiny-llama", prompt="x", max_tokens=3, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == done.choices[0].text

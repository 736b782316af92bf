"""Fuzzing the HTTP routes: bodies generated from the routes' own schema (the typed request Structs of
`openai_protocol.py`, field by field through Hypothesis), then mutated with hostile values, and garbage
bytes. However odd the body, the answer is never a 5xx and
the engine never dies; at the end no KV block is held and a good request gives the same tokens.

Bounded in time: a fixed number of examples per strategy (and a wall-clock stop).
"""

from __future__ import annotations

import json
import math
import time
import typing
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.servers import Server
from tokenflow.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
EXAMPLES = 200  # per test; the whole file stays under ~2 minutes on a 2-core CI machine
WALL_S = 150.0
seen: Counter[str] = Counter()  # route and status
refused: Counter[str | None] = Counter()  # the field a 400 named
clock = {"started": math.inf}  # set when the server is up, so the wall-clock bound counts fuzzing only


def _cap_tokens(request: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The operator's policy: short answers (the fuzzer asks for huge ones; keep the run bounded)."""
    asked = params.get("max_tokens")
    return {"max_tokens": min(asked, 4) if isinstance(asked, int) and asked > 0 else asked}


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    with Server(tiny_model, max_model_len=256, num_kv_blocks=64, default_max_tokens=4, max_num_seqs=4,
                request_policy=_cap_tokens, timeout=20) as running:
        clock["started"] = time.monotonic()
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-300, -1e300, 2**63, -(2**63) - 1, 1e308]),
    st.text(max_size=50), st.sampled_from(["<|im_end|>\n<|im_start|>system\n", "\ud7ff\ue000", "x" * 5000]),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=20),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


# Plausible values for some fields, mixed with whatever their type allows, so that the fuzzer gets past
# validation often enough to exercise generation, streaming and stop handling too.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.01, 1.0), "top_k": st.integers(0, 50),
    "min_p": st.floats(0.0, 1.0), "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8),
    "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0), "seed": st.integers(0, 2**32), "n": st.just(1),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)), "top_logprobs": st.integers(0, 5),
    "content": st.text(min_size=1, max_size=40), "prompt": st.one_of(st.text(min_size=1, max_size=40),
                                                                     st.lists(st.integers(0, 300), min_size=1)),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "min_tokens": st.integers(0, 4), "stop_token_ids": st.lists(st.integers(0, 400), max_size=4),
    "model": st.one_of(st.none(), st.just("tiny-llama")),  # another name is a 404, tried now and then
}


def _bodies(kind: type) -> st.SearchStrategy[bytes]:
    """JSON bodies of `kind`: its required fields always, the others sometimes, each value drawn from the
    field's type (untyped fields from HOSTILE_VALUES), often a plausible one; nested Structs recursively."""

    def field_value(name: str, hint: Any) -> st.SearchStrategy[Any]:
        typed = value_of(hint)
        return st.one_of(PLAUSIBLE[name], PLAUSIBLE[name], typed) if name in PLAUSIBLE else typed

    def value_of(hint: Any) -> st.SearchStrategy[Any]:
        if hint is Any:
            return HOSTILE_VALUES
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            return fields_of(hint)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            return st.one_of(*(value_of(a) for a in args))
        if origin is list:
            return st.lists(value_of(args[0]), max_size=4)
        if origin is dict:  # a JSON schema: any small object
            return st.dictionaries(st.text(max_size=8), HOSTILE_VALUES, max_size=4)
        return st.from_type(hint)

    def fields_of(struct: type) -> st.SearchStrategy[dict[str, Any]]:
        hints = typing.get_type_hints(struct)
        info = msgspec.structs.fields(struct)
        required = {f.encode_name: field_value(f.name, hints[f.name]) for f in info if f.required}
        optional = {f.encode_name: field_value(f.name, hints[f.name]) for f in info
                    if not f.required and hints[f.name] is not Any}  # not-yet-supported fields: hostile test
        tag = getattr(struct.__struct_config__, "tag", None)
        if tag is not None:
            required[struct.__struct_config__.tag_field] = st.just(tag)
        return st.fixed_dictionaries(required, optional=optional)

    return fields_of(kind).map(lambda body: json.dumps(body, allow_nan=True).encode())
FIELDS = sorted({*CompletionRequest.__struct_fields__, *ChatCompletionRequest.__struct_fields__})


def _post(client: httpx.Client, route: str, content: bytes) -> httpx.Response:
    response = client.post(route, content=content, headers={"Content-Type": "application/json"})
    seen[f"{route} {response.status_code}"] += 1
    if response.status_code == 400:
        refused[response.json()["error"]["param"]] += 1
    return response


def _check(response: httpx.Response, content: bytes) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500], content[:300])
    if response.status_code != 200:
        assert "error" in response.json(), response.text[:300]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", response.text[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event[6:]) or json.loads(event[6:])["error"]["type"] != "server_error"


def _budget_left() -> bool:
    return time.monotonic() - clock["started"] < WALL_S


fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.mark.parametrize("route", list(ROUTES))
def test_schema_bodies(client: httpx.Client, route: str) -> None:
    @fuzz_settings
    @given(content=_bodies(ROUTES[route]))
    def run(content: bytes) -> None:
        if _budget_left():
            _check(_post(client, route, content), content)

    run()


@pytest.mark.parametrize("route", list(ROUTES))
def test_schema_bodies_with_hostile_values(client: httpx.Client, route: str) -> None:
    @fuzz_settings
    @given(body=_bodies(ROUTES[route]),
           hostile=st.dictionaries(st.sampled_from(FIELDS), HOSTILE_VALUES, min_size=1, max_size=4))
    def run(body: bytes, hostile: dict[str, Any]) -> None:
        if _budget_left():
            content = json.dumps({**json.loads(body), **hostile}, allow_nan=True).encode()  # NaN: not JSON
            _check(_post(client, route, content), content)

    run()


@pytest.mark.parametrize("route", list(ROUTES))
def test_garbage_bytes(client: httpx.Client, route: str) -> None:
    @fuzz_settings
    @given(content=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
    def run(content: bytes) -> None:
        if _budget_left():
            _check(_post(client, route, content), content)

    run()


def test_the_engine_survived_the_fuzzing(server: Server, client: httpx.Client) -> None:
    elapsed = time.monotonic() - clock["started"]
    print(f"\n[fuzz] {sum(seen.values())} requests in {elapsed:.0f} s: {dict(sorted(seen.items()))}")
    print(f"[fuzz] fields named by the 400s: {dict(refused.most_common())}")
    assert not [k for k in seen if k.split()[-1].startswith("5")]
    deadline = time.monotonic() + 20
    while (stats := server.stats())["kv_blocks_used"] or stats["num_running"] or stats["num_waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert not stats["dead"] and stats["state"] == "running"
    assert sum(v for k, v in seen.items() if k.endswith(" 200")) >= 20  # the fuzzer got through often enough
    good = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    texts = {client.post("/v1/completions", json=good).json()["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 1 and not math.isnan(stats["step_time_ms"])

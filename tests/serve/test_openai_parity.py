"""OpenAI/vLLM surface beyond plain completions, with the official `openai` client against a real server:
logprobs in streamed chunks (the same numbers as the whole response), the tokenizer endpoints (the ids a
request gets), the `developer` role."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anyio
import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.servers import Server
from tokenflow.serve.openai_protocol import ChatMessage, FunctionCall


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    with Server(tiny_model, max_num_seqs=4, dtype="float32") as running:  # fp32 on every host: oracle checks
        yield running


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.openai_client()


def test_streamed_chat_logprobs_match_the_whole_response(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", messages=[{"role": "user", "content": "tell me"}], max_tokens=12,
                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [entry for event in client.chat.completions.create(stream=True, **kwargs)
                if event.choices and event.choices[0].logprobs for entry in event.choices[0].logprobs.content]
    assert len(whole) == len(streamed) == 12
    for a, b in zip(whole, streamed, strict=True):
        assert (a.token, a.bytes) == (b.token, b.bytes) and a.bytes == list(a.token.encode())
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs] and len(a.top_logprobs) == 3


def test_streamed_completion_logprobs(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", prompt="the river", max_tokens=10, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    events = [e.choices[0] for e in client.completions.create(stream=True, **kwargs) if e.choices]
    tokens = [t for e in events if e.logprobs for t in e.logprobs.tokens]
    values = [v for e in events if e.logprobs for v in e.logprobs.token_logprobs]
    offsets = [o for e in events if e.logprobs for o in e.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_tokenize_and_detokenize(server: Server, tiny_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    url = server.url
    done = httpx.post(url + "/tokenize", json={"prompt": "the quick brown fox"}, timeout=30).json()
    assert done["tokens"] == tokenizer("the quick brown fox")["input_ids"] and done["count"] == len(done["tokens"])
    assert done["max_model_len"] > 0
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    back = httpx.post(url + "/detokenize", json={"tokens": done["tokens"]}, timeout=30).json()
    assert back == {"prompt": tokenizer.decode(done["tokens"])}
    bad = [({"tokens": [-1]}, "/detokenize", "tokens"), ({"tokens": "abc"}, "/detokenize", "tokens"),
           ({}, "/tokenize", "prompt"), ({"prompt": "x", "messages": messages}, "/tokenize", "prompt")]
    for body, route, field in bad:
        refused = httpx.post(url + route, json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (body, refused.text)
    unknown = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404


def test_developer_role_is_the_system_prompt(client: openai.OpenAI, server: Server) -> None:
    as_developer = httpx.post(server.url + "/tokenize", json={"messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}, timeout=30).json()
    as_system = httpx.post(server.url + "/tokenize", json={"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}, timeout=30).json()
    assert as_developer["tokens"] == as_system["tokens"]
    done = client.chat.completions.create(model="tiny-llama", max_tokens=3, messages=[
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert done.usage.prompt_tokens == as_developer["count"]


def test_logit_bias_over_http(client: openai.OpenAI, tiny_model) -> None:
    """+100 on one token makes it the greedy choice at every step; out-of-range entries are 400s."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    forced = tokenizer(" music", add_special_tokens=False)["input_ids"][0]
    pushed = client.completions.create(model="tiny-llama", prompt="the river", max_tokens=6, temperature=0,
                                       logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert pushed.choices[0].text == tokenizer.decode([forced] * 6)
    for bias, why in [({"10": 101}, "over 100"), ({str(10**6): 1}, "outside the vocabulary")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, logit_bias=bias)
        assert info.value.body["param"] == "logit_bias", why


async def test_logit_bias_bans_tokens(tiny_model) -> None:
    """-100 on each token of the greedy answer: none of them comes back; the other rows are untouched."""
    from tokenflow import Engine

    async with Engine(tiny_model) as engine:
        base = await engine.generate("the river", max_tokens=8, temperature=0.0, ignore_eos=True)
        banned = await engine.generate("the river", max_tokens=8, temperature=0.0, ignore_eos=True,
                                       logit_bias={t: -100.0 for t in base.token_ids})
        assert not set(banned.token_ids) & set(base.token_ids)
        again = await engine.generate("the river", max_tokens=8, temperature=0.0, ignore_eos=True)
        assert again.token_ids == base.token_ids


def test_n_choices_share_one_prefill(client: openai.OpenAI, server: Server) -> None:
    prompt = "the river and the mountain and the library " * 8
    done = client.completions.create(model="tiny-llama", prompt=prompt, n=3, max_tokens=8, temperature=1.0,
                                     seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2] and len({c.text for c in done.choices}) == 3
    single = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=1.0, seed=7,
                                       extra_body={"ignore_eos": True})
    assert done.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert done.usage.completion_tokens == 24
    assert single.choices[0].text == done.choices[0].text  # sample 0 has the request's own seed
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1]


def test_streamed_choices_equal_the_whole_response(client: openai.OpenAI) -> None:
    """`n` and a batch of prompts, streamed: each choice's deltas (interleaved, tagged by index) join into
    the whole response's choice, with its logprobs; usage counts each prompt once."""
    kwargs = dict(model="tiny-llama", prompt=["the river and the mountain " * 6, "a lantern"], n=2, max_tokens=8,
                  temperature=1.0, seed=3, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finished: dict[int, str] = {}
    usage = None
    for event in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = event.usage or usage
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and finished == dict.fromkeys(range(4), "length")
    for choice in whole.choices:
        assert texts[choice.index] == choice.text and tokens[choice.index] == choice.logprobs.tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 32
    events = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                 n=3, max_tokens=4, temperature=1.0, stream=True))
    roles = [c.index for e in events for c in e.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    assert sorted(c.index for e in events for c in e.choices if c.finish_reason) == [0, 1, 2]


async def test_generate_many_prefills_the_prompt_once(tiny_model) -> None:
    from tokenflow import Engine

    async with Engine(tiny_model, block_size=16) as engine:
        prompt = list(range(10, 171))  # 161 tokens: ten full blocks and one token
        outs = await engine.generate_many(prompt, 4, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
        assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) == 4
        # the first computes all 161; each other one its last token only (the ten blocks come from the cache)
        assert engine.stats()["prompt_tokens_computed"] == 161 + 3 * 1
        assert [o.usage.cached_tokens for o in outs] == [0, 160, 160, 160]
        for i, out in enumerate(outs):  # sample i is the request seeded with seed + i
            alone = await engine.generate(prompt, max_tokens=5, temperature=1.0, seed=1 + i, ignore_eos=True)
            assert alone.token_ids == out.token_ids


async def test_stream_many_equals_generate_many_and_closing_it_ends_every_sample(tiny_model) -> None:
    from tokenflow import Engine

    async with Engine(tiny_model, block_size=16, dtype="float32", debug_leaks=True) as engine:
        prompt = list(range(10, 171))
        outs = await engine.generate_many(prompt, 3, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
        computed = engine.stats()["prompt_tokens_computed"]
        streamed: dict[int, list[int]] = {}
        async for index, chunk in engine.stream_many(prompt, 3, max_tokens=6, temperature=1.0, seed=4,
                                                     ignore_eos=True, cache_salt="fresh"):
            streamed.setdefault(index, []).extend(chunk.token_ids)
        assert [streamed[i] for i in range(3)] == [o.token_ids for o in outs]
        assert engine.stats()["prompt_tokens_computed"] - computed == 161 + 2  # the prompt computed once
        stream = engine.stream_many(prompt, 4, max_tokens=500, ignore_eos=True, cache_salt="closed")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 8:
                break
        await stream.aclose()
        for _ in range(100):
            if engine.stats()["num_running"] == 0:
                break
            await anyio.sleep(0.05)
        stats = engine.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_aborted"] == 4


def test_a_batch_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["the river", "music and winter", "a lantern"]
    done = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert done.choices[i].index == i and done.choices[i].text == alone.choices[0].text
    ids = client.completions.create(model="tiny-llama", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2,
                                    temperature=1.0)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]


def _oracle_prompt_logprobs(tiny_model, ids: list[int]) -> list[float]:
    """Each prompt token's log-probability after the ones before it, from transformers in fp32."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]


def test_echo_logprobs_equal_the_oracle(client: openai.OpenAI, tiny_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = "the river flows past the old mill and into the sea"
    ids = tokenizer(prompt)["input_ids"]
    expected = _oracle_prompt_logprobs(tiny_model, ids)
    done = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                     echo=True, extra_body={"ignore_eos": True}).choices[0]
    plain = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert done.text == prompt + plain.text
    lp = done.logprobs
    assert lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.tokens[len(ids):] == plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the top 2, and the prompt token if not in them
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(prompt)
    # a batch of token-id prompts, as lm-evaluation-harness sends for log-likelihoods
    other = tokenizer("a cat sat on the mat")["input_ids"]
    batch = client.completions.create(model="tiny-llama", prompt=[ids, other], max_tokens=1, temperature=0,
                                      logprobs=1, echo=True).choices
    assert [c.index for c in batch] == [0, 1]
    assert batch[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert batch[1].logprobs.token_logprobs[1:len(other)] == pytest.approx(
        _oracle_prompt_logprobs(tiny_model, other), abs=1e-4)
    assert batch[1].text.startswith(tokenizer.decode(other))
    echoed = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, echo=True)  # no logprobs
    assert echoed.choices[0].text.startswith(prompt) and echoed.choices[0].logprobs is None


def test_streamed_echo(client: openai.OpenAI, tiny_model) -> None:
    prompt = "the river flows past the old mill"
    kwargs = dict(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    events = [e.choices[0] for e in client.completions.create(stream=True, **kwargs) if e.choices]
    assert events[0].text == prompt and "".join(e.text for e in events) == whole.text
    tokens = [t for e in events if e.logprobs for t in e.logprobs.tokens]
    values = [v for e in events if e.logprobs for v in e.logprobs.token_logprobs]
    offsets = [o for e in events if e.logprobs for o in e.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)


def test_a_chat_that_echoes_each_response_message_back(client: openai.OpenAI, server: Server) -> None:
    """openai-python's multi-turn pattern, `messages.append(resp.choices[0].message.model_dump())`: the echoed
    `refusal`, `annotations`, `audio` and `function_call` (all null) are accepted and the prompt is the one the
    plain assistant text gives."""
    messages: list[dict] = [{"role": "user", "content": "hello"}]
    for turn in range(3):
        done = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=5, temperature=0,
                                              store=False, metadata={"turn": str(turn)})
        echoed = done.choices[0].message.model_dump()
        assert {"refusal", "annotations", "audio", "function_call"} <= set(echoed)
        messages += [echoed, {"role": "user", "content": f"and {turn}?"}]
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        tokens = httpx.post(server.url + "/tokenize", json={"messages": plain}, timeout=30).json()
        follow = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=1)
        assert follow.usage.prompt_tokens == tokens["count"], turn


def test_a_tool_loop_with_echoed_messages(client: openai.OpenAI, server: Server) -> None:
    """A forced call, its message echoed back with `model_dump()`, the tool's result, then the answer."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    messages: list[dict] = [{"role": "user", "content": "weather in Paris?"}]
    call = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, tool_choice="required",
                                          max_tokens=60, temperature=0)
    message = call.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    messages += [message.model_dump(), {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    answer = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # the deprecated single `function_call` of an echoed message is read as its tool call
    legacy = ChatMessage(role="assistant", function_call=FunctionCall(name="get_weather", arguments='{"city": "x"}'))
    assert legacy.to_dict()["tool_calls"] == [
        {"id": None, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]


@pytest.mark.parametrize(("body", "field"), [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"temperature": 7}, "temperature"),
    ({"messages": [{"role": "assistant", "content": "x", "unknown_field": 1}]}, "messages"),
])
def test_openai_validation_cases_are_400s_naming_the_field(server: Server, body: dict, field: str) -> None:
    sent = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=sent, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field or field in error["message"], error
    if field == "logit_bias":
        assert "'abc'" in error["message"]


def test_prompt_logprobs_over_http_equal_the_python_api_and_transformers(server: Server, tiny_model) -> None:
    """vLLM's `prompt_logprobs` on a 100-token prompt: completions per choice, chat at the top; each prompt token's
    logprob is transformers' fp32 log-softmax, and the alternatives are the Python API's."""
    prompt = list(range(5, 105))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        oracle = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == 100
    for i, entry in enumerate(got[1:], start=1):
        mine = entry[str(prompt[i])]["logprob"]
        assert mine == pytest.approx(oracle[i - 1, prompt[i]].item(), abs=1e-4)
        assert 2 <= len(entry) <= 3  # the token itself and the two best
        best = oracle[i - 1].topk(2).indices.tolist()
        assert set(map(str, best)) <= set(entry)

    async def python_api() -> list:
        from tokenflow import Engine

        async with Engine(tiny_model, dtype="float32") as engine:
            return (await engine.generate(prompt, max_tokens=1, prompt_logprobs=2)).prompt_logprobs

    ours = anyio.run(python_api)
    for entry, from_python in zip(got[1:], ours[1:]):
        assert {int(k): v["logprob"] for k, v in entry.items()} == pytest.approx(from_python, abs=1e-5)
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1,
        "prompt_logprobs": 0}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    refused = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_completion_logprobs_zero_gives_the_sampled_token(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny-llama", prompt="the river", max_tokens=5, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[token] for token in lp.tokens]
    assert [next(iter(top.values())) for top in lp.top_logprobs] == lp.token_logprobs


def test_continue_final_message_continues_the_assistant_text(server: Server, client: openai.OpenAI) -> None:
    """vLLM's `continue_final_message`: the prompt is the template's up to the partial assistant text, left
    open, and the reply's tokens follow it; `echo` repeats that text first (whole and streamed); the
    template options are on /tokenize too, and contradictory ones are 400s."""
    messages = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "My answer is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, **options}, timeout=30).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()["prompt"]
    assert text.endswith("My answer is")  # not closed: no end-of-turn after the partial answer
    opened = httpx.post(server.url + "/tokenize", json={"messages": messages[:1]}, timeout=30).json()["tokens"]
    assert tokens["tokens"][:len(opened)] == opened  # the same turns before it
    done = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={**options, "ignore_eos": True, "echo": True})
    assert done.usage.prompt_tokens == tokens["count"]
    whole = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": tokens["tokens"],
                                                             "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                       timeout=30).json()["choices"][0]["text"]
    assert done.choices[0].message.content == "My answer is" + whole
    streamed = "".join(e.choices[0].delta.content or "" for e in client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=6, temperature=0, stream=True,
        extra_body={**options, "ignore_eos": True, "echo": True}) if e.choices)
    assert streamed == done.choices[0].message.content
    for bad, field in [({"continue_final_message": True}, "continue_final_message"),
                       ({**options, "messages": messages[:1]}, "messages")]:
        response = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny-llama", "messages": messages, "max_tokens": 2, **bad}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_strict_schemas_close_every_object(client: openai.OpenAI) -> None:
    """OpenAI's `strict: true` on a pydantic model's schema (which says nothing of extra keys) and on a function:
    16 samples at temperature 1 each validate with every object closed and every key present."""
    import jsonschema
    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: str = Field(max_length=6)
        code: int = Field(ge=0, le=99)
        tags: list[bool] = Field(max_length=2)

    schema = Place.model_json_schema()
    assert "additionalProperties" not in schema
    closed = {**schema, "additionalProperties": False, "required": ["city", "code", "tags"]}
    done = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "a place"}], n=16, temperature=1.0, max_tokens=80,
        seed=3, response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema,
                                                                         "strict": True}})
    for choice in done.choices:
        jsonschema.validate(json.loads(choice.message.content), closed)
    tools = [{"type": "function", "function": {"name": "find", "strict": True, "parameters": schema}}]
    calls = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "find"}], n=16,
                                           temperature=1.0, max_tokens=80, seed=4, tools=tools, tool_choice="required")
    for choice in calls.choices:
        assert choice.finish_reason == "tool_calls", choice
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), closed)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "open", "strict": True,
                                           "schema": {"type": "object", "additionalProperties": True}}})


def test_a_required_call_cut_short_reports_its_partial_arguments(client: openai.OpenAI) -> None:
    """max_tokens ends a forced call mid-arguments: finish_reason "length", the call's name and the arguments as
    far as they got (never dropped); cut before its name is whole, the text as far as it got."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 40}}, "required": ["query"]}}}]
    early = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "look it up"}],
                                           tools=tools, tool_choice="required", max_tokens=6, temperature=0)
    assert early.choices[0].finish_reason == "length"  # cut inside the name: the text as far as it got
    assert early.choices[0].message.content.startswith('{"') and not early.choices[0].message.tool_calls
    done = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "look it up"}],
                                          tools=tools, tool_choice="required", max_tokens=40, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "length"
    call = choice.message.tool_calls[0].function
    assert call.name == "lookup" and call.arguments.startswith("{") and not call.arguments.endswith("}")
    whole = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "look it up"}],
                                           tools=tools, tool_choice="required", max_tokens=200, temperature=0)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.tool_calls[0].function.arguments.startswith(call.arguments.rstrip())

"""OpenAI's Responses API through the official client: text, instructions, a strict JSON schema, a function tool
and its result, `previous_response_id`, and `.stream` events that add up to the whole response."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.servers import Server


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    with Server(tiny_model, max_num_seqs=4, dtype="float32") as running:
        yield running


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.openai_client()


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "sunny": {"type": "boolean"}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}}]


def test_text_and_instructions_equal_the_chat_route(client: openai.OpenAI) -> None:
    done = client.responses.create(model="tiny-llama", instructions="be brief", input="hello there",
                                   max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model="tiny-llama", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert done.output_text == chat.choices[0].message.content
    assert done.usage.input_tokens == chat.usage.prompt_tokens and done.usage.output_tokens <= 6
    assert done.id.startswith("resp_") and done.status in ("completed", "incomplete")
    if chat.choices[0].finish_reason == "length":
        assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"


def test_a_strict_json_schema_and_a_function_tool_loop(client: openai.OpenAI) -> None:
    closed = {**SCHEMA, "additionalProperties": False, "required": ["city", "sunny"]}
    for seed in range(4):
        shaped = client.responses.create(model="tiny-llama", input="the weather?", temperature=1.0,
                                         max_output_tokens=60, extra_body={"seed": seed}, text={"format": {
                                             "type": "json_schema", "name": "weather", "schema": SCHEMA,
                                             "strict": True}})
        jsonschema.validate(json.loads(shaped.output_text), closed)
    called = client.responses.create(model="tiny-llama", input="weather in Paris?", tools=TOOLS,
                                     tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), {**TOOLS[0]["parameters"], "additionalProperties": False,
                                                        "required": ["city"]})
    answered = client.responses.create(model="tiny-llama", previous_response_id=called.id, tools=TOOLS,
                                       max_output_tokens=5, temperature=0, input=[
                                           {"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "sunny"}])
    assert answered.previous_response_id == called.id and answered.usage.input_tokens > called.usage.input_tokens
    # the same conversation sent whole, without the stored response: the same prompt
    whole = client.responses.create(model="tiny-llama", tools=TOOLS, max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert whole.usage.input_tokens == answered.usage.input_tokens and whole.output_text == answered.output_text


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", input="tell me", max_output_tokens=10, temperature=0,
                  text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text and len(deltas) > 1
    with client.responses.stream(model="tiny-llama", input="weather?", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=60, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and final.output[0].type == "function_call"


def test_responses_validation(server: Server) -> None:
    for body, field in [({"input": "x", "unknown": 1}, "unknown"), ({"input": "x", "temperature": 3}, "temperature"),
                        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
                        ({"input": [{"type": "message", "role": "assistant", "content": "x"}]}, "input"),
                        ({"input": "x", "tool_choice": "required"}, "tool_choice")]:
        response = httpx.post(server.url + "/v1/responses", json={"model": "tiny-llama", **body}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field or field in error["message"], error
    other = httpx.post(server.url + "/v1/responses", json={"model": "other", "input": "x"}, timeout=30)
    assert other.status_code == 404

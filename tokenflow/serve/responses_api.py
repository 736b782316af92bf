"""OpenAI's Responses API (`POST /v1/responses`), as the official client's `responses.create` / `.stream` call it:
text or item input, `instructions`, `text.format` (a JSON schema, strict or not), function tools and their
results, `previous_response_id` and streamed events.

A response is a chat turn underneath: instructions, the earlier turns and the input become chat messages
(`function_call` items an assistant's tool calls, `function_call_output` items tool messages) and run through
`Engine.chat`. Responses are kept for `previous_response_id` in memory, the newest `RESPONSES_KEPT` of them
(`store: false` keeps none): a restarted server has forgotten them, as it says in a 404.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenflow.errors import InvalidRequest
from tokenflow.params import Completion
from tokenflow.serve.openai_protocol import ToolFunction, ToolSpec, check_temperature, decode_as
from tokenflow.structured.strict import strict_schema
from tokenflow.structured.tools import content_besides_calls, template_arguments

__all__ = ("RESPONSES_KEPT", "ResponsesRequest", "StoredResponses", "responses")

RESPONSES_KEPT = 1024  # responses remembered for `previous_response_id` (the oldest forgotten first)


class InputText(msgspec.Struct, tag="input_text", tag_field="type", forbid_unknown_fields=True, frozen=True):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", forbid_unknown_fields=True, frozen=True):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(msgspec.Struct, tag="message", tag_field="type", forbid_unknown_fields=True, frozen=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", forbid_unknown_fields=True,
                       frozen=True):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type",
                             forbid_unknown_fields=True, frozen=True):
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, tag="function", tag_field="type", forbid_unknown_fields=True, frozen=True):
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, tag="function", tag_field="type", forbid_unknown_fields=True, frozen=True):
    name: str


class TextFormatText(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class TextFormatJsonObject(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True,
                           frozen=True):
    pass


class TextFormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True,
                           frozen=True):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    format: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The body; fields OpenAI documents that change nothing here (`store` aside) are accepted."""

    model: str | None = None
    input: str | list[Any]  # items are typed by `input_items` (a message may leave its `type` out)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old turns) is not offered
    seed: int | None = None  # vLLM-style extra


class StoredResponses:
    """The newest responses' conversations (messages, then the response's own turn), for `previous_response_id`."""

    def __init__(self, size: int = RESPONSES_KEPT) -> None:
        self.size = size
        self._kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        found = self._kept.get(response_id)
        if found is None:
            raise InvalidRequest(f"no stored response {response_id!r} (this server keeps the newest {self.size}, "
                                 "in memory)", field="previous_response_id")
        self._kept.move_to_end(response_id)
        return found

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._kept[response_id] = messages
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


def input_items(given: str | list[Any]) -> list[InputItem]:
    """The body's input as typed items: a text is one user message; a message item may omit its `type`."""
    if isinstance(given, str):
        return [MessageItem(role="user", content=given)]
    items = []
    for i, raw in enumerate(given):
        if isinstance(raw, dict) and "type" not in raw and "role" in raw:
            raw = {**raw, "type": "message"}
        try:
            items.append(msgspec.convert(raw, type=InputItem))  # type: ignore[arg-type]
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"input[{i}]: {exc}", field="input") from None
    return items


def _messages(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of the request: instructions, the stored earlier turns, then its input."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += [m for m in earlier if m["role"] != "system"]  # a response's instructions are not carried over
    items = input_items(body.input)
    for item in items:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = _template_call(item.call_id, item.name, item.arguments)
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages or (messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")):
        raise InvalidRequest("the input must end with a user message or a function call's output", field="input")
    return messages


def _template_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A function call as an assistant message's `tool_calls` entry (what chat templates read)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": template_arguments(arguments)}}


def _kwargs(body: ResponsesRequest) -> dict[str, Any]:
    """The Engine keywords of the body."""
    kwargs: dict[str, Any] = {}
    if body.temperature is not None:
        kwargs["temperature"] = check_temperature(body.temperature)
    for name in ("top_p", "seed"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        kwargs["max_tokens"] = body.max_output_tokens
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        kwargs["json_schema"] = strict_schema(fmt.schema, field="text") if fmt.strict else fmt.schema
    elif isinstance(fmt, TextFormatJsonObject):
        kwargs["json_object"] = True
    if body.tools:
        kwargs["tools"] = [ToolSpec(ToolFunction(t.name, t.description, t.parameters or {}, t.strict)).to_dict()
                           for t in body.tools]
        choice = body.tool_choice
        if isinstance(choice, NamedFunction):
            kwargs["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            kwargs["tool_choice"] = choice
    elif body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice needs tools", field="tool_choice")
    return kwargs


def _output(done: Completion) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The response's output items and its turn as a chat message (for the next `previous_response_id`)."""
    items: list[dict[str, Any]] = []
    if done.tool_calls:
        content = content_besides_calls(done.text)
        if content:
            items.append(_message_item(content))
        calls = [_template_call(c.id, c.name, c.arguments) for c in done.tool_calls]
        items += [{"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id,
                   "name": c.name, "arguments": c.arguments, "status": "completed"} for c in done.tool_calls]
        return items, {"role": "assistant", "content": content or "", "tool_calls": calls}
    return [_message_item(done.text)], {"role": "assistant", "content": done.text}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _response(body: ResponsesRequest, rid: str, model: str, output: list[dict[str, Any]], done: Completion | None,
              created: int) -> dict[str, Any]:
    """The response object (`status` in_progress until `done`)."""
    incomplete = done is not None and done.finish_reason == "length" and not done.tool_calls
    usage = None
    if done is not None:
        usage = {"input_tokens": done.usage.prompt_tokens, "output_tokens": done.usage.completion_tokens,
                 "total_tokens": done.usage.total_tokens,
                 "input_tokens_details": {"cached_tokens": done.usage.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    fmt = body.text.format if body.text is not None and body.text.format is not None else TextFormatText()
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": "in_progress" if done is None else "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "text": {"format": {"type": "text"} if isinstance(fmt, TextFormatText) else msgspec.to_builtins(fmt)},
        "tool_choice": msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else "auto",
        "tools": [{**msgspec.to_builtins(t), "type": "function"} for t in body.tools or ()],
        "truncation": "disabled", "usage": usage, "user": body.user,
    }


async def responses(request: Request, settings: Any) -> Response:
    """`POST /v1/responses`: the whole response, or its events with `stream: true`."""
    from tokenflow.serve.openai_app import (
        _apply_policy,
        _EventStream,
        _read_body,
        _served_as,
        _sse,
        _unknown_model,
        _unless_disconnected,
    )

    engine = request.app.state.engine
    body = decode_as(await _read_body(request, settings.max_request_bytes), ResponsesRequest)
    if (unknown := _unknown_model(body.model, engine)) is not None:
        return unknown
    store: StoredResponses = request.app.state.responses
    earlier = store.get(body.previous_response_id) if body.previous_response_id else []
    messages = _messages(body, earlier)
    model, kwargs = _served_as(body, engine, await _apply_policy(request, _kwargs(body), settings))
    rid, created = "resp_" + secrets.token_hex(16), int(time.time())

    def finish(done: Completion) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        output, turn = _output(done)
        if body.store:
            store.put(rid, [*messages, turn])
        return output, _response(body, rid, model, output, done, created)

    if not body.stream:
        done = await _unless_disconnected(request, lambda: engine.chat(messages, **kwargs))
        if not isinstance(done, Completion):
            return Response(status_code=499)
        return JSONResponse(finish(done)[1])


    async def events() -> Any:
        number = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal number
            number += 1
            return _sse({"type": kind, "sequence_number": number - 1, **fields})

        yield event("response.created", response=_response(body, rid, model, [], None, created))
        yield event("response.in_progress", response=_response(body, rid, model, [], None, created))
        item = _message_item("", status="in_progress")
        item["content"] = []
        text_streamed = not body.tools  # with tools the output may be calls, known at its end: sent whole then
        if text_streamed:
            yield event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0, part=part)
            text, finish_reason, usage = "", None, None
            async for chunk in engine.stream_chat(messages, **kwargs):
                if chunk.text:
                    text += chunk.text
                    yield event("response.output_text.delta", item_id=item["id"], output_index=0, content_index=0,
                                delta=chunk.text, logprobs=[])
                finish_reason, usage = chunk.finish_reason or finish_reason, chunk.usage or usage
            assert finish_reason is not None and usage is not None
            done = Completion(request_id=rid, text=text, token_ids=[], finish_reason=finish_reason, usage=usage)
        else:
            done = await engine.chat(messages, **kwargs)
        output, final = finish(done)
        for index, out in enumerate(output):
            if text_streamed and out["type"] == "message":
                out["id"] = item["id"]
                part = out["content"][0]
                yield event("response.output_text.done", item_id=item["id"], output_index=0, content_index=0,
                            text=part["text"], logprobs=[])
                yield event("response.content_part.done", item_id=item["id"], output_index=0, content_index=0,
                            part=part)
            else:
                yield event("response.output_item.added", output_index=index, item={**out, "status": "in_progress"})
                if out["type"] == "function_call":
                    yield event("response.function_call_arguments.delta", item_id=out["id"], output_index=index,
                                delta=out["arguments"])
                    yield event("response.function_call_arguments.done", item_id=out["id"], output_index=index,
                                arguments=out["arguments"], name=out["name"])
            yield event("response.output_item.done", output_index=index, item=out)
        final["output"] = output
        yield event("response.completed", response=final)

    return _EventStream(events())

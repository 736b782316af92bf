"""The OpenAI request bodies as typed msgspec Structs, and their mapping to Engine keywords.

Decoding a body with these types is the first check of untrusted input: a
wrong type, an unknown field, invalid UTF-8, a number out of range or
nesting too deep is a `InvalidRequest` (HTTP 400) naming the field, before
anything else runs. Fields of the OpenAI API that tokenflow does not
implement yet are refused by name instead of being dropped.
Value ranges (temperature, penalties, ...) are checked by the engine itself.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from tokenflow.errors import InvalidRequest
from tokenflow.structured.strict import strict_schema
from tokenflow.structured.tools import template_arguments

__all__ = ("ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest", "decode_as",
           "decode_body", "engine_kwargs", "prompts_of", "to_engine_kwargs")

Role = Literal["system", "developer", "user", "assistant", "tool"]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True, frozen=True):
    text: str


class RefusalPart(msgspec.Struct, tag="refusal", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """An assistant content part a client echoes back: the model's refusal, not shown to it again."""

    refusal: str


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"

    def to_dict(self) -> dict[str, Any]:
        """Chat templates iterate the arguments as a mapping: parsed when they are a JSON object."""
        arguments = template_arguments(self.function.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A message as OpenAI's clients send it, including every field of an assistant message they echo back
    (`resp.choices[0].message.model_dump()`): `refusal`, `annotations` and `audio` are accepted and not shown to
    the model again (no chat template has a place for them); a legacy `function_call` is its tool call."""

    role: Role
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    function_call: FunctionCall | None = None  # the deprecated single call: read as `tool_calls`
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        parts = () if isinstance(self.content, str) else self.content or ()
        content = self.content if isinstance(self.content, str) else "".join(
            p.text for p in parts if isinstance(p, TextPart))
        # OpenAI's `developer` role is the system prompt of newer models; chat templates know `system`
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        calls = self.tool_calls or ([MessageToolCall(self.function_call)] if self.function_call else None)
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
        return message


class ToolFunction(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # OpenAI's strict rules on its parameters (every object closed, every key required)


class ToolSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    function: ToolFunction
    type: Literal["function"] = "function"

    def to_dict(self) -> dict[str, Any]:
        """The tool as chat templates and the engine take it; with `strict`, its parameters under OpenAI's strict
        rules (`tokenflow.structured.strict`)."""
        function = {k: v for k, v in msgspec.structs.asdict(self.function).items() if v is not None and k != "strict"}
        if self.function.strict and self.function.parameters is not None:
            function["parameters"] = strict_schema(self.function.parameters, field="tools")
        return {"type": "function", "function": function}


class ChosenFunction(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    function: ChosenFunction
    type: Literal["function"] = "function"


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class JsonSchemaSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    schema: dict[str, Any] = {}  # OpenAI: absent means any JSON
    description: str | None = None
    strict: bool | None = None  # OpenAI's strict rules (every object closed, every key required)


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True, frozen=True):
    json_schema: JsonSchemaSpec


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's `structured_outputs` extra: one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _CommonRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Fields both routes take: OpenAI's, then vLLM-style extras (sent through a client's `extra_body`)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility; not used
    store: bool | None = None  # OpenAI's stored completions: accepted, nothing is stored
    metadata: dict[str, str] | None = None  # accepted with `store`; not used
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    priority: int | None = None  # only when the server trusts clients with it (see HTTPSettings)
    cache_salt: str | None = None  # likewise
    # OpenAI fields not implemented yet: refused by name when present (never silently dropped).
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, as text) -> bias in [-100, 100]
    functions: Any = None
    function_call: Any = None
    best_of: Any = None


class ChatCompletionRequest(_CommonRequest, kw_only=True, forbid_unknown_fields=True, frozen=True):
    messages: list[ChatMessage]
    # vLLM's template options: continue the last (assistant) message instead of opening a new turn; with `echo`,
    # the reply repeats that message's text before its own
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: "auto" returns every call the model writes
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_CommonRequest, kw_only=True, forbid_unknown_fields=True, frozen=True):
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    echo: bool = False  # the prompt's text (and with `logprobs`, its tokens' logprobs) before the completion
    suffix: Any = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """vLLM's `POST /tokenize`: a prompt, or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolSpec] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """OpenAI's `POST /v1/embeddings` (`dimensions` only as the model's own size; `user` accepted and unused),
    plus vLLM's `normalize` and tokenflow's `pooling`."""

    model: str | None = None
    input: str | list[Any]  # texts or token-id lists: `Engine.embed` checks each item
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    pooling: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    model: str | None = None
    tokens: list[int]


_UNSUPPORTED = ("functions", "function_call", "best_of", "suffix")
# Body fields that become the Engine keyword of the same name when present.
PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "ignore_eos", "priority", "cache_salt", "min_tokens", "stop_token_ids",
               "include_stop_str_in_output", "skip_special_tokens")
MAX_TEMPERATURE = 2.0  # OpenAI's bound (the Python API takes any temperature >= 0, as vLLM does)


def decode_body(raw: bytes | dict[str, Any], chat: bool) -> ChatCompletionRequest | CompletionRequest:
    """The typed body (from JSON bytes, or an already decoded dict); `InvalidRequest` naming the field
    for anything malformed."""
    body = decode_as(raw, ChatCompletionRequest if chat else CompletionRequest)
    for name in _UNSUPPORTED:
        value = getattr(body, name, None)
        if value is not None and value is not False and not (name == "best_of" and value == 1):
            raise InvalidRequest(f"`{name}` is not supported by this server yet", field=name)
    if not 1 <= body.n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}]", field="n")
    return body


BodyT = TypeVar("BodyT")
MAX_N = 16  # choices per prompt (the engine's own max_n bounds it too)
MAX_PROMPTS = 64  # prompts in one /v1/completions batch


def decode_as(raw: bytes | dict[str, Any], kind: type[BodyT]) -> BodyT:
    """`raw` decoded as the body type `kind`; `InvalidRequest` naming the field for anything malformed."""
    try:
        if isinstance(raw, dict):  # one path for both: the same checks and messages
            raw = msgspec.json.encode(raw)
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}", field=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
    except (TypeError, msgspec.EncodeError) as exc:  # a dict holding something JSON has no form for
        raise InvalidRequest(f"the request body is not JSON: {exc}") from None
    return body


def prompts_of(body: ChatCompletionRequest | CompletionRequest) -> list[Any]:
    """The body's prompts in choice order: its messages, one prompt, or each prompt of a completions batch
    (a list of strings or of token-id lists)."""
    if isinstance(body, ChatCompletionRequest):
        return [[m.to_dict() for m in body.messages]]
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]
    if not all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest("`prompt` must be a string, a list of token ids, or a list of either", field="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", field="prompt")
    return list(prompt)


def to_engine_kwargs(body: ChatCompletionRequest | CompletionRequest) -> tuple[Any, dict[str, Any]]:
    """`(prompt or messages, Engine keyword arguments)` of a decoded body with one prompt (see `prompts_of`
    for batches; several choices, `n` > 1, are the caller's to fan out)."""
    if body.n != 1:
        raise InvalidRequest("n > 1 is not supported by this route", field="n")
    prompts = prompts_of(body)
    if len(prompts) != 1:
        raise InvalidRequest("a batch of prompts is not supported here", field="prompt")
    return prompts[0], engine_kwargs(body)


def engine_kwargs(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The Engine keyword arguments of a decoded body, shared by each of its prompts and choices."""
    kwargs: dict[str, Any] = {k: getattr(body, k) for k in PASSTHROUGH if getattr(body, k) is not None}
    if body.temperature is not None:
        check_temperature(body.temperature)
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("`stream_options` is only for streaming requests (stream: true)", field="stream_options")
    if body.logit_bias is not None:
        kwargs["logit_bias"] = _logit_bias(body.logit_bias)
    if isinstance(body, ChatCompletionRequest):
        if not body.messages:
            raise InvalidRequest("`messages` must be a non-empty list of message objects", field="messages")
        kwargs["add_generation_prompt"] = body.add_generation_prompt
        kwargs["continue_final_message"] = body.continue_final_message
        if body.tools is not None:
            kwargs["tools"] = [t.to_dict() for t in body.tools]
        if body.tool_choice is not None:
            choice = body.tool_choice
            kwargs["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice.function.name}}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.logprobs:
            kwargs["logprobs"] = body.top_logprobs or 0
    else:
        max_tokens = body.max_tokens
        if body.logprobs is not None:
            kwargs["logprobs"] = body.logprobs
            if body.echo:
                kwargs["prompt_logprobs"] = body.logprobs
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequest("`prompt_logprobs` comes with a whole response (stream: false)", field="prompt_logprobs")
    if body.prompt_logprobs is not None:  # vLLM's field; over echo's own (the same scores, more alternatives)
        kwargs["prompt_logprobs"] = max(body.prompt_logprobs, kwargs.get("prompt_logprobs") or 0)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    kwargs.update(_constraint(body))
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    return kwargs


def check_temperature(value: float) -> float:
    """`value`, refused (naming `temperature`) past OpenAI's bound."""
    if not 0 <= value <= MAX_TEMPERATURE:
        raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value}", field="temperature")
    return value


def _logit_bias(given: dict[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON keys) with integer keys; `InvalidRequest` naming a key that is
    not one."""
    found: dict[int, float] = {}
    for key, bias in given.items():
        try:
            found[int(key)] = bias
        except ValueError:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id (an integer)", field="logit_bias") from None
    return found


def _constraint(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """Engine keywords of the body's output constraint: `response_format` or vLLM's `structured_outputs`."""
    found: dict[str, Any] = {}
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        found["json_object"] = True
    elif isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema or {"type": "object"}
        found["json_schema"] = strict_schema(schema) if fmt.json_schema.strict else schema
    extra = body.structured_outputs
    if extra is not None:
        named = {"json_schema": extra.json, "regex": extra.regex, "choice": extra.choice, "grammar": extra.grammar,
                 "json_object": extra.json_object or None}
        given = {k: v for k, v in named.items() if v is not None}
        if found and given:
            raise InvalidRequest("give either `response_format` or `structured_outputs`, not both",
                                 field="structured_outputs")
        found = given
    return found


def _field_of(text: str) -> str | None:
    """`... - at `$.messages[0].role`` -> "messages"; `unknown field `x`` -> "x"."""
    for marker in ("at `$.", "in `$.", "unknown field `", "required field `"):
        if marker in text:
            return text.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0] or None
    return None

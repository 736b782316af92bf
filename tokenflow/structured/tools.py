"""Tool calling: a request's tools and tool choice as an output constraint, and tool calls read back from
the generated text.

`tool_choice` follows OpenAI: "none" (tools are not shown, no call), "auto" (tools go to the chat
template; a call is whatever the model writes in the Hermes/Qwen form `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`), "required" (the output is constrained to one call of any tool) or
`{"type": "function", "function": {"name": N}}` (the output is constrained to N's parameters).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from tokenflow.errors import InvalidRequest
from tokenflow.params import ToolCall

__all__ = ("ToolCallStream", "check_tools", "content_besides_calls", "parse_tool_calls", "tool_schema")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function-name rule


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
    """The tools as plain dicts and the normalised choice; `InvalidRequest` naming `tools` or
    `tool_choice` for anything malformed."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise InvalidRequest("`tools` must be a non-empty list of function tools", field="tools")
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest('each tool must be {"type": "function", "function": {...}}', field="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest("a tool's name must be 1-64 letters, digits, '_', '.' or '-'", field="tools")
        if name in names:
            raise InvalidRequest(f"two tools are named {name!r}", field="tools")
        names.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"the parameters of {name!r} must be a JSON schema object", field="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or a named function',
                                 field="tool_choice")
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not one of the tools", field="tool_choice")
    return [dict(t) for t in tools], choice


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def tool_schema(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema the output must match: the named tool's parameters, or for "required" one
    `{"name", "arguments"}` object of any tool; None when the output is free."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return next(_parameters(t) for t in tools if t["function"]["name"] == name)
    if choice != "required":
        return None
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "arguments": _parameters(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def template_arguments(text: str) -> Any:
    """A call's arguments as chat templates iterate them: parsed when they are a JSON object, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{secrets.token_hex(12)}", name=name, arguments=text)


def parse_tool_calls(text: str, tools: list[dict[str, Any]], choice: str | dict[str, Any]
                     ) -> tuple[str | None, list[ToolCall]]:
    """(the remaining content, the tool calls) of a generated text."""
    if isinstance(choice, dict):  # constrained to the parameters: the whole text is the arguments
        return None, [_call(choice["function"]["name"], text)]
    if choice == "required":
        try:
            call = json.loads(text)
            return None, [_call(call["name"], call["arguments"])]
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: the call as far as it got
            partial = _PARTIAL_CALL.match(text)
            if partial is None:
                return text, []
            return None, [_call(partial.group(1), partial.group(2))]
    if choice == "none":
        return text, []
    names = {t["function"]["name"] for t in tools}
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict):
            calls.append(_call(call["name"], call.get("arguments", {})))
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


# the start of a "required" call cut short: its name, then its arguments' text as far as they got (the grammar
# writes the name before the arguments, so a call with arguments started has its name whole)
_PARTIAL_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\Z', re.S)


def content_besides_calls(text: str) -> str | None:
    """The text of a reply that made tool calls, without them: None when the text was only calls (a
    named or required call is nothing but its JSON)."""
    if "<tool_call>" not in text:
        return None
    return _CALL.sub("", text).strip() or None


class ToolCallStream:
    """A streamed reply's text deltas as OpenAI's streaming deltas: `{"content": ...}` and `{"tool_calls":
    [...]}`. A named call streams its arguments as they are written; a required call is sent whole when
    the reply ends; with "auto", content streams until a `<tool_call>` opens (text that may start the tag
    is held back), and each call is sent whole when its tag closes (a call that does not parse stays
    content). Whitespace at the end of the content is held until more content follows, so a reply with
    calls ends its content as the unstreamed reply does."""

    def __init__(self, tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> None:
        self.tools = tools
        self.choice = choice
        self.names = {t["function"]["name"] for t in tools}
        self.num_calls = 0
        self._held = ""  # text not sent yet: a possible tag start, a call being written, or a required call
        self._inside = False
        self._space = ""  # trailing whitespace of the content so far, sent once more content follows

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes."""
        if isinstance(self.choice, dict):
            return [self._named(text)] if text or not self.num_calls else []
        if self.choice == "required":
            self._held += text
            return []
        if self.choice == "none":
            return [{"content": text}] if text else []
        self._held += text
        out: list[dict[str, Any]] = []
        while True:
            if self._inside:
                end = self._held.find(_CLOSE)
                if end < 0:
                    return out
                body, self._held = self._held[:end], self._held[end + len(_CLOSE):]
                self._inside = False
                out.extend(self._auto_call(body))
                continue
            start = self._held.find(_OPEN)
            if start >= 0:
                before, self._held = self._held[:start], self._held[start + len(_OPEN):]
                self._inside = True
            else:
                keep = _partial_tag(self._held)
                before, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            if before:
                out.extend(self._content(before))
            if start < 0:
                return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what is still held when the reply ends."""
        held, self._held = self._held, ""
        if isinstance(self.choice, dict):
            return [self._named("")] if not self.num_calls else []
        if self.choice == "required":
            content, calls = parse_tool_calls(held, self.tools, self.choice)
            if calls:
                return [self._call_delta(calls[0])]
            return [{"content": content}] if content else []
        if self._inside:  # an unclosed call (cut short): its text is content
            self._inside = False
            held = _OPEN + held
        out = self._content(held) if held else []
        if self._space and not self.num_calls:  # a reply with calls has no trailing whitespace (as unstreamed)
            out.append({"content": self._space})
        self._space = ""
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        """Content deltas of `text`; trailing whitespace waits for more content (see `finish`)."""
        body = text.rstrip()
        space, self._space = self._space, self._space + text[len(body):] if not body else text[len(body):]
        return [{"content": space + body}] if body else []

    def _named(self, text: str) -> dict[str, Any]:
        if self.num_calls:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        assert isinstance(self.choice, dict)
        return self._call_delta(_call(self.choice["function"]["name"], text))

    def _auto_call(self, body: str) -> list[dict[str, Any]]:
        _, calls = parse_tool_calls(_OPEN + body + _CLOSE, self.tools, "auto")
        return [self._call_delta(calls[0])] if calls else self._content(_OPEN + body + _CLOSE)

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}]}


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the opening tag."""
    for size in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-size:]):
            return size
    return 0

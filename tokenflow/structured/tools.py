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

__all__ = ("check_tools", "content_besides_calls", "parse_tool_calls", "tool_schema")

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
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: no complete call
            return text, []
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


def content_besides_calls(text: str) -> str | None:
    """The text of a reply that made tool calls, without them: None when the text was only calls (a
    named or required call is nothing but its JSON)."""
    if "<tool_call>" not in text:
        return None
    return _CALL.sub("", text).strip() or None

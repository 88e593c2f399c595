"""Tool calling: tools rendered for the chat template, `tool_choice` enforced with a grammar, calls parsed back.

- `tool_choice: "required"`: the output is constrained to a JSON list of one or more calls, each
  `{"name": <one of the tools>, "parameters": <that tool's schema>}` (vLLM's approach); every call parses. A
  parameters object that does not set `additionalProperties` is closed (OpenAI's strict mode), so calls end.
- A named function: the output is constrained to that function's parameters schema; it is the call's arguments.
- `"auto"`: the model writes freely and calls are parsed from its text with the Hermes format (Qwen, Hermes,
  many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text outside them is the content.
- `"none"`: tools are rendered but never parsed.

A chat template that does not mention `tools` gets them as a system message in the Hermes format, so that a
model whose template ignores tools still sees them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from jaxserve.core.sampling_params import StructuredOutputsParams

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN = "<tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """Raise ValueError (its first word the field) for tools or a tool_choice OpenAI would refuse."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise ValueError("tool_choice 'required' needs tools")
        return
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}")
    if name not in names:
        raise ValueError(f"tool_choice names a function that is not among the tools: {name[:60]}")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as the grammar enforces it: closed (no properties beyond the declared ones)
    unless it says otherwise, as OpenAI's strict function calling requires, so a call always ends."""
    schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    return {"additionalProperties": False, **schema} if schema.get("type") == "object" else schema


def named_function(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def tool_constraint(tools: list[dict[str, Any]] | None, tool_choice: Any) -> StructuredOutputsParams | None:
    """The grammar that enforces `tool_choice` (required or a named function), else None."""
    if not tools:
        return None
    name = named_function(tool_choice)
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_parameters(tool))
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)}}
             for t in tools]
    return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None, tool_choice: Any,
                     ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output."""
    if not tools or tool_choice == "none":
        return text, []
    name = named_function(tool_choice)
    if name is not None:
        return None, [ToolCall(name, text)]
    if tool_choice == "required":
        try:
            return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                          for c in json.loads(text)]
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: no call
            return text, []
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
            args = call.get("arguments", call.get("parameters", {}))
            calls.append(ToolCall(str(call["name"]), args if isinstance(args, str) else json.dumps(args)))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a call after all: it stays in the content
    if not calls:
        return text, []
    content = HERMES_CALL.sub("", text).strip()
    return content or None, calls


def streamable_prefix(text: str, tools: list[dict[str, Any]] | None, tool_choice: Any) -> str:
    """How much of a growing output can be streamed as content now: all of it without tool parsing, none of it
    for an enforced call, and under `auto` what comes before a (possibly partial) `<tool_call>`."""
    if not tools or tool_choice == "none":
        return text
    if tool_choice == "required" or named_function(tool_choice) is not None:
        return ""
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return text[:at]
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a tail that may grow into the tag
        if HERMES_OPEN.startswith(text[-k:]):
            return text[:-k]
    return text


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes format's description of the tools, for a template that does not render them itself."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions:\n<tools>\n"
            f"{listing}\n</tools>\nFor each call, return a JSON object with the function name and arguments "
            'within <tool_call></tool_call> tags: <tool_call>{"name": <name>, "arguments": <arguments>}'
            "</tool_call>")


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template: str | None) -> list[dict[str, Any]]:
    """Messages for the chat template: assistant calls' arguments as objects (what templates expect), and the
    tools as a first system message when the template does not render `tools` itself."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
        out.append(m)
    if tools and template is not None and "tools" not in template:
        out.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            return call
    return call

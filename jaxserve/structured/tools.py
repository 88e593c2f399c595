"""Tool calling: tools rendered for the chat template, `tool_choice` enforced with a grammar, calls parsed back.

- `tool_choice: "required"`: the output is constrained to a JSON list of calls, each `{"name": <one of the
  tools>, "parameters": <that tool's schema>}` (vLLM's approach), at most as many as fit max_tokens (one with
  `parallel_tool_calls: false`), with arguments bounded to fit (structured/tool_grammar.py): every call ends
  and parses. An object that does not set `additionalProperties` is closed (OpenAI's strict mode).
- A named function: the output is constrained to that function's parameters schema, bounded the same way; it
  is the call's arguments.
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

from jaxserve.core.json_depth import json_depth
from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.structured.limits import DEFAULT_LIMITS, GrammarError, GrammarLimits, check_json_schema
from jaxserve.structured.tool_grammar import arguments_schema, call_list_schema

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


class ToolsError(ValueError):
    """A malformed tools, tool_choice or assistant tool_calls field; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_TOOLS = 128  # OpenAI's bound
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's characters (and . and :, which MCP names use)


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raise ToolsError (naming the field) for tools or a tool_choice OpenAI would refuse, or for a parameters
    schema past `limits`."""
    names: list[str] = []
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ToolsError("tools", f"tools holds {len(tools)} functions; at most {MAX_TOOLS} are allowed")
    for i, tool in enumerate(tools or []):
        at = f"tools[{i}]"
        if tool.get("type") != "function":
            raise ToolsError(f"{at}.type", f"{at}.type must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolsError(f"{at}.function", f"{at} must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolsError(f"{at}.function.name", f"{at}.function.name must be 1-64 letters, digits, '_', '-', "
                                                    "'.' or ':'")
        if name in names:
            raise ToolsError(f"{at}.function.name", f"{at}.function.name repeats tools[{names.index(name)}]'s "
                                                    f"name '{name}'")
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "a boolean")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise ToolsError(f"{at}.function.{key}", f"{at}.function.{key} must be {what}")
        try:
            check_json_schema(fn.get("parameters") or {}, limits)
        except GrammarError as e:
            raise ToolsError(f"{at}.function.parameters", f"{at}.function.parameters: {e}") from None
        names.append(name)
    _check_choice(tool_choice, names)


def _check_choice(tool_choice: Any, names: list[str]) -> None:
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise ToolsError("tool_choice", "tool_choice 'required' needs tools")
        return
    if not isinstance(tool_choice, dict):
        raise ToolsError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                        "'function': {'name': ...}}")
    if tool_choice.get("type") != "function":
        raise ToolsError("tool_choice.type", "tool_choice.type must be 'function'")
    fn = tool_choice.get("function")
    if not isinstance(fn, dict):
        raise ToolsError("tool_choice.function", "tool_choice.function must be an object {'name': ...}")
    name = fn.get("name")
    if not isinstance(name, str):
        raise ToolsError("tool_choice.function.name", "tool_choice.function.name must be a string")
    if name not in names:
        raise ToolsError("tool_choice.function.name", f"tool_choice.function.name names a function that is not "
                                                      f"among the tools: {name[:60]}")


def check_tool_calls(calls: list[dict[str, Any]], at: str, max_depth: int) -> None:
    """An assistant message's `tool_calls` (`at` names them): each {'id'?, 'type'?: 'function', 'function':
    {'name': str, 'arguments': str}}, the arguments nested at most `max_depth` deep."""
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        if call.get("type", "function") != "function":
            raise ToolsError(f"{where}.type", f"{where}.type must be 'function'")
        if not isinstance(call.get("id", ""), str):
            raise ToolsError(f"{where}.id", f"{where}.id must be a string")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ToolsError(f"{where}.function", f"{where}.function must be {{'name': ..., 'arguments': ...}}")
        if not isinstance(fn.get("name"), str):
            raise ToolsError(f"{where}.function.name", f"{where}.function.name must be a string")
        args = fn.get("arguments")
        if not isinstance(args, str):
            raise ToolsError(f"{where}.function.arguments", f"{where}.function.arguments must be a string (JSON)")
        if json_depth(args) > max_depth:
            raise ToolsError(f"{where}.function.arguments", f"{where}.function.arguments nests {json_depth(args)} "
                                                            f"deep; at most {max_depth} is allowed")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def named_function(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def tool_constraint(tools: list[dict[str, Any]] | None, tool_choice: Any, budget: int | None,
                    parallel: bool = True) -> StructuredOutputsParams | bool | None:
    """The grammar that enforces `tool_choice` (required or a named function) within `budget` tokens
    (structured/tool_grammar.py), else None; with `budget` None only whether there is one (True or None)."""
    if not tools:
        return None
    enforced = named_function(tool_choice) is not None or tool_choice == "required"
    if budget is None:
        return True if enforced else None
    name = named_function(tool_choice)
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=arguments_schema(_parameters(tool), budget))
    if tool_choice != "required":
        return None
    schema, _ = call_list_schema({t["function"]["name"]: _parameters(t) for t in tools}, budget, parallel)
    return StructuredOutputsParams(json=schema)


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
    """The tools as compact signatures with the Hermes call format, for a template that does not render them
    itself: `get_weather(city: string, days?: integer): The weather in a city`, a line each (whole JSON schemas
    would fill a small model's context: docs/startup.md has the count)."""
    lines = "\n".join(_signature(t.get("function") or {}) for t in tools)
    return ('Tools; to call one, write <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n' + lines)


def _signature(fn: dict[str, Any]) -> str:
    desc = fn.get("description")
    return f"{fn.get('name')}({_fields(fn.get('parameters') or {})})" + (f": {desc}" if desc else "")


def _fields(schema: dict[str, Any]) -> str:
    """An object schema's properties as `name: type, other?: type` (? for the optional ones)."""
    required = set(schema.get("required") or ())
    return ", ".join(f"{name}{'' if name in required else '?'}: {_type_text(sub)}"
                     for name, sub in (schema.get("properties") or {}).items())


def _type_text(schema: Any) -> str:
    """A JSON schema in a few characters: string, integer[], "a"|"b", {x: number}; anything else as compact JSON."""
    if not isinstance(schema, dict):
        return json.dumps(schema, separators=(",", ":"))
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"{_type_text(schema.get('items', {}))}[]"
    if kind == "object" and schema.get("properties"):
        return "{" + _fields(schema) + "}"
    if isinstance(kind, str):
        return kind
    if isinstance(kind, list):
        return "|".join(map(str, kind))
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


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
        except (ValueError, RecursionError):  # the server bounds the depth first; LLM callers may not
            return call
    return call

"""The request fields that ask for structured outputs, read into one `StructuredOutputsParams`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`,
`json_object`, `regex`, `choice`, `grammar`) and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`; and `tool_choice` "required" or a named function (structured/tools.py). At most one constraint
per request; a malformed one is an UnsupportedValue naming its field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.server.errors import UnsupportedValue
from jaxserve.structured.tools import tool_constraint

ANY_JSON = StructuredOutputsParams(json={})  # a tool call's place in the one-constraint rule, before its budget
_TYPES: dict[str, tuple[type, ...]] = {"json": (str, dict), "json_object": (bool,), "regex": (str,),
                                       "choice": (list,), "grammar": (str,)}


def _invalid(param: str, message: str) -> UnsupportedValue:
    return UnsupportedValue(param, message, "invalid_value")


def _make(param: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise _invalid(param, str(e)) from None


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _invalid("response_format.json_schema", "response_format json_schema needs "
                                                          "{'json_schema': {'name': ..., 'schema': {...}}}")
        return StructuredOutputsParams(json=schema)
    raise _invalid("response_format.type", "response_format type must be 'text', 'json_object' or 'json_schema'")


def _fields(source: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The constraint keys of a `structured_outputs` object (its other keys, vLLM's backend options, are
    ignored), each checked for its JSON type."""
    out = {}
    for key, types in _TYPES.items():
        value = source.get(key)
        if value is None or (key == "json_object" and value is False):
            continue
        if not isinstance(value, types) or isinstance(value, bool) != (key == "json_object"):
            raise _invalid(f"{prefix}{key}", f"{prefix}{key} has the wrong type")
        if key == "choice":
            if not all(isinstance(c, str) for c in value):
                raise _invalid(f"{prefix}choice", f"{prefix}choice must be a list of strings")
            value = tuple(value)
        out[key] = value
    return out


def structured_outputs(req: Any, budget: int | None) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; raises UnsupportedValue for a malformed or second one. A tool
    call's grammar is fitted to `budget` tokens (the request's max_tokens); with None (validation, before the
    budget is known) it is a placeholder that only takes part in the one-constraint rule."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _make("structured_outputs",
                                                  **_fields(req.structured_outputs, "structured_outputs."))))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}
    for key, value in guided.items():
        if value is not None:
            found.append((f"guided_{key}", _make(f"guided_{key}", **_fields({key: value}, "guided_"))))
    if "tools" in type(req).model_fields and req.tools:  # chat's (an extra field elsewhere: ignored)
        parallel = req.parallel_tool_calls is not False  # OpenAI's default: true
        if budget is None:
            tool = ANY_JSON if tool_constraint(req.tools, req.tool_choice, None) else None
        else:
            tool = tool_constraint(req.tools, req.tool_choice, budget, parallel)  # required, or a named function
        if tool is not None:
            found.append(("tool_choice", tool))
    if len(found) > 1:
        raise _invalid(found[1][0], f"give one structured output constraint, got {found[0][0]} and {found[1][0]}")
    return found[0][1] if found else None


def constraint_field(req: Any) -> str:
    """The name of the field that holds the request's constraint (for an error's `param`)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "tool_choice"):
        if name in type(req).model_fields and getattr(req, name) is not None and (name != "response_format"
                                                     or req.response_format.get("type") != "text"):
            return name
    return "structured_outputs"

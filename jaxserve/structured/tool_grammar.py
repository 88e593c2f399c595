"""Tool-call grammars that end: each call's arguments are bounded, and the call list is closed, so that an
enforced call (`tool_choice` "required" or a named function) always fits within the request's max_tokens.

A model constrained only by a schema may write digits, string characters or list items until max_tokens cut
it, and then nothing parses. So each schema gets caps where it has none (a string's maxLength, an integer's
and a number's range and a number's fraction digits through `multipleOf`, an array's maxItems, objects closed
as in OpenAI's strict mode), and `worst_case_bytes` bounds the JSON any output can be. Every token is at least
one byte, so bytes bound tokens: the caps are tightened step by step (`CAPS_LADDER`) until the call list fits
the budget, and the list holds at most as many calls as fit (one when `parallel_tool_calls` is false). A
schema that stays unbounded (an open object, an untyped value, a recursive $ref) cannot be guaranteed: it
gets its caps anyway, and the list one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

INF = float("inf")
MAX_PARALLEL_CALLS = 8
_ANNOTATIONS = {"description", "title", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly"}


@dataclass(frozen=True)
class Caps:
    chars: int  # a string's characters
    items: int  # an array's items
    digits: int  # an integer's (or a number's integer part's) digits
    fraction: int  # a number's fraction digits


# From generous to tight, each step about 3/4 of the last: 256 characters, 16 items, 15 digits, 6 decimals down to
# one character, one item, two digits and one decimal.
CAPS_LADDER = [Caps(max(1, int(256 * 0.75**i)), max(1, int(16 * 0.75**i)), max(2, int(15 * 0.8**i)),
                    max(1, int(6 * 0.85**i))) for i in range(20)]
# No \u escapes in tool arguments: a character is then at most 4 bytes (raw UTF-8), which bounds a string by its
# length; the escapes kept cover every character a tool argument needs.
ESCAPES = {"json_allowed_escapes": '"\\bfnrt'}


def _json_bytes(value: Any) -> int:
    """Most bytes `value` can take as JSON (escaped or raw UTF-8)."""
    return max(len(json.dumps(value, ensure_ascii=a, separators=(", ", ": ")).encode()) for a in (True, False))


def cap_schema(node: Any, caps: Caps) -> Any:
    """`node` with caps where it has none (see the module docstring); a schema's depth is checked before
    (structured/limits.py), so this recursion is bounded."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: cap_schema(v, caps) for k, v in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [cap_schema(v, caps) for v in out[key]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = cap_schema(out[key], caps)
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "string" in types:
        out["maxLength"] = _capped(out.get("maxLength"), caps.chars, out.get("minLength"))
    if types & {"integer", "number"}:
        top = 10 ** caps.digits - 1
        lo, hi = out.get("minimum"), out.get("maximum")
        lo = max(lo, -top) if isinstance(lo, int | float) else -top
        hi = min(hi, top) if isinstance(hi, int | float) else top
        if lo <= hi:  # else the schema's own range lies past the cap: it stays
            out["minimum"], out["maximum"] = lo, hi
        if "number" in types and not isinstance(out.get("multipleOf"), int | float):
            out["multipleOf"] = float(f"1e-{caps.fraction}")
    if "array" in types or "items" in out:
        out["maxItems"] = _capped(out.get("maxItems"), caps.items, out.get("minItems"))
    if ("object" in types or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _capped(given: Any, cap: int, least: Any) -> int:
    floor = least if isinstance(least, int) and least > 0 else 0
    return max(floor, min(given, cap) if isinstance(given, int) and given >= 0 else cap)


def worst_case_bytes(schema: Any) -> float:
    """The most bytes any JSON value `schema` allows can take in jaxserve's compact JSON (", " and ": "); INF
    when unbounded. Follows local $refs (a cycle is unbounded)."""
    return _Sizer(schema).size(schema, ())


class _Sizer:
    def __init__(self, root: Any) -> None:
        self.root = root

    def size(self, node: Any, refs: tuple[str, ...]) -> float:
        if node is True or node == {}:
            return INF
        if node is False or not isinstance(node, dict):
            return 0
        if "const" in node:
            return _json_bytes(node["const"])
        if isinstance(node.get("enum"), list):
            return max((_json_bytes(v) for v in node["enum"]), default=0)
        if isinstance(node.get("$ref"), str):
            ref = node["$ref"]
            target = _resolve(self.root, ref)
            return INF if ref in refs or target is None else self.size(target, (*refs, ref))
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                rest = {k: v for k, v in node.items() if k != key and k not in _ANNOTATIONS}
                alts = [self.size({**rest, **a} if isinstance(a, dict) else a, refs) for a in node[key]]
                return max(alts, default=0)
        if "allOf" in node or "not" in node:
            return INF
        types = node.get("type")
        if isinstance(types, list):
            return max((self.size({**node, "type": t}, refs) for t in types), default=0)
        if types is None:
            types = "object" if "properties" in node else "array" if "items" in node else None
        return self._typed(node, types, refs)

    def _typed(self, node: dict[str, Any], kind: Any, refs: tuple[str, ...]) -> float:
        if kind == "boolean":
            return 5
        if kind == "null":
            return 4
        if kind == "string":
            n = node.get("maxLength")
            return 2 + 4 * n if isinstance(n, int) else INF  # a character is at most 4 bytes (no \u escapes)
        if kind in ("integer", "number"):
            lo, hi = node.get("minimum"), node.get("maximum")
            if not isinstance(lo, int | float) or not isinstance(hi, int | float):
                return INF
            whole = max(len(str(int(abs(lo)))), len(str(int(abs(hi))))) + 1  # and a sign
            return whole if kind == "integer" else _fraction(node.get("multipleOf"), whole)
        if kind == "array":
            n = node.get("maxItems")
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if not isinstance(n, int):
                return INF
            sizes = [self.size(p, refs) for p in prefix[:n]]
            rest = n - len(sizes)
            if rest > 0:
                sizes += [self.size(node.get("items", True), refs)] * rest
            return 2 + sum(sizes) + 2 * max(0, len(sizes) - 1)
        if kind == "object":
            if node.get("additionalProperties", True) is not False:
                return INF
            props = node.get("properties") or {}
            parts = [_json_bytes(k) + 2 + self.size(v, refs) for k, v in props.items()]
            return 2 + sum(parts) + 2 * max(0, len(parts) - 1)
        return INF


def _fraction(step: Any, whole: int) -> float:
    """A number's bytes: its whole part and, with `multipleOf`, the step's decimals."""
    try:
        exponent = Decimal(str(step)).normalize().as_tuple().exponent if isinstance(step, int | float) else None
    except InvalidOperation:
        return INF
    if not isinstance(exponent, int):
        return INF
    return whole + (1 - exponent if exponent < 0 else 0)


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _fitted(params: Any, budget: float) -> tuple[Any, float, int]:
    """`params` capped as loosely as fits `budget` bytes (the tightest caps when none does), its bound, and the
    step of CAPS_LADDER it took: a binary search, since tighter caps never make a schema larger."""
    def at(step: int) -> tuple[Any, float]:
        capped = cap_schema(params, CAPS_LADDER[step])
        return capped, worst_case_bytes(capped)

    capped, size = at(0)
    if size <= budget or size == INF:  # fits as it is, or no cap can bound it
        return capped, size, 0
    lo, hi = 0, len(CAPS_LADDER) - 1  # at(lo) does not fit; find the first step that does
    best = at(hi)
    if best[1] > budget:
        return best[0], best[1], hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = at(mid)
        if got[1] <= budget:
            hi, best = mid, got
        else:
            lo = mid
    return best[0], best[1], hi


ROOMY_STEP = 5  # caps no tighter than this (60 characters) leave room to share the budget among parallel calls


def call_list_schema(tools: dict[str, dict[str, Any]], budget: int, parallel: bool) -> tuple[dict[str, Any], int]:
    """The schema of `tool_choice: "required"` for `tools` (name -> parameters schema) within `budget` tokens:
    a list of 1..k calls `{"name": ..., "parameters": ...}`, each tool's arguments fitted on their own; and k.
    With `parallel`, each call is first fitted to half the budget, so that two or more fit, unless that cuts
    its arguments past ROOMY_STEP."""
    for share in (2, 1) if parallel else (1,):
        calls, largest, tightest = [], 0.0, 0
        for name, params in tools.items():
            wrapper = _json_bytes({"name": name, "parameters": None}) - 4  # all but the arguments
            # "[", "]" and the end token around the calls, and ", " between them
            capped, size, step = _fitted(params, (budget - 1) / share - 2 - wrapper)
            calls.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"const": name}, "parameters": capped}})
            largest, tightest = max(largest, wrapper + size), max(tightest, step)
        if tightest <= ROOMY_STEP:
            break
    fits = int((budget - 1) // (largest + 2)) if largest < INF else 1
    k = max(1, min(MAX_PARALLEL_CALLS, fits)) if parallel else 1
    return {"type": "array", "minItems": 1, "maxItems": k, "items": {"anyOf": calls}, "x-guidance": ESCAPES}, k


def arguments_schema(params: dict[str, Any], budget: int) -> dict[str, Any]:
    """A named function's arguments schema with caps that fit `budget` tokens (the tightest when none does)."""
    capped, _, _ = _fitted(params, budget - 1)  # and the end token
    return {**capped, "x-guidance": {**(capped.get("x-guidance") or {}), **ESCAPES}}

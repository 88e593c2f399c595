"""Bounds on a structured output constraint, checked in Python before llguidance sees it.

llguidance's native code recurses along a schema's `$ref` chain and a grammar's rule chain: deep enough input
overflows its thread's stack, a segfault that takes the whole process, and counted repetitions multiply into
hundreds of MB of lexer state (docs/server.md has the measured bounds). So every
constraint is measured here first, without recursion, and refused with a `GrammarLimitError` that names the
limit: its size, its nesting depth (counting `$ref` hops and rule references), its rule count and the largest
product of nested counted repetitions. llguidance's own run-time bounds (`parser_limits`) cap what is left:
the lexer's work per mask and the lexer states one grammar may build.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jaxserve.core.json_depth import json_depth


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why (in one line)."""


class GrammarUnavailable(GrammarError):
    """llguidance is not installed (an image with jax preinstalled may lack it): no constraint can compile."""


def llguidance_module() -> Any:
    """The llguidance package, imported when a grammar is first needed: jaxserve starts and serves without it, and
    refuses structured outputs with `GrammarUnavailable` (a 400 on the server) when it is missing."""
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.numpy
    except ImportError:
        raise GrammarUnavailable("structured outputs (guided_json, guided_regex, response_format, tool_choice "
                                 "'required' or a named function) need the llguidance package: pip install "
                                 "llguidance") from None
    return llguidance


class GrammarLimitError(GrammarError):
    """A constraint past one of `GrammarLimits`; the message names the limit."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may be (see the module docstring); docs/server.md gives the measured costs."""

    max_source_bytes: int = 128 * 2**10  # a schema's JSON, a regex, a grammar's text
    max_depth: int = 64  # JSON nesting with $ref hops followed; a grammar's rule chain; regex groups
    max_rules: int = 2000  # rules of a Lark or GBNF grammar
    max_repeat: int = 10_000  # the product of nested counted repetitions ({n}, {n,m}) in a regex or grammar
    # llguidance's run-time bounds (its defaults: 1M fuel, 200k per step, 250k states of 1-2 kB)
    initial_lexer_fuel: int = 200_000  # building the lexer (about 50k a ms)
    step_lexer_fuel: int = 100_000  # one mask (about 14k a ms)
    max_lexer_states: int = 20_000  # lexer states one grammar builds over its life: memory

    def parser_limits(self) -> Any:
        """llguidance's `LLParserLimits` of these limits."""
        return llguidance_module().LLParserLimits(
            initial_lexer_fuel=self.initial_lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
            max_lexer_states=self.max_lexer_states, verbose_errors=False)


DEFAULT_LIMITS = GrammarLimits()


def _refuse(what: str, value: int, limit: int, name: str) -> GrammarLimitError:
    return GrammarLimitError(f"{what} {value}, past this server's limit of {limit} ({name})")


def check_size(text: str, limits: GrammarLimits) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_source_bytes:
        raise _refuse("the constraint is", size, limits.max_source_bytes, "max_source_bytes") from None


# ---- JSON schemas ----

def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#/$defs/x") points at, or None (llguidance reports the others)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any) -> int:
    """Nesting depth of a JSON schema with each local `$ref` followed into its target (a ref back into its own
    chain, a recursive schema, adds nothing); iterative, so any depth is measured."""
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            memo[key] = 1 + max((memo.get(id(c), 0) for c in _children(node, schema)), default=0)
            continue
        if key in memo or key in on_path:
            continue
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node, schema)
                     if isinstance(c, dict | list) and id(c) not in memo and id(c) not in on_path)
    return memo.get(id(schema), 0)


def _children(node: Any, root: Any) -> list[Any]:
    if isinstance(node, list):
        return [c for c in node if isinstance(c, dict | list)]
    if not isinstance(node, dict):
        return []
    out = [c for c in node.values() if isinstance(c, dict | list)]
    ref = node.get("$ref")
    target = _pointer(root, ref) if isinstance(ref, str) else None
    if isinstance(target, dict | list) and target is not node:
        out.append(target)
    return out


def _patterns(schema: Any) -> list[str]:
    """Every `pattern` string of a schema (its regexes), without recursion."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return found


def check_json_schema(schema: str | dict[str, Any], limits: GrammarLimits = DEFAULT_LIMITS) -> dict[str, Any] | bool:
    """The schema as an object, after its size, depth (with $ref hops) and patterns are checked."""
    if isinstance(schema, str):
        check_size(schema, limits)
        if json_depth(schema) > limits.max_depth:  # before json.loads, which recurses
            raise _refuse("the JSON schema nests", json_depth(schema), limits.max_depth, "max_depth")
        try:
            obj = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
    else:
        obj = schema
    if not isinstance(obj, dict | bool):
        raise GrammarError("a JSON schema must be an object")
    text = schema if isinstance(schema, str) else None
    if text is None:
        try:
            text = json.dumps(obj)
        except RecursionError:  # Python's guard, far past any limit here
            raise _refuse("the JSON schema nests more than", 900, limits.max_depth, "max_depth") from None
        check_size(text, limits)
        if json_depth(text) > limits.max_depth:
            raise _refuse("the JSON schema nests", json_depth(text), limits.max_depth, "max_depth")
    if '"$ref"' in text:  # only refs make the depth more than the text's (measured above)
        depth = schema_depth(obj)
        if depth > limits.max_depth:
            raise _refuse("the JSON schema nests, following its $refs,", depth, limits.max_depth, "max_depth")
    if '"pattern"' in text:
        for pattern in _patterns(obj):
            check_regex(pattern, limits)
    return obj


# ---- regular expressions and grammars ----

_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _scan(text: str, grammar: bool, limits: GrammarLimits) -> None:
    """Group depth and the largest product of nested counted repetitions, in one pass over a regex (or a Lark
    grammar, where brackets are optional groups and strings and /regexes/ are atoms)."""
    groups: list[int] = [1]  # per open group: the largest repetition product inside it
    last = 1  # the repetition product of the atom just closed (a quantifier multiplies it)
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i, last = i + 2, 1
            continue
        if grammar and (ch == "#" or text.startswith("//", i)):  # a comment (Lark's //, GBNF's #)
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if grammar and ch in "\"/":
            end = _closing(text, i, ch)
            if ch == "/":
                _scan(text[i + 1:end], False, limits)
            i, last = end + 1, 1
            continue
        if ch == "[" and not grammar:
            i, last = _class_end(text, i) + 1, 1
            continue
        if ch in "([":
            groups.append(1)
            if len(groups) - 1 > limits.max_depth:
                raise _refuse("the constraint nests groups", len(groups) - 1, limits.max_depth, "max_depth")
        elif ch in ")]":
            last = groups.pop() if len(groups) > 1 else 1
            groups[-1] = max(groups[-1], last)
        elif ch == "{" and (m := _COUNT.match(text, i)):
            count = max(int(m.group(1)), int(m.group(2) or 0))
            product = last * max(count, 1)
            if product > limits.max_repeat:
                raise _refuse("the constraint repeats", product, limits.max_repeat, "max_repeat")
            groups[-1] = max(groups[-1], product)
            i, last = m.end(), product
            continue
        else:
            last = 1
        i += 1


def _closing(text: str, start: int, quote: str) -> int:
    """Where the string or regex literal opened at `start` ends (the text's end when it does not)."""
    i = start + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return min(i, len(text))


def _class_end(text: str, start: int) -> int:
    i = start + 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i


def check_regex(regex: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    check_size(regex, limits)
    _scan(regex, False, limits)


_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w.-]*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*(?::|::=)", re.M)
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_LITERALS = re.compile(r'//[^\n]*|#[^\n]*|"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*')


def check_rule_count(text: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """A Lark or GBNF grammar's size and rule count (before the GBNF converter, Python, spends time on it)."""
    check_size(text, limits)
    rules = sum(1 for _ in _RULE.finditer(text))
    if rules > limits.max_rules:
        raise _refuse("the grammar has", rules, limits.max_rules, "max_rules")


def check_grammar(text: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """A Lark grammar's size, rule count, rule-reference depth, groups and repetitions; and the JSON schemas it
    embeds with `%json`."""
    check_rule_count(text, limits)
    starts = [(m.start(), m.end(), m.group(1)) for m in _RULE.finditer(text)]
    for at in (m.end() for m in re.finditer(r"%json\s*", text)):
        try:
            schema, _ = json.JSONDecoder().raw_decode(text[at:]) if json_depth(text[at:]) <= limits.max_depth \
                else (None, 0)
        except ValueError:
            continue  # llguidance reports it
        if schema is None:
            raise _refuse("the grammar's %json nests", json_depth(text[at:]), limits.max_depth, "max_depth")
        check_json_schema(schema, limits)
    _scan(text, True, limits)
    bodies = {}
    for k, (_, end, name) in enumerate(starts):
        stop = starts[k + 1][0] if k + 1 < len(starts) else len(text)
        body = _LITERALS.sub(" ", text[end:stop])
        bodies.setdefault(name, set()).update(_NAME.findall(body))
    depth = _reference_depth(bodies)
    if depth > limits.max_depth * 4:  # a rule chain is lighter than JSON nesting: 4x
        raise _refuse("the grammar's rules reference each other", depth, limits.max_depth * 4,
                      "max_depth x 4 for rule chains")


def _reference_depth(bodies: dict[str, set[str]]) -> int:
    """The longest chain of rule references (a cycle counts once), iteratively."""
    memo: dict[str, int] = {}
    for root in bodies:
        stack: list[tuple[str, bool]] = [(root, False)]
        on_path: set[str] = set()
        while stack:
            name, done = stack.pop()
            if done:
                on_path.discard(name)
                memo[name] = 1 + max((memo.get(c, 0) for c in bodies.get(name, ()) if c in bodies), default=0)
                continue
            if name in memo or name in on_path:
                continue
            on_path.add(name)
            stack.append((name, True))
            stack.extend((c, False) for c in bodies.get(name, ()) if c in bodies and c not in memo
                         and c not in on_path)
    return max(memo.values(), default=0)

"""Errors in OpenAI's shape, and the rule that no error echoes more than a short excerpt of the input.

`APIError` is what every handler raises for a client-visible failure; its message and param are capped, so
a 10 MB field can never come back as a 10 MB error body. `validation_error` turns pydantic's errors into
one such 400 naming the first offending parameter.
"""

from __future__ import annotations

import reprlib
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

MAX_MESSAGE_CHARS = 600  # long enough for vLLM's context-length message, which clients match on
MAX_PARAM_CHARS = 64
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

_REPR = reprlib.Repr()  # bounded-time repr: never walks more of a value than it prints
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 8
_REPR.maxdict, _REPR.maxlevel = 4, 3


class UnsupportedValue(ValueError):
    """A parameter given a value we do not implement (or an invalid one); `param` names it."""

    def __init__(self, param: str, message: str, code: str = "unsupported_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def excerpt(value: Any, limit: int = 60) -> str:
    """A short printable excerpt of a client's value: strings cut to `limit` characters, others a bounded repr."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"... ({len(value)} characters)"
    try:
        return _REPR.repr(value)
    except (RecursionError, ValueError):  # deep nesting; an int too long to print
        return f"<{type(value).__name__}>"


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with `headers`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = _cap(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.param = None if param is None else _cap(param, MAX_PARAM_CHARS)
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].content` from a pydantic error location, dropping union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.lower() not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first offending parameter."""
    err = e.errors(include_input=False, include_url=False)[0] if isinstance(e, ValidationError) else e.errors()[0]
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = _param_path(loc)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unsupported parameter: '{excerpt(param)}' (jaxserve does not implement it)", param,
                        "unsupported_parameter")
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    what = f"'{excerpt(param)}'" if param else "request"
    return APIError(400, f"Invalid {what}: {excerpt(err['msg'], 200)}", param, "invalid_value")

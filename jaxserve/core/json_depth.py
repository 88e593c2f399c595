"""The nesting depth of JSON text, measured without parsing it: json.loads, pydantic and llguidance all recurse
over nesting, so a body, a schema or a tool call's arguments is measured first and refused past a bound.

Vectorised (numpy), so a MB-sized body costs no Python loop over its bytes (docs/results.md). Brackets inside
strings do not count; a quote preceded by an odd run of backslashes is inside its string.
"""

from __future__ import annotations

import numpy as np

_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of [ and { in `text` outside strings (0 for a scalar). Not a validator: text that is
    not JSON gets some depth, and the parser reports it afterwards."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if b"[" not in data and b"{" not in data:
        return 0
    a = np.frombuffer(data, np.uint8)
    quotes = np.flatnonzero(a == ord('"'))
    if quotes.size:
        backslash = a == ord("\\")
        if backslash.any():
            idx = np.arange(a.size, dtype=np.int64)
            last_plain = np.maximum.accumulate(np.where(backslash, -1, idx))  # last non-backslash at or before i
            before = quotes - 1
            run = np.where(before >= 0, before - last_plain[np.maximum(before, 0)], 0)
            quotes = quotes[run % 2 == 0]
        toggle = np.zeros(a.size, np.int8)
        toggle[quotes] = 1
        outside = (np.cumsum(toggle, dtype=np.int64) & 1) == 0
    else:
        outside = np.ones(a.size, bool)
    step = (np.isin(a, _OPEN).astype(np.int32) - np.isin(a, _CLOSE).astype(np.int32)) * outside
    return int(np.cumsum(step, dtype=np.int64).max(initial=0))

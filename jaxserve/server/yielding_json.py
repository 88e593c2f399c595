"""JSON in slices, for big bodies on a worker thread: the C codec holds the GIL for a whole call (tens of
milliseconds for a MB of token ids: docs/results.md), during which the event loop cannot run, so big documents go
through in pieces of a few milliseconds each and the loop gets the GIL back between them.

`loads` is json.loads with the same results and errors: the standard library's pure-Python scanner walks the
structure, strings are still scanned in C (fast), and a run of numbers in an array is parsed by C json.loads a
slice at a time. `dumps_ints` renders a list of ints the same way.
"""

from __future__ import annotations

import json
from json import decoder, scanner
from typing import Any

_FIRST_SLICE, _MAX_SLICE = 1024, 64 * 1024  # characters; a slice grows while the run continues
_INT_SLICE = 8192


def reject_constant(name: str) -> None:
    """NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


def _array(s_and_end: tuple[str, int], scan_once: Any) -> tuple[list[Any], int]:
    """json.decoder.JSONArray, with a fast path for arrays of numbers or of flat arrays: slices cut between
    elements, each parsed by C json.loads. A slice that is not valid JSON on its own (strings, objects, deeper
    nesting) falls back to JSONArray from the array's start; slices start small, so a fallback wastes little."""
    s, end = s_and_end
    first = s[end:end + 64].lstrip()[:1]
    # Numbers are cut after a comma; arrays of arrays (prompts of ids) after "],", their end is "]]".
    sep, stop = (",", "]") if first.isdigit() or first == "-" else ("],", "]]") if first == "[" else ("", "")
    if sep:
        values: list[Any] = []
        pos, size = end, _FIRST_SLICE
        while True:
            close = s.find(stop, pos, pos + size)
            if close >= 0:
                close += len(stop) - 1
            cut = close if close >= 0 else s.rfind(sep, pos, pos + size) + len(sep) - 1
            if cut < pos:
                break
            try:
                part = json.loads("[" + s[pos:cut] + "]", parse_constant=reject_constant)
            except (ValueError, RecursionError):
                break
            values.extend(part)
            if close >= 0:
                return values, close + 1
            pos, size = cut + 1, min(2 * size, _MAX_SLICE)
    return decoder.JSONArray(s_and_end, scan_once)


class _SlicedDecoder(json.JSONDecoder):
    def __init__(self) -> None:
        super().__init__(parse_constant=reject_constant)
        self.parse_array = _array
        self.scan_once = scanner.py_make_scanner(self)


_DECODER = _SlicedDecoder()


def loads(body: bytes) -> Any:
    """json.loads(body) in GIL-yielding pieces (raises what json.loads raises, RecursionError included)."""
    return _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))


def dumps_ints(ids: list[int]) -> str:
    """json.dumps(ids) for a list of ints, in slices."""
    return "[" + ",".join(",".join(map(str, ids[i:i + _INT_SLICE])) for i in range(0, len(ids), _INT_SLICE)) + "]"

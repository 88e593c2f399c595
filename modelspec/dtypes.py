"""The one table of dtype names: the planner's short names, the array names they stand for, and their sizes.

Every name a user or a config may give (`bf16` or `bfloat16`, `fp32` or `float32`, ...) resolves here, for the
planner's byte counts and peaks and for the runtime's arrays alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One element type: its short name, its numpy/JAX name (None where no array type exists) and its size."""

    name: str
    array_name: str | None
    bytes: float


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("fp32", "float32", 4.0),
    DType("bf16", "bfloat16", 2.0),
    DType("fp16", "float16", 2.0),
    DType("fp8", "float8_e4m3fn", 1.0),
    DType("int8", "int8", 1.0),
    DType("int4", None, 0.5),  # weight-only, two to a byte
)}
_BY_ANY_NAME = {**DTYPES, **{d.array_name: d for d in DTYPES.values() if d.array_name}}


def lookup(name: str) -> DType:
    """The dtype a short or array name stands for; ValueError naming the choices otherwise."""
    try:
        return _BY_ANY_NAME[str(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}") from None


def short_name(name: str) -> str:
    """The planner's short name (fp32, bf16, ...) of a short or array name."""
    return lookup(name).name


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name."""
    return lookup(name).bytes

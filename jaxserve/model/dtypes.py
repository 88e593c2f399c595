"""Array dtypes of the runtime, resolved through the planner's one dtype table (`modelspec.dtypes`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from modelspec.dtypes import lookup, short_name

# What `--dtype` accepts for weights and activations; "auto" is float32 on a CPU, bfloat16 elsewhere.
ARRAY_DTYPES = ("float32", "bfloat16", "float16")
RUNTIME_DTYPES = ("auto", *ARRAY_DTYPES)


def resolve_dtype(dtype: str | Any = "auto", platform: str | None = None) -> jnp.dtype:
    """The array dtype a name (short or array name, or "auto" for this platform) or a dtype stands for."""
    if isinstance(dtype, str) and dtype == "auto":
        platform = platform or jax.default_backend()
        return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        array_name = lookup(dtype).array_name
        if array_name is None:
            raise ValueError(f"dtype {dtype!r} has no array type")
        return jnp.dtype(array_name)
    return jnp.dtype(dtype)


def planner_dtype(dtype: Any) -> str:
    """The planner's short name (fp32, bf16, ...) of an array dtype."""
    return short_name(str(np.dtype(dtype)))

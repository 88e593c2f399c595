"""Array dtypes of the runtime, resolved through the planner's one dtype table (`modelspec.dtypes`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import ARRAY_DTYPES, RUNTIME_DTYPES
from modelspec.dtypes import lookup, short_name

__all__ = ["ARRAY_DTYPES", "RUNTIME_DTYPES", "planner_dtype", "resolve_dtype"]


def resolve_dtype(dtype: str | Any) -> jnp.dtype:
    """The array dtype a name (short or array name) or a dtype stands for; "auto" is refused here (the engine
    resolves it for its device: `jaxserve.platform.policy.default_dtype`)."""
    if isinstance(dtype, str) and dtype == "auto":
        raise ValueError("dtype 'auto' depends on the device: resolve it with jaxserve.platform.policy.default_dtype")
    if isinstance(dtype, str):
        array_name = lookup(dtype).array_name
        if array_name is None:
            raise ValueError(f"dtype {dtype!r} has no array type")
        return jnp.dtype(array_name)
    return jnp.dtype(dtype)


def planner_dtype(dtype: Any) -> str:
    """The planner's short name (fp32, bf16, ...) of an array dtype."""
    return short_name(str(np.dtype(dtype)))

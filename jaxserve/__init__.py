"""jaxserve: a JAX/XLA LLM inference runtime with an analytical planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from jaxserve.engine.llm import LLM


def __getattr__(name: str):
    # LLM pulls in JAX; import it on first use so `jaxserve plan` and the planner stay light.
    if name == "LLM":
        from jaxserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)

"""No engine step waits on the host: what the host decides when it builds a batch (greedy or sampling, a cut, the
top logprobs, logits processing, prompt logprobs) picks a compiled variant there, so no step function holds a
conditional, and no loop in it runs to a device-computed bound (on a GPU, each would copy a predicate or a bound
to the host and wait, every step). Checked on the programs the engine runs for each kind of request."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.core.batch import trash_prefill
from jaxserve.core.request import Request
from jaxserve.model.moe import MoE
from jaxserve.model.ops import XLA_MATMULS
from jaxserve.runner.prompt_logprobs import plan_rows
from jaxserve.runner.sampler import SamplingArrays, tier_for
from modelspec.spec import PRESETS
from tests.hlo_checks import conditionals, dynamic_while_loops, host_round_trips

KINDS = {
    "greedy": SamplingParams(temperature=0, max_tokens=4),
    "top-p": SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4),
    "temperature": SamplingParams(temperature=0.7, seed=2, max_tokens=4),
    "penalties": SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=4),
    "logprobs": SamplingParams(temperature=0, logprobs=3, max_tokens=4),
    "prompt logprobs": SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=4),
}


def _request(params: SamplingParams, prompt: list[int]) -> Request:
    return Request(request_id="r", prompt_token_ids=prompt, sampling_params=params, arrival_time=0.0,
                   max_tokens=params.max_tokens)


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_step_function_waits_on_the_host(tiny_llm: LLM, kind: str) -> None:
    params = KINDS[kind]
    prompt = list(range(3, 40))
    out = tiny_llm.generate([prompt], params)[0]  # the request runs, as a client's would
    assert len(out.token_ids) == params.max_tokens
    runner = tiny_llm.engine.runner
    req = _request(params, prompt)
    for num_tokens in (1, len(prompt)):  # a decode step and a prefill step
        batch = trash_prefill(num_tokens, runner.page_size, 1, runner.pages_per_seq * runner.page_size)
        batch = dataclasses.replace(batch, requests=[req])
        assert host_round_trips(runner.lower_forward(batch, num_tokens).as_text()) == []
    sampling = SamplingArrays.build([(params, 1, 0)], runner.sampling_bucket(1))
    hidden = jnp.zeros((runner.max_sampled, tiny_llm.engine.spec.hidden_size), tiny_llm.engine.dtype)
    text = runner.sampler.lower(hidden, sampling, [req]).as_text()
    assert host_round_trips(text) == [], tier_for(sampling, params.needs_processing)
    if params.prompt_logprobs is not None:
        batch = trash_prefill(len(prompt), runner.page_size, 1, len(prompt))
        batch = dataclasses.replace(batch, requests=[req], token_ids=np.asarray(prompt, np.int32))
        rows = plan_rows(batch, {0: [None] * len(prompt)})
        every_row = jnp.zeros((len(prompt), tiny_llm.engine.spec.hidden_size), tiny_llm.engine.dtype)
        assert host_round_trips(runner.prompt_head.lower(every_row, rows).as_text()) == []


def test_an_accelerators_moe_layer_loops_to_a_static_bound() -> None:
    """Off a CPU (the matmul route's `moe_tiles_in_use` off) the experts' loop runs to the most tiles a step can
    need; a CPU's runs to the tiles in use, which costs nothing there."""
    layer = MoE(PRESETS["tiny-moe"], jnp.float32, nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = jnp.ones((96, layer.experts_gate_up.shape[1]), jnp.float32)  # past decode sizes: XLA's tile loop

    def lowered(route) -> str:
        return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, route)).lower(state, x).as_text()

    accelerator = dataclasses.replace(XLA_MATMULS, moe_tiles_in_use=False)
    assert "stablehlo.while" in lowered(accelerator) and dynamic_while_loops(lowered(accelerator)) == []
    assert dynamic_while_loops(lowered(dataclasses.replace(XLA_MATMULS, moe_tiles_in_use=True)))  # the check bites


def test_the_checks_see_a_conditional() -> None:
    text = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda: x, lambda: -x)).lower(jnp.ones(3)).as_text()
    assert conditionals(text)

"""The kernel plan: which row counts of the matmuls run in jaxserve's CPU kernel, measured once per machine and
model against XLA's own dots (`kernel_choice.choose`), cached, and followed by `linear` and the LM head."""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM
from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu import matmul_int8 as cpu_matmul_int8
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.llama import LlamaForCausalLM, linear
from jaxserve.model.quantize import QuantizedWeight
from jaxserve.model.quantize_model import quantize_model
from jaxserve.platform import kernel_choice
from jaxserve.platform.kernel_choice import CPU_KERNEL_ROUTE
from modelspec.spec import PRESETS

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(PRESETS["tiny"], jnp.float32, rngs=nnx.Rngs(0))


def plan(matmul_rows: set[int], head_rows: set[int] = frozenset()) -> KernelPlan:
    return KernelPlan("test", frozenset(matmul_rows), frozenset(head_rows))


def test_linear_runs_the_kernel_at_the_plans_row_counts_only():
    w = jnp.ones((64, 96), jnp.float32)

    def hlo(rows: int, p: KernelPlan | None) -> str:
        route = dataclasses.replace(CPU_KERNEL_ROUTE, plan=p)
        return jax.jit(lambda x, w: linear(x, w, route)).lower(jnp.ones((rows, 64)), w).as_text()

    assert cpu_matmul.TARGET in hlo(4, plan({4})) and cpu_matmul.TARGET not in hlo(8, plan({4}))
    assert cpu_matmul.TARGET in hlo(8, None)  # no plan: every row count the kernel takes


def test_the_lm_head_runs_the_kernel_at_the_plans_row_counts_only(tiny_model):
    def hlo(rows: int) -> str:
        route = dataclasses.replace(CPU_KERNEL_ROUTE, plan=plan({1, 4}, {1}))
        f = jax.jit(lambda h: tiny_model.compute_logits(h, route))
        return f.lower(jnp.ones((rows, 64), jnp.float32)).as_text()

    assert cpu_matmul.TARGET_NT in hlo(1) and cpu_matmul.TARGET_NT not in hlo(4)


def test_the_plan_keeps_the_kernel_where_it_was_faster(tiny_model, tmp_path, monkeypatch):
    def fake_times(kernel, xla, args, repeats):  # the kernel wins below 8 rows
        x = args[1] if isinstance(args[1], jax.Array) else next(iter(args[0].values()))
        return [float(x.shape[0]), 8.0]

    monkeypatch.setattr(kernel_choice, "time_pair", fake_times)
    p = kernel_choice.choose(tiny_model, (1, 4, 8, 16, 64), (1, 2, 8), cache=tmp_path / "plan.json")
    assert p.matmul_rows == {1, 4} and p.head_rows == {1, 2}
    assert p.isa == cpu_kernels.isa()


def test_the_plan_cuts_one_row_into_the_part_count_that_streamed_fastest(tiny_model, tmp_path, monkeypatch):
    # one row against the default's 16 parts, each candidate (one and two a thread) paired with the default
    monkeypatch.setattr(kernel_choice, "_threads", lambda: 2)
    timed = []

    def fake_times(first, second, args, repeats):
        x = args[1] if isinstance(args[1], jax.Array) else next(iter(args[0].values()))
        return [float(x.shape[0]), 8.0]

    def fake_parts(weights, candidates, repeats, dtype):
        timed.append(list(candidates))
        return {"2": [1.0, 0.9], "4": [1.0, 0.6]}  # four parts: 0.6 of the default's time

    monkeypatch.setattr(kernel_choice, "time_pair", fake_times)
    monkeypatch.setattr(kernel_choice, "_measure_row_parts", fake_parts)
    p = kernel_choice.choose(tiny_model, (1, 4), (1,), cache=tmp_path / "plan.json")
    assert timed == [[2, 4]] and p.row_parts == 4 and p.parts_at(1) == 4 and p.parts_at(4) == 0
    assert "one row in at most 4 parts" in p.describe()

    def hlo(rows: int) -> str:
        w = jnp.ones((64, 96), jnp.float32)
        route = dataclasses.replace(CPU_KERNEL_ROUTE, plan=p)
        return jax.jit(lambda x: linear(x, w, route)).lower(jnp.ones((rows, 64))).as_text()

    assert "row_parts = 4" in hlo(1) and "row_parts = 0" in hlo(4)


def test_the_default_part_count_stays_where_no_candidate_beat_it(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "_threads", lambda: 2)
    monkeypatch.setattr(kernel_choice, "_measure_row_parts",
                        lambda weights, candidates, repeats, dtype: {"2": [1.0, 1.3], "4": [1.0, 1.05]})
    monkeypatch.setattr(kernel_choice, "time_pair", lambda first, second, args, repeats: [1.0, 2.0])
    p = kernel_choice.choose(tiny_model, (1,), (1,), cache=tmp_path / "plan.json")
    assert p.row_parts == 0 and "parts" not in p.describe()


def test_an_overlapped_loops_row_counts_are_timed_with_the_hosts_work_beside_them(tiny_model, tmp_path, monkeypatch):
    # the kernel's helper threads contend with the loop's host thread: where the host's work stretches the kernel
    # more than XLA's one-thread dot, that row count goes to XLA for an overlapped engine only
    def fake_times(kernel, xla, args, repeats):
        beside = kernel.__name__ == "with_host_work"  # `_beside`'s wrapper: dispatch, the host's work, the wait
        assert (xla.__name__ == "with_host_work") == beside
        return [2.0, 1.0] if beside else [1.0, 2.0]

    monkeypatch.setattr(kernel_choice, "time_pair", fake_times)
    monkeypatch.setattr(kernel_choice, "_measure_row_parts", lambda *a: {})
    cache = tmp_path / "plan.json"
    overlapped = kernel_choice.choose(tiny_model, (1, 4, 16), (1, 16), cache=cache, beside_host=(1, 4))
    alone = kernel_choice.choose(tiny_model, (1, 4, 16), (1, 16), cache=cache)
    assert overlapped.matmul_rows == {16} and overlapped.head_rows == {16}
    assert alone.matmul_rows == {1, 4, 16} and alone.head_rows == {1, 16}
    [entry] = json.loads(cache.read_text()).values()  # one model: both kinds of timing side by side
    assert {"1", "1 beside the host", "4 beside the host", "16"} <= set(entry["matmul"])


def test_the_hosts_stand_in_is_a_fixed_amount_of_work():
    work = kernel_choice.host_work(1e-4)
    assert work() is None  # runs its count, whatever the clock says meanwhile
    f = kernel_choice._beside(lambda x: x + 1, work)
    assert f(1) == 2 and kernel_choice._beside(abs, None) is abs


def test_an_overlapped_cpu_engine_asks_for_its_overlapped_row_counts_beside_the_host(monkeypatch):
    asked = []
    choose = kernel_choice.choose

    def spy(model, token_buckets, seq_buckets, **kwargs):
        asked.append(tuple(kwargs.get("beside_host", ())))
        return choose(model, token_buckets, seq_buckets, **kwargs)

    monkeypatch.setattr(kernel_choice, "choose", spy)
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(1, 2, 4, 16, 64), warmup=False)
    LLM("tiny", **args)
    LLM("tiny", async_scheduling=True, **args)
    assert asked == [(), (1, 2, 4)]  # the synchronous loop's plan alone; the overlapped one's up to 8 tokens


def test_the_plan_is_measured_once_then_read_from_its_cache(tiny_model, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "plan.json"
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        first = kernel_choice.choose(tiny_model, (1, 4, 64), (1, 2), cache=cache, repeats=2)
    assert "measured in" in caplog.text and f"built for {cpu_kernels.isa()}" in caplog.text
    [entry] = json.loads(cache.read_text()).values()
    assert set(entry["matmul"]) == {"1", "4"} and set(entry["head"]) == {"1", "2"}  # 64: more than MAX_ROWS
    assert first.matmul_rows <= {1, 4} and first.head_rows <= {1, 2}

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(kernel_choice, "time_pair", no_timing)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        assert kernel_choice.choose(tiny_model, (4, 1), (2, 1), cache=cache) == first
    assert "timings cached" in caplog.text


def test_a_plan_timed_beside_other_processes_serves_its_start_and_is_not_kept(tiny_model, tmp_path, monkeypatch,
                                                                               caplog):
    # such timings would choose the plan of every later start on this machine
    class Busy:
        def busy(self) -> bool:
            return True

        def cores(self) -> float:
            return 1.0

    monkeypatch.setattr(kernel_choice, "OthersCpu", Busy)
    monkeypatch.setattr(kernel_choice, "time_pair", lambda kernel, xla, args, repeats: [1.0, 2.0])
    monkeypatch.setattr(kernel_choice, "_measure_row_parts", lambda *a: {})
    cache = tmp_path / "plan.json"
    with caplog.at_level(logging.WARNING, logger=kernel_choice.__name__):
        plan = kernel_choice.choose(tiny_model, (1, 4), (1,), cache=cache)
    assert plan.matmul_rows == {1, 4} and plan.head_rows == {1}  # this start runs what it timed
    assert not cache.exists() and "other processes used 1.00 cores" in caplog.text


def test_the_cache_tells_models_apart(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "time_pair", lambda kernel, xla, args, repeats: [1.0, 2.0])
    cache = tmp_path / "plan.json"
    kernel_choice.choose(tiny_model, (1,), (1,), cache=cache)
    one_layer = LlamaForCausalLM(dataclasses.replace(PRESETS["tiny"], num_layers=1), jnp.float32, rngs=nnx.Rngs(0))
    kernel_choice.choose(one_layer, (1,), (1,), cache=cache)
    assert len(json.loads(cache.read_text())) == 2


def test_an_moe_models_plan_takes_the_grouped_expert_kernel_where_it_was_faster(tmp_path, monkeypatch):
    moe_model = LlamaForCausalLM(PRESETS["tiny-moe"], jnp.float32, rngs=nnx.Rngs(0))
    timed = []

    def fake_times(kernel, xla, args, repeats):  # the expert tiles' args are (x, ids, weights, experts)
        if len(args) == 4:
            timed.append(args[0].shape[0])
            return [float(args[0].shape[0]), 8.0]  # the grouped kernel wins below 8 tokens
        return [1.0, 2.0]

    monkeypatch.setattr(kernel_choice, "time_pair", fake_times)
    p = kernel_choice.choose(moe_model, (1, 4, 8, 64, 128), (1,), cache=tmp_path / "plan.json")
    assert timed == [1, 4, 8, 64]  # decode-sized steps only: wider ones keep XLA's tiles
    assert p.moe_rows == {1, 4} and p.moe(4) and not p.moe(8)
    assert "grouped expert kernel at 1, 4 tokens" in p.describe()


def test_a_quantized_models_plan_runs_the_int8_kernel_on_one_thread_where_that_was_faster(tmp_path, monkeypatch):
    model = LlamaForCausalLM(PRESETS["tiny"], jnp.float32, rngs=nnx.Rngs(0))
    quantize_model(model, "int8")
    timed = []

    def fake_times(kernel, xla, args, repeats):  # [one thread, all threads] for the int8 threads' measurement
        if isinstance(args[1], list) and all(isinstance(w, QuantizedWeight) for w in args[1]) and any(
                w.shape[1] == PRESETS["tiny"].vocab_size for w in args[1]):  # the head's codes are among them
            rows = next(iter(args[0].values())).shape[0]
            timed.append(rows)
            return [1.0, 2.0] if rows == 1 else [2.0, 1.0]
        return [1.0, 2.0]

    monkeypatch.setattr(kernel_choice, "time_pair", fake_times)
    p = kernel_choice.choose(model, (1, 4), (1, 4), cache=tmp_path / "plan.json")
    if kernel_choice._threads() == 1:
        assert not timed and not p.int8_one_thread_rows  # nothing to choose between
        return
    assert timed == [1, 4] and p.int8_one_thread_rows == {1}
    assert p.int8_threads(1) == 1 and p.int8_threads(4) == 0

    def hlo(rows: int) -> str:
        w = model.layers[0].mlp.gate_up[...]
        route = dataclasses.replace(CPU_KERNEL_ROUTE, plan=p)
        return jax.jit(lambda x: linear(x, w, route)).lower(jnp.ones((rows, w.shape[0]))).as_text()

    assert "max_threads = 1" in hlo(1) and "max_threads = 0" in hlo(4)


def test_the_int8_kernel_gives_the_same_product_on_one_thread_as_on_all():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(-127, 128, (256, 192), dtype=np.int8))
    scale = jnp.asarray(rng.random(192, np.float32))
    for rows in (1, 5):
        x = jnp.asarray(rng.standard_normal((rows, 256), np.float32))
        one, every = (cpu_matmul_int8.cpu_matmul_int8(x, q, scale, t) for t in (1, 0))
        expected = (np.asarray(x) @ np.asarray(q, np.float32)) * np.asarray(scale)
        np.testing.assert_allclose(np.asarray(one), expected, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.asarray(every), expected, rtol=1e-4, atol=1e-3)


def test_the_plans_matmuls_are_timed_one_after_another_as_a_step_runs_them():
    # independent dots could run side by side in XLA's CPU runtime; a step's never do
    ws = [jnp.full((4, 8), 0.5), jnp.full((4, 4), 0.25), jnp.full((8, 4), 2.0)]
    xs = {4: jnp.ones((3, 4)), 8: jnp.ones((3, 8))}
    run = kernel_choice._in_sequence(lambda x, w: x @ w)
    for got, w in zip(run(xs, ws), ws, strict=True):  # the chaining changes no value
        np.testing.assert_array_equal(np.asarray(got), np.asarray(xs[w.shape[0]] @ w))
    eqns = jax.make_jaxpr(run)(xs, ws).jaxpr.eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    producer = {v: e for e in eqns for v in e.outvars}

    def depends_on(var, eqn) -> bool:  # whether `var` is computed from `eqn`'s output
        seen, todo = set(), [var]
        while todo:
            e = producer.get(todo.pop())
            if e is None or id(e) in seen:
                continue
            if e is eqn:
                return True
            seen.add(id(e))
            todo += [v for v in e.invars if not isinstance(v, jax.extend.core.Literal)]
        return False

    assert len(dots) == 3
    assert all(depends_on(later.invars[0], earlier) for earlier, later in zip(dots, dots[1:], strict=False))
    assert not depends_on(dots[0].invars[0], dots[1])

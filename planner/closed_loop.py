"""Closed loops as benchmarks run them: N clients with fixed lengths, each sending its next request the moment its
last one ends (`vllm bench serve --max-concurrency N` at an infinite rate, SGLang's `bench_serving` likewise).

Such clients move in waves. All N send at once; their prompts queue behind one another into steps of at most
`chunk_size` tokens (the first wave), so the j-th prompt's first token waits for the j prompts before it. What
follows depends on how the engine mixes work (`ServingConfig.scheduler`):

- "prefill-first" (vLLM V0 without chunked prefill, SGLang): the decodes wait while prompts are prefilled, so
  every request gets its first token during the wave's prefill steps and then all decode together; they end in
  the same step and the next wave is the first one again. TTFT is the prefill steps up to a prompt's own (mean
  about half the wave's), TPOT the decode step plus the wave's later prefill steps spread over the output.
- "mixed" (vLLM V1, jaxserve): decodes run in every step, so the prompts completed in one step of the first
  wave end together and come back together: a cohort. Cohorts settle to the most prompts a step holds beside
  the others' decodes, g = floor((chunk_size - N) / (I - 1)) (N mod g in a last one), each prefilled in one
  step of its own; a prompt longer than a step comes back alone and takes its own chunked steps. TTFT is that
  step (the whole cohort's prompts, not one), TPOT the decode step with the other cohorts' prefill steps spread
  over the output. When the cohorts' prefill steps no longer fit in a client's cycle (N I / (chunk_size - B)
  steps against O), the loop is prefill-bound: every step is a full mixed step, a cycle is N (I + O - 1) /
  chunk_size of them, and a prompt waits the cycle less its own decodes.

Every figure is a sum of step times of the step model, so these are closed forms in the same terms as
`planner.serving`; `planner.simulate` runs the same loops event by event (tests/test_planner_closed_loop.py).
With `Workload.num_prompts` the first wave counts as a benchmark run counts it (its requests first, then the
settled ones); without, only the settled state. Spread lengths break the waves (`planner.serving` then prices a
loop of spread-out arrivals).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.serving_steps import StepCosts
from planner.step_model import prefill_chunk_tokens


@dataclass
class LoopResult:
    """Per-request TTFT and TPOT (s) of one replica's closed loop, its ITL samples, throughput and decode batch."""

    ttft: np.ndarray
    tpot: np.ndarray
    itl: np.ndarray
    requests_per_s: float
    decode_batch: float
    regime: str  # "waves" (prefill-first); mixed: "cohorts", "stream" or "prefill-bound" (see _settled_mixed)
    cohorts: tuple[int, ...] = ()  # settled cohort sizes (mixed)


def first_wave(m: StepCosts, n: int) -> tuple[list[float], list[int], list[int]]:
    """The wave of `n` prompts sent at once: each step's time, each step's decodes, and each prompt's last step
    (0-based). Chunks are cut as the runtime cuts them, oldest prompt first, within the budget left by the decodes
    (none while prompts wait, under "prefill-first")."""
    owed = [int(round(m.wl.computed_input))] * n
    done = [0] * n
    prefix, cfg = float(m.prefix), m.cfg
    mixed = cfg.scheduler == "mixed"
    times: list[float] = []
    decodes_per_step: list[int] = []
    last = [-1] * n
    nxt = 0  # first prompt not yet complete
    while nxt < n:
        decodes = nxt if mixed else 0
        budget = cfg.chunk_size - decodes
        chunks: list[tuple[int, float]] = []
        j = nxt
        while j < n and budget > 0:
            q = prefill_chunk_tokens(int(prefix) + done[j], owed[j] - done[j], budget, cfg.page_size)
            if q <= 0:
                break
            chunks.append((q, prefix + done[j]))
            done[j] += q
            budget -= q
            if done[j] >= owed[j]:
                last[j] = len(times)
            j += 1
        times.append(m.step_s(decodes, chunks))
        decodes_per_step.append(decodes)
        while nxt < n and done[nxt] >= owed[nxt]:
            nxt += 1
    return times, decodes_per_step, last


def _wave_tpot(m: StepCosts, times: list[float], last: int, n: int, out: int) -> float:
    """TPOT of a first-wave prompt completed in step `last`: the wave's later steps (mixed: each gives it a
    token; prefill-first: none does), then decode steps of all `n`."""
    after = times[last + 1:]
    gaps = max(out - 1, 1)
    if m.cfg.scheduler == "mixed":
        rest = max(0, gaps - len(after))
        return (sum(after[:gaps]) + rest * m.t_dec(n)) / gaps
    return (sum(after) + gaps * m.t_dec(n)) / gaps


def _settled_mixed(m: StepCosts, n: int, last: list[int]) -> tuple[list[float], list[float], list[float],
                                                                    list[tuple[float, float]], str, tuple[int, ...]]:
    """A mixed scheduler's loop after its first wave: per-request TTFTs settled and before settling, TPOTs, ITL
    (time, weight) pairs, the regime ("cohorts", "stream" or "prefill-bound") and the settled cohort sizes."""
    wl, cfg = m.wl, m.cfg
    i_c, c, p0 = int(round(wl.computed_input)), cfg.chunk_size, float(m.prefix)
    gaps = max(wl.output_len - 1, 1)
    t_dec, full, room = m.t_dec(n), _full_step(m, n), _room(m, n)
    span = 1 + (i_c - 1) / room  # steps a prompt spans in a stream of full steps
    g = min(max(int((c - n) // (i_c - 1) if i_c > 1 else c - n + 1), 0), n)
    sizes = [g] * (n // g) + ([n % g] if n % g else []) if g >= 1 else [1] * n
    if g >= 1 and len(sizes) <= gaps:  # cohorts of g whole prompts, one step each, settling into idle steps
        own = {k: m.step_s(n - k, [(i_c, p0)] * k) for k in set(sizes)}
        prefill = sum(own[k] for k in sizes)
        ttft = [t for k in sizes for t in [own[k]] * k]
        tpot = [(prefill - own[k] + (gaps - len(sizes) + 1) * t_dec) / gaps for k in sizes for _ in range(k)]
        itl = [(t_dec, gaps - len(sizes) + 1.0)] + [(own[k], 1.0) for k in sizes[1:]]
        return ttft, _unsettled(m, n, last), tpot, itl, "cohorts", tuple(sizes)
    if g >= 1:  # no idle step to settle into: the first wave's groups keep coming back as they were
        ttft = unsettled = _unsettled(m, n, last)
    else:  # a prompt longer than a step: the prompts chain into one stream; its first and last prompts share
        # only one end of their steps (priced alone), as does a prompt whole steps hold exactly
        steps, done = [], 0
        while done < i_c:
            q = prefill_chunk_tokens(int(p0) + done, i_c - done, c - (n - 1), cfg.page_size)
            steps.append(m.step_s(n - 1, [(q, p0 + done)]))
            done += q
        alone, chained = sum(steps), (span * full if i_c % room else sum(steps))
        ttft = unsettled = [alone] + [chained] * (n - 2) + ([alone] if n > 1 else [])
    others = max(0.0, n * i_c / room - span)  # full steps of the others' prompts in one's cycle
    if others <= gaps:
        tpot = [(others * full + (gaps - others) * t_dec) / gaps] * n
        return ttft, unsettled, tpot, [(t_dec, gaps - others), (full, others)], "stream", tuple(sizes)
    # Prefill-bound: every step a full mixed one; a cycle is the tokens of all n over the budget.
    cycle = n * (i_c + gaps) / c
    batch = n * gaps / cycle
    room = max(1, int(c - batch))
    whole, rest = divmod(room, i_c)
    step = m.step_s(int(round(batch)), [(i_c, p0)] * whole + ([(rest, p0 + i_c / 2)] if rest else []))
    ttft = [max(cycle - gaps, 1 + (i_c - 1) / room) * step] * n
    return ttft, ttft, [step] * n, [(step, 1.0)], "prefill-bound", tuple(sizes)


def _room(m: StepCosts, n: int) -> int:
    """Prefill tokens a step holds beside the other n - 1 clients' decodes, cut to whole pages."""
    budget = m.cfg.chunk_size - (n - 1)
    page = m.cfg.page_size
    return max(1, budget // page * page if budget >= page else budget)


def _full_step(m: StepCosts, n: int) -> float:
    """A step whose budget is all prefill (whole prompts, then a part of the next) beside n - 1 decodes."""
    i_c, p0, room = int(round(m.wl.computed_input)), float(m.prefix), _room(m, n)
    if i_c >= room:
        return m.step_s(n - 1, [(room, p0 + i_c / 2)])
    whole, rest = divmod(room, i_c)
    return m.step_s(n - 1, [(i_c, p0)] * whole + ([(rest, p0)] if rest else []))


def _unsettled(m: StepCosts, n: int, last: list[int]) -> list[float]:
    """TTFTs of a wave after the first while its cohorts are still the first wave's groups (the prompts completed
    in one step come back together): a group that fits beside the others' decodes is one step of its own; one
    that does not fills a full step with its whole prompts and a part of the next, which completes in the
    following step, shared with the next group."""
    i_c, p0, c = int(round(m.wl.computed_input)), float(m.prefix), m.cfg.chunk_size
    full = _full_step(m, n)
    ttft: list[float] = []
    for step in sorted(set(last)):
        h = last.count(step)
        if h * i_c + (n - h) <= c:
            ttft += [m.step_s(n - h, [(i_c, p0)] * h)] * h
        else:
            whole = min(h, max(0, (c - (n - h)) // i_c))
            ttft += [full] * whole + [2 * full] * (h - whole)
    return ttft


def lockstep_loop(m: StepCosts, clients: int) -> LoopResult:
    """The closed loop of `clients` clients (one replica) with fixed lengths; see the module docstring.

    Clients beyond the slots (`max_num_seqs`, KV) wait for one: their TTFT adds (clients - slots) / throughput.
    """
    n = max(1, min(int(clients), m.slots))
    out = m.wl.output_len
    gaps = max(out - 1, 1)
    times, decodes, last = first_wave(m, n)
    wave_ttft = [sum(times[:s + 1]) for s in last]
    wave_tpot = [_wave_tpot(m, times, s, n, out) for s in last]
    if m.cfg.scheduler == "prefill-first":
        ttft, tpot, regime, sizes = wave_ttft, wave_tpot, "waves", ()
        itl = [(t, 1.0) for t in times] + [(m.t_dec(n), float(gaps))]
        unsettled = ttft
    else:
        ttft, unsettled, tpot, itl, regime, sizes = _settled_mixed(m, n, last)
    k = m.wl.num_prompts
    if k is None:  # a steady state measured on real hardware: settling needs every step to repeat exactly, which
        ttft = unsettled  # noise undoes; it stays in the first wave's groups (NIM's windows, docs/planner.md)
    cycle = float(np.mean(ttft)) + (out - 1) * float(np.mean(tpot))
    rate = n / cycle
    extra = max(0.0, clients - n) / rate
    # The run as a benchmark measures it: the first wave, then waves in which the prompts still chain into one
    # stream, settling one cohort a wave from the front (the first cohort alone has an idle step before it).
    if k is not None:
        k = max(1, round(k / m.cfg.replicas))
        run_ttft = list(wave_ttft[:min(n, k)])
        wave = 1
        while len(run_ttft) < k:
            settled = min(n, (wave - 1) * (sizes[0] if sizes else n)) if regime == "cohorts" else n
            run_ttft += (ttft[:settled] + unsettled[settled:])[:k - len(run_ttft)]
            wave += 1
        tpot = wave_tpot[:min(n, k)] + (tpot * (-(-k // n)))[:max(0, k - n)]
        ttft = run_ttft
    values = np.array([t for t, _ in itl])
    weights = np.array([w for _, w in itl], dtype=float)
    itl_samples = np.repeat(values, np.maximum(1, np.round(weights / weights.sum() * 400)).astype(int))
    return LoopResult(ttft=np.array(ttft) + extra, tpot=np.array(tpot), itl=itl_samples, requests_per_s=rate,
                      decode_batch=n * (out - 1) * float(np.mean(tpot)) / cycle, regime=regime, cohorts=sizes)

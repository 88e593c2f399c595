"""`jaxserve plan`: a thin click layer over `planner.plan` (rich report, or `--json`)."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from modelspec.memory import DoesNotFitError
from modelspec.spec import PRESETS, ModelSpecError
from planner.api import DEFAULT_CONCURRENCY, PlanRequest, PlanResult
from planner.api import plan as run_plan
from planner.hardware import CATALOG, MOE_KERNELS, HardwareError
from planner.search import ConfigError
from planner.workload import SCHEDULERS

DTYPES = ["bf16", "fp16", "fp8", "int8", "int4", "fp32"]
QUANTIZED_WEIGHTS = ["int8", "fp8"]  # vLLM's --quantization names the planner prices as the weights' dtype


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise click.UsageError(f"{name} must be positive, got {value:g}")


@click.command("plan")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help=f"Preset ({', '.join(PRESETS)}) or an HF config.json / folder holding one.")
@click.option("--hardware", default="h100-sxm", show_default=True,
              help=f"Catalog entry ({', '.join(CATALOG)}) or a hardware profile JSON.")
@click.option("--num-devices", default=None, type=int, help="Devices to plan for (N); default: --tp, or 1.")
@click.option("--input-len", default=1024, show_default=True, type=int, help="Prompt tokens per request.")
@click.option("--output-len", default=256, show_default=True, type=int, help="Output tokens per request.")
@click.option("--spread", default=0.0, show_default=True, type=float,
              help="Length spread: lengths uniform in [L(1-s), L(1+s)].")
@click.option("--prefix-hit", default=0.0, show_default=True, type=float,
              help="Fraction of prompt tokens served from the prefix cache.")
@click.option("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s (total).")
@click.option("--concurrency", "--max-concurrency", "concurrency", type=float, default=None,
              help="Closed-loop clients (total; vLLM's --max-concurrency): each sends its next request when its last "
                   "ends; with --request-rate, a cap on requests in flight; default "
                   f"{DEFAULT_CONCURRENCY} when no rate is given.")
@click.option("--burstiness", default=1.0, show_default=True, type=float,
              help="Gamma shape of the gaps between sends (vLLM's --burstiness): 1 Poisson, <1 burstier, >1 smoother.")
@click.option("--num-prompts", type=int, default=None,
              help="Requests in the benchmark run: its first wave (every client at once) counts, as a bench measures "
                   "it; default: the steady state.")
@click.option("--scheduler", type=click.Choice(SCHEDULERS), default="mixed", show_default=True,
              help="mixed: decodes ride in every step beside prefill chunks (vLLM V1, chunked prefill, TensorRT-LLM, "
                   "jaxserve); prefill-first: prompts get steps of their own while decodes wait (vLLM V0 without "
                   "chunked prefill, SGLang).")
@click.option("--moe-kernels", type=click.Choice(MOE_KERNELS), default="tuned", show_default=True,
              help="MoE kernels tuned for the device (the published mature engines' efficiencies), or untuned (e.g. "
                   "vLLM on ROCm before its fused MoE kernels: compute /3, weight reads /1.6; docs/planner.md).")
@click.option("--ttft-slo-ms", type=float, default=None, help="TTFT SLO for goodput.")
@click.option("--tpot-slo-ms", type=float, default=None, help="TPOT SLO for goodput.")
@click.option("--tp", type=int, default=None, help="Hold the tensor-parallel degree fixed.")
@click.option("--max-num-seqs", type=int, default=None, help="Hold max_num_seqs fixed.")
@click.option("--chunk-size", type=int, default=None, help="Hold the prefill chunk (token budget per step) fixed.")
@click.option("--page-size", default=16, show_default=True, type=int, help="KV page size in tokens.")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(DTYPES), help="Weight dtype.")
@click.option("--kv-dtype", default=None, type=click.Choice(DTYPES), help="KV-cache dtype (default: --dtype).")
@click.option("--quantization", default=None, type=click.Choice(QUANTIZED_WEIGHTS),
              help="vLLM's name: the weights' stored dtype (int8 or fp8), in place of --dtype.")
@click.option("--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(("auto", *DTYPES)),
              help="vLLM's name for --kv-dtype (auto: --dtype, also under --quantization, as vLLM and the runtime).")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=float,
              help="Fraction of device memory for weights + workspace + KV.")
@click.option("--num-scheduler-steps", default=1, show_default=True, type=int,
              help="Decode steps per dispatch (the runtime's flag): the host overhead is paid once per dispatch.")
@click.option("--async-scheduling", is_flag=True,
              help="The overlapped loop (the runtime's flag; a GPU's default): each step's host work runs beside the "
                   "previous step's device work.")
@click.option("--speculative-k", type=int, default=None,
              help="Speculative decoding: drafts verified per step; TPOT at the plan's decode batch (--acceptance).")
@click.option("--acceptance", type=float, default=None, help="Probability that a draft token is accepted, in [0, 1].")
@click.option("--speculative-method", type=click.Choice(["draft_model", "ngram"]), default="draft_model",
              show_default=True, help="Proposer: a draft model (--draft-model) or n-gram lookup (no model).")
@click.option("--draft-model", default=None, help="The draft model: a preset or an HF config.json / folder.")
@click.option("--disaggregate", is_flag=True, help="Also plan separate prefill and decode pools.")
@click.option("--simulate", is_flag=True, help="Check the chosen config with a discrete-event simulation.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the report.")
@click.option("--top", default=5, show_default=True, type=int, help="Candidates shown in the report.")
def plan(model: str, hardware: str, num_devices: int | None, input_len: int, output_len: int, spread: float,
         prefix_hit: float, request_rate: float | None, concurrency: float | None, burstiness: float,
         num_prompts: int | None, scheduler: str, moe_kernels: str, ttft_slo_ms: float | None,
         tpot_slo_ms: float | None, tp: int | None, max_num_seqs: int | None, chunk_size: int | None,
         page_size: int, dtype: str, kv_dtype: str | None, quantization: str | None, kv_cache_dtype: str,
         gpu_memory_utilization: float, num_scheduler_steps: int, async_scheduling: bool, speculative_k: int | None,
         acceptance: float | None, speculative_method: str,
         draft_model: str | None, disaggregate: bool,
         simulate: bool, as_json: bool, top: int) -> None:
    """Plan a deployment: TP, replicas, max_num_seqs, chunk size, and the TTFT/TPOT users will see."""
    if num_devices is None:
        num_devices = tp if tp and tp > 0 else 1
    if kv_cache_dtype != "auto":
        if kv_dtype is not None and kv_dtype != kv_cache_dtype:
            raise click.UsageError(f"--kv-dtype {kv_dtype} and --kv-cache-dtype {kv_cache_dtype} disagree; give one")
        kv_dtype = kv_cache_dtype
    if quantization:  # the weights' codes; an auto KV cache stays in the model's dtype, as in vLLM and the runtime
        kv_dtype, dtype = kv_dtype or dtype, quantization
    if burstiness <= 0:
        raise click.UsageError(f"--burstiness must be positive, got {burstiness:g}")
    for name, v in [("--num-devices", num_devices), ("--input-len", input_len), ("--output-len", output_len),
                    ("--request-rate", request_rate), ("--concurrency", concurrency), ("--tp", tp),
                    ("--max-num-seqs", max_num_seqs), ("--chunk-size", chunk_size), ("--page-size", page_size),
                    ("--ttft-slo-ms", ttft_slo_ms), ("--tpot-slo-ms", tpot_slo_ms),
                    ("--gpu-memory-utilization", gpu_memory_utilization),
                    ("--num-scheduler-steps", num_scheduler_steps), ("--num-prompts", num_prompts)]:
        _positive(name, v)
    if not 0 <= spread < 1 or not 0 <= prefix_hit < 1:
        raise click.UsageError("--spread and --prefix-hit must be in [0, 1)")
    if gpu_memory_utilization > 1:
        raise click.UsageError("--gpu-memory-utilization must be at most 1")
    _positive("--speculative-k", speculative_k)
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise click.UsageError(f"--acceptance must be in [0, 1], got {acceptance:g}")
    req = PlanRequest(model=model, hardware=hardware, num_devices=num_devices, input_len=input_len,
                      output_len=output_len, spread=spread, prefix_hit=prefix_hit, request_rate=request_rate,
                      concurrency=concurrency, burstiness=burstiness, num_prompts=num_prompts, scheduler=scheduler,
                      moe_kernels=moe_kernels, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms, tp=tp,
                      max_num_seqs=max_num_seqs, chunk_size=chunk_size, page_size=page_size, dtype=dtype,
                      kv_dtype=kv_dtype, gpu_memory_utilization=gpu_memory_utilization,
                      num_scheduler_steps=num_scheduler_steps, async_scheduling=async_scheduling,
                      speculative_k=speculative_k, acceptance=acceptance,
                      speculative_method=speculative_method, draft_model=draft_model, disaggregate=disaggregate,
                      simulate=simulate)
    try:
        result = run_plan(req)
    except (ModelSpecError, HardwareError, ConfigError, DoesNotFitError, ValueError) as e:
        raise click.UsageError(str(e).splitlines()[0]) from None
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        report(result, top=top)


def _ms(d: dict[str, float | None]) -> str:
    f = [("-" if v is None else f"{v:.1f}") for v in (d["mean"], d["p50"], d["p90"], d["p99"])]
    return " / ".join(f)


def report(result: PlanResult, top: int = 5, console: Console | None = None) -> None:
    """Print the readable plan: chosen config, predictions, memory, bottleneck, candidates."""
    con = console or Console(width=None if Console().is_terminal else 120)
    j = result.to_json()
    c, p, w = j["config"], j["predicted"], j["workload"]
    arrivals = "Poisson" if w["burstiness"] == 1 else f"gamma, burstiness {w['burstiness']:g}"
    clients = f"{w['concurrency']:g} clients" if w["concurrency"] else ""
    load = (f"{w['request_rate']:g} req/s ({arrivals})" + (f", at most {clients}" if clients else "")
            if w["request_rate"] else clients)
    if w["num_prompts"]:
        load += f", a run of {w['num_prompts']} requests"
    con.print(f"[bold]jaxserve plan[/bold]: {j['model']} on {j['num_devices']} x {j['hardware']}, "
              f"input {w['input_len']} / output {w['output_len']} tokens, {load}"
              + (f", prefix hit {w['prefix_hit']:.0%}" if w["prefix_hit"] else ""))
    con.print(f"[bold]config[/bold]: tp={c['tp']} x replicas={c['replicas']}, max_num_seqs={c['max_num_seqs']}, "
              f"chunk_size={c['chunk_size']}, page_size={c['page_size']}, dtype={c['dtype']}, "
              f"kv_dtype={c['kv_dtype']}")
    t = Table(title="predicted (ms: mean / p50 / p90 / p99)", show_header=False)
    t.add_row("TTFT", _ms(p["ttft_ms"]))
    t.add_row("TPOT", _ms(p["tpot_ms"]))
    t.add_row("ITL", _ms(p["itl_ms"]))
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    t.add_row("throughput", f"{fmt(p['output_tokens_per_s'])} output tok/s, {fmt(p['requests_per_s'])} req/s "
              f"(capacity {fmt(p['capacity_requests_per_s'])} req/s, load {fmt((p['load'] or 0) * 100)}%)")
    t.add_row("goodput", f"{fmt(p['goodput_requests_per_s'])} req/s meeting the SLOs")
    t.add_row("steps", f"decode {fmt(p['step_ms']['decode'])} ms at batch {fmt(p['decode_batch'])} "
              f"(roofline floor {fmt(p['roofline_decode_step_ms'])}); "
              f"prefill chunk {fmt(p['step_ms']['prefill_chunk'])} ms")
    m = p["memory_gib"]
    t.add_row("memory/device", f"weights {m['weights']:.1f} GiB, KV {m['kv']:.1f} GiB, activations "
              f"{m['activations']:.2f} GiB, total {m['total']:.1f} GiB")
    t.add_row("KV capacity", f"{p['kv_capacity_tokens']:,} tokens, {p['max_concurrency']} sequences at "
              f"{w['input_len'] + w['output_len']} tokens")
    con.print(t)
    con.print(f"[bold]bottleneck[/bold]: {p['bottleneck']}")
    d = j["disaggregated"]
    if d:
        con.print(f"[bold]disaggregated[/bold]: prefill {d['prefill']['instances']} x tp{d['prefill']['tp']}, "
                  f"decode {d['decode']['instances']} x tp{d['decode']['tp']} (P:D devices {d['pd_ratio']}), "
                  f"KV transfer {d['kv_transfer_ms']:.2f} ms/request, goodput/device {d['goodput_per_device']:.3f}"
                  f" vs colocated {d['colocated_goodput_per_device']:.3f}")
        con.print(f"  compares {d['compared']}")
        con.print(f"[bold]as servers[/bold]: {d['prefill']['instances']} x `jaxserve serve --disaggregation-mode "
                  f"prefill --tensor-parallel-size {d['prefill']['tp']}`, {d['decode']['instances']} x `jaxserve serve "
                  f"--disaggregation-mode decode --tensor-parallel-size {d['decode']['tp']}`, behind `jaxserve router "
                  f"--pd-disaggregation` (docs/disaggregation.md)")
    if j["simulated"]:
        s = j["simulated"]
        con.print(f"[bold]simulated[/bold]: TTFT {_ms(s['ttft_ms'])}; TPOT {_ms(s['tpot_ms'])}")
    sp = j["speculative"]
    if sp:
        con.print(f"[bold]speculative[/bold] ({sp['method']}, k={sp['k']}, acceptance {sp['acceptance']:g}): TPOT "
                  f"{sp['tpot_ms']:.2f} ms against {sp['decode_step_ms']:.2f} ms ({sp['speedup']:.2f}x; "
                  f"{sp['tokens_per_step']:.2f} tokens a verify step of {sp['verify_step_ms']:.2f} ms + proposer "
                  f"{sp['proposer_ms']:.2f} ms); best k {sp['best_k']} at {sp['best_tpot_ms']:.2f} ms")
    for note in j["notes"]:
        con.print(f"[yellow]note[/yellow]: {note}")
    ct = Table(title=f"top {min(top, len(j['candidates']))} of {len(j['candidates'])} candidates")
    for col in ("tp", "replicas", "max_num_seqs", "chunk", "TTFT mean", "TPOT mean", "ITL p99", "req/s",
                "goodput/dev"):
        ct.add_column(col, justify="right")
    for cand in j["candidates"][:top]:
        ct.add_row(str(cand["tp"]), str(cand["replicas"]), str(cand["max_num_seqs"]), str(cand["chunk_size"]),
                   fmt(cand["ttft_ms_mean"]), fmt(cand["tpot_ms_mean"]), fmt(cand["itl_ms_p99"]),
                   fmt(cand["requests_per_s"]), f"{cand['goodput_per_device'] or 0:.3f}")
    con.print(ct)

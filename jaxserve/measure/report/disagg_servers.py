"""The report's disaggregated part measured as separate server processes (docs/disaggregation.md).

One `jaxserve serve --disaggregation-mode prefill` server (TP P) and one `--disaggregation-mode decode` server (TP
D, its prefill server named by `--prefill-url`), each pinned to cores of its own (on a CPU: the first P cores this
process may use for the prefill server, the next D for the decode server; each server sees as many CPU devices as
it has cores), with the report's engine flags for the part: step budget and chunk one prompt, context prompt +
output, the synchronous loop (as calibrated). The burst goes to the decode server as OpenAI completions
(`measure/bench/http_client.py`); each server's busy time and work are the deltas of its `/metrics` pool counters
over the burst (`jaxserve:prefill_busy_seconds_total`, ...: `engine/pool_stats.StepPoolCounters`), the KV moved
those of the decode server's `/disagg/info`. The servers are stopped (their process groups) however the part ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

import jaxserve
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.pool_stats import POOL_COUNTERS
from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.http_client import run_http
from jaxserve.measure.bench.load import LoadConfig
from jaxserve.measure.report.context import avoid_tokens
from jaxserve.measure.report.disagg import PoolRun, pool_rows

METRIC_PREFIX = "jaxserve:"
KV_COUNTERS = ("kv_imports", "kv_import_bytes", "kv_pull_seconds", "kv_insert_seconds")
READY_TIMEOUT_S = 1800.0  # a first start compiles every bucket: minutes for `small` on a shared 2-core machine


def parse_counters(text: str, names: tuple[str, ...] | list[str]) -> dict[str, float]:
    """The `jaxserve:NAME_total` counters of a Prometheus exposition, summed over labels, by NAME; ValueError
    naming the first of `names` the text lacks."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.startswith(METRIC_PREFIX) and name.endswith("_total"):
                key = name[len(METRIC_PREFIX):-len("_total")]
                if key in names:
                    out[key] = out.get(key, 0.0) + sample.value
    missing = [n for n in names if n not in out]
    if missing:
        raise ValueError(f"the server's /metrics has no {METRIC_PREFIX}{missing[0]}_total (not a disaggregation "
                         "role server of this version?)")
    return out


def server_flags(cfg, port: int) -> list[str]:
    """`jaxserve serve` flags shared by both roles: the part's engine (as `disagg_engine.engine_config`)."""
    n = cfg.disagg_input_len
    flags = ["--model", cfg.model, "--dtype", cfg.dtype, "--seed", str(cfg.seed), "--host", "127.0.0.1",
             "--port", str(port), "--max-num-seqs", str(cfg.disagg_max_num_seqs), "--max-num-batched-tokens", str(n),
             "--chunk-size", str(n), "--max-model-len", str(n + cfg.disagg_output_len), "--no-async-scheduling"]
    return flags + (["--kv-cache-memory", str(cfg.kv_cache_memory)] if cfg.kv_cache_memory else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], cores: Sequence[int], log_path: Path, command: str = "serve") -> subprocess.Popen:
    """`jaxserve COMMAND ARGS` importing this tree, in its own process group, pinned to `cores` with as many CPU
    devices (the report runs pools as such processes where its policy says so: `pools_as_pinned_processes`)."""
    env = dict(os.environ)
    tree = str(Path(jaxserve.__file__).resolve().parents[1])  # the servers run the code this report runs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "jaxserve", command, *args]
    taskset = shutil.which("taskset")
    if len(cores) > 1:  # JAX's own flag: one CPU device per pinned core (TP over them)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={len(cores)}"
    if taskset:
        cmd = [taskset, "-c", ",".join(map(str, cores)), *cmd]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if not taskset:  # before the interpreter starts its threads, which inherit the mask
        os.sched_setaffinity(proc.pid, cores)
    return proc


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop a server started by `launch` and whatever it started (its process group): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    with contextlib.suppress(ProcessLookupError):  # children left behind by a server that exited on its own
        os.killpg(proc.pid, signal.SIGKILL)


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until `url`/health answers 200; RuntimeError, naming the log, if the server exits or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}: {tail[0]} (log {log_path})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server for {url} was not ready in {timeout_s:.0f} s (log {log_path})")


def calibrate_pinned(cfg, cores: Sequence[int], out: Path, log=print) -> Path:
    """A hardware profile of `cfg`'s model measured by `jaxserve calibrate` pinned to `cores` (a pool's server
    runs on those alone: a profile of all the cores prices its steps too fast), on the engine the report
    calibrates on every core (`cfg.engine_config()`: its weights, KV dtype, sequences and step budget); its path.
    ValueError, with the log's last line, when calibration fails."""
    e = cfg.engine_config()
    args = ["--model", e.model, "--dtype", e.dtype, "--seed", str(e.seed), "--out", str(out),
            "--max-num-seqs", str(e.max_num_seqs), "--max-num-batched-tokens", str(e.max_num_batched_tokens),
            "--chunk-size", str(e.chunk_size), "--kv-cache-dtype", e.kv_cache_dtype,
            *(["--quantization", e.quantization] if e.quantization else []), *(["--quick"] if cfg.quick else []),
            *(["--kv-cache-memory", str(e.kv_cache_memory)] if e.kv_cache_memory else [])]
    log_path = out.with_suffix(".log")
    t0 = time.monotonic()
    proc = launch(args, cores, log_path, command="calibrate")
    try:
        code = proc.wait()
    finally:
        stop(proc)
    if code != 0 or not out.is_file():
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise ValueError(f"calibration pinned to cores {cores} failed (exit {code}): {lines[-1] if lines else ''}")
    log(f"calibrated on cores {cores} alone in {time.monotonic() - t0:.0f} s: {out}")
    return out


@contextlib.contextmanager
def role_servers(cfg, prefill_cores: Sequence[int], decode_cores: Sequence[int],
                 log=print) -> Iterator[dict[str, Any]]:
    """A prefill and a decode server of the part, ready; yields their urls, cores, pids and logs; stops both."""
    logs = Path(tempfile.mkdtemp(prefix="jaxserve-report-disagg-"))
    ports = {"prefill": free_port(), "decode": free_port()}
    url = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    tp = {"prefill": len(prefill_cores), "decode": len(decode_cores)}
    # Each role compiles into a folder of its own: the two start side by side, and where jax's cache class is not
    # the one the engine makes write whole entries, one could read an entry the other is writing (docs/tuning.md).
    cache = os.path.expanduser(EngineConfig.compilation_cache_dir)
    extra = {role: ["--compilation-cache-dir", os.path.join(cache, f"disagg-{role}")] for role in ("prefill", "decode")}
    extra["decode"] += ["--prefill-url", url["prefill"]]
    cores = {"prefill": prefill_cores, "decode": decode_cores}
    procs: dict[str, subprocess.Popen] = {}
    t0 = time.monotonic()
    try:
        for role in ("prefill", "decode"):
            args = [*server_flags(cfg, ports[role]), "--tensor-parallel-size", str(tp[role]),
                    "--disaggregation-mode", role, *extra[role]]
            procs[role] = launch(args, cores[role], logs / f"{role}.log")
        for role in procs:
            wait_ready(url[role], procs[role], logs / f"{role}.log")
        log(f"prefill and decode servers ready in {time.monotonic() - t0:.0f} s (cores {prefill_cores} and "
            f"{decode_cores}; logs in {logs})")
        yield {"urls": url, "cores": cores, "pids": {r: p.pid for r, p in procs.items()}, "logs": str(logs)}
    finally:
        for proc in procs.values():
            stop(proc)


def scrape(url: str) -> dict[str, float]:
    """A role server's pool counters (`/metrics`) and, from a decode server, its KV counters (`/disagg/info`)."""
    out = parse_counters(httpx.get(url + "/metrics", timeout=30).text, [*POOL_COUNTERS, "process_cpu_seconds"])
    info = httpx.get(url + "/disagg/info", timeout=30).json()
    return out | {k: float(info["counters"][k]) for k in KV_COUNTERS if k in info["counters"]}


def run_disagg_servers(ctx) -> list[dict[str, Any]]:
    """Rows of kind `disagg` (`disagg.pool_rows`), measured on a prefill server and a decode server."""
    cfg = ctx.cfg
    p, d = cfg.disagg
    cores = ctx.facts.cores
    if p + d > len(cores):
        raise ValueError(f"--disagg {p}+{d} as server processes needs {p + d} cores; this process may use "
                         f"{len(cores)}")
    with role_servers(cfg, cores[:p], cores[p:p + d], log=ctx.log) as servers:
        url = servers["urls"]

        def burst(num: int, seed: int):
            reqs = generate(DatasetConfig(name="random", num_prompts=num, input_len=cfg.disagg_input_len,
                                          output_len=cfg.disagg_output_len, seed=seed), ctx.spec.vocab_size,
                            avoid_tokens(ctx))
            return run_http(url["decode"], reqs, LoadConfig(), timeout_s=READY_TIMEOUT_S)

        burst(2, cfg.seed + 5)  # first-run effects (transfers, host paths) stay out of the measurement
        before = {role: scrape(u) for role, u in url.items()}
        run = burst(cfg.disagg_num_prompts, cfg.seed + 6)
        after = {role: scrape(u) for role, u in url.items()}
    delta = {role: {k: after[role][k] - before[role][k] for k in after[role]} for role in after}
    failed = [r.error for r in run.records if not r.success]
    if failed:
        ctx.log(f"disagg {p}+{d}: {len(failed)} of {len(run.records)} requests failed, first: {failed[0]}")
    counters = {k: delta[k.split("_", 1)[0]][k] for k in POOL_COUNTERS}  # each pool's counters from its server
    kv = delta["decode"]
    completed = sum(r.success and r.output_len == cfg.disagg_output_len for r in run.records)
    return pool_rows(ctx, PoolRun(mode="processes", counters=counters, duration=run.duration, completed=completed,
                                  kv_transfers=int(kv.get("kv_imports", 0)), kv_bytes=kv.get("kv_import_bytes", 0.0),
                                  kv_seconds=kv.get("kv_pull_seconds", 0.0) + kv.get("kv_insert_seconds", 0.0),
                                  cpu_seconds={role: delta[role]["process_cpu_seconds"] for role in delta},
                                  config={"prefill_cores": servers["cores"]["prefill"],
                                          "decode_cores": servers["cores"]["decode"],
                                          "server_pids": servers["pids"], "server_urls": url,
                                          "server_logs": servers["logs"]}))

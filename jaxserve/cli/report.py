"""`jaxserve report`: the click command over `jaxserve.measure.report.run.run_report`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from jaxserve.cli.log_setup import setup_logging
from jaxserve.cli.output_paths import check_writable
from jaxserve.config.engine import KV_CACHE_DTYPES, QUANTIZATIONS, RUNTIME_DTYPES
from jaxserve.config.speculative import parse_speculative_config


def _pools_option(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    from jaxserve.measure.report.disagg import pools_option  # JAX loads when the command runs, not for --help

    return pools_option(ctx, param, value)


@click.command("report")
@click.option("--model", default="small", show_default=True, help="Preset or HF checkpoint folder.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(RUNTIME_DTYPES))
@click.option("--quantization", default=None, type=click.Choice(QUANTIZATIONS),
              help="The engine's weights as int8 or fp8 codes (vLLM's flag); calibrated and priced as such.")
@click.option("--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(KV_CACHE_DTYPES),
              help="The engine's KV pages (vLLM's flag); calibrated and priced as such.")
@click.option("--profile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A calibrated hardware profile (default: calibrate now, into DIR/profile.json).")
@click.option("--out", "out_dir", default="reports/report", show_default=True, type=click.Path(file_okay=False))
@click.option("--quick", is_flag=True, help="Tiny sizes everywhere (tests, smoke runs).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--batch-sizes", default=None, help="Grid batch sizes, comma-separated.")
@click.option("--context-lens", default=None, help="Grid context lengths, comma-separated.")
@click.option("--long-prompt-len", default=None, type=click.IntRange(min=16))
@click.option("--load-num-prompts", default=None, type=click.IntRange(min=2))
@click.option("--disagg", default=None, metavar="P+D", callback=_pools_option,
              help="Also serve a burst on P prefill + D decode devices and compare each pool's capacity with the "
                   "planner's (on a CPU: a prefill and a decode server process pinned to P and D cores of their "
                   "own, at most the cores).")
@click.option("--disagg-in-process", is_flag=True,
              help="With --disagg: measure the disaggregated engine in this process (on a CPU: P + D fake devices "
                   "sharing the cores) instead of server processes.")
@click.option("--disagg-only", is_flag=True,
              help="With --disagg: only that part (no grid, loads or chunked prefill); with --profile, no "
                   "calibration either.")
@click.option("--speculative-config", default=None, metavar="JSON",
              help="Also one request's TPOT with this speculative decoding (vLLM's JSON) against the planner's.")
def report_command(model: str, dtype: str, quantization: str | None, kv_cache_dtype: str, profile: str | None,
                   out_dir: str, quick: bool, seed: int,
                   batch_sizes: str | None, context_lens: str | None, long_prompt_len: int | None,
                   load_num_prompts: int | None, disagg: tuple[int, int] | None, disagg_in_process: bool,
                   disagg_only: bool, speculative_config: str | None) -> None:
    """Measured vs predicted: calibrate, grid, two loads, chunked prefill (+ --disagg); DIR/report.*."""
    from jaxserve.measure.report.context import ReportConfig, fmt
    from jaxserve.measure.report.run import run_report
    from jaxserve.platform.devices import provide_devices

    if (disagg_in_process or disagg_only) and not disagg:
        raise click.UsageError("--disagg-in-process and --disagg-only go with --disagg P+D")
    if disagg and (quantization or kv_cache_dtype != "auto"):
        raise click.UsageError("--quantization and --kv-cache-dtype run on one device; drop --disagg")
    if disagg:  # before anything starts JAX: on CPU the devices are created with the backend
        try:
            provide_devices(*disagg)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    check_writable(out_dir, is_dir=True)
    cfg = ReportConfig.quick_config(model) if quick else ReportConfig(model=model)
    cfg = replace(cfg, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype, seed=seed, disagg=disagg,
                  disagg_in_process=disagg_in_process, disagg_only=disagg_only, speculative=speculative_config)
    if speculative_config:
        try:
            parse_speculative_config(speculative_config)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    try:
        if batch_sizes:
            cfg = replace(cfg, batch_sizes=tuple(int(v) for v in batch_sizes.split(",")))
            cfg = replace(cfg, max_num_seqs=max(cfg.max_num_seqs, *cfg.batch_sizes))
        if context_lens:
            cfg = replace(cfg, context_lens=tuple(int(v) for v in context_lens.split(",")))
    except ValueError:
        raise click.UsageError("--batch-sizes and --context-lens take comma-separated integers") from None
    if long_prompt_len:
        cfg = replace(cfg, long_prompt_len=long_prompt_len)
    if load_num_prompts:
        cfg = replace(cfg, load_num_prompts=load_num_prompts)
    setup_logging()  # the engines' start-up progress (kernels, compiles) on the log
    try:
        report = run_report(cfg, out_dir, profile, log=lambda m: click.echo(m, err=True))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    s = report["summary"]
    click.echo(Path(out_dir, "report.md").read_text())
    click.echo(f"median |error|: TTFT {fmt(s['median_abs_error_ttft_pct'], '.2f')}%, "
               f"TPOT {fmt(s['median_abs_error_tpot_pct'], '.2f')}% "
               f"-> {out_dir}/report.json, report.md, report.png ({report['seconds']:.0f} s)")

"""`jaxserve calibrate`: the click command, its progress bar and its summary table."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jaxserve.cli.engine_flags import config_from_options, engine_options
from jaxserve.cli.log_setup import setup_logging
from jaxserve.cli.output_paths import check_writable
from planner.hardware import GIGA

if TYPE_CHECKING:
    from jaxserve.measure.calibrate.calibrate import Calibration, CalibrationConfig


def summary_rows(cal: Calibration) -> list[tuple[str, str]]:
    """(name, value) lines for the terminal."""
    hw, c = cal.hardware, cal.hardware.coefficients
    rows = [("device", cal.measurements["device"]),
            ("memory bandwidth", f"{hw.memory_bw / GIGA:.1f} GB/s"),
            (f"matmul peak ({cal.measurements['compute_dtype']})", f"{hw.peak(cal.dtype) / GIGA:.1f} GFLOP/s"),
            ("weights / KV priced in", f"{cal.dtype} / {cal.kv_dtype}"),
            ("step-time fit", f"median |err| {cal.fit.median_abs_error:.1%}, max {cal.fit.max_abs_error:.1%} "
                              f"({len(cal.samples)} steps)")]
    rows += [(k, f"{v:.4g}") for k, v in asdict(c).items()]
    rows.append(("--num-scheduler-steps (recommended)", str(cal.measurements["recommended_num_scheduler_steps"])))
    rows.append(("took", f"{cal.seconds:.0f} s"))
    return rows


def run_with_progress(engine, cfg: CalibrationConfig, seed: int = 0) -> Calibration:
    """`calibrate` under a rich progress bar."""
    from jaxserve.measure.calibrate.calibrate import calibrate

    with Progress(TextColumn("{task.description:<55}"), BarColumn(), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("calibrating", total=1.0)
        return calibrate(engine, cfg, lambda phase, frac: bar.update(task, description=phase, completed=frac),
                         seed=seed)


@click.command("calibrate")
@engine_options
@click.option("--out", default="profile.json", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the hardware profile JSON.")
@click.option("--quick", is_flag=True, help="Tiny measurement sizes (tests, smoke runs).")
def calibrate_command(out: str, quick: bool, **options) -> None:
    """Measure this device and the engine; write a hardware profile for `jaxserve plan --hardware`."""
    from jaxserve.engine.llm_engine import LLMEngine  # JAX loads here, not for --help
    from jaxserve.measure.calibrate.calibrate import CalibrationConfig

    check_writable(out)
    seed = options["seed"]
    config = config_from_options(options)
    if config.async_scheduling:  # each step is timed around one `step()` call, which overlap would blur
        raise click.UsageError("calibrate times the synchronous engine loop; drop --async-scheduling")
    config.async_scheduling = False  # unset: not the platform's default either (a GPU's is the overlapped loop)
    setup_logging()  # the engine's start-up progress (kernels, compiles) on the log
    t0 = time.monotonic()
    try:
        engine = LLMEngine(config)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"engine ready in {time.monotonic() - t0:.1f} s", err=True)
    cal = run_with_progress(engine, CalibrationConfig.quick() if quick else CalibrationConfig(), seed)
    cal.save(out)
    table = Table(title=f"calibrated profile -> {out}", show_header=False)
    for name, value in summary_rows(cal):
        table.add_row(name, value)
    Console().print(table)

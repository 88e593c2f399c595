"""Whole engine steps with the matmul kernels of two revisions, built in one process and timed alternately.

    python scripts/bench_step_ab.py --base eba4aed~1 --batch 1 --modes sync,async
    python scripts/bench_step_ab.py --base eba4aed~1 --batch 16 --modes sync
    python scripts/bench_step_ab.py --base 2c28345 --batch 1 --modes sync,async --kernel-every-row
    python scripts/bench_step_ab.py --row-parts --batch 1 --modes sync,async

`--base REV`'s `matmul.cc` (with its headers, from `git show`) is built into a library of its own and
registered under targets of its own; engines traced while `jaxserve.kernels.cpu.matmul`'s targets name them run
REV's matmuls, everything else the working tree's. Each variant (base or working tree) and mode (synchronous or
asynchronous scheduling) is one engine (`--model`, float32, a 256 MiB KV pool) with `--batch` requests decoding
after `--prompt-len`-token prompts. Rounds alternate the engines and time `--steps` steps each, so a machine
that slows down mid-run slows all of them; the script prints each engine's median step and rounds, and the
median over rounds of its time over the first engine's. Unlike `bench_forward_ab.py` this times whole steps:
host work, both jitted calls, and the overlap of asynchronous scheduling.

`--row-parts` compares the working tree with itself instead: engines whose start-up plan cuts a one-row
projection into the part count it measured fastest (`KernelPlan.row_parts`) against engines with the kernel's
default (16 parts).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.platform import kernel_choice

MATMUL_FILES = ("matmul.cc", "pool.h", "vec.h")


def register_base_matmul(rev: str) -> tuple[str, str]:
    """Build REV's matmul kernels and register them with XLA; their two target names."""
    folder = Path(tempfile.mkdtemp(prefix="jaxserve-ab-"))
    for name in MATMUL_FILES:
        text = subprocess.run(["git", "show", f"{rev}:jaxserve/kernels/cpu/{name}"], capture_output=True, text=True,
                              check=True).stdout
        (folder / name).write_text(text)
    lib_path = folder / "base_matmul.so"
    subprocess.run(["c++", *cpu_kernels.FLAGS, f"-I{jax.ffi.include_dir()}", str(folder / "matmul.cc"), "-o",
                    str(lib_path)], capture_output=True, text=True, check=True)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    targets = ("ab_base_matmul", "ab_base_matmul_nt")
    for target, symbol in zip(targets, ("JaxserveMatmul", "JaxserveMatmulNT"), strict=True):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return targets


def decoding_engine(args: argparse.Namespace, targets: tuple[str, str], async_scheduling: bool) -> LLMEngine:
    """An engine whose forward and sampler were traced with `targets` as the matmuls, `--batch` requests decoding."""
    cpu_matmul.TARGET, cpu_matmul.TARGET_NT = targets
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(16, args.batch), kv_cache_memory=2**28,
                                    warmup=False, async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0, max_tokens=(args.rounds + 1) * (args.steps + 3) + 16, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [(i + j) % 1000 + 1 for j in range(args.prompt_len)], params)
    while True:  # until every request decodes
        engine.step()
        last = engine.last_step
        if last is not None and not last.num_prefill_tokens and last.num_decode_tokens >= args.batch:
            break
    for _ in range(3):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="git revision whose matmul.cc is the baseline")
    ap.add_argument("--row-parts", action="store_true",
                    help="instead of --base: the plan's one-row part count against the kernel's default")
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--modes", default="sync", help="comma-separated: sync, async")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernel-every-row", action="store_true",
                    help="both engines run the matmul kernel at every row count it takes, not where the start-up "
                         "plan measured it faster than XLA: the A/B then compares the two kernels")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"sync", "async"}:
        ap.error("--modes takes sync and/or async")
    if not cpu_kernels.available():
        ap.error("jaxserve's CPU kernels are not available here")
    if (args.base is None) == (not args.row_parts):
        ap.error("give one of --base REV and --row-parts")
    if args.row_parts:
        return compare_row_parts(args, modes)
    try:
        base = register_base_matmul(args.base)
    except subprocess.CalledProcessError as e:
        ap.error(f"cannot build {args.base}'s matmul kernels: {(e.stderr or '').strip().splitlines()[-1:]}")
    if args.kernel_every_row:
        rows = frozenset(range(1, cpu_matmul.MAX_ROWS + 1))
        plan = KernelPlan(cpu_kernels.isa() or "", rows, rows)
        kernel_choice.choose = lambda *_, **__: plan  # the policy asks this module at start-up
    ours = (cpu_matmul.TARGET, cpu_matmul.TARGET_NT)
    engines = {(name, mode): decoding_engine(args, targets, mode == "async")
               for name, targets in ((f"base {args.base}", base), ("working tree", ours)) for mode in modes}
    cpu_matmul.TARGET, cpu_matmul.TARGET_NT = ours
    alternate(args, engines)


def compare_row_parts(args: argparse.Namespace, modes: list[str]) -> None:
    """The working tree's engines: the plan's one-row part count, and the kernel's default."""
    ours = (cpu_matmul.TARGET, cpu_matmul.TARGET_NT)
    choose = kernel_choice.choose
    engines = {}
    for name, parts in (("plan's parts", None), ("default parts", 0)):
        if parts is not None:  # the policy asks this module at start-up
            kernel_choice.choose = lambda *a, p=parts, **k: dataclasses.replace(choose(*a, **k), row_parts=p)
        for mode in modes:
            engines[name, mode] = decoding_engine(args, ours, mode == "async")
        kernel_choice.choose = choose
    print(f"plan: {engines[next(iter(engines))].runner.ops.matmul.plan.describe()}")
    alternate(args, engines)


def alternate(args: argparse.Namespace, engines: dict[tuple[str, str], LLMEngine]) -> None:
    """Rounds over the engines, `--steps` steps each after three untimed ones; prints each engine's medians."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    for _ in range(args.rounds):
        for key, engine in engines.items():
            for _ in range(3):
                engine.step()
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[key].append((time.perf_counter() - t) / args.steps * 1e3)
    first = np.array(next(iter(times.values())))
    print(f"{args.model}, {args.batch} decoding after {args.prompt_len}-token prompts, {args.rounds} rounds of "
          f"{args.steps} steps:")
    for (name, mode), ms in times.items():
        ratio = float(np.median(np.array(ms) / first))
        print(f"  {name:>24s} {mode:5s}: median {np.median(ms):6.2f} ms a step ({ratio:.3f}x the first); rounds "
              + " ".join(f"{m:.1f}" for m in ms))


if __name__ == "__main__":
    main()

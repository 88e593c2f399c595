"""Time loading a model from HF safetensors vs from our converted (orbax) folder.

    python scripts/bench_load.py --model small --dir /tmp/jaxserve-load-bench

Writes the preset's seeded random weights as an HF safetensors folder (sharded like real checkpoints), converts
it, then loads each `--repeat` times, interleaved (best reported; the machine is shared), and checks that the
params agree.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxserve.model.checkpoint import convert, load_checkpoint, save_hf_checkpoint
from jaxserve.model.llama import LlamaForCausalLM
from modelspec.spec import PRESETS, load_model_spec


def timed_load(folder: Path) -> tuple[float, LlamaForCausalLM]:
    t0 = time.perf_counter()
    model = load_checkpoint(folder, load_model_spec(str(folder)), "float32")
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - t0, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--dir", default="/tmp/jaxserve-load-bench")
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    spec = PRESETS[args.model]
    model = LlamaForCausalLM(spec, "float32", rngs=nnx.Rngs(0))
    save_hf_checkpoint(model, spec, root / "hf", max_shard_bytes=args.shard_mb * 2**20)
    convert(root / "hf", root / "converted")
    size = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors")) / 2**20
    t_hf = t_conv = float("inf")
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        t, from_hf = timed_load(root / "hf")
        t_hf = min(t_hf, t)
        t, from_conv = timed_load(root / "converted")
        t_conv = min(t_conv, t)
    a = nnx.to_flat_state(nnx.state(from_hf, nnx.Param))
    b = dict(nnx.to_flat_state(nnx.state(from_conv, nnx.Param)))
    assert all(np.array_equal(np.asarray(v.get_value()), np.asarray(b[k].get_value())) for k, v in a)
    print(f"{args.model}: {size:.0f} MiB float32")
    print(f"  HF safetensors: {t_hf:.2f} s   converted (orbax): {t_conv:.2f} s   ({t_hf / t_conv:.1f}x)")


if __name__ == "__main__":
    main()

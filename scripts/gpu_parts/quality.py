"""Part `quality` (issue 42 item 1): bard's perplexity in bf16 and each quantized mode, and greedy agreement.

Perplexity through the command itself, `python3 -m jaxserve eval perplexity --model bard --json` (bard's held-out
text), once per mode (bf16; `--quantization fp8`; `--quantization int8`; `--kv-cache-dtype fp8`), the four
processes side by side (only their results matter here, not their speed). Meanwhile, in this process, each
mode's greedy continuations of held-out passages against bf16's (`measure.eval.agreement`). Target: each
quantized mode's perplexity within 1% of bf16's (<= 1.01x); agreement reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from jaxserve.engine.llm import LLM
from jaxserve.measure.eval.agreement import agreement_counts, greedy_tokens
from modelspec.spec import resolve_model_path
from scripts.gpu_parts.common import Part

MODES = (("bf16", []), ("fp8 weights", ["--quantization", "fp8"]), ("int8 weights", ["--quantization", "int8"]),
         ("fp8 KV", ["--kv-cache-dtype", "fp8"]))
KV_BYTES = 256 * 2**20  # bard's 512-token context needs ~1 MiB a sequence: small, so four processes share a device


def engine_flags(part: Part, flags: list[str]) -> dict:
    """A mode's CLI flags as `LLM(...)` arguments."""
    s = part.sizes
    args = {"model": s.quality_model, "dtype": s.quality_dtype, "kv_cache_memory": KV_BYTES, "max_num_seqs": 8,
            "max_num_batched_tokens": s.eval_batched_tokens, "token_buckets": (8, s.eval_batched_tokens),
            "seq_buckets": (1, 8)}  # two buckets: the prompts' step and the decodes' (fewer compiles)
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        args[name.lstrip("-").replace("-", "_")] = value
    return args


def start_perplexity(part: Part, flags: list[str], data: str) -> subprocess.Popen:
    s = part.sizes
    cmd = [sys.executable, "-m", "jaxserve", "eval", "perplexity", "--model", s.quality_model, "--dtype",
           s.quality_dtype, "--kv-cache-memory", str(KV_BYTES), "--max-num-seqs", "8", "--max-num-batched-tokens",
           str(s.eval_batched_tokens), "--data", data, "--json", *flags]
    if s.eval_max_len:
        cmd += ["--max-len", str(s.eval_max_len)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_perplexity(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=max(1.0, timeout))
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    part = Part("quality", __doc__.splitlines()[0], 45)
    s = part.sizes
    data = "held-out"
    held = Path(resolve_model_path(s.quality_model)) / "held_out.txt"
    text = held.read_text()
    if s.eval_chars:  # the smoke run: the opening of the held-out text
        data = str(part.out / "quality_eval.txt")
        Path(data).write_text(text[: s.eval_chars])
    modes = MODES[: s.quality_modes]
    waiting = list(modes)
    procs: dict[str, subprocess.Popen] = {}

    def start(n: int) -> None:  # keep up to `n` perplexity processes running
        while waiting and sum(p.poll() is None for p in procs.values()) < n:
            label, flags = waiting.pop(0)
            procs[label] = start_perplexity(part, flags, data)
            part.log(f"perplexity {label}: `jaxserve eval perplexity` started")

    start(s.eval_jobs)
    greedy: dict[str, list[list[int]]] = {}
    for label, flags in modes:
        def run(label=label, flags=flags) -> dict:
            t = time.perf_counter()
            llm = LLM(**engine_flags(part, flags))
            passages = [text[i * 500: i * 500 + 400] for i in range(s.greedy_prompts)]
            prompts = [llm.tokenizer.encode(p, add_special_tokens=False)[:32] for p in passages]
            greedy[label] = greedy_tokens(llm, prompts, s.greedy_tokens)
            return {"seconds": time.perf_counter() - t, "prompts": len(prompts)}

        part.run(f"greedy {label}", run, need_s=5)
        start(s.eval_jobs)
    for label in greedy:
        if label != "bf16" and "bf16" in greedy:
            before, equal, total = agreement_counts(greedy[label], greedy["bf16"])
            part.record["results"][f"agreement {label}"] = {"before_first_divergence": before / total,
                                                            "equal_anywhere": equal / total, "tokens": total}
            part.figure(f"greedy agreement with bf16, {label} (positions before the first divergence)",
                        before / total, "", None, None, "42")
    ppl = {}
    for label, _ in modes:
        while label not in procs and part.left() > 0:  # one at a time: start the next when one ends
            start(s.eval_jobs)
            time.sleep(0.2)
        if label not in procs:
            part.record["skipped"].append(f"perplexity {label}: not started within the budget")
            continue
        proc = procs[label]
        r = part.run(f"perplexity {label}", lambda proc=proc: finish_perplexity(proc, part.left()))
        if proc.poll() is None:
            proc.kill()
        if r is not None:
            ppl[label] = r["perplexity"]
    for label, _ in modes[1:]:
        value = ppl[label] / ppl["bf16"] if label in ppl and "bf16" in ppl else None
        part.figure(f"bard perplexity, {label} / bf16", value, "x", "<=", 1.01, "42")
    part.finish()


if __name__ == "__main__":
    main()

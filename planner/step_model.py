"""Time of one engine step: per-layer, per-operation FLOPs and bytes, combined by a calibrated additive model.

A step runs one flat ragged batch: decode tokens (one per running sequence, each with its context length)
and prefill chunks (each with its length and the tokens already computed before it), as the runtime does.
For every operation we count, per device under tensor parallelism `tp`:

- FLOPs (2 per multiply-add), weight bytes, KV bytes (read + write), activation bytes, all-reduce bytes;
- MoE: the expected number of distinct routed experts the batch touches, E*(1-(1-k/E)^T), plus shared ones;
  prefill-sized steps compute whole tiles of rows per expert, as the runtime lays them out (`moe_tiles`);
- MLA: the compressed latent KV, replicated on every TP rank (not divided by tp), attended in absorbed form;
- KV-head replication when tp > num_kv_heads; embedding, lm_head and sampling for one row per sequence.

The time is a sum of terms, each a roofline term divided by an efficiency coefficient, plus fixed overheads
per step, per layer and per sequence (`Coefficients`); `roofline_s` is the pure floor max(FLOPs/peak, bytes/BW).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from modelspec.dtypes import dtype_bytes
from modelspec.memory import kv_heads_per_device, kv_scale_bytes
from modelspec.moe_tiles import DECODE_TILE_MAX, expected_tiles, tile_rows
from modelspec.spec import ModelSpec
from planner.hardware import Coefficients, Hardware

# The per-pass part of prefill attention: FLOPs of one query row over each chunk's KV, which `time_ops` scales
# by the `attn_m_half` coefficient (0 for every catalog device; `jaxserve calibrate` fits it).
ATTENTION_PASS = "attention_pass"
# The query-key pairs of prefill chunks of at most this many rows are priced apart (`attention_small`), at their
# own fitted efficiency where a profile has one (`attn_small_eff_scale` > 0): a small chunk's work is one or a few
# short tiles, whose fixed costs its few rows amortise less. Their passes stay with everyone's.
SMALL_CHUNK_ROWS = 32
ATTENTION_SMALL = "attention_small"
# GEMMs of at most this many rows (the projections of steps of at most this many tokens, the LM head of at most
# this many sequences) are priced apart where a profile says so (`gemm_small_eff_scale` > 0): on a CPU jaxserve
# runs them in its own matmul kernel (`jaxserve.kernels.cpu.matmul.MAX_ROWS` is this constant), whose
# FLOP rate does not ramp with the rows the way a GEMM library's does; from there on XLA's GEMM takes them.
SMALL_GEMM_ROWS = 32
# The LM head's op: on a CPU its kernel reads the embedding at the memory's rate and adds little compute per row,
# unlike the projections', so a profile may price its small-row FLOPs apart (`head_small_eff_scale`).
LM_HEAD = "lm_head"
# A mixture-of-experts layer's grouped GEMMs: priced at their own efficiencies (`moe_*_eff_scale`).
EXPERTS = "experts"



@dataclass(frozen=True)
class StepShape:
    """Aggregates of one ragged batch that the cost equations need (additive over sequences)."""

    num_decode: int = 0  # decoding sequences (one token each)
    num_prefill: int = 0  # prefill chunks (sequences)
    prefill_tokens: int = 0  # sum of chunk lengths
    attn_pairs: float = 0.0  # query x key pairs under the causal mask, summed over sequences
    kv_read_tokens: float = 0.0  # KV entries read by attention (context incl. the new tokens)
    decode_context: float = 0.0  # sum of decode context lengths (for reporting)
    prefill_kv: float = 0.0  # KV length each prefill chunk's query rows read, summed over chunks
    small_pairs: float = 0.0  # the part of attn_pairs from chunks of at most SMALL_CHUNK_ROWS rows

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.prefill_tokens

    @property
    def num_seqs(self) -> int:
        return self.num_decode + self.num_prefill

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(*(a + b for a, b in zip(self._t(), other._t(), strict=True)))

    def _t(self) -> tuple[float, ...]:
        return (self.num_decode, self.num_prefill, self.prefill_tokens, self.attn_pairs, self.kv_read_tokens,
                self.decode_context, self.prefill_kv, self.small_pairs)


def decode_shape(batch: int, context_len: float) -> StepShape:
    """`batch` decoding sequences, each with `context_len` tokens already in the KV cache."""
    return StepShape(num_decode=batch, attn_pairs=batch * (context_len + 1),
                     kv_read_tokens=batch * (context_len + 1), decode_context=batch * context_len)


def prefill_shape(chunk_len: int, computed: float = 0) -> StepShape:
    """One prefill chunk of `chunk_len` tokens after `computed` tokens already in the KV cache."""
    if chunk_len <= 0:
        return StepShape()
    pairs, kv = chunk_len * (computed + (chunk_len + 1) / 2), computed + chunk_len
    return StepShape(num_prefill=1, prefill_tokens=chunk_len, attn_pairs=pairs, kv_read_tokens=kv, prefill_kv=kv,
                     small_pairs=pairs if chunk_len <= SMALL_CHUNK_ROWS else 0.0)


def batch_shape(decode_context_lens: Iterable[int] = (), prefill_chunks: Iterable[tuple[int, int]] = ()) -> StepShape:
    """Shape of a ragged batch: decode context lengths, and (chunk_len, already_computed) per prefill chunk."""
    ctx = [int(c) for c in decode_context_lens]
    shape = StepShape(num_decode=len(ctx), attn_pairs=sum(ctx) + len(ctx), kv_read_tokens=sum(ctx) + len(ctx),
                      decode_context=sum(ctx))
    for q, p in prefill_chunks:
        shape = shape + prefill_shape(int(q), int(p))
    return shape


@dataclass(frozen=True)
class OpCost:
    """Per-device cost of one operation, for one layer (multiply by `count` for the whole model)."""

    name: str
    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    act_bytes: float = 0.0
    comm_bytes: float = 0.0  # payload of collectives (all-reduce, all-gather)
    collectives: int = 0  # number of collectives
    count: int = 1  # layers this op repeats over
    gemm_rows: float = 0  # M of the matmul (0: not a GEMM, e.g. attention)
    allgather: bool = False


def is_small_gemm(op: OpCost) -> bool:
    """Whether `op` is a GEMM of at most SMALL_GEMM_ROWS rows (the kernel's, where a profile prices it)."""
    return 0 < op.gemm_rows <= SMALL_GEMM_ROWS


def expected_experts(num_experts: int, k: int, tokens: float) -> float:
    """Expected distinct routed experts touched by `tokens` tokens choosing `k` of `num_experts` uniformly."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def _act_bytes(dtype: str) -> float:
    """Activations run in bf16 for low-precision weights, fp32 for fp32 weights."""
    return 4.0 if dtype in ("fp32", "float32") else 2.0


def _attention_ops(shape: StepShape, flops_per_pair: float, kv_bytes: float, act_bytes: float,
                   layers: int) -> list[OpCost]:
    """Attention of decodes and long chunks, of small chunks (SMALL_CHUNK_ROWS), and every chunk's per-pass part."""
    return [OpCost("attention", flops=flops_per_pair * (shape.attn_pairs - shape.small_pairs), kv_bytes=kv_bytes,
                   act_bytes=act_bytes, count=layers),
            OpCost(ATTENTION_SMALL, flops=flops_per_pair * shape.small_pairs, count=layers),
            OpCost(ATTENTION_PASS, flops=flops_per_pair * shape.prefill_kv, count=layers)]


def op_costs(spec: ModelSpec, shape: StepShape, *, tp: int = 1, dtype: str = "bf16",
             kv_dtype: str | None = None, padded_tokens: int = 0) -> list[OpCost]:
    """Per-operation FLOPs and bytes of one step on one device (see module docstring).

    `padded_tokens`: the token count the runtime pads the step to (its bucket); the matmuls, activations and
    KV writes run over the padded rows, attention over the real query-key pairs.
    """
    kv_dtype = kv_dtype or dtype
    bw, ba, bkv = dtype_bytes(dtype), _act_bytes(dtype), dtype_bytes(kv_dtype)
    sk = kv_scale_bytes(kv_dtype)  # an int8/fp8 pool's scale per cached row, read beside its codes
    T, S = max(shape.num_tokens, padded_tokens), shape.num_seqs
    h, L = spec.hidden_size, spec.num_layers
    nh = spec.num_heads / tp
    ar = 1 if tp > 1 else 0
    ops: list[OpCost] = []
    if spec.is_mla:
        kvr, rope, nope, vd = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim
        qhd = spec.q_head_dim
        if spec.q_lora_rank:
            qr = spec.q_lora_rank
            q_w = h * qr + qr * nh * qhd
        else:
            q_w = h * nh * qhd
        ops.append(OpCost("q_proj", flops=2 * T * q_w, weight_bytes=q_w * bw, act_bytes=T * (h + nh * qhd) * ba,
                          count=L, gemm_rows=T))
        kvd = h * (kvr + rope)
        ops.append(OpCost("kv_down_proj", flops=2 * T * kvd, weight_bytes=kvd * bw, act_bytes=T * (h + kvr + rope) * ba,
                          count=L, gemm_rows=T))
        up = kvr * nh * (nope + vd)
        ops.append(OpCost("kv_up_absorb", flops=2 * T * up, weight_bytes=up * bw,
                          act_bytes=T * nh * (qhd + kvr + vd) * ba, count=L, gemm_rows=T))
        kv_tok = (kvr + rope) * bkv + sk  # latent + rope key, whole on every rank
        ops += _attention_ops(shape, nh * (2 * (kvr + rope) + 2 * kvr), (shape.kv_read_tokens + T) * kv_tok,
                              T * nh * (kvr + rope + kvr) * ba, L)
        o_w = nh * vd * h
    else:
        hd, nkv = spec.head_dim, kv_heads_per_device(spec, tp)
        qkv_w = h * (nh + 2 * nkv) * hd + ((nh + 2 * nkv) * hd if spec.qkv_bias else 0)
        ops.append(OpCost("qkv_proj", flops=2 * T * h * (nh + 2 * nkv) * hd, weight_bytes=qkv_w * bw,
                          act_bytes=T * (h + (nh + 2 * nkv) * hd) * ba, count=L, gemm_rows=T))
        kv_tok = 2 * nkv * (hd * bkv + sk)
        ops += _attention_ops(shape, 4 * nh * hd, (shape.kv_read_tokens + T) * kv_tok, T * 2 * nh * hd * ba, L)
        o_w = nh * hd * h
    ops.append(OpCost("o_proj", flops=2 * T * o_w, weight_bytes=o_w * bw, act_bytes=T * (o_w / h + h) * ba,
                      count=L, gemm_rows=T))
    ops.append(OpCost("allreduce_attn", comm_bytes=T * h * ba * ar, collectives=ar, count=L))
    ops.append(OpCost("norms_residual", act_bytes=T * h * ba * 6, weight_bytes=2 * h * bw, count=L))
    if spec.num_dense_layers:
        inter = spec.intermediate_size / tp
        ops.append(OpCost("mlp", flops=2 * T * 3 * h * inter, weight_bytes=3 * h * inter * bw,
                          act_bytes=T * (2 * h + 4 * inter) * ba, count=spec.num_dense_layers, gemm_rows=T))
    if spec.is_moe:
        E, k, sh = spec.num_experts, spec.num_experts_per_tok, spec.num_shared_experts
        mi = spec.moe_intermediate_size / tp
        real = shape.num_tokens  # the bucket's padding rows route to no expert
        distinct = expected_experts(E, k, real)
        ops.append(OpCost("router", flops=2 * T * h * E, weight_bytes=h * E * bw, act_bytes=T * (h + E) * 4,
                          count=spec.num_moe_layers, gemm_rows=T))
        if T > DECODE_TILE_MAX:  # prefill-sized: every row of every tile is computed (modelspec/moe_tiles.py)
            rows = tile_rows(math.ceil(T), k, E)
            expert_rows = expected_tiles(math.ceil(real), k, E, padded_tokens=math.ceil(T)) * rows
        else:  # one tile per touched expert, its padding skipped
            rows = max(1.0, real * k / max(distinct, 1e-9))  # tokens per touched expert: the GEMM's M
            expert_rows = real * k
        ops.append(OpCost(EXPERTS, flops=2 * (expert_rows + T * sh) * 3 * h * mi,
                          weight_bytes=(distinct + sh) * 3 * h * mi * bw,
                          act_bytes=(real * k + T * sh) * (2 * h + 4 * mi) * ba, count=spec.num_moe_layers,
                          gemm_rows=rows))
    ops.append(OpCost("allreduce_mlp", comm_bytes=T * h * ba * ar, collectives=ar, count=L))
    # Vocab-parallel embedding (gather of T rows, then an all-reduce), lm_head on one row per sequence, sampling.
    ops.append(OpCost("embedding", weight_bytes=min(T, spec.vocab_size) * h * bw / tp, act_bytes=T * h * ba,
                      comm_bytes=T * h * ba * ar, collectives=ar))
    V = spec.vocab_size
    ops.append(OpCost(LM_HEAD, flops=2 * S * h * V / tp, weight_bytes=h * V * bw / tp + h * bw,  # + final norm
                      act_bytes=S * (h + V / tp) * 4,
                      comm_bytes=S * V * 4 * ar, collectives=ar, gemm_rows=S, allgather=True))
    ops.append(OpCost("sampling", flops=8 * S * V, act_bytes=3 * S * V * 4))
    return ops


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one step, split into additive terms (seconds), plus the pure roofline floor."""

    total_s: float
    compute_s: float
    weight_s: float  # weight reads and activation traffic
    kv_s: float
    comm_s: float
    overhead_s: float
    roofline_s: float  # max(FLOPs/peak, bytes/BW) + ideal collectives: no efficiency, no overheads
    flops: float
    bytes: float
    shape: StepShape = field(repr=False, default_factory=StepShape)

    @property
    def terms(self) -> dict[str, float]:
        return {"compute": self.compute_s, "weights": self.weight_s, "kv_cache": self.kv_s,
                "communication": self.comm_s, "overhead": self.overhead_s}

    @property
    def bottleneck(self) -> str:
        """The term that contributes most to the step time."""
        return max(self.terms.items(), key=lambda kv: kv[1])[0]

    @property
    def total_ms(self) -> float:
        return self.total_s * 1e3

    def explain(self) -> str:
        """The binding term in one sentence."""
        b = self.bottleneck
        share = self.terms[b] / self.total_s if self.total_s else 0.0
        return (f"{b} binds: {share:.0%} of a {self.total_ms:.2f} ms step "
                f"(roofline floor {self.roofline_s * 1e3:.2f} ms, arithmetic intensity "
                f"{self.flops / max(self.bytes, 1):.0f} FLOP/byte)")


def _collective_s(hw: Hardware, tp: int, payload: float, allgather: bool, eff: float, latency: bool = True) -> float:
    if tp <= 1 or payload <= 0:
        return 0.0
    link = hw.intra_node_bw if tp <= hw.devices_per_node else hw.inter_node_bw
    factor = (tp - 1) / tp if allgather else 2 * (tp - 1) / tp
    lat = hw.allreduce_latency_s * (1 if tp <= hw.devices_per_node else 4)
    return (lat if latency else 0.0) + factor * payload / (link * eff)


def prefill_rows(shape: StepShape, padded_tokens: int = 0) -> float:
    """Rows a step with prefill runs beyond its decodes: its chunks' tokens and the padding up to its bucket (the
    runtime computes padded rows as it does real ones; only attention skips them); 0 for a decode-only step."""
    if shape.prefill_tokens <= 0:
        return 0.0
    return max(shape.num_tokens, padded_tokens) - shape.num_decode


def time_ops(ops: Sequence[OpCost], spec: ModelSpec, shape: StepShape, hw: Hardware, *, tp: int = 1,
             dtype: str = "bf16", coefficients: Coefficients | None = None, steps_per_dispatch: int = 1,
             padded_tokens: int = 0, overlapped: bool = False) -> StepTime:
    """Combine operation costs into a step time with `coefficients` (default: the hardware's).

    A decode-only step run `steps_per_dispatch` at a time (`--num-scheduler-steps`) pays its share of one
    dispatch's host overhead (`dispatch_overhead_s`) instead of a whole one. `overlapped` (the overlapped loop,
    `--async-scheduling`): a step's host overhead runs beside the previous step's device work, so a step takes the
    longer of the two rather than their sum. `padded_tokens`: the bucket the step runs at (`ops` already counted at
    it); the per-token overhead is paid on its padded prefill rows."""
    c = coefficients or hw.coefficients
    peak = hw.peak(dtype)
    compute = weight = kv = comm = ideal_comm = 0.0
    flops = nbytes = 0.0
    # Small chunks' pairs at their own efficiency where the profile has one, else as all others.
    width = spec.moe_intermediate_size / tp if spec.is_moe else 0.0
    moe_width = width / (width + c.moe_width_half) if width > 0 else 1.0  # an expert's GEMM width per device
    attn_scale = {"attention": c.attn_eff_scale,
                  ATTENTION_SMALL: c.attn_small_eff_scale if c.attn_small_eff_scale > 0 else c.attn_eff_scale}
    for op in ops:
        n = op.count
        if op.name == ATTENTION_PASS:  # overhead priced as attn_m_half extra query rows, not real FLOPs
            compute += op.flops * n * c.attn_m_half / (peak * c.compute_eff * c.attn_eff_scale)
            continue
        flops += op.flops * n
        nbytes += (op.weight_bytes + op.kv_bytes + op.act_bytes) * n
        if op.flops:
            if c.gemm_small_eff_scale > 0 and is_small_gemm(op):
                head = op.name == LM_HEAD and c.head_small_eff_scale > 0
                eff = c.compute_eff * (c.head_small_eff_scale if head else c.gemm_small_eff_scale)
            else:
                eff = c.compute_eff * (op.gemm_rows / (op.gemm_rows + c.gemm_m_half) if op.gemm_rows else 1.0)
                eff *= attn_scale.get(op.name, 1.0)
            if op.name == EXPERTS:
                eff *= c.moe_compute_eff_scale * moe_width
            compute += op.flops * n / (peak * eff)
        w_eff = c.weight_bw_eff * (c.gemv_speedup if op.gemm_rows == 1 else 1.0)
        if op.name == EXPERTS:
            w_eff *= c.moe_weight_bw_eff_scale * moe_width
        weight += (op.weight_bytes + op.act_bytes) * n / (hw.memory_bw * w_eff)
        kv += op.kv_bytes * n / (hw.memory_bw * c.kv_bw_eff)
        for _ in range(op.collectives):
            comm += _collective_s(hw, tp, op.comm_bytes, op.allgather, c.comm_eff) * n
            ideal_comm += _collective_s(hw, tp, op.comm_bytes, op.allgather, 1.0) * n
    shared = c.dispatch_overhead_s * (1 - 1 / steps_per_dispatch) if shape.prefill_tokens == 0 else 0.0
    overhead = (c.step_overhead_s - shared + spec.num_layers * c.layer_overhead_s + shape.num_seqs * c.seq_overhead_s
                + prefill_rows(shape, padded_tokens) * c.prefill_token_overhead_s)
    roofline = max(flops / peak, nbytes / hw.memory_bw) + ideal_comm
    total = compute + weight + kv + comm + overhead
    if overlapped:
        host = c.dispatch_overhead_s
        total = max(total - host, host)
    return StepTime(total_s=total, compute_s=compute, weight_s=weight, kv_s=kv, comm_s=comm, overhead_s=overhead,
                    roofline_s=roofline, flops=flops, bytes=nbytes, shape=shape)


def pad_tokens(num_tokens: int, token_buckets: Sequence[int] = ()) -> int:
    """The smallest bucket holding `num_tokens` (the runtime's padding); `num_tokens` itself past the ladder."""
    return min((b for b in token_buckets if b >= num_tokens), default=num_tokens)


def prefill_chunk_tokens(computed: int, owed: int, budget: int, page_size: int = 1) -> int:
    """Tokens a prefill computes in one step, cut as the runtime's scheduler cuts them.

    All it owes if that fits in `budget`; else a chunk ending on a page boundary; when no page boundary is
    reachable, what fits (so a prefill always progresses and the next chunk realigns).
    """
    n = min(owed, budget)
    if n < owed and page_size > 1:
        aligned = (computed + n) // page_size * page_size - computed
        if aligned > 0:
            n = aligned
    return max(n, 0)


def step_time_shape(spec: ModelSpec, hw: Hardware, shape: StepShape, *, tp: int = 1, dtype: str = "bf16",
                    kv_dtype: str | None = None, coefficients: Coefficients | None = None,
                    padded_tokens: int = 0, steps_per_dispatch: int = 1, overlapped: bool = False) -> StepTime:
    """Step time for an aggregated `StepShape` (what the serving model and the simulator call); a decode-only
    step with `steps_per_dispatch` > 1 is one of that many run in one dispatch; `overlapped` as in `time_ops`."""
    if shape.num_tokens <= 0:
        return StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, shape)
    ops = op_costs(spec, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=padded_tokens)
    return time_ops(ops, spec, shape, hw, tp=tp, dtype=dtype, coefficients=coefficients,
                    steps_per_dispatch=steps_per_dispatch, padded_tokens=padded_tokens, overlapped=overlapped)


def step_time(spec: ModelSpec, hw: Hardware, decode_context_lens: Iterable[int] = (),
              prefill_chunks: Iterable[tuple[int, int]] = (), *, tp: int = 1, dtype: str = "bf16",
              kv_dtype: str | None = None, coefficients: Coefficients | None = None,
              token_buckets: Sequence[int] = ()) -> StepTime:
    """Predicted time of one engine step on one TP group.

    `decode_context_lens`: tokens already cached for each decoding sequence (each decodes one token).
    `prefill_chunks`: (chunk_len, already_computed) for each prefill chunk in the step.
    `token_buckets`: the runtime's padding ladder (the step runs at the smallest bucket holding its tokens).
    """
    shape = batch_shape(decode_context_lens, prefill_chunks)
    return step_time_shape(spec, hw, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, coefficients=coefficients,
                           padded_tokens=pad_tokens(shape.num_tokens, token_buckets))


def weight_time_per_device(spec: ModelSpec, hw: Hardware, tp: int, dtype: str = "bf16") -> float:
    """Seconds to stream one device's share of the weights at peak bandwidth, for one decode token."""
    ops = op_costs(spec, decode_shape(1, 0), tp=tp, dtype=dtype)
    return sum(op.weight_bytes * op.count for op in ops) / hw.memory_bw


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))

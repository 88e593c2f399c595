"""Model architecture specs: one table shared by the planner's equations and the runtime's model builder.

A `ModelSpec` holds every architectural number the roofline equations and the JAX model need. Presets
come from the published HF `config.json` of each model; `tiny` and `small` are the synthetic presets the
runtime serves with deterministic random weights. `load_model_spec` resolves a preset name or an HF
`config.json` (file or folder).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


class ModelSpecError(ValueError):
    """A model name or config that cannot be turned into a spec."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, in HF config terms."""

    name: str
    architecture: str  # llama | mistral | qwen2 | qwen3 | mixtral | qwen3_moe | deepseek_v2 | deepseek_v3
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Mixture of experts (0 experts = dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_layers: int = 0
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers kept dense past first_k_dense_layers
    decoder_sparse_step: int = 1  # Qwen3-MoE: every n-th layer is sparse
    norm_topk_prob: bool = False  # renormalize the k routing weights to sum to 1 (Mixtral always does)
    routed_scaling_factor: float = 1.0  # DeepSeek: routed experts' output scale
    topk_method: str = "greedy"  # DeepSeek-V2: greedy | group_limited_greedy (n_group groups, topk_group kept)
    n_group: int = 1
    topk_group: int = 1
    # Multi-head latent attention (kv_lora_rank 0 = ordinary MHA/GQA).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    synthetic: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) routes its MLP through experts."""
        return (self.is_moe and layer >= self.first_k_dense_layers and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def q_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: nope + rope parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def o_head_dim(self) -> int:
        """Per-head width of attention values/outputs."""
        return self.v_head_dim if self.is_mla else self.head_dim

    def attention_params(self) -> int:
        """Parameters of one attention block (projections and biases, no norms)."""
        h = self.hidden_size
        if self.is_mla:
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * self.q_head_dim
                 if self.q_lora_rank else h * self.num_heads * self.q_head_dim)
            kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_up = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            return q + kv_down + kv_up + o
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        return qkv + bias + self.num_heads * self.head_dim * h

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """Parameters of one routed (or shared) expert."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def param_count(self) -> int:
        """Total parameters, all experts included."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        layers = self.num_layers * self.attention_params() + self.num_dense_layers * self.dense_mlp_params()
        if self.is_moe:
            router = self.hidden_size * self.num_experts
            per_moe = (self.num_experts + self.num_shared_experts) * self.expert_params() + router
            layers += self.num_moe_layers * per_moe
        return layers + norms + self.embedding_params()

    def active_param_count(self) -> int:
        """Parameters touched by one token (k routed experts + shared)."""
        if not self.is_moe:
            return self.param_count()
        unused = self.num_moe_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params()
        return self.param_count() - unused

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, architecture=kw.pop("architecture", "llama"), num_layers=layers,
                     hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=kw.pop("head_dim", hidden // heads),
                     intermediate_size=inter, vocab_size=vocab, **kw)


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_L31 = dict(rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072,
            bos_token_id=128000, eos_token_id=128001)
_QWEN = dict(architecture="qwen2", qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645)

PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        # Synthetic presets served by the runtime with seeded random weights and a byte-level tokenizer.
        _llama("tiny", 2, 64, 4, 2, 128, 512, tie_word_embeddings=True, max_position_embeddings=4096,
               bos_token_id=256, eos_token_id=257, synthetic=True),
        _llama("small", 12, 768, 12, 4, 2048, 32000, tie_word_embeddings=True, rope_theta=500000.0,
               max_position_embeddings=8192, bos_token_id=256, eos_token_id=257, synthetic=True),
        # A ~1B Llama-3.2-1B-shaped synthetic model for the GPU report script.
        _llama("synthetic-1b", 16, 2048, 32, 8, 8192, 128256, tie_word_embeddings=True, rope_theta=500000.0,
               max_position_embeddings=8192, bos_token_id=256, eos_token_id=257, synthetic=True),
        # Llama-3.1-8B's shape (untied head, llama3 RoPE scaling) with random weights: the GPU check's 8B step.
        _llama("synthetic-8b", 32, 4096, 32, 8, 14336, 128256, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
               max_position_embeddings=131072, bos_token_id=256, eos_token_id=257, synthetic=True),
        # Synthetic MoE and MLA presets (random weights, byte-level tokenizer): Mixtral-like top-2 of 8, and a
        # DeepSeek-V2-like model with a latent KV pool of 48 + 16 per token, a dense first layer, shared experts.
        _llama("tiny-moe", 2, 64, 4, 2, 64, 512, architecture="mixtral", tie_word_embeddings=True,
               bos_token_id=256, eos_token_id=257, synthetic=True, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=64, norm_topk_prob=True),
        _llama("small-moe", 8, 512, 8, 4, 768, 32000, architecture="mixtral", tie_word_embeddings=True,
               rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=256, eos_token_id=257,
               synthetic=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True),
        _llama("tiny-mla", 2, 64, 4, 4, 128, 512, architecture="deepseek_v2", head_dim=16, tie_word_embeddings=True,
               bos_token_id=256, eos_token_id=257, synthetic=True, num_experts=8, num_experts_per_tok=2,
               num_shared_experts=1, moe_intermediate_size=32, first_k_dense_layers=1, kv_lora_rank=48,
               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
        # Published architectures (values from each model's HF config.json).
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
        _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
        _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, **_L31),
        _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, **_L31),
        _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, **_L31),
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, **_QWEN),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, **_QWEN),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32768, architecture="mistral", rope_theta=1000000.0,
               max_position_embeddings=32768),
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, architecture="mixtral", rope_theta=1000000.0,
               max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
        ModelSpec(name="deepseek-v3", architecture="deepseek_v3", num_layers=61, hidden_size=7168, num_heads=128,
                  num_kv_heads=128, head_dim=128, intermediate_size=18432, vocab_size=129280, rms_norm_eps=1e-6,
                  max_position_embeddings=163840, bos_token_id=0, eos_token_id=1, num_experts=256,
                  num_experts_per_tok=8, num_shared_experts=1, moe_intermediate_size=2048, first_k_dense_layers=3,
                  kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}),
    ]
}


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def spec_from_hf_config(config: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Build a spec from an HF `config.json` dict (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, DeepSeek)."""
    archs = config.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
                   "qwen3_moe": "qwen3_moe", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3"}
        arch = by_type.get(config.get("model_type", ""))
    if arch is None:
        raise ModelSpecError(
            f"unsupported architecture {archs or config.get('model_type')!r}; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES))
    # transformers >= 5 writes rope_theta and rope scaling together as `rope_parameters`.
    rope_params = config.get("rope_parameters") or {}
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        common: dict[str, Any] = dict(
            name=name, architecture=arch, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=config.get("rope_scaling") or (
                rope_params if rope_params.get("rope_type", "default") != "default" else None),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            bos_token_id=_first_id(config.get("bos_token_id")),
            eos_token_id=_first_id(config.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelSpecError(f"config.json lacks required key {e.args[0]!r}") from None
    if arch == "mixtral":
        common.update(num_experts=int(config["num_local_experts"]),
                      num_experts_per_tok=int(config["num_experts_per_tok"]),
                      moe_intermediate_size=common["intermediate_size"], norm_topk_prob=True)
    if arch == "qwen3_moe":
        common.update(num_experts=int(config.get("num_experts") or config["num_local_experts"]),
                      num_experts_per_tok=int(config["num_experts_per_tok"]),
                      moe_intermediate_size=int(config["moe_intermediate_size"]),
                      norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
                      mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()))
    if arch in ("deepseek_v2", "deepseek_v3"):
        # V2's router: softmax, top-k (greedy or by group), times routed_scaling_factor; HF's V2 ignores norm_topk_prob.
        common.update(head_dim=int(config["qk_rope_head_dim"]),
                      routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                      topk_method=str(config.get("topk_method") or "greedy"),
                      n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1))
        common.update(
            num_experts=int(config["n_routed_experts"]), num_experts_per_tok=int(config["num_experts_per_tok"]),
            num_shared_experts=int(config.get("n_shared_experts", 0)),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            first_k_dense_layers=int(config.get("first_k_dense_replace", 0)),
            kv_lora_rank=int(config["kv_lora_rank"]), q_lora_rank=int(config.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]), qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]))
    return ModelSpec(**common)


# Trained checkpoints shipped as package data (scripts/train_reference_model.py); their names resolve to folders.
SHIPPED_MODELS = ("bard", "bard-draft")


def resolve_model_path(model: str) -> str:
    """A shipped model's name (`bard`, `bard-draft`) as its folder under `jaxserve/trained_models/`; anything else
    as is."""
    if model in SHIPPED_MODELS:
        # Beside this package, whether in the source tree or site-packages; found by path so jax is not imported.
        return str(Path(__file__).resolve().parent.parent / "jaxserve" / "trained_models" / model)
    return model


def load_model_spec(model: str) -> ModelSpec:
    """Resolve a preset name, a shipped model's name, an HF `config.json` path, or a folder holding one."""
    if model in PRESETS:
        return PRESETS[model]
    if model in SHIPPED_MODELS:
        return spec_from_hf_config(json.loads((Path(resolve_model_path(model)) / "config.json").read_text()), model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelSpecError(
            f"unknown model {model!r}: not a preset ({', '.join((*PRESETS, *SHIPPED_MODELS))}) "
            "nor a config.json or folder holding one")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"{path}: not valid JSON ({e})") from None
    return spec_from_hf_config(config, name=path.parent.name or path.stem)

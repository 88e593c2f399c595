"""Hardware catalog and hardware-profile JSON: peak FLOP/s, memory, links, and the step model's coefficients.

Every catalog figure carries its source beside it (`sources`). A profile JSON (written by hand or by
`jaxserve calibrate`) can describe a new device or override a catalog entry (`"base": "h100-sxm"`) and carry
fitted `coefficients` for the step model. Units in JSON are human units (TFLOP/s, GB, GB/s, us, ms);
the dataclasses hold SI units (FLOP/s, bytes, bytes/s, seconds). The schema is documented in docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelspec.dtypes import short_name

TERA = 1e12
GIGA = 1e9
GIB = 1024**3  # device memory is sold in binary units: an "80 GB" H100 holds 80 GiB of HBM


class HardwareError(ValueError):
    """An unknown hardware name or an invalid profile."""


@dataclass(frozen=True)
class Coefficients:
    """Calibrated additive step model: time = sum of roofline terms / efficiency + fixed overheads.

    Default priors are for a mature engine (CUDA graphs, fused kernels) on a datacenter GPU; they were set
    once, globally, against published measurements (docs/planner.md), never per point.
    """

    compute_eff: float = 0.70  # fraction of dense peak reached by large GEMMs and attention
    gemm_m_half: float = 16.0  # rows at which a GEMM reaches half of compute_eff (small-M GEMMs are slow)
    weight_bw_eff: float = 0.80  # fraction of HBM bandwidth reached streaming weights (GEMV-like decode)
    kv_bw_eff: float = 0.80  # fraction of HBM bandwidth reached reading paged KV in attention
    comm_eff: float = 0.70  # fraction of link bandwidth reached by ring all-reduce
    step_overhead_s: float = 300e-6  # per engine step: scheduling, launch, sampling setup
    layer_overhead_s: float = 6e-6  # per layer per step: kernel launches, norms, small ops
    seq_overhead_s: float = 4e-6  # per sequence in the step: metadata, sampling, detokenize
    prefill_token_overhead_s: float = 0.0  # per prefill token (host-side work that scales with tokens)
    attn_eff_scale: float = 1.0  # attention FLOP efficiency relative to compute_eff (1: the GEMMs')
    attn_m_half: float = 0.0  # query rows one prefill chunk's pass over its KV costs beyond its own rows
    # Chunks of at most SMALL_CHUNK_ROWS rows (planner/step_model.py): their pairs' attention efficiency relative
    # to compute_eff; 0: priced like every other chunk's (attn_eff_scale).
    attn_small_eff_scale: float = 0.0
    # GEMMs of at most SMALL_GEMM_ROWS rows: their FLOP efficiency relative to compute_eff, flat in the rows (no
    # gemm_m_half ramp); 0: priced as every other GEMM.
    gemm_small_eff_scale: float = 0.0
    # The LM head's GEMM of at most SMALL_GEMM_ROWS rows, the same way; 0: as the other small GEMMs.
    head_small_eff_scale: float = 0.0
    gemv_speedup: float = 1.0  # weight-read rate of a one-row matmul (GEMV) over a multi-row one's
    # Host seconds per dispatch (scheduling, input and output copies) within step_overhead_s: a run of k decode
    # steps in one dispatch pays it once, so each of its steps costs (1 - 1/k) x this less.
    dispatch_overhead_s: float = 0.0
    # A mixture-of-experts layer's grouped GEMMs run apart from dense ones: their FLOP rate and their weight-read
    # rate relative to compute_eff and weight_bw_eff (1: as dense layers; the GPU entries carry the published
    # mature engines', MOE_TUNED; `with_moe_kernels(hw, "untuned")` divides them by MOE_UNTUNED's factors).
    moe_compute_eff_scale: float = 1.0
    moe_weight_bw_eff_scale: float = 1.0
    # ... both times W / (W + moe_width_half), W an expert's GEMM width on one device (moe_intermediate_size / tp):
    # fine-grained experts split over many devices (DeepSeek-V3's 2048 over 8: 256) fill a GEMM's tiles poorly.
    # 0: no such term.
    moe_width_half: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# The MoE priors (`moe_compute_eff_scale`, `moe_weight_bw_eff_scale`), as fractions of the dense efficiencies.
# MOE_TUNED: every GPU catalog entry's, set once from mature engines' published MoE runs (docs/planner.md, "MoE
# efficiency"). MOE_UNTUNED: what an engine whose MoE kernels are not tuned for the device loses on top, from the
# published kernel comparisons cited there (compute: AITER's fused MoE over ROCm's generic Triton path, up to 3x;
# weights: vLLM's default-config fused MoE against a tuned one at decode sizes, 1.6x).
MOE_TUNED = {"moe_compute_eff_scale": 0.4, "moe_weight_bw_eff_scale": 1.0, "moe_width_half": 256.0}
MOE_UNTUNED = {"moe_compute_eff_scale": 1 / 3, "moe_weight_bw_eff_scale": 1 / 1.6}
MOE_KERNELS = ("tuned", "untuned")


COEFFICIENT_DOCS: dict[str, str] = {
    "compute_eff": "achieved / peak FLOP/s for large matmuls (typical 0.5-0.75 on GPUs)",
    "gemm_m_half": "GEMM rows at which efficiency is half of compute_eff: eff(M) = compute_eff*M/(M+m_half)",
    "weight_bw_eff": "achieved / peak memory bandwidth when streaming weights (0.75-0.84 on GPUs)",
    "kv_bw_eff": "achieved / peak memory bandwidth reading the paged KV cache",
    "comm_eff": "achieved / peak link bandwidth of the ring all-reduce",
    "step_overhead_s": "fixed seconds per engine step",
    "dispatch_overhead_s": "host seconds per dispatch within step_overhead_s, paid once by k decode steps a dispatch",
    "layer_overhead_s": "fixed seconds per layer per step",
    "seq_overhead_s": "fixed seconds per sequence in a step",
    "prefill_token_overhead_s": "seconds per prefill token not explained by FLOPs or bytes",
    "attn_eff_scale": "attention FLOP efficiency as a fraction of compute_eff (a jnp attention on CPU runs far "
                      "below its GEMMs; 1 = the same)",
    "attn_m_half": "extra query rows each prefill chunk's pass over its KV costs (per-block loads and loop "
                   "overhead): a chunk of c rows over kv keys costs (c + attn_m_half) x kv pairs; small chunks "
                   "over long histories are far below the FLOP rate",
    "attn_small_eff_scale": "attention FLOP efficiency, as a fraction of compute_eff, of prefill chunks of at most "
                            "32 rows; 0: priced as every other chunk",
    "gemm_small_eff_scale": "FLOP efficiency, as a fraction of compute_eff and without the gemm_m_half ramp, of "
                            "GEMMs of at most 32 rows (jaxserve's CPU matmul kernel takes them); 0: priced as every "
                            "other GEMM",
    "head_small_eff_scale": "the same for the LM head over at most 32 sequences (a memory-bound pass over the "
                            "embedding whose FLOPs cost little on top); 0: as the other small GEMMs",
    "moe_compute_eff_scale": "FLOP efficiency of the experts' grouped GEMMs as a fraction of compute_eff (GPU "
                             "catalog: MOE_TUNED; 1 = as dense GEMMs)",
    "moe_weight_bw_eff_scale": "weight-read efficiency of the experts as a fraction of weight_bw_eff (GPU catalog: "
                               "MOE_TUNED; 1 = as dense weights)",
    "moe_width_half": "an expert's GEMM width per device (moe_intermediate_size / tp) at which both MoE efficiencies "
                      "halve: W / (W + moe_width_half); 0 = none",
    "gemv_speedup": "weight-read rate of a one-row matmul over that of a few-row one (weight_bw_eff's): a CPU "
                    "runs one row through a GEMV kernel that streams ~1.3x faster than its 2-16-row GEMMs; calibrate "
                    "fits it from one-decode steps; 1 on GPUs unless calibrated",
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or a CPU treated as one device) and the links between devices."""

    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per compute dtype: bf16, fp16, fp8, int8, fp32
    memory_bytes: float
    memory_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s per direction per device (NVLink, ICI, PCIe)
    allreduce_latency_s: float  # small-message all-reduce latency inside a node
    inter_node_bw: float  # bytes/s per device across nodes
    devices_per_node: int = 8
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    coefficients: Coefficients = field(default_factory=Coefficients)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls with weights in `dtype`.

        int4 (weight-only) and fp8/int8 on devices without those units compute in bf16.
        """
        key = short_name(dtype)
        key = "bf16" if key == "int4" else key
        if key in self.peak_flops:
            return self.peak_flops[key]
        return self.peak_flops.get("bf16") or max(self.peak_flops.values())

    @property
    def ridge_point(self) -> float:
        """FLOP per byte where bf16 (or fp32 on CPUs) compute and memory time are equal."""
        return self.peak("bf16") / self.memory_bw

    def with_coefficients(self, **kw: float) -> Hardware:
        return dataclasses.replace(self, coefficients=dataclasses.replace(self.coefficients, **kw))

    def to_profile(self) -> dict[str, Any]:
        """This hardware as a profile JSON object (human units), loadable by `load_hardware`."""
        return {
            "name": self.name,
            "peak_tflops": {k: v / TERA for k, v in self.peak_flops.items()},
            "memory_gib": self.memory_bytes / GIB,
            "memory_bandwidth_gbps": self.memory_bw / GIGA,
            "intra_node_bandwidth_gbps": self.intra_node_bw / GIGA,
            "allreduce_latency_us": self.allreduce_latency_s * 1e6,
            "inter_node_bandwidth_gbps": self.inter_node_bw / GIGA,
            "devices_per_node": self.devices_per_node,
            "sources": dict(self.sources),
            "coefficients": self.coefficients.to_dict(),
        }


def _hw(name: str, *, bf16: float, fp8: float | None, int8: float | None, fp32: float, mem_gib: float,
        bw_tbs: float, link_gbs: float, ar_us: float, inter_gbs: float, sources: dict[str, str],
        per_node: int = 8, coefficients: Coefficients | None = None) -> Hardware:
    peaks = {"bf16": bf16 * TERA, "fp16": bf16 * TERA, "fp32": fp32 * TERA}
    if fp8:
        peaks["fp8"] = fp8 * TERA
    if int8:
        peaks["int8"] = int8 * TERA
    return Hardware(name=name, peak_flops=peaks, memory_bytes=mem_gib * GIB, memory_bw=bw_tbs * TERA,
                    intra_node_bw=link_gbs * GIGA, allreduce_latency_s=ar_us * 1e-6, inter_node_bw=inter_gbs * GIGA,
                    devices_per_node=per_node, sources=sources, coefficients=coefficients or Coefficients(**MOE_TUNED))


_AR_NCCL = "all-reduce latency: NCCL small-message figures on 8xH100 NVLink (30-40 us; custom all-reduce ~10 us)"
_IB_NDR = "inter-node: one 400 Gb/s InfiniBand NDR NIC per GPU (DGX/HGX reference design)"

CATALOG: dict[str, Hardware] = {h.name: h for h in [
    _hw("h100-sxm", bf16=989.4, fp8=1978.9, int8=1978.9, fp32=66.9, mem_gib=80, bw_tbs=3.35, link_gbs=450,
        ar_us=25, inter_gbs=50, sources={
            "compute": "NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 989 TFLOPS, FP8 1979, INT8 1979 TOPS dense "
                       "(half the with-sparsity figures), FP32 67 TFLOPS",
            "memory": "NVIDIA H100 datasheet (SXM): 80 GB HBM3 (binary: 80 GiB; vLLM logs total_gpu_memory "
                      "79.1-79.3 GiB, the rest held by the driver), 3.35 TB/s",
            "intra_node": "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional = 450 GB/s per direction",
            "allreduce_latency": _AR_NCCL, "inter_node": _IB_NDR}),
    _hw("h200", bf16=989.4, fp8=1978.9, int8=1978.9, fp32=66.9, mem_gib=141, bw_tbs=4.8, link_gbs=450,
        ar_us=25, inter_gbs=50, sources={
            "compute": "NVIDIA H200 Tensor Core GPU datasheet (SXM): Hopper compute as H100 SXM, dense = half sparse",
            "memory": "NVIDIA H200 datasheet: 141 GB HBM3e (binary: 141 GiB; vLLM logs total_gpu_memory 139.8 GiB), "
                      "4.8 TB/s",
            "intra_node": "NVIDIA H200 datasheet: NVLink 900 GB/s bidirectional",
            "allreduce_latency": _AR_NCCL, "inter_node": _IB_NDR}),
    _hw("a100-80g", bf16=312, fp8=None, int8=624, fp32=19.5, mem_gib=80, bw_tbs=2.039, link_gbs=300,
        ar_us=30, inter_gbs=25, sources={
            "compute": "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS, INT8 624 TOPS dense, FP32 19.5; "
                       "no FP8 units (fp8 weights compute in bf16)",
            "memory": "NVIDIA A100 datasheet (80GB SXM): 80 GB HBM2e (binary: 80 GiB; vLLM logs 79.15 GiB), 2,039 GB/s",
            "intra_node": "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional = 300 GB/s per direction",
            "allreduce_latency": "NCCL small-message latency on 8xA100 NVLink (~30 us, nccl-tests)",
            "inter_node": "one 200 Gb/s InfiniBand HDR NIC per GPU (DGX A100)"}),
    _hw("a100-40g", bf16=312, fp8=None, int8=624, fp32=19.5, mem_gib=40, bw_tbs=1.555, link_gbs=300,
        ar_us=30, inter_gbs=25, sources={
            "compute": "NVIDIA A100 datasheet: BF16 312 TFLOPS dense, INT8 624 TOPS, FP32 19.5",
            "memory": "NVIDIA A100 datasheet (40GB SXM): 40 GB HBM2 (binary: 40 GiB; vLLM logs 39.4-39.6 GiB), "
                      "1,555 GB/s",
            "intra_node": "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional",
            "allreduce_latency": "NCCL small-message latency on 8xA100 NVLink (~30 us, nccl-tests)",
            "inter_node": "one 200 Gb/s InfiniBand HDR NIC per GPU (DGX A100)"}),
    _hw("l40s", bf16=362.05, fp8=733, int8=733, fp32=91.6, mem_gib=48, bw_tbs=0.864, link_gbs=32,
        ar_us=50, inter_gbs=25, sources={
            "compute": "NVIDIA L40S datasheet: BF16 362 TFLOPS dense (733 sparse), FP8 733 dense, INT8 733 TOPS, "
                       "FP32 91.6 TFLOPS",
            "memory": "NVIDIA L40S datasheet: 48 GB GDDR6 (binary: 48 GiB, less the ECC share when ECC is on), "
                      "864 GB/s",
            "intra_node": "no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional = 32 GB/s per direction",
            "allreduce_latency": "PCIe all-reduce through host bridges (~50 us, nccl-tests order of magnitude)",
            "inter_node": "200 Gb/s Ethernet/IB per GPU assumed"}),
    _hw("b200", bf16=2250, fp8=4500, int8=4500, fp32=80, mem_gib=180, bw_tbs=8.0, link_gbs=900,
        ar_us=20, inter_gbs=50, sources={
            "compute": "NVIDIA HGX B200 datasheet: FP8 9 PFLOPS sparse = 4.5 dense, BF16 4.5 sparse = 2.25 dense, "
                       "INT8 4.5 POPS dense, FP32 80 TFLOPS (per GPU)",
            "memory": "NVIDIA HGX B200 datasheet: 180 GB HBM3e per GPU (binary: 180 GiB), 8 TB/s",
            "intra_node": "NVIDIA Blackwell datasheet: NVLink 5 1.8 TB/s bidirectional = 900 GB/s per direction",
            "allreduce_latency": "assumed like Hopper NVLink NCCL latency, slightly lower",
            "inter_node": "ConnectX-7 400 Gb/s per GPU (HGX B200 reference)"}),
    _hw("mi300x", bf16=1307.4, fp8=2614.9, int8=2614.9, fp32=163.4, mem_gib=192, bw_tbs=5.3, link_gbs=448,
        ar_us=35, inter_gbs=50, sources={
            "compute": "AMD Instinct MI300X datasheet: BF16 1307.4 TFLOPS dense, FP8 2614.9, INT8 2614.9 TOPS, "
                       "FP32 163.4 TFLOPS (matrix)",
            "memory": "AMD MI300X datasheet: 192 GB HBM3 (binary: 192 GiB; vLLM logs total_gpu_memory 191.45 GiB), "
                      "5.3 TB/s",
            "intra_node": "AMD MI300X datasheet: 7 Infinity Fabric links x 64 GB/s = 448 GB/s per direction",
            "allreduce_latency": "RCCL small-message latency on 8xMI300X (~35 us, order of magnitude)",
            "inter_node": "400 Gb/s NIC per GPU assumed"}),
    _hw("tpu-v5e", bf16=197, fp8=None, int8=394, fp32=49, mem_gib=16, bw_tbs=0.819, link_gbs=50,
        ar_us=20, inter_gbs=25, per_node=8, sources={
            "compute": "Google Cloud TPU v5e docs: 197 TFLOPS bf16, 394 TOPS int8 per chip; fp32 estimated as "
                       "bf16/4 (multi-pass on the MXU)",
            "memory": "Google Cloud TPU v5e docs: 16 GB HBM2 (binary: 16 GiB), 819 GB/s",
            "intra_node": "Google Cloud TPU v5e docs: ICI 1,600 Gbps per chip over 4 links, ~50 GB/s per link "
                          "per direction used by a ring",
            "allreduce_latency": "ICI all-reduce small-message latency (~20 us, assumed)",
            "inter_node": "data-center network between slices (~25 GB/s per chip, assumed)"}),
    _hw("tpu-v5p", bf16=459, fp8=None, int8=918, fp32=115, mem_gib=95, bw_tbs=2.765, link_gbs=100,
        ar_us=20, inter_gbs=25, per_node=8, sources={
            "compute": "Google Cloud TPU v5p docs: 459 TFLOPS bf16, 918 TOPS int8 per chip; fp32 estimated bf16/4",
            "memory": "Google Cloud TPU v5p docs: 95 GB HBM2e (binary: 95 GiB), 2,765 GB/s",
            "intra_node": "Google Cloud TPU v5p docs: ICI 4,800 Gbps per chip over 6 links, ~100 GB/s per link",
            "allreduce_latency": "ICI all-reduce small-message latency (~20 us, assumed)",
            "inter_node": "data-center network between slices (~25 GB/s per chip, assumed)"}),
    # A small CPU treated as one device, as measured on the project's 2-core machines with XLA:CPU.
    Hardware(name="cpu", peak_flops={"fp32": 120 * GIGA, "bf16": 7 * GIGA, "fp16": 7 * GIGA},
             memory_bytes=8 * GIGA, memory_bw=27 * GIGA, intra_node_bw=10 * GIGA, allreduce_latency_s=50e-6,
             inter_node_bw=1 * GIGA, devices_per_node=1, sources={
                 "compute": "measured (../shared/GUIDE.md): XLA:CPU fp32 matmul ~120 GFLOP/s on 2 cores; bf16 15-20x "
                            "slower (~7 GFLOP/s)",
                 "memory": "measured (../shared/GUIDE.md): streaming read ~27 GB/s; capacity: 8 GB assumed for the "
                           "pool",
                 "intra_node": "host devices share memory (XLA forced host devices), assumed 10 GB/s",
                 "allreduce_latency": "assumed 50 us", "inter_node": "not applicable (1 GB/s placeholder)"},
             coefficients=Coefficients(compute_eff=0.8, gemm_m_half=4.0, weight_bw_eff=0.6, kv_bw_eff=0.3,
                                       comm_eff=0.5, step_overhead_s=2e-3, layer_overhead_s=100e-6,
                                       seq_overhead_s=50e-6, prefill_token_overhead_s=0.0)),
]}

_PROFILE_KEYS = {"name", "base", "peak_tflops", "memory_gib", "memory_gb", "memory_bandwidth_gbps",
                 "intra_node_bandwidth_gbps", "allreduce_latency_us", "inter_node_bandwidth_gbps", "devices_per_node",
                 "sources", "coefficients",
                 "notes", "measurements", "device"}


def _positive(d: dict[str, Any], key: str, where: str) -> float:
    try:
        v = float(d[key])
    except (TypeError, ValueError):
        raise HardwareError(f"{where}: {key!r} must be a number, got {d[key]!r}") from None
    if not v > 0:
        raise HardwareError(f"{where}: {key!r} must be positive, got {v}")
    return v


def hardware_from_profile(profile: dict[str, Any], where: str = "profile") -> Hardware:
    """Build `Hardware` from a profile dict (human units); `base` names a catalog entry to start from."""
    if not isinstance(profile, dict):
        raise HardwareError(f"{where}: a hardware profile must be a JSON object")
    unknown = set(profile) - _PROFILE_KEYS
    if unknown:
        raise HardwareError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_PROFILE_KEYS)}")
    base_name = profile.get("base")
    if base_name is not None and base_name not in CATALOG:
        raise HardwareError(f"{where}: unknown base {base_name!r}; choose from {', '.join(CATALOG)}")
    d = CATALOG[base_name].to_profile() if base_name else {}
    coeffs = dict(d.get("coefficients") or Coefficients().to_dict())
    if "memory_gib" in profile and "memory_gb" in profile:
        raise HardwareError(f"{where}: give the memory once, as 'memory_gib' or 'memory_gb'")
    if "memory_gb" in profile:  # decimal gigabytes, as older profiles wrote it
        d.pop("memory_gib", None)
    d.update({k: v for k, v in profile.items() if k != "coefficients"})
    if "peak_tflops" in profile and base_name:
        d["peak_tflops"] = {**CATALOG[base_name].to_profile()["peak_tflops"], **profile["peak_tflops"]}
    missing = [k for k in ("peak_tflops", "memory_gib", "memory_bandwidth_gbps") if k not in d
               and not (k == "memory_gib" and "memory_gb" in d)]
    if missing:
        raise HardwareError(f"{where}: missing required keys {missing} (or give \"base\": a catalog name)")
    peaks = d["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        raise HardwareError(f"{where}: 'peak_tflops' must be an object like {{\"bf16\": 989, \"fp32\": 67}}")
    peak_flops = {k: _positive(peaks, k, where + ".peak_tflops") * TERA for k in peaks}
    for k, v in (profile.get("coefficients") or {}).items():
        if k not in COEFFICIENT_DOCS:
            raise HardwareError(f"{where}: unknown coefficient {k!r}; known: {', '.join(COEFFICIENT_DOCS)}")
        try:
            coeffs[k] = float(v)
        except (TypeError, ValueError):
            raise HardwareError(f"{where}: coefficient {k!r} must be a number") from None
        if coeffs[k] < 0 or (k.endswith("_eff") and not 0 < coeffs[k] <= 1.5) or (
                k in ("attn_eff_scale", "moe_compute_eff_scale", "moe_weight_bw_eff_scale") and coeffs[k] <= 0):
            raise HardwareError(f"{where}: coefficient {k!r}={coeffs[k]} out of range")
    d.setdefault("intra_node_bandwidth_gbps", 10.0)
    d.setdefault("allreduce_latency_us", 50.0)
    d.setdefault("inter_node_bandwidth_gbps", 1.0)
    return Hardware(
        name=str(d.get("name") or base_name or "custom"), peak_flops=peak_flops,
        memory_bytes=(_positive(d, "memory_gib", where) * GIB if "memory_gib" in d
                      else _positive(d, "memory_gb", where) * GIGA),
        memory_bw=_positive(d, "memory_bandwidth_gbps", where) * GIGA,
        intra_node_bw=_positive(d, "intra_node_bandwidth_gbps", where) * GIGA,
        allreduce_latency_s=float(d["allreduce_latency_us"]) * 1e-6,
        inter_node_bw=_positive(d, "inter_node_bandwidth_gbps", where) * GIGA,
        devices_per_node=int(d.get("devices_per_node", 1 if base_name is None else 8)),
        sources=dict(d.get("sources") or {}), coefficients=Coefficients(**coeffs))


def load_hardware(hardware: str | Path | Hardware) -> Hardware:
    """Resolve a catalog name, a profile JSON path, or pass a `Hardware` through."""
    if isinstance(hardware, Hardware):
        return hardware
    if str(hardware) in CATALOG:
        return CATALOG[str(hardware)]
    path = Path(hardware)
    if not path.is_file():
        raise HardwareError(f"unknown hardware {str(hardware)!r}: not one of {', '.join(CATALOG)} "
                            "nor a profile JSON file")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HardwareError(f"{path}: not valid JSON ({e})") from None
    return hardware_from_profile(profile, where=str(path))


def save_profile(hw: Hardware, path: str | Path) -> None:
    """Write `hw` as a profile JSON (what `jaxserve calibrate` does after fitting coefficients)."""
    Path(path).write_text(json.dumps(hw.to_profile(), indent=2) + "\n")


def with_moe_kernels(hw: Hardware, kernels: str) -> Hardware:
    """`hw` as priced for an engine whose MoE kernels are `kernels` ("tuned": as is; "untuned": its MoE
    efficiencies divided by MOE_UNTUNED's factors)."""
    if kernels not in MOE_KERNELS:
        raise HardwareError(f"unknown MoE kernels {kernels!r}; choose from {', '.join(MOE_KERNELS)}")
    if kernels == "tuned":
        return hw
    c = hw.coefficients
    return hw.with_coefficients(**{k: getattr(c, k) * f for k, f in MOE_UNTUNED.items()})

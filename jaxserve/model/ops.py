"""Which implementation runs each of the model's heavy operations: decided once at start-up by the platform policy
(jaxserve/platform/policy.py) and passed into the jitted step, so the model itself never asks which device it is on.

Both classes are frozen dataclasses: hashable, so a jitted function closes over them as static configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.attention.backend import AttentionBackend


@dataclass(frozen=True)
class MatmulRoute:
    """How `layers.linear` multiplies x [T, in] by a weight, by the step's row count T.

    - `cpu_kernel`: jaxserve's C++ matmuls may run (a CPU, float32 or int8 codes, one device), at the row counts
      `plan` names (None: wherever they support the shapes);
    - `transposed_rows`: (lo, hi) on XLA's CPU backend, where steps of lo..hi rows go in transposed so Eigen, not
      YNNPACK, runs them (docs/tuning.md); None elsewhere;
    - `step_order_converts`: quantized weights on XLA's path are converted one at a time, in step order (a CPU,
      where XLA would otherwise hoist every weight's float copy to the step's start; docs/quantization.md);
    - `moe_tiles_in_use`: the MoE layer's XLA loop runs over the tiles in use, a device-computed bound (a CPU, whose
      loops run on the host anyway), rather than over the most a step can need (a static bound: an accelerator's
      runtime would copy a device-computed bound to the host every iteration; model/moe.py);
    - `matvec_rows`: on a GPU, the row counts at which a projection (float or int8/fp8 codes) runs in the Pallas
      few-row matmul (kernels/gpu/matvec.py), which reads the weight once in its stored dtype: measured faster than
      XLA's dot at those counts on this device at start-up (platform/gpu_matmul_choice.py); `matvec_interpret`
      runs it in Pallas' interpreter (tests on a CPU);
    - `fp8_activations`: fp8 weights at row counts past the matvec's run as an fp8 GEMM, the activations quantized
      per token to e4m3 (Hopper's fp8 tensor cores; model/quantize.py).
    """

    cpu_kernel: bool = False
    plan: KernelPlan | None = None
    transposed_rows: tuple[int, int] | None = None
    step_order_converts: bool = False
    moe_tiles_in_use: bool = False
    matvec_rows: frozenset[int] = frozenset()
    matvec_interpret: bool = False
    fp8_activations: bool = False

    def kernel_at(self, rows: int) -> bool:
        """Whether the C++ matmul may take a projection of `rows` rows."""
        return self.cpu_kernel and (self.plan is None or self.plan.matmul(rows))

    def row_parts_at(self, rows: int) -> int:
        """The C++ matmul's part count for a projection of `rows` rows (0: its default)."""
        return self.plan.parts_at(rows) if self.plan is not None else 0

    def head_kernel_at(self, rows: int) -> bool:
        """Whether the C++ matmul may take the LM head over `rows` hidden rows."""
        return self.cpu_kernel and (self.plan is None or self.plan.head(rows))

    def moe_kernel_at(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens runs its expert tiles in the grouped C++ kernel."""
        return self.cpu_kernel and (self.plan is None or self.plan.moe(tokens))

    def int8_threads(self, rows: int) -> int:
        """The int8 kernel's thread limit at `rows` rows (0: all of XLA's intra-op threads)."""
        return self.plan.int8_threads(rows) if self.plan is not None else 0

    def matvec_at(self, rows: int) -> bool:
        """Whether a projection of `rows` rows runs in the GPU few-row matmul."""
        return rows in self.matvec_rows

    def transposed_at(self, rows: int) -> bool:
        """Whether a projection of `rows` rows goes in transposed (see the class doc)."""
        return self.transposed_rows is not None and self.transposed_rows[0] <= rows <= self.transposed_rows[1]


XLA_MATMULS = MatmulRoute()  # XLA's own dot for every projection, as written


@dataclass(frozen=True)
class ModelOps:
    """The model's implementations for one engine: paged attention's backend and the projections' route."""

    attention: AttentionBackend
    matmul: MatmulRoute = XLA_MATMULS

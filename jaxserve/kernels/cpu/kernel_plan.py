"""Which row counts of a step's matmuls go to jaxserve's CPU matmul kernel: decided once at start-up, from what
was measured faster than XLA's own dots on this machine (`kernel_choice.choose`), and passed down to
`llama.linear` and the LM head, so that no step shape runs slower in the kernel than it would in XLA."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelPlan:
    """The row counts at which x @ w (`matmul_rows`) and the LM head (`head_rows`) run in the kernel; at any other
    count they run in XLA. Hashable: jitted functions close over it as a static choice."""

    isa: str  # what the kernels were built for: "avx512", "avx2" or "portable"
    matmul_rows: frozenset[int]
    head_rows: frozenset[int]
    moe_rows: frozenset[int] = frozenset()  # step sizes whose expert tiles run in the grouped kernel
    # row counts at which the int8 kernel runs on one thread: where the CPUs share one core's vector units, a
    # second thread only contends for them
    int8_one_thread_rows: frozenset[int] = frozenset()
    # the most parts a one-row projection cuts its weight into for the threads to claim (0: the kernel's default):
    # fewer, longer parts streamed faster on some CPUs, more let a thread cover for a descheduled one on others
    row_parts: int = 0

    def moe(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens runs its MoE layers' expert tiles in the grouped kernel."""
        return tokens in self.moe_rows

    def matmul(self, rows: int) -> bool:
        """Whether a projection of `rows` rows goes to the kernel."""
        return rows in self.matmul_rows

    def head(self, rows: int) -> bool:
        """Whether the LM head over `rows` hidden rows goes to the kernel."""
        return rows in self.head_rows

    def parts_at(self, rows: int) -> int:
        """The part count the kernel's call at `rows` rows takes (0: its default; only one row is cut in parts)."""
        return self.row_parts if rows == 1 else 0

    def int8_threads(self, rows: int) -> int:
        """The int8 kernel's thread limit for `rows` rows: 1, or 0 for all of XLA's intra-op threads."""
        return 1 if rows in self.int8_one_thread_rows else 0

    def describe(self) -> str:
        """One line for the start-up log."""
        def rows(r: frozenset[int]) -> str:
            return ", ".join(map(str, sorted(r))) + " rows" if r else "no row count"

        moe = f", grouped expert kernel at {rows(self.moe_rows).replace('rows', 'tokens')}" if self.moe_rows else ""
        if self.int8_one_thread_rows:
            moe += f", int8 kernel on one thread at {rows(self.int8_one_thread_rows)}"
        if self.row_parts:
            moe += f", one row in at most {self.row_parts} parts"
        return (f"CPU kernels built for {self.isa}: matmul kernel at {rows(self.matmul_rows)}, LM head kernel at "
                f"{rows(self.head_rows)}{moe}; XLA's dots at every other row count")

"""Run any `jaxserve` command with another instruction-set build of the CPU kernels loaded first.

    python scripts/with_kernel_variant.py avx2 report --model small --out reports/small-avx2
    python scripts/with_kernel_variant.py portable calibrate --model tiny --out /tmp/tiny.json

On an AVX-512 machine `avx2` emulates an AVX2-only CPU for the kernels (same cores, half the vector width, 16
named registers); XLA's own code still uses AVX-512. The engine's kernel plan is measured for that build at its
first start and cached under the build's own key, so calibrate and the report measure what the engine runs.
"""

from __future__ import annotations

import sys

from jaxserve.kernels.cpu import library as cpu_kernels


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in cpu_kernels.VARIANTS:
        print(f"usage: with_kernel_variant.py {{{'|'.join(cpu_kernels.VARIANTS)}}} JAXSERVE-COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    variant, rest = argv[0], argv[1:]
    # The first library loaded is the one every later `available()` returns, so the engine takes this build.
    if not cpu_kernels.load(cpu_kernels.CACHE_DIR, variant):
        print(f"error: the {variant} build of jaxserve's CPU kernels is not available", file=sys.stderr)
        return 2
    print(f"jaxserve's CPU kernels: the {variant} build ({cpu_kernels.isa()})", file=sys.stderr)
    from jaxserve.cli.main import main as jaxserve_main  # after the load: nothing may load the native build first

    jaxserve_main(rest)  # exits with the command's status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

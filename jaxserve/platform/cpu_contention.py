"""How much CPU other processes (and, on a VM, other guests) took while this process timed something.

The kernel plan times its candidates once per machine and keeps the timings (`kernel_choice`); timings taken while
another process ran beside them (the test suite's other worker, a benchmark, a neighbour's burst) can choose the
wrong path for every later start. `OthersCpu` measures that share from the machine's CPU counters, so such timings
serve the start that took them and are not kept.
"""

from __future__ import annotations

import os
import time

# Others' average use over a timing above which it is not kept: a quiet machine measured ~0.01 cores (the 2-core
# EPYC, docs/tuning.md), the suite's other worker about one.
OTHERS_MAX_CORES = 0.25


def _machine_cpu_s() -> float | None:
    """Seconds of CPU the machine's cores spent busy, plus the time a hypervisor gave to other guests (`steal`);
    None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OthersCpu:
    """Started when made: `cores()` is the CPU everything but this process has used since, in cores on average
    (None where the machine does not say); `busy()` whether that exceeds OTHERS_MAX_CORES."""

    def __init__(self) -> None:
        self._start = (time.monotonic(), _machine_cpu_s(), time.process_time())

    def cores(self) -> float | None:
        wall0, machine0, own0 = self._start
        machine = _machine_cpu_s()
        if machine is None or machine0 is None:
            return None
        wall = max(time.monotonic() - wall0, 1e-9)
        return max(0.0, (machine - machine0) - (time.process_time() - own0)) / wall

    def busy(self) -> bool:
        cores = self.cores()
        return cores is not None and cores > OTHERS_MAX_CORES

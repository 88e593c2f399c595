"""What other processes take of the CPU while this one times something (`platform/cpu_contention.py`): the kernel
plan keeps only timings taken on a machine no one else was using."""

import subprocess
import sys
import time

import pytest

from jaxserve.platform import cpu_contention
from jaxserve.platform.cpu_contention import OthersCpu

pytestmark = pytest.mark.skipif(cpu_contention._machine_cpu_s() is None, reason="no /proc/stat here")


@pytest.mark.exclusive  # the other test worker would count as another process
def test_a_process_spinning_beside_the_block_counts_and_this_ones_own_work_does_not(monkeypatch):
    monkeypatch.setattr(cpu_contention, "OTHERS_MAX_CORES", 0.25)  # the suite's conftest lifts it
    own = OthersCpu()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # this process's own CPU
        pass
    assert own.cores() < 0.25 and not own.busy()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic()\n"
                                "while time.monotonic() - t < 1.5: pass"])
    try:
        time.sleep(0.3)  # the interpreter's start
        beside = OthersCpu()
        time.sleep(0.8)
        assert beside.cores() > 0.5 and beside.busy()
    finally:
        spinner.wait()

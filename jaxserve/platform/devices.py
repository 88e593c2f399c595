"""Facts about the devices that only the platform layer reads: whether a device is a CPU, how much memory it has,
which of the host's cores this process may use.

The engine's choices go through `policy.PlatformPolicy`, which holds the `DeviceFacts` it read at start-up; the
measurement tools (which describe and price a CPU differently from an accelerator) read them there. The one other
reader is start-up before any engine: `provide_devices`, which makes a disaggregated report's devices visible.
No file outside this package asks which platform it runs on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class DeviceFacts:
    """What a set of devices is, read once from its first device."""

    platform: str  # "cpu", "gpu", "tpu"
    kind: str  # the device kind, for names and logs
    cpu: bool
    memory_bytes: float | None  # the host's memory on a CPU; what XLA may allocate on an accelerator (None: unknown)
    cores: tuple[int, ...]  # the host's cores this process may run on, in order (pinned pools take them)


def device_facts(devices: Sequence[jax.Device] | None = None) -> DeviceFacts:
    """The facts of `devices` (default: this process's `jax.devices()`)."""
    device = next(iter(devices if devices is not None else jax.devices()))
    platform, kind = device_description(device)
    cpu = is_cpu(device)
    memory = host_memory_bytes() if cpu else memory_limit(device)
    return DeviceFacts(platform, kind, cpu, memory, tuple(usable_cores()))


def is_cpu(device: jax.Device) -> bool:
    """Whether `device` is a CPU."""
    return device.platform == "cpu"


def memory_limit(device: jax.Device) -> float | None:
    """An accelerator's memory that XLA may allocate, in bytes; None on a CPU (its memory is the host's)."""
    if is_cpu(device):
        return None
    stats = device.memory_stats() or {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


def host_memory_bytes() -> float:
    """The host's physical memory, in bytes."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_description(device: jax.Device) -> tuple[str, str]:
    """(platform, device kind) of a device, for names and logs."""
    return device.platform, str(getattr(device, "device_kind", device.platform))


def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def provide_devices(p: int, d: int) -> str:
    """Make P + D devices visible before JAX starts (`--disagg P+D`); returns the platform. ValueError if they
    cannot be.

    On CPU this asks JAX for P + D CPU devices (`jax_num_cpu_devices`, read only by the CPU platform, so it
    changes nothing on an accelerator; once JAX has started, the devices it has are used). Fake CPU devices
    beyond the cores would time-share them, which a speed measurement cannot use, so on CPU P + D must not
    exceed the cores this process may run on (nor may the servers' pinned cores, measured as processes).
    """
    n = p + d
    with contextlib.suppress(RuntimeError):  # raised once the backend has started (e.g. in a test process)
        jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"--disagg {p}+{d} needs {n} devices; {len(devices)} visible")
    facts = device_facts(devices)
    cores = len(facts.cores)
    if facts.cpu and n > cores:
        raise ValueError(f"--disagg {p}+{d} needs {n} CPU devices but this machine has {cores} cores "
                         "(fake devices beyond the cores would only share them)")
    return facts.platform

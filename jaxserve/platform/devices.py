"""Facts about the devices that only the platform layer reads: whether a device is a CPU, how much memory it has.

The engine's choices go through `policy.PlatformPolicy`; what sizes memory and the measurement tools (which
describe and price a CPU differently from an accelerator) read `DeviceFacts`, looked at once, so no file outside
this package asks which platform it runs on.
"""

from __future__ import annotations

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


def device_facts(devices: Sequence[jax.Device] | None = None) -> DeviceFacts:
    """The facts of `devices` (default: this process's `jax.devices()`)."""
    device = next(iter(devices if devices is not None else jax.devices()))
    platform, kind = device_description(device)
    cpu = is_cpu(device)
    return DeviceFacts(platform, kind, cpu, host_memory_bytes() if cpu else memory_limit(device))


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

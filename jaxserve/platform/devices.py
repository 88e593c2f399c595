"""Facts about the devices that only the platform layer reads: whether a device is a CPU, how much memory it has.

The engine's choices go through `policy.PlatformPolicy`; these are for what sizes memory and for the measurement
tools, which describe and price a CPU differently from an accelerator.
"""

from __future__ import annotations

import os

import jax


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

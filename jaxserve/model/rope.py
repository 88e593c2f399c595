"""Rotary position embeddings with HF conventions (rotate_half layout) and Llama-3.1 rope scaling."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class RopeScalingError(ValueError):
    """A rope_scaling config this runtime does not implement."""


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, computed as HF does (default, linear, llama3)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise RopeScalingError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(
        np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array,
                 inv_freq: np.ndarray | tuple[float, ...]) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim // 2] (float32) for integer positions [T]."""
    freqs = jnp.asarray(np.asarray(inv_freq, dtype=np.float32))
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, heads, head_dim] in HF's rotate_half layout (first half / second half pairs)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

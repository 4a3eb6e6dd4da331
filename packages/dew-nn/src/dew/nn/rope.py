"""Rotary position embeddings (Su et al., 2021, arXiv:2104.09864).

Uses the "rotate half" layout of GPT-NeoX and Hugging Face Llama: the first
and second halves of each head's features form the rotated pairs, so
Hugging Face checkpoints load without permuting weights.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long contexts.

    kind: ``'linear'`` (positions divided by ``factor``) or ``'llama3'``
      (Meta's Llama 3.1 frequency-dependent scaling).
    factor: the context extension factor.
    low_freq_factor, high_freq_factor, original_max_position: llama3 only.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(
                f"unsupported rope scaling {self.kind!r}; supported: 'linear', 'llama3'"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """``[head_dim // 2]`` inverse frequencies, float64 numpy (computed once, at trace time)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate between.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x`` ``[batch, length, heads, head_dim]`` by ``positions`` ``[batch, length]``."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(angles)[:, :, None, :]  # [batch, length, 1, head_dim/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)

"""Rotary position embeddings (Su et al., 2021, arXiv:2104.09864).

Uses the "rotate half" layout of GPT-NeoX and Hugging Face Llama: the first
and second halves of each head's features form the rotated pairs, so
Hugging Face checkpoints load without permuting weights.

:func:`apply_axial_rope` rotates by coordinates on a grid instead (patches of
an image or tubelets of a video), in V-JEPA 2's layout (Assran et al., 2025),
so its checkpoints load as they are.
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


def axial_section_dim(head_dim: int, num_axes: int) -> int:
    """Features of each head that one grid axis rotates: the largest even number
    ``<= head_dim / num_axes`` (V-JEPA 2's ``2 * ((head_dim // 3) // 2)`` for video)."""
    return 2 * ((head_dim // num_axes) // 2)


def apply_axial_rope(x: jax.Array, coordinates: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotate ``x`` ``[batch, length, heads, head_dim]`` by grid coordinates
    ``[batch, length, axes]`` (patch indices along each axis: time, row, column).

    V-JEPA 2's layout: axis ``a`` owns features ``[a S, (a + 1) S)`` of each
    head, ``S = axial_section_dim(head_dim, axes)``; the remaining ``head_dim -
    axes S`` features pass unrotated. Within a section, feature ``i`` pairs
    with its neighbour (``2j`` with ``2j + 1``) and turns by the angle
    ``c_a w_(i mod S/2)``, ``w_k = theta^(-2k / S)``::

        out[2j]     = x[2j]     cos(c_a w_(2j mod S/2))     - x[2j + 1] sin(c_a w_(2j mod S/2))
        out[2j + 1] = x[2j + 1] cos(c_a w_(2j+1 mod S/2)) + x[2j]     sin(c_a w_(2j+1 mod S/2))

    (the angles are the ``S/2`` frequencies tiled twice, as V-JEPA 2's
    ``rotate_queries_or_keys`` repeats them, so the two members of a pair
    turn by different angles).
    """
    num_axes, head_dim = coordinates.shape[-1], x.shape[-1]
    section = axial_section_dim(head_dim, num_axes)
    if section == 0:
        raise ValueError(
            f"head_dim {head_dim} is too small for a rotary embedding over {num_axes} grid "
            f"axes; it needs head_dim >= {2 * num_axes} (2 features per axis)"
        )
    rotated_dim = num_axes * section
    inv_freq = jnp.asarray(inverse_frequencies(section, theta, None), jnp.float32)
    angles = coordinates[..., None].astype(jnp.float32) * inv_freq  # [batch, length, axes, S/2]
    angles = jnp.tile(angles, 2).reshape(*coordinates.shape[:2], 1, rotated_dim)
    x32 = x.astype(jnp.float32)
    pairs = x32[..., :rotated_dim].reshape(*x.shape[:-1], rotated_dim // 2, 2)
    turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(*x.shape[:-1], -1)
    out = x32[..., :rotated_dim] * jnp.cos(angles) + turned * jnp.sin(angles)
    out = jnp.concatenate([out, x32[..., rotated_dim:]], axis=-1)
    return out.astype(x.dtype)  # [batch, length, heads, head_dim]

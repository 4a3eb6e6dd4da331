"""Normalisation layers with logically named parameters."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): ``x / rms(x) * scale``.

    Computed in float32 whatever the input dtype, as Llama does. ``axis``: the
    logical axis of ``scale`` (``embed``; ``head_dim`` for a per-head q/k norm).
    """

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    axis: str = axes.EMBED

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nn.Module):
    """Layer norm (Ba et al., 2016) with a bias, as GPT-2 uses."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (axes.EMBED,)),
            (features,),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
            (features,),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


NORMS = ("rms", "layer")


def make_norm(kind: str, eps: float, dtype, param_dtype, name: str) -> nn.Module:
    """``'rms'`` or ``'layer'``."""
    if kind == "rms":
        return RMSNorm(eps=eps, dtype=dtype, param_dtype=param_dtype, name=name)
    if kind == "layer":
        return LayerNorm(eps=eps, dtype=dtype, param_dtype=param_dtype, name=name)
    raise ValueError(f"unknown norm {kind!r}; use one of {NORMS}")

"""What a diffusion network predicts, and the conversions between the four choices.

On a Gaussian path ``x = alpha x0 + sigma eps`` (any schedule of
:mod:`dew.sampling.diffusion.schedules`) the network may predict

- ``'eps'``: the noise ``eps`` (DDPM, Ho et al. 2020);
- ``'x0'``: the data ``x0`` (EDM's denoiser ``D`` is one);
- ``'v'``: ``v = alpha eps - sigma x0`` (Salimans & Ho 2022); stays finite where
  ``alpha -> 0`` (zero terminal SNR);
- ``'flow'``: the velocity ``u = eps - x0`` of rectified flow / flow matching (Liu et al.
  2022; Lipman et al. 2022), ``dx/dt`` on the path ``x = (1 - t) x0 + t eps``.

Given ``x`` and one prediction, ``(x0, eps)`` follow by solving the 2x2 system
``[x, p] = M [x0, eps]``:

- eps: ``x0 = (x - sigma p) / alpha``
- x0: ``eps = (x - alpha p) / sigma``
- v: ``x0 = (alpha x - sigma p) / (alpha^2 + sigma^2)``,
  ``eps = (sigma x + alpha p) / (alpha^2 + sigma^2)`` (``alpha x - sigma v`` on a
  variance-preserving path)
- flow: ``x0 = (x - sigma p) / (alpha + sigma)``, ``eps = (x + alpha p) / (alpha + sigma)``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TARGETS = ("eps", "v", "x0", "flow")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"unknown prediction target {target!r}; use one of {TARGETS}")


def target_of(target: str, x0: jax.Array, eps: jax.Array, alpha, sigma) -> jax.Array:
    """The regression target of ``target`` for data ``x0``, noise ``eps`` and the path's
    ``alpha``, ``sigma`` (broadcast against them)."""
    check_target(target)
    if target == "eps":
        return eps
    if target == "x0":
        return x0
    if target == "v":
        return alpha * eps - sigma * x0
    return eps - x0


def predictions_of(
    target: str, prediction: jax.Array, x: jax.Array, alpha, sigma
) -> tuple[jax.Array, jax.Array]:
    """``(x0, eps)`` from the network's ``prediction`` of ``target`` at ``x = alpha x0 +
    sigma eps``. eps is undefined where ``sigma = 0`` for an x0 target and x0 where
    ``alpha = 0`` for an eps target; samplers never evaluate there."""
    check_target(target)
    p = prediction
    if target == "eps":
        return (x - sigma * p) / alpha, p
    if target == "x0":
        return p, (x - alpha * p) / sigma
    if target == "v":
        norm = alpha**2 + sigma**2
        return (alpha * x - sigma * p) / norm, (sigma * x + alpha * p) / norm
    total = alpha + sigma
    return (x - sigma * p) / total, (x + alpha * p) / total


def eps_from_x0(x0: jax.Array, x: jax.Array, alpha, sigma) -> jax.Array:
    """``eps = (x - alpha x0) / sigma`` (after clipping x0, improved-diffusion's
    ``_predict_eps_from_xstart``)."""
    return (x - alpha * x0) / sigma


def as_float32(x: jax.Array) -> jax.Array:
    """Sampler math runs in float32 or wider: bfloat16 / float16 inputs are promoted."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))

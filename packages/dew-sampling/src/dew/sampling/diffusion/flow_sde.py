"""The flow ODE as an SDE with the same marginals, sampled with per-step log-probs
(Flow-GRPO, Liu et al. 2025, arXiv 2505.05470; its ``sde_step_with_logprob``).

Time runs from ``t = 1`` (noise) to ``t = 0`` (data), ``x_t = (1 - t) x0 + t eps``,
and ``v = eps - x0`` is the flow velocity (the denoiser's ``eps - x0``,
:func:`dew.sampling.model_denoiser`). With noise level ``a``:

- ``kind="sde"`` (Flow-GRPO): ``dx = [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt +
  sigma_t dw``, ``sigma_t = a sqrt(t / (1 - t))``, has the ODE's marginals. One
  Euler-Maruyama step from ``t`` to ``t'`` (``dt = t' - t < 0``)::

      mean = x (1 + sigma_t^2 dt / (2t)) + v (1 + sigma_t^2 (1 - t) / (2t)) dt
      x'   = mean + sigma_t sqrt(-dt) z,          z ~ N(0, I)

  At ``t = 1`` the ``1 - t`` in ``sigma_t`` is replaced by ``1 - t_1`` (the next
  time), the reference's guard (``sigma_max``).
- ``kind="cps"`` (coefficients-preserving sampling, Wang & Yu 2025, arXiv 2509.05952):
  ``x0 = x - t v``, ``x1 = x + (1 - t) v``, ``s = t' sin(a pi / 2)``,
  ``mean = (1 - t') x0 + sqrt(t'^2 - s^2) x1``, ``x' = mean + s z``: the noise's
  coefficient stays ``t'``. Its last step (``t' = 0``) has no noise, so it is never
  stochastic.

Each stochastic step's log-prob is the Gaussian's, ``log N(x'; mean, std^2 I)``
(``std = sigma_t sqrt(-dt)``, or ``s``), averaged over the sample's dimensions
(``reduction="mean"``, the reference's) or summed (``"sum"``, the true log-density),
in float32 whatever the model's dtype. The CPS reference drops the Gaussian's scale
and constants (``-(x' - mean)^2``); here both kinds use the Gaussian's.

``window=(start, end)``: only steps ``start <= i < end`` are stochastic, the others
ODE Euler steps (Flow-GRPO-Fast, MixGRPO); the trajectory keeps the window's states
and log-probs only. ``a = 0`` has no stochastic step: it is :class:`FlowEuler`.

Randomness: row ``r`` of a batch draws from ``fold_in(key, rows[r])`` only (its
initial noise, then step ``i`` from ``fold_in`` of that and ``i``), where ``rows``
are the rows' global indices: the same example gets the same draws whatever the
batch size, its slot in the batch, the chunking of a rollout or the device count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import is_whole_number, real_number
from dew.sampling.diffusion.samplers import DenoiseFn, check_steps, flow_times

KINDS = ("sde", "cps")
REDUCTIONS = ("mean", "sum")


class Trajectory(NamedTuple):
    """An SDE sample and what a policy gradient needs of it.

    samples: ``[batch, *shape]`` float32, at ``t = 0``.
    latents: ``[batch, W + 1, *shape]`` float32: the states before each of the ``W``
      stochastic steps and after the last one (``latents[:, j]`` -> ``latents[:, j + 1]``
      is window step ``j``).
    log_probs: ``[batch, W]`` float32 log-probs of those transitions.
    """

    samples: jax.Array
    latents: jax.Array
    log_probs: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowSDE:
    """The SDE sampler of a flow model, with per-step log-probs (module docstring).

    num_steps: sampling steps (model calls); Flow-GRPO trains on 10 and evaluates
      with the ODE on 40. At least 2.
    noise_level: ``a`` >= 0 (Flow-GRPO: 0.7; its CPS recipe 0.8); 0 = the ODE.
    kind: ``"sde"`` (Flow-GRPO's) or ``"cps"`` (coefficients-preserving).
    window: ``(start, end)``: the stochastic steps ``start <= i < end``; None = all
      (all but the last for CPS, whose last step has no noise).
    shift: the time shift ``s t / (1 + (s - 1) t)`` of :func:`flow_times` (1 = none).
    reduction: a step's log-prob over the sample's dimensions: ``"mean"`` (the
      reference's) or ``"sum"``.
    """

    num_steps: int = 10
    noise_level: float = 0.7
    kind: str = "sde"
    window: tuple[int, int] | None = None
    shift: float = 1.0
    reduction: str = "mean"

    family = "flow"

    def __post_init__(self):
        steps = check_steps(
            self.num_steps,
            low=2,
            meaning=(
                "FlowSDE: the first step starts at t = 1, where the noise scale borrows the "
                "next time"
            ),
        )
        object.__setattr__(self, "num_steps", steps)
        a = real_number(
            self.noise_level,
            "noise_level",
            low=0.0,
            meaning="FlowSDE's a; Flow-GRPO: 0.7; 0 = the ODE",
        )
        object.__setattr__(self, "noise_level", a)
        shift = real_number(
            self.shift, "shift", low=0.0, low_open=True, meaning="FlowSDE's time shift; 1 = none"
        )
        object.__setattr__(self, "shift", shift)
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "cps" and a > 1:
            raise ValueError(f"CPS needs noise_level in [0, 1] (s = t' sin(a pi / 2)), got {a}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.window is not None:
            window = tuple(self.window)
            last = self.num_steps - (1 if self.kind == "cps" else 0)
            if (
                len(window) != 2
                or not all(is_whole_number(w) for w in window)
                or not 0 <= window[0] < window[1] <= last
            ):
                raise ValueError(
                    f"window {self.window!r} must be (start, end) step indices with 0 <= start "
                    f"< end <= {last} ({self.num_steps} steps"
                    + (", the last CPS step has no noise" if self.kind == "cps" else "")
                    + "); None = every step"
                )
            object.__setattr__(self, "window", tuple(int(w) for w in window))

    # ------------------------------------------------------------- the table
    @property
    def stochastic(self) -> tuple[int, int]:
        """``(start, end)`` of the stochastic steps; ``(0, 0)`` when ``a = 0``."""
        if self.noise_level == 0:
            return (0, 0)
        if self.window is not None:
            return self.window
        return (0, self.num_steps - (1 if self.kind == "cps" else 0))

    @property
    def window_steps(self) -> int:
        start, end = self.stochastic
        return end - start

    def times(self) -> np.ndarray:
        """``num_steps + 1`` times from 1 to 0 (float64)."""
        return flow_times(self.num_steps, self.shift)

    def table(self) -> dict[str, np.ndarray]:
        """Per step ``i`` (float64, ``[num_steps]``): ``t``, ``t_next``,
        ``mean = c_x x + c_v v``, the transition's noise ``std``, the diffusion
        coefficient ``sigma`` (``sigma_t`` of ``kind="sde"``, ``s`` of CPS) and
        ``dt``; ``std = 0`` outside the stochastic steps (Euler: ``c_x = 1``,
        ``c_v = dt``)."""
        ts = self.times()
        t, t_next = ts[:-1], ts[1:]
        dt = t_next - t
        a = float(self.noise_level)
        start, end = self.stochastic
        on = (np.arange(self.num_steps) >= start) & (np.arange(self.num_steps) < end)
        if self.kind == "sde":
            guarded = np.where(t == 1.0, ts[1], t)  # the reference's sigma_max at t = 1
            sigma = a * np.sqrt(t / (1.0 - guarded))
            c_x = 1.0 + sigma**2 * dt / (2.0 * t)
            c_v = (1.0 + sigma**2 * (1.0 - t) / (2.0 * t)) * dt
            std = sigma * np.sqrt(-dt)
        else:
            s = t_next * math.sin(a * math.pi / 2.0)
            keep = np.sqrt(np.maximum(t_next**2 - s**2, 0.0))
            c_x = (1.0 - t_next) + keep
            c_v = -t * (1.0 - t_next) + (1.0 - t) * keep
            sigma = std = s
        # outside the window: the ODE's Euler step, exactly x + dt v
        c_x, c_v = np.where(on, c_x, 1.0), np.where(on, c_v, dt)
        sigma, std = np.where(on, sigma, 0.0), np.where(on, std, 0.0)
        return {"t": t, "t_next": t_next, "c_x": c_x, "c_v": c_v, "std": std, "sigma": sigma,
                "dt": dt}  # fmt: skip

    def window_table(self) -> dict[str, jax.Array]:
        """:meth:`table` restricted to the stochastic steps, float32 ``[W]``."""
        start, end = self.stochastic
        return {k: jnp.asarray(v[start:end], jnp.float32) for k, v in self.table().items()}

    # -------------------------------------------------------------- sampling
    def run(self, denoise_fn: DenoiseFn, schedule, key, shape) -> jax.Array:
        """Samples ``[batch, *shape]`` (the :func:`dew.sampling.sample_diffusion` form)."""
        del schedule
        return sample_flow_sde(denoise_fn, sampler=self, key=key, shape=shape).samples


def velocity_of(denoise_fn: DenoiseFn, x: jax.Array, time: jax.Array) -> jax.Array:
    """The flow velocity ``v = eps - x0`` of the denoiser at ``x``, float32 (the same
    expression as :class:`dew.sampling.FlowEuler`'s, so ``a = 0`` is that sampler)."""
    d = denoise_fn(x, time)
    return d.eps - d.x0


def _rows(value: jax.Array, like: jax.Array) -> jax.Array:
    value = jnp.asarray(value, jnp.float32)
    return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))


def step_mean(x: jax.Array, v: jax.Array, c_x, c_v) -> jax.Array:
    """``c_x x + c_v v`` (float32; ``c_x``, ``c_v`` scalars or one per row)."""
    return _rows(c_x, x) * x + _rows(c_v, x) * v


def gaussian_log_prob(x_next, mean, std, *, reduction: str = "mean") -> jax.Array:
    """``[batch]`` float32 ``log N(x_next; mean, std^2 I)`` per element, averaged or
    summed over the non-batch dimensions (``std`` a scalar or one per row, > 0)."""
    x_next, mean = x_next.astype(jnp.float32), mean.astype(jnp.float32)
    std = _rows(std, x_next)
    per = -((x_next - mean) ** 2) / (2.0 * std**2) - jnp.log(std) - 0.5 * math.log(2.0 * math.pi)
    per = per.reshape(per.shape[0], -1)
    return jnp.mean(per, axis=1) if reduction == "mean" else jnp.sum(per, axis=1)


def row_keys(key: jax.Array, rows: jax.Array) -> jax.Array:
    """``[batch]`` keys ``fold_in(key, rows[r])``: row ``r``'s draws (module docstring)."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.asarray(rows, jnp.uint32))


def _normal_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(keys)


def sample_flow_sde(
    denoise_fn: DenoiseFn,
    *,
    sampler: FlowSDE,
    key: jax.Array,
    shape: tuple[int, ...],
    rows: jax.Array | None = None,
    initial: jax.Array | None = None,
) -> Trajectory:
    """Sample ``shape = (batch, ...)`` with ``sampler``, traceable (call it in ``jax.jit``).

    denoise_fn: :func:`dew.sampling.model_denoiser` of a flow model (its guidance is
      the guidance of every step, and of the loss that rescores them).
    key: the rollout's key; row ``r`` draws from ``fold_in(key, rows[r])`` alone.
    rows: ``[batch]`` the rows' global indices; None = ``0..batch-1``.
    initial: ``[batch, ...]`` the noise at ``t = 1``; None = drawn per row.
    Returns a :class:`Trajectory` (the samples, the window's states and log-probs).
    """
    shape = tuple(shape)
    batch, example = shape[0], shape[1:]
    rows = jnp.arange(batch) if rows is None else rows
    keys = row_keys(key, rows)
    pairs = jax.vmap(jax.random.split)(keys)  # [batch, 2] keys
    k_init, k_steps = pairs[:, 0], pairs[:, 1]
    x = _normal_rows(k_init, example) if initial is None else initial.astype(jnp.float32)
    table = {k: jnp.asarray(v, jnp.float32) for k, v in sampler.table().items()}
    times = jnp.asarray(sampler.times(), jnp.float32)
    table["dt"] = times[1:] - times[:-1]  # in float32, as FlowEuler's steps
    start, end = sampler.stochastic

    def ode(i, x):
        v = velocity_of(denoise_fn, x, table["t"][i])
        return x + table["dt"][i] * v

    def sde(x, i):
        v = velocity_of(denoise_fn, x, table["t"][i])
        mean = step_mean(x, v, table["c_x"][i], table["c_v"][i])
        z = _normal_rows(jax.vmap(lambda k: jax.random.fold_in(k, i))(k_steps), example)
        x_next = mean + table["std"][i] * z
        logp = gaussian_log_prob(x_next, mean, table["std"][i], reduction=sampler.reduction)
        return x_next, (x_next, logp)

    x = jax.lax.fori_loop(0, start, ode, x)
    first = x
    x, (states, log_probs) = jax.lax.scan(sde, x, jnp.arange(start, end))
    x = jax.lax.fori_loop(end, sampler.num_steps, ode, x)
    latents = jnp.concatenate([first[None], states], axis=0)  # [W + 1, batch, ...]
    return Trajectory(
        samples=x,
        latents=jnp.moveaxis(latents, 0, 1),
        log_probs=jnp.moveaxis(log_probs, 0, 1).reshape(batch, end - start),
    )


def transition_log_prob(
    denoise_fn: DenoiseFn,
    sampler: FlowSDE,
    x: jax.Array,
    x_next: jax.Array,
    step: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(log_prob [batch], mean [batch, ...])`` of transitions ``x -> x_next`` at window
    steps ``step [batch]`` (int, ``0..W-1``), under ``denoise_fn``: what the sampler
    computed for them, recomputed (differentiable), for the policy loss."""
    table = sampler.window_table()
    at = {k: v[step] for k, v in table.items()}
    v = velocity_of(denoise_fn, x, at["t"])
    mean = step_mean(x, v, at["c_x"], at["c_v"])
    return gaussian_log_prob(x_next, mean, at["std"], reduction=sampler.reduction), mean

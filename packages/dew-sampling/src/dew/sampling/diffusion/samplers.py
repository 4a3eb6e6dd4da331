"""Diffusion samplers: DDPM ancestral, DDIM, flow Euler / Heun, EDM Heun; guidance.

A sampler turns noise into data with a denoiser ``denoise_fn(x, time) -> Denoised(x0,
eps, variance)`` in a schedule's own time (:mod:`dew.sampling.noise_schedules`).
:func:`model_denoiser` builds one from a network, its prediction target
(:mod:`dew.sampling.diffusion_targets`) and classifier-free guidance
(Ho & Salimans 2022): ``x0 = x0_u + w (x0_c - x0_u)`` (and the same for eps; the
guided pair stays on the path because it is linear), with the conditional and the
null-conditioned rows in one batched call. :func:`sample_diffusion` runs a sampler as one
compiled loop (``lax.fori_loop``), traceable, its math in float32 or wider:

- :class:`DDPM`: ancestral sampling from the posterior ``q(x_{t-1} | x_t, x0)``
  (Ho et al. 2020), on ``num_steps`` evenly spaced timesteps (iDDPM respacing,
  ``beta'_k = 1 - abar_k / abar_{k-1}``); fixed-small variance, or the learned
  interpolation ``exp(f log beta + (1 - f) log beta~)`` with ``f = (v + 1) / 2``.
- :class:`DDIM`: ``x' = sqrt(abar') x0 + sqrt(1 - abar' - s^2) eps + s z``,
  ``s = eta sqrt((1 - abar') / (1 - abar)) sqrt(1 - abar / abar')`` (Song et al. 2020);
  ``eta = 0`` is deterministic.
- :class:`FlowEuler` / :class:`FlowHeun`: ``x_{t'} = x_t + (t' - t) u``, ``u = eps - x0``,
  from ``t = 1`` to ``0`` (Heun averages ``u`` at both ends; its last step is Euler).
- :class:`EDMHeun`: Karras et al. 2022 Algorithm 2 (NVlabs/edm ``generate.py``
  ``edm_sampler``) on ``sigma_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) -
  smax^(1/rho)))^rho``, ``sigma_N = 0``, with optional churn.

Keys: the initial noise and each step's noise are drawn from ``key`` with shapes of the
whole batch, so a fixed key gives the same samples however the batch is sharded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import whole_number
from dew.sampling.diffusion.schedules import DDPMSchedule, EDMSchedule, FlowSchedule, Schedule
from dew.sampling.diffusion.schedules import per_row as _rows
from dew.sampling.diffusion.targets import as_float32, check_target, eps_from_x0, predictions_of


class Denoised(NamedTuple):
    """A denoiser's answer at ``x``: ``x0`` and ``eps`` (``x = alpha x0 + sigma eps``),
    float32, and the learned-variance channels ``variance`` in ``[-1, 1]`` (iDDPM's
    ``v``) or None."""

    x0: jax.Array
    eps: jax.Array
    variance: jax.Array | None = None


DenoiseFn = Callable[[jax.Array, jax.Array], Denoised]


def check_target_for(schedule: Schedule, target: str) -> None:
    """Raise ValueError when ``target`` cannot be sampled under ``schedule``."""
    check_target(target)
    if schedule.family == "edm" and target != "x0":
        raise ValueError(
            f"an EDMSchedule preconditions an x0 denoiser D = c_skip x + c_out F; "
            f"target {target!r} does not go with it: use target='x0'"
        )
    if schedule.family == "flow" and target == "eps":
        raise ValueError(
            "target 'eps' with a FlowSchedule has no x0 at t = 1 (alpha = 0), where flow "
            "sampling starts; use target='flow' (or 'v', 'x0')"
        )
    if schedule.family == "ddpm" and schedule.zero_terminal_snr and target == "eps":
        raise ValueError(
            "a zero-terminal-SNR schedule has abar = 0 at the last timestep, where an eps "
            "prediction says nothing about x0; use target='v' (Lin et al. 2023) or 'x0'"
        )


def model_denoiser(
    apply_fn: Callable[..., jax.Array],
    *,
    schedule: Schedule,
    target: str,
    learn_sigma: bool = False,
    label: jax.Array | None = None,
    null_label: int | None = None,
    context: jax.Array | None = None,
    null_context: jax.Array | None = None,
    guidance: float = 1.0,
    clip_denoised: float | None = None,
) -> DenoiseFn:
    """A ``denoise_fn(x, time)`` of a network ``apply_fn(x, t, label=None, context=None)``.

    apply_fn: the network, e.g. ``functools.partial(model.apply, variables)``; its output
      has ``C`` channels (``2C`` with ``learn_sigma``: prediction, then iDDPM's variance
      interpolation ``v``, improved-diffusion's order).
    schedule, target: how the network was trained (checked by :func:`check_target_for`).
    label: ``int32 [batch]`` class labels; null_label the null class (``num_classes``).
    context: ``[batch, tokens, features]`` text embeddings; null_context the null
      context, ``[tokens, features]`` or ``[batch, tokens, features]``.
    guidance: the classifier-free guidance scale ``w``; 1.0 = the conditional model
      alone (one call), otherwise conditional and null rows in one batched call.
    clip_denoised: clip ``x0`` to ``[-c, c]`` and recompute eps from it
      (improved-diffusion ``clip_denoised``; 1.0 for pixels in [-1, 1]); None = no clip.
    """
    check_target_for(schedule, target)
    guided = guidance != 1.0
    if guided and label is None and context is None:
        raise ValueError(
            f"guidance {guidance} needs a condition (label or context) to guide towards; "
            f"pass one, or guidance=1.0"
        )
    if guided and label is not None and null_label is None:
        raise ValueError("guidance with labels needs null_label (the model's num_classes)")
    if guided and context is not None and null_context is None:
        raise ValueError("guidance with a context needs null_context (e.g. zeros)")

    def network(x, time, label, context):
        x_in, model_t = schedule.model_input(x, time)
        raw = as_float32(apply_fn(x_in, model_t, label=label, context=context))
        variance = None
        if learn_sigma:
            raw, variance = jnp.split(raw, 2, axis=-1)
        prediction = schedule.network_output(raw, x, time)
        alpha, sigma = (_rows(c, x) for c in schedule.coefficients(time))
        x0, eps = predictions_of(target, prediction, x, alpha, sigma)
        return x0, eps, variance

    def denoise(x: jax.Array, time: jax.Array) -> Denoised:
        x = as_float32(x)
        rows = x.shape[0]
        time = jnp.broadcast_to(time, (rows,))
        if not guided:
            x0, eps, variance = network(x, time, label, context)
        else:
            both_label = both_context = None
            if label is not None:
                both_label = jnp.concatenate([label, jnp.full_like(label, null_label)])
            if context is not None:
                null = jnp.broadcast_to(null_context, context.shape).astype(context.dtype)
                both_context = jnp.concatenate([context, null])
            x0, eps, variance = network(
                jnp.concatenate([x, x]), jnp.concatenate([time, time]), both_label, both_context
            )
            (x0_c, x0_u), (eps_c, eps_u) = jnp.split(x0, 2), jnp.split(eps, 2)
            x0 = x0_u + guidance * (x0_c - x0_u)
            eps = eps_u + guidance * (eps_c - eps_u)
            variance = None if variance is None else variance[:rows]
        if clip_denoised is not None:
            alpha, sigma = (_rows(c, x) for c in schedule.coefficients(time))
            x0 = jnp.clip(x0, -clip_denoised, clip_denoised)
            eps = eps_from_x0(x0, x, alpha, sigma)
        return Denoised(x0, eps, variance)

    return denoise


def check_steps(num_steps, *, low: int = 1, meaning: str = "sampling steps") -> int:
    """``num_steps`` as an int >= ``low`` (any integer form), or a ValueError."""
    return whole_number(num_steps, "num_steps", low=low, meaning=meaning)


def respaced_timesteps(num_timesteps: int, num_steps: int) -> np.ndarray:
    """``num_steps`` timesteps evenly spaced over ``[0, T-1]``, both ends included,
    ascending (the first sampling step is at ``T - 1``, the "trailing" choice of Lin et
    al. 2023; with ``num_steps = T`` every timestep)."""
    if num_steps > num_timesteps:
        raise ValueError(
            f"num_steps {num_steps} exceeds the schedule's {num_timesteps} timesteps; use "
            f"num_steps <= {num_timesteps}"
        )
    if num_steps == 1:
        return np.array([num_timesteps - 1])
    return np.round(np.linspace(0, num_timesteps - 1, num_steps)).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPM:
    """Ancestral DDPM sampling. num_steps: denoising steps (model calls), <= T (Latte: 250)."""

    num_steps: int = 250

    family = "ddpm"

    def __post_init__(self):
        check_steps(self.num_steps)

    def run(self, denoise_fn: DenoiseFn, schedule: DDPMSchedule, key, shape) -> jax.Array:
        ts = respaced_timesteps(schedule.num_timesteps, self.num_steps)
        abar_all = schedule.alphas_cumprod
        abar = abar_all[ts]
        prev = np.concatenate([[1.0], abar[:-1]])
        beta = 1.0 - abar / prev
        var = beta * (1.0 - prev) / (1.0 - abar)
        log_var = np.log(np.maximum(np.concatenate([var[1:2], var[1:]]), 1e-20))
        if len(ts) == 1:
            log_var = np.log(np.maximum(beta, 1e-20))
        table = {
            "t": ts,
            "c0": np.sqrt(prev) * beta / (1.0 - abar),
            "ct": np.sqrt(1.0 - beta) * (1.0 - prev) / (1.0 - abar),
            "log_var": log_var,
            "log_beta": np.log(np.maximum(beta, 1e-20)),
            "noise": (np.arange(len(ts)) > 0).astype(np.float64),
        }
        table = {k: v[::-1].copy() for k, v in table.items()}  # sampling order: noisy first
        k_init, k_steps = jax.random.split(key)
        x = jax.random.normal(k_init, shape, jnp.float32)

        def step(i, x):
            at = _row_of(table, i)
            d = denoise_fn(x, at["t"])
            mean = at["c0"] * d.x0 + at["ct"] * x
            log_var = at["log_var"]
            if d.variance is not None:
                f = (d.variance + 1.0) / 2.0
                log_var = f * at["log_beta"] + (1.0 - f) * at["log_var"]
            z = jax.random.normal(jax.random.fold_in(k_steps, i), shape, jnp.float32)
            return mean + at["noise"] * jnp.exp(0.5 * log_var) * z

        return jax.lax.fori_loop(0, len(ts), step, x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDIM:
    """DDIM sampling. num_steps: model calls (DDIM paper / DiT: 50); eta: 0 deterministic,
    1 the DDPM posterior's variance."""

    num_steps: int = 50
    eta: float = 0.0

    family = "ddpm"

    def __post_init__(self):
        check_steps(self.num_steps)
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")

    def run(self, denoise_fn: DenoiseFn, schedule: DDPMSchedule, key, shape) -> jax.Array:
        ts = respaced_timesteps(schedule.num_timesteps, self.num_steps)[::-1].copy()
        abar = schedule.alphas_cumprod[ts]
        prev = np.concatenate([abar[1:], [1.0]])
        s = self.eta * np.sqrt((1 - prev) / np.maximum(1 - abar, 1e-20)) * np.sqrt(1 - abar / prev)
        c_eps = np.sqrt(np.maximum(1 - prev - s**2, 0.0))
        table = {"t": ts, "c0": np.sqrt(prev), "c_eps": c_eps, "s": s}
        k_init, k_steps = jax.random.split(key)
        x = jax.random.normal(k_init, shape, jnp.float32)

        def step(i, x):
            at = _row_of(table, i)
            d = denoise_fn(x, at["t"])
            x = at["c0"] * d.x0 + at["c_eps"] * d.eps
            if self.eta:
                x = x + at["s"] * jax.random.normal(jax.random.fold_in(k_steps, i), shape)
            return x

        return jax.lax.fori_loop(0, len(ts), step, x)


def _row_of(table: dict[str, np.ndarray], i: jax.Array) -> dict[str, jax.Array]:
    """Entry ``i`` of each per-step table (int32 timesteps ``t``, float32 coefficients)."""
    return {k: jnp.asarray(v, jnp.int32 if k == "t" else jnp.float32)[i] for k, v in table.items()}


def flow_times(num_steps: int, shift: float) -> np.ndarray:
    """``num_steps + 1`` times from 1 to 0, evenly spaced then shifted
    ``s t / (1 + (s - 1) t)`` (SD3's sampling shift), float64."""
    t = np.linspace(1.0, 0.0, num_steps + 1)
    return shift * t / (1.0 + (shift - 1.0) * t)


def _ode_step(slope, x: jax.Array, start, end, *, heun: bool) -> jax.Array:
    """One explicit step of ``dx/dt = slope(x, t)`` from ``start`` to ``end``: Euler
    ``x + (end - start) u``, or Heun (Euler predictor, trapezoid corrector)
    ``x + (end - start) (u + u') / 2`` with ``u' = slope(x + (end - start) u, end)``."""
    dt = end - start
    u = slope(x, start)
    if not heun:
        return x + dt * u
    u_next = slope(x + dt * u, end)
    return x + dt * 0.5 * (u + u_next)


def _integrate(slope, x, starts, ends, num_steps: int, *, heun: bool, perturb=None):
    """``num_steps`` :func:`_ode_step` s, step ``i`` from ``starts[i]`` to ``ends[i]``, as one
    ``lax.fori_loop``; ``perturb(i, x)`` (EDM's churn) moves ``x`` before step ``i``."""

    def step(i, x):
        if perturb is not None:
            x = perturb(i, x)
        return _ode_step(slope, x, starts[i], ends[i], heun=heun)

    return jax.lax.fori_loop(0, num_steps, step, x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FlowODE:
    """The flow ODE ``dx/dt = u = eps - x0`` from ``t = 1`` to ``0`` on :func:`flow_times`;
    Euler, or Heun (``heun``) with a last Euler step (the corrector would evaluate at
    ``t = 0``)."""

    num_steps: int
    shift: float = 1.0

    family = "flow"
    heun = False

    def __post_init__(self):
        check_steps(self.num_steps)
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")

    def run(self, denoise_fn: DenoiseFn, schedule: FlowSchedule, key, shape) -> jax.Array:
        ts = jnp.asarray(flow_times(self.num_steps, self.shift), jnp.float32)
        x = jax.random.normal(key, shape, jnp.float32)

        def velocity(x, t):
            d = denoise_fn(x, t)
            return d.eps - d.x0

        if not self.heun:
            return _integrate(velocity, x, ts[:-1], ts[1:], self.num_steps, heun=False)
        x = _integrate(velocity, x, ts[:-1], ts[1:], self.num_steps - 1, heun=True)
        return _ode_step(velocity, x, ts[-2], ts[-1], heun=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowEuler(_FlowODE):
    """Euler on the flow ODE. num_steps: model calls (SD3 28-50); shift: time shift (1 = none)."""

    num_steps: int = 50


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowHeun(_FlowODE):
    """Heun on the flow ODE: ``2 num_steps - 1`` model calls; shift as :class:`FlowEuler`."""

    num_steps: int = 28
    heun = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class EDMHeun:
    """EDM's Heun sampler (``2 num_steps - 1`` model calls; EDM: 18 steps, 35 calls).

    sigma_min, sigma_max, rho: the step spacing; None = the schedule's.
    s_churn, s_min, s_max, s_noise: stochastic churn (EDM Algorithm 2; 0 = the ODE).
    """

    num_steps: int = 18
    sigma_min: float | None = None
    sigma_max: float | None = None
    rho: float | None = None
    s_churn: float = 0.0
    s_min: float = 0.0
    s_max: float = math.inf
    s_noise: float = 1.0

    family = "edm"

    def __post_init__(self):
        check_steps(self.num_steps)
        if self.s_churn < 0:
            raise ValueError(f"s_churn must be >= 0, got {self.s_churn}")

    def sigmas(self, schedule: EDMSchedule) -> np.ndarray:
        """``num_steps + 1`` sigmas, the last 0, float64."""
        schedule = dataclasses.replace(
            schedule,
            **{
                k: v
                for k, v in (
                    ("sigma_min", self.sigma_min),
                    ("sigma_max", self.sigma_max),
                    ("rho", self.rho),
                )
                if v is not None
            },
        )
        n = self.num_steps
        steps = schedule.rho_sigmas(np.arange(n) / max(n - 1, 1))
        return np.concatenate([steps, [0.0]])

    def run(self, denoise_fn: DenoiseFn, schedule: EDMSchedule, key, shape) -> jax.Array:
        sig = self.sigmas(schedule)
        n = self.num_steps
        gamma = np.where(
            (sig[:-1] >= self.s_min) & (sig[:-1] <= self.s_max),
            min(self.s_churn / n, math.sqrt(2) - 1),
            0.0,
        )
        hat = sig[:-1] * (1 + gamma)
        lift = np.sqrt(np.maximum(hat**2 - sig[:-1] ** 2, 0.0)) * self.s_noise
        sig, hat, lift = (jnp.asarray(a, jnp.float32) for a in (sig, hat, lift))
        k_init, k_steps = jax.random.split(key)
        x = jax.random.normal(k_init, shape, jnp.float32) * sig[0]

        def churn(i, x):
            z = jax.random.normal(jax.random.fold_in(k_steps, i), shape, jnp.float32)
            return x + lift[i] * z

        def slope(x, sigma):
            return denoise_fn(x, sigma).eps  # (x - D) / sigma

        perturb = churn if self.s_churn else None
        x = _integrate(slope, x, hat, sig[1:], n - 1, heun=True, perturb=perturb)
        x_hat = x if perturb is None else churn(n - 1, x)
        return denoise_fn(x_hat, hat[n - 1]).x0  # the Euler step to sigma = 0


Sampler = DDPM | DDIM | FlowEuler | FlowHeun | EDMHeun

SAMPLERS: dict[str, type] = {
    "ddpm": DDPM,
    "ddim": DDIM,
    "euler": FlowEuler,
    "heun": FlowHeun,
    "edm_heun": EDMHeun,
}

DEFAULT_SAMPLERS = {"ddpm": "ddim", "flow": "euler", "edm": "edm_heun"}


def make_sampler(
    sampler: str | Any | None, *, schedule: Schedule, num_steps: int | None = None, **options
):
    """A sampler config from a name (``'ddpm'``, ``'ddim'``, ``'euler'``, ``'heun'``,
    ``'edm_heun'``), a config (returned, with ``num_steps`` replaced when given), or None
    (the schedule's default: DDIM, flow Euler, EDM Heun). Raises ValueError before
    anything is compiled when it does not go with ``schedule``."""
    if num_steps is not None:
        check_steps(num_steps)
        options["num_steps"] = num_steps
    if sampler is None:
        sampler = DEFAULT_SAMPLERS[schedule.family]
    if isinstance(sampler, str):
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; use one of {sorted(SAMPLERS)}")
        sampler = SAMPLERS[sampler](**options)
    elif options:
        sampler = dataclasses.replace(sampler, **options)
    check_sampler_for(schedule, sampler)
    return sampler


def check_sampler_for(schedule: Schedule, sampler) -> None:
    """Raise ValueError when ``sampler`` does not go with a model trained on ``schedule``."""
    family = getattr(sampler, "family", None)
    if family != schedule.family:
        fits = sorted(k for k, v in SAMPLERS.items() if v.family == schedule.family)
        raise ValueError(
            f"sampler {type(sampler).__name__} samples {family!r} models, but this model was "
            f"trained with {type(schedule).__name__} ({schedule.family!r}); use one of {fits}"
        )


def sample_diffusion(
    denoise_fn: DenoiseFn,
    *,
    schedule: Schedule,
    sampler,
    key: jax.Array,
    shape: tuple[int, ...],
) -> jax.Array:
    """Samples ``[batch, ...]`` of ``shape``, float32, from ``denoise_fn`` (see
    :func:`model_denoiser`) with ``sampler`` (:class:`DDPM`, :class:`DDIM`,
    :class:`FlowEuler`, :class:`FlowHeun`, :class:`EDMHeun`). Traceable (call it inside
    ``jax.jit``); the pairing is checked first, in Python."""
    check_sampler_for(schedule, sampler)
    return sampler.run(denoise_fn, schedule, key, tuple(shape))

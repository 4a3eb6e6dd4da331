"""Noise schedules of diffusion models: how data and noise mix at each time.

Every schedule here is a Gaussian path ``x_t = alpha(t) x0 + sigma(t) eps`` with
``eps ~ N(0, I)``, in its own time variable:

- :class:`DDPMSchedule`: discrete timesteps ``t in {0, ..., T-1}`` (DDPM, Ho et al.
  2020, arXiv 2006.11239; iDDPM, Nichol & Dhariwal 2021), ``alpha = sqrt(abar_t)``,
  ``sigma = sqrt(1 - abar_t)``, ``abar_t = prod_{s <= t} (1 - beta_s)``. Linear betas
  ``linspace(1e-4 * 1000/T, 0.02 * 1000/T, T)`` or the cosine schedule
  ``abar(u) = cos^2((u + 0.008) / 1.008 * pi / 2)`` with ``beta <= 0.999``
  (openai/improved-diffusion ``gaussian_diffusion.py``); optionally rescaled to zero
  terminal SNR (Lin et al. 2023, arXiv 2305.08891, Algorithm 1). The model sees the
  timestep index as a float.
- :class:`FlowSchedule`: continuous ``t in [0, 1]``, ``t = 1`` noise and ``t = 0`` data
  (rectified flow, Liu et al. 2022; flow matching, Lipman et al. 2022; the SD3 / Flux /
  Wan convention): ``alpha = 1 - t``, ``sigma = t``. Training times are uniform or
  logit-normal (SD3 "rf/lognorm(0, 1)", Esser et al. 2024), then shifted
  ``t' = s t / (1 + (s - 1) t)``. The model sees ``time_scale * t`` (1000 by default, as
  diffusers and maxdiffusion feed their transformers).
- :class:`EDMSchedule`: ``x = x0 + sigma n`` (Karras et al. 2022, arXiv 2206.00364) with
  ``ln sigma ~ N(P_mean, P_std^2)`` and the preconditioning
  ``D(x, sigma) = c_skip x + c_out F(c_in x, c_noise)``.

Each schedule has the same small interface, used by the objective and the samplers:
``coefficients(time) -> (alpha, sigma)``, ``sample_time(key, shape)``,
``model_input(x, time) -> (network input, network time)`` and
``network_output(raw, x, time) -> prediction`` (the identity but for EDM's c_skip/c_out).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

DDPM_KINDS = ("linear", "cosine")
TIME_SAMPLING = ("uniform", "logit_normal")


def linear_betas(num_timesteps: int) -> np.ndarray:
    """improved-diffusion's linear betas, scaled so any ``T`` matches DDPM's ``T = 1000``."""
    scale = 1000.0 / num_timesteps
    return np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64)


def cosine_betas(num_timesteps: int, max_beta: float = 0.999) -> np.ndarray:
    """``beta_i = min(1 - abar((i+1)/T) / abar(i/T), max_beta)`` with
    ``abar(u) = cos^2((u + 0.008) / 1.008 * pi / 2)`` (iDDPM eq. 17; the clip keeps
    ``abar_{T-1} > 0`` so ``x0 = (x - sigma eps) / alpha`` stays finite)."""

    def abar(u):
        return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

    t = num_timesteps
    return np.array(
        [min(1 - abar((i + 1) / t) / abar(i / t), max_beta) for i in range(t)], np.float64
    )


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Lin et al. 2023 Algorithm 1: shift and scale ``sqrt(abar)`` so the last timestep
    is pure noise (``abar_{T-1} = 0``) and the first keeps its value. Train with
    ``target='v'`` (or ``'x0'``): an eps prediction carries no signal at ``abar = 0``."""
    root = np.sqrt(np.cumprod(1.0 - betas))
    first, last = root[0], root[-1]
    root = (root - last) * first / (first - last)
    abar = root**2
    alphas = np.concatenate([abar[:1], abar[1:] / abar[:-1]])
    return 1.0 - alphas


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPMSchedule:
    """Discrete variance-preserving schedule (DDPM / iDDPM).

    kind: ``'linear'`` (DDPM) or ``'cosine'`` (iDDPM).
    num_timesteps: ``T``, the number of discrete noise levels (DDPM, DiT, Latte: 1000).
    max_beta: the cosine schedule's clip on each beta (improved-diffusion: 0.999).
    zero_terminal_snr: rescale to ``abar_{T-1} = 0`` (Lin et al. 2023); needs a ``v``
      or ``x0`` target.
    """

    kind: str = "linear"
    num_timesteps: int = 1000
    max_beta: float = 0.999
    zero_terminal_snr: bool = False

    family = "ddpm"

    def __post_init__(self):
        if self.kind not in DDPM_KINDS:
            raise ValueError(f"unknown DDPM schedule kind {self.kind!r}; use one of {DDPM_KINDS}")
        if isinstance(self.num_timesteps, bool) or self.num_timesteps < 2:
            raise ValueError(f"num_timesteps must be >= 2, got {self.num_timesteps!r}")
        if not 0.0 < self.max_beta < 1.0:
            raise ValueError(f"max_beta must be in (0, 1), got {self.max_beta}")

    @property
    def betas(self) -> np.ndarray:
        """``[T]`` float64 betas."""
        if self.kind == "linear":
            betas = linear_betas(self.num_timesteps)
        else:
            betas = cosine_betas(self.num_timesteps, self.max_beta)
        return rescale_zero_terminal_snr(betas) if self.zero_terminal_snr else betas

    @property
    def alphas_cumprod(self) -> np.ndarray:
        """``[T]`` float64 ``abar_t``."""
        return np.cumprod(1.0 - self.betas)

    def coefficients(self, time: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(sqrt(abar_t), sqrt(1 - abar_t))`` at integer timesteps ``time``, float32."""
        abar = self.alphas_cumprod  # both roots from float64, so 1 - abar keeps its digits
        t = jnp.asarray(time, jnp.int32)
        alpha = jnp.asarray(np.sqrt(abar), jnp.float32)[t]
        return alpha, jnp.asarray(np.sqrt(1.0 - abar), jnp.float32)[t]

    def sample_time(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Training timesteps ``t ~ U{0, ..., T-1}``, int32."""
        return jax.random.randint(key, shape, 0, self.num_timesteps, jnp.int32)

    def time_grid(self, fractions) -> jax.Array:
        """Evaluation timesteps ``round(f (T - 1))`` for fractions ``f`` of the range."""
        return jnp.asarray(np.round(np.asarray(fractions) * (self.num_timesteps - 1)), jnp.int32)

    def model_input(self, x: jax.Array, time: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The network reads ``x_t`` as it is and the timestep index as a float."""
        return x, jnp.asarray(time, jnp.float32)

    def network_output(self, raw: jax.Array, x: jax.Array, time: jax.Array) -> jax.Array:
        """The network's output is the prediction itself."""
        del x, time
        return raw


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowSchedule:
    """Continuous flow-matching time, ``x_t = (1 - t) x0 + t eps`` (t = 1 noise, t = 0 data).

    time_sampling: ``'uniform'`` ``t ~ U[0, 1]`` or ``'logit_normal'``
      ``t = sigmoid(m + s n)``, ``n ~ N(0, 1)`` (SD3's best, m = 0, s = 1).
    logit_mean, logit_std: ``m`` and ``s`` of the logit-normal draw.
    shift: ``s`` in ``t' = s t / (1 + (s - 1) t)`` applied after the draw (SD3 at 1024^2
      and maxdiffusion: 3.0); 1.0 = no shift.
    time_scale: the network reads ``time_scale * t`` (diffusers / maxdiffusion: 1000, the
      range the sinusoidal timestep embedding of DiT was designed for).
    """

    time_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    time_scale: float = 1000.0

    family = "flow"

    def __post_init__(self):
        if self.time_sampling not in TIME_SAMPLING:
            raise ValueError(
                f"unknown time_sampling {self.time_sampling!r}; use one of {TIME_SAMPLING}"
            )
        if self.logit_std <= 0 or self.shift <= 0 or self.time_scale <= 0:
            raise ValueError(
                f"logit_std, shift and time_scale must be > 0, got {self.logit_std}, "
                f"{self.shift}, {self.time_scale}"
            )

    def coefficients(self, time: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(1 - t, t)``, float32."""
        t = jnp.asarray(time, jnp.float32)
        return 1.0 - t, t

    def shift_time(self, t: jax.Array) -> jax.Array:
        """``s t / (1 + (s - 1) t)``: more time near the noise end for ``s > 1``."""
        return self.shift * t / (1.0 + (self.shift - 1.0) * t)

    def sample_time(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Training times in ``[0, 1]``, float32, drawn then shifted."""
        if self.time_sampling == "uniform":
            t = jax.random.uniform(key, shape, jnp.float32)
        else:
            n = jax.random.normal(key, shape, jnp.float32)
            t = jax.nn.sigmoid(self.logit_mean + self.logit_std * n)
        return self.shift_time(t)

    def time_grid(self, fractions) -> jax.Array:
        """Evaluation times ``t = f`` (unshifted)."""
        return jnp.asarray(fractions, jnp.float32)

    def model_input(self, x: jax.Array, time: jax.Array) -> tuple[jax.Array, jax.Array]:
        return x, self.time_scale * jnp.asarray(time, jnp.float32)

    def network_output(self, raw: jax.Array, x: jax.Array, time: jax.Array) -> jax.Array:
        del x, time
        return raw


@dataclasses.dataclass(frozen=True, kw_only=True)
class EDMSchedule:
    """EDM (Karras et al. 2022): ``x = x0 + sigma n``, trained at ``ln sigma ~ N(P_mean,
    P_std^2)``, the network preconditioned as ``D = c_skip x + c_out F(c_in x, c_noise)``
    with ``c_skip = sd^2 / (sigma^2 + sd^2)``, ``c_out = sigma sd / sqrt(sigma^2 + sd^2)``,
    ``c_in = 1 / sqrt(sigma^2 + sd^2)``, ``c_noise = ln(sigma) / 4`` and the loss weight
    ``lambda = (sigma^2 + sd^2) / (sigma sd)^2`` (NVlabs/edm ``training/loss.py``,
    ``training/networks.py::EDMPrecond``). The time variable is ``sigma`` itself.

    sigma_data: ``sd``, the data's standard deviation (0.5 for images in [-1, 1]).
    p_mean, p_std: the training log-normal (EDM: -1.2, 1.2).
    sigma_min, sigma_max: the sampler's range (EDM: 0.002, 80); also the evaluation grid's.
    rho: the sampler's and evaluation grid's spacing exponent (EDM: 7).
    """

    sigma_data: float = 0.5
    p_mean: float = -1.2
    p_std: float = 1.2
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0

    family = "edm"

    def __post_init__(self):
        if self.sigma_data <= 0 or self.p_std <= 0 or self.rho <= 0:
            raise ValueError(
                f"sigma_data, p_std and rho must be > 0, got {self.sigma_data}, {self.p_std}, "
                f"{self.rho}"
            )
        if not 0 < self.sigma_min < self.sigma_max:
            raise ValueError(
                f"need 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}"
            )

    def coefficients(self, time: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(1, sigma)``, float32."""
        sigma = jnp.asarray(time, jnp.float32)
        return jnp.ones_like(sigma), sigma

    def sample_time(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Training sigmas ``exp(P_mean + P_std n)``, float32."""
        return jnp.exp(self.p_mean + self.p_std * jax.random.normal(key, shape, jnp.float32))

    def rho_sigmas(self, fractions) -> np.ndarray:
        """``(smax^(1/rho) + f (smin^(1/rho) - smax^(1/rho)))^rho``: ``f = 0`` is
        ``sigma_max``, ``f = 1`` is ``sigma_min`` (EDM eq. 5), float64."""
        f = np.asarray(fractions, np.float64)
        lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
        return (hi + f * (lo - hi)) ** self.rho

    def time_grid(self, fractions) -> jax.Array:
        """Evaluation sigmas at fractions ``f`` of the noise range, ``f = 1`` the noisiest:
        ``rho_sigmas(1 - f)``."""
        return jnp.asarray(self.rho_sigmas(1.0 - np.asarray(fractions)), jnp.float32)

    def precondition(self, sigma: jax.Array):
        """``(c_skip, c_out, c_in, c_noise)`` at ``sigma``."""
        sigma = jnp.asarray(sigma, jnp.float32)
        sd2 = self.sigma_data**2
        c_skip = sd2 / (sigma**2 + sd2)
        c_out = sigma * self.sigma_data * jax.lax.rsqrt(sigma**2 + sd2)
        c_in = jax.lax.rsqrt(sigma**2 + sd2)
        c_noise = jnp.log(sigma) / 4.0
        return c_skip, c_out, c_in, c_noise

    def loss_weight(self, sigma: jax.Array) -> jax.Array:
        """``lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2``."""
        sigma = jnp.asarray(sigma, jnp.float32)
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def model_input(self, x: jax.Array, time: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(c_in x, c_noise)``; ``time`` is sigma, one per row ``[batch]``."""
        _, _, c_in, c_noise = self.precondition(time)
        return x * per_row(c_in, x), c_noise

    def network_output(self, raw: jax.Array, x: jax.Array, time: jax.Array) -> jax.Array:
        """``D = c_skip x + c_out F``: the x0 prediction."""
        c_skip, c_out, _, _ = self.precondition(time)
        return per_row(c_skip, x) * x + per_row(c_out, x) * raw


Schedule = DDPMSchedule | FlowSchedule | EDMSchedule


def per_row(value: jax.Array, like: jax.Array) -> jax.Array:
    """A per-row ``[batch]`` (or scalar) value broadcast against ``like [batch, ...]``
    (a schedule's coefficients at each row's time, against the rows' samples)."""
    value = jnp.asarray(value)
    return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))

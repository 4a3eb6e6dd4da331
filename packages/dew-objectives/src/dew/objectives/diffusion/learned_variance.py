"""iDDPM's learned variance (Nichol & Dhariwal 2021): the variational-bound term a
model with ``learn_sigma`` adds to its loss (improved-diffusion ``_vb_terms_bpd``).

The model outputs ``2C`` channels, the second half iDDPM's ``v`` in ``[-1, 1]``, and
``log Sigma = f log beta_t + (1 - f) log beta~_t``, ``f = (v + 1) / 2``. The term at
``t`` is ``KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t))`` in bits per dimension, and
at ``t = 0`` the discretized Gaussian decoder's NLL; the mean comes from a frozen
prediction, so the term trains the variance only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.diffusion.schedules import DDPMSchedule, per_row
from dew.sampling.diffusion.targets import predictions_of


def mean_rows(x: jax.Array) -> jax.Array:
    """``[batch, ...] -> [batch]``: the mean over every non-batch axis."""
    return jnp.mean(x.reshape(x.shape[0], -1), axis=1)


def normal_kl(mean1, logvar1, mean2, logvar2):
    """``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` elementwise (nats)."""
    return 0.5 * (
        -1.0
        + logvar2
        - logvar1
        + jnp.exp(logvar1 - logvar2)
        + (mean1 - mean2) ** 2 * jnp.exp(-logvar2)
    )


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log-likelihood of data ``x`` in ``[-1, 1]`` on 256 bins under ``N(means,
    e^(2 log_scales))`` (improved-diffusion ``losses.py``, tanh approximation of the
    normal CDF)."""

    def cdf(v):
        return 0.5 * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))

    centered = x - means
    inv_std = jnp.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = jnp.log(jnp.maximum(cdf_plus, 1e-12))
    log_one_minus_cdf_min = jnp.log(jnp.maximum(1.0 - cdf_min, 1e-12))
    log_delta = jnp.log(jnp.maximum(cdf_plus - cdf_min, 1e-12))
    return jnp.where(
        x < -0.999, log_cdf_plus, jnp.where(x > 0.999, log_one_minus_cdf_min, log_delta)
    )


def posterior_tables(schedule: DDPMSchedule) -> dict[str, np.ndarray]:
    """Per timestep ``[T]`` float64: ``q(x_{t-1} | x_t, x0) = N(c0 x0 + ct x_t,
    e^log_var)`` (``log_var`` clipped at ``t = 0`` as improved-diffusion) and ``log
    beta_t``."""
    betas = schedule.betas
    abar = np.cumprod(1.0 - betas)
    prev = np.concatenate([[1.0], abar[:-1]])
    var = betas * (1.0 - prev) / (1.0 - abar)
    return {
        "c0": betas * np.sqrt(prev) / (1.0 - abar),
        "ct": (1.0 - prev) * np.sqrt(1.0 - betas) / (1.0 - abar),
        "log_var": np.log(np.concatenate([var[1:2], var[1:]])),
        "log_beta": np.log(betas),
    }


def vb_terms(schedule: DDPMSchedule, target: str, prediction, variance, x0, x_t, time):
    """iDDPM's ``L_t`` ``[batch]`` (bits per dimension) of ``variance`` (the model's
    ``v``) with the mean from ``prediction`` of ``target`` (frozen by the caller)."""
    tables = {k: jnp.asarray(v, jnp.float32)[time] for k, v in posterior_tables(schedule).items()}
    c0, ct, log_var, log_beta = (
        per_row(tables[k], x0) for k in ("c0", "ct", "log_var", "log_beta")
    )
    alpha, sigma = (per_row(c, x0) for c in schedule.coefficients(time))
    x0_hat, _ = predictions_of(target, prediction, x_t, alpha, sigma)
    true_mean = c0 * x0 + ct * x_t
    model_mean = c0 * x0_hat + ct * x_t
    f = (variance + 1.0) / 2.0
    model_log_var = f * log_beta + (1.0 - f) * log_var
    kl = mean_rows(normal_kl(true_mean, log_var, model_mean, model_log_var)) / math.log(2.0)
    nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var)
    nll = mean_rows(nll) / math.log(2.0)
    return jnp.where(time == 0, nll, kl)

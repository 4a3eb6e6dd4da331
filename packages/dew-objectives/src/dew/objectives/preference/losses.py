"""Preference losses by name, as pure functions of sequence log-probs (issue 43).

Every function takes per-example sequence log-probs (float32 ``[rows]``) and
returns per-example losses; the objectives weight and average them
(:class:`~dew.objectives.Weighted`). Notation: ``pi_w``, ``pi_l`` the
policy's log-probs of the chosen and rejected completions, summed over the
completion's tokens; ``avg_w = pi_w / |y_w|`` the per-token mean (the
length-normalised log-prob); ``ref_*`` the reference's.

DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) and its variants
(:func:`dpo_losses`), with ``h = (pi_w - ref_w) - (pi_l - ref_l)``::

    sigmoid:  -log sigmoid(beta h)
    cdpo:     -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo:      (h - 1 / (2 beta))^2                  (Azar et al. 2023, eq. 17)

SimPO (Meng et al. 2024, "Simple Preference Optimization with a Reference-Free
Reward", arXiv 2405.14734, eq. 6; TRL's ``CPOTrainer(loss_type="simpo")``),
reference-free, on length-normalised log-probs with a target margin
``gamma`` (:func:`simpo_losses`)::

    -log sigmoid(beta avg_w - beta avg_l - gamma)

ORPO (Hong et al. 2024, "Monolithic Preference Optimization without
Reference Model", arXiv 2403.07691, eq. 4-7; TRL's ``ORPOTrainer``),
reference-free: the SFT loss on the chosen completion plus ``lambda`` times
the odds-ratio term (:func:`orpo_losses` returns the latter, the objective
adds the chosen NLL), with ``odds(y) = p / (1 - p)``, ``p = exp(avg)``::

    log odds(y) = avg - log(1 - exp(avg))
    L_OR        = -log sigmoid(log odds(y_w) - log odds(y_l))
    L           = NLL(y_w) + lambda L_OR

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization", arXiv 2402.01306, eq. 7-8; TRL's ``KTOTrainer``): unpaired
rows, each a completion with a label, desirable or undesirable. With
``r = pi - ref`` (the row's log-ratio) and the reference point
``z0 = max(0, mean(pi(y'|x) - ref(y'|x)))`` over mismatched pairs (each
prompt with another row's completion; no gradient, :func:`kto_reference_point`)::

    desirable:    lambda_D (1 - sigmoid(beta (r - z0)))
    undesirable:  lambda_U (1 - sigmoid(beta (z0 - r)))

averaged over all rows (TRL's ``nanmean`` of the concatenated weighted losses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DPO_LOSSES = ("sigmoid", "cdpo", "ipo")


def _f32(x):
    return jnp.asarray(x).astype(jnp.float32)


def dpo_losses(h: jax.Array, *, beta: float, loss_type: str, label_smoothing: float = 0.0):
    """DPO's per-pair losses from ``h [pairs]`` (module docstring)."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(
            f"dpo_losses: loss_type must be one of {list(DPO_LOSSES)}, got {loss_type!r}"
        )
    h = _f32(h)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    eps = label_smoothing
    return -(1.0 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)


def simpo_losses(
    chosen_avg: jax.Array,
    rejected_avg: jax.Array,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> jax.Array:
    """SimPO's per-pair losses from the length-normalised log-probs ``[pairs]``;
    ``label_smoothing`` as cDPO's (TRL's), 0 = the paper's loss."""
    z = beta * (_f32(chosen_avg) - _f32(rejected_avg)) - gamma
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(
        -z
    )


def log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``
    (Maechler 2012, "Accurately computing log(1 - exp(-|a|))")."""
    x = _f32(x)
    small = x < -jnp.log(2.0)
    # each branch evaluated where it is accurate; the other's input is made harmless
    safe_small = jnp.where(small, x, -1.0)
    safe_large = jnp.where(small, -0.5, x)
    return jnp.where(small, jnp.log1p(-jnp.exp(safe_small)), jnp.log(-jnp.expm1(safe_large)))


def orpo_log_odds(chosen_avg: jax.Array, rejected_avg: jax.Array) -> jax.Array:
    """``log odds(y_w) - log odds(y_l)`` from length-normalised log-probs ``[pairs]``
    (each below 0: a completion's mean token probability is below 1)."""
    chosen_avg, rejected_avg = _f32(chosen_avg), _f32(rejected_avg)
    return (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))


def orpo_losses(chosen_avg: jax.Array, rejected_avg: jax.Array, *, lam: float) -> jax.Array:
    """ORPO's odds-ratio term ``-lambda log sigmoid(log odds ratio)`` per pair (the
    objective adds the chosen completions' NLL)."""
    return -lam * jax.nn.log_sigmoid(orpo_log_odds(chosen_avg, rejected_avg))


def kto_reference_point(mismatched_logps: jax.Array, mismatched_ref_logps: jax.Array, *, rows=None):
    """KTO's ``z0 = max(0, mean(pi - ref))`` over mismatched pairs ``[rows]``
    (``rows``: optional 0/1 weights of the rows that count), without gradient."""
    gap = _f32(mismatched_logps) - _f32(mismatched_ref_logps)
    weights = jnp.ones_like(gap) if rows is None else _f32(rows)
    mean = jnp.sum(gap * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0.0))


def kto_losses(
    logratios: jax.Array,
    desirable: jax.Array,
    reference_point: jax.Array,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> jax.Array:
    """KTO's per-row losses (module docstring): ``logratios = pi - ref [rows]``,
    ``desirable [rows]`` bool, ``reference_point`` the scalar ``z0``."""
    r, z0 = _f32(logratios), _f32(reference_point)
    good = 1.0 - jax.nn.sigmoid(beta * (r - z0))
    bad = 1.0 - jax.nn.sigmoid(beta * (z0 - r))
    return jnp.where(desirable, desirable_weight * good, undesirable_weight * bad)


def bradley_terry_losses(
    chosen_rewards: jax.Array,
    rejected_rewards: jax.Array,
    *,
    margin: jax.Array | float = 0.0,
    center_coefficient: float = 0.0,
) -> jax.Array:
    """A reward model's per-pair loss under the Bradley-Terry model (Bradley & Terry
    1952; Ouyang et al. 2022, eq. 1; TRL's ``RewardTrainer``)::

        -log sigmoid(r_w - r_l - margin) + c (r_w + r_l)^2

    ``margin``: per pair or one value (Llama 2's margin loss); ``c``: TRL's
    ``center_rewards_coefficient`` (Eisenstein et al. 2023), 0 = off."""
    r_w, r_l = _f32(chosen_rewards), _f32(rejected_rewards)
    losses = -jax.nn.log_sigmoid(r_w - r_l - _f32(margin))
    if center_coefficient:
        losses = losses + center_coefficient * (r_w + r_l) ** 2
    return losses

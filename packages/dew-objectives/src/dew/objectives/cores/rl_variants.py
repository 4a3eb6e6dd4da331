"""GRPO-family choices on the RL core, by name (issue 43): critic-free
advantage estimators and GSPO's sequence-level importance ratio.

Written beside :mod:`dew.objectives.cores.rl` (the clipped surrogate, group
advantages, GAE) as pure functions of log-probs and rewards; they move into it
as they are.

Advantages of ``rewards [rows]`` (rows ``b * G + g``, ``G`` completions of one
prompt in a row), ``advantage_estimator``:

- ``"grpo"``: the group-relative ones (:func:`dew.objectives.cores.rl.group_advantages`).
- ``"rloo"`` (REINFORCE Leave-One-Out; Kool et al. 2019, "Buy 4 REINFORCE
  samples, get a baseline for free!"; Ahmadian et al. 2024, "Back to Basics",
  arXiv 2402.14740): every completion's baseline is the mean of the *other*
  ``G - 1`` rewards of its group,

      A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean(r))

  unbiased (the baseline does not depend on ``o_i``); TRL's ``RLOOTrainer``,
  with its ``normalize_advantages`` as ``scale="batch"``:
  ``(A - mean(A)) / (std(A) + eps)`` over the batch.
- ``"reinforce"`` (REINFORCE++, Hu 2025, arXiv 2501.03262): no per-group
  baseline and no critic; the rewards are normalised over the whole batch,
  ``A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)``.

Standard deviations are unbiased (ddof=1), as TRL's ``nanstd``. A group whose
rewards are all equal gets ``A = 0`` under ``"rloo"`` (exactly, before any
batch normalisation: every baseline is its own reward) but not under
``"reinforce"``, whose baseline is the batch's.

GSPO (Group Sequence Policy Optimization; Zheng et al. 2025, arXiv
2507.18071, eq. 5-7; TRL's ``importance_sampling_level="sequence"``): one
importance ratio per completion, the geometric mean of its token ratios,

    s_i = exp( 1/|o_i| sum_t (log pi(o_t) - log pi_old(o_t)) )
    l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))

clipped per sequence (the paper's clip range is small: 3e-4 below, 4e-4
above), and every token of ``o_i`` carries ``l_i`` (so the sequence-mean
aggregation gives ``mean_i l_i``, the paper's objective).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def check_choice(name: str, value: str, allowed: tuple[str, ...], *, what: str) -> None:
    """``value`` one of ``allowed``, or a ValueError naming the option and listing them."""
    if value not in allowed:
        raise ValueError(f"{what}: {name} must be one of {list(allowed)}, got {value!r}")


def _batch_normalised(x: jax.Array, eps: float) -> jax.Array:
    return (x - jnp.mean(x)) / (jnp.std(x, ddof=1) + eps)


def rloo_advantages(
    rewards: jax.Array, group_size: int, *, scale: str = "none", eps: float = 1e-4
) -> tuple[jax.Array, jax.Array]:
    """Leave-one-out advantages of ``rewards [rows]`` (module docstring);
    ``scale``: ``"none"`` (the paper) or ``"batch"`` (TRL's ``normalize_advantages``).

    Returns ``(advantages [rows], zero_variance [rows])`` as
    :func:`~dew.objectives.cores.rl.group_advantages`."""
    check_choice("scale", scale, ("none", "batch"), what="rloo_advantages")
    rewards = rewards.astype(jnp.float32)
    groups = rewards.reshape(-1, group_size)  # [prompts, group]
    baseline = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (group_size - 1)
    constant = jnp.max(groups, axis=1) == jnp.min(groups, axis=1)  # [prompts]
    advantages = jnp.where(constant[:, None], 0.0, groups - baseline).reshape(-1)
    if scale == "batch":
        advantages = _batch_normalised(advantages, eps)
    zero = jnp.broadcast_to(constant[:, None], groups.shape).astype(jnp.float32)
    return advantages, zero.reshape(-1)


def reinforce_advantages(
    rewards: jax.Array, group_size: int, *, eps: float = 1e-4
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ advantages of ``rewards [rows]``: normalised over the batch, no
    group baseline (module docstring). ``zero_variance`` marks the groups whose
    rewards are all equal (logged; their advantages are not 0 here)."""
    rewards = rewards.astype(jnp.float32)
    groups = rewards.reshape(-1, group_size)
    constant = jnp.max(groups, axis=1) == jnp.min(groups, axis=1)
    zero = jnp.broadcast_to(constant[:, None], groups.shape).astype(jnp.float32)
    return _batch_normalised(rewards, eps), zero.reshape(-1)


def sequence_log_ratio(logps: jax.Array, old_logps: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO's length-normalised log importance ratio ``[rows]``:
    ``sum_t m (log pi - log pi_old) / max(1, sum_t m)`` in float32."""
    mask = mask.astype(jnp.float32)
    gap = (logps.astype(jnp.float32) - old_logps.astype(jnp.float32)) * mask
    return jnp.sum(gap, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def sequence_clipped_policy_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GSPO (module docstring): the clipped surrogate on the sequence ratio ``s_i``.

    logps, old_logps, mask: ``[rows, tokens]``; advantages: ``[rows]``.
    Returns ``(per_token [rows, tokens], ratio [rows], clipped [rows])``: every
    token of a row carries the row's loss (aggregate with the completion mask);
    ``clipped`` is 1.0 where the clip removes the row's gradient."""
    ratio = jnp.exp(sequence_log_ratio(logps, old_logps, mask))  # [rows]
    adv = advantages.astype(jnp.float32)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    active = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    per_row = jnp.maximum(unclipped, clipped)
    per_token = jnp.broadcast_to(per_row[:, None], logps.shape)
    return per_token, ratio, active.astype(jnp.float32)

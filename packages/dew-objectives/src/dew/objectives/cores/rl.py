"""The RL core: the policy-gradient maths GRPO, PPO (and Flow-GRPO, on-policy
distillation) share, for any policy whose actions have log-probs (tokens of a
causal LM, denoising steps of a diffusion model).

Clipped surrogate (PPO, Schulman et al. 2017, arXiv 1707.06347; the asymmetric
clip of DAPO, Yu et al. 2025, arXiv 2503.14476), per action, minimized:

    rho = exp(log pi(a) - log pi_old(a))
    l   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))

The clip fraction is the share of actions whose gradient the clip removes:
``rho < 1 - eps_low`` with ``A < 0``, or ``rho > 1 + eps_high`` with ``A > 0``
(TRL's ``is_low_clipped | is_high_clipped``); the same tokens as "the clipped
term is the larger" (TRL's PPO ``pg_losses2 > pg_losses``), decided on the ratio
rather than on two rounded products.

Advantages: GRPO's group-relative ones (:func:`group_advantages`), GAE
(Schulman et al. 2016, arXiv 1506.02438; :func:`gae`) and whitening over the
valid actions (:func:`whiten`).

GRPO-family choices by name (issue 43).

Advantages of ``rewards [rows]`` (rows ``b * G + g``, ``G`` completions of one
prompt in a row), ``advantage_estimator``:

- ``"grpo"``: the group-relative ones (:func:`dew.objectives.cores.rl.group_advantages`).
- ``"rloo"`` (REINFORCE Leave-One-Out; Kool et al. 2019, "Buy 4 REINFORCE
  samples, get a baseline for free!"; Ahmadian et al. 2024, "Back to Basics",
  arXiv 2402.14740): every completion's baseline is the mean of the *other*
  ``G - 1`` rewards of its group,

      A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean(r))

  unbiased (the baseline does not depend on ``o_i``); TRL's ``RLOOTrainer``.
  ``scale_rewards``: ``"none"`` the paper's; ``"batch"`` TRL's
  ``normalize_advantages``, ``(A - mean(A)) / (std(A) + eps)`` over the batch;
  ``"group"`` divides by the group's std + eps (then it is ``G/(G-1)`` times
  GRPO's advantage).
- ``"reinforce"`` (REINFORCE++, Hu 2025, arXiv 2501.03262): no per-group
  baseline and no critic; the rewards are normalised over the whole batch,
  ``A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)`` (``scale_rewards``
  ``"group"`` or ``"batch"``; ``"none"`` keeps ``r_i - mean_batch(r)``).

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

RLOO's loss (TRL's ``RLOOTrainer``, trl 1.16; Ahmadian et al. 2024 treat a
whole completion as one action): ``importance_sampling_level="sequence-sum"``,
the ratio of the completion's probabilities, its token log-ratios summed, not
length-normalised,

    s_i = pi(o_i | q) / pi_old(o_i | q) = exp( sum_t (log pi(o_t) - log pi_old(o_t)) )

clipped per sequence as GSPO's, ``mean_i l_i`` over completions; and its KL penalty
in the reward (``kl_penalty="reward"``): the rollout's k1 summed over the
completion is taken off each reward before the advantages,

    r_i <- r_i - beta sum_t (log pi_old(o_t) - log ref(o_t))      (no gradient)

where GRPO adds ``beta k3`` per token to the loss (``kl_penalty="loss"``).

First-update check (:func:`check_first_update`): prepare scores a rollout with
the loss's own log-prob function on the pre-update weights, so the first
update's log-probs are the rollout's. It is checked relative to the log-prob,
``|log pi - log pi_old| <= tolerance * max(1, |log pi_old|)``, not as
``|rho - 1| <= tolerance``: two compiled programs may round float32 logits
differently by one unit in the last place of the log-prob (1e-6 at
``log p = -10``, so ``|rho - 1| ~ 1e-6`` on a correct rollout), while a
reconstruction bug (another temperature, padding or positions) is off by a
fraction of the log-prob itself. A failure raises :class:`RatioError` on the
host, inside the compiled step; :func:`raising_ratio_errors` (the trainer's
``fit`` runs inside it) hands the caller that :class:`RatioError` instead of the
``JaxRuntimeError`` XLA wraps it in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.nn.keywords import is_whole_number
from dew.objectives.contract import errors
from dew.objectives.contract.weighted import Weighted
from dew.objectives.cores.logprobs import kl_k1, masked_mean

RATIO_TOLERANCE = 1e-6
"""The largest relative log-prob gap :func:`check_first_update` accepts."""
SCALE_REWARDS = ("group", "batch", "none")


class RatioError(AssertionError):
    """The first update of a prepared batch saw log-probs other than the rollout's
    (an importance ratio other than 1)."""


# ------------------------------------------------------------ the clipped loss
def clipped_policy_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per action ``max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))``, ``rho``, and
    whether the clip removed the action's gradient (module docstring), each float32
    of ``logps``' shape. ``advantages`` broadcasts against it from the left: one per
    row (``[rows]``, GRPO) or one per action (``[rows, actions]``, PPO)."""
    ratio = jnp.exp(logps.astype(jnp.float32) - old_logps.astype(jnp.float32))
    adv = advantages.astype(jnp.float32)
    adv = adv.reshape(adv.shape + (1,) * (ratio.ndim - adv.ndim))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    active = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    return jnp.maximum(unclipped, clipped), ratio, active.astype(jnp.float32)


def check_group_size(group_size: int, *, what: str, samples: str) -> None:
    """``group_size`` an int >= 2 (advantages are rewards against the group's mean), or
    an error naming ``what`` and the ``samples`` a group holds ("completions per prompt")."""
    if not is_whole_number(group_size):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    if group_size < 2:
        raise ValueError(
            f"{what} needs group_size >= 2 {samples} (advantages are rewards against the "
            f"group's mean), got {group_size}"
        )


def upper_clip(epsilon: float, epsilon_high: float | None) -> float:
    """The clip range above 1: ``epsilon_high`` (DAPO's clip-higher), or ``epsilon``
    when it is None (a symmetric clip)."""
    return epsilon if epsilon_high is None else epsilon_high


def check_epsilons(epsilon_low: float, epsilon_high: float, *, what: str) -> None:
    """``0 < eps_low < 1`` and ``eps_high > 0``, or a ValueError naming both."""
    if not 0 < epsilon_low < 1 or not epsilon_high > 0:
        raise ValueError(
            f"{what}: the clip range needs 0 < epsilon (below 1) < 1 and epsilon_high > 0, got "
            f"{epsilon_low} and {epsilon_high}"
        )


# ------------------------------------------------------------------ advantages
def group_advantages(
    rewards: jax.Array, group_size: int, *, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[jax.Array, jax.Array]:
    """Group-relative advantages of ``rewards [rows]`` (rows ``b * G + g``):

        "group": (r - mean_group) / (std_group + eps);   "batch": / (std_batch + eps);
        "none":   r - mean_group (Dr.GRPO)

    Returns ``(advantages [rows], zero_variance [rows])``: ``zero_variance`` is 1.0
    on the rows of a group whose rewards are all equal, whose advantages are 0
    exactly. Standard deviations are unbiased (ddof=1), as in Tunix and TRL.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = rewards.astype(jnp.float32)
    groups = rewards.reshape(-1, group_size)  # [prompts, group]
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    constant = jnp.max(groups, axis=1) == jnp.min(groups, axis=1)  # [prompts]
    if scale_rewards == "group":
        centred = centred / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (jnp.std(rewards, ddof=1) + eps)
    advantages = jnp.where(constant[:, None], 0.0, centred)
    zero = jnp.broadcast_to(constant[:, None], groups.shape).astype(jnp.float32)
    return advantages.reshape(-1), zero.reshape(-1)


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation by a reverse ``lax.scan``.

    rewards, values, mask: ``[rows, steps]``; the mask is True on a prefix of each
    row, False on the padding after its end, where values and rewards count as 0,
    so the last real step bootstraps from nothing.

        delta_t = r_t + gamma V_{t+1} - V_t;   A_t = delta_t + gamma lam A_{t+1}

    Returns ``(advantages, returns = advantages + values)``, each ``[rows, steps]``,
    0 on padding.
    """
    mask = mask.astype(jnp.float32)
    values = values.astype(jnp.float32) * mask
    rewards = rewards.astype(jnp.float32) * mask
    next_values = jnp.pad(values[:, 1:], ((0, 0), (0, 1)))  # [rows, steps]
    deltas = rewards + gamma * next_values - values

    def back(later, x):
        delta, m = x  # [rows] each, at one step
        advantage = (delta + gamma * lam * later) * m
        return advantage, advantage

    _, advantages = jax.lax.scan(
        back, jnp.zeros(mask.shape[:1], jnp.float32), (deltas.T, mask.T), reverse=True
    )
    advantages = advantages.T  # [rows, steps]
    return advantages, (advantages + values) * mask


def whiten(x: jax.Array, mask: jax.Array, *, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the valid entries (unbiased variance, as
    TRL's ``masked_whiten``); 0 on padding."""
    mask = mask.astype(jnp.float32)
    mean = masked_mean(x, mask)
    count = jnp.sum(mask)
    var = masked_mean((x - mean) ** 2, mask) * count / jnp.maximum(count - 1.0, 1.0)
    return (x - mean) * jax.lax.rsqrt(var + eps) * mask


# --------------------------------------------------------- first-update check
def max_ratio_deviation(ratio: jax.Array, mask: jax.Array) -> jax.Array:
    """``max |rho - 1|`` over the entries where ``mask`` is True (0 when none)."""
    return jnp.max(jnp.where(mask, jnp.abs(ratio.astype(jnp.float32) - 1.0), 0.0))


def relative_logprob_gap(logps: jax.Array, old_logps: jax.Array, mask: jax.Array) -> jax.Array:
    """``max |log pi - log pi_old| / max(1, |log pi_old|)`` over the valid entries."""
    gap = jnp.abs(logps.astype(jnp.float32) - old_logps.astype(jnp.float32))
    scale = jnp.maximum(1.0, jnp.abs(old_logps.astype(jnp.float32)))
    return jnp.max(jnp.where(mask, gap / scale, 0.0))


def check_first_update(
    logps: jax.Array,
    old_logps: jax.Array,
    mask: jax.Array,
    *,
    step: jax.Array,
    updates_per_batch: int,
    what: str,
    tolerance: float = RATIO_TOLERANCE,
) -> None:
    """Debug assertion, traced into the loss: on the first update of a prepared batch
    (``step % updates_per_batch == 0``) the loss's log-probs are the rollout's,
    :func:`relative_logprob_gap` ``<= tolerance``, or :class:`RatioError` on the host
    (through ``jax.debug.callback``; :func:`raising_ratio_errors` unwraps it)."""
    relative = relative_logprob_gap(logps, old_logps, mask)
    absolute = max_ratio_deviation(jnp.exp(logps - old_logps), mask)
    first = (step % updates_per_batch) == 0

    def check(relative, absolute, first, step):
        if bool(first) and float(relative) > tolerance:
            error = RatioError(
                f"{what}: the first update of the prepared batch at step {int(step)} has "
                f"log-probs off the rollout's by {float(relative):.3g} of max(1, |log p|) > "
                f"{tolerance:g} (max |rho - 1| = {float(absolute):.3g}); the loss's log-probs "
                f"differ from the rollout's (temperature, truncation, padding, positions or "
                f"dropout differ between prepare and loss)"
            )
            errors.raise_on_host(error)

    jax.debug.callback(check, relative, absolute, first, step)


# the trainer's fit runs inside it: a RatioError raised in the compiled step reaches
# the caller as itself
raising_ratio_errors = errors.raising_host_errors


# ------------------------------------------- GRPO-family choices (issue 43)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence-sum")
KL_PENALTIES = ("loss", "reward")


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
    ``scale``: ``"none"`` (the paper), ``"batch"`` (TRL's ``normalize_advantages``:
    centred and divided by the batch's std) or ``"group"`` (divided by the group's
    std + eps, GRPO's scale).

    Returns ``(advantages [rows], zero_variance [rows])`` as :func:`group_advantages`."""
    check_choice("scale", scale, SCALE_REWARDS, what="rloo_advantages")
    rewards = rewards.astype(jnp.float32)
    groups = rewards.reshape(-1, group_size)  # [prompts, group]
    baseline = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (group_size - 1)
    constant = jnp.max(groups, axis=1) == jnp.min(groups, axis=1)  # [prompts]
    advantages = jnp.where(constant[:, None], 0.0, groups - baseline)
    if scale == "group":
        advantages = advantages / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + eps)
    advantages = advantages.reshape(-1)
    if scale == "batch":
        advantages = _batch_normalised(advantages, eps)
    zero = jnp.broadcast_to(constant[:, None], groups.shape).astype(jnp.float32)
    return advantages, zero.reshape(-1)


def reinforce_advantages(
    rewards: jax.Array, group_size: int, *, scale: str = "batch", eps: float = 1e-4
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ advantages of ``rewards [rows]``: the batch's mean as the baseline,
    no group baseline (module docstring); ``scale``: ``"batch"`` or ``"group"`` (both
    divide by the batch's std + eps: the group plays no part) or ``"none"``.
    ``zero_variance`` marks the groups whose rewards are all equal (logged; their
    advantages are not 0 here)."""
    check_choice("scale", scale, SCALE_REWARDS, what="reinforce_advantages")
    rewards = rewards.astype(jnp.float32)
    groups = rewards.reshape(-1, group_size)
    constant = jnp.max(groups, axis=1) == jnp.min(groups, axis=1)
    zero = jnp.broadcast_to(constant[:, None], groups.shape).astype(jnp.float32)
    if scale == "none":
        return rewards - jnp.mean(rewards), zero.reshape(-1)
    return _batch_normalised(rewards, eps), zero.reshape(-1)


def sequence_log_ratio(
    logps: jax.Array, old_logps: jax.Array, mask: jax.Array, *, length_normalised: bool = True
) -> jax.Array:
    """The log importance ratio of each completion ``[rows]`` in float32: GSPO's
    ``sum_t m (log pi - log pi_old) / max(1, sum_t m)``, or without the division
    (``length_normalised=False``: RLOO's, the completion's log-probability ratio)."""
    mask = mask.astype(jnp.float32)
    gap = jnp.sum((logps.astype(jnp.float32) - old_logps.astype(jnp.float32)) * mask, axis=-1)
    if not length_normalised:
        return gap
    return gap / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def sequence_kl_k1(old_logps: jax.Array, ref_logps: jax.Array, mask: jax.Array) -> jax.Array:
    """``[rows]`` float32 ``sum_t m (log pi_old - log ref)``: the k1 estimate of a
    completion's KL to the reference, RLOO's penalty on its reward."""
    return jnp.sum(kl_k1(old_logps, ref_logps) * mask.astype(jnp.float32), axis=-1)


def sequence_clipped_policy_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    *,
    epsilon_low: float,
    epsilon_high: float,
    length_normalised: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GSPO (module docstring): the clipped surrogate on the sequence ratio ``s_i``;
    ``length_normalised=False``: RLOO's, on the completion's probability ratio.

    logps, old_logps, mask: ``[rows, tokens]``; advantages: ``[rows]``.
    Returns ``(per_token [rows, tokens], ratio [rows], clipped [rows])``: every
    token of a row carries the row's loss (aggregate with the completion mask);
    ``clipped`` is 1.0 where the clip removes the row's gradient."""
    log_ratio = sequence_log_ratio(logps, old_logps, mask, length_normalised=length_normalised)
    ratio = jnp.exp(log_ratio)  # [rows]
    adv = advantages.astype(jnp.float32)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    active = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    per_row = jnp.maximum(unclipped, clipped)
    per_token = jnp.broadcast_to(per_row[:, None], logps.shape)
    return per_token, ratio, active.astype(jnp.float32)


def policy_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    *,
    level: str,
    epsilon_low: float,
    epsilon_high: float,
):
    """The clipped surrogate at an ``importance_sampling_level`` (``"token"``: GRPO's
    per-token ratio; ``"sequence"``: GSPO's; ``"sequence-sum"``: RLOO's), with the
    advantages ``[rows]`` of the completions.

    Returns ``(per_token [rows, tokens], ratio, clip_fraction)``, the last two
    :class:`Weighted` means over the tokens (``"token"``) or the completions."""
    check_choice("level", level, IMPORTANCE_SAMPLING_LEVELS, what="policy_loss")
    clip = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    if level == "token":
        per_token, ratio, clipped = clipped_policy_loss(logps, old_logps, advantages, **clip)
        return per_token, Weighted.mean(ratio, mask), Weighted.mean(clipped, mask)
    per_token, ratio, clipped = sequence_clipped_policy_loss(
        logps, old_logps, mask, advantages, length_normalised=level == "sequence", **clip
    )
    return per_token, Weighted.mean(ratio), Weighted.mean(clipped)


def advantages_by_name(
    estimator: str, rewards: jax.Array, group_size: int, *, scale: str, eps: float
) -> tuple[jax.Array, jax.Array]:
    """``(advantages, zero_variance)`` of ``rewards [rows]`` by an ``advantage_estimator``
    (:data:`ADVANTAGE_ESTIMATORS`: :func:`group_advantages`, :func:`rloo_advantages`,
    :func:`reinforce_advantages`), scaled by ``scale`` (``scale_rewards``)."""
    check_choice("advantage_estimator", estimator, ADVANTAGE_ESTIMATORS, what="advantages")
    if estimator == "grpo":
        return group_advantages(rewards, group_size, scale_rewards=scale, eps=eps)
    by_name = {"rloo": rloo_advantages, "reinforce": reinforce_advantages}
    return by_name[estimator](rewards, group_size, scale=scale, eps=eps)

"""GRPO-family choices (dew.objectives.cores.rl) against numpy loops
transcribing the papers' formulas: RLOO (Ahmadian et al. 2024; its loss and KL
penalty as TRL's RLOOTrainer computes them), REINFORCE++ (Hu 2025), GSPO (Zheng et
al. 2025, eq. 5-7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.objectives.cores.rewards import TokenReward
from dew.objectives.cores.rl import (
    policy_loss,
    reinforce_advantages,
    rloo_advantages,
    sequence_clipped_policy_loss,
)
from dew.objectives.rl.grpo import GRPOObjective, aggregate

RNG = np.random.default_rng(43)
G = 4
POLICY = CausalTransformer(
    vocab_size=16, emb_features=8, num_layers=1, num_heads=1, mlp_features=8, max_seq_len=8
)
REWARDS = np.array([0.3, 1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0, -1.0, 0.25, 4.0, 0.0], np.float32)


def numpy_rloo(rewards, group_size):
    """Each completion against the mean of the other G - 1 of its prompt."""
    out = np.zeros(len(rewards))
    for i, r in enumerate(np.float64(rewards)):
        start = i // group_size * group_size
        others = [rewards[j] for j in range(start, start + group_size) if j != i]
        out[i] = r - np.mean(np.float64(others))
    return out


def test_rloo_is_the_leave_one_out_baseline():
    advantages, zero = rloo_advantages(jnp.asarray(REWARDS), G)
    want = numpy_rloo(REWARDS, G)
    np.testing.assert_allclose(advantages, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(advantages[4:8], 0.0)  # a constant group: exactly 0
    np.testing.assert_array_equal(zero, np.repeat([0.0, 1.0, 0.0], G))
    # G / (G - 1) times the group-centred rewards
    centred = REWARDS.reshape(-1, G) - REWARDS.reshape(-1, G).mean(1, keepdims=True)
    np.testing.assert_allclose(advantages, (G / (G - 1) * centred).reshape(-1), atol=1e-6)


def test_rloo_batch_normalised():
    advantages, _ = rloo_advantages(jnp.asarray(REWARDS), G, scale="batch", eps=1e-4)
    a = numpy_rloo(REWARDS, G)
    want = (a - a.mean()) / (np.std(a, ddof=1) + 1e-4)
    np.testing.assert_allclose(advantages, want, rtol=1e-5, atol=1e-6)


def test_reinforce_normalises_over_the_batch():
    advantages, zero = reinforce_advantages(jnp.asarray(REWARDS), G, eps=1e-4)
    r = np.float64(REWARDS)
    np.testing.assert_allclose(advantages, (r - r.mean()) / (r.std(ddof=1) + 1e-4), rtol=1e-5)
    assert float(np.abs(advantages[4:8]).min()) > 0.1  # the batch's baseline, not the group's
    np.testing.assert_array_equal(zero, np.repeat([0.0, 1.0, 0.0], G))


def test_rloo_group_scale_and_an_unknown_scale():
    advantages, _ = rloo_advantages(jnp.asarray(REWARDS), G, scale="group", eps=1e-4)
    groups = np.float64(REWARDS).reshape(-1, G)
    std = np.repeat(groups.std(axis=1, ddof=1), G)
    np.testing.assert_allclose(
        advantages, numpy_rloo(REWARDS, G) / (std + 1e-4), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(
        ValueError, match=r"scale must be one of \['group', 'batch', 'none'\], got 'x'"
    ):
        rloo_advantages(jnp.asarray(REWARDS), G, scale="x")
    none, _ = reinforce_advantages(jnp.asarray(REWARDS), G, scale="none")
    np.testing.assert_allclose(
        none, np.float64(REWARDS) - np.mean(np.float64(REWARDS)), rtol=1e-6, atol=1e-6
    )


def numpy_gspo(logps, old, mask, adv, weights, eps_low, eps_high):
    """GSPO eq. 5-7 row by row: the geometric mean of the token ratios, clipped per
    sequence, weighted mean over rows; its clip fraction."""
    total = clipped = 0.0
    for i in range(len(adv)):
        n = mask[i].sum()
        s = np.exp(np.sum((np.float64(logps[i]) - old[i]) * mask[i]) / max(n, 1))
        bounded = min(max(s, 1 - eps_low), 1 + eps_high)
        total += weights[i] * max(-adv[i] * s, -adv[i] * bounded)
        clipped += weights[i] * float(
            (s < 1 - eps_low and adv[i] < 0) or (s > 1 + eps_high and adv[i] > 0)
        )
    return total / weights.sum(), clipped / weights.sum()


def completions(lengths, spread):
    """``(mask, logps, old_logps, advantages)`` of completions of ``lengths`` tokens, the
    old log-probs ``spread`` off (normal) on real tokens."""
    rows, tokens = len(lengths), max(lengths)
    mask = (np.arange(tokens)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    logps = RNG.normal(-2.0, 0.5, (rows, tokens)).astype(np.float32)
    old = (logps + RNG.normal(0, spread, (rows, tokens)) * mask).astype(np.float32)
    return mask, logps, old, RNG.normal(size=rows).astype(np.float32)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)], ids=["paper clip", "wide clip"])
def test_gspo_matches_the_paper(eps):
    lengths = np.array([7, 3, 1, 5, 2, 6])
    mask, logps, old, adv = completions(lengths, 0.01)
    weights = np.array([1.0, 2.0, 0.5, 3.0, 1.0, 0.25], np.float32)  # unequal rows
    per_token, ratio, clipped = sequence_clipped_policy_loss(
        logps, old, mask, adv, epsilon_low=eps[0], epsilon_high=eps[1]
    )
    # the sequence-mean aggregation of per-token losses is each row's loss
    per_row = jnp.sum(per_token * mask, 1) / mask.sum(1)
    want, want_clipped = numpy_gspo(logps, old, mask, adv, weights, *eps)
    np.testing.assert_allclose(jnp.sum(per_row * weights) / weights.sum(), want, rtol=1e-5)
    np.testing.assert_allclose(jnp.sum(clipped * weights) / weights.sum(), want_clipped)
    if eps[0] < 1e-3:
        assert 0 < want_clipped < 1  # the paper's clip acts on some rows, not all

    def loss(lp):
        per_token, _, _ = sequence_clipped_policy_loss(
            lp, old, mask, adv, epsilon_low=eps[0], epsilon_high=eps[1]
        )
        return jnp.sum(jnp.sum(per_token * mask, 1) / mask.sum(1) * weights) / weights.sum()

    # d l_i / d logp_{i,t} = -A_i s_i / |o_i| on unclipped rows, 0 on clipped rows and padding
    grad = np.asarray(jax.grad(loss)(jnp.asarray(logps)))
    s = np.asarray(ratio, np.float64)
    want_grad = (-adv * s / lengths * (1 - np.asarray(clipped)) * weights / weights.sum())[
        :, None
    ] * mask
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-9)


def test_rloo_loss_is_the_completion_ratio_clipped_per_sequence():
    """RLOO's loss as TRL's RLOOTrainer computes it (importance_sampling_level=
    "sequence-sum"): per completion s_i = exp(sum_t (log pi - log pi_old)), clipped per
    sequence, a mean over completions; against a numpy loop, loss and gradient."""
    mask, logps, old, adv = completions([5, 3, 1, 4, 2, 5], 0.1)
    rows, tokens = mask.shape
    eps_low, eps_high = 0.2, 0.28

    def loss(lp):
        per_token, _, _ = policy_loss(
            lp, old, mask, adv, level="sequence-sum", epsilon_low=eps_low, epsilon_high=eps_high
        )
        return aggregate(per_token, mask, "sequence-mean").value

    got, grad = jax.value_and_grad(loss)(jnp.asarray(logps))
    want, want_grad, clipped = 0.0, np.zeros((rows, tokens)), []
    for i in range(rows):
        s = np.exp(np.sum((np.float64(logps[i]) - old[i]) * mask[i]))  # not divided by |o_i|
        bounded = min(max(s, 1 - eps_low), 1 + eps_high)
        want += max(-adv[i] * s, -adv[i] * bounded) / rows
        clip = (s < 1 - eps_low and adv[i] < 0) or (s > 1 + eps_high and adv[i] > 0)
        clipped.append(clip)
        want_grad[i] = 0.0 if clip else -adv[i] * s * mask[i] / rows  # d/d log pi(o_t) of l_i
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert 0 < np.mean(clipped) < 1  # the clip acts on some completions, not all


def test_rloo_kl_penalty_in_the_reward():
    """kl_penalty="reward": advantages of r_i - beta sum_t (log pi_old - log ref) (the
    rollout's k1), the logged reward without it; kl_penalty="loss" leaves the rewards."""
    rows, tokens = len(REWARDS), 3
    mask = np.arange(tokens)[None] < RNG.integers(1, tokens + 1, rows)[:, None]
    old = (RNG.normal(-1.5, 0.5, (rows, tokens)) * mask).astype(np.float32)
    ref = (old + RNG.normal(0, 0.3, (rows, tokens)) * mask).astype(np.float32)
    batch = dict(rewards=REWARDS[:, None], old_logps=old, ref_logps=ref, completion_mask=mask)
    beta = 0.1
    penalised = np.float64(REWARDS) - beta * np.sum((np.float64(old) - ref) * mask, axis=1)
    for where, rewards in (("reward", penalised), ("loss", np.float64(REWARDS))):
        grpo = GRPOObjective(
            model=POLICY,
            rewards=[TokenReward(fn=lambda c, m, b: c[:, 0])],
            group_size=G,
            beta=beta,
            advantage_estimator="rloo",
            scale_rewards="none",
            kl_penalty=where,
        )
        out = grpo.prepare_finish(None, jax.tree.map(jnp.asarray, batch), None)
        np.testing.assert_allclose(out["advantages"], numpy_rloo(rewards, G), atol=1e-5)
        np.testing.assert_allclose(out["reward"], REWARDS)


def test_unknown_rloo_options_are_named():
    with pytest.raises(ValueError, match=r"kl_penalty must be one of \('loss', 'reward'\)"):
        GRPOObjective(model=POLICY, rewards=[TokenReward(fn=len)], kl_penalty="k1")
    with pytest.raises(ValueError, match=r"'token', 'sequence', 'sequence-sum'\), got 'seq'"):
        GRPOObjective(model=POLICY, rewards=[TokenReward(fn=len)], importance_sampling_level="seq")

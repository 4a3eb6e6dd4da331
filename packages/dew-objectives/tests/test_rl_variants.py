"""GRPO-family choices (dew.objectives.cores.rl) against numpy loops
transcribing the papers' formulas: RLOO (Ahmadian et al. 2024), REINFORCE++
(Hu 2025), GSPO (Zheng et al. 2025, eq. 5-7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.objectives.cores.rl import (
    reinforce_advantages,
    rloo_advantages,
    sequence_clipped_policy_loss,
)

RNG = np.random.default_rng(43)
G = 4
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


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)], ids=["paper clip", "wide clip"])
def test_gspo_matches_the_paper(eps):
    rows, tokens = 6, 7
    lengths = np.array([7, 3, 1, 5, 2, 6])
    mask = (np.arange(tokens)[None] < lengths[:, None]).astype(np.float32)
    logps = RNG.normal(-2.0, 0.5, (rows, tokens)).astype(np.float32)
    old = (logps + RNG.normal(0, 0.01, (rows, tokens)) * mask).astype(np.float32)
    adv = RNG.normal(size=rows).astype(np.float32)
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

"""The RL core (dew.objectives.cores.rl) against slow numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.objectives.contract.weighted import Weighted
from dew.objectives.cores.rl import (
    RatioError,
    check_first_update,
    clipped_policy_loss,
    gae,
    group_advantages,
    raising_ratio_errors,
    relative_logprob_gap,
    whiten,
)

ROWS, STEPS = 5, 6
RNG = np.random.default_rng(3)
LENGTHS = np.array([6, 4, 1, 0, 3])
MASK = np.arange(STEPS)[None, :] < LENGTHS[:, None]  # [rows, steps], one row empty


def numpy_clipped(logps, old, adv, mask, weights, eps_low, eps_high):
    """Loop over every action: the PPO surrogate with an asymmetric clip, its
    weighted mean and the weighted share of actions whose gradient the clip removes."""
    total = clipped = weight = 0.0
    for r in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if not mask[r, t]:
                continue
            a = adv[r] if adv.ndim == 1 else adv[r, t]
            rho = np.exp(np.float64(logps[r, t]) - np.float64(old[r, t]))
            bounded = min(max(rho, 1 - eps_low), 1 + eps_high)
            total += weights[r] * max(-a * rho, -a * bounded)
            # zero gradient: the bounded term is the larger and rho is outside the range
            clipped += weights[r] * float(
                (rho < 1 - eps_low and a < 0) or (rho > 1 + eps_high and a > 0)
            )
            weight += weights[r]
    return total / weight, clipped / weight


@pytest.mark.parametrize("per_action", [False, True], ids=["A per row", "A per action"])
def test_clipped_loss_and_clip_fraction_match_numpy(per_action):
    logps = RNG.normal(-2.0, 0.5, (ROWS, STEPS)).astype(np.float32)
    old = (logps + RNG.normal(0, 0.3, (ROWS, STEPS))).astype(np.float32)
    shape = (ROWS, STEPS) if per_action else (ROWS,)
    adv = RNG.normal(size=shape).astype(np.float32)
    weights = np.array([1.0, 3.0, 0.5, 2.0, 1.5], np.float32)  # unequal rows
    eps_low, eps_high = 0.1, 0.28  # DAPO's clip-higher: eps_low != eps_high
    per_token, ratio, clipped = clipped_policy_loss(
        logps, old, adv, epsilon_low=eps_low, epsilon_high=eps_high
    )
    w = MASK * weights[:, None]
    loss = Weighted(total=jnp.sum(per_token * w), weight=jnp.sum(w))
    fraction = Weighted(total=jnp.sum(clipped * w), weight=jnp.sum(w))
    want_loss, want_fraction = numpy_clipped(logps, old, adv, MASK, weights, eps_low, eps_high)
    np.testing.assert_allclose(float(loss.value), want_loss, rtol=1e-5)
    assert float(fraction.value) == pytest.approx(want_fraction, abs=1e-7)
    assert 0 < want_fraction < 1  # both branches are exercised
    np.testing.assert_allclose(ratio, np.exp(np.float64(logps) - old), rtol=1e-6)
    # the two halves of the asymmetric clip both act
    a = np.broadcast_to(adv if per_action else adv[:, None], (ROWS, STEPS))
    rho = np.asarray(ratio)
    assert np.any(MASK & (rho < 1 - eps_low) & (a < 0)) and np.any(
        MASK & (rho > 1 + eps_high) & (a > 0)
    )


def test_clip_fraction_is_the_zero_gradient_set():
    """Where the clip is active the surrogate's gradient in log pi is 0; elsewhere
    it is -A rho (not 0 when A != 0); A = 0 is never clipped."""
    logps = jnp.asarray(RNG.normal(-1.0, 0.4, (ROWS, STEPS)), jnp.float32)
    old = logps + jnp.asarray(RNG.normal(0, 0.3, (ROWS, STEPS)), jnp.float32)
    adv = jnp.asarray(np.r_[RNG.normal(size=ROWS - 1), 0.0], jnp.float32)

    def loss(lp):
        return jnp.sum(clipped_policy_loss(lp, old, adv, epsilon_low=0.2, epsilon_high=0.3)[0])

    grad = np.asarray(jax.grad(loss)(logps))
    _, ratio, clipped = clipped_policy_loss(logps, old, adv, epsilon_low=0.2, epsilon_high=0.3)
    clipped = np.asarray(clipped, bool)
    assert clipped.any() and not clipped[-1].any()
    np.testing.assert_array_equal(grad[clipped], 0.0)
    want = -np.asarray(adv)[:, None] * np.asarray(ratio)
    np.testing.assert_allclose(
        grad[~clipped], np.broadcast_to(want, grad.shape)[~clipped], rtol=1e-6
    )
    # on-policy (rho = 1) nothing is clipped
    assert not np.asarray(
        clipped_policy_loss(old, old, adv, epsilon_low=0.2, epsilon_high=0.3)[2]
    ).any()


def numpy_gae(rewards, values, lengths, gamma, lam):
    adv = np.zeros_like(rewards, np.float64)
    for r, n in enumerate(lengths):
        later = 0.0
        for t in reversed(range(n)):
            next_value = values[r, t + 1] if t + 1 < n else 0.0
            delta = rewards[r, t] + gamma * next_value - values[r, t]
            later = delta + gamma * lam * later
            adv[r, t] = later
    return adv, np.where(MASK, adv + values, 0.0)


def test_gae_matches_a_numpy_loop():
    rewards = RNG.normal(size=(ROWS, STEPS)).astype(np.float32)
    values = RNG.normal(size=(ROWS, STEPS)).astype(np.float32)
    # garbage on padding changes nothing: a row's last real step bootstraps from 0
    rewards[~MASK], values[~MASK] = 50.0, -70.0
    got_adv, got_ret = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    want_adv, want_ret = numpy_gae(rewards, values, LENGTHS, 0.9, 0.8)
    np.testing.assert_allclose(got_adv, want_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_ret, want_ret, rtol=1e-5, atol=1e-6)
    # gamma = lam = 1, reward only at the end: every return is the final reward
    final = np.zeros((ROWS, STEPS), np.float32)
    final[np.arange(ROWS)[LENGTHS > 0], LENGTHS[LENGTHS > 0] - 1] = 3.0
    _, returns = gae(final, values, MASK, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(np.asarray(returns)[MASK], 3.0, rtol=1e-5)


def test_whiten_is_the_masked_unbiased_standard_score():
    x = RNG.normal(2.0, 3.0, (ROWS, STEPS)).astype(np.float32)
    x[~MASK] = 1e4  # padding must not move the statistics
    got = np.asarray(whiten(x, MASK))
    valid = np.float64(x[MASK])
    want = (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(got[MASK], want, rtol=1e-5, atol=1e-6)
    assert not got[~MASK].any()
    assert got[MASK].mean() == pytest.approx(0.0, abs=1e-6)
    assert got[MASK].std(ddof=1) == pytest.approx(1.0, rel=1e-5)


def test_group_advantages_are_standard_scores_within_groups():
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0], np.float32)
    adv, zero = group_advantages(jnp.asarray(rewards), 4, scale_rewards="group", eps=0.0)
    first = rewards[:4]
    np.testing.assert_allclose(adv[:4], (first - first.mean()) / first.std(ddof=1), rtol=1e-6)
    np.testing.assert_array_equal(adv[4:], 0.0)  # identical rewards: no signal, exactly 0
    np.testing.assert_array_equal(zero, [0, 0, 0, 0, 1, 1, 1, 1])


def test_first_update_check_is_relative_to_the_logprob():
    """The relative gap is |d| / max(1, |log p_old|): a float32 ulp at log p = -12
    (|rho - 1| = 1.9e-6, over an absolute 1e-6 bound) passes; a temperature
    mismatch is a RatioError that reaches the caller as itself."""
    old = jnp.asarray([[-12.0, -0.5, -3.0], [-1.0, -2.0, -4.0]])
    mask = jnp.asarray([[True, True, False], [True, True, True]])
    ulp = jnp.zeros_like(old).at[0, 0].set(1.9e-6).at[0, 2].set(5.0)  # [0, 2] is masked
    assert float(relative_logprob_gap(old + ulp, old, mask)) == pytest.approx(1.9e-6 / 12, rel=1e-2)
    assert float(jnp.exp(ulp[0, 0]) - 1) > 1e-6

    def run(logps, step):
        check_first_update(logps, old, mask, step=step, updates_per_batch=2, what="Toy")
        return logps.sum()

    fn = jax.jit(run)
    jax.block_until_ready(fn(old + ulp, jnp.int32(0)))
    jax.block_until_ready(fn(old / 0.7, jnp.int32(1)))  # a second update: not checked
    with pytest.raises(
        RatioError, match=r"Toy: the first update .* at step 2 .* off the rollout's"
    ):
        with raising_ratio_errors():
            jax.block_until_ready(fn(old / 0.7, jnp.int32(2)))
    with pytest.raises(ZeroDivisionError):  # other errors pass through unchanged
        with raising_ratio_errors():
            raise ZeroDivisionError
    assert issubclass(RatioError, AssertionError)

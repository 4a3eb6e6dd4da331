"""Preference losses (dew.objectives.preference.losses) against numpy
transcriptions of the papers' formulas: SimPO (Meng et al. 2024, eq. 6), ORPO
(Hong et al. 2024, eq. 4-7), KTO (Ethayarajh et al. 2024, eq. 7-8), DPO."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.objectives.preference.losses import (
    dpo_losses,
    kto_losses,
    kto_reference_point,
    log1mexp,
    orpo_log_odds,
    orpo_losses,
    simpo_losses,
)

RNG = np.random.default_rng(7)
PAIRS = 6
TOKENS = np.array([[5, 2], [1, 7], [3, 3], [8, 1], [2, 4], [6, 6]], np.float32)  # |y_w|, |y_l|
SUMS = (RNG.normal(-1.2, 0.6, (PAIRS, 2)) * TOKENS).astype(np.float32)  # summed log-probs
WEIGHTS = np.array([1.0, 0.5, 2.0, 1.0, 3.0, 0.25], np.float32)  # unequal pairs


def weighted(values, weights=WEIGHTS):
    return float(np.sum(np.float64(values) * weights) / np.sum(weights))


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_simpo_is_eq_6():
    beta, gamma = 2.0, 0.5
    avg = SUMS / TOKENS
    got = simpo_losses(avg[:, 0], avg[:, 1], beta=beta, gamma=gamma)
    want = [
        -math.log(sigmoid(beta * s[0] / n[0] - beta * s[1] / n[1] - gamma))
        for s, n in zip(np.float64(SUMS), TOKENS)
    ]
    np.testing.assert_allclose(weighted(got), weighted(want), rtol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_orpo_is_the_odds_ratio():
    lam = 0.1
    avg = SUMS / TOKENS
    got = orpo_losses(avg[:, 0], avg[:, 1], lam=lam)
    want = []
    for chosen, rejected in np.float64(avg):
        pw, pl = math.exp(chosen), math.exp(rejected)
        odds_ratio = (pw / (1 - pw)) / (pl / (1 - pl))
        want.append(-lam * math.log(sigmoid(math.log(odds_ratio))))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(weighted(got), weighted(want), rtol=1e-6)


def test_log1mexp_is_accurate_on_both_branches():
    x = np.array([-1e-6, -0.01, -0.5, -math.log(2), -0.7, -3.0, -40.0], np.float32)
    want = [math.log(-math.expm1(v)) for v in np.float64(x)]
    np.testing.assert_allclose(log1mexp(x), want, rtol=2e-6, atol=1e-12)
    grad = jax.grad(lambda v: jnp.sum(log1mexp(v)))(jnp.asarray(x))
    np.testing.assert_allclose(grad, [-1 / math.expm1(-v) for v in np.float64(x)], rtol=1e-4)
    assert np.isfinite(orpo_log_odds(x, x[::-1])).all()


def test_kto_is_eq_7_with_its_reference_point():
    beta, lam_d, lam_u = 0.1, 1.0, 1.33
    rows = 7
    logps = RNG.normal(-8, 2, rows).astype(np.float32)
    ref = (logps + RNG.normal(0, 1, rows)).astype(np.float32)
    desirable = np.array([1, 0, 1, 1, 0, 0, 1], bool)
    mismatched = RNG.normal(-12, 2, rows).astype(np.float32)
    mismatched_ref = (mismatched - np.abs(RNG.normal(0, 1, rows))).astype(np.float32)
    z0 = kto_reference_point(mismatched, mismatched_ref)
    want_z0 = max(0.0, float(np.mean(np.float64(mismatched) - mismatched_ref)))
    np.testing.assert_allclose(z0, want_z0, rtol=1e-6)
    assert want_z0 > 0
    # clamped at 0 when the policy is below the reference on the mismatched pairs
    assert float(kto_reference_point(mismatched_ref, mismatched)) == 0.0
    got = kto_losses(
        logps - ref, desirable, z0, beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u
    )
    want = []
    for lp, rf, good in zip(np.float64(logps), np.float64(ref), desirable):
        r = lp - rf
        value = (
            lam_d * (1 - sigmoid(beta * (r - want_z0)))
            if good
            else lam_u * (1 - sigmoid(beta * (want_z0 - r)))
        )
        want.append(value)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # z0 carries no gradient: the loss's gradient is the per-row one only
    grad = jax.grad(
        lambda m: jnp.sum(
            kto_losses(logps - ref, desirable, kto_reference_point(m, mismatched_ref), beta=beta)
        )
    )(jnp.asarray(mismatched))
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "cdpo", "ipo"])
def test_dpo_losses_match_the_paper(loss_type):
    h = RNG.normal(0, 3, PAIRS).astype(np.float32)
    beta, eps = 0.1, (0.2 if loss_type == "cdpo" else 0.0)
    got = dpo_losses(h, beta=beta, loss_type=loss_type, label_smoothing=eps)
    if loss_type == "ipo":
        want = [(v - 1 / (2 * beta)) ** 2 for v in np.float64(h)]
    else:
        want = [
            -(1 - eps) * math.log(sigmoid(beta * v)) - eps * math.log(sigmoid(-beta * v))
            for v in np.float64(h)
        ]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_dpo_losses_name_the_choices():
    with pytest.raises(ValueError, match=r"one of \['sigmoid', 'cdpo', 'ipo'\], got 'simpo'"):
        dpo_losses(jnp.zeros(2), beta=0.1, loss_type="simpo")

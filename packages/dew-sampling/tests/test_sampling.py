"""Sampling rules against numpy on fixed logits: the kept sets of top-k, top-p and
min-p, the order they apply in, and the distribution of draws."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.sampling import Sampling, filter_logits, sample_logits

# Fixed logits without ties: three rows, from peaked to flat.
LOGITS = np.array(
    [
        [4.0, 1.0, 0.5, -1.0, 2.5, 0.0, -3.0, 3.2],
        [0.3, 0.1, -0.2, 0.25, 0.05, -0.1, 0.2, 0.15],
        [-1.0, 6.0, 5.5, 0.0, -2.0, 5.9, 1.0, 2.0],
    ],
    np.float32,
)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_kept(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The ids each rule keeps, applied in order: temperature, top-k, top-p, min-p."""
    kept = set(range(len(logits)))
    scaled = logits.astype(np.float64) / temperature
    if top_k:
        kept &= set(np.argsort(-scaled)[:top_k].tolist())
    if top_p < 1.0:
        ids = sorted(kept, key=lambda i: -scaled[i])
        probs = softmax(scaled[ids])
        nucleus, mass = set(), 0.0
        for i, p in zip(ids, probs):  # smallest prefix whose mass reaches top_p
            nucleus.add(i)
            mass += p
            if mass >= top_p:
                break
        kept = nucleus
    if min_p > 0.0:
        ids = sorted(kept)
        probs = softmax(scaled[ids])
        kept = {i for i, p in zip(ids, probs) if p >= min_p * probs.max()}
    return kept


RULES = [
    dict(top_k=3),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(top_p=0.999),
    dict(min_p=0.1),
    dict(min_p=0.5),
    dict(temperature=0.5, top_p=0.8),
    dict(temperature=2.0, min_p=0.3),
    dict(top_k=5, top_p=0.7, min_p=0.2),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()))
def test_kept_set_matches_numpy(rule):
    filtered = np.asarray(filter_logits(jnp.asarray(LOGITS), Sampling(**rule)))
    for row, logits in zip(filtered, LOGITS):
        kept = set(np.flatnonzero(row > np.finfo(np.float32).min).tolist())
        assert kept == np_kept(logits, **rule)
        # kept logits are the tempered originals
        t = rule.get("temperature", 1.0)
        np.testing.assert_allclose(row[sorted(kept)], logits[sorted(kept)] / t, rtol=1e-6)


def test_top_k_1_and_temperature_0_are_argmax():
    key = jax.random.key(0)
    for sampling in (Sampling(temperature=0), Sampling(top_k=1)):
        tokens, logprobs = sample_logits(jnp.asarray(LOGITS), key, sampling)
        np.testing.assert_array_equal(tokens, LOGITS.argmax(-1))
        want = [np.log(softmax(r.astype(np.float64))[t]) for r, t in zip(LOGITS, tokens)]
        np.testing.assert_allclose(logprobs, want, rtol=1e-5)


def test_draws_follow_the_renormalised_kept_distribution():
    sampling = Sampling(temperature=0.7, top_p=0.9)
    n = 20000
    keys = jax.random.split(jax.random.key(7), n)
    row = jnp.asarray(LOGITS[0])
    draw = jax.vmap(lambda k: sample_logits(row[None], k, sampling)[0][0])
    tokens = np.asarray(jax.jit(draw)(keys))
    kept = sorted(np_kept(LOGITS[0], temperature=0.7, top_p=0.9))
    assert set(np.unique(tokens).tolist()) <= set(kept)
    want = softmax(LOGITS[0][kept].astype(np.float64) / 0.7)
    got = np.array([(tokens == i).mean() for i in kept])
    np.testing.assert_allclose(got, want, atol=0.015)  # ~4 standard errors at n=20000


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), r"temperature=-1 must be a finite number >= 0 \(0 = greedy"),
        # a NaN compares False with everything: unchecked, every draw was id 0
        (dict(temperature=float("nan")), "temperature=nan must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature=inf must be a finite number >= 0"),
        (dict(temperature="0.7"), "temperature='0.7' must be a finite number"),
        (dict(top_k=-2), r"top_k=-2 must be a whole number >= 0 \(0 = off\)"),
        (dict(top_k=2.5), "top_k=2.5 must be a whole number >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\] \(1 = off\)"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_p=float("nan")), r"top_p=nan must be in \(0, 1\]"),
        (dict(min_p=1.0), r"min_p=1.0 must be in \[0, 1\) \(0 = off\)"),
        (dict(min_p=float("nan")), r"min_p=nan must be in \[0, 1\)"),
    ],
)
def test_bad_rules_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        Sampling(**kwargs)
    assert "Sampling(temperature=0) for greedy" in str(error.value)  # what to do


def test_every_bad_rule_is_named_at_once_and_numpy_scalars_are_accepted():
    with pytest.raises(ValueError, match=r"temperature=nan .*; top_k=-1 .*; top_p=2"):
        Sampling(temperature=float("nan"), top_k=-1, top_p=2)
    rule = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
    assert rule.top_k == 3 and not rule.is_greedy


def test_sampling_keyword_typo_names_the_nearest():
    with pytest.raises(
        TypeError,
        match=r"Sampling got unknown keyword\(s\) 'temprature' \(did you mean 'temperature'\?\)",
    ):
        Sampling(temprature=0)

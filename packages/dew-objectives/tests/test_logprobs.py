"""dew.objectives.cores.logprobs against numpy, the sampler and the cached decoder."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives.cores import logprobs as lp
from dew.sampling import Sampling
from dew.sampling.causal.generate import decode
from dew.sampling.causal.sampling import filter_logits, sample_logits

MODEL = CausalTransformer(**TINY_LM)


@pytest.fixture(scope="module")
def params():
    init = jax.jit(MODEL.init)
    return nn.unbox(init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]


def numpy_logprobs(logits, targets, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0] - logz


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_token_logprobs_is_log_softmax_at_temperature(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(3, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (3, 5))
    got = lp.token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature=temperature)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, numpy_logprobs(logits, targets, temperature), atol=2e-6)


def test_token_logprobs_bf16_logits_in_float32():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 9)), jnp.bfloat16)
    targets = jnp.arange(4)
    got = lp.token_logprobs(logits, targets)
    assert got.dtype == jnp.float32
    want = numpy_logprobs(np.asarray(logits.astype(jnp.float32)), np.arange(4))
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_token_logprobs_equal_the_samplers_bit_for_bit():
    logits = jnp.asarray(np.random.default_rng(2).normal(scale=4, size=(16, 32)), jnp.float32)
    for sampling in (Sampling(), Sampling(temperature=0), Sampling(top_k=5)):
        tokens, logprobs = sample_logits(logits, jax.random.key(3), sampling)
        np.testing.assert_array_equal(lp.token_logprobs(logits, tokens), logprobs)
    # At temperature T: the sampler's own scaling of the logits (filter_logits).
    tokens = jnp.arange(16)
    scaled = filter_logits(logits, Sampling(temperature=0.6))
    want = jnp.take_along_axis(scaled, tokens[:, None], -1)[:, 0] - jax.nn.logsumexp(scaled, -1)
    np.testing.assert_array_equal(lp.token_logprobs(logits, tokens, temperature=0.6), want)


def test_temperature_zero_is_an_error():
    with pytest.raises(ValueError, match="temperature > 0"):
        lp.token_logprobs(jnp.zeros((1, 3)), jnp.zeros((1,), jnp.int32), temperature=0.0)


def test_sequence_logprobs_score_each_next_id(params):
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 32, (2, 8)), jnp.int32)
    fn = jax.jit(functools.partial(lp.sequence_logprobs, MODEL, temperature=0.8))
    got = np.asarray(fn(params, ids))
    assert got.shape == (2, 8) and np.all(got[:, 0] == 0)
    logits = jax.jit(MODEL.apply)({"params": params}, ids)  # logits[t] predicts ids[t + 1]
    want = numpy_logprobs(logits[:, :-1], ids[:, 1:], 0.8)
    np.testing.assert_allclose(got[:, 1:], want, atol=1e-5)


def left_pad(prompts, length):
    ids = np.zeros((len(prompts), length), np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for r, p in enumerate(prompts):
        ids[r, length - len(p) :] = p
        mask[r, length - len(p) :] = True
    return jnp.asarray(ids), jnp.asarray(mask)


def test_completion_logprobs_match_the_cached_decoder(params):
    """Left-padded prompts of different lengths: the whole-sequence scores equal
    the log-probs ``decode`` reported while sampling (positions and masks agree)."""
    prompts = [[3, 4, 5, 6, 7], [9, 2], [1, 1, 1], [30]]
    ids, mask = left_pad(prompts, 8)
    run = jax.jit(functools.partial(decode, MODEL, max_new_tokens=6, sampling=Sampling()))
    new, logprobs, lengths = run(params, ids, mask, key=jax.random.key(5))
    score = jax.jit(functools.partial(lp.completion_logprobs, MODEL))
    scored = score(params, ids, mask, new)
    valid = np.arange(6)[None] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.where(valid, scored, 0.0), logprobs, atol=1e-5)
    # More left padding changes nothing: padding is never seen.
    ids16, mask16 = left_pad(prompts, 16)
    np.testing.assert_allclose(score(params, ids16, mask16, new), scored, atol=1e-5)
    # Each row without padding, at positions 0.. (right-padded: a causal model never
    # reads what follows).
    rows = np.zeros((4, 12), np.int32)
    for r, p in enumerate(prompts):
        rows[r, : len(p) + 6] = p + np.asarray(new[r]).tolist()
    alone = jax.jit(functools.partial(lp.sequence_logprobs, MODEL))(params, jnp.asarray(rows))
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(alone[r, len(p) : len(p) + 6], scored[r], atol=1e-5)


def test_rollout_positions_continue_the_prompt():
    _, mask = left_pad([[1, 2, 3], [4]], 4)
    positions, attention = lp.rollout_positions(mask, 3)
    np.testing.assert_array_equal(positions, [[0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 2, 3]])
    np.testing.assert_array_equal(attention, [[0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])


def test_masked_sum_and_mean_against_numpy():
    rng = np.random.default_rng(6)
    values = rng.normal(size=(4, 7)).astype(np.float32)
    mask = rng.random((4, 7)) < 0.5
    mask[2] = False  # an empty row
    np.testing.assert_allclose(lp.masked_sum(values, mask), (values * mask).sum(-1), rtol=1e-6)
    row_mean = lp.masked_mean(values, mask, axis=-1)
    want = [(v[m].mean() if m.any() else 0.0) for v, m in zip(values, mask)]
    np.testing.assert_allclose(row_mean, want, rtol=1e-6, atol=1e-7)
    assert float(lp.masked_mean(values, mask)) == pytest.approx(values[mask].mean(), rel=1e-6)
    grad = jax.grad(lambda v: lp.masked_mean(v, mask, axis=-1).sum())(jnp.asarray(values))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[2] == 0)


def test_kl_estimators_against_numpy_and_the_exact_kl():
    rng = np.random.default_rng(7)
    logp, ref = rng.normal(size=(2, 50)).astype(np.float32) - 2.0
    d = ref.astype(np.float64) - logp
    np.testing.assert_allclose(lp.kl_k1(logp, ref), -d, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lp.kl_k2(logp, ref), d * d / 2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lp.kl_k3(logp, ref), np.expm1(d) - d, rtol=1e-4, atol=1e-6)
    # Sampled from pi, k1 and k3 are unbiased for KL(pi || ref) of two categoricals.
    pi = jax.nn.log_softmax(jnp.asarray(rng.normal(size=8), jnp.float32))
    rf = jax.nn.log_softmax(jnp.asarray(rng.normal(size=8), jnp.float32))
    exact = float(jnp.sum(jnp.exp(pi) * (pi - rf)))
    x = jax.random.categorical(jax.random.key(8), pi, shape=(400_000,))
    for name, fn in (("k1", lp.kl_k1), ("k3", lp.kl_k3)):
        estimate = float(jnp.mean(fn(pi[x], rf[x])))
        assert estimate == pytest.approx(exact, abs=0.01), name


def test_k3_clamp_keeps_it_finite():
    far = lp.kl_k3(jnp.float32(-200.0), jnp.float32(0.0))  # ref >> pi
    assert np.isfinite(far) and float(far) == pytest.approx(np.exp(20.0) - 21.0, rel=1e-5)
    assert float(lp.kl_k3(jnp.float32(0.0), jnp.float32(-200.0))) == pytest.approx(19.0, rel=1e-5)
    assert not np.isfinite(lp.kl_k3(jnp.float32(-200.0), jnp.float32(0.0), clamp=None))
    assert float(lp.kl_k3(jnp.float32(-1.0), jnp.float32(-1.0))) == 0.0


def test_logprobs_in_chunks_equal_the_whole_logits(params):
    """The model scoring the ids in chunks of 3 positions (not dividing 8) gives
    today's log-probs, at a temperature, with left-padded prompts; and its gradient."""
    prompts = [[3, 4, 5, 6, 7], [9, 2], [1, 1, 1], [30]]
    ids, mask = left_pad(prompts, 5)
    new = jnp.asarray(np.random.default_rng(6).integers(0, 32, (4, 3)), jnp.int32)
    weights = jnp.asarray(np.random.default_rng(7).uniform(0, 2, (4, 3)), jnp.float32)

    def total(p, chunk):
        scored = lp.completion_logprobs(
            MODEL, p, ids, mask, new, temperature=0.8, logits_chunk_size=chunk
        )
        return jnp.sum(scored * weights), scored

    (value, scored), grads = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)(
        params, None
    )
    (chunked_value, chunked), chunked_grads = jax.jit(
        jax.value_and_grad(total, has_aux=True), static_argnums=1
    )(params, 3)
    np.testing.assert_allclose(chunked, scored, atol=1e-5)
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)

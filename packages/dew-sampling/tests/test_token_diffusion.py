"""Token-diffusion samplers: the categorical draw's law, cached == uncached ancestral
sampling with fewer model calls, first-hitting's one token per step, top-p, entropy,
and BD3-LM's block sampler with a clean-block KV cache == without it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import Transformer
from dew.sampling import Sampling
from dew.sampling.token_diffusion import (
    MaskedSampler,
    MaskSchedule,
    sample_blocks,
    sample_categorical,
    sample_entropy,
    sample_masked,
    subs_log_probs,
    subs_nll,
)

L, V, MASK = 8, 6, 6
MODEL = Transformer(
    vocab_size=V + 1, emb_features=32, num_layers=2, num_heads=2, mlp_features=64, max_seq_len=L
)
SCHEDULE = MaskSchedule()


@pytest.fixture(scope="module")
def params():
    p = nn.unbox(MODEL.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32)))["params"]
    return jax.tree.map(lambda a: 3.0 * a, p)  # sharper, position-dependent predictions


def test_categorical_draws_follow_the_probabilities():
    p = np.array([0.5, 0.3, 0.199, 0.001])
    draws = np.asarray(
        jax.jit(
            lambda k: sample_categorical(
                k, jnp.log(jnp.asarray(p, jnp.float32))[None].repeat(200_000, 0)
            )
        )(jax.random.key(0))
    )
    counts = np.bincount(draws, minlength=4)
    expected = p * draws.size
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected * (1 - p))), counts
    # a -1e6 logit (the mask under SUBS) is never drawn
    masked = np.log(np.array([0.5, 0.5, 1e-300 + 0.0]))
    logits = jnp.asarray(np.nan_to_num(masked, neginf=-1e6), jnp.float32)[None].repeat(10_000, 0)
    assert int(jnp.max(sample_categorical(jax.random.key(1), logits))) <= 1


def test_subs_carries_unmasked_tokens_and_never_predicts_the_mask():
    logits = jax.random.normal(jax.random.key(0), (1, 3, V + 1))
    z = jnp.asarray([[2, MASK, 4]])
    lp = np.asarray(subs_log_probs(logits, z, MASK))
    assert lp[0, 0, 2] == 0.0 and lp[0, 2, 4] == 0.0 and lp[0, 0].max() == 0.0
    assert lp[0, 1, MASK] < -1e5 and np.exp(lp[0, 1]).sum() == pytest.approx(1.0, rel=1e-6)


def test_subs_nll_is_the_log_probs_at_the_data_without_the_full_tensor():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7, V + 1)).astype(np.float32) * 4
    x = rng.integers(0, V, (3, 7))
    z = np.where(rng.random((3, 7)) < 0.5, MASK, x)
    z[0, 0] = (x[0, 0] + 1) % V  # an unmasked token that is not the data: 1e6
    got = np.asarray(subs_nll(jnp.asarray(logits), jnp.asarray(z), jnp.asarray(x), MASK))
    # numpy, float64: log-softmax with the mask removed at masked positions
    kept = np.delete(logits.astype(np.float64), MASK, axis=-1)
    top = kept.max(-1)
    lse = top + np.log(np.exp(kept - top[..., None]).sum(-1))
    picked = np.take_along_axis(logits, x[..., None], -1)[..., 0]
    want = np.where(z == MASK, lse - picked, np.where(z == x, 0.0, 1e6))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert (got[z == x] == 0.0).all() and got[0, 0] == 1e6
    # and the entries of subs_log_probs at the data
    lp = np.asarray(subs_log_probs(jnp.asarray(logits), jnp.asarray(z), MASK))
    np.testing.assert_allclose(got, -np.take_along_axis(lp, x[..., None], -1)[..., 0], atol=2e-5)


def run_masked(params, sampler, *, rows=16, key=2):
    fn = jax.jit(
        lambda p, k: sample_masked(
            lambda z, t: MODEL.apply({"params": p}, z),
            jnp.full((rows, L), MASK, jnp.int32),
            key=k,
            mask_id=MASK,
            schedule=SCHEDULE,
            sampler=sampler,
        )
    )
    tokens, calls = fn(params, jax.random.key(key))
    return np.asarray(tokens), int(calls)


def test_the_caching_update_draws_the_same_tokens_with_fewer_model_calls(params):
    cached, cached_calls = run_masked(params, MaskedSampler(num_steps=64), rows=2)
    plain, plain_calls = run_masked(params, MaskedSampler(num_steps=64, use_cache=False), rows=2)
    np.testing.assert_array_equal(cached, plain)
    assert (cached != MASK).all()
    assert plain_calls == 64
    # a call at the first step and after each step that unmasked a token (of 2 x 8)
    assert cached_calls <= 1 + 2 * L


def test_first_hitting_unmasks_one_token_per_step_and_top_p_tiny_is_greedy(params):
    partial, calls = run_masked(params, MaskedSampler(num_steps=3, first_hitting=True))
    np.testing.assert_array_equal((partial != MASK).sum(1), np.full(16, 3))
    full, _ = run_masked(params, MaskedSampler(num_steps=L, first_hitting=True))
    assert (full != MASK).all()
    with pytest.raises(ValueError, match=r"num_steps=3 cannot unmask 8 masked tokens"):
        MaskedSampler(num_steps=3, first_hitting=True).check_masked(L)
    tiny, _ = run_masked(params, MaskedSampler(num_steps=L, sampling=Sampling(top_p=1e-6)))
    greedy, _ = run_masked(params, MaskedSampler(num_steps=L, sampling=Sampling(temperature=0)))
    np.testing.assert_array_equal(tiny, greedy)


def test_sample_entropy_by_hand():
    np.testing.assert_allclose(
        sample_entropy([[0, 0, 1, 1], [3, 3, 3, 3], [0, 1, 2, 3]]), [np.log(2), 0.0, np.log(4)]
    )
    np.testing.assert_allclose(sample_entropy([[0, 1, 5, 5]], [[1, 1, 0, 0]]), [np.log(2)])


@pytest.mark.parametrize("block_size,prompt", [(2, 3), (4, 0)])
def test_block_sampling_with_a_kv_cache_of_clean_blocks_equals_recomputing(
    params, block_size, prompt
):
    given = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, prompt)), jnp.int32)

    def run(use_kv_cache):
        return jax.jit(
            lambda p, k: sample_blocks(
                MODEL,
                p,
                given,
                key=k,
                mask_id=MASK,
                block_size=block_size,
                length=L,
                schedule=SCHEDULE,
                sampler=MaskedSampler(num_steps=block_size, first_hitting=True),
                use_kv_cache=use_kv_cache,
            )
        )(params, jax.random.key(4))

    cached, blocks, calls = run(True)
    plain, plain_blocks, plain_calls = run(False)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(cached)[:, :prompt], np.asarray(given))
    assert (np.asarray(cached) != MASK).all()
    first = prompt // block_size
    assert int(blocks) == int(plain_blocks) == L // block_size - first
    # per block of m masked tokens, first-hitting over block_size steps with the caching
    # update calls the model 1 + min(m, block_size - 1) times; the KV cache adds one
    # write per finished block but the last
    masked = [min(block_size, (b + 1) * block_size - prompt) for b in range(first, L // block_size)]
    want = sum(1 + min(m, block_size - 1) for m in masked)
    assert int(plain_calls) == want and int(calls) == want + int(blocks) - 1


def test_block_sampling_stops_once_every_row_has_the_end_id():
    """With the end id the most likely token everywhere (+100 on its logit's bias),
    greedy block sampling ends after the first block."""
    model = MODEL.clone(use_bias=True)
    p = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32)))["params"]
    p["head"]["bias"] = p["head"]["bias"].at[3].set(100.0)
    tokens, blocks, _ = jax.jit(
        lambda p: sample_blocks(
            model,
            p,
            jnp.zeros((2, 0), jnp.int32),
            key=jax.random.key(0),
            mask_id=MASK,
            block_size=2,
            length=L,
            schedule=SCHEDULE,
            sampler=MaskedSampler(num_steps=2, sampling=Sampling(temperature=0)),
            end_id=3,
        )
    )(p)
    assert int(blocks) == 1
    np.testing.assert_array_equal(np.asarray(tokens)[:, :2], 3)
    assert (np.asarray(tokens)[:, 2:] == MASK).all()

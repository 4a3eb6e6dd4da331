"""The bidirectional Transformer against the numpy transformer under each mask
policy, its identities (padded == unpadded, causal policy == CausalTransformer),
and cached attention under a block-causal policy."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import Attention, CausalTransformer, Transformer, masks, models
from dew.nn.testing import TINY_ENCODER, TINY_LM, tiny_encoder

POS = np.broadcast_to(np.arange(8), (2, 8))
TOKENS = np.random.default_rng(0).integers(0, 32, (2, 8))


def init(model, inputs):
    """Initial parameters, each shifted by noise so biases and scales are exercised."""
    params = nn.unbox(model.init(jax.random.key(0), jnp.asarray(inputs)))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )


@pytest.fixture(scope="module")
def encoder():
    model = tiny_encoder()
    return model, init(model, TOKENS)


@pytest.mark.parametrize(
    "policy,definition",
    [
        (masks.full(), dict(kind="full")),
        (masks.sliding_window(3, causal=False), dict(kind="full", window=3)),
        (masks.block_causal(3), dict(kind="block_causal", block_size=3)),
    ],
    ids=["full", "sliding_bidirectional", "block_causal"],
)
def test_forward_matches_numpy(encoder, reference, policy, definition):
    """Row 1 is right-padded: no query sees its last two tokens."""
    model, params = encoder
    valid = np.array([[True] * 8, [True] * 6 + [False] * 2])
    got = model.clone(mask=policy).apply(
        {"params": params}, jnp.asarray(TOKENS), attention_mask=jnp.asarray(valid)
    )
    allowed = reference.allowed(**definition, query_positions=POS, key_positions=POS)
    want = reference.forward(model, params, TOKENS, allowed & valid[:, None, :])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_an_explicit_mask_matches_numpy(encoder, reference):
    model, params = encoder
    explicit = np.random.default_rng(1).random((2, 8, 8)) < 0.4
    got = model.apply({"params": params}, jnp.asarray(TOKENS), query_key_mask=jnp.asarray(explicit))
    np.testing.assert_allclose(
        got, reference.forward(model, params, TOKENS, explicit), rtol=2e-4, atol=2e-4
    )


def test_continuous_inputs_match_numpy(reference):
    """Vectors in, a projection out; learned positions, LayerNorm, GELU, biases."""
    model = Transformer(
        **{**TINY_ENCODER, "vocab_size": None},
        out_features=5,
        position_embedding="learned",
        norm="layer",
        mlp_activation="gelu",
        use_bias=True,
    )
    x = np.random.default_rng(2).normal(size=(2, 8, 6)).astype(np.float32)
    params = init(model, x)
    got = model.apply({"params": params}, jnp.asarray(x))
    want = reference.forward(model, params, x, np.ones((2, 8, 8), bool))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_a_later_token_changes_earlier_outputs_only_when_bidirectional(encoder):
    model, params = encoder
    changed = TOKENS.copy()
    changed[:, 6] = (changed[:, 6] + 1) % 32
    for policy, moves in [(masks.full(), True), (masks.causal(), False)]:
        m = model.clone(mask=policy)
        before = m.apply({"params": params}, jnp.asarray(TOKENS))
        after = m.apply({"params": params}, jnp.asarray(changed))
        earlier = np.abs(np.asarray(after - before)[:, :6]).max()
        assert (earlier > 1e-3) if moves else (earlier == 0.0), (policy, earlier)


def test_padding_equals_the_unpadded_row(encoder):
    model, params = encoder
    padded = model.apply(
        {"params": params},
        jnp.asarray(TOKENS[:1]),
        attention_mask=jnp.asarray([[True] * 5 + [False] * 3]),
    )
    alone = model.apply({"params": params}, jnp.asarray(TOKENS[:1, :5]))
    np.testing.assert_allclose(padded[:, :5], alone, rtol=1e-5, atol=1e-5)


def test_causal_policy_equals_causal_transformer(encoder):
    """Same blocks, same stack: only the head's name differs."""
    model, params = encoder
    causal = CausalTransformer(**TINY_LM)
    renamed = {("lm_head" if k == "head" else k): v for k, v in params.items()}
    want = causal.apply({"params": renamed}, jnp.asarray(TOKENS))
    got = model.clone(mask=masks.causal()).apply({"params": params}, jnp.asarray(TOKENS))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_config_round_trips_through_json():
    model = models.build("transformer", **TINY_ENCODER, mask=masks.block_causal(4))
    name, config = models.config_of(model)
    assert name == "transformer"
    assert models.build(name, **json.loads(json.dumps(config))) == model


def test_bad_inputs_are_refused(encoder):
    model, params = encoder
    with pytest.raises(ValueError, match=r"shape \(2, 8, 3\); with vocab_size=32 give token ids"):
        model.apply({"params": params}, jnp.zeros((2, 8, 3)))


@pytest.mark.parametrize("block", [2, 4])
def test_block_causal_cached_attention_equals_full(block):
    """Block diffusion decodes a block at a time against the cache of earlier
    blocks; that equals attending over the whole sequence at once."""
    attention = Attention(num_heads=4, num_kv_heads=2, head_dim=4, mask=masks.block_causal(block))
    x = jax.random.normal(jax.random.key(3), (2, 8, 16))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    valid = jnp.ones((2, 8), bool)
    params = attention.init(jax.random.key(0), x, positions, valid)["params"]
    full = attention.apply({"params": params}, x, positions, valid)
    cache = jax.eval_shape(
        lambda: attention.init(jax.random.key(0), x, positions, valid, decode=True)
    )["cache"]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
    steps = []
    for start in range(0, 8, block):
        part = slice(start, start + block)
        out, v = attention.apply(
            {"params": params, "cache": cache},
            x[:, part],
            positions[:, part],
            valid[:, part],
            decode=True,
            mutable=["cache"],
        )
        cache = v["cache"]
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_pipelined_encoder_equals_the_plain_stack(encoder):
    model, params = encoder
    padding = jnp.asarray([[True] * 8, [True] * 5 + [False] * 3] * 2)
    tokens = jnp.asarray(np.concatenate([TOKENS, TOKENS[::-1]]))
    piped = model.clone(num_stages=2, pipeline_microbatches=2)
    want = jax.jit(lambda p: model.apply({"params": p}, tokens, attention_mask=padding))(params)
    got = jax.jit(lambda p: piped.apply({"params": p}, tokens, attention_mask=padding))(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_time_conditioning_is_off_by_default_and_reads_row_or_token_times():
    """Off: no time parameters and a time input refused. On: a [batch] time equals the
    same time per token, and the output moves with the time only through the added
    embedding (the time MLP's output layer zeroed gives the unconditioned model)."""
    plain = Transformer(**TINY_ENCODER)
    timed = Transformer(**TINY_ENCODER, time_conditioning=True, time_features=8)
    params = nn.unbox(plain.init(jax.random.key(0), jnp.asarray(TOKENS)))["params"]
    with pytest.raises(ValueError, match=r"time_conditioning=False\) was called with time"):
        plain.apply({"params": params}, TOKENS, time=jnp.zeros(2))
    t = jnp.asarray([0.2, 0.9])
    timed_params = nn.unbox(timed.init(jax.random.key(0), jnp.asarray(TOKENS), time=t))["params"]
    assert set(timed_params) - set(params) == {"time_in", "time_out"}
    rows = timed.apply({"params": timed_params}, TOKENS, time=t)
    tokens = timed.apply({"params": timed_params}, TOKENS, time=jnp.repeat(t[:, None], 8, 1))
    np.testing.assert_allclose(np.asarray(rows), np.asarray(tokens), rtol=1e-6)
    assert (
        np.abs(np.asarray(rows - timed.apply({"params": timed_params}, TOKENS, time=1 - t))).max()
        > 1e-4
    )
    zeroed = jax.tree.map(jnp.zeros_like, timed_params["time_out"])
    same = {**timed_params, "time_out": zeroed}
    shared = {k: v for k, v in same.items() if k in params}
    np.testing.assert_allclose(
        np.asarray(timed.apply({"params": same}, TOKENS, time=t)),
        np.asarray(plain.apply({"params": shared}, TOKENS)),
        rtol=1e-6,
        atol=1e-6,
    )

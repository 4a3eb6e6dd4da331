"""Causal self-attention in query blocks (the CPU path from 128 tokens) against one
product over every key and against float64 numpy: values and gradients, with GQA,
a sliding window, left padding, packed segments and a length the block does not
divide; and when the blocks are used."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, attention, masks
from dew.nn.testing import TINY_LM

LENGTH = 150  # blocks of 64: [0, 64), [64, 128), [128, 150)


def np_attention(q, k, v, visible):
    """float64 softmax(q k^T / sqrt(d)) v over the visible keys, GQA by repeating k, v."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.asarray(visible), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)


def masked_inputs():
    """q, k, v ``[2, LENGTH, heads, 8]`` (4 query heads on 2 kv heads) and the
    mask of a causal window of 40 with row 1 left-padded by 7 tokens and row 0
    two packed segments."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, LENGTH, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, LENGTH, 2, 8)).astype(np.float32) for _ in range(2))
    slots = np.arange(LENGTH)
    valid = np.ones((2, LENGTH), bool)
    valid[1, :7] = False
    positions = np.stack([np.where(slots < 90, slots, slots - 90), np.maximum(slots - 7, 0)])
    segments = np.stack([(slots >= 90).astype(np.int32), np.zeros(LENGTH, np.int32)])
    visible = masks.attention_mask(
        masks.causal(window=40), positions, positions, valid, slots, slots,
        query_segments=segments, key_segments=segments,
    )  # fmt: skip
    return q, k, v, visible


def test_blocks_equal_one_product_and_numpy():
    q, k, v, visible = masked_inputs()
    assert visible.shape == (2, 1, LENGTH, LENGTH)
    one = attention.attend(q, k, v, visible)
    blocked = attention.attend_in_query_blocks(q, k, v, visible, 64)
    np.testing.assert_allclose(blocked, one, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(blocked, np_attention(q, k, v, visible), rtol=1e-5, atol=1e-5)

    def loss(fn):
        w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
        return lambda q, k, v: jnp.sum(fn(q, k, v, visible) * w)

    blocked_grads = jax.grad(
        loss(lambda *a: attention.attend_in_query_blocks(*a, 64)), argnums=(0, 1, 2)
    )(q, k, v)
    one_grads = jax.grad(loss(attention.attend), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(blocked_grads, one_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_constant_mask_broadcast_over_the_batch():
    """The backbone's default mask is a ``[1, 1, length, length]`` numpy constant."""
    q, k, v, _ = masked_inputs()
    slots = np.arange(LENGTH)
    visible = masks.attention_mask(masks.causal(), slots[None], slots[None],
                                   np.ones((1, LENGTH), bool), slots, slots)  # fmt: skip
    blocked = attention.attend_in_query_blocks(q, k, v, visible, 64)
    np.testing.assert_allclose(blocked, np_attention(q, k, v, visible), rtol=1e-5, atol=1e-5)


def test_block_sizes_and_when_blocks_are_used():
    assert jax.default_backend() == "cpu"
    assert attention.causal_query_block(64) is None
    assert attention.causal_query_block(127) is None
    assert attention.causal_query_block(128) == 64
    assert attention.causal_query_block(150) == 75  # 2 blocks: [0, 75), [75, 150)
    assert attention.causal_query_block(256) == 128
    assert attention.causal_query_block(1024) == 256  # 4 blocks
    assert attention.causal_query_block(2048) == 256  # 8 blocks
    assert attention.causal_query_block(8192) == 1024  # at most 8
    # a mesh that splits the sequence keeps one product (no slices across shards)
    mesh = jax.sharding.AbstractMesh((2,), ("sequence",))
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules([("length", "sequence")]):
        assert attention.causal_query_block(256) is None
    q, k, v, visible = masked_inputs()
    with pytest.raises(ValueError, match="150 queries but 10 keys"):
        attention.attend_in_query_blocks(q, k[:, :10], v[:, :10], visible, 64)


def test_causal_transformer_in_blocks_equals_one_product(monkeypatch, reference):
    """The model at 150 tokens runs its attention in 2 blocks of 75 (counted), and its
    logits and gradients equal the one-product program's and numpy's."""
    model = CausalTransformer(**{**TINY_LM, "max_seq_len": LENGTH})
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, LENGTH)))
    params = nn.unbox(model.init(jax.random.key(0), tokens[:, :8]))["params"]

    def loss(params):
        logits = model.apply({"params": params}, tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, tokens[..., None], -1)[..., 0]), logits  # fmt: skip

    calls = []
    blocks = attention.attend_in_query_blocks

    def counted(*args):
        calls.append(args[-1])
        return blocks(*args)

    monkeypatch.setattr(attention, "attend_in_query_blocks", counted)
    blocked, blocked_logits = jax.grad(loss, has_aux=True)(params)
    assert calls and set(calls) == {75}, calls
    monkeypatch.setattr(attention, "CAUSAL_BLOCKS_FROM", 10**9)
    calls.clear()
    one, one_logits = jax.grad(loss, has_aux=True)(params)
    assert not calls
    np.testing.assert_allclose(blocked_logits, one_logits, rtol=1e-5, atol=1e-5)
    want = reference.forward(model, params, np.asarray(tokens))
    np.testing.assert_allclose(blocked_logits, want, rtol=2e-4, atol=2e-4)
    for (path, got), want in zip(jax.tree.leaves_with_path(blocked), jax.tree.leaves(one),
                                 strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=str(path))


def test_block_diffusion_pieces_equal_the_dense_mask_and_numpy():
    """BD3-LM's [noisy | clean] attention computed in pieces (the clean half over the
    clean keys, the noisy half over its own block and the clean keys) against the
    dense 2L x 2L mask and float64 numpy, with GQA and padding: values and gradients;
    the Transformer takes the structure as query_key_mask and gives the dense logits
    (and with output_length=L the noisy half's alone)."""
    length, block, policy = 8, 2, masks.block_causal(2)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2 * length, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2 * length, 2, 8)).astype(np.float32) for _ in range(2))
    valid = np.ones((2, 2 * length), bool)
    valid[1, length - 3 : length] = valid[1, -3:] = False  # row 1's last 3 tokens: padding
    positions = np.tile(np.arange(length), 2)[None].repeat(2, 0)
    slots = np.arange(2 * length)
    structure = masks.BlockDiffusionMask(length, block)
    visible = masks.attention_mask(
        policy, positions, positions, valid, slots, slots, query_key_mask=structure
    )
    np.testing.assert_array_equal(visible[0, 0], masks.block_diffusion_mask(length, block)[0])
    pieces = jax.jit(lambda q, k, v: attention.attend_block_diffusion(q, k, v, visible, block))
    dense = jax.jit(lambda q, k, v: attention.attend(q, k, v, visible))
    np.testing.assert_allclose(pieces(q, k, v), dense(q, k, v), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pieces(q, k, v), np_attention(q, k, v, visible), atol=1e-5)
    w = rng.standard_normal(q.shape).astype(np.float32)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
        for f in (pieces, dense)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    from dew.nn import Transformer

    model = Transformer(vocab_size=11, emb_features=16, num_layers=1, num_heads=2,
                        mlp_features=32, max_seq_len=length, mask=policy)  # fmt: skip
    tokens = rng.integers(0, 11, (2, 2 * length)).astype(np.int32)
    params = model.init(jax.random.key(0), tokens[:, :length])

    def logits(mask, **kw):
        return model.apply(params, tokens, positions=positions, attention_mask=valid,
                           query_key_mask=mask, **kw)  # fmt: skip

    dense_logits = logits(masks.block_diffusion_mask(length, block))
    np.testing.assert_allclose(logits(structure), dense_logits, atol=2e-6)
    # the head over the noisy half only (what block diffusion reads)
    noisy = logits(structure, output_length=length)
    np.testing.assert_allclose(noisy, dense_logits[:, :length], atol=2e-6)


def test_block_diffusion_last_layer_on_the_noisy_half_equals_every_slot():
    """With output_length=L the last layer computes queries, attention output and MLP
    for the noisy half alone (its clean half giving keys and values only: fewer FLOPs
    in the compiled program): the noisy half's logits and the parameters' gradients
    equal the full 2L computation sliced (1e-6 / 1e-5), with GQA,
    padding and remat (the scanned stack: the path that splits its parameters); the
    noisy-half attention equals the pieces' first half."""
    from dew.nn import Transformer

    length, block = 8, 2
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, length, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2 * length, 2, 8)).astype(np.float32) for _ in range(2))
    visible = masks.block_diffusion_mask(length, block)[:, None]
    full_q = np.concatenate([q, rng.standard_normal(q.shape).astype(np.float32)], axis=1)
    np.testing.assert_allclose(
        attention.attend_noisy_half(q, k, v, visible, block),
        attention.attend_block_diffusion(full_q, k, v, visible, block)[:, :length],
        rtol=1e-6, atol=1e-6,
    )  # fmt: skip

    model = Transformer(vocab_size=11, emb_features=16, num_layers=3, num_heads=4,
                        num_kv_heads=2, mlp_features=32, max_seq_len=length,
                        mask=masks.block_causal(block), use_remat=True)  # fmt: skip
    tokens = rng.integers(0, 11, (2, 2 * length)).astype(np.int32)
    valid = np.ones((2, 2 * length), bool)
    valid[1, length - 3 : length] = valid[1, -3:] = False
    positions = np.tile(np.arange(length), 2)[None].repeat(2, 0)
    structure = masks.BlockDiffusionMask(length, block)
    params = nn.unbox(model.init(jax.random.key(0), tokens[:, :length]))["params"]
    params = jax.tree.map(lambda a: 3.0 * a, params)  # attention far from uniform
    w = rng.standard_normal((2, length, 11)).astype(np.float32)

    def loss(params, **kw):
        logits = model.apply({"params": params}, tokens, positions=positions,
                             attention_mask=valid, query_key_mask=structure, **kw)  # fmt: skip
        return jnp.sum(logits[:, :length] * w), logits[:, :length]

    short_step = jax.jit(jax.value_and_grad(lambda p: loss(p, output_length=length),
                                            has_aux=True)).lower(params).compile()  # fmt: skip
    full_step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params).compile()
    (_, short), short_grads = short_step(params)
    (_, full), full_grads = full_step(params)
    # the work skipped: the last layer's clean-half queries, attention output and MLP
    flops = [step.cost_analysis()["flops"] for step in (short_step, full_step)]
    assert flops[0] < 0.95 * flops[1], flops
    assert short.shape == (2, length, 11)
    np.testing.assert_allclose(short, full, rtol=1e-6, atol=1e-6)
    for (path, got), want in zip(jax.tree.leaves_with_path(short_grads),
                                 jax.tree.leaves(full_grads), strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(path))
    # the parameter tree is the plain stack's, created through the short path too
    short_init = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, positions=positions,
                                query_key_mask=structure, output_length=length))  # fmt: skip
    assert jax.tree.structure(nn.unbox(short_init)["params"]) == jax.tree.structure(params)
    with pytest.raises(ValueError, match=r"query_length 20 must be in \[1, 16\]"):
        attention.Attention(num_heads=2, num_kv_heads=2, head_dim=4, mask=masks.full()).init(
            jax.random.key(0), jnp.zeros((1, 16, 8)), jnp.zeros((1, 16), jnp.int32),
            jnp.ones((1, 16), bool), query_length=20,
        )  # fmt: skip

"""Token scores over the vocabulary in chunks: equal to the whole logits (numpy), in
value and gradient, with tied embeddings and a LoRA head, and smaller temporaries."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, LoRA
from dew.nn.lora import merge, split
from dew.nn.token_scores import check_chunk_size

SMALL = dict(emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16)
LENGTH = 11  # 4 does not divide it: the last chunk is padded


def numpy_scores(logits, targets, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    top = z.max(-1, keepdims=True)
    logz = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
    chosen = np.take_along_axis(z, targets[..., None], -1)[..., 0]
    return chosen - logz, logz, z.argmax(-1) == targets


@pytest.fixture(scope="module", params=[False, True], ids=["lm_head", "tied"])
def setup(request):
    model = CausalTransformer(vocab_size=61, tie_embeddings=request.param, **SMALL)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 61, (3, LENGTH)).astype(np.int32)
    targets = rng.integers(0, 61, (3, LENGTH)).astype(np.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens))["params"]
    return model, params, tokens, targets


def test_chunked_scores_equal_numpy_of_whole_logits(setup):
    model, params, tokens, targets = setup
    logits = model.apply({"params": params}, tokens)
    scores = model.apply(
        {"params": params}, tokens, targets=targets, logits_chunk_size=4, temperature=0.7
    )
    log_probs, logz, is_argmax = numpy_scores(logits, targets, 0.7)
    np.testing.assert_allclose(scores.log_probs, log_probs, atol=2e-5)
    np.testing.assert_allclose(scores.logsumexp, logz, atol=2e-5)
    # the target as argmax: the model's own next-token guesses are the targets here
    guesses = np.asarray(jnp.argmax(logits, -1))
    again = model.apply({"params": params}, tokens, targets=guesses, logits_chunk_size=4)
    assert np.asarray(again.is_argmax).all() and (np.asarray(scores.is_argmax) == is_argmax).all()


def test_chunked_gradient_equals_whole_logits(setup):
    model, params, tokens, targets = setup
    # unequal weights per position and row, zeros included
    weights = np.random.default_rng(1).integers(0, 3, targets.shape).astype(np.float32)

    def whole(p):  # today's path: the whole logits, then log-softmax
        logits = model.apply({"params": p}, tokens)
        log_probs = jax.nn.log_softmax(logits)
        return jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0] * weights)

    def chunked(p):
        scores = model.apply({"params": p}, tokens, targets=targets, logits_chunk_size=4)
        return jnp.sum(scores.log_probs * weights)

    value, grads = jax.value_and_grad(whole)(params)
    chunked_value, chunked_grads = jax.value_and_grad(chunked)(params)
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        other = chunked_grads
        for key in path:
            other = other[key.key]
        np.testing.assert_allclose(other, g, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_lora_on_the_head_works_in_chunks():
    model = CausalTransformer(vocab_size=61, **SMALL)
    lora = LoRA(rank=2, alpha=4, targets="lm_head").apply(model)
    tokens = np.random.default_rng(0).integers(0, 61, (2, LENGTH)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    base, adapters = split(nn.unbox(lora.init(jax.random.key(0), tokens))["params"])
    keys = iter(jax.random.split(jax.random.key(1), 8))
    adapters = jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape), adapters)

    def total(adapters, chunk):
        params = merge(base, adapters)
        scores = lora.apply({"params": params}, tokens, targets=targets, logits_chunk_size=chunk)
        return jnp.sum(scores.log_probs)

    zero = total(jax.tree.map(jnp.zeros_like, adapters), 4)
    value, grads = jax.value_and_grad(total)(adapters, 4)
    whole, whole_grads = jax.value_and_grad(total)(adapters, None)
    assert abs(float(value) - float(zero)) > 1.0  # the adapters change the head's output
    assert float(value) == pytest.approx(float(whole), rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_chunks_shrink_the_compiled_temporaries():
    # vocab 4096 x 4 x 256 tokens: 16 MiB of float32 logits; 4 MiB a chunk of 64 positions.
    # Measured: 38.1 MiB of temporaries whole, 14.2 MiB in chunks of 64 (the rest is the
    # trunk's, attention scores included, the same in both)
    model = CausalTransformer(
        vocab_size=4096, emb_features=32, num_layers=1, num_heads=2, mlp_features=64,
        max_seq_len=256,
    )  # fmt: skip
    tokens = jnp.zeros((4, 256), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens[:, :8])))

    def temporaries(chunk):
        def loss(p):
            scores = model.apply(p, tokens, targets=tokens, logits_chunk_size=chunk)
            return -jnp.mean(scores.log_probs)

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = 4 * 256 * 4096 * 4
    whole, chunked = temporaries(None), temporaries(64)
    assert whole >= logits_bytes  # the whole logits (and their softmax) are held
    assert whole - chunked >= logits_bytes, (whole, chunked)  # saves more than one copy
    assert chunked < whole / 2, (whole, chunked)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "512"])
def test_a_bad_chunk_size_is_refused_with_what_to_do(bad):
    with pytest.raises(ValueError, match=r"logits_chunk_size must be .* got .*Use e\.g\. 512"):
        check_chunk_size(bad, what="test")

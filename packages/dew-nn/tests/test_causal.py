"""CausalTransformer against a numpy transformer, and its identities:
scan == loop, left padding == no padding, cached decoding == full recompute,
packed segments == separate rows; and the parameter tree checkpoints rely on."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, axes
from dew.nn.testing import TINY_GPT2, TINY_LM

TINY = TINY_LM


def init(model, length=8, seed=0):
    tokens = jnp.zeros((2, length), jnp.int32)
    return nn.unbox(model.init(jax.random.key(seed), tokens))["params"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sliding_window": 3},
        {"use_qkv_bias": True},
        TINY_GPT2,
    ],
    ids=["llama", "mistral", "qwen2", "gpt2"],
)
def test_forward_matches_numpy(options, reference):
    model = CausalTransformer(**{**TINY, **options})
    params = init(model)
    # random biases so they are exercised
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(9), x.shape), params)
    tokens = np.random.default_rng(0).integers(0, 32, (2, 8))
    got = model.apply({"params": params}, jnp.asarray(tokens))
    window = options.get("sliding_window")
    pos = np.broadcast_to(np.arange(8), (2, 8))
    allowed = reference.allowed("causal", pos, pos, window=window)
    want = reference.forward(model, params, tokens, allowed)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_scan_equals_loop_and_remat():
    scanned = CausalTransformer(**TINY)
    looped = CausalTransformer(**TINY, use_scan=False)
    rematted = CausalTransformer(**TINY, use_remat=True)
    params = init(scanned)
    layers = params.pop("layers")
    loop_params = dict(params)
    for i in range(TINY["num_layers"]):
        loop_params[f"layer_{i}"] = jax.tree.map(lambda a, i=i: a[i], layers)
    params["layers"] = layers
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 8)))
    a = scanned.apply({"params": params}, tokens)
    b = looped.apply({"params": loop_params}, tokens)
    c = rematted.apply({"params": params}, tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)

    def loss(p, m):
        return jnp.mean(m.apply({"params": p}, tokens) ** 2)

    ga = jax.grad(loss)(params, scanned)
    gc = jax.grad(loss)(params, rematted)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), ga, gc)


def test_left_padding_gives_the_unpadded_logits():
    model = CausalTransformer(**TINY)
    params = init(model)
    row = jnp.asarray([[5, 9, 2, 7, 1]])
    padded = jnp.asarray([[0, 0, 0, 5, 9, 2, 7, 1]])
    mask = jnp.asarray([[False] * 3 + [True] * 5])
    positions = jnp.asarray([[0, 0, 0, 0, 1, 2, 3, 4]])
    want = model.apply({"params": params}, row)
    got = model.apply({"params": params}, padded, positions=positions, attention_mask=mask)
    np.testing.assert_allclose(got[:, 3:], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_cached_decoding_equals_full_recompute(window):
    model = CausalTransformer(**TINY, sliding_window=window)
    params = init(model)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 10)))
    full = model.apply({"params": params}, tokens)
    cache = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((2, 12), jnp.int32), decode=True)
    )["cache"]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
    # prefill 4 tokens, then one at a time
    logits, v = model.apply(
        {"params": params, "cache": cache}, tokens[:, :4], decode=True, mutable=["cache"]
    )
    steps = [logits]
    for t in range(4, 10):
        pos = jnp.full((2, 1), t, jnp.int32)
        logits, v = model.apply(
            {"params": params, "cache": v["cache"]},
            tokens[:, t : t + 1],
            positions=pos,
            decode=True,
            mutable=["cache"],
        )
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_every_parameter_names_vocabulary_axes():
    model = CausalTransformer(**TINY)
    boxed = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    specs = jax.tree.leaves(
        nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    names = {n for spec in specs for n in spec if n is not None}
    assert names <= set(axes.VOCABULARY)
    assert {"layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab"} <= names


def test_bad_head_configuration_is_refused_when_built():
    with pytest.raises(
        ValueError, match=r"num_heads 4 is not a multiple of num_kv_heads 3.*in \[1, 2, 4\]"
    ):
        CausalTransformer(**{**TINY, "num_kv_heads": 3})


def test_packed_segments_equal_separate_rows():
    """Two sequences packed in one row with segment ids and restarting positions
    give each sequence's logits alone (masked == sliced)."""
    model = CausalTransformer(**TINY)
    params = init(model)
    first, second = [5, 9, 2], [7, 1, 3, 8, 4]
    packed = jnp.asarray([first + second])
    segments = jnp.asarray([[0] * 3 + [1] * 5])
    positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]])
    got = model.apply({"params": params}, packed, positions=positions, segment_ids=segments)
    want_first = model.apply({"params": params}, jnp.asarray([first]))
    want_second = model.apply({"params": params}, jnp.asarray([second]))
    np.testing.assert_allclose(got[:, :3], want_first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 3:], want_second, rtol=1e-5, atol=1e-5)


def test_query_key_mask_is_anded_with_causality(reference):
    model = CausalTransformer(**TINY)
    params = init(model)
    tokens = np.random.default_rng(4).integers(0, 32, (2, 8))
    extra = np.random.default_rng(5).random((2, 8, 8)) < 0.6
    got = model.apply({"params": params}, jnp.asarray(tokens), query_key_mask=jnp.asarray(extra))
    pos = np.broadcast_to(np.arange(8), (2, 8))
    want = reference.forward(model, params, tokens, reference.allowed("causal", pos, pos) & extra)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


# Checkpoints and the Hugging Face formats name parameters by these paths.
SCANNED_PARAMS = {
    "embed/embedding": ((32, 16), ("vocab", "embed")),
    "final_norm/scale": ((16,), ("embed",)),
    "layers/attention/key_kernel": ((2, 16, 2, 4), ("layers", "embed", "kv_heads", "head_dim")),
    "layers/attention/out_kernel": ((2, 4, 4, 16), ("layers", "heads", "head_dim", "embed")),
    "layers/attention/query_kernel": ((2, 16, 4, 4), ("layers", "embed", "heads", "head_dim")),
    "layers/attention/value_kernel": ((2, 16, 2, 4), ("layers", "embed", "kv_heads", "head_dim")),
    "layers/attention_norm/scale": ((2, 16), ("layers", "embed")),
    "layers/mlp/down/kernel": ((2, 24, 16), ("layers", "mlp", "embed")),
    "layers/mlp/gate/kernel": ((2, 16, 24), ("layers", "embed", "mlp")),
    "layers/mlp/up/kernel": ((2, 16, 24), ("layers", "embed", "mlp")),
    "layers/mlp_norm/scale": ((2, 16), ("layers", "embed")),
    "lm_head/kernel": ((16, 32), ("embed", "vocab")),
}


def param_table(model):
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    flat = jax.tree_util.tree_leaves_with_path(
        boxed["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
    return {"/".join(k.key for k in path): (leaf.value.shape, leaf.names) for path, leaf in flat}


def test_parameter_paths_are_pinned():
    assert param_table(CausalTransformer(**TINY)) == SCANNED_PARAMS
    looped = param_table(CausalTransformer(**TINY, use_scan=False, use_remat=True))
    want = {}
    for path, (shape, names) in SCANNED_PARAMS.items():
        if path.startswith("layers/"):
            for i in range(TINY["num_layers"]):
                want[f"layer_{i}/" + path[7:]] = (shape[1:], names[1:])
        else:
            want[path] = (shape, names)
    assert looped == want

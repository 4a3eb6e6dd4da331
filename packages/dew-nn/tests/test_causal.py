"""CausalTransformer against a numpy transformer, and its identities:
scan == loop, left padding == no padding, cached decoding == full recompute."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, axes
from dew.nn.rope import inverse_frequencies

TINY = dict(
    vocab_size=32,
    emb_features=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=24,
    max_seq_len=32,
)


# ---------------------------------------------------------------- numpy reference
def np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * scale


def np_layer(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def np_rope(x, pos, inv_freq):
    ang = pos[..., None] * inv_freq  # [b, t, d/2]
    c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    a, b = np.split(x, 2, -1)
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def np_forward(model, params, tokens, window=None):
    p = jax.tree.map(np.asarray, params)
    b, t = tokens.shape
    x = p["embed"]["embedding"][tokens]
    pos = np.broadcast_to(np.arange(t), (b, t))
    if model.position_embedding == "learned":
        x = x + p["position_embed"][pos]
    h_q, h_kv = model.num_heads, model.kv_heads
    hd = model.emb_features // h_q
    inv = inverse_frequencies(hd, model.rope_theta, None)
    norm = (
        (lambda x, q: np_rms(x, q["scale"], model.norm_eps))
        if model.norm == "rms"
        else (lambda x, q: np_layer(x, q["scale"], q["bias"], model.norm_eps))
    )
    for i in range(model.num_layers):
        L = jax.tree.map(lambda a, i=i: a[i], p["layers"])
        a = L["attention"]
        h = norm(x, L["attention_norm"])
        q = np.einsum("bte,ehd->bthd", h, a["query_kernel"])
        k = np.einsum("bte,ehd->bthd", h, a["key_kernel"])
        v = np.einsum("bte,ehd->bthd", h, a["value_kernel"])
        if model.use_qkv_bias or model.use_bias:
            q, k, v = q + a["query_bias"], k + a["key_bias"], v + a["value_bias"]
        if model.position_embedding == "rope":
            q, k = np_rope(q, pos, inv), np_rope(k, pos, inv)
        k = np.repeat(k, h_q // h_kv, axis=2)
        v = np.repeat(v, h_q // h_kv, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        allowed = np.tril(np.ones((t, t), bool))
        if window:
            allowed &= np.triu(np.ones((t, t), bool), -(window - 1))
        scores = np.where(allowed, scores, -1e30)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", w, v)
        o = np.einsum("bqhd,hde->bqe", o, a["out_kernel"])
        if model.use_bias:
            o = o + a["out_bias"]
        x = x + o
        h = norm(x, L["mlp_norm"])
        m = L["mlp"]
        bias = (lambda n, m=m: m[n]["bias"]) if model.use_bias else (lambda n: 0.0)
        up = h @ m["up"]["kernel"] + bias("up")
        if model.mlp_activation == "swiglu":
            g = h @ m["gate"]["kernel"] + bias("gate")
            hidden = g / (1 + np.exp(-g)) * up
        else:  # tanh-approximated gelu
            hidden = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up**3)))
        x = x + hidden @ m["down"]["kernel"] + bias("down")
    x = norm(x, p["final_norm"])
    if model.tie_embeddings:
        return x @ p["embed"]["embedding"].T
    return x @ p["lm_head"]["kernel"]


def init(model, length=8, seed=0):
    tokens = jnp.zeros((2, length), jnp.int32)
    return nn.unbox(model.init(jax.random.key(seed), tokens))["params"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sliding_window": 3},
        {"use_qkv_bias": True},
        dict(
            position_embedding="learned",
            norm="layer",
            mlp_activation="gelu",
            use_bias=True,
            tie_embeddings=True,
            num_kv_heads=None,
            norm_eps=1e-5,
        ),
    ],
    ids=["llama", "mistral", "qwen2", "gpt2"],
)
def test_forward_matches_numpy(options):
    model = CausalTransformer(**{**TINY, **options})
    params = init(model)
    # random biases so they are exercised
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(9), x.shape), params)
    tokens = np.random.default_rng(0).integers(0, 32, (2, 8))
    got = model.apply({"params": params}, jnp.asarray(tokens))
    want = np_forward(model, params, tokens, window=options.get("sliding_window"))
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


def test_bad_head_configuration_is_refused():
    model = CausalTransformer(**{**TINY, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="num_heads 4 is not a multiple of num_kv_heads 3"):
        model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

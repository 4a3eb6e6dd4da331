"""The mixture-of-experts block against a per-token numpy loop, its load-balancing
loss against the formula and its closed-form extremes, and dropless routing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, MoE, axes, models
from dew.nn.moe import load_balancing_loss
from dew.nn.testing import TINY_MOE

EMBED, FEATURES, EXPERTS = 8, 12, 4


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_moe(p, x, k):
    """Route each token on its own: softmax, top-k, renormalised gates, SwiGLU experts."""
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            logits = x[b, t] @ p["router"]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            chosen = np.argsort(-probs)[:k]
            gates = probs[chosen] / (probs[chosen].sum() if k > 1 else 1.0)
            for e, g in zip(chosen, gates):
                hidden = np_silu(x[b, t] @ p["gate"][e]) * (x[b, t] @ p["up"][e])
                out[b, t] += g * (hidden @ p["down"][e])
    return out


@pytest.fixture(scope="module")
def moe_and_params():
    x = jax.random.normal(jax.random.key(1), (3, 5, EMBED))
    out = {}
    for k in (1, 2):
        module = MoE(num_experts=EXPERTS, experts_per_token=k, features=FEATURES, init_std=0.5)
        params = nn.unbox(module.init(jax.random.key(0), x)["params"])
        out[k] = module, params
    return x, out


@pytest.mark.parametrize("k", [1, 2])
def test_moe_matches_a_per_token_numpy_loop(moe_and_params, k):
    x, modules = moe_and_params
    module, params = modules[k]
    y, sown = module.apply({"params": params}, x, mutable=["intermediates"])
    want = np_moe(jax.tree.map(np.asarray, params), np.asarray(x, np.float64), k)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)  # float32 vs float64
    (aux,) = sown["intermediates"]["aux_loss"]  # [batch]: one balance loss per row
    # the formula by hand, per row: f_e from the chosen experts, P_e the mean probability
    probs = np.asarray(jax.nn.softmax(jnp.einsum("ble,ex->blx", x, params["router"]), -1))
    want_aux = []
    for row in probs:
        chosen = np.argsort(-row, -1)[:, :k].reshape(-1)
        f = np.bincount(chosen, minlength=EXPERTS) / chosen.size
        want_aux.append(EXPERTS * np.sum(f * row.mean(0)))
    np.testing.assert_allclose(np.asarray(aux), want_aux, rtol=1e-6)


def test_load_balancing_loss_closed_forms():
    tokens = 64
    # a uniform router: any assignment gives num_experts * sum_e f_e / num_experts = 1
    uniform = jnp.full((tokens, EXPERTS), 1 / EXPERTS)
    chosen = jnp.arange(tokens)[:, None] % EXPERTS
    assert float(load_balancing_loss(uniform, chosen, EXPERTS)) == pytest.approx(1.0)
    # everything on expert 0 with probability 1: the maximum, num_experts
    collapsed = jnp.zeros((tokens, EXPERTS)).at[:, 0].set(1.0)
    zeros = jnp.zeros((tokens, 1), jnp.int32)
    assert float(load_balancing_loss(collapsed, zeros, EXPERTS)) == pytest.approx(EXPERTS)


def test_routing_is_dropless_and_independent_of_the_batch(moe_and_params):
    """No capacity limit: a token's output is the same alone or among many tokens
    that all prefer the same expert."""
    x, modules = moe_and_params
    module, params = modules[1]
    crowd = jnp.concatenate([x[:1], jnp.broadcast_to(x[:1, :1], (1, 40, EMBED))], axis=1)
    alone = module.apply({"params": params}, x[:1])
    crowded = module.apply({"params": params}, crowd)
    np.testing.assert_allclose(np.asarray(crowded[:, :5]), np.asarray(alone), rtol=1e-6, atol=1e-7)


def test_causal_transformer_with_experts_names_expert_first():
    model = CausalTransformer(**TINY_MOE)
    tokens = jnp.arange(16).reshape(2, 8) % 32
    variables = model.init(jax.random.key(0), tokens)
    specs = nn.get_partition_spec(variables)["params"]["layers"]["mlp"]
    assert tuple(specs["up"]) == (axes.LAYERS, axes.EXPERT, axes.EMBED, axes.MLP)
    assert tuple(specs["down"]) == (axes.LAYERS, axes.EXPERT, axes.MLP, axes.EMBED)
    assert tuple(specs["router"]) == (axes.LAYERS, axes.EMBED, axes.EXPERT)
    params = nn.unbox(variables["params"])
    logits, sown = jax.jit(lambda v: model.apply(v, tokens, mutable=["intermediates"]))(
        {"params": params}
    )
    aux = sown["intermediates"]["layers"]["mlp"]["aux_loss"][0]  # [layers, batch]
    # scan == loop with experts, and each layer sows its own balance loss
    looped = model.clone(use_scan=False)
    per_layer = {k: v for k, v in params.items() if k != "layers"}
    for i in range(2):
        per_layer[f"layer_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    want, want_sown = jax.jit(lambda v: looped.apply(v, tokens, mutable=["intermediates"]))(
        {"params": per_layer}
    )
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-6)
    want_aux = [want_sown["intermediates"][f"layer_{i}"]["mlp"]["aux_loss"][0] for i in range(2)]
    np.testing.assert_allclose(np.asarray(aux), np.asarray(want_aux), rtol=1e-6)


def test_bad_expert_options_are_refused():
    with pytest.raises(ValueError, match="experts_per_token 3 must be between 1 and num_experts 2"):
        CausalTransformer(**{**TINY_MOE, "num_experts": 2, "experts_per_token": 3}).init(
            jax.random.key(0), jnp.zeros((1, 8), int)
        )


def test_dense_and_expert_layers_mix_unrolled():
    """moe_layers=(1,): layer 0 a dense MLP of width dense_mlp_features, layer 1
    the MoE. One expert, top-1, is that expert's MLP exactly (its gate is
    softmax over one logit = 1), so the mixed model equals a model with one
    expert in every layer whose layer-0 expert holds the dense weights."""
    tokens = jnp.arange(16).reshape(2, 8) % 32
    one = dict(TINY_MOE, num_experts=1, experts_per_token=1, use_scan=False)
    mixed = CausalTransformer(**dict(one, moe_layers=[1], dense_mlp_features=one["mlp_features"]))
    assert mixed.moe_layers == (1,) and mixed.is_mixed  # a JSON list becomes a tuple
    name, config = models.config_of(mixed)
    assert models.build(name, **config) == mixed  # a saved run rebuilds it
    params = nn.unbox(mixed.init(jax.random.key(0), tokens)["params"])
    assert set(params["layer_0"]["mlp"]) == {"gate", "up", "down"}  # Dense modules
    assert params["layer_1"]["mlp"]["up"].shape == (1, one["emb_features"], one["mlp_features"])
    logits, sown = jax.jit(lambda p: mixed.apply({"params": p}, tokens, mutable="intermediates"))(
        params
    )
    assert list(sown["intermediates"]) == ["layer_1"]  # only the MoE layer sows its losses
    uniform = CausalTransformer(**one)
    moved = dict(params, layer_0=dict(params["layer_0"]))
    moved["layer_0"]["mlp"] = dict(
        jax.tree.map(
            lambda a: a[None], {n: v["kernel"] for n, v in params["layer_0"]["mlp"].items()}
        ),
        router=jnp.zeros((one["emb_features"], 1)),
    )
    want = jax.jit(uniform.apply)({"params": moved}, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-6)
    # every layer listed: the plain scanned stack, the same parameters as moe_layers=None
    every = CausalTransformer(**dict(TINY_MOE, moe_layers=(0, 1)))
    assert not every.is_mixed and every.layer_stack().use_scan


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(moe_layers=(2,)), r"moe_layers=\[2\] must be distinct layer indices in 0...1"),
        (dict(moe_layers=(1, 1)), r"moe_layers=\[1, 1\] must be distinct"),
        (dict(moe_layers=()), r"at least one"),
        (dict(moe_layers=(1,), num_experts=0), r"lists expert layers but num_experts is 0"),
        (dict(moe_layers=(1,), num_stages=2), r"num_stages 2 \(a pipeline\) needs every layer"),
        (dict(moe_layers=(1,), dense_mlp_features=0), r"dense_mlp_features=0"),
        (dict(moe_capacity_factor=0.0), r"moe_capacity_factor must be > 0 .* got 0.0"),
        (dict(moe_dispatch="sparse"), r"unknown moe_dispatch 'sparse'; use one of"),
    ],
)
def test_bad_expert_options_are_refused_when_built(options, message):
    with pytest.raises(ValueError, match=message):
        CausalTransformer(**{**TINY_MOE, **options})

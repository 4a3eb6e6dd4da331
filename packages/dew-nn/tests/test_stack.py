"""LayerStack with a toy block against the layers applied one after another in
numpy: scanned, looped, rematerialised and pipelined, with a per-row aux loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import axes
from dew.nn.stack import LayerStack

LAYERS, BATCH, LENGTH, WIDTH = 4, 8, 3, 6


class Tanh(nn.Module):
    """``tanh(x W + b) * scale``; sows the per-row mean square of its output."""

    sows: bool = True

    @nn.compact
    def __call__(self, x, scale):
        w = self.param(
            "w",
            nn.with_logical_partitioning(
                nn.initializers.normal(WIDTH**-0.5), (axes.EMBED, axes.MLP)
            ),
            (WIDTH, WIDTH),
        )
        b = self.param(
            "b", nn.with_logical_partitioning(nn.initializers.normal(1.0), (axes.MLP,)), (WIDTH,)
        )
        y = jnp.tanh(x @ w + b) * scale[:, None, None]
        if self.sows:
            self.sow("intermediates", "aux_loss", jnp.mean(y**2, axis=(1, 2)))  # [rows]
        return y


class Host(nn.Module):
    stack: LayerStack
    sows: bool = True

    @nn.compact
    def __call__(self, x, scale):
        return self.stack(self, Tanh, {"sows": self.sows}, x, scale)


@pytest.fixture(scope="module")
def setup():
    k_x, k_p = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k_x, (BATCH, LENGTH, WIDTH))
    scale = jnp.linspace(0.5, 1.5, BATCH)
    params = nn.unbox(Host(LayerStack(num_layers=LAYERS)).init(k_p, x, scale))["params"]
    return x, scale, params


def np_layers(params, x, scale):
    """Every layer in order, float64; the aux loss of each layer and row."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["layers"])
    x, scale = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    aux = []
    for i in range(LAYERS):
        x = np.tanh(x @ p["w"][i] + p["b"][i]) * scale[:, None, None]
        aux.append(np.mean(x**2, axis=(1, 2)))
    return x, np.stack(aux)  # [batch, length, width], [layers, batch]


def looped(params):
    return {
        f"layer_{i}": jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(LAYERS)
    }


def test_scanned_parameters_name_the_layers_axis():
    x = jnp.zeros((BATCH, LENGTH, WIDTH))
    boxed = Host(LayerStack(num_layers=LAYERS)).init(jax.random.key(0), x, jnp.ones(BATCH))
    assert boxed["params"]["layers"]["w"].names == (axes.LAYERS, axes.EMBED, axes.MLP)
    assert boxed["params"]["layers"]["w"].value.shape == (LAYERS, WIDTH, WIDTH)


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(use_scan=False),
        dict(use_remat=True),
        dict(use_scan=False, use_remat=True, remat_policy="dots_saveable"),
    ],
    ids=["scan", "loop", "scan_remat", "loop_remat_policy"],
)
def test_stack_equals_the_layers_in_sequence(setup, options):
    x, scale, params = setup
    host = Host(LayerStack(num_layers=LAYERS, **options))
    p = params if options.get("use_scan", True) else looped(params)
    y, sown = host.apply({"params": p}, x, scale, mutable=["intermediates"])
    want, want_aux = np_layers(params, x, scale)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)  # float32
    if options.get("use_scan", True):
        (aux,) = sown["intermediates"]["layers"]["aux_loss"]  # [layers, batch]
    else:
        aux = np.stack([sown["intermediates"][f"layer_{i}"]["aux_loss"][0] for i in range(LAYERS)])
    np.testing.assert_allclose(np.asarray(aux), want_aux, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_remat_gives_the_same_gradients(setup, policy):
    x, scale, params = setup

    def loss(p, stack):
        return jnp.sum(Host(stack).apply({"params": p}, x, scale) ** 2)

    plain = jax.grad(loss)(params, LayerStack(num_layers=LAYERS))
    remat = jax.grad(loss)(
        params, LayerStack(num_layers=LAYERS, use_remat=True, remat_policy=policy)
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), remat, plain)


@pytest.mark.parametrize("policy", [None, "full", "dots_saveable"])
def test_straight_stack_runs_the_scanned_parameters_layer_after_layer(setup, policy):
    """``straight``: a Python loop over slices of the scan's ``[layers, ...]``
    parameters, no scan in the program; the output is numpy's, the gradients the
    scan's (the same tree)."""
    x, scale, params = setup
    remat = dict(remat_policy=policy) if policy else {}
    straight = LayerStack(num_layers=LAYERS, unroll=LAYERS, straight=True, **remat)
    scanned = LayerStack(num_layers=LAYERS, **remat)

    def loss(p, stack):
        return jnp.sum(Host(stack, sows=False).apply({"params": p}, x, scale) ** 2)

    y = Host(straight, sows=False).apply({"params": params}, x, scale)
    np.testing.assert_allclose(np.asarray(y), np_layers(params, x, scale)[0], rtol=1e-5, atol=1e-6)
    assert "scan[" not in str(jax.make_jaxpr(lambda p: loss(p, straight))(params))
    assert "scan[" in str(jax.make_jaxpr(lambda p: loss(p, scanned))(params))
    got = jax.grad(loss)(params, straight)
    want = jax.grad(loss)(params, scanned)  # float32, summed in another order
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_straight_stack_of_a_block_that_sows_scans():
    """A block that sows (a mixture of experts' losses) runs the scan, which stacks
    what each layer sows: the same values as the scanned stack."""
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, WIDTH))
    scale = jnp.linspace(0.5, 1.5, BATCH)
    params = nn.unbox(Host(LayerStack(num_layers=LAYERS)).init(jax.random.key(2), x, scale))
    straight = Host(LayerStack(num_layers=LAYERS, unroll=LAYERS, straight=True))
    y, sown = straight.apply(params, x, scale, mutable=["intermediates"])
    want, want_aux = np_layers(params["params"], x, scale)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    (aux,) = sown["intermediates"]["layers"]["aux_loss"]
    np.testing.assert_allclose(np.asarray(aux), want_aux, rtol=1e-5, atol=1e-6)


def test_causal_transformer_unrolled_layers_equal_the_scan_and_decode_alike():
    """``unroll_layers=True`` (the accelerators' default): the same parameters, logits
    and gradients as the scan (float32 rounding), and cached decoding (which threads
    the cache through the scan) the same tokens."""
    from dew.nn import models

    kw = dict(vocab_size=32, emb_features=16, num_layers=3, num_heads=4, num_kv_heads=2,
              mlp_features=32, max_seq_len=12)  # fmt: skip
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 32)
    scanned = models.build("causal_transformer", **kw, unroll_layers=False)
    straight = models.build("causal_transformer", **kw, unroll_layers=True)
    assert straight.layer_stack().straight and not scanned.layer_stack().straight
    params = nn.unbox(scanned.init(jax.random.key(4), tokens))

    def loss(p, model):
        return jnp.mean(model.apply(p, tokens).astype(jnp.float32) ** 2)

    (a, ga), (b, gb) = (jax.value_and_grad(loss)(params, m) for m in (scanned, straight))
    np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7), gb, ga)
    cache = scanned.apply(params, jnp.zeros((2, 12), jnp.int32), decode=True, mutable=["cache"])
    prefill = [
        m.apply({**params, **cache[1]}, tokens, decode=True, mutable=["cache"])
        for m in (scanned, straight)
    ]
    jax.tree.map(np.testing.assert_array_equal, prefill[1], prefill[0])


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 4), (4, 8)])
def test_pipelined_stack_equals_the_layers_in_sequence(setup, stages, microbatches):
    """Same parameters; the aux loss comes back per row, averaged over layers."""
    x, scale, params = setup
    host = Host(LayerStack(num_layers=LAYERS, num_stages=stages, num_microbatches=microbatches))
    y, sown = jax.jit(lambda p: host.apply({"params": p}, x, scale, mutable=["intermediates"]))(
        params
    )
    want, want_aux = np_layers(params, x, scale)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    (aux,) = sown["intermediates"]["aux_loss"]  # [batch]
    np.testing.assert_allclose(np.asarray(aux), want_aux.mean(0), rtol=1e-5, atol=1e-6)


def test_bad_stacks_are_refused():
    with pytest.raises(ValueError, match="unknown remat_policy 'dots'.*dots_saveable"):
        LayerStack(num_layers=2, use_remat=True, remat_policy="dots")
    with pytest.raises(ValueError, match="num_stages 2 \\(a pipeline\\) needs use_scan=True"):
        LayerStack(num_layers=2, num_stages=2, use_scan=False)
    with pytest.raises(ValueError, match="num_layers 3 does not divide into num_stages 2"):
        LayerStack(num_layers=3, num_stages=2)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        LayerStack(num_layers=0)


def test_a_scanned_stack_on_a_tpu_keeps_the_projections_by_default(monkeypatch):
    """The policy a stack that names none runs: ``'none'`` on this backend; on a
    TPU (the backend's name patched) ``'minimal'`` for the compiled loop alone, the
    named policies and ``use_remat`` unchanged. The causal transformer's defaults
    then trace a remat whose gradients equal no remat's, and cached decoding (the
    cache threaded through the rematted scan) gives the logits of the plain stack."""
    from dew.nn import models
    from dew.nn import stack as stack_module

    assert LayerStack(num_layers=2).remat_name == "none"
    monkeypatch.setattr(stack_module, "_backend", lambda: "tpu")
    assert LayerStack(num_layers=2).remat_name == "minimal"
    assert LayerStack(num_layers=2).is_remat
    for kw, name in [(dict(use_scan=False), "none"), (dict(remat_policy="none"), "none"),
                     (dict(use_remat=True), "full"), (dict(straight=True), "none"),
                     (dict(num_stages=2), "none"), (dict(remat_policy="save_qkv_proj"),
                                                    "save_qkv_proj")]:  # fmt: skip
        assert LayerStack(num_layers=2, **kw).remat_name == name, kw

    kw = dict(vocab_size=32, emb_features=16, num_layers=2, num_heads=4, mlp_features=32,
              max_seq_len=12, unroll_layers=False)  # fmt: skip
    default = models.build("causal_transformer", **kw)
    plain = models.build("causal_transformer", **kw, remat_policy="none")
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 32)
    params = nn.unbox(plain.init(jax.random.key(4), tokens))

    def loss(p, model):
        return jnp.mean(model.apply(p, tokens).astype(jnp.float32) ** 2)

    assert "remat" in str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, default))
    assert "remat" not in str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, plain))
    ga, gb = (jax.grad(loss)(params, m) for m in (plain, default))
    jax.tree.map(lambda u, v: np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-7), ga, gb)
    empty = jnp.zeros((2, 12), jnp.int32)
    decoded = []
    for m in (plain, default):
        _, cache = m.apply(params, empty, decode=True, mutable=["cache"])
        decoded.append(m.apply({**params, **cache}, tokens, decode=True, mutable=["cache"])[0])
    np.testing.assert_allclose(decoded[1], decoded[0], rtol=1e-6, atol=1e-6)

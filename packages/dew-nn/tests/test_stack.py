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
        self.sow("intermediates", "aux_loss", jnp.mean(y**2, axis=(1, 2)))  # [rows]
        return y


class Host(nn.Module):
    stack: LayerStack

    @nn.compact
    def __call__(self, x, scale):
        return self.stack(self, Tanh, {}, x, scale)


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

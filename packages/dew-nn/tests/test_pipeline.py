"""The GPipe schedule against applying the layers one after another (numpy), and
CausalTransformer(num_stages=...) against the plain layer stack."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.nn.pipeline import bubble_fraction, pipeline
from dew.nn.testing import TINY_LM, TINY_MOE

LAYERS, BATCH, WIDTH = 4, 8, 6


def layer_fn(params, carry):
    x, scale = carry
    y = jnp.tanh(x @ params["w"] + params["b"]) * scale[:, None]
    return (y, scale), jnp.mean(y)


@pytest.fixture(scope="module")
def stack():
    k_w, k_b, k_x = jax.random.split(jax.random.key(0), 3)
    params = {
        "w": jax.random.normal(k_w, (LAYERS, WIDTH, WIDTH)) / WIDTH**0.5,
        "b": jax.random.normal(k_b, (LAYERS, WIDTH)),
    }
    x = jax.random.normal(k_x, (BATCH, WIDTH))
    scale = jnp.linspace(0.5, 1.5, BATCH)
    return params, x, scale


def np_sequential(params, x, scale, microbatches):
    """Every layer on the whole batch, in order; aux averaged over layers and microbatches
    (microbatch j = rows j, j + M, ...)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    aux = []
    for i in range(LAYERS):
        x = np.tanh(x @ p["w"][i] + p["b"][i]) * np.asarray(scale)[:, None]
        aux += [x[j::microbatches].mean() for j in range(microbatches)]
    return x, np.mean(aux)


@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 2), (2, 4), (4, 2), (4, 8)])
def test_pipeline_equals_the_layers_in_sequence(stack, stages, microbatches):
    params, x, scale = stack
    fn = jax.jit(
        lambda p, x: pipeline(
            layer_fn, p, (x, scale), num_stages=stages, num_microbatches=microbatches
        )
    )
    (y, scale_out), aux = fn(params, x)
    want, want_aux = np_sequential(params, x, scale, microbatches)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)  # float32
    np.testing.assert_allclose(np.asarray(scale_out), np.asarray(scale))
    # the bubble's idle stages compute on zeros; their aux is left out of the mean
    assert float(aux) == pytest.approx(want_aux, rel=1e-5, abs=1e-6)


def test_pipeline_gradients_equal_the_sequential_gradients(stack):
    params, x, scale = stack

    def sequential(p):
        (y, _), aux = jax.lax.scan(lambda c, q: layer_fn(q, c), (x, scale), p)
        return jnp.sum(y**2)

    def piped(p):
        (y, _), _ = pipeline(layer_fn, p, (x, scale), num_stages=2, num_microbatches=4)
        return jnp.sum(y**2)

    want, got = jax.grad(sequential)(params), jax.jit(jax.grad(piped))(params)
    # per-microbatch gradients summed in another order: float32 agrees to ~2e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, want)


def test_circular_pipeline_equals_the_layers_in_sequence_and_gpipe(stack):
    """2 stages x 2 rounds over 4 layers: chunk r * 2 + s on stage s, 4 microbatches (each
    waits 2 iterations in the buffer between rounds); forward, aux and gradients as the
    sequence (numpy) and as GPipe."""
    params, x, scale = stack
    microbatches = 4

    def run(p, repeats):
        return pipeline(
            layer_fn,
            p,
            (x, scale),
            num_stages=2,
            num_microbatches=microbatches,
            num_repeats=repeats,
        )

    (y, _), aux = jax.jit(lambda p: run(p, 2))(params)
    want, want_aux = np_sequential(params, x, scale, microbatches)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    assert float(aux) == pytest.approx(want_aux, rel=1e-5, abs=1e-6)
    loss = lambda repeats: jax.jit(  # noqa: E731
        jax.grad(lambda p: jnp.sum(run(p, repeats)[0][0] ** 2))
    )
    circular, gpipe = loss(2)(params), loss(1)(params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), circular, gpipe
    )


def test_bubble_fraction_shrinks_with_rounds():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # GPipe: (S - 1) / (M + S - 1)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # circular: (S - 1) / (M R + S - 1)


def test_layers_and_batch_must_divide(stack):
    params, x, scale = stack
    three = jax.tree.map(lambda a: a[:3], params)
    with pytest.raises(ValueError, match="num_layers 3 does not divide into num_stages 2"):
        pipeline(layer_fn, three, (x, scale), num_stages=2, num_microbatches=2)
    with pytest.raises(ValueError, match="batch 8 does not divide into pipeline_microbatches 3"):
        pipeline(layer_fn, params, (x, scale), num_stages=2, num_microbatches=3)
    with pytest.raises(ValueError, match=r"num_stages 2 x pipeline_repeats 4 = 8 pipeline"):
        pipeline(layer_fn, params, (x, scale), num_stages=2, num_microbatches=2, num_repeats=4)
    with pytest.raises(ValueError, match="needs at least as many microbatches as stages"):
        pipeline(layer_fn, params, (x, scale), num_stages=2, num_microbatches=1, num_repeats=2)


TINY = {**TINY_LM, "num_layers": 4}


def test_pipelined_transformer_equals_the_plain_stack():
    """Logits equal; gradients are compared through training in
    packages/dew-train/tests/test_mesh_equivalence.py (data=4,stage=2)."""
    tokens = jax.random.randint(jax.random.key(3), (4, 8), 0, 32)
    plain = CausalTransformer(**TINY)
    piped = CausalTransformer(**TINY, num_stages=2, pipeline_microbatches=2)
    params = nn.unbox(plain.init(jax.random.key(0), tokens)["params"])
    # the same parameter tree and values: a checkpoint moves between the two
    same = nn.unbox(piped.init(jax.random.key(0), tokens)["params"])
    jax.tree.map(np.testing.assert_array_equal, same, params)
    want = jax.jit(plain.apply)({"params": params}, tokens)
    got = jax.jit(piped.apply)({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bad_pipeline_options_are_refused():
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="num_layers 3 does not divide into num_stages 2"):
        CausalTransformer(**{**TINY, "num_layers": 3}, num_stages=2).init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="needs use_scan=True"):
        CausalTransformer(**TINY, num_stages=2, use_scan=False).init(jax.random.key(0), tokens)


def test_pipelined_experts_sow_the_per_row_balance_loss_of_the_plain_stack():
    """The pipeline hands back each row's balance loss (and router z-loss) averaged
    over layers: what the plain stack sows as [layers, rows], averaged over layers."""
    tokens = jax.random.randint(jax.random.key(4), (4, 8), 0, 32)
    plain = CausalTransformer(**TINY_MOE)
    piped = CausalTransformer(**TINY_MOE, num_stages=2, pipeline_microbatches=2)
    params = nn.unbox(plain.init(jax.random.key(0), tokens)["params"])
    apply = lambda m: jax.jit(  # noqa: E731
        lambda p: m.apply({"params": p}, tokens, mutable=["intermediates"])
    )(params)
    want, want_sown = apply(plain)
    got, sown = apply(piped)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    (per_layer,) = want_sown["intermediates"]["layers"]["mlp"]["aux_loss"]  # [layers, batch]
    (aux,) = sown["intermediates"]["aux_loss"]  # [batch]
    np.testing.assert_allclose(np.asarray(aux), np.asarray(per_layer).mean(0), rtol=1e-5)
    (per_layer,) = want_sown["intermediates"]["layers"]["mlp"]["z_loss"]
    (z,) = sown["intermediates"]["z_loss"]
    np.testing.assert_allclose(np.asarray(z), np.asarray(per_layer).mean(0), rtol=1e-5)


def test_pipelined_experts_sow_the_dropped_fraction_of_each_microbatch():
    """With a capacity factor each pipeline microbatch (rows m, m + M, ...) drops
    against its own capacity: the pipeline's per-row dropped fraction is the plain
    stack's on that microbatch alone, averaged over layers."""
    tokens = jax.random.randint(jax.random.key(6), (4, 8), 0, 32)
    capacity = dict(TINY_MOE, moe_dispatch="capacity", moe_capacity_factor=1.0, init_std=0.5)
    plain = CausalTransformer(**capacity)
    piped = CausalTransformer(**capacity, num_stages=2, pipeline_microbatches=2)
    params = nn.unbox(plain.init(jax.random.key(0), tokens)["params"])
    sown_of = lambda m, t: jax.jit(  # noqa: E731
        lambda p: m.apply({"params": p}, t, mutable=["intermediates"])[1]["intermediates"]
    )(params)
    (dropped,) = sown_of(piped, tokens)["dropped_fraction"]  # [batch]
    want = np.zeros(4)
    for m in range(2):
        (per_layer,) = sown_of(plain, tokens[m::2])["layers"]["mlp"]["dropped_fraction"]
        want[m::2] = np.asarray(per_layer).mean(0)
    assert want.max() > 0, want  # some dropped
    np.testing.assert_allclose(np.asarray(dropped), want, atol=1e-6)


def test_circular_transformer_equals_gpipe_on_a_stage_mesh():
    """CausalTransformer(pipeline_repeats=2) on 8 devices (data=4 x stage=2, the layers
    split over stage): the logits and gradients of GPipe's run, within 1e-5."""
    tokens = jax.random.randint(jax.random.key(5), (8, 8), 0, 32)
    gpipe = CausalTransformer(**TINY, num_stages=2, pipeline_microbatches=2)
    circular = gpipe.clone(pipeline_repeats=2)
    params = nn.unbox(CausalTransformer(**TINY).init(jax.random.key(0), tokens)["params"])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "stage"))
    rules = [("batch", "data"), ("layers", "stage")]

    def value_and_grad(model):
        loss = lambda p: jnp.mean(model.apply({"params": p}, tokens) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        (want, want_grads), (got, grads) = value_and_grad(gpipe), value_and_grad(circular)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads
    )

"""dew.train.packing: a step's metrics come back from one array per dtype exactly
as the unpacked tree would (values, dtypes, shapes, the tree's structure)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives import Weighted
from dew.train.packing import packed_step


def step(state, batch):
    x = batch["x"]
    metrics = {
        "loss": jnp.mean(x),
        "accepted": jnp.float32(1.0),
        # an integer count past float32's exact range: packing must not round it
        "tokens": jnp.int32(2**24 + 1) + jnp.sum(batch["n"]),
        "margin": Weighted(total=jnp.sum(x), weight=jnp.float32(x.size)),
        "per_reward": jnp.stack([x.min(), x.max(), x[0, 1]]),
    }
    return state + 1, metrics


def test_unpacked_metrics_equal_the_plain_ones_exactly():
    batch = {
        "x": jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32),
        "n": jnp.arange(4, dtype=jnp.int32),
    }
    want_state, want = jax.device_get(jax.jit(step)(jnp.int32(0), batch))
    fn, packing = packed_step(step)
    state, packed = jax.jit(fn)(jnp.int32(0), batch)
    # one array per dtype crosses to the host
    assert sorted(str(a.dtype) for a in packed) == ["float32", "int32"]
    got = packing.unpack(jax.device_get(packed))
    assert int(state) == int(want_state) == 1
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == np.shape(w)
        np.testing.assert_array_equal(g, w)
    assert int(got["tokens"]) == 2**24 + 1 + 6

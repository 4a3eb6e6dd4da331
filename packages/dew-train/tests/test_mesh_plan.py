"""``dew.train.plan``: FLOPs against the closed form of a transformer step, bytes
against the arrays a sharded initialisation really creates."""

import jax
import jax.numpy as jnp
import optax
import pytest

from dew.nn import CausalTransformer
from dew.objectives import EMA
from dew.objectives.lm import LMObjective
from dew.train import MeshSpec, Trainer, plan

V, E, LAYERS, HEADS, MLP, BATCH, SEQ = 64, 32, 2, 4, 48, 8, 16


def model(**kw):
    return CausalTransformer(vocab_size=V, emb_features=E, num_layers=LAYERS, num_heads=HEADS,
                             mlp_features=MLP, max_seq_len=SEQ, **kw)


def test_flops_are_three_forward_passes_of_matrix_products():
    """Forward: 2 FLOPs per multiply-add in q, k, v, out (4 E^2), SwiGLU (3 E MLP),
    the scores and the weighted values (2 x L^2 E per row), the LM head (E V);
    the backward pass doubles it. The layers are a scan: counted LAYERS times."""
    report = plan(LMObjective(model(), seq_len=SEQ), optax.sgd(0.1),
                  mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
                  batch={"text": ((BATCH, SEQ + 1), jnp.int32)})
    tokens = BATCH * SEQ
    layer = 2 * tokens * (4 * E * E + 3 * E * MLP) + 2 * 2 * BATCH * SEQ * SEQ * E
    head = 2 * tokens * E * V
    assert report.flops == 3 * (LAYERS * layer + head)
    assert report.parameters == V * E + LAYERS * (4 * E * E + 3 * E * MLP + 2 * E) + E + E * V


@pytest.mark.slow
def test_bytes_per_device_match_a_sharded_initialisation():
    mesh = MeshSpec(data=1, fsdp=4, tensor=2)
    objective = LMObjective(model(), seq_len=SEQ, ema=EMA(decay=0.9))
    report = plan(objective, optax.adam(1e-3), mesh=mesh,
                  batch={"text": ((BATCH, SEQ + 1), jnp.int32)})
    state = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), mesh=mesh).init_state()

    def measured(tree):
        per_device = {}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        return max(per_device.values())

    assert report.parameter_bytes == measured(state.params)
    assert report.optimizer_bytes == measured(state.opt_state)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    assert report.parameter_bytes < total / 6  # split 8 ways but for the norm scales
    assert report.peak_bytes >= report.parameter_bytes + report.optimizer_bytes
    assert report.temporary_bytes > 0
    assert report.flops_per_device == report.flops / 8
    assert "plan on 8 devices (fsdp=4, tensor=2)" in str(report)


def test_a_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"batch rows \[6\] must be one number, a multiple of "
                                         r"accumulate=1 x 8 data-parallel devices"):
        plan(LMObjective(model(), seq_len=SEQ), optax.sgd(0.1), mesh=MeshSpec(data=8),
             batch={"text": ((6, SEQ + 1), jnp.int32)})

"""``dew.train.plan``: FLOPs against the closed form of a transformer step, bytes
against the arrays a sharded initialisation really creates."""

import jax
import jax.numpy as jnp
import optax
import pytest

from dew.nn import CausalTransformer
from dew.objectives import EMA
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, Trainer, plan

V, E, LAYERS, HEADS, MLP, BATCH, SEQ = 64, 32, 2, 4, 48, 8, 16


def model(**kw):
    return CausalTransformer(
        vocab_size=V,
        emb_features=E,
        num_layers=LAYERS,
        num_heads=HEADS,
        mlp_features=MLP,
        max_seq_len=SEQ,
        **kw,
    )


def test_flops_are_three_forward_passes_of_matrix_products():
    """Forward: 2 FLOPs per multiply-add in q, k, v, out (4 E^2), SwiGLU (3 E MLP),
    the scores and the weighted values (2 x L^2 E per row), the LM head (E V);
    the backward pass doubles it. The layers are a scan: counted LAYERS times."""
    report = plan(
        LMObjective(model=model(), seq_len=SEQ),
        optax.sgd(0.1),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        batch={"text": ((BATCH, SEQ + 1), jnp.int32)},
    )
    tokens = BATCH * SEQ
    layer = 2 * tokens * (4 * E * E + 3 * E * MLP) + 2 * 2 * BATCH * SEQ * SEQ * E
    head = 2 * tokens * E * V
    assert report.flops == 3 * (LAYERS * layer + head)
    assert report.parameters == V * E + LAYERS * (4 * E * E + 3 * E * MLP + 2 * E) + E + E * V


@pytest.mark.slow
def test_bytes_per_device_match_a_sharded_initialisation():
    # test_mesh.py's tiny model, optimizer and mesh: its initialisation is compiled once
    tiny = CausalTransformer(
        vocab_size=64,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_features=64,
        max_seq_len=16,
    )
    mesh = MeshSpec(data=2, fsdp=2, tensor=2)
    objective = LMObjective(model=tiny, seq_len=16, ema=EMA(decay=0.9))
    report = plan(objective, optax.adamw(1e-3), mesh=mesh, batch={"text": ((BATCH, 17), jnp.int32)})
    state = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), mesh=mesh).init_state()

    def measured(tree):
        per_device = {}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        return max(per_device.values())

    assert report.parameter_bytes == measured(state.params)
    assert report.optimizer_bytes == measured(state.opt_state)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    # weights split 4 ways (fsdp x tensor), norm scales 2 ways (fsdp only): ~0.7% above
    assert report.parameter_bytes == pytest.approx(total / 4, rel=0.01)
    assert report.peak_bytes >= report.parameter_bytes + report.optimizer_bytes
    assert report.temporary_bytes > 0
    assert report.flops_per_device == report.flops / 8
    assert "plan on 8 devices (data=2, fsdp=2, tensor=2)" in str(report)


def test_a_batch_that_does_not_divide_is_refused():
    with pytest.raises(
        ValueError,
        match=r"batch rows \[6\] must be one number, a multiple of "
        r"accumulate=1 x 8 data-parallel devices",
    ):
        plan(
            LMObjective(model=model(), seq_len=SEQ),
            optax.sgd(0.1),
            mesh=MeshSpec(data=8),
            batch={"text": ((6, SEQ + 1), jnp.int32)},
        )


def test_plan_names_the_pipeline_bubble_of_each_schedule():
    """(S - 1) / (M R + S - 1): 2 stages, 4 microbatches: 1/5 for GPipe, 1/9 circular x 2;
    printed by the report (nothing compiled here: the figure is the schedule's)."""
    from dew.train.plan import Plan, pipeline_of

    pipelined = dict(num_stages=2, pipeline_microbatches=4)
    gpipe = pipeline_of(LMObjective(model=model(**pipelined), seq_len=SEQ))
    circular_model = model(**pipelined).clone(num_layers=4, pipeline_repeats=2)
    circular = pipeline_of(LMObjective(model=circular_model, seq_len=SEQ))
    assert gpipe == (pytest.approx(1 / 5), "2 stages, 4 microbatches, GPipe")
    assert circular == (pytest.approx(1 / 9), "2 stages, 4 microbatches, circular x 2")
    assert pipeline_of(LMObjective(model=model(), seq_len=SEQ)) == (None, "")
    figures = dict.fromkeys(
        ("parameters", "parameter_bytes", "optimizer_bytes", "other_state_bytes"), 0
    ) | dict(temporary_bytes=0, peak_bytes=0, flops=0.0, flops_per_device=0.0)
    report = Plan(
        mesh={"stage": 2},
        compile_seconds=0.0,
        pipeline_bubble=circular[0],
        pipeline_schedule=circular[1],
        **figures,
    )
    assert "pipeline bubble" in str(report)
    assert "11.1% idle (2 stages, 4 microbatches, circular x 2)" in str(report)

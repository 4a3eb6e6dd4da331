"""Every mesh axis gives the one-device run: five optax.sgd steps under each of
data=8; fsdp=8; data=2,fsdp=2,tensor=2; data=4,sequence=2; data=4,stage=2 (a
GPipe pipeline); data=4,expert=2 (a mixture of experts, dense dispatch and
routed) and data=2,expert=4 (routed: each device's tokens sent to their experts
by all_to_all) match the same Trainer on a single device (the mixtures against
the dense dispatch).

Tolerance: float32 sums taken in another order across devices agree to a
few units in the 7th digit; we allow rtol 1e-5 on losses and parameters
(atol 1e-6 for parameters near zero).
"""

import collections
import itertools
import json
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.objectives.language.lm import LMObjective
from dew.train import DEFAULT_RULES, MeshSpec, Trainer

SEQ, BATCH, VOCAB, STEPS = 16, 8, 64, 5
TINY = dict(
    vocab_size=VOCAB,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=64,
    max_seq_len=SEQ,
)
MOE = dict(TINY, num_experts=4, experts_per_token=2)
PIPELINE = dict(TINY, num_stages=2, pipeline_microbatches=2)
ROWS = np.random.default_rng(0).integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
ONE_DEVICE = MeshSpec(data=1, devices=jax.devices()[:1])


def data(rows=ROWS) -> Dataset:
    """Five different global batches; each process reads its partition's rows."""
    return Dataset(
        train=lambda p: iter({"text": r[p.slice(BATCH)]} for r in itertools.cycle(rows)),
        val=None,
        records=STEPS * BATCH,
        batch=BATCH,
    )


def run(config: dict, mesh: MeshSpec, run_dir, rows=ROWS) -> tuple[list[float], dict, dict]:
    """Train five steps; returns (losses, final params, last metrics)."""
    trainer = Trainer(
        LMObjective(model=CausalTransformer(**config), seq_len=rows.shape[-1] - 1),
        optax.sgd(0.5),
        key=jax.random.key(0),
        mesh=mesh,
        run_dir=str(run_dir),
    )
    state = trainer.fit(data(rows), steps=STEPS, log_every=1)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    return [r["loss"] for r in train], state.params, train[-1]


def assert_same_training(losses, params, want_losses, want_params, what=""):
    """Losses within rtol 1e-5, parameters within rtol 1e-5 / atol 1e-6 (the module's
    tolerance: float32 sums taken in another order across devices)."""
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=what)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what),
        jax.device_get(params),
        jax.device_get(want_params),
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-device runs: the dense model (also the reference of the pipeline,
    whose parameters are the same tree) and the mixture of experts."""
    return {
        "dense": run(TINY, ONE_DEVICE, tmp_path_factory.mktemp("dense")),
        "moe": run(MOE, ONE_DEVICE, tmp_path_factory.mktemp("moe")),
    }


CASES = {
    "data=8": (TINY, MeshSpec(data=8), "dense"),
    "fsdp=8": (TINY, MeshSpec(fsdp=8), "dense"),
    "data=2,fsdp=2,tensor=2": (TINY, MeshSpec(data=2, fsdp=2, tensor=2), "dense"),
    "data=4,sequence=2": (TINY, MeshSpec(data=4, sequence=2), "dense"),
    "data=4,stage=2": (PIPELINE, MeshSpec(data=4, stage=2), "dense"),
    "data=4,expert=2": (MOE, MeshSpec(data=4, expert=2), "moe"),
    "data=4,expert=2 routed": (
        dict(MOE, moe_dispatch="capacity"),
        MeshSpec(data=4, expert=2),
        "moe",
    ),
    "data=2,expert=4 routed": (
        dict(MOE, moe_dispatch="capacity"),
        MeshSpec(data=2, expert=4),
        "moe",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mesh_matches_one_device(case, reference, tmp_path, capsys):
    config, mesh, ref_name = CASES[case]
    losses, params, metrics = run(config, mesh, tmp_path)
    want_losses, want_params, want_metrics = reference[ref_name]
    sizes = mesh.sizes(8)
    assert f"on {sizes} (1 process(es))" in capsys.readouterr().out  # the start line
    assert_same_training(losses, params, want_losses, want_params)
    if ref_name == "moe":  # the load-balancing loss is reported, agrees, and is in the loss
        assert metrics["aux_loss"] == pytest.approx(want_metrics["aux_loss"], rel=1e-5)
        assert 0.0 < metrics["aux_loss"] <= MOE["num_experts"]
        lm_loss = metrics["nll"]
        assert metrics["loss"] == pytest.approx(lm_loss + 0.01 * metrics["aux_loss"], rel=1e-6)
        up = params["layers"]["mlp"]["up"]  # [layers, expert, embed, mlp]
        held = MOE["num_experts"] // sizes["expert"]
        assert {s.data.shape[1] for s in up.addressable_shards} == {held}  # experts / device


LONG = 128  # from here causal attention runs in query blocks on the CPU (dew.nn.attention)


@pytest.mark.slow
def test_attention_in_query_blocks_matches_one_device_on_a_mesh(tmp_path, monkeypatch):
    """At 128 tokens the model's attention runs in 2 query blocks on one device and on
    data=2,fsdp=2,tensor=2 (counted), and in one product where the mesh splits the
    sequence (data=4,sequence=2); all three train to the same losses and weights."""
    from dew.nn import attention

    blocks, calls = attention.attend_in_query_blocks, []
    monkeypatch.setattr(
        attention, "attend_in_query_blocks", lambda *a: calls.append(a[-1]) or blocks(*a)
    )
    rows = np.random.default_rng(1).integers(0, VOCAB, (STEPS, BATCH, LONG + 1)).astype(np.int32)
    config = dict(TINY, max_seq_len=LONG)
    want_losses, want_params, _ = run(config, ONE_DEVICE, tmp_path / "one", rows)
    assert calls and set(calls) == {64}
    for name, mesh, blocked in [
        ("data=2,fsdp=2,tensor=2", MeshSpec(data=2, fsdp=2, tensor=2), True),
        ("data=4,sequence=2", MeshSpec(data=4, sequence=2), False),
    ]:
        calls.clear()
        losses, params, _ = run(config, mesh, tmp_path / name, rows)
        assert bool(calls) == blocked, name
        assert_same_training(losses, params, want_losses, want_params, name)


def compiled_forward(config, mesh_spec):
    """The model's forward pass compiled on the mesh: (output sharding, collectives, params)."""
    model = CausalTransformer(**config)
    mesh, tokens = mesh_spec.make(), np.zeros((BATCH, SEQ), np.int32)
    with jax.set_mesh(mesh), nn.logical_axis_rules(list(DEFAULT_RULES)):
        boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(boxed), mesh, list(DEFAULT_RULES)
        )
        params = jax.jit(
            lambda k: nn.unbox(model.init(k, tokens)), out_shardings=nn.unbox(shardings)
        )(jax.random.key(0))
        forward = jax.jit(model.apply)
        out = forward(params, tokens)
        hlo = forward.lower(params, tokens).compile().as_text()
    ops = collections.Counter(
        re.findall(r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(", hlo)
    )
    return out.sharding.spec, ops, params["params"]


@pytest.mark.slow
def test_each_axis_does_its_own_kind_of_work():
    """Not replicated work in disguise: sequence splits activations along length and
    gathers keys/values; stage holds half the layers per device and passes
    activations between stages. (Expert: the golden shardings in test_mesh.py
    and the shard shapes in test_mesh_matches_one_device.)"""
    spec, ops, _ = compiled_forward(TINY, MeshSpec(data=4, sequence=2))
    assert spec[1] == "sequence" and ops["all-gather"] > 0  # logits [batch, length, vocab]

    _, ops, params = compiled_forward(PIPELINE, MeshSpec(data=4, stage=2))
    kernel = params["layers"]["mlp"]["up"]["kernel"]  # [layers, embed, mlp]
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {1}  # 2 layers / 2 stages
    assert ops["collective-permute"] > 0  # jnp.roll of the stage buffer

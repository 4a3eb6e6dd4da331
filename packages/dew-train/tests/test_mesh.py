"""MeshSpec, the rules table and the shardings they give, on 8 emulated devices.

The golden file ``golden/mesh_shardings.json`` pins ``{parameter path:
PartitionSpec}`` for tiny models; regenerate it after an intended change with

    DEW_UPDATE_GOLDEN=1 .venv/bin/python -m pytest packages/dew-train/tests/test_mesh.py
"""

import itertools
import json
import os
import pathlib

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dew.data import Dataset
from dew.nn import CausalTransformer, axes
from dew.objectives import EMA
from dew.objectives.language.lm import LMObjective
from dew.train import DEFAULT_RULES, MeshSpec, Trainer

GOLDEN = pathlib.Path(__file__).parent / "golden" / "mesh_shardings.json"
TINY = dict(
    vocab_size=64,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=64,
    max_seq_len=16,
)
CASES = {
    "dense data=2,fsdp=2,tensor=2": (TINY, MeshSpec(data=2, fsdp=2, tensor=2)),
    "moe expert=2,fsdp=2,tensor=2": (
        {**TINY, "num_experts": 4},
        MeshSpec(expert=2, fsdp=2, tensor=2),
    ),
    "pipeline fsdp=2,tensor=2,stage=2": (
        {**TINY, "num_stages": 2},
        MeshSpec(fsdp=2, tensor=2, stage=2),
    ),
}


def trainer_for(config, mesh, optimizer=None, **objective):
    model = CausalTransformer(**config)
    return Trainer(
        LMObjective(model=model, seq_len=16, **objective),
        optimizer or optax.sgd(0.1),
        key=jax.random.key(0),
        mesh=mesh,
    )


def path_of(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def spec_to_json(spec: PartitionSpec) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def json_to_spec(spec: list) -> PartitionSpec:
    return PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in spec])


def param_specs(trainer) -> dict[str, list]:
    _, shardings = trainer.state_shardings()
    flat = jax.tree_util.tree_leaves_with_path(
        shardings.params, is_leaf=lambda x: isinstance(x, NamedSharding)
    )
    return {path_of(p): spec_to_json(s.spec) for p, s in flat}


# ---------------------------------------------------------------- MeshSpec
def test_default_puts_every_device_on_data():
    assert MeshSpec().sizes(8) == dict(data=8, expert=1, fsdp=1, tensor=1, sequence=1, stage=1)


def test_minus_one_fills_the_remaining_devices():
    assert MeshSpec(fsdp=-1, tensor=2).sizes(8)["fsdp"] == 4
    assert MeshSpec(fsdp=-1, tensor=2).sizes(8)["data"] == 1
    assert MeshSpec(data=-1, sequence=2, stage=2).sizes(8)["data"] == 2
    mesh = MeshSpec(data=2, tensor=-1).make()
    assert dict(mesh.shape) == dict(data=2, expert=1, fsdp=1, tensor=4, sequence=1, stage=1)
    assert mesh.axis_names == ("data", "expert", "fsdp", "tensor", "sequence", "stage")


def test_product_mismatch_names_both_and_the_devices_present():
    with pytest.raises(ValueError) as err:
        MeshSpec(data=2, fsdp=2).make()
    message = str(err.value)
    assert "data=2" in message and "fsdp=2" in message and "needs 4 devices" in message
    assert "8 are present" in message and "cpu" in message.lower()
    with pytest.raises(ValueError, match="other axes use 3 devices, which does not divide the 8"):
        MeshSpec(data=-1, tensor=3).make()
    with pytest.raises(ValueError, match="only one MeshSpec axis may be -1"):
        MeshSpec(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="MeshSpec.tensor must be >= 1 or -1"):
        MeshSpec(tensor=0)


def test_a_subset_of_devices():
    mesh = MeshSpec(data=1, devices=jax.devices()[:1]).make()
    assert mesh.devices.size == 1 and mesh.devices.flat[0] == jax.devices()[0]
    with pytest.raises(ValueError, match="needs 4 devices but 2 are given in MeshSpec.devices"):
        MeshSpec(data=4, devices=jax.devices()[:2]).make()


# ------------------------------------------------------------------- rules
def test_rules_table_maps_the_vocabulary():
    rules = {}
    for name, mesh_axes in DEFAULT_RULES:
        rules.setdefault(name, mesh_axes)  # the first rule of a name is its main one
    assert rules[axes.BATCH] == ("data", "fsdp", "expert")
    assert rules[axes.EMBED] == "fsdp"
    for name in (axes.HEADS, axes.KV_HEADS, axes.MLP, axes.VOCAB):
        assert rules[name] == "tensor"
    assert (rules[axes.LENGTH], rules[axes.EXPERT], rules[axes.LAYERS]) == (
        "sequence",
        "expert",
        "stage",
    )
    assert set(rules) == set(axes.VOCABULARY)


def golden_text(cases: dict) -> str:
    """JSON with one parameter a line, so a diff shows which sharding changed."""
    blocks = []
    for name in sorted(cases):
        lines = [f"  {json.dumps(p)}: {json.dumps(s)}" for p, s in sorted(cases[name].items())]
        blocks.append(f" {json.dumps(name)}: {{\n" + ",\n".join(lines) + "\n }")
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def test_golden_parameter_shardings():
    got = {name: param_specs(trainer_for(config, mesh)) for name, (config, mesh) in CASES.items()}
    if os.environ.get("DEW_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(golden_text(got))
    assert got == json.loads(GOLDEN.read_text())


def test_trainer_rules_override():
    # no fsdp for embed; MLP features over fsdp and tensor together
    rules = tuple(
        (n, {axes.EMBED: None, axes.MLP: ("fsdp", "tensor")}.get(n, m)) for n, m in DEFAULT_RULES
    )
    trainer = Trainer(
        LMObjective(model=CausalTransformer(**TINY), seq_len=16),
        optax.sgd(0.1),
        key=jax.random.key(0),
        mesh=MeshSpec(data=2, fsdp=2, tensor=2),
        rules=rules,
    )
    specs = param_specs(trainer)
    assert specs["embed/embedding"] == ["tensor", None]
    assert specs["layers/mlp/up/kernel"] == ["stage", None, ["fsdp", "tensor"]]
    assert specs["layers/attention/query_kernel"] == ["stage", None, "tensor", None]
    default = param_specs(trainer_for(TINY, MeshSpec(data=2, fsdp=2, tensor=2)))
    assert default["layers/mlp/up/kernel"] == ["stage", "fsdp", "tensor"]


def test_state_is_created_sharded_by_a_jit_with_out_shardings(monkeypatch):
    """Parameters, optimizer state and the moving average come out of the
    initialising jit already sharded as the golden specs say."""
    config, mesh = CASES["dense data=2,fsdp=2,tensor=2"]
    trainer = trainer_for(config, mesh, optax.adamw(1e-3), ema=EMA(decay=0.9))
    seen = []
    real_jit = jax.jit

    def spy(fn, **kwargs):
        seen.append(kwargs)
        return real_jit(fn, **kwargs)

    monkeypatch.setattr(jax, "jit", spy)
    state = trainer.init_state()
    golden = json.loads(GOLDEN.read_text())["dense data=2,fsdp=2,tensor=2"]
    device_mesh = trainer.device_mesh
    expected = {p: NamedSharding(device_mesh, json_to_spec(s)) for p, s in golden.items()}
    trees = {
        "params": state.params,
        "mu": state.opt_state[0].mu["policy"],  # the optimizer state is keyed by role
        "nu": state.opt_state[0].nu["policy"],
        "averaged": state.averaged,
    }
    for tree_name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            want = expected[path_of(path)]
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (tree_name, path_of(path))
    (init_kwargs,) = [k for k in seen if "out_shardings" in k]
    assert init_kwargs["out_shardings"].params["embed"]["embedding"] == expected["embed/embedding"]


@pytest.mark.parametrize("config", [TINY, {**TINY, "num_experts": 4}], ids=["dense", "moe"])
def test_no_large_parameter_is_left_replicated_under_fsdp(config):
    trainer = trainer_for(config, MeshSpec(data=1, fsdp=8))
    abstract, shardings = trainer.state_shardings()
    flat = zip(
        jax.tree_util.tree_leaves_with_path(abstract.params),
        jax.tree.leaves(shardings.params, is_leaf=lambda x: isinstance(x, NamedSharding)),
    )
    replicated = [path_of(p) for (p, leaf), s in flat if leaf.size > 1024 and s.is_fully_replicated]
    assert replicated == []


def per_device_bytes(tree, device) -> int:
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


@pytest.mark.slow
def test_parameter_and_optimizer_bytes_shrink_as_one_over_fsdp():
    config = TINY
    abstract, _ = trainer_for(config, MeshSpec(data=8), optax.adam(1e-3)).state_shardings()
    total = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves((abstract.params, abstract.opt_state))
    )
    measured = {}
    for fsdp in (2, 8):
        state = trainer_for(config, MeshSpec(data=-1, fsdp=fsdp), optax.adam(1e-3)).init_state()
        measured[fsdp] = max(
            per_device_bytes((state.params, state.opt_state), d) for d in jax.devices()
        )
    for fsdp, nbytes in measured.items():
        # everything but Adam's step counter splits over fsdp: within 1% of total / fsdp
        assert nbytes == pytest.approx(total / fsdp, rel=0.01), (total, measured)


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "config,mesh,message",
    [
        (
            {**TINY, "num_heads": 3, "num_kv_heads": 3, "head_dim": 8},
            MeshSpec(tensor=2),
            r"\['attention'\]\['(key|query)_kernel'\]: dimension 2 \('(kv_)?heads'\) "
            r"of size 3 does not divide over mesh axis tensor of size 2",
        ),
        (
            {**TINY, "num_layers": 3},
            MeshSpec(stage=2),
            r"dimension 0 \('layers'\) of size 3 does not divide over mesh axis stage of size 2",
        ),
        (
            {**TINY, "num_experts": 3},
            MeshSpec(expert=2),
            # the routed MoE refuses it while tracing its experts (dew.nn.shards)
            r"MoE num_experts: 'expert' of size 3 does not divide over mesh axis expert of size 2",
        ),
        (
            {**TINY, "max_seq_len": 16},
            MeshSpec(sequence=3, data=-1, devices=jax.devices()[:6]),
            r"'length' of size 16 does not divide over mesh axis sequence of size 3",
        ),
    ],
    ids=["heads/tensor", "layers/stage", "experts/expert", "length/sequence"],
)
def test_dimension_that_does_not_divide_is_refused_before_compiling(config, mesh, message):
    trainer = trainer_for(config, mesh)
    with pytest.raises(ValueError, match=message):
        trainer.state_shardings()  # abstract evaluation only: nothing is compiled


def test_batch_that_does_not_divide_over_data_is_refused_before_compiling():
    rows = np.zeros((12, 17), np.int32)
    data = Dataset(train=lambda p: itertools.repeat({"text": rows}), val=None, records=12, batch=12)
    trainer = trainer_for(TINY, MeshSpec(data=8))
    with pytest.raises(ValueError, match="global batch 12 does not divide over 8 data-parallel"):
        trainer.fit(data, steps=1)
    assert getattr(trainer, "_init_fn", None) is None  # refused before initialising


def test_pipeline_microbatch_that_does_not_divide_over_data_is_refused():
    config = {**TINY, "num_stages": 2, "pipeline_microbatches": 4}
    trainer = trainer_for(config, MeshSpec(data=4, stage=2))
    rows = np.zeros((8, 17), np.int32)
    data = Dataset(train=lambda p: itertools.repeat({"text": rows}), val=None, records=8, batch=8)
    with pytest.raises(
        ValueError,
        match=r"pipeline microbatch \(batch 8 / 4 microbatches\): "
        r"'batch' of size 2 does not divide over mesh axis "
        r"dataxfsdpxexpert of size 4",
    ):
        trainer.fit(data, steps=1)  # raised while tracing the step, before compiling it

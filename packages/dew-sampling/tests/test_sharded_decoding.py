"""Decoding on a mesh as inside ``Trainer.fit``: parameters split over fsdp and
tensor by the logical rules, the model's activation constraints active.
The tokens equal one device's, and XLA compiles it without "[SPMD]
Involuntary full rematerialization" (a sharding the partitioner can only
reach by gathering a whole array on every device, then splitting it again).

The warning is printed to the process's stderr while XLA compiles, so each
test compiles afresh and reads stderr at the file-descriptor level.
"""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from dew.sampling import Sampling, beam_search, generate

WARNING = "Involuntary full rematerialization"
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 2, 6, 11, 4, 5, 60], [42]]  # 3 rows over 4 batch shards
NUCLEUS = Sampling(temperature=1.0, top_p=0.95)
GREEDY = Sampling(temperature=0)
# dew.train's DEFAULT_RULES on the mesh axes used here.
RULES = [
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("head_dim", None),
]


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 emulated devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


@pytest.fixture
def fresh_compiles():
    """Programs compile here, so XLA prints its warnings: nothing comes from the
    in-memory caches or from the persistent cache, and nothing is written to it."""
    jax.clear_caches()
    for module in ("dew.sampling.generate", "dew.sampling.beam"):
        importlib.import_module(module)._compiled.cache_clear()
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)


def shard(model, params, mesh):
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    sharded = jax.tree.map(jax.device_put, params, shardings)
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(sharded))
    return sharded


def on_mesh(mesh, fn):
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        return fn()


def test_the_check_sees_a_partitioner_warning(mesh, fresh_compiles, capfd):
    # A gather from a table split along its rows' features, constrained to a
    # batch split: the pattern XLA warns about.
    table = jax.device_put(
        np.ones((16, 8), np.float32), NamedSharding(mesh, PartitionSpec(None, "fsdp"))
    )
    index = jax.device_put(
        np.zeros((8, 4), np.int32), NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    )
    out = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, None))
    jax.jit(lambda t, i: jax.lax.with_sharding_constraint(jnp.take(t, i, axis=0), out))(
        table, index
    )
    assert WARNING in capfd.readouterr().err


@pytest.mark.slow
def test_generate_on_fsdp_and_tensor_equals_one_device_quietly(tiny, mesh, fresh_compiles, capfd):
    model, params = tiny("llama")
    sharded = shard(model, params, mesh)
    want = generate(model, params, PROMPTS, 8, jax.random.key(1), sampling=NUCLEUS)
    want_one = generate(model, params, PROMPTS[:1], 8, jax.random.key(0), sampling=GREEDY)
    got = on_mesh(
        mesh, lambda: generate(model, sharded, PROMPTS, 8, jax.random.key(1), sampling=NUCLEUS)
    )
    # One row, as a trainer's preview: the batch is filled up to the 4 batch shards.
    got_one = on_mesh(
        mesh, lambda: generate(model, sharded, PROMPTS[:1], 8, jax.random.key(0), sampling=GREEDY)
    )
    err = capfd.readouterr().err
    assert got.tokens == want.tokens and got_one.tokens == want_one.tokens
    assert got.lengths == want.lengths == [8, 8, 8]
    for a, b in zip(got.logprobs + got_one.logprobs, want.logprobs + want_one.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert WARNING not in err, err[-3000:]


@pytest.mark.slow
def test_beam_search_on_fsdp_and_tensor_equals_one_device_quietly(
    tiny, mesh, fresh_compiles, capfd
):
    model, params = tiny("llama")
    sharded = shard(model, params, mesh)
    want = beam_search(model, params, PROMPTS, 4, num_beams=2, end_ids=[7])
    got = on_mesh(mesh, lambda: beam_search(model, sharded, PROMPTS, 4, num_beams=2, end_ids=[7]))
    err = capfd.readouterr().err
    assert got.tokens == want.tokens and got.lengths == want.lengths
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-5)
    assert WARNING not in err, err[-3000:]


@pytest.mark.slow
def test_learned_positions_on_fsdp_are_quiet(tiny, mesh, fresh_compiles, capfd):
    model, params = tiny("gpt2")
    sharded = shard(model, params, mesh)
    want = generate(model, params, PROMPTS, 8, jax.random.key(0), sampling=GREEDY)
    got = on_mesh(
        mesh, lambda: generate(model, sharded, PROMPTS, 8, jax.random.key(0), sampling=GREEDY)
    )
    err = capfd.readouterr().err
    assert got.tokens == want.tokens
    assert WARNING not in err, err[-3000:]

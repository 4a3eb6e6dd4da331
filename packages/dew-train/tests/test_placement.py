"""Host batches onto the mesh (dew.train.placement.to_global): values, dtypes and
shardings equal what ``jax.device_put`` with the batch sharding gives, on one device
(the compiled identity) and on eight (one batched ``device_put``)."""

import jax
import numpy as np
import pytest

from dew.data import Partition
from dew.train import DEFAULT_RULES, MeshSpec, placement
from dew.train.mesh import batch_sharding


def local_batch(rows=8):
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, 2**40, (rows, 5)),  # int64 on the host
        "mask": rng.random((rows, 5)) < 0.5,
        "weight": rng.random(rows),  # float64 on the host
        "image": rng.random((rows, 2, 3, 1)).astype(np.float32),
    }


@pytest.mark.parametrize("devices", [1, 8])
def test_to_global_equals_device_put_with_the_batch_sharding(devices):
    mesh = MeshSpec(data=devices).make(jax.devices()[:devices])
    local = local_batch()
    placed = placement.to_global(local, Partition(0, 1), 8, mesh, DEFAULT_RULES)
    assert sorted(placed) == sorted(local)
    for name, value in local.items():
        want = jax.device_put(value, batch_sharding(mesh, DEFAULT_RULES, value.ndim))
        got = placed[name]
        assert got.dtype == want.dtype, name  # int64 -> int32, float64 -> float32 (no x64)
        assert got.sharding == want.sharding, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
        for shard, want_shard in zip(got.addressable_shards, want.addressable_shards):
            assert shard.device == want_shard.device and shard.index == want_shard.index


def test_one_device_placement_compiles_once_per_layout():
    mesh = MeshSpec().make(jax.devices()[:1])
    placement._placer.cache_clear()
    for seed in range(3):
        batch = {k: v + seed for k, v in local_batch().items() if k != "mask"}
        placed = placement.to_global(batch, Partition(0, 1), 8, mesh, DEFAULT_RULES)
        np.testing.assert_allclose(np.asarray(placed["weight"]), batch["weight"], rtol=1e-7)
    info = placement._placer.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    placement.to_global(local_batch(16), Partition(0, 1), 16, mesh, DEFAULT_RULES)
    assert placement._placer.cache_info().misses == 2  # a new shape: a new program


def test_wrong_row_count_names_the_key_and_the_rows():
    mesh = MeshSpec().make(jax.devices()[:1])
    with pytest.raises(ValueError, match=r"batch\['tokens'\] has 4 rows.*must read 8 rows"):
        placement.to_global(local_batch(4), Partition(0, 1), 8, mesh, DEFAULT_RULES)

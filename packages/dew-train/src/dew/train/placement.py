"""Placement on the mesh: host batches to global arrays, and the one place a
function is jitted with explicit shardings, lowered and compiled.

``Trainer`` and :func:`dew.train.plan` both compile through :func:`compile_fn`,
so the step that ``plan`` measures is the step that ``fit`` runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data import Partition
from dew.train.mesh import Rules, batch_sharding, data_parallel_size, mesh_sizes
from dew.train.throughput import program_flops


def check_batch_rows(mesh: Mesh, rules: Rules, rows: int, accumulate: int, *, what="global batch"):
    """``rows`` splits into ``accumulate`` microbatches, each over the data-parallel
    devices, or a clear error before anything is compiled."""
    dp = data_parallel_size(mesh, rules)
    if rows % dp:
        raise ValueError(
            f"{what} {rows} does not divide over {dp} data-parallel devices "
            f"(mesh {mesh_sizes(mesh)}); use a multiple of {dp} or fewer "
            f"devices on data/fsdp/expert"
        )
    if rows % (accumulate * dp):
        raise ValueError(
            f"{what} {rows} does not split into accumulate={accumulate} "
            f"microbatches of a multiple of {dp} data-parallel devices; use a batch that "
            f"is a multiple of {accumulate * dp}"
        )


def to_global(
    local: Mapping[str, Any], partition: Partition, global_rows: int, mesh: Mesh, rules: Rules
) -> dict[str, jax.Array]:
    """This process's rows of a global batch -> global arrays sharded by rows."""
    out = {}
    for name, value in local.items():
        value = np.asarray(value)
        if value.shape[:1] != (global_rows // partition.count,):
            raise ValueError(
                f"batch[{name!r}] has {value.shape[0] if value.ndim else 0} rows; this "
                f"process (partition {partition.index} of {partition.count}) must read "
                f"{global_rows // partition.count} rows of the global batch {global_rows}"
            )
        sharding = batch_sharding(mesh, rules, value.ndim)
        if partition.count == 1:  # this process holds the whole batch
            out[name] = jax.device_put(value, sharding)
        else:
            out[name] = jax.make_array_from_process_local_data(
                sharding, value, (global_rows, *value.shape[1:])
            )
    return out


def to_host(batch: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Global arrays -> numpy arrays holding every row, on every process
    (gathered across processes when there are several)."""
    if jax.process_count() == 1:
        return {k: np.asarray(v) for k, v in jax.device_get(dict(batch)).items()}
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(dict(batch), tiled=True)
    return {k: np.asarray(v) for k, v in gathered.items()}


def from_host(batch: Mapping[str, Any], mesh: Mesh, rules: Rules) -> dict[str, jax.Array]:
    """Numpy arrays holding every row (the same on every process) -> global
    arrays sharded by rows."""
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        sharding = batch_sharding(mesh, rules, value.ndim)
        out[name] = jax.make_array_from_callback(
            value.shape, sharding, lambda index, v=value: v[index]
        )
    return out


def abstract_batch(batch: Mapping[str, Any], mesh: Mesh, rules: Rules) -> dict:
    """``{name: ShapeDtypeStruct}`` with the row sharding of each key."""
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(mesh, rules, v.ndim))
        for k, v in batch.items()
    }


def layout(batch: Mapping[str, Any]) -> tuple:
    """What a compiled program depends on: every key's shape, dtype and sharding."""
    return tuple(
        (name, tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
        for name, x in sorted(batch.items())
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def compile_fn(
    fn: Callable,
    args: tuple,
    *,
    in_shardings: tuple,
    out_shardings: Any,
    donate_argnums: tuple[int, ...] = (),
):
    """``jax.jit(fn)`` with explicit shardings, lowered for ``args`` (arrays or
    ``ShapeDtypeStruct``) and compiled: nothing runs."""
    return compile_with_flops(
        fn,
        args,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnums=donate_argnums,
    )[0]


def compile_with_flops(
    fn: Callable,
    args: tuple,
    *,
    in_shardings: tuple,
    out_shardings: Any,
    donate_argnums: tuple[int, ...] = (),
):
    """``(compiled, flops)``: :func:`compile_fn`'s program and its matrix-product
    FLOPs (:func:`dew.train.throughput.program_flops`), from one trace."""
    traced = jax.jit(
        fn,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnums=donate_argnums,
    ).trace(*args)
    return traced.lower().compile(), program_flops(traced.jaxpr)


def shard_bytes(abstract, shardings) -> int:
    """Bytes of ``abstract``'s arrays that the fullest device holds."""
    per_device: dict[Any, int] = {}
    leaves = jax.tree.leaves(abstract)
    sharding_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for leaf, sharding in zip(leaves, sharding_leaves):
        itemsize = _itemsize(leaf.dtype)
        for device, index in sharding.devices_indices_map(leaf.shape).items():
            size = math.prod(len(range(*s.indices(n))) for s, n in zip(index, leaf.shape))
            per_device[device] = per_device.get(device, 0) + size * itemsize
    return max(per_device.values(), default=0)


def _itemsize(dtype) -> int:
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key: two uint32
    return np.dtype(dtype).itemsize

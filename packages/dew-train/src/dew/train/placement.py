"""Placement on the mesh: host batches to global arrays, and the one place a
function is jitted with explicit shardings, lowered and compiled.

``Trainer`` and :func:`dew.train.plan` both compile through :func:`compile_fn`,
so the step that ``plan`` measures is the step that ``fit`` runs.
"""

from __future__ import annotations

import functools
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
    values = {}
    for name, value in local.items():
        value = np.asarray(value)
        if value.shape[:1] != (global_rows // partition.count,):
            raise ValueError(
                f"batch[{name!r}] has {value.shape[0] if value.ndim else 0} rows; this "
                f"process (partition {partition.index} of {partition.count}) must read "
                f"{global_rows // partition.count} rows of the global batch {global_rows}"
            )
        values[name] = value
    if partition.count == 1:  # this process holds the whole batch
        return _placed(values, mesh, rules)
    return {
        name: jax.make_array_from_process_local_data(
            batch_sharding(mesh, rules, value.ndim), value, (global_rows, *value.shape[1:])
        )
        for name, value in values.items()
    }


def host_rows(local: Mapping[str, Any], partition: Partition, global_rows: int) -> dict:
    """This process's rows of a global batch as numpy arrays of JAX's dtypes, for a
    compiled program on one device to take as they are: the program's call moves
    them in JAX's C++ path, one transfer with the call itself, where
    :func:`to_global` runs a program of its own first (measured on the tiny DPO
    step: 110 us less a step). Rows are checked as :func:`to_global` checks them."""
    rows = global_rows // partition.count
    values = {}
    for name, value in local.items():
        value = np.asarray(value)
        if value.shape[:1] != (rows,):
            raise ValueError(
                f"batch[{name!r}] has {value.shape[0] if value.ndim else 0} rows; this "
                f"process (partition {partition.index} of {partition.count}) must read "
                f"{rows} rows of the global batch {global_rows}"
            )
        values[name] = value.astype(_canonical(value.dtype), copy=False)
    return values


def signature(local: Mapping[str, Any]) -> tuple:
    """What a host batch's placed layout depends on, cheaply: keys, shapes, dtypes
    (:func:`layout` of the placed batch reads each sharding, ~100 us a batch)."""
    return tuple(
        (k, v.shape, v.dtype)
        if isinstance(v, np.ndarray)
        else (k, np.shape(v), getattr(v, "dtype", None))
        for k, v in local.items()
    )


def _placed(values: dict[str, np.ndarray], mesh: Mesh, rules: Rules) -> dict[str, jax.Array]:
    """Host arrays -> arrays with the batch sharding. On one device through a compiled
    identity (:func:`_placer`): a compiled call takes numpy arguments in JAX's C++ path,
    ~40 us for a batch, where ``jax.device_put`` costs ~100 us per array in Python, on
    every step of ``fit`` (measured: 90 against 400-600 us for three arrays). Over
    several devices the identity would run a program on each, slower than one batched
    ``jax.device_put`` (810 against 440 us on 8 CPU devices). The dtypes are JAX's
    (``jax.device_put``'s: int64 -> int32 without x64)."""
    if mesh.size > 1:
        shardings = [batch_sharding(mesh, rules, v.ndim) for v in values.values()]
        return dict(zip(values, jax.device_put(list(values.values()), shardings)))
    values = {k: v.astype(_canonical(v.dtype), copy=False) for k, v in values.items()}
    key = tuple(
        (k, v.shape, v.dtype.str, batch_sharding(mesh, rules, v.ndim)) for k, v in values.items()
    )
    return _placer(key)(values)


@functools.lru_cache(maxsize=64)
def _canonical(dtype) -> np.dtype:
    """JAX's dtype for host ``dtype`` (cached: a batch's arrays on every step)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


@functools.lru_cache(maxsize=64)
def _placer(key: tuple) -> Callable:
    """The compiled identity for one batch layout ``((name, shape, dtype, sharding), ...)``."""
    abstract = {k: jax.ShapeDtypeStruct(shape, np.dtype(d), sharding=s) for k, shape, d, s in key}
    shardings = {k: s for k, _, _, s in key}
    return (
        jax.jit(lambda b: b, in_shardings=(shardings,), out_shardings=shardings)
        .lower(abstract)
        .compile()
    )


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

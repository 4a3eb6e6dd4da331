"""Size a run before running it: per-device memory and step FLOPs of a model,
an optimizer and a ``MeshSpec``, from compilation alone.

:func:`plan` builds the trainer's state shardings from abstract shapes
(``jax.eval_shape``: nothing is allocated), lowers and compiles the real
training step for the mesh, and reads

- parameter / optimizer / other state bytes per device from the shardings
  (each array's shard shape on a device, summed);
- temporary bytes per device from XLA's ``memory_analysis()`` of the
  compiled step: activations kept for the backward pass, gradients and
  workspace;
- FLOPs of the step by counting the matrix products (``dot_general``,
  convolutions) of its jaxpr, forward and backward, with every loop body
  multiplied by its trip count. (XLA's own ``cost_analysis()`` counts a
  loop body once, so it undercounts a scanned layer stack.)

Devices are whatever this process has: a CPU process emulates N devices
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before JAX
starts (``tools/plan.py --devices N`` does it). Memory figures are those of
the CPU compiler for that mesh: a good guide to an accelerator's, not a
promise (fusion and layouts differ by backend).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dew.objectives import Objective
from dew.train.mesh import (
    MeshSpec,
    Rules,
    batch_sharding,
    data_parallel_size,
    mesh_sizes,
)
from dew.train.placement import compile_fn, shard_bytes
from dew.train.step import build_train_step
from dew.train.trainer import Trainer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What one training step needs, per device unless said otherwise.

    mesh: the resolved mesh axis sizes.
    parameters: parameter count of the model (whole, not per device).
    parameter_bytes: bytes of the parameters one device holds (the largest
      over devices).
    optimizer_bytes: bytes of the optimizer state one device holds.
    other_state_bytes: moving average, frozen collections, counters.
    temporary_bytes: XLA's temporary buffers for one step on one device
      (activations saved for the backward pass, gradients, workspace).
    peak_bytes: arguments + outputs - donated + temporary: what one device
      must hold at the step's peak.
    flops: floating-point operations of one step over the whole mesh
      (matrix products, forward and backward, pipeline bubbles included).
    flops_per_device: ``flops / devices``: the share of one device when the
      partitioner splits the work evenly.
    compile_seconds: wall time of lowering and compiling the step.
    """

    mesh: dict[str, int]
    parameters: int
    parameter_bytes: int
    optimizer_bytes: int
    other_state_bytes: int
    temporary_bytes: int
    peak_bytes: int
    flops: float
    flops_per_device: float
    compile_seconds: float

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def __str__(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        rows = [
            ("parameters", f"{self.parameters:,}"),
            ("parameters / device", _bytes(self.parameter_bytes)),
            ("optimizer state / device", _bytes(self.optimizer_bytes)),
            ("other state / device", _bytes(self.other_state_bytes)),
            ("activations + temporaries / device", _bytes(self.temporary_bytes)),
            ("peak / device", _bytes(self.peak_bytes)),
            ("step FLOPs (all devices)", f"{self.flops:.3e}"),
            ("step FLOPs / device", f"{self.flops_per_device:.3e}"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [
            f"plan on {self.devices} devices ({mesh}), compiled in {self.compile_seconds:.1f} s"
        ]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines)


def _bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def plan(
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    mesh: MeshSpec,
    batch: Mapping[str, jax.ShapeDtypeStruct | tuple[tuple[int, ...], Any]],
    rules: Rules | None = None,
    accumulate: int = 1,
) -> Plan:
    """Compile one training step of ``objective`` with ``optimizer`` on ``mesh``
    and report its per-device memory and FLOPs; nothing is allocated or run.

    batch: the global batch, ``{name: ShapeDtypeStruct}`` or ``{name: (shape,
      dtype)}``, e.g. ``{"text": ((256, 2049), jnp.int32)}`` for an LM with
      ``seq_len=2048``.
    rules, accumulate: as in :class:`Trainer`.
    """
    trainer = Trainer(
        objective, optimizer, key=jax.random.key(0), mesh=mesh, rules=rules, accumulate=accumulate
    )
    device_mesh = trainer.device_mesh
    batch = {
        k: v if isinstance(v, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(*v)
        for k, v in batch.items()
    }
    rows = {v.shape[0] for v in batch.values()}
    dp = data_parallel_size(device_mesh, trainer.rules)
    if len(rows) != 1 or next(iter(rows)) % (dp * accumulate):
        raise ValueError(
            f"batch rows {sorted(rows)} must be one number, a multiple of accumulate="
            f"{accumulate} x {dp} data-parallel devices (mesh {mesh_sizes(device_mesh)})"
        )
    abstract, shardings = trainer.state_shardings()
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    batch_shardings = {
        k: batch_sharding(device_mesh, trainer.rules, v.ndim) for k, v in batch.items()
    }
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_shardings[k])
        for k, v in batch.items()
    }
    step_fn = build_train_step(
        objective, optimizer, accumulate_steps=accumulate, one_device=device_mesh.size == 1
    )
    replicated = NamedSharding(device_mesh, PartitionSpec())

    start = time.perf_counter()
    with jax.set_mesh(device_mesh), nn.logical_axis_rules(list(trainer.rules)):
        flops = count_flops(jax.make_jaxpr(step_fn)(state, batch).jaxpr)
        compiled = compile_fn(
            step_fn,
            (state, batch),
            in_shardings=(shardings, batch_shardings),
            out_shardings=(shardings, replicated),
            donate_argnums=(0,),
        )
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    devices = device_mesh.devices.size
    return Plan(
        mesh=mesh_sizes(device_mesh),
        parameters=sum(math.prod(a.shape) for a in jax.tree.leaves(abstract.params)),
        parameter_bytes=shard_bytes(abstract.params, shardings.params),
        optimizer_bytes=shard_bytes(abstract.opt_state, shardings.opt_state),
        other_state_bytes=shard_bytes(
            (abstract.averaged, abstract.frozen, abstract.key, abstract.step),
            (shardings.averaged, shardings.frozen, shardings.key, shardings.step),
        ),
        temporary_bytes=int(memory.temp_size_in_bytes),
        peak_bytes=int(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        ),
        flops=flops,
        flops_per_device=flops / devices,
        compile_seconds=seconds,
    )


def count_flops(jaxpr) -> float:
    """FLOPs of the matrix products in ``jaxpr`` (2 per multiply-add), loop
    bodies times their trip counts; elementwise work is not counted.

    ``scan`` bodies count ``length`` times, ``cond`` its costliest branch, a
    ``while`` loop's body once (its trip count is not static).
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = math.prod(eqn.outvars[0].aval.shape)
            total += 2.0 * out * math.prod(lhs[d] for d in contract)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape  # the kernel: out, in / groups, *window
            numbers = eqn.params["dimension_numbers"]
            kernel = math.prod(rhs[d] for d in numbers.rhs_spec[1:])  # in / groups x window
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * kernel
        elif name == "scan":
            total += eqn.params["length"] * count_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(count_flops(b.jaxpr) for b in eqn.params["branches"])
        else:
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        total += count_flops(inner)
    return total

"""Size a run before running it: per-device memory and step FLOPs of a model,
an optimizer and a ``MeshSpec``, from compilation alone.

:func:`plan` builds the state shardings from abstract shapes (nothing is allocated) and compiles
the update step through :class:`dew.train.Programs`, the object ``Trainer.fit``
compiles with: the same program (for GRPO and PPO, the update over the
prepared minibatch, after an abstract prepare phase), and reads

- parameter / optimizer / other state bytes per device from the shardings
  (each array's shard shape on a device, summed);
- temporary bytes per device from XLA's ``memory_analysis()`` of the
  compiled step: activations kept for the backward pass, gradients and
  workspace;
- FLOPs of the step by counting the matrix products (``dot_general``) of
  its jaxpr, forward and backward, with every loop body multiplied by its
  trip count (:func:`dew.train.throughput.program_flops`: what the chip
  computes, recomputation included). (XLA's own ``cost_analysis()`` counts a
  loop body once, so it undercounts a scanned layer stack.)
- the step's model FLOPs as MaxText counts them (:mod:`dew.train.model_flops`:
  causal attention halved, recomputation not counted): the number the log's
  MFU divides;
- whether the step fits one device: ``peak_bytes`` against the device's
  memory (:func:`dew.train.memory.device_memory_bytes`, or a size given).

:func:`recommend` compiles candidates over remat policy x microbatches
(``accumulate``) and returns the fastest that fits.

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

import jax
import optax

from dew.nn.backbones import layer_stack_of
from dew.nn.pipeline import bubble_fraction
from dew.objectives import Objective
from dew.train._prepare_phase import abstract_prepared
from dew.train._programs import Programs
from dew.train.memory import peak_bytes  # noqa: F401  (re-exported: dew.train.plan.peak_bytes)
from dew.train.mesh import DEFAULT_RULES, MeshSpec, Rules, data_parallel_size, mesh_sizes
from dew.train.placement import abstract_batch, shard_bytes
from dew.train.throughput import device_peak
from dew.train.trainer import as_optax


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
    pipeline_bubble: the fraction of the step each pipeline stage is idle,
      ``(stages - 1) / (microbatches * repeats + stages - 1)``
      (:func:`dew.nn.pipeline.bubble_fraction`), for the most pipelined model
      of the objective; None without a pipeline.
    pipeline_schedule: how that pipeline runs, e.g. ``'2 stages, 4
      microbatches, GPipe'`` or ``'..., circular x 2'``; empty without one.
    model_flops: the step's model FLOPs (all devices) as MaxText counts them
      (:class:`dew.train.model_flops.ModelFlops`: 3 x forward, causal attention
      halved, recomputation not counted); None when they could not be counted.
    device_memory_bytes: bytes one device may hold; None when unknown (a CPU with
      no size given).
    device_kind: the devices' kind (``'TPU v5 lite'``, ``'cpu'``).
    peak_flops: the devices' bf16 peak FLOP/s together
      (:func:`dew.train.throughput.device_peak`); None on a CPU (``fit``'s log
      measures one) or for a kind the table does not know (``peak_source`` says
      how to pass it).
    peak_source: where ``peak_flops`` comes from, or why there is none.
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
    pipeline_bubble: float | None = None
    pipeline_schedule: str = ""
    model_flops: float | None = None
    device_memory_bytes: int | None = None
    device_kind: str = ""
    peak_flops: float | None = None
    peak_source: str = ""

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def fits(self) -> bool | None:
        """``peak_bytes <= device_memory_bytes``; None when the device's memory is unknown."""
        if self.device_memory_bytes is None:
            return None
        return self.peak_bytes <= self.device_memory_bytes

    def mfu(self, step_seconds: float) -> float | None:
        """MFU of a step that takes ``step_seconds`` (None: no peak known)."""
        if self.peak_flops is None:
            return None
        flops = self.flops if self.model_flops is None else self.model_flops
        return flops / step_seconds / self.peak_flops

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
        if self.model_flops is not None:
            rows.append(("model FLOPs (MFU; MaxText count)", f"{self.model_flops:.3e}"))
        if self.peak_flops is not None:
            flops = self.flops if self.model_flops is None else self.model_flops
            seconds = flops / self.peak_flops
            rows.append(("peak", f"{self.peak_flops / 1e12:g} TFLOP/s ({self.peak_source})"))
            rows.append(("step time at 50% MFU", f"{2 * seconds * 1e3:.2f} ms"))
        elif self.peak_source:
            rows.append(("peak", self.peak_source))
        if self.device_memory_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            rows.append(("device memory", f"{_bytes(self.device_memory_bytes)}: {verdict}"))
        if self.pipeline_bubble is not None:
            bubble = f"{self.pipeline_bubble:.1%} idle ({self.pipeline_schedule})"
            rows.append(("pipeline bubble", bubble))
        width = max(len(name) for name, _ in rows)
        lines = [
            f"plan on {self.devices} devices ({mesh}), compiled in {self.compile_seconds:.1f} s"
        ]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines)


def pipeline_of(objective: Objective) -> tuple[float | None, str]:
    """``(bubble fraction, schedule)`` of the objective's most pipelined model
    (the largest bubble), ``(None, '')`` when none is pipelined."""
    found = []
    for role in objective.roles():
        stack = layer_stack_of(role.module)
        if stack is None or stack.num_stages <= 1:
            continue
        s, m, r = stack.num_stages, stack.microbatches, stack.num_repeats
        schedule = "GPipe" if r == 1 else f"circular x {r}"
        found.append((bubble_fraction(s, m, r), f"{s} stages, {m} microbatches, {schedule}"))
    return max(found) if found else (None, "")


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
    device_memory_bytes: int | str | None = None,
    update_norm: bool = False,
) -> Plan:
    """Compile one training step of ``objective`` with ``optimizer`` on ``mesh``
    and report its per-device memory and FLOPs; nothing is allocated or run.

    batch: the global batch, ``{name: ShapeDtypeStruct}`` or ``{name: (shape,
      dtype)}``, e.g. ``{"text": ((256, 2049), jnp.int32)}`` for an LM with
      ``seq_len=2048``.
    rules, accumulate, device_memory_bytes, update_norm: as in :class:`Trainer`
      (``device_memory_bytes``: what :attr:`Plan.fits` compares with; None = the
      device's own memory).

    A step that XLA refuses to compile for want of memory (on a TPU) raises
    :class:`dew.train.StepDoesNotFit`.
    """
    programs = Programs(
        objective=objective,
        optimizer=as_optax(optimizer),
        mesh=mesh,
        rules=DEFAULT_RULES if rules is None else rules,
        accumulate=accumulate,
        device_memory_bytes=device_memory_bytes,
        check_memory=False,
        update_norm=update_norm,
    )
    device_mesh = programs.device_mesh
    batch = {
        k: v if isinstance(v, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(*v)
        for k, v in batch.items()
    }
    rows = {v.shape[0] for v in batch.values()}
    # with a prepare phase, accumulate splits the prepared minibatch (checked when
    # the prepare program is traced), not the data batch
    divisor = 1 if objective.has_prepare else accumulate
    dp = data_parallel_size(device_mesh, programs.rules)
    if len(rows) != 1 or next(iter(rows)) % (dp * divisor):
        raise ValueError(
            f"batch rows {sorted(rows)} must be one number, a multiple of accumulate="
            f"{divisor} x {dp} data-parallel devices (mesh {mesh_sizes(device_mesh)})"
        )
    # only traced: the initialisation's shapes, never its values
    abstract, shardings = programs.state_shardings(None, key=jax.eval_shape(_any_key))
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    batch = abstract_batch(batch, device_mesh, programs.rules)

    start = time.perf_counter()
    with programs.context():
        # the batch the update step reads: fit's prepared batch for GRPO / PPO
        prepared = abstract_prepared(programs, state, batch, shardings)
        compiled = programs.update(state, prepared, shardings)
    seconds = time.perf_counter() - start
    memory = compiled.program.memory_analysis()  # peak_bytes: read at compile
    devices = device_mesh.devices.size
    bubble, schedule = pipeline_of(objective)
    kind, peak, source = _peak(device_mesh.devices.flat)
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
        peak_bytes=compiled.peak_bytes,
        flops=compiled.flops,
        flops_per_device=compiled.flops / devices,
        compile_seconds=seconds,
        pipeline_bubble=bubble,
        pipeline_schedule=schedule,
        model_flops=None if compiled.model_flops is None else compiled.model_flops.flops,
        device_memory_bytes=programs.memory_limit,
        device_kind=kind,
        peak_flops=peak,
        peak_source=source,
    )


def _peak(devices) -> tuple[str, float | None, str]:
    """``(device kind, peak FLOP/s of them all or None, its source)``; a CPU's is
    not probed here (``fit``'s log measures it)."""
    devices = list(devices)
    kind = getattr(devices[0], "device_kind", "") or devices[0].platform
    if devices[0].platform == "cpu":
        return kind, None, ""
    peak, source = device_peak(devices)
    return kind, (peak if peak > 0 else None), source


def _any_key() -> jax.Array:
    return jax.random.key(0)

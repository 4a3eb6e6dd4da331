"""``Programs``: what a run compiles, owned in one frozen object.

Built from the objective, the optimizer, the mesh, the rules table and the
accumulation, it owns the device mesh, the state's shardings, the compiled
initialisation and the compiled prepare / finish / update / evaluate
programs, each in a typed cache keyed by the batch layout with its FLOPs.
``Trainer.fit`` runs these programs and :func:`dew.train.plan` compiles
them, so ``plan`` measures the very step ``fit`` runs (for an objective with
a prepare phase: the update over the prepared minibatch, with its metrics
packed, not the loss over the raw data batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Partition
from dew.objectives import Objective, Role, Step
from dew.objectives import check_roles as _check_roles
from dew.objectives.contract import weighted as wt
from dew.train._compiled import Compiled
from dew.train._prepare_phase import prepared
from dew.train._roles import (
    averaged_roles,
    check_params_by_role,
    evaluates_averaged,
    initial_variables,
    keeps_average,
)
from dew.train.adapters import split_lora
from dew.train.goodput import Goodput
from dew.train.memory import (
    ADVICE,
    StepDoesNotFit,
    check_fits,
    device_memory_bytes,
    is_out_of_memory,
    peak_bytes,
)
from dew.train.mesh import (
    MeshSpec,
    Rules,
    check_divisible,
    data_parallel_size,
    logical_shardings,
    mesh_sizes,
    optimizer_specs,
    unbox_abstract,
)
from dew.train.model_flops import step_model_flops
from dew.train.packing import packed_step
from dew.train.placement import (
    compile_with_flops,
    layout,
    replicated,
    to_global,
)
from dew.train.state import TrainState
from dew.train.step import (
    LOGGED_SPEC,
    Stream,
    build_train_step,
    microbatch_key,
    minibatch_fn,
    orders_selects,
    with_minibatch,
)

INIT_CPU_OPTIONS = {"xla_backend_optimization_level": 1}
"""XLA:CPU options for the compiled initialisation: LLVM at O1 instead of O2 compiles
the random initialisers' kernels 1.3-2.8 s faster at the seed and medium LM sizes (jax
0.10.2 and 0.12.0.1; docs/performance.md), with the same values bit for bit
(dew-train's tests/test_startup.py); the program runs once, so its own speed does not
matter. O0 compiles faster still but changes the values' last bits."""


@dataclasses.dataclass
class ProgramCache:
    """What :class:`Programs` compiled, by data spec or batch layout."""

    # spec token -> (abstract state, its NamedSharding tree)
    shardings: dict[Any, tuple[TrainState, TrainState]] = dataclasses.field(default_factory=dict)
    # spec token -> (the init jaxpr, its output treedef): traced once, replayed compiled
    init_jaxprs: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    init: dict[Any, Callable] = dataclasses.field(default_factory=dict)
    # (part, layout) -> the prepare phase's compiled parts ("prepare", "finish")
    prepare: dict[tuple, Compiled] = dataclasses.field(default_factory=dict)
    # layout -> the compiled update step
    update: dict[tuple, Compiled] = dataclasses.field(default_factory=dict)
    evaluate: Callable | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Programs:
    """The device mesh, the state shardings, initialisation and the compiled
    programs of one objective / optimizer / mesh / rules / accumulation.

    learning_rate: the schedule the log reads the rate from (as in ``Trainer``);
      it is part of the compiled update step.
    device_memory_bytes: bytes one device may hold (as in ``Trainer``); None = the
      device's own limit (:func:`dew.train.memory.device_memory_bytes`).
    check_memory: refuse an update step that needs more than that, when it is
      compiled (:class:`dew.train.memory.StepDoesNotFit`); ``plan`` reports instead.
    update_norm: the update step logs ``update_norm`` (as in ``Trainer``).
    """

    objective: Objective
    optimizer: optax.GradientTransformation
    mesh: MeshSpec
    rules: Rules
    accumulate: int = 1
    learning_rate: Callable | float | None = None
    device_memory_bytes: int | str | None = None
    check_memory: bool = True
    update_norm: bool = False
    cache: ProgramCache = dataclasses.field(default_factory=ProgramCache, repr=False)

    def __post_init__(self):
        # An objective that sizes its own microbatches (FlowGRPOObjective(device_rows=))
        # derives the accumulation from the data-parallel devices.
        derived = self.objective.accumulate_for(data_parallel_size(self.device_mesh, self.rules))
        if derived:
            if self.accumulate not in (1, derived):
                raise ValueError(
                    f"{type(self.objective).__name__} derives accumulate={derived} on this "
                    f"mesh ({mesh_sizes(self.device_mesh)}); leave the trainer's accumulate "
                    f"at 1, not {self.accumulate}"
                )
            object.__setattr__(self, "accumulate", derived)

    # ----------------------------------------------------------------- mesh
    @functools.cached_property
    def device_mesh(self) -> jax.sharding.Mesh:
        return self.mesh.make()

    @functools.cached_property
    def memory_limit(self) -> int | None:
        """Bytes one device of the mesh may hold; None when unknown (a CPU)."""
        return device_memory_bytes(self.device_mesh.devices.flat, self.device_memory_bytes)

    @functools.cached_property
    def roles(self) -> tuple[Role, ...]:
        return check_roles(self.objective)

    @property
    def per_batch(self) -> int:
        """Steps (updates) one data batch feeds: ``prepared_updates.per_batch``
        with a prepare phase, else 1."""
        objective = self.objective
        return objective.prepared_updates.per_batch if objective.has_prepare else 1

    def context(self) -> contextlib.ExitStack:
        """The mesh and the logical-axis rules, entered for tracing and running.

        On a mesh of one device the rules stay out, so the model's activation
        constraints (``nn.with_logical_constraint``) are no-ops, as in a plain
        loop: nothing can be split, and a constraint inside a scanned layer is a
        value of its own that the backward pass keeps (measured on a TPU v5e,
        docs/performance.md: one more ``[layers, tokens, mlp]`` residual and its
        copies, 144.8 against 130 ms a step)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.device_mesh))
        if self.device_mesh.size > 1:
            stack.enter_context(nn.logical_axis_rules(list(self.rules)))
        return stack

    # ---------------------------------------------------------------- state
    def create(self, key: jax.Array, spec=None) -> TrainState:
        """The initial state, parameters still in their logical-axis boxes."""
        k_init, k_run = jax.random.split(key)
        # ``Objective.initialize``: ``init(key, spec=)`` or the seed's ``init(key)``,
        # as the objective declares (``init_reads_spec``)
        variables = dict(self.objective.initialize(k_init, spec))
        if "params" not in variables:
            raise ValueError(
                f"{type(self.objective).__name__}.init returned {sorted(variables)}; it must "
                f"return a dict with 'params' (the trained weights)"
            )
        check_params_by_role(self.objective, self.roles, variables["params"])
        # the declared relations: initial_from roles filled, averaged ones left out
        variables = initial_variables(self.objective, self.roles, variables)
        # Under LoRA only the adapters train; the base moves to frozen (dew.train.adapters).
        params, variables, views = split_lora(self.roles, variables.pop("params"), variables)
        return TrainState(
            params_by_role=params,
            opt_state=self.optimizer.init(params),
            key=k_run,
            step=jnp.zeros((), jnp.int32),
            microstep=jnp.zeros((), jnp.int32),
            updates=jnp.zeros((), jnp.int32),
            averaged_by_role=params if keeps_average(self.objective, self.roles) else None,
            frozen=variables,
            lora_views=views,
            averaged_roles=averaged_roles(self.roles),
            evaluate_averaged=evaluates_averaged(self.objective, self.roles),
        )

    def state_shardings(self, spec=None, *, key: jax.Array) -> tuple[TrainState, TrainState]:
        """``(abstract state, NamedSharding tree)`` without allocating anything."""
        token = spec_token(spec)
        if token in self.cache.shardings:
            return self.cache.shardings[token]
        with self.context():
            # one trace of the model's init serves the shapes here and the
            # compiled initialisation (init_state replays this jaxpr)
            closed, boxed = jax.make_jaxpr(lambda k: self.create(k, spec), return_shape=True)(key)
            self.cache.init_jaxprs[token] = (closed, jax.tree.structure(boxed))
            specs = nn.get_partition_spec(boxed)
            # Optimizer arrays shaped unlike their parameter (Adafactor's factored
            # moments) get a spec that fits their own shape.
            specs = specs.replace(
                opt_state=optimizer_specs(
                    boxed.opt_state, boxed.params_by_role, self.device_mesh, self.rules
                )
            )
            abstract = unbox_abstract(boxed)
            check_divisible(abstract, specs, self.device_mesh, self.rules)
            shardings = logical_shardings(specs, self.device_mesh, self.rules)
        self.cache.shardings[token] = (abstract, shardings)
        return abstract, shardings

    def init_state(self, key: jax.Array, spec=None) -> TrainState:
        """The state already sharded (initialisation compiled with output shardings)."""
        _, shardings = self.state_shardings(spec, key=key)
        token = spec_token(spec)
        if token not in self.cache.init:
            # unbox_abstract, not nn.unbox: nn.unbox re-applies each parameter's spec to
            # optimizer arrays of other shapes (Adafactor's factored moments);
            # out_shardings already places every array
            closed, treedef = self.cache.init_jaxprs[token]

            def create(key):
                leaves = jax.extend.core.jaxpr_as_fun(closed)(key)
                return unbox_abstract(jax.tree.unflatten(treedef, leaves))

            options = (
                INIT_CPU_OPTIONS if self.device_mesh.devices.flat[0].platform == "cpu" else None
            )
            self.cache.init[token] = jax.jit(
                create, out_shardings=shardings, compiler_options=options
            )
        with self.context():
            return self.cache.init[token](key)

    # -------------------------------------------------------------- prepare
    def prepare(self, state, batch, shardings, goodput: Goodput):
        """``batch`` after the objective's prepare phase (``batch`` itself without one):
        :func:`dew.train._prepare_phase.prepared`."""
        return prepared(self, state, batch, shardings, goodput)

    # --------------------------------------------------------------- update
    def update(self, state, batch, shardings) -> Compiled:
        """The update step compiled for ``batch``'s layout (arrays, or
        ``ShapeDtypeStruct`` with shardings): ``(state, batch, is_logged) ->
        (state, packed metrics)``; a later ``fit`` with the same layout reuses it."""
        key = layout(batch)
        compiled = self.cache.update.get(key)
        if compiled is None:
            step_fn, packing = packed_step(self.step_fn(shardings))
            try:
                program, flops = compile_with_flops(
                    step_fn,
                    (state, batch, LOGGED_SPEC),
                    in_shardings=(
                        shardings,
                        jax.tree.map(lambda x: x.sharding, batch),
                        replicated(self.device_mesh),
                    ),
                    out_shardings=(shardings, replicated(self.device_mesh)),
                    donate_argnums=(0,),
                )
            except Exception as error:  # XLA on a TPU refuses at compile time
                if is_out_of_memory(error):
                    limit = self.memory_limit
                    available = "" if limit is None else f" ({limit:,} bytes available)"
                    raise StepDoesNotFit(
                        f"the training step does not fit one device{available}; XLA said "
                        f"when compiling it: {str(error)[:400]}. {ADVICE}"
                    ) from error
                raise
            peak = peak_bytes(program.memory_analysis())
            if self.check_memory:
                check_fits(peak, self.memory_limit)
            try:
                model = step_model_flops(self.objective, state, batch, accumulate=self.accumulate)
            except Exception:  # a loss the counter cannot trace apart: the MFU divides flops
                model = None
            compiled = self.cache.update[key] = Compiled(program, flops, packing, peak, model)
        return compiled

    def step_fn(self, shardings: TrainState | None = None) -> Callable:
        """``(state, batch, is_logged) -> (state, metrics)``: the update step
        before its metrics are packed (a prepared batch's minibatch selected first).

        shardings: the state's; when every trained leaf is whole on each device (one
        device, or data parallelism alone) the non-finite guard's selects are ordered
        on the CPU (:func:`dew.train.step.orders_selects`)."""
        one_device = self.device_mesh.size == 1
        platform = self.device_mesh.devices.flat[0].platform
        whole = shardings is not None and all(
            s.is_fully_replicated
            for s in jax.tree.leaves(
                (shardings.params_by_role, shardings.opt_state, shardings.averaged_by_role)
            )
        )
        step_fn = build_train_step(
            self.objective,
            self.optimizer,
            accumulate_steps=self.accumulate,
            learning_rate=self.learning_rate,
            one_device=one_device,
            ordered_selects=orders_selects(platform, whole=one_device or whole),
            update_norm=self.update_norm,
        )
        if self.objective.has_prepare:
            step_fn = with_minibatch(minibatch_fn(self.objective.prepared_updates), step_fn)
        return step_fn

    # ------------------------------------------------------------- evaluate
    def evaluate(
        self, state: TrainState, val, partition: Partition, max_batches: int, *, averaged=None
    ) -> dict:
        """One pass of ``objective.evaluate`` over ``val(partition)``: the reduced
        metrics after ``objective.summarize`` ({} without evaluation). Reads the
        weights ``state.variables(averaged=averaged)`` gives (None: the moving average
        when the objective evaluates with it; False: the live weights)."""
        objective = self.objective
        if val is None or not objective.has_evaluate:
            return {}
        if self.cache.evaluate is None:

            def evaluate(variables, batch, root, step, first_row):
                key = microbatch_key(root, step, Stream.EVALUATE)
                # each row's index in the evaluation set: per-row draws (MDLM's bound)
                # follow it, whatever the batch size and the device count
                index = first_row + jnp.arange(_rows(batch), dtype=jnp.int32)
                metrics = objective.evaluate(
                    variables, batch, Step(index=step, key=key, rows=index)
                )
                rows = batch["example_mask"].sum() if "example_mask" in batch else _rows(batch)
                return wt.as_metrics(metrics, rows)

            self.cache.evaluate = jax.jit(evaluate)
        variables = state.variables(averaged=averaged)
        totals, first_row = None, 0
        for i, local in enumerate(val(partition)):
            if max_batches and i >= max_batches:
                break
            rows = np.asarray(next(iter(local.values()))).shape[0] * partition.count
            batch = to_global(local, partition, rows, self.device_mesh, self.rules)
            sums = jax.device_get(
                self.cache.evaluate(variables, batch, state.key, state.step, np.int32(first_row))
            )
            first_row += rows
            totals = sums if totals is None else wt.add(totals, sums)
        if totals is None:
            return {}
        return objective.summarize(wt.to_float(totals))


def check_roles(objective: Objective) -> tuple[Role, ...]:
    """``objective.roles()`` checked, relations included (:func:`dew.objectives.check_roles`)."""
    return _check_roles(objective)


def spec_token(spec) -> Any:
    if not spec:
        return None
    return tuple(sorted((k, tuple(f.shape), str(f.dtype)) for k, f in spec.items()))


def _rows(batch) -> int:
    leaves = jax.tree.leaves(batch)
    return leaves[0].shape[0] if leaves else 1

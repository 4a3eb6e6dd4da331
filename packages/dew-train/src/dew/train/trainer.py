"""``Trainer``: the mesh, the compiled step, the loop, evaluation, logging, goodput."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Dataset, Partition
from dew.objectives import Objective, Step
from dew.train.checkpoints import Checkpoints, resume_position
from dew.train.goodput import Goodput
from dew.train.logs import MetricsLog, format_value
from dew.train.mesh import (
    DEFAULT_RULES,
    MeshSpec,
    Rules,
    batch_sharding,
    check_divisible,
    data_parallel_size,
    logical_shardings,
    mesh_sizes,
    unbox_abstract,
)
from dew.train.preemption import StopSignals
from dew.train.state import TrainState
from dew.train.step import build_train_step, microbatch_key


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class Trainer:
    """Trains ``objective`` with ``optimizer``; configure it, do not subclass it.

    objective: an :class:`dew.objectives.Objective`.
    optimizer: an ``optax.GradientTransformation``.
    key: the run's root PRNG key; every draw is a function of it and the step.
    mesh: axis sizes; the default puts every device on ``data``.
    rules: logical-axis -> mesh-axis table; None = ``DEFAULT_RULES``.
    accumulate: split each global batch into this many microbatches and
      apply one update with their mean gradient.
    max_rejected: stop with an error after more than this many consecutive
      steps with a non-finite loss or gradient.
    run_dir: where ``metrics.jsonl`` and TensorBoard events go; None = the
      checkpoint directory when there is one, else stdout only.
    checkpoints: a :class:`dew.train.Checkpoints`, or None.
    progress: show a progress bar; None = only on a TTY.
    """

    objective: Objective
    optimizer: optax.GradientTransformation
    key: jax.Array = dataclasses.field(kw_only=True)
    mesh: MeshSpec = dataclasses.field(default_factory=MeshSpec, kw_only=True)
    rules: Rules | None = dataclasses.field(default=None, kw_only=True)
    accumulate: int = dataclasses.field(default=1, kw_only=True)
    max_rejected: int = dataclasses.field(default=10, kw_only=True)
    run_dir: str | None = dataclasses.field(default=None, kw_only=True)
    checkpoints: Checkpoints | None = dataclasses.field(default=None, kw_only=True)
    progress: bool | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.objective, Objective):
            raise TypeError(
                f"objective must be a dew.objectives.Objective, got {type(self.objective).__name__}"
            )
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 microbatches, got {self.accumulate}")
        if self.checkpoints is not None and not isinstance(self.checkpoints, Checkpoints):
            raise TypeError(
                f"checkpoints must be a dew.train.Checkpoints (e.g. "
                f"Checkpoints('runs/x')), got {type(self.checkpoints).__name__}"
            )
        if self.max_rejected < 0:
            raise ValueError(f"max_rejected must be >= 0, got {self.max_rejected}")
        if self.rules is None:
            self.rules = DEFAULT_RULES
        self._mesh = None

    # ----------------------------------------------------------------- setup
    @property
    def device_mesh(self) -> jax.sharding.Mesh:
        if self._mesh is None:
            self._mesh = self.mesh.make()
        return self._mesh

    def _context(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.device_mesh))
        stack.enter_context(nn.logical_axis_rules(list(self.rules)))
        return stack

    def _create(self, key: jax.Array) -> TrainState:
        """The initial state, parameters still in their logical-axis boxes."""
        k_init, k_run = jax.random.split(key)
        variables = dict(self.objective.init(k_init))
        params = variables.pop("params")
        return TrainState(
            params=params,
            opt_state=self.optimizer.init(params),
            key=k_run,
            step=jnp.zeros((), jnp.int32),
            microstep=jnp.zeros((), jnp.int32),
            updates=jnp.zeros((), jnp.int32),
            averaged=params if self.objective.ema is not None else None,
            frozen=variables,
        )

    def state_shardings(self):
        """``(abstract state, NamedSharding tree)`` without allocating anything."""
        if getattr(self, "_shardings", None) is None:
            self._shardings = self._state_shardings()
        return self._shardings

    def _state_shardings(self):
        with self._context():
            boxed = jax.eval_shape(self._create, self.key)
            specs = nn.get_partition_spec(boxed)
            abstract = unbox_abstract(boxed)
            check_divisible(abstract, specs, self.device_mesh, self.rules)
            return abstract, logical_shardings(specs, self.device_mesh, self.rules)

    def init_state(self) -> TrainState:
        """Create the state already sharded (initialisation compiled with output shardings)."""
        _, shardings = self.state_shardings()
        if getattr(self, "_init_fn", None) is None:
            self._init_fn = jax.jit(lambda k: nn.unbox(self._create(k)), out_shardings=shardings)
        with self._context():
            return self._init_fn(self.key)

    def _check_batch_rows(self, data: Dataset, partition: Partition) -> None:
        dp = data_parallel_size(self.device_mesh, self.rules)
        if data.batch % dp:
            raise ValueError(
                f"global batch {data.batch} does not divide over {dp} data-parallel devices "
                f"(mesh {mesh_sizes(self.device_mesh)}); use a multiple of {dp} or fewer "
                f"devices on data/fsdp/expert"
            )
        if data.batch % (self.accumulate * dp):
            raise ValueError(
                f"global batch {data.batch} does not split into accumulate={self.accumulate} "
                f"microbatches of a multiple of {dp} data-parallel devices; use a batch that "
                f"is a multiple of {self.accumulate * dp}"
            )
        partition.rows(data.batch)

    def _to_global(self, local: Mapping[str, Any], partition: Partition, global_rows: int):
        out = {}
        for name, value in local.items():
            value = np.asarray(value)
            if value.shape[:1] != (global_rows // partition.count,):
                raise ValueError(
                    f"batch[{name!r}] has {value.shape[0] if value.ndim else 0} rows; this "
                    f"process (partition {partition.index} of {partition.count}) must read "
                    f"{global_rows // partition.count} rows of the global batch {global_rows}"
                )
            sharding = batch_sharding(self.device_mesh, self.rules, value.ndim)
            if partition.count == 1:  # this process holds the whole batch
                out[name] = jax.device_put(value, sharding)
            else:
                out[name] = jax.make_array_from_process_local_data(
                    sharding, value, (global_rows, *value.shape[1:])
                )
        return out

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        data: Dataset,
        *,
        steps: int,
        log_every: int = 100,
        eval_every: int = 0,
        checkpoint_every: int = 0,
        eval_batches: int = 0,
    ) -> TrainState:
        """Train until the step counter reaches ``steps``; returns the final state.

        log_every: print and record metrics every this many steps (0 = never).
        eval_every: run ``objective.evaluate`` over ``data.val`` (and a preview)
          every this many steps (0 = never).
        checkpoint_every: save a checkpoint every this many steps; 0 = only at
          the end. Needs ``checkpoints=``, which always saves at the end.
        eval_batches: stop each evaluation after this many batches (0 = all).

        With ``checkpoints=``, a directory that holds a checkpoint continues
        from the newest usable one (see :mod:`dew.train.checkpoints`). SIGTERM
        or SIGINT finish the step in flight, write a checkpoint and return
        the state early (see :mod:`dew.train.preemption`).
        """
        for name, value in (
            ("steps", steps),
            ("log_every", log_every),
            ("eval_every", eval_every),
            ("eval_batches", eval_batches),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be >= 1 steps (or 0 = only at the end), "
                f"got {checkpoint_every}"
            )
        if checkpoint_every > 0 and self.checkpoints is None:
            raise ValueError(
                f"checkpoint_every={checkpoint_every} needs somewhere to write: pass "
                f"Trainer(..., checkpoints=Checkpoints(directory)), or leave "
                f"checkpoint_every=0"
            )
        goodput = Goodput()
        partition = Partition(jax.process_index(), jax.process_count())
        self._check_batch_rows(data, partition)
        run_dir = self.run_dir
        if run_dir is None and self.checkpoints is not None:
            run_dir = self.checkpoints.directory
        session = None
        if self.checkpoints is not None:  # checks the directory can be written
            session = self.checkpoints.open(print_fn=lambda line: log.print(line))
        log = MetricsLog(
            run_dir,
            is_main=jax.process_index() == 0,
            progress=self.progress,
            total_steps=steps,
            examples_per_step=data.batch,
        )
        try:
            return self._fit(
                data,
                partition,
                goodput,
                log,
                session,
                steps=steps,
                log_every=log_every,
                eval_every=eval_every,
                checkpoint_every=checkpoint_every,
                eval_batches=eval_batches,
            )
        finally:
            if session is not None:
                session.close()
            log.close()

    def _fit(
        self,
        data,
        partition,
        goodput,
        log,
        session,
        *,
        steps,
        log_every,
        eval_every,
        checkpoint_every,
        eval_batches,
    ) -> TrainState:
        mesh = self.device_mesh
        abstract, shardings = self.state_shardings()
        restored = None
        if session is not None:
            with goodput.measure("checkpoint"), self._context():
                restored = session.restore(abstract, shardings, root_key=self.key)
        if restored is None:
            with goodput.measure("init"):
                state = self.init_state()
        else:
            state = restored.state
        start = int(jax.device_get(state.step))
        log.start(start)
        resuming = f"Resuming from step {start} ({restored.path}). " if restored else ""
        log.print(
            f"{resuming}Training from step {start} to {steps} on {mesh_sizes(mesh)} "
            f"({jax.process_count()} process(es))"
        )
        with goodput.measure("data"):
            train_iter: Iterator = resume_position(
                iter(data.train(partition)), restored, print_fn=log.print
            )
        meta = self._checkpoint_meta() if session is not None else {}
        saved_at = restored.step if restored else None

        compiled = None
        pending: list[tuple[int, Any]] = []  # (step, metrics on device) since the last fetch
        rejected_run: list[int] = []
        step = start
        with self._context(), StopSignals() as stop:
            while step < steps:
                with goodput.measure("data"):
                    local = next(train_iter)
                    self.objective.check_batch(local)
                    batch = self._to_global(local, partition, data.batch)
                if compiled is None:
                    with goodput.measure("compile"):
                        compiled = self._compiled_step(state, batch, shardings)
                with goodput.measure("steps"):
                    state, metrics = compiled(state, batch)
                    step += 1
                    if goodput.first_step_at is None:
                        jax.block_until_ready(metrics)
                        goodput.first_step_done()
                log.advance(step)
                stopping = stop.requested(step)
                pending.append((step, metrics))
                is_log = log_every and step % log_every == 0
                if is_log or len(pending) >= max(self.max_rejected, 1) or step == steps or stopping:
                    # Between log steps only two scalars a step leave the device (was
                    # it applied, and its loss for the rejection message), every
                    # max_rejected steps, so a run of rejections stops in time.
                    with goodput.measure("steps"):
                        flags = jax.device_get(
                            [{"accepted": m["accepted"], "loss": m["loss"]} for _, m in pending]
                        )
                        last = jax.device_get(pending[-1][1]) if is_log else None
                    with goodput.measure("logging"):
                        self._account(pending, flags, rejected_run, log)
                        if is_log:
                            values = {k: float(v) for k, v in last.items()}
                            log.log(
                                step,
                                values,
                                line=f"step {step}: loss {format_value(values['loss'])}",
                            )
                    pending = []
                if eval_every and step % eval_every == 0:
                    with goodput.measure("eval"):
                        self._evaluate(state, data, partition, step, log, eval_batches)
                if session is not None and checkpoint_every and step % checkpoint_every == 0:
                    with goodput.measure("checkpoint"):
                        session.save(step, state, train_iter, meta)
                        saved_at = step
                if stopping:
                    break
            if session is not None:
                with goodput.measure("checkpoint"):
                    if saved_at != step:
                        session.save(step, state, train_iter, meta)
                    session.wait()
        with goodput.measure("steps"):
            jax.block_until_ready(state)
        if stop.received is not None:
            where = (
                f"checkpoint written to {session.path(step)}"
                if session is not None
                else "no checkpoint written (no checkpoints= given)"
            )
            log.print(f"Stopped by {stop.received} at step {step}; {where}")
        report = goodput.report()
        log.print(goodput.line(report))
        log.log(step, report, kind="goodput")
        return state

    def _compiled_step(self, state, batch, shardings):
        """The step compiled for this batch layout; a later ``fit`` with the
        same layout reuses it."""
        signature = tuple((name, x.shape, x.dtype, x.sharding) for name, x in sorted(batch.items()))
        cache = self.__dict__.setdefault("_compiled", {})
        if signature not in cache:
            step_fn = build_train_step(
                self.objective, self.optimizer, accumulate_steps=self.accumulate
            )
            batch_shardings = jax.tree.map(lambda x: x.sharding, batch)
            replicated = jax.sharding.NamedSharding(self.device_mesh, jax.P())
            cache[signature] = (
                jax.jit(
                    step_fn,
                    in_shardings=(shardings, batch_shardings),
                    out_shardings=(shardings, replicated),
                    donate_argnums=0,
                )
                .lower(state, batch)
                .compile()
            )
        return cache[signature]

    def _checkpoint_meta(self) -> dict:
        """What a checkpoint records besides the state: the model's registry
        name and config (so ``load_model`` can rebuild it)."""
        from dew.nn import models

        meta: dict[str, Any] = {"averaged": self.objective.ema is not None}
        try:
            name, config = models.config_of(self.objective.model)
            json.dumps(config)
        except (ValueError, TypeError) as error:
            meta["model"] = None
            meta["model_note"] = str(error)
        else:
            meta["model"] = {"name": name, "config": config}
        return meta

    def _account(self, pending, fetched, rejected_run: list[int], log: MetricsLog) -> None:
        for (step, _), values in zip(pending, fetched):
            if float(values["accepted"]) > 0:
                rejected_run.clear()
                continue
            rejected_run.append(step)
            log.print(
                f"step {step}: rejected (loss {format_value(float(values['loss']))} or its "
                f"gradients not finite); nothing applied"
            )
            if len(rejected_run) > self.max_rejected:
                raise NonFiniteError(
                    f"{len(rejected_run)} consecutive steps had a non-finite loss or gradient "
                    f"(steps {rejected_run}), more than max_rejected={self.max_rejected}; check "
                    f"the data and the learning rate"
                )

    # ------------------------------------------------------------ evaluation
    def evaluate(self, state: TrainState, data: Dataset, *, max_batches: int = 0) -> dict:
        """Run ``objective.evaluate`` over one pass of ``data.val``; the summarized metrics."""
        partition = Partition(jax.process_index(), jax.process_count())
        with self._context():
            return self._eval_totals(state, data, partition, max_batches)

    def _eval_totals(self, state, data, partition, max_batches):
        if data.val is None or not self.objective.has_evaluate:
            return {}
        variables = state.variables(averaged=self.objective.evaluate_averaged)
        fn = jax.jit(
            lambda v, b, s: self.objective.evaluate(
                v, b, Step(index=s, key=microbatch_key(state.key, s, -1 & 0x7FFFFFFF))
            )
        )
        totals: dict[str, float] = {}
        for i, local in enumerate(data.val(partition)):
            if max_batches and i >= max_batches:
                break
            rows = np.asarray(next(iter(local.values()))).shape[0] * partition.count
            batch = self._to_global(local, partition, rows)
            sums = jax.device_get(fn(variables, batch, state.step))
            for name, value in sums.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        return self.objective.summarize(totals) if totals else {}

    def _evaluate(self, state, data, partition, step, log: MetricsLog, max_batches: int) -> None:
        results = self._eval_totals(state, data, partition, max_batches)
        if results:
            shown = ", ".join(f"{k} {format_value(v)}" for k, v in results.items())
            log.log(step, results, kind="eval", line=f"eval step {step}: {shown}")
        if self.objective.has_preview:
            variables = state.variables(averaged=self.objective.evaluate_averaged)
            sample = self.objective.preview(
                variables, microbatch_key(state.key, state.step, 0x7FFFFFFE)
            )
            if sample is not None:
                log.print(
                    f"preview step {step}: {sample!r}"
                    if isinstance(sample, str)
                    else f"preview step {step}: {type(sample).__name__}"
                )

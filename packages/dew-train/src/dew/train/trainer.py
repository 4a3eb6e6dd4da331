"""``Trainer``: the mesh, the compiled step, the loop, evaluation, logging, goodput.

The loop::

    for each data batch:                      # every prepared_updates.per_batch steps
        batch = prepare(state, batch)         # objectives with a prepare phase only
                                              # (compiled; then, with prepare_host, host
                                              # Python and a compiled prepare_finish)
        for each update over the batch:       # one step each
            state, metrics = step(state, minibatch)
            hooks: metrics and logging, evaluation and preview, checkpoint,
                   stop signals, then the user's hooks (add_hook)
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Dataset, Partition
from dew.nn.keywords import check_keywords, unknown_keywords
from dew.nn.lora import base_module, lora_of
from dew.objectives import Objective, Role, Step, check_batch_spec
from dew.objectives import weighted as wt
from dew.objectives.rl import raising_ratio_errors
from dew.train import _programs
from dew.train._run import Run
from dew.train.adapters import split_lora
from dew.train.checkpoints import Checkpoints, resume_position
from dew.train.goodput import Goodput
from dew.train.hooks import EarlyStopping, FitResult, Hook, StepInfo
from dew.train.logs import MetricsLog
from dew.train.mesh import (
    DEFAULT_RULES,
    MeshSpec,
    Rules,
    check_divisible,
    logical_shardings,
    mesh_sizes,
    unbox_abstract,
)
from dew.train.placement import (
    check_batch_rows,
    layout,
    shard_bytes,
    to_global,
)
from dew.train.preemption import StopSignals
from dew.train.state import TrainState
from dew.train.step import (
    Stream,
    is_logged_step,
    logged_flag,
    microbatch_key,
)
from dew.train.throughput import Throughput
from dew.train.trackers import Tracker


@check_keywords
@dataclasses.dataclass
class Trainer:
    """Trains ``objective`` with ``optimizer``; configure it, do not subclass it.

    objective: an :class:`dew.objectives.Objective`.
    optimizer: an ``optax.GradientTransformation`` (any chain, schedule or wrapper).
    key: the run's root PRNG key (``jax.random.key(seed)``); every draw is a
      function of it and the step.
    mesh: axis sizes; the default puts every device on ``data``.
    rules: logical-axis -> mesh-axis table; None = ``DEFAULT_RULES``.
    accumulate: split each global batch (or prepared minibatch) into this many
      microbatches and apply one update; losses divide once by the total weight.
    max_rejected: stop with an error after more than this many consecutive
      steps with a non-finite loss or gradient.
    run_dir: where ``metrics.jsonl`` and TensorBoard events go; None = the
      checkpoint directory when there is one, else stdout only.
    checkpoints: a :class:`dew.train.Checkpoints`, or None.
    progress: show a progress bar; None = only on a TTY.
    hooks: :class:`dew.train.Hook` objects run after the trainer's own hooks
      (or add them with :meth:`add_hook`).
    trackers: experiment trackers (``dew.train.trackers``) fed every record.
    learning_rate: the schedule (or constant) the optimizer was built with, for
      the log only; None = read ``learning_rate`` from an
      ``optax.inject_hyperparams`` state when there is one.
    early_stopping: an :class:`dew.train.EarlyStopping` on an evaluation metric.

    After ``fit``, :attr:`result` (a :class:`dew.train.FitResult`) says whether
    the run completed, stopped early or was interrupted.
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
    hooks: list = dataclasses.field(default_factory=list, kw_only=True)
    trackers: Sequence[Tracker] = dataclasses.field(default=(), kw_only=True)
    learning_rate: Callable | float | None = dataclasses.field(default=None, kw_only=True)
    early_stopping: EarlyStopping | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.objective, Objective):
            raise TypeError(
                f"objective must be a dew.objectives.Objective, got {type(self.objective).__name__}"
            )
        if not isinstance(self.optimizer, optax.GradientTransformation):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(3e-4) or "
                f"an optax.chain(...)), got {type(self.optimizer).__name__} "
                f"{self.optimizer!r:.80}; a learning rate goes inside the optax optimizer"
            )
        if not _is_typed_key(self.key):
            raise TypeError(
                f"key must be a typed JAX key such as jax.random.key(0), got "
                f"{type(self.key).__name__} {self.key!r:.60}; a legacy uint32 PRNGKey converts "
                f"with jax.random.wrap_key_data(k)"
            )
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int):
            raise TypeError(f"accumulate must be an int, got {self.accumulate!r}")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 microbatches, got {self.accumulate}")
        if self.checkpoints is not None and not isinstance(self.checkpoints, Checkpoints):
            raise TypeError(
                f"checkpoints must be a dew.train.Checkpoints (e.g. "
                f"Checkpoints('runs/x')), got {type(self.checkpoints).__name__}"
            )
        if not isinstance(self.mesh, MeshSpec):
            raise TypeError(
                f"mesh must be a dew.train.MeshSpec (e.g. MeshSpec(fsdp=4)), got "
                f"{type(self.mesh).__name__}"
            )
        if self.max_rejected < 0:
            raise ValueError(f"max_rejected must be >= 0, got {self.max_rejected}")
        if self.early_stopping is not None and not isinstance(self.early_stopping, EarlyStopping):
            raise TypeError(
                f"early_stopping must be a dew.train.EarlyStopping, got "
                f"{type(self.early_stopping).__name__}"
            )
        self.hooks = [h if isinstance(h, Hook) else Hook(h) for h in self.hooks]
        if self.rules is None:
            self.rules = DEFAULT_RULES
        self.roles = check_roles(self.objective)
        self._mesh = None
        self.result: FitResult | None = None

    def add_hook(self, fn: Callable[[StepInfo], Any], *, every: int = 1, name: str = "") -> Hook:
        """Run ``fn(StepInfo)`` after every ``every``-th step (after the trainer's
        own hooks). Returns the :class:`Hook`."""
        hook = Hook(fn, every=every, name=name)
        self.hooks.append(hook)
        return hook

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

    def _init_variables(self, key: jax.Array, spec) -> dict:
        init = self.objective.init
        if spec is not None and "spec" in inspect.signature(init).parameters:
            return dict(init(key, spec=spec))
        return dict(init(key))

    def _create(self, key: jax.Array, spec=None) -> TrainState:
        """The initial state, parameters still in their logical-axis boxes."""
        k_init, k_run = jax.random.split(key)
        variables = self._init_variables(k_init, spec)
        if "params" not in variables:
            raise ValueError(
                f"{type(self.objective).__name__}.init returned {sorted(variables)}; it must "
                f"return a dict with 'params' (the trained weights)"
            )
        # Under LoRA only the adapters train; the base moves to frozen (dew.train.adapters).
        params, variables, views = split_lora(self.roles, variables.pop("params"), variables)
        return TrainState(
            params=params,
            opt_state=self.optimizer.init(params),
            key=k_run,
            step=jnp.zeros((), jnp.int32),
            microstep=jnp.zeros((), jnp.int32),
            updates=jnp.zeros((), jnp.int32),
            averaged=params if self.objective.ema is not None else None,
            frozen=variables,
            lora_views=views,
        )

    def state_shardings(self, spec=None):
        """``(abstract state, NamedSharding tree)`` without allocating anything."""
        cache = self.__dict__.setdefault("_shardings_by_spec", {})
        token = _spec_token(spec)
        if token not in cache:
            self._spec = spec
            cache[token] = self._state_shardings()
        self._shardings = cache[token]
        return self._shardings

    def _state_shardings(self):
        with self._context():
            # one trace of the model's init serves the shapes here and the
            # compiled initialisation (init_state replays this jaxpr)
            closed, boxed = jax.make_jaxpr(
                lambda k: self._create(k, self._spec), return_shape=True
            )(self.key)
            self.__dict__.setdefault("_init_jaxprs", {})[_spec_token(self._spec)] = (
                closed,
                jax.tree.structure(boxed),
            )
            specs = nn.get_partition_spec(boxed)
            # Optimizer arrays shaped unlike their parameter (Adafactor's factored
            # moments) get a spec that fits their own shape.
            from dew.train.mesh import optimizer_specs

            specs = specs.replace(
                opt_state=optimizer_specs(
                    boxed.opt_state, boxed.params, self.device_mesh, self.rules
                )
            )
            abstract = unbox_abstract(boxed)
            check_divisible(abstract, specs, self.device_mesh, self.rules)
            return abstract, logical_shardings(specs, self.device_mesh, self.rules)

    def init_state(self, spec=None) -> TrainState:
        """Create the state already sharded (initialisation compiled with output shardings)."""
        _, shardings = self.state_shardings(spec)
        fns = self.__dict__.setdefault("_init_fns", {})
        token = _spec_token(spec)
        if token not in fns:
            # unbox_abstract, not nn.unbox: nn.unbox re-applies each parameter's spec to
            # optimizer arrays of other shapes (Adafactor's factored moments);
            # out_shardings already places every array
            closed, treedef = self._init_jaxprs[token]

            def create(key):
                leaves = jax.extend.core.jaxpr_as_fun(closed)(key)
                return unbox_abstract(jax.tree.unflatten(treedef, leaves))

            fns[token] = jax.jit(
                create, out_shardings=shardings, compiler_options=init_compiler_options(self)
            )
        with self._context():
            return fns[token](self.key)

    # ------------------------------------------------------------------- fit
    @raising_ratio_errors()  # a first-update RatioError reaches the caller as itself
    def fit(
        self,
        data: Dataset,
        *,
        steps: int,
        log_every: int = 100,
        eval_every: int = 0,
        checkpoint_every: int = 0,
        eval_batches: int = 0,
        **unknown,
    ) -> TrainState:
        """Train until the step counter reaches ``steps``; returns the final state.

        log_every: print and record metrics every this many steps (0 = never);
          the logged loss and metrics are means over the steps since the last
          log line.
        eval_every: run ``objective.evaluate`` over ``data.val`` (and a preview)
          every this many steps (0 = never).
        checkpoint_every: save a checkpoint every this many steps; 0 = only at
          the end. Needs ``checkpoints=``, which always saves at the end.
        eval_batches: stop each evaluation after this many batches (0 = all).

        With ``checkpoints=``, a directory that holds a checkpoint continues
        from the newest usable one (see :mod:`dew.train.checkpoints`). SIGTERM
        or SIGINT finish the step in flight, write a checkpoint and return
        the state early (see :mod:`dew.train.preemption`); :attr:`result` says
        how the run ended.

        With an objective that has ``prepare``, one data batch feeds
        ``prepared_updates.per_batch`` steps: ``steps`` and ``checkpoint_every``
        must be multiples of it, and a stop request ends the run at the end
        of the batch's updates.
        """
        if unknown:
            valid = ["steps", "log_every", "eval_every", "checkpoint_every", "eval_batches"]
            raise TypeError(unknown_keywords("Trainer.fit", list(unknown), valid))
        if not isinstance(data, Dataset):
            raise TypeError(
                f"fit needs a dew.data.Dataset (e.g. TokenWindows(...).load(batch=8) or "
                f"Dataset(train=..., val=..., records=..., batch=...)), got {type(data).__name__}"
            )
        for name, value in (
            ("steps", steps),
            ("log_every", log_every),
            ("eval_every", eval_every),
            ("eval_batches", eval_batches),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"{name} must be an int, got {value!r}")
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
        per_batch = self._per_batch()
        if per_batch > 1:
            for name, value in (("steps", steps), ("checkpoint_every", checkpoint_every)):
                if value % per_batch:
                    raise ValueError(
                        f"{type(self.objective).__name__} runs {per_batch} updates per prepared "
                        f"batch ({self.objective.prepared_updates}); {name}={value} must be a "
                        f"multiple of {per_batch} so every batch finishes its updates"
                    )
        records = getattr(data, "records", None)
        if records and records < data.batch:  # 0 or None: not known
            raise ValueError(
                f"the global batch {data.batch} is larger than the dataset's {records} "
                f"records; use batch <= {records} or more data"
            )
        notes = []
        if eval_every and data.val is None:
            if self.objective.has_evaluate and not self.objective.has_preview:
                raise ValueError(
                    f"eval_every={eval_every} but the dataset has no validation data "
                    f"(Dataset.val is None); give the reader a validation split or set "
                    f"eval_every=0"
                )
            if self.objective.has_evaluate:
                notes.append(
                    f"Note: eval_every={eval_every} with no validation data (Dataset.val is "
                    f"None): only previews run"
                )
        spec_c = self.checkpoints
        if spec_c is not None and getattr(spec_c, "keep_best", 0):
            evaluates = eval_every and data.val is not None and self.objective.has_evaluate
            if not evaluates or (checkpoint_every and checkpoint_every % eval_every):
                raise ValueError(
                    f"Checkpoints(keep_best={spec_c.keep_best}, best_metric="
                    f"{spec_c.best_metric!r}) ranks checkpoints by an evaluation of their own "
                    f"step, but this run evaluates every {eval_every} steps"
                    f"{' with no validation data' if data.val is None else ''} and checkpoints "
                    f"every {checkpoint_every}; set eval_every to a divisor of checkpoint_every"
                )
        if self.early_stopping is not None and not eval_every:
            raise ValueError(
                f"early_stopping on {self.early_stopping.metric!r} needs evaluations: set "
                f"eval_every > 0"
            )
        goodput = Goodput()
        partition = Partition(jax.process_index(), jax.process_count())
        check_batch_rows(self.device_mesh, self.rules, data.batch, self._update_microbatches())
        partition.rows(data.batch)
        run_dir = self.run_dir
        if run_dir is None and self.checkpoints is not None:
            run_dir = self.checkpoints.directory
        session = None
        log = None
        if self.checkpoints is not None:  # checks the directory can be written
            session = self.checkpoints.open(print_fn=lambda line: log.print(line))
        log = MetricsLog(
            run_dir,
            is_main=jax.process_index() == 0,
            progress=self.progress,
            total_steps=steps,
            examples_per_step=data.batch,
            trackers=list(self.trackers),
        )
        try:
            return self._fit(
                data,
                partition,
                goodput,
                log,
                session,
                notes=notes,
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

    def _per_batch(self) -> int:
        return self.objective.prepared_updates.per_batch if self.objective.has_prepare else 1

    def _update_microbatches(self) -> int:
        """Row divisor of a data batch: minibatches x accumulate with prepare is
        checked on the prepared batch; here the plain accumulate."""
        return 1 if self.objective.has_prepare else self.accumulate

    def _fit(
        self,
        data,
        partition,
        goodput,
        log,
        session,
        *,
        notes,
        steps,
        log_every,
        eval_every,
        checkpoint_every,
        eval_batches,
    ) -> TrainState:
        mesh = self.device_mesh
        spec = self._data_spec(data)
        if spec:  # the objective's declared fields against the data's, before compiling
            check_batch_spec(
                self.objective.batch_fields(), spec, what=type(self.objective).__name__
            )
        abstract, shardings = self.state_shardings(spec)
        restored = None
        if session is not None:
            with goodput.measure("checkpoint"), self._context():
                restored = session.restore(
                    abstract,
                    shardings,
                    root_key=self.key,
                    # reset_optimizer: a new optimizer state for the restored weights
                    init_opt_state=jax.jit(self.optimizer.init, out_shardings=shardings.opt_state),
                )
        if restored is None:
            with goodput.measure("init"):
                state = self.init_state(spec)
        else:
            state = restored.state
            self._check_resume(restored, data, steps)
        start = int(jax.device_get(state.step))
        log.start(start)
        resuming = f"Resuming from step {start} ({restored.path}). " if restored else ""
        log.print(
            f"{resuming}Training from step {start} to {steps} on {mesh_sizes(mesh)} "
            f"({jax.process_count()} process(es))"
        )
        log.print(self._model_line(abstract, shardings))
        for note in notes:
            log.print(note)
        with goodput.measure("data"):
            train_iter: Iterator = resume_position(
                iter(data.train(partition)),
                _batches_view(restored, self._per_batch()),
                print_fn=log.print,
            )
        meta = self._checkpoint_meta(data) if session is not None else {}
        run = Run(
            trainer=self,
            data=data,
            partition=partition,
            goodput=goodput,
            log=log,
            session=session,
            train_iter=train_iter,
            meta=meta,
            steps=steps,
            log_every=log_every,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            eval_batches=eval_batches,
            saved_at=restored.step if restored else None,
            tokens_key="tokens",
        )
        per_batch = self._per_batch()
        prepared = previous = None
        step = start
        self.result = None
        with self._context(), StopSignals() as stop:
            run.stop = stop
            while step < steps:
                if step % per_batch == 0:
                    with goodput.measure("data"):
                        local = next(train_iter)
                        if step == start:
                            # the values once (dew.data readers check their own rows);
                            # the shapes every batch
                            self.objective.check_batch(local)
                        self._check_spec(spec, local, data)
                        if step == start or not _unchanged(local, previous):
                            batch = to_global(local, partition, data.batch, mesh, self.rules)
                        previous = local
                    if self.objective.has_prepare and step > start:
                        # the previous batch's updates finish in "steps", not "prepare"
                        with goodput.measure("steps"):
                            jax.block_until_ready(state)
                    began = goodput.seconds["prepare"]  # compilation not counted
                    prepared = _programs.prepared(self, state, batch, shardings, goodput)
                    run.interval.prepare_seconds += goodput.seconds["prepare"] - began
                update, run.packing = _programs.compiled_update(
                    self, state, prepared, shardings, goodput
                )
                if run.throughput is None:
                    run.throughput = self.throughput(prepared)
                    log.print(run.throughput.line())
                with goodput.measure("steps"):
                    # diagnostics only on the steps the log reads (dew.objectives.Step)
                    logged = logged_flag(mesh, is_logged_step(step + 1, steps, log_every))
                    state, metrics = update(state, prepared, logged)
                    step += 1
                    if goodput.first_step_at is None:
                        jax.block_until_ready(metrics)
                        goodput.first_step_done()
                        # the log's rates leave out the step that compiled
                        run.interval.restart(untimed=step - start)
                log.advance(step)
                if run.after_step(step, state, metrics, at_boundary=step % per_batch == 0):
                    break
            run.finish(step, state)
        with goodput.measure("steps"):
            jax.block_until_ready(state)
        if stop.received is not None:
            where = (
                f"checkpoint written to {session.path(step)}"
                if session is not None
                else "no checkpoint written (no checkpoints= given)"
            )
            log.print(f"Stopped by {stop.received} at step {step}; {where}")
        self.result = run.result(step)
        report = goodput.report()
        log.print(goodput.line(report))
        log.log(step, report, kind="goodput")
        return state

    def throughput(self, batch) -> Throughput:
        """The compiled step's FLOPs for ``batch``'s layout and the mesh's peak
        (:mod:`dew.train.throughput`): what the log's MFU divides."""
        flops = self.__dict__.get("_step_flops", {})[layout(batch)]
        return Throughput(flops, self.device_mesh.devices.flat)

    # -------------------------------------------------------- data and state
    def _data_spec(self, data):
        spec = getattr(data, "spec", None)
        return dict(spec) if spec else None

    def _check_spec(self, spec, local, data) -> None:
        if not spec:
            return
        rows = data.batch // max(1, jax.process_count())
        for key, field in spec.items():
            if key not in local:
                raise KeyError(
                    f"the data declares batch[{key!r}] (Dataset.spec) but a batch has only "
                    f"{sorted(local)}"
                )
            value = np.asarray(local[key])
            want = (rows, *tuple(field.shape))
            if value.shape != want:
                raise ValueError(
                    f"batch[{key!r}] has shape {value.shape}, but the data declares rows of "
                    f"{tuple(field.shape)} (Dataset.spec) in batches of {rows}: {want}"
                )

    def _check_resume(self, restored, data, steps) -> None:
        step = restored.step
        if steps < step:
            raise ValueError(
                f"the checkpoint in {restored.path} is at step {step}, past steps={steps}; "
                f"ask for steps >= {step} to continue, or use another checkpoint directory"
            )
        saved_batch = restored.meta.get("batch")
        if saved_batch is not None and int(saved_batch) != data.batch:
            raise ValueError(
                f"the checkpoint in {restored.path} was written with a global batch of "
                f"{saved_batch} and its data position counts batches of that size; this run "
                f"uses batch {data.batch}. Resume with batch={saved_batch}, or start a new "
                f"directory (load the weights with dew.train.load_model)"
            )

    def _model_line(self, abstract, shardings) -> str:
        count = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract.params))
        per_device = shard_bytes(abstract.params, shardings.params)
        optimizer = shard_bytes(abstract.opt_state, shardings.opt_state)
        return (
            f"Model: {count:,} parameters; per device {_mib(per_device)} of parameters, "
            f"{_mib(optimizer)} of optimizer state"
        )

    def _checkpoint_meta(self, data) -> dict:
        """What a checkpoint records besides the state: each role's registry name
        and config (so ``load_model`` can rebuild it), the batch size."""
        meta: dict[str, Any] = {
            "averaged": self.objective.ema is not None,
            "batch": data.batch,
            "prepared_updates": self._per_batch(),
        }
        roles = {}
        for role in self.roles:
            roles[role.name] = {"trained": role.trained, **_model_record(base_module(role.module))}
            if lora_of(role.module) is not None:
                roles[role.name]["lora"] = dataclasses.asdict(lora_of(role.module))
        meta["roles"] = roles
        trained = [r for r in self.roles if r.trained]
        first = roles[trained[0].name] if trained else {"model": None}
        meta["model"] = first.get("model")
        if "model_note" in first:
            meta["model_note"] = first["model_note"]
        return meta

    # ------------------------------------------------------------ evaluation
    def evaluate(self, state: TrainState, data: Dataset, *, max_batches: int = 0) -> dict:
        """One pass of ``objective.evaluate`` over ``data.val``: the reduced metrics
        (weighted means divided once over the whole pass) after
        ``objective.summarize``. Uses the averaged weights when the objective
        evaluates with them and there are any (``eval (ema)`` in the log)."""
        partition = Partition(jax.process_index(), jax.process_count())
        with self._context():
            return self._eval_results(state, data, partition, max_batches)

    def _uses_ema(self, state) -> bool:
        return (
            self.objective.evaluate_averaged
            and self.objective.ema is not None
            and state.averaged is not None
        )

    def _eval_results(self, state, data, partition, max_batches):
        if data.val is None or not self.objective.has_evaluate:
            return {}
        if getattr(self, "_eval_fn", None) is None:
            objective = self.objective

            def evaluate(variables, batch, root, step):
                key = microbatch_key(root, step, Stream.EVALUATE)
                metrics = objective.evaluate(variables, batch, Step(index=step, key=key))
                rows = batch["example_mask"].sum() if "example_mask" in batch else _rows(batch)
                return wt.as_metrics(metrics, rows)

            self._eval_fn = jax.jit(evaluate)
        variables = state.variables(averaged=self._uses_ema(state))
        totals = None
        for i, local in enumerate(data.val(partition)):
            if max_batches and i >= max_batches:
                break
            rows = np.asarray(next(iter(local.values()))).shape[0] * partition.count
            batch = to_global(local, partition, rows, self.device_mesh, self.rules)
            sums = jax.device_get(self._eval_fn(variables, batch, state.key, state.step))
            totals = sums if totals is None else wt.add(totals, sums)
        if totals is None:
            return {}
        return self.objective.summarize(wt.to_float(totals))


INIT_CPU_OPTIONS = {"xla_backend_optimization_level": 1}
"""XLA:CPU options for the compiled initialisation: LLVM at O1 instead of O2 compiles
the random initialisers' kernels 1.3-2.8 s faster at the seed and medium LM sizes (jax
0.10.2 and 0.12.0.1; docs/performance.md), with the same values bit for bit
(dew-train's tests/test_startup.py); the program runs once, so its own speed does not
matter. O0 compiles faster still but changes the values' last bits."""


def init_compiler_options(trainer: Trainer) -> dict | None:
    """:data:`INIT_CPU_OPTIONS` when the mesh's devices are CPUs, else XLA's defaults."""
    return INIT_CPU_OPTIONS if trainer.device_mesh.devices.flat[0].platform == "cpu" else None


def check_roles(objective: Objective) -> tuple[Role, ...]:
    roles = tuple(objective.roles())
    seen: dict[str, int] = {}
    for role in roles:
        if not isinstance(role, Role):
            raise TypeError(
                f"{type(objective).__name__}.roles() must return dew.objectives.Role objects, "
                f"got {type(role).__name__}"
            )
        seen[role.name] = seen.get(role.name, 0) + 1
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ValueError(
            f"{type(objective).__name__} declares role name(s) {twice} more than once "
            f"(roles: {[r.name for r in roles]}); give every role its own name"
        )
    if not any(role.trained for role in roles):
        raise ValueError(
            f"{type(objective).__name__} declares no trained role (roles: "
            f"{[r.name for r in roles]}); mark at least one Role(trained=True)"
        )
    return roles


def _unchanged(local, previous) -> bool:
    """``local`` holds the very arrays of ``previous`` and none of them can have
    changed in between (read-only numpy, or jax arrays): its global batch is
    the one already on the devices."""
    if previous is None or local.keys() != previous.keys():
        return False
    for name, value in local.items():
        if value is not previous[name]:
            return False
        if isinstance(value, np.ndarray) and value.flags.writeable:
            return False
        if not isinstance(value, np.ndarray | jax.Array):
            return False
    return True


def _rows(batch) -> int:
    leaves = jax.tree.leaves(batch)
    return leaves[0].shape[0] if leaves else 1


def _batches_view(restored, per_batch: int):
    """``restored`` as the data stream sees it: one batch per ``per_batch`` steps."""
    if restored is None or per_batch == 1:
        return restored
    return dataclasses.replace(restored, step=restored.step // per_batch)


def _spec_token(spec) -> Any:
    if not spec:
        return None
    return tuple(sorted((k, tuple(f.shape), str(f.dtype)) for k, f in spec.items()))


def _model_record(module) -> dict:
    from dew.nn import models

    try:
        name, config = models.config_of(module)
        json.dumps(config)
    except (ValueError, TypeError) as error:
        return {"model": None, "model_note": str(error)}
    return {"model": {"name": name, "config": config}}


def _is_typed_key(key) -> bool:
    return isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"

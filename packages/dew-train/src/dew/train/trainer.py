"""``Trainer``: configures a run and runs it.

``fit`` is three owners in a row: :class:`~dew.train.Programs` (mesh,
shardings, compiled programs), the loop :func:`~dew.train.training_steps`
(data -> prepare -> updates, one record a step) and the hooks
(:mod:`dew.train.hooks`: the trainer's own, then the user's)::

    hooks: start (the checkpoint hook restores the state and the data stream)
    for record in training_steps(programs, state, ...):
        hooks: rejections, log, evaluation (and preview), checkpoints,
               early stopping, stop signals, then the user's hooks
    hooks: finish (the final checkpoint), close
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import optax

from dew.data import Dataset, Partition
from dew.nn.keywords import check_keywords, is_whole_number
from dew.objectives import Objective, check_batch_spec
from dew.objectives.contract.errors import raising_host_errors as raising_ratio_errors
from dew.train._checkpoint_meta import checkpoint_meta, first_trained_record
from dew.train._checkpointing import Checkpointing
from dew.train._default_hooks import (
    DefaultHook,
    LogMetrics,
)
from dew.train._fit_hooks import checkpoint_hook, fit_hooks, start_hooks
from dew.train._fit_input import check_fit_arguments, check_resume, check_spec
from dew.train._loop import training_steps
from dew.train._programs import INIT_CPU_OPTIONS, Programs, check_roles
from dew.train._run import HookRunner, Pending
from dew.train.checkpoints import Checkpoints
from dew.train.goodput import Goodput
from dew.train.hooks import (
    DEFAULT_HOOKS,
    EarlyStopping,
    FitResult,
    Hook,
    RunStart,
    StepInfo,
)
from dew.train.logs import MetricsLog
from dew.train.mesh import DEFAULT_RULES, MeshSpec, Rules, mesh_sizes
from dew.train.placement import check_batch_rows, layout, shard_bytes
from dew.train.preemption import StopSignals
from dew.train.run_lock import lock_run, release_run
from dew.train.state import TrainState
from dew.train.throughput import Throughput
from dew.train.trackers import Tracker

__all__ = ["INIT_CPU_OPTIONS", "Trainer", "as_optax", "check_roles"]


@check_keywords
@dataclasses.dataclass
class Trainer:
    """Trains ``objective`` with ``optimizer``; configure it, do not subclass it.

    objective: an :class:`dew.objectives.Objective`.
    optimizer: an optax optimizer: a ``GradientTransformation`` (any chain,
      schedule or wrapper), a ``GradientTransformationExtraArgs``, or an
      ``optax.MultiSteps`` as it is built (``optax.MultiSteps(optax.adam(1e-3), k)``).
    key: the run's root PRNG key (``jax.random.key(seed)``); every draw is a
      function of it and the step.
    mesh: axis sizes; the default puts every device on ``data``.
    rules: logical-axis -> mesh-axis table; None = ``DEFAULT_RULES``.
    accumulate: split each global batch (or prepared minibatch) into this many
      microbatches and apply one update; losses divide once by the total weight. An
      objective whose ``accumulate_for(data_parallel)`` returns a number derives it from
      the mesh (``FlowGRPOObjective(device_rows=)``); leave it at 1 then.
    max_rejected: stop with an error after more than this many consecutive
      steps with a non-finite loss or gradient.
    run_dir: where ``metrics.jsonl`` and TensorBoard events go; None = the
      checkpoint directory when there is one, else stdout only.
    checkpoints: a :class:`dew.train.Checkpoints`, or None: the default
      ``checkpoints`` hook (a :class:`dew.train.Checkpointing`) restores from it
      and writes to it.
    progress: show a progress bar; None = only on a TTY.
    hooks: :class:`dew.train.Hook` objects (or functions of a
      :class:`dew.train.StepInfo`) run after the trainer's own hooks
      (:data:`dew.train.hooks.DEFAULT_HOOKS`); or add them with :meth:`add_hook`,
      list them with :meth:`hook_names`, replace a default one with
      :meth:`replace_hook`.
    trackers: experiment trackers (``dew.train.trackers``) fed every record.
    learning_rate: the schedule (or constant) the optimizer was built with, for
      the log only; None = read ``learning_rate`` from an
      ``optax.inject_hyperparams`` state when there is one.
    early_stopping: an :class:`dew.train.EarlyStopping` on an evaluation metric
      (a shorthand for the ``early_stopping`` hook, :class:`dew.train.EarlyStop`).
    device_memory_bytes: bytes one device may hold (an int, or a size such as
      ``'16GiB'``); None = ``$DEW_DEVICE_MEMORY`` when set, else the device's own
      limit (``memory_stats()['bytes_limit']`` on a TPU or GPU; a CPU has none and
      is not checked). When the compiled update step needs more (its
      ``memory_analysis()``: arguments + outputs - donated + temporaries), ``fit``
      raises :class:`dew.train.StepDoesNotFit` before the first step, naming the
      bytes and what to change, instead of running out of memory.
    peak_flops: one device's peak FLOP/s for the log's MFU; None = ``$DEW_PEAK_FLOPS``
      when set, else the table of bf16 peaks by device kind
      (:data:`dew.train.throughput.PEAKS`; MFU shown as unknown for a kind it lacks).
    update_norm: also log ``update_norm``, the global norm of each logged step's
      update (``grad_norm`` is logged always). Off by default, as in MaxText and the
      Hugging Face trainer: it makes XLA write every gradient out in float32 (a
      bfloat16 model's are otherwise converted inside the update), 3% of GRPO's update
      on a TPU v5e.

    :attr:`programs` (:class:`dew.train.Programs`) owns the device mesh, the state
    shardings and the compiled programs; :func:`dew.train.plan` compiles the same.

    After ``fit``, :attr:`result` (a :class:`dew.train.FitResult`) says whether
    the run completed, stopped early or was interrupted.
    """

    objective: Objective
    optimizer: Any
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
    device_memory_bytes: int | str | None = dataclasses.field(default=None, kw_only=True)
    peak_flops: float | None = dataclasses.field(default=None, kw_only=True)
    update_norm: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.objective, Objective):
            raise TypeError(
                f"objective must be a dew.objectives.Objective, got {type(self.objective).__name__}"
            )
        optimizer = as_optax(self.optimizer)
        if not _is_typed_key(self.key):
            raise TypeError(
                f"key must be a typed JAX key such as jax.random.key(0), got "
                f"{type(self.key).__name__} {self.key!r:.60}; a legacy uint32 PRNGKey converts "
                f"with jax.random.wrap_key_data(k)"
            )
        if not is_whole_number(self.accumulate):
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
        self.programs = Programs(
            objective=self.objective,
            optimizer=optimizer,
            mesh=self.mesh,
            rules=self.rules,
            accumulate=self.accumulate,
            learning_rate=self.learning_rate,
            device_memory_bytes=self.device_memory_bytes,
            update_norm=self.update_norm,
        )
        self.accumulate = self.programs.accumulate  # an objective may derive it
        self.roles = self.programs.roles
        # default hook name -> its replacement (None: left out)
        self._replaced: dict[str, Hook | None] = {}
        self.result: FitResult | None = None

    # ----------------------------------------------------------------- hooks
    def add_hook(self, fn: Callable[[StepInfo], Any], *, every: int = 1, name: str = "") -> Hook:
        """Run ``fn(StepInfo)`` after every ``every``-th step (after the trainer's
        own hooks). Returns the :class:`Hook`."""
        hook = Hook(fn, every=every, name=name)
        self.hooks.append(hook)
        return hook

    def replace_hook(
        self,
        name: str,
        fn: Callable[[StepInfo], Any] | Hook | Checkpointing | DefaultHook | None,
        *,
        every: int = 1,
    ) -> Hook | Checkpointing | DefaultHook | None:
        """Run ``fn(StepInfo)`` every ``every`` steps in place of the default hook
        ``name`` (:data:`dew.train.hooks.DEFAULT_HOOKS`), at its place in the order;
        None leaves it out. A default hook with settings of one's own takes its
        place as it is (it wins over ``fit``'s shorthands)::

            trainer.replace_hook("log", LogMetrics(every=10))
            trainer.replace_hook("evaluation", Evaluation(every=50, batches=4))

        Replacing ``checkpoints`` replaces all of checkpointing
        (restoring included), so it goes without ``Trainer(checkpoints=)``; a
        checkpoint policy of one's own::

            def policy(info):
                if info.at_boundary and info.metrics.get("eval/loss", 9) < 1.0:
                    info.save_checkpoint(info.evaluation)

            trainer.replace_hook("checkpoints", Checkpointing(Checkpoints(d), policy=policy))
        """
        if name not in DEFAULT_HOOKS:
            raise ValueError(
                f"there is no default hook {name!r} to replace; the default hooks are "
                f"{list(DEFAULT_HOOKS)} (add a new one with Trainer.add_hook)"
            )
        if isinstance(fn, Checkpointing | DefaultHook) and fn.name != name:
            raise ValueError(
                f"{fn!r} is the {fn.name!r} hook: replace_hook({fn.name!r}, ...) puts it in "
                f"its place; in the place of {name!r} goes a hook of one's own (a function "
                f"or a dew.train.Hook) or None"
            )
        own = isinstance(fn, Hook | Checkpointing | DefaultHook)
        hook = None if fn is None else fn if own else Hook(fn, every=every)
        if hook is not None and hook.name != name and not own:
            hook = dataclasses.replace(hook, name=f"{name} ({hook.name})")
        self._replaced[name] = hook
        return hook

    def hook_names(self) -> list[str]:
        """The hooks ``fit`` runs after each step, in order: the defaults (a
        replaced one under its replacement's name), then the user's."""
        names = []
        for name in DEFAULT_HOOKS:
            if name not in self._replaced:
                names.append(name)
            elif self._replaced[name] is not None:
                names.append(self._replaced[name].name)
        return names + [h.name for h in self.hooks]

    # ----------------------------------------------------------------- setup
    @property
    def device_mesh(self) -> jax.sharding.Mesh:
        return self.programs.device_mesh

    def state_shardings(self, spec=None):
        """``(abstract state, NamedSharding tree)`` without allocating anything."""
        return self.programs.state_shardings(spec, key=self.key)

    def init_state(self, spec=None) -> TrainState:
        """Create the state already sharded (initialisation compiled with output shardings)."""
        return self.programs.init_state(self.key, spec)

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

        The cadences are shorthands that build the default hooks (a hook
        installed with :meth:`replace_hook` keeps its own settings instead):

        log_every: print and record metrics every this many steps (0 = never);
          the logged loss and metrics are means over the steps since the last
          log line: ``LogMetrics(every=log_every)``.
        eval_every: run ``objective.evaluate`` over ``data.val`` (and a preview)
          every this many steps (0 = never): ``Evaluation(every=eval_every,
          batches=eval_batches)``.
        checkpoint_every: save a checkpoint every this many steps; 0 = only at
          the end. Needs ``checkpoints=``, which always saves at the end:
          ``Checkpointing(checkpoints, every=checkpoint_every)``.
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
        per_batch = self.programs.per_batch
        notes = check_fit_arguments(
            self.objective,
            data,
            unknown,
            steps=steps,
            log_every=log_every,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            eval_batches=eval_batches,
            per_batch=per_batch,
            checkpoints=self.checkpoints,
            early_stopping=self.early_stopping,
        )
        # a prepared batch's minibatches x accumulate are checked on the prepared rows
        divisor = 1 if self.objective.has_prepare else self.accumulate
        check_batch_rows(self.device_mesh, self.rules, data.batch, divisor)
        Partition(jax.process_index(), jax.process_count()).rows(data.batch)
        run_dir = self.run_dir
        if run_dir is None and self.checkpoints is not None:
            run_dir = self.checkpoints.directory
        owned = run_dir is not None and jax.process_index() == 0
        if owned:  # one process writes a run directory (dew.train.run_lock)
            try:
                lock_run(run_dir)
            except OSError:  # cannot be written: the checkpoint hook says so, naming it
                owned = False
        try:
            return self._fit_owned(
                data,
                run_dir,
                steps,
                log_every,
                eval_every,
                eval_batches,
                checkpoint_every,
                notes,
            )
        finally:
            if owned:
                release_run(run_dir)

    def _fit_owned(
        self,
        data,
        run_dir,
        steps,
        log_every,
        eval_every,
        eval_batches,
        checkpoint_every,
        notes,
    ) -> TrainState:
        """:meth:`fit` once its checks have passed and it owns ``run_dir``."""
        goodput = Goodput()
        partition = Partition(jax.process_index(), jax.process_count())
        # built first: the checkpoint hook checks its directory can be written
        checkpointing = checkpoint_hook(self._replaced, self.checkpoints, checkpoint_every)
        log = MetricsLog(
            run_dir,
            is_main=jax.process_index() == 0,
            progress=self.progress,
            total_steps=steps,
            examples_per_step=data.batch,
            trackers=list(self.trackers),
        )
        self.result = None
        signals = StopSignals()
        hooks = fit_hooks(
            self._replaced,
            checkpointing,
            self.hooks,
            self.early_stopping,
            log_every=log_every,
            eval_every=eval_every,
            eval_batches=eval_batches,
        )
        try:
            return self._fit(
                data,
                partition,
                goodput,
                log,
                hooks,
                signals,
                notes=notes,
                steps=steps,
            )
        finally:
            try:
                for hook in hooks:
                    hook.close()
            finally:
                log.close()

    def _fit(self, data, partition, goodput, log, hooks, signals, *, notes, steps) -> TrainState:
        programs = self.programs
        spec = dict(data.spec) if data.spec else None
        if spec:  # the objective's declared fields against the data's, before compiling
            check_batch_spec(
                self.objective.batch_fields(), spec, what=type(self.objective).__name__
            )
        abstract, shardings = self.state_shardings(spec)
        run = RunStart(
            abstract=abstract,
            shardings=shardings,
            root_key=self.key,
            # reset_optimizer: a new optimizer state for the restored weights
            init_opt_state=jax.jit(programs.optimizer.init, out_shardings=shardings.opt_state),
            model=first_trained_record(self.roles),
            meta=checkpoint_meta(programs, data.batch),
            per_batch=programs.per_batch,
            open_batches=lambda: iter(data.train(partition)),
            context=programs.context,
            print=log.print,
            goodput=goodput,
            log=log,
            programs=programs,
            objective=self.objective,
            data=data,
            partition=partition,
            devices=tuple(self.device_mesh.devices.flat),
            peak_flops=self.peak_flops,
            max_rejected=self.max_rejected,
            signals=signals,
        )
        resume = start_hooks(hooks, run)
        # the metrics leave the devices (and the step computes its diagnostics) on the
        # log hook's steps
        log_every = next((h.every or 0 for h in hooks if isinstance(h, LogMetrics)), 0)
        restored = resume.restored if resume is not None else None
        rows = data.batch // max(1, jax.process_count())

        def check_batch(local, first: bool) -> None:
            if first:  # the values once (dew.data readers check their own rows)
                self.objective.check_batch(local)
            check_spec(spec, local, rows)  # the shapes every batch

        with goodput.measure("data"):
            train_iter: Iterator = (
                resume.open_batches() if resume is not None else run.open_batches()
            )
            # the first batch's values (ids beyond the vocabulary, the mask id as data,
            # ties, empty completions) are refused before the state's creation compiles
            first = next(train_iter, None)
            if first is not None:
                check_batch(first, True)
                train_iter = itertools.chain([first], train_iter)
        if restored is None:
            with goodput.measure("init"):
                state = self.init_state(spec)
        else:
            check_resume(restored, data, steps)
            # the static fields (the tree's structure, not arrays) are this run's
            state = restored.state.with_structure(abstract)
        start = int(jax.device_get(state.step))
        log.start(start)
        resuming = f"Resuming from step {start} ({restored.path}). " if restored else ""
        log.print(
            f"{resuming}Training from step {start} to {steps} on {mesh_sizes(self.device_mesh)} "
            f"({jax.process_count()} process(es))"
        )
        log.print(_model_line(abstract, shardings))
        for note in notes:
            log.print(note)
        step = start
        with programs.context(), signals:
            runner = HookRunner(
                hooks,
                pending=Pending(log_every, max(self.max_rejected, 1), steps),
                goodput=goodput,
                print_fn=log.print,
                log_fn=log.log,
                save_fn=resume.save if resume is not None else None,
            )
            records = training_steps(
                programs,
                state,
                shardings,
                train_iter,
                partition=partition,
                global_rows=data.batch,
                steps=steps,
                log_every=log_every,
                goodput=goodput,
                # the first batch's values are checked above, the shapes every batch
                check_batch=lambda local, first: check_spec(spec, local, rows),
            )
            for record in records:
                state, step = record.state, record.step
                log.advance(step)
                if runner.after_step(record):
                    records.close()
                    break
            else:
                if step < steps:
                    runner.data_ended(step, steps)
                    log.print(f"Stopped at step {step}: {runner.stopped[1]}")
            final = runner.finish(step, state)
        with goodput.measure("steps"):
            jax.block_until_ready(state)
        if signals.received is not None:
            where = (
                f"checkpoint written to {final.checkpoint}"
                if final.checkpoint is not None
                else "no checkpoint written"
                + (" (no checkpoints= given)" if resume is None else "")
            )
            log.print(f"Stopped by {signals.received} at step {step}; {where}")
        self.result = runner.result(step)
        report = goodput.report()
        log.print(goodput.line(report))
        log.log(step, report, kind="goodput")
        return state

    def throughput(self, batch) -> Throughput:
        """The compiled step's FLOPs for ``batch``'s layout and the mesh's peak
        (:mod:`dew.train.throughput`): what the log's MFU divides."""
        compiled = self.programs.cache.update[layout(batch)]
        return Throughput(
            compiled.mfu_flops,
            self.device_mesh.devices.flat,
            peak_flops=self.peak_flops,
            is_model_flops=compiled.model_flops is not None,
        )

    # ------------------------------------------------------------ evaluation
    def evaluate(
        self, state: TrainState, data: Dataset, *, max_batches: int = 0, averaged=None
    ) -> dict:
        """One pass of ``objective.evaluate`` over ``data.val``: the reduced metrics
        (weighted means divided once over the whole pass) after
        ``objective.summarize``. Uses the weights ``state.variables(averaged=averaged)``
        gives: by default the averaged ones when the objective evaluates with them and
        there are any (``eval (ema)`` in the log, which adds the live weights' metrics
        as ``live/<name>``); ``averaged=False`` the live weights."""
        partition = Partition(jax.process_index(), jax.process_count())
        with self.programs.context():
            return self.programs.evaluate(
                state, data.val, partition, max_batches, averaged=averaged
            )


def as_optax(optimizer) -> optax.GradientTransformation:
    """``optimizer`` as an ``optax.GradientTransformation``: a ``GradientTransformation``
    (and ``GradientTransformationExtraArgs``) as it is, an ``optax.MultiSteps`` by its
    ``gradient_transformation()`` (the same ``init`` and ``update``, so the same state)."""
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise TypeError(
        f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(3e-4), an "
        f"optax.chain(...) or an optax.MultiSteps(...)), got {type(optimizer).__name__} "
        f"{optimizer!r:.80}; a learning rate goes inside the optax optimizer"
    )


def _model_line(abstract, shardings) -> str:
    count = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract.params))
    per_device = shard_bytes(abstract.params, shardings.params)
    optimizer = shard_bytes(abstract.opt_state, shardings.opt_state)
    return (
        f"Model: {count:,} parameters; per device {_mib(per_device)} of parameters, "
        f"{_mib(optimizer)} of optimizer state"
    )


def _is_typed_key(key) -> bool:
    return isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"

"""Hooks: what the loop does after each step, the trainer's own and the user's.

The loop is ``data -> prepare -> updates`` (:func:`dew.train.training_steps`);
after every step ``fit`` runs the installed hooks in order: the trainer's own
(:data:`DEFAULT_HOOKS`), each with its own state and settings, then the user's
in the order they were added::

    def report(info):
        info.print(f"step {info.step}: {info.metrics.get('loss')}")

    trainer.add_hook(report, every=50)              # add one
    trainer.hook_names()                            # list them, in order
    trainer.replace_hook("log", LogMetrics(every=10))  # other settings
    trainer.replace_hook("evaluation", None)        # leave a default one out
    trainer.replace_hook("checkpoints",             # or replace it: a checkpoint
        Checkpointing(Checkpoints(dir), policy=fn)) # policy of one's own

A default hook (:mod:`dew.train._default_hooks`: ``Rejections``, ``LogMetrics``,
``Evaluation``, ``EarlyStop``, ``StopSignalsHook``; ``Checkpointing``) takes its
settings when it is built, checked then, and the run's context (:class:`RunStart`)
in ``start``; ``fit(log_every=, eval_every=, eval_batches=, checkpoint_every=)``
are shorthands that build them.

A hook sees :class:`StepInfo`, a frozen record: the step just finished, the
state after it, the metrics the default hooks read off it (the log interval's
on log steps, this step's evaluation under ``eval/...``), and ``print`` /
``log`` / ``request_stop`` / ``save_checkpoint`` to talk to the run. A hook's
results reach the hooks after it as fields of the record they see: ``run``
returns a :class:`StepReport` (metrics, evaluation, checkpoint). No
subclassing. (Levanter's ``Trainer.add_hook`` and its default hooks are the
model.)

A hook's life in one ``fit`` (:class:`Installed`): ``start`` before the first
step (the ``checkpoints`` hook restores the newest checkpoint there and
provides the state and the data stream: :class:`Resume`), ``run`` after each
step, ``finish`` at the end, ``close`` always, also after an error. The
``checkpoints`` hook (:class:`dew.train.Checkpointing`) is the one owner of
the run's checkpoints: it opens the directory, restores, saves, keeps the
best, waits for the writes and closes; replacing it replaces all of that.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from dew.nn.keywords import is_whole_number

DEFAULT_HOOKS = (
    "rejections",
    "log",
    "evaluation",
    "checkpoints",
    "early_stopping",
    "stop_signals",
)
"""The trainer's own hooks, in the order they run (before the user's), each a
public class of ``dew.train`` that takes its settings when built:

- ``rejections`` (``Rejections``): counts steps whose loss or gradients were not
  finite, prints each, raises :class:`dew.train.NonFiniteError` past
  ``Trainer(max_rejected=)``;
- ``log`` (``LogMetrics(every=)``): the interval metrics and the ``step N: loss
  ...`` line every ``every`` (``fit(log_every=)``) steps (``metrics.jsonl``,
  TensorBoard, trackers);
- ``evaluation`` (``Evaluation(every=, batches=)``): ``objective.evaluate`` over
  the validation data and a preview every ``every`` (``fit(eval_every=)``) steps;
- ``checkpoints`` (``Checkpointing(checkpoints, every=)``, with
  ``Trainer(checkpoints=...)``): restores the newest usable checkpoint before the
  first step, saves every ``every`` (``fit(checkpoint_every=)``) steps (ranked by
  this step's evaluation for ``keep_best``) and at the end;
- ``early_stopping`` (``EarlyStop(metric=, patience=, ...)``,
  ``Trainer(early_stopping=...)``) on the evaluations;
- ``stop_signals`` (``StopSignalsHook``): SIGTERM / SIGINT end the run after the
  step in flight.
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepReport:
    """What a hook's ``run`` (or ``finish``) returns for the hooks after it: the
    next :class:`StepInfo` they see carries it (a hook's results reach later hooks
    here, never by writing into the record).

    metrics: added to :attr:`StepInfo.metrics` (the log's interval metrics, the
      evaluation's under ``eval/...``).
    evaluation: this step's evaluation results (:attr:`StepInfo.evaluation`).
    checkpoint: the directory of a checkpoint of this step (:attr:`StepInfo.checkpoint`).
    """

    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    evaluation: Mapping[str, float] | None = None
    checkpoint: str | None = None


class StepRequests:
    """What the hooks of one step ask of the run through :class:`StepInfo`'s methods
    (``log``, ``request_stop``, ``save_checkpoint``); the run reads it after each
    hook and gives the checkpoint to the hooks after it in their record."""

    def __init__(self, log_fn: Callable[..., None] | None, save_fn: Callable[..., str] | None):
        self.log_fn = log_fn
        self.save_fn = save_fn
        # (kind, detail) stop requests of this step, in the order the hooks made them
        self.stops: list[tuple[str, str]] = []
        self.checkpoint: str | None = None


_NO_METRICS: Mapping[str, float] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInfo:
    """What a hook sees after a step (frozen: each hook sees the results of the
    hooks before it as fields of its own record, :class:`StepReport`).

    step: steps done (``state.step``).
    state: the ``TrainState`` after the step (arrays on the devices).
    metrics: the last log interval's reduced training metrics when this step
      logged, this step's evaluation under ``eval/...`` when it evaluated;
      empty otherwise (the default hooks report them before the user's run).
    print: print a line to the run's output (the main process only).
    at_boundary: the step is the last update of its data batch (always True
      without a prepare phase): a checkpoint or a stop happens only here.
    evaluation: this step's evaluation results (``{name: value}``), or None
      when it did not evaluate.
    step_metrics: ``(step, {name: value})`` of the steps whose metrics came off
      the devices after this one (on log steps and at the end; about every
      ``max_rejected`` steps, where a step at which no hook acts leaves its own
      for the next fetch; empty otherwise), each step once.
    step_flops: FLOPs of the update step the MFU divides: its model FLOPs
      (:mod:`dew.train.model_flops`) where ``is_model_flops``, else the matrix
      products of the compiled step (:func:`dew.train.throughput.program_flops`).
    is_model_flops: see ``step_flops``.
    prepare_seconds: seconds of the prepare phase that fed this step (on the
      first update of a prepared batch; 0 otherwise).
    is_first: the first step of this ``fit`` (it compiled the step).
    checkpoint: the directory of a checkpoint of this step, once the checkpoint
      hook (or :meth:`save_checkpoint`) of an earlier hook has written one; None
      otherwise.
    """

    step: int
    state: Any
    metrics: Mapping[str, float] = dataclasses.field(default_factory=lambda: _NO_METRICS)
    print: Callable[[str], None] = builtins.print
    at_boundary: bool = True
    evaluation: Mapping[str, float] | None = None
    step_metrics: Sequence[tuple[int, Mapping[str, Any]]] = ()
    step_flops: float = 0.0
    is_model_flops: bool = False
    prepare_seconds: float = 0.0
    is_first: bool = False
    checkpoint: str | None = None
    requests: StepRequests | None = dataclasses.field(default=None, repr=False, compare=False)

    def after(self, report: StepReport | None) -> StepInfo:
        """The record the next hook sees: this one with ``report`` (a hook's
        results) and the checkpoint a :meth:`save_checkpoint` wrote."""
        changes: dict[str, Any] = {}
        if report is not None:
            if report.metrics:
                changes["metrics"] = MappingProxyType({**self.metrics, **report.metrics})
            if report.evaluation is not None:
                changes["evaluation"] = MappingProxyType(dict(report.evaluation))
            if report.checkpoint is not None:
                changes["checkpoint"] = report.checkpoint
        saved = self.requests.checkpoint if self.requests is not None else None
        if saved is not None and saved != self.checkpoint and "checkpoint" not in changes:
            changes["checkpoint"] = saved
        return dataclasses.replace(self, **changes) if changes else self

    def log(self, values: Mapping[str, float], kind: str = "hook") -> None:
        """Record ``values`` at this step in ``metrics.jsonl`` and the trackers."""
        if self.requests is not None and self.requests.log_fn is not None:
            self.requests.log_fn(self.step, values, kind=kind)

    def request_stop(self, reason: str) -> None:
        """End the run after this step (at the end of its data batch with a prepare
        phase); a checkpoint is written as on SIGTERM. ``fit``'s result says
        ``stopped_by_hook`` with the hook's name and ``reason``."""
        self.stop("stopped_by_hook", reason)

    def stop(self, kind: str, detail: str) -> None:
        """A stop request of a given :attr:`FitResult.reason` (``"early_stopped"``,
        ``"interrupted"``); :meth:`request_stop` is the user's form."""
        if self.requests is None:
            raise ValueError(
                f"step {self.step}: a stop request needs a run; this StepInfo was not "
                f"made by Trainer.fit"
            )
        self.requests.stops.append((kind, detail))

    def save_checkpoint(self, metrics: Mapping[str, float] | None = None) -> str:
        """Write a checkpoint of this step now (with ``keep_best``: ranked by
        ``metrics``), through the installed checkpoint hook
        (:class:`dew.train.Checkpointing`): for a checkpoint policy of one's own,
        ``Checkpointing(Checkpoints(dir), policy=fn)``. Returns its directory,
        which the hooks after this one see as :attr:`checkpoint`."""
        if self.requests is None or self.requests.save_fn is None:
            raise ValueError(
                "save_checkpoint needs somewhere to write: pass Trainer(..., "
                "checkpoints=Checkpoints(directory)), or install a checkpoint hook with a "
                "policy of its own: trainer.replace_hook('checkpoints', "
                "Checkpointing(Checkpoints(directory), policy=fn))"
            )
        if not self.at_boundary:
            raise ValueError(
                f"step {self.step} is inside a prepared batch's updates; a checkpoint is "
                f"written only at the end of a batch (StepInfo.at_boundary)"
            )
        path = self.requests.save_fn(self.step, self.state, metrics)
        self.requests.checkpoint = path
        return path


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunStart:
    """What a hook's ``start`` sees before the first step of a ``fit``.

    abstract: the state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves).
    shardings: the state's ``NamedSharding`` tree.
    root_key: the run's root PRNG key.
    init_opt_state: ``params -> opt_state``, compiled with the optimizer
      state's shardings (for ``Checkpoints(reset_optimizer=True)``).
    model: the first trained role's ``{"name", "config"}`` (None: not a registered model).
    meta: what a checkpoint of this run records besides the state
      (:mod:`dew.train._checkpoint_meta`).
    per_batch: optimizer updates per data batch (a prepare phase's).
    open_batches: opens this process's training iterator, from its start.
    context: enters the mesh and the logical-axis rules (``Programs.context``).
    print: print a line to the run's output.
    goodput: the run's time buckets (``checkpoint``, ``data``, ``logging``, ``eval``).
    log: the run's :class:`dew.train.logs.MetricsLog` (``metrics.jsonl``, the
      trackers, the printed lines).
    programs: the run's :class:`dew.train.Programs` (its ``evaluate``, its objective).
    objective: the objective being trained.
    data: the ``dew.data.Dataset`` ``fit`` was given (``data.val``, ``data.batch``).
    partition: this process's ``dew.data.Partition`` of the data.
    devices: the devices of the mesh (for the log's MFU).
    peak_flops: ``Trainer(peak_flops=)`` (None: by device kind).
    max_rejected: ``Trainer(max_rejected=)``.
    signals: the run's :class:`dew.train.preemption.StopSignals`.
    """

    abstract: Any
    shardings: Any
    root_key: Any
    init_opt_state: Callable[[Any], Any]
    model: dict | None
    meta: dict
    per_batch: int
    open_batches: Callable[[], Iterator]
    context: Callable[[], Any]
    print: Callable[[str], None]
    goodput: Any
    log: Any = None
    programs: Any = None
    objective: Any = None
    data: Any = None
    partition: Any = None
    devices: Sequence[Any] = ()
    peak_flops: float | None = None
    max_rejected: int = 10
    signals: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resume:
    """What the checkpoint hook's ``start`` gives the run (at most one hook does).

    restored: the checkpoint read back (a ``dew.train.checkpoints.Restored``), or
      None: the run starts from a new state.
    open_batches: opens the training iterator where ``restored`` left it (called
      once, after the log's first lines); the hook saves its position with each
      checkpoint.
    save: ``save(step, state, metrics) -> directory``, what
      :meth:`StepInfo.save_checkpoint` calls.
    """

    restored: Any
    open_batches: Callable[[], Iterator]
    save: Callable[[int, Any, Mapping[str, float] | None], str]


class Installed(Protocol):
    """What ``fit`` calls on each installed hook: ``start`` once before the first
    step (a :class:`Resume` from the checkpoint hook, None from any other),
    ``run`` after every step, ``finish`` once at the end (the final step's
    info; remaining ``step_metrics``), each returning a :class:`StepReport` for
    the hooks after it (or None), ``close`` once after it (also when the
    run raised), and ``acts_at(step)``: whether ``run`` does anything at
    ``step`` that others see (prints, reads the state, stops the run). On a step
    where no hook acts, the rejection count's fetch leaves that step's metrics
    for the next fetch instead of waiting for the devices to finish it."""

    name: str

    def start(self, run: RunStart) -> Resume | None: ...

    def run(self, info: StepInfo) -> StepReport | None: ...

    def finish(self, info: StepInfo) -> StepReport | None: ...

    def close(self) -> None: ...

    def acts_at(self, step: int) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(StepInfo)`` after every ``every``-th step.

    every: steps between calls (>= 1).
    name: shown in errors and :meth:`Trainer.hook_names`; defaults to the
      function's name.
    """

    fn: Callable[[StepInfo], Any]
    every: int = 1
    name: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"a hook must be callable, got {type(self.fn).__name__}")
        if not is_whole_number(self.every) or self.every < 1:
            raise ValueError(f"hook every= must be an int >= 1 steps, got {self.every!r}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", type(self.fn).__name__))

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def start(self, run: RunStart) -> None:
        """Nothing: a function hook starts nothing."""

    def acts_at(self, step: int) -> bool:
        return self.due(step)

    def run(self, info: StepInfo) -> StepReport | None:
        """``fn(info)`` on its steps; a :class:`StepReport` it returns reaches the
        hooks after it."""
        if self.due(info.step):
            out = self.fn(info)
            return out if isinstance(out, StepReport) else None
        return None

    def finish(self, info: StepInfo) -> None:
        """Nothing: a function hook runs on its steps only."""

    def close(self) -> None:
        """Nothing to close."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlyStopping:
    """Stop when an evaluation metric stops improving.

    metric: a name evaluation reports (``"loss"``, ``"accuracy"``).
    mode: ``"min"`` or ``"max"``: which direction is better.
    patience: evaluations without an improvement of more than ``min_delta``
      before the run stops.
    min_delta: the smallest change that counts as an improvement.
    """

    metric: str = "loss"
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self):
        if self.mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {self.mode!r}")
        if self.patience < 1:
            raise ValueError(
                f"EarlyStopping patience must be >= 1 evaluations, got {self.patience}"
            )
        if self.min_delta < 0:
            raise ValueError(f"EarlyStopping min_delta must be >= 0, got {self.min_delta}")


class EarlyStoppingState:
    """The best value so far and the evaluations since it."""

    def __init__(self, spec: EarlyStopping):
        self.spec = spec
        self.best: float | None = None
        self.since_best = 0

    def update(self, value: float) -> bool:
        """Record one evaluation; True when the run should stop."""
        better = (
            self.best is None
            or (self.spec.mode == "min" and value < self.best - self.spec.min_delta)
            or (self.spec.mode == "max" and value > self.best + self.spec.min_delta)
        )
        if better:
            self.best, self.since_best = value, 0
            return False
        self.since_best += 1
        return self.since_best >= self.spec.patience


@dataclasses.dataclass(frozen=True)
class FitResult:
    """How the last ``fit`` ended, for a script to check before exporting.

    reason: ``"completed"`` (reached ``steps``), ``"early_stopped"``,
      ``"interrupted"`` (SIGTERM/SIGINT), ``"stopped_by_hook"`` or
      ``"data_exhausted"`` (the training data ended before ``steps``: a reader that
      ends, such as ``Mixture(exhausted="stop")``).
    step: the step it ended at.
    detail: the signal, the metric and its best value, the hook's reason, or where
      the data ended.
    """

    reason: str
    step: int
    detail: str = ""

    @property
    def completed(self) -> bool:
        return self.reason == "completed"

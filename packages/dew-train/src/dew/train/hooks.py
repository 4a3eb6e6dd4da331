"""Hooks: what the loop does every N steps, the trainer's own and the user's.

The loop is ``data -> prepare -> updates -> hooks``. After every step the
trainer runs its own hooks (metrics and logging, evaluation and preview,
checkpoints, stop signals) and then each user hook whose ``every`` divides
the step, in the order they were added::

    def report(info):
        info.print(f"step {info.step}: {info.metrics.get('loss')}")

    trainer.add_hook(report, every=50)

A hook sees :class:`StepInfo`: the step just finished, the state after it,
the metrics of the last log interval (on log steps; else empty), and
``print``/``log``/``request_stop`` to talk to the run. No subclassing.
(Levanter's ``Trainer.add_hook`` and its default hooks are the model.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step.

    step: steps done (``state.step``).
    state: the ``TrainState`` after the step (arrays on the devices).
    metrics: the last log interval's reduced training metrics when this step
      logged, the latest evaluation's under ``eval/...`` when it evaluated;
      empty otherwise.
    """

    step: int
    state: Any
    metrics: Mapping[str, float]
    print: Callable[[str], None]
    log: Callable[..., None]
    _stop: list = dataclasses.field(default_factory=list, repr=False)

    def request_stop(self, reason: str) -> None:
        """End the run after this step (a checkpoint is written as on SIGTERM)."""
        self._stop.append(reason)


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(StepInfo)`` after every ``every``-th step.

    every: steps between calls (>= 1).
    name: shown in errors; defaults to the function's name.
    """

    fn: Callable[[StepInfo], Any]
    every: int = 1
    name: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"a hook must be callable, got {type(self.fn).__name__}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"hook every= must be an int >= 1 steps, got {self.every!r}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", type(self.fn).__name__))

    def due(self, step: int) -> bool:
        return step % self.every == 0


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
      ``"interrupted"`` (SIGTERM/SIGINT) or ``"stopped_by_hook"``.
    step: the step it ended at.
    detail: the signal, the metric and its best value, or the hook's reason.
    """

    reason: str
    step: int
    detail: str = ""

    @property
    def completed(self) -> bool:
        return self.reason == "completed"

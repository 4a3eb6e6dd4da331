"""The trainer's own hooks (:data:`dew.train.hooks.DEFAULT_HOOKS`): each takes its
settings when it is built and the run's context (the log, the time buckets, the
programs, the data) in ``start``; rejections, the log, evaluation and previews,
early stopping, stop signals (checkpoints: :mod:`dew.train._checkpointing`).
``Trainer.fit(log_every=, eval_every=, eval_batches=)`` are shorthands that build
them; ``trainer.replace_hook("log", LogMetrics(every=10))`` installs one of one's own.
"""

from __future__ import annotations

import time

from dew.nn.keywords import whole_number
from dew.objectives.contract import weighted as wt
from dew.train._run import ROLLOUT_SAMPLES, ROLLOUT_TOKENS, NonFiniteError
from dew.train.hooks import EarlyStopping, EarlyStoppingState, RunStart, StepInfo, StepReport
from dew.train.logs import MetricsLog, format_value
from dew.train.previews import as_pixels
from dew.train.step import Stream, microbatch_key
from dew.train.throughput import Throughput


def every_steps(hook: str, every, meaning: str) -> int:
    """``every`` as a whole number of steps >= 1, else a ValueError naming ``hook``."""
    return whole_number(every, "every", low=1, what=hook, meaning=meaning)


class DefaultHook:
    """What the trainer's own hooks share: the run's log and time buckets, taken in
    ``start``; nothing to finish or close."""

    log: MetricsLog
    goodput = None

    def start(self, run: RunStart) -> None:
        """Take the run's log and time buckets."""
        self.log, self.goodput = run.log, run.goodput

    def finish(self, info: StepInfo) -> StepReport | None:
        """Nothing: the hook acts on its steps only."""
        return None

    def close(self) -> None:
        """Nothing to close."""

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({settings})"

    def settings(self) -> dict:
        return {}


class Rejections(DefaultHook):
    """Counts consecutive steps whose loss or gradients were not finite: a line for
    each, :class:`dew.train.NonFiniteError` past ``Trainer(max_rejected=)``."""

    name = "rejections"

    def start(self, run: RunStart) -> None:
        super().start(run)
        self.objective_name = type(run.objective).__name__
        self.max_rejected = run.max_rejected
        self.run_of: list[int] = []  # the current run of rejected steps

    def run(self, info: StepInfo) -> None:
        if not info.step_metrics:
            return
        with self.goodput.measure("logging"):
            for step, values in info.step_metrics:
                self._account(step, values)

    finish = run

    def acts_at(self, step: int) -> bool:
        """Never by itself: it reads the metrics it is given, whenever they come."""
        return False

    def _account(self, step: int, values) -> None:
        if float(values["accepted"]) > 0:
            self.run_of.clear()
            return
        self.run_of.append(step)
        weight = float(values.get("loss_weight", 1.0))
        why = (
            f"the loss weight of the batch is {weight:g} ({self.objective_name}: nothing "
            f"in it counts, e.g. every target masked)"
            if not weight > 0
            else f"loss {format_value(float(values['loss']))} or its gradients not finite"
        )
        self.log.print(f"step {step}: rejected ({why}); nothing applied")
        if len(self.run_of) > self.max_rejected:
            raise NonFiniteError(
                f"{len(self.run_of)} consecutive steps had a non-finite loss or gradient "
                f"(steps {self.run_of}), more than max_rejected={self.max_rejected}; check "
                f"the data and the learning rate"
            )


class LogMetrics(DefaultHook):
    """The interval metrics and the ``step N: loss ...`` line every ``every`` steps;
    the throughput line (FLOPs, peak) before the first.

    every: steps between log lines (>= 1); None = no log lines, the throughput line
      only. ``Trainer.fit(log_every=)`` builds this hook (``log_every=0``: None).
    """

    name = "log"

    def __init__(self, *, every: int | None = 100):
        self.every = (
            None
            if every is None
            else every_steps("LogMetrics", every, "steps between log lines; None = none")
        )

    def settings(self) -> dict:
        return {"every": self.every}

    def start(self, run: RunStart) -> None:
        super().start(run)
        objective = run.objective
        self.headline = tuple(objective.headline_metrics)  # printed after the loss
        self.notes_fn = objective.log_notes  # warnings after the line (JEPA's collapse)
        self.rows = run.data.batch  # examples per step
        self.devices = run.devices
        self.peak_flops = run.peak_flops
        self.interval = Interval()
        self.throughput: Throughput | None = None

    def run(self, info: StepInfo) -> StepReport | None:
        is_log = self.every is not None and info.step % self.every == 0
        if not (is_log or info.step_metrics or info.is_first or info.prepare_seconds):
            return None  # nothing to add up or show at this step
        with self.goodput.measure("logging"):
            if info.is_first:
                self.throughput = Throughput(
                    info.step_flops,
                    self.devices,
                    peak_flops=self.peak_flops,
                    is_model_flops=info.is_model_flops,
                )
                self.log.print(self.throughput.line())
                # the log's rates leave out the step that compiled (this fit's first)
                self.interval.restart(untimed=1)
            self.interval.prepare_seconds += info.prepare_seconds
            for _, values in info.step_metrics:
                self.interval.add(values)
            if not is_log:
                return None
            values = self.interval.reduce(self.rows, "tokens")
            self.interval = Interval()
            rates = self._rates(values)
            shown = "".join(
                f"{k} {format_value(values[k])}, " for k in self.headline if k in values
            )
            line = f"step {info.step}: loss {format_value(values['loss'])}, {shown}{rates}"
            self.log.log(info.step, values, line=line)
            for note in self.notes_fn(info.step, values):
                self.log.print(note)
            return StepReport(metrics=values)

    def finish(self, info: StepInfo) -> None:
        for _, values in info.step_metrics:
            self.interval.add(values)

    def acts_at(self, step: int) -> bool:
        """A log step; this fit's first step (the throughput line)."""
        return (self.every is not None and step % self.every == 0) or self.throughput is None

    def _rates(self, values: dict) -> str:
        """``12,345 tokens/s, MFU 31.2%`` (examples/s when the objective counts no
        tokens); adds ``mfu`` and ``step_flops`` to ``values``."""
        if "tokens_per_second" in values:
            rate = f"{values['tokens_per_second']:,.0f} tokens/s"
        else:
            rate = f"{values['examples_per_second']:,.1f} examples/s"
        if "rollout_samples_per_second" in values:  # Flow-GRPO's images, in the prepare phase
            rate += f", rollout {values['rollout_samples_per_second']:,.1f} samples/s"
        if self.throughput is None:
            return rate
        mfu = self.throughput.mfu(values["step_seconds"])
        values["mfu"], values["step_flops"] = mfu, self.throughput.step_flops
        return f"{rate}, MFU {100 * mfu:.2f}%" if mfu == mfu else f"{rate}, MFU n/a"


class Evaluation(DefaultHook):
    """``objective.evaluate`` over the validation data, then a preview, every
    ``every`` steps, on the weights ``state.variables()`` gives (the moving
    average where the objective evaluates with it: ``eval (ema)`` in the log).
    The hooks after it see the results as ``info.evaluation`` and under
    ``eval/...`` in ``info.metrics``.

    every: steps between evaluations (>= 1).
    batches: stop each evaluation after this many batches (>= 1); None = all.
    ``Trainer.fit(eval_every=, eval_batches=)`` builds this hook.
    """

    name = "evaluation"

    def __init__(self, *, every: int, batches: int | None = None):
        self.every = every_steps("Evaluation", every, "steps between evaluations")
        self.batches = (
            None
            if batches is None
            else whole_number(
                batches,
                "batches",
                low=1,
                what="Evaluation",
                meaning="batches per evaluation; None = all",
            )
        )

    def settings(self) -> dict:
        return {"every": self.every, "batches": self.batches}

    def start(self, run: RunStart) -> None:
        super().start(run)
        self.programs, self.data, self.partition = run.programs, run.data, run.partition

    def run(self, info: StepInfo) -> StepReport | None:
        if info.step % self.every:
            return None
        with self.goodput.measure("eval"):
            results = self._evaluate(info.state, info.step)
        return StepReport(
            metrics={f"eval/{k}": v for k, v in results.items()}, evaluation=results or None
        )

    def acts_at(self, step: int) -> bool:
        return step % self.every == 0

    def _evaluate(self, state, step: int) -> dict[str, float]:
        objective = self.programs.objective
        batches = self.batches or 0
        results = self.programs.evaluate(state, self.data.val, self.partition, batches)
        averaged = state.evaluate_averaged and state.averaged is not None
        if results and averaged:
            # the live weights too: a short run's average may lag them (issue 42)
            live = self.programs.evaluate(
                state, self.data.val, self.partition, batches, averaged=False
            )
            results = {**results, **{f"live/{k}": v for k, v in live.items()}}
        if results:
            ema = " (ema; live/ = the live weights)" if averaged else ""
            shown = ", ".join(f"{k} {format_value(v)}" for k, v in results.items())
            self.log.log(
                step,
                {**results, "ema": float(averaged)},
                kind="eval",
                line=f"eval{ema} step {step}: {shown}",
            )
        if objective.has_preview:
            key = microbatch_key(state.key, state.step, Stream.PREVIEW)
            self._show(step, objective.preview(state.variables(), key))
        return results

    def _show(self, step: int, sample) -> None:
        pixels = as_pixels(sample)
        if pixels is not None:
            path = self.log.image(step, "preview", pixels)
            shape = "x".join(map(str, pixels.shape))
            self.log.print(f"preview step {step}: uint8 {shape}" + (f", {path}" if path else ""))
        elif sample is not None:
            if isinstance(sample, str):
                self.log.text(step, "preview", sample)
            self.log.print(
                f"preview step {step}: {sample!r}"
                if isinstance(sample, str)
                else f"preview step {step}: {type(sample).__name__}"
            )


class EarlyStop(DefaultHook):
    """Stops the run when an evaluation metric has not improved for ``patience``
    evaluations (it reads ``info.evaluation``, which the ``evaluation`` hook before
    it reports).

    spec: an :class:`dew.train.EarlyStopping`; or its settings as keywords
      (``EarlyStop(metric="loss", patience=2)``). ``Trainer(early_stopping=)``
      builds this hook.
    """

    name = "early_stopping"

    def __init__(self, spec: EarlyStopping | None = None, **settings):
        if spec is not None and settings:
            raise ValueError(
                f"EarlyStop takes an EarlyStopping or its settings as keywords, not both: "
                f"got {spec!r} and {sorted(settings)}"
            )
        if spec is not None and not isinstance(spec, EarlyStopping):
            raise TypeError(
                f"EarlyStop needs a dew.train.EarlyStopping (e.g. EarlyStopping(metric="
                f"'loss', patience=3)), got {type(spec).__name__}"
            )
        self.spec = spec if spec is not None else EarlyStopping(**settings)

    def settings(self) -> dict:
        return {"spec": self.spec}

    def start(self, run: RunStart) -> None:
        super().start(run)
        self.state = EarlyStoppingState(self.spec)

    def run(self, info: StepInfo) -> None:
        results = info.evaluation
        if not results:
            return
        metric = self.spec.metric
        if metric not in results:
            raise ValueError(
                f"early_stopping watches {metric!r}, which evaluation does not report; "
                f"it reports {sorted(results)}"
            )
        if self.state.update(float(results[metric])):
            detail = (
                f"{metric} did not improve on {self.state.best:.6g} for "
                f"{self.spec.patience} evaluations"
            )
            self.log.print(f"Stopping early at step {info.step}: {detail}")
            info.stop("early_stopped", detail)

    def acts_at(self, step: int) -> bool:
        """Only on an evaluation's results (the evaluation's step)."""
        return False


class StopSignalsHook(DefaultHook):
    """SIGTERM / SIGINT (on any process) end the run at the next data-batch
    boundary (:mod:`dew.train.preemption`); the run's signal handlers come in
    ``start``."""

    name = "stop_signals"

    def start(self, run: RunStart) -> None:
        super().start(run)
        self.signals = run.signals

    def run(self, info: StepInfo) -> None:
        if info.at_boundary and self.signals.requested(info.step):
            info.stop("interrupted", str(self.signals.received))

    def acts_at(self, step: int) -> bool:
        """A stop prints nothing here and needs no metrics (``finish`` fetches them)."""
        return False


class Interval:
    """Training metrics added up over the steps between two log lines."""

    def __init__(self):
        self.start = self.began = time.perf_counter()
        self.steps = 0
        self.accepted = 0
        self.weighted: dict | None = None
        self.plain: dict[str, float] = {}
        # (the values' keys, the Weighted / Summed names, the plain names) of the last add
        self._names: tuple = ((), (), ())
        self.last: dict[str, float] = {}
        # seconds of the prepare phases (rollouts) that fed this interval
        self.prepare_seconds = 0.0
        # steps run before ``start`` (the first step, with its compilation)
        self.untimed = 0

    def restart(self, untimed: int) -> None:
        """Time the interval from now: the ``untimed`` steps already run (the first,
        which compiled the step) do not count in its rates."""
        self.start, self.untimed = time.perf_counter(), untimed

    def add(self, values) -> None:
        self.steps += 1
        if float(values["accepted"]) <= 0:
            return
        self.accepted += 1
        if self.weighted is not None and values.keys() == self._names[0]:
            # the names sorted once per interval: the same additions, in the same order,
            # without wt.add's tree flattening or a type check per value
            _, weighted_names, plain_names = self._names
            summed = self.weighted
            self.weighted = {k: summed[k] + values[k] for k in weighted_names}
            plain = self.plain
            for k in plain_names:
                plain[k] = plain.get(k, 0.0) + float(values[k])
        else:
            weighted = {k: v for k, v in values.items() if wt.is_metric(v)}
            self.weighted = weighted if self.weighted is None else wt.add(self.weighted, weighted)
            plain_names = tuple(
                k
                for k, v in values.items()
                if not wt.is_metric(v) and k not in ("accepted", "loss_weight", "learning_rate")
            )
            for k in plain_names:
                self.plain[k] = self.plain.get(k, 0.0) + float(values[k])
            self._names = (values.keys(), tuple(weighted), plain_names)
        if "learning_rate" in values:
            self.last["learning_rate"] = float(values["learning_rate"])

    def reduce(self, examples_per_step: int, tokens_key: str | None) -> dict[str, float]:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        out: dict[str, float] = {}
        if self.accepted:
            out.update({k: v / self.accepted for k, v in self.plain.items()})
            out.update(wt.to_float(self.weighted or {}))
        else:
            out["loss"] = float("nan")
        out.update(self.last)
        out["rejected_fraction"] = 1.0 - self.accepted / max(self.steps, 1)
        timed = self.steps - self.untimed
        if timed <= 0:  # only the untimed steps: time them from the interval's creation
            timed, seconds = self.steps, max(time.perf_counter() - self.began, 1e-9)
        out["step_seconds"] = seconds / max(timed, 1)
        out["examples_per_second"] = examples_per_step * timed / seconds
        if tokens_key is not None and self.weighted and tokens_key in self.weighted:
            # the timed steps' share of the tokens
            tokens = float(self.weighted[tokens_key].total) * timed / max(self.steps, 1)
            out["tokens_per_second"] = tokens / seconds
        if self.prepare_seconds > 0:
            # the prepare phases (rollouts) of this interval, apart from its steps
            out["prepare_seconds"] = self.prepare_seconds
        if self.prepare_seconds > 0 and self.weighted and ROLLOUT_TOKENS in self.weighted:
            # an objective counts each prepared batch's rollout tokens once (its
            # first epoch): exact when log_every is a multiple of the updates per batch
            rollout = float(self.weighted[ROLLOUT_TOKENS].total)
            out["rollout_tokens_per_second"] = rollout / self.prepare_seconds
        if self.prepare_seconds > 0 and self.weighted and ROLLOUT_SAMPLES in self.weighted:
            # images (Flow-GRPO) a rollout drew, counted once per prepared batch likewise
            rollout = float(self.weighted[ROLLOUT_SAMPLES].total)
            out["rollout_samples_per_second"] = rollout / self.prepare_seconds
        return out

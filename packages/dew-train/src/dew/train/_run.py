"""One ``fit``'s hooks and their bookkeeping: interval metrics, rejected
steps, evaluation and preview, checkpoints, early stopping, stop requests,
then the user's hooks (:mod:`dew.train.hooks`)."""

from __future__ import annotations

import inspect
import time
from typing import Any

import jax

from dew.objectives import weighted as wt
from dew.train.hooks import EarlyStoppingState, FitResult, StepInfo
from dew.train.logs import format_value
from dew.train.previews import as_pixels
from dew.train.step import Stream, microbatch_key

ROLLOUT_TOKENS = "rollout_tokens"
"""The ``Summed`` metric of tokens an objective's prepare phase generated; with
it the log shows ``rollout_tokens_per_second`` (over the prepare time)."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class Run:
    """One ``fit``'s hooks and their bookkeeping (interval metrics, rejections,
    evaluations, checkpoints, stop requests)."""

    def __init__(self, *, trainer, **fields):
        self.trainer = trainer
        self.__dict__.update(fields)
        # (step, packed metrics, their Packing), fetched together at the next flush
        self.pending: list[tuple[int, Any, Any]] = []
        self.rejected_run: list[int] = []
        self.interval = Interval()
        self.stop = None
        self.stopped: tuple[str, str] | None = None
        self.early = EarlyStoppingState(trainer.early_stopping) if trainer.early_stopping else None
        self.last_eval: dict[str, float] = {}
        self.last_eval_step: int | None = None
        # the step's FLOPs and the devices' peak (dew.train.throughput), set once
        # the step is compiled
        self.throughput = None
        # how the compiled step packs its metrics (dew.train.packing)
        self.packing = None

    # the trainer's own hooks, in order
    def after_step(self, step: int, state, metrics, *, at_boundary: bool) -> bool:
        """Run the hooks after ``step``; True = end the run now."""
        t = self.trainer
        self.pending.append((step, metrics, self.packing))
        is_log = bool(self.log_every) and step % self.log_every == 0
        requested = at_boundary and self.stop.requested(step)
        logged: dict[str, float] = {}
        if is_log or len(self.pending) >= max(t.max_rejected, 1) or step == self.steps or requested:
            logged = self._flush(step, is_log)
        info_metrics = dict(logged)
        if self.eval_every and step % self.eval_every == 0:
            with self.goodput.measure("eval"):
                results = self._evaluate(state, step)
            info_metrics.update({f"eval/{k}": v for k, v in results.items()})
        if (
            at_boundary
            and self.session is not None
            and (self.checkpoint_every and step % self.checkpoint_every == 0)
        ):
            with self.goodput.measure("checkpoint"):
                self._save(step, state)
        user = self._user_hooks(step, state, info_metrics)
        if requested:
            self.stopped = ("interrupted", str(self.stop.received))
            return True
        if at_boundary and self.stopped is not None:
            return True
        if user and at_boundary:
            self.stopped = ("stopped_by_hook", "; ".join(user))
            return True
        return False

    def _flush(self, step: int, is_log: bool) -> dict[str, float]:
        with self.goodput.measure("steps"):
            packed = jax.device_get([m for _, m, _ in self.pending])
            fetched = [p.unpack(m) for (_, _, p), m in zip(self.pending, packed)]
        with self.goodput.measure("logging"):
            for (s, _, _), values in zip(self.pending, fetched):
                self._account(s, values)
                self.interval.add(values)
            self.pending = []
            if not is_log:
                return {}
            values = self.interval.reduce(self.data.batch, self.tokens_key)
            self.interval = Interval()
            rates = self._rates(values)
            line = f"step {step}: loss {format_value(values['loss'])}, {rates}"
            self.log.log(step, values, line=line)
            for note in self.trainer.objective.log_notes(step, values):
                self.log.print(note)
            return values

    def _rates(self, values: dict) -> str:
        """``12,345 tokens/s, MFU 31.2%`` (examples/s when the objective counts no
        tokens); adds ``mfu`` and ``step_flops`` to ``values``."""
        if "tokens_per_second" in values:
            rate = f"{values['tokens_per_second']:,.0f} tokens/s"
        else:
            rate = f"{values['examples_per_second']:,.1f} examples/s"
        if self.throughput is None:
            return rate
        mfu = self.throughput.mfu(values["step_seconds"])
        values["mfu"], values["step_flops"] = mfu, self.throughput.step_flops
        return f"{rate}, MFU {100 * mfu:.2f}%" if mfu == mfu else f"{rate}, MFU n/a"

    def _account(self, step: int, values) -> None:
        t = self.trainer
        if float(values["accepted"]) > 0:
            self.rejected_run.clear()
            return
        self.rejected_run.append(step)
        weight = float(values.get("loss_weight", 1.0))
        why = (
            f"the loss weight of the batch is {weight:g} ({type(t.objective).__name__}: nothing "
            f"in it counts, e.g. every target masked)"
            if not weight > 0
            else f"loss {format_value(float(values['loss']))} or its gradients not finite"
        )
        self.log.print(f"step {step}: rejected ({why}); nothing applied")
        if len(self.rejected_run) > t.max_rejected:
            raise NonFiniteError(
                f"{len(self.rejected_run)} consecutive steps had a non-finite loss or gradient "
                f"(steps {self.rejected_run}), more than max_rejected={t.max_rejected}; check "
                f"the data and the learning rate"
            )

    def _evaluate(self, state, step: int) -> dict[str, float]:
        t = self.trainer
        results = t._eval_results(state, self.data, self.partition, self.eval_batches)
        if results:
            ema = " (ema)" if t._uses_ema(state) else ""
            shown = ", ".join(f"{k} {format_value(v)}" for k, v in results.items())
            self.log.log(
                step,
                {**results, "ema": float(bool(ema))},
                kind="eval",
                line=f"eval{ema} step {step}: {shown}",
            )
            self.last_eval, self.last_eval_step = results, step
            if self.session is not None and hasattr(self.session, "check_best_metric"):
                self.session.check_best_metric(set(results))
            if self.early is not None:
                metric = t.early_stopping.metric
                if metric not in results:
                    raise ValueError(
                        f"early_stopping watches {metric!r}, which evaluation does not report; "
                        f"it reports {sorted(results)}"
                    )
                if self.early.update(float(results[metric])):
                    self.stopped = (
                        "early_stopped",
                        f"{metric} did not improve on {self.early.best:.6g} for "
                        f"{t.early_stopping.patience} evaluations",
                    )
                    self.log.print(f"Stopping early at step {step}: {self.stopped[1]}")
        if t.objective.has_preview:
            variables = state.variables(averaged=t._uses_ema(state))
            sample = t.objective.preview(
                variables, microbatch_key(state.key, state.step, Stream.PREVIEW)
            )
            pixels = as_pixels(sample)
            if pixels is not None:
                path = self.log.image(step, "preview", pixels)
                shape = "x".join(map(str, pixels.shape))
                self.log.print(
                    f"preview step {step}: uint8 {shape}" + (f", {path}" if path else "")
                )
            elif sample is not None:
                self.log.print(
                    f"preview step {step}: {sample!r}"
                    if isinstance(sample, str)
                    else f"preview step {step}: {type(sample).__name__}"
                )
        return results

    def _save(self, step: int, state) -> None:
        kwargs = {}
        # keep_best ranks a checkpoint by the evaluation of its own weights only
        fresh = self.last_eval if self.last_eval_step == step else None
        if fresh and "metrics" in inspect.signature(self.session.save).parameters:
            kwargs["metrics"] = fresh
        self.session.save(step, state, self.train_iter, self.meta, **kwargs)
        self.saved_at = step

    def _user_hooks(self, step: int, state, metrics) -> list[str]:
        requests: list[str] = []
        for hook in self.trainer.hooks:
            if not hook.due(step):
                continue
            info = StepInfo(
                step=step,
                state=state,
                metrics=metrics,
                print=self.log.print,
                log=lambda values, kind="hook", _s=step: self.log.log(_s, values, kind=kind),
            )
            with self.goodput.measure("logging"):
                hook.fn(info)
            requests += [f"{hook.name}: {r}" for r in info._stop]
        return requests

    def finish(self, step: int, state) -> None:
        if self.session is None:
            return
        with self.goodput.measure("checkpoint"):
            if self.saved_at != step:
                self._save(step, state)
            self.session.wait()

    def result(self, step: int) -> FitResult:
        if self.stopped is None:
            return FitResult(reason="completed", step=step)
        reason, detail = self.stopped
        return FitResult(reason=reason, step=step, detail=detail)


class Interval:
    """Training metrics added up over the steps between two log lines."""

    def __init__(self):
        self.start = self.began = time.perf_counter()
        self.steps = 0
        self.accepted = 0
        self.weighted: dict | None = None
        self.plain: dict[str, float] = {}
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
        weighted = {k: v for k, v in values.items() if wt.is_metric(v)}
        self.weighted = weighted if self.weighted is None else wt.add(self.weighted, weighted)
        for k, v in values.items():
            if not wt.is_metric(v) and k not in ("accepted", "loss_weight", "learning_rate"):
                self.plain[k] = self.plain.get(k, 0.0) + float(v)
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
        return out

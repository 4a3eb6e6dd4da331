"""Running the installed hooks over ``training_steps``' records: the metrics
that leave the devices, the stop requests, the end of the run
(:mod:`dew.train.hooks`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dew.train.goodput import Goodput
from dew.train.hooks import FitResult, Hook, Installed, StepInfo, StepRequests

ROLLOUT_TOKENS = "rollout_tokens"
"""The ``Summed`` metric of tokens an objective's prepare phase generated; with
it the log shows ``rollout_tokens_per_second`` (over the prepare time)."""
ROLLOUT_SAMPLES = "rollout_samples"
"""The ``Summed`` metric of samples (images) a prepare phase drew (Flow-GRPO); with it
the log shows ``rollout_samples_per_second``."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class Pending:
    """Packed metrics of the steps since the last fetch, fetched together.

    every: fetch after this many steps even without a log line (so rejections
      are counted in time: ``max(max_rejected, 1)``). Such a fetch, on a step
      where no hook acts (:meth:`dew.train.hooks.Installed.acts_at`), leaves the
      newest step's metrics for the next fetch: that step may still be running,
      the earlier ones are done, so the fetch does not drain the devices' queue.
    """

    log_every: int
    every: int
    steps: int
    items: list[tuple[int, Any, Any]] = dataclasses.field(default_factory=list)

    def add(self, step: int, metrics, packing) -> None:
        self.items.append((step, metrics, packing))

    def due(self, step: int) -> bool:
        """Every pending step's metrics are needed now: a log step, the last step."""
        return bool(self.log_every and step % self.log_every == 0) or step == self.steps

    def counted(self) -> bool:
        """``every`` steps are pending: the rejection count should see them."""
        return len(self.items) >= self.every

    def fetch(self, *, keep: int = 0) -> list[tuple[int, dict]]:
        """The pending steps' metrics but the newest ``keep``, unpacked."""
        taken = self.items[: len(self.items) - keep]
        if not taken:
            return []
        packed = jax.device_get([m for _, m, _ in taken])
        fetched = [(s, p.unpack(m)) for (s, _, p), m in zip(taken, packed)]
        self.items = self.items[len(taken) :]
        return fetched


class HookRunner:
    """Runs ``hooks`` after each step and once at the end; decides when the run stops.

    A stop request ends the run at the next data-batch boundary: SIGTERM
    (``interrupted``) before any other, else the first request made.
    """

    def __init__(
        self,
        hooks: Sequence[Installed],
        *,
        pending: Pending,
        goodput: Goodput,
        print_fn: Callable[[str], None],
        log_fn: Callable[..., None],
        save_fn: Callable[..., None] | None,
    ):
        self.hooks = list(hooks)
        self.pending = pending
        self.goodput = goodput
        self.print_fn = print_fn
        self.log_fn = log_fn
        self.save_fn = save_fn
        self.stopped: tuple[str, str] | None = None
        self._acts = [hook.acts_at for hook in self.hooks]

    def info(
        self,
        step: int,
        state,
        step_metrics: list,
        *,
        at_boundary: bool = True,
        step_flops: float = 0.0,
        is_model_flops: bool = False,
        prepare_seconds: float = 0.0,
        is_first: bool = False,
    ) -> StepInfo:
        return StepInfo(
            step=step,
            state=state,
            print=self.print_fn,
            at_boundary=at_boundary,
            step_metrics=tuple(step_metrics),
            step_flops=step_flops,
            is_model_flops=is_model_flops,
            prepare_seconds=prepare_seconds,
            is_first=is_first,
            requests=StepRequests(self.log_fn, self.save_fn),
        )

    def after_step(self, record) -> bool:
        """Run the hooks after ``record``'s step; True = end the run now."""
        pending = self.pending
        step = record.step
        pending.add(step, record.metrics, record.compiled.packing)
        fetched = []
        if pending.due(step) or pending.counted():
            # only the rejection count reads them: leave this step's, still running
            keep = 0 if pending.due(step) or any(acts(step) for acts in self._acts) else 1
            with self.goodput.measure("steps"):
                fetched = pending.fetch(keep=keep)
        info = self.info(
            step,
            record.state,
            fetched,
            at_boundary=record.at_boundary,
            step_flops=record.compiled.mfu_flops,
            is_model_flops=record.compiled.model_flops is not None,
            prepare_seconds=record.prepare_seconds,
            is_first=record.is_first,
        )
        self._run(info, finish=False)
        return record.at_boundary and self.stopped is not None

    def data_ended(self, step: int, steps: int) -> None:
        """The training data ended after ``step`` of ``steps``: the run ends there."""
        if self.stopped is None:
            self.stopped = (
                "data_exhausted",
                f"the training data ended after step {step} of {steps} (a reader that ends, "
                f"e.g. Mixture(exhausted='stop')); a checkpoint of step {step} is written "
                f"as at any end of a run",
            )

    def finish(self, step: int, state) -> StepInfo:
        """The end of the run: the metrics still on the devices, then each hook's
        ``finish`` (the final checkpoint); returns the final step's info."""
        with self.goodput.measure("steps"):
            fetched = self.pending.fetch()
        return self._run(self.info(step, state, fetched), finish=True)

    def _run(self, info: StepInfo, *, finish: bool) -> StepInfo:
        """Each hook in order, each seeing the record the ones before it left
        (:meth:`StepInfo.after`); returns the last one."""
        users: list[str] = []
        requests = info.requests.stops
        for hook in self.hooks:
            before = len(requests)
            call = hook.finish if finish else hook.run
            if isinstance(hook, Hook):  # a user's function: its time is "logging"
                with self.goodput.measure("logging"):
                    report = call(info)
            else:  # the default hooks measure their own buckets
                report = call(info)
            info = info.after(report)
            if len(requests) == before:
                continue
            for kind, detail in requests[before:]:
                if kind == "stopped_by_hook":
                    users.append(f"{hook.name}: {detail}")
                elif kind == "interrupted" or self.stopped is None:
                    if self.stopped is None or self.stopped[0] != "interrupted":
                        self.stopped = (kind, detail)
        if users and self.stopped is None:
            self.stopped = ("stopped_by_hook", "; ".join(users))
        return info

    def result(self, step: int) -> FitResult:
        if self.stopped is None:
            return FitResult(reason="completed", step=step)
        reason, detail = self.stopped
        return FitResult(reason=reason, step=step, detail=detail)

"""The ``checkpoints`` hook: the one owner of a run's checkpoints.

:class:`Checkpointing` opens the directory (when it is built, so an unwritable
one fails before anything else), restores the newest usable checkpoint and
puts the data stream where it left off (``start``), saves on its cadence or
its policy's, ranking each for ``keep_best`` by its own step's evaluation
(``run``), writes the final checkpoint and waits for the writes (``finish``)
and closes the directory (``close``). ``Trainer(checkpoints=...)`` installs one;
``trainer.replace_hook("checkpoints", ...)`` replaces all of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dew.nn.keywords import whole_number
from dew.train.checkpoints import Checkpoints, Restored, resume_position
from dew.train.hooks import Resume, RunStart, StepInfo, StepReport


class Checkpointing:
    """Restores a run from ``checkpoints`` and writes its checkpoints.

    checkpoints: a :class:`dew.train.Checkpoints` (directory, ``keep``,
      ``keep_best``, ``use_async``, ...).
    every: a checkpoint every this many steps (>= 1) at a data-batch boundary, and
      one at the end; None = only at the end. ``Trainer.fit(checkpoint_every=)``
      sets it on the default hook (``checkpoint_every=0``: None).
    policy: a checkpoint policy of one's own instead: ``policy(StepInfo)`` after
      every step, writing with ``info.save_checkpoint(metrics)`` when it chooses;
      no other checkpoint is written (none at the end unless the policy writes
      it)::

          def policy(info):
              if info.at_boundary and info.metrics.get("eval/loss", 9) < 1.0:
                  info.save_checkpoint(info.evaluation)

          trainer.replace_hook("checkpoints", Checkpointing(Checkpoints(d), policy=policy))
    """

    name = "checkpoints"

    def __init__(
        self,
        checkpoints: Checkpoints,
        *,
        every: int | None = None,
        policy: Callable[[StepInfo], Any] | None = None,
    ):
        if not isinstance(checkpoints, Checkpoints):
            raise TypeError(
                f"Checkpointing needs a dew.train.Checkpoints (e.g. Checkpoints('runs/x')), "
                f"got {type(checkpoints).__name__}"
            )
        if every is not None:
            every = whole_number(
                every,
                "every",
                low=1,
                what="Checkpointing",
                meaning="steps between checkpoints; None = only at the end",
            )
        if policy is not None and not callable(policy):
            raise TypeError(f"Checkpointing policy must be callable, got {type(policy).__name__}")
        if policy is not None and every is not None:
            raise ValueError(
                f"Checkpointing(every={every}, policy=...): the policy decides when to save; "
                f"drop every= (or the policy)"
            )
        self.checkpoints = checkpoints
        self.every = every
        self.policy = policy
        self._print: Callable[[str], None] = print
        # checks the directory can be written, before anything else of the run
        self.session = checkpoints.open(print_fn=lambda line: self._print(line))
        self._batches: Iterator | None = None
        self._meta: dict = {}
        self._goodput = None
        self.saved_at: int | None = None
        self._last_eval: tuple[int, dict] | None = None

    def path(self, step: int) -> str:
        return self.session.path(step)

    # ------------------------------------------------------------ lifecycle
    def start(self, run: RunStart) -> Resume:
        """Restore the newest usable checkpoint (None in a directory without one)."""
        self._print, self._meta, self._goodput = run.print, run.meta, run.goodput
        self._batches, self.saved_at, self._last_eval = None, None, None
        with run.goodput.measure("checkpoint"), run.context():
            restored = self.session.restore(
                run.abstract,
                run.shardings,
                root_key=run.root_key,
                init_opt_state=run.init_opt_state,
                model=run.model,
            )
        if restored is not None:
            self.saved_at = restored.step

        def open_batches() -> Iterator:
            self._batches = resume_position(
                run.open_batches(), _batches_view(restored, run.per_batch), print_fn=run.print
            )
            return self._batches

        return Resume(restored=restored, open_batches=open_batches, save=self.save)

    def __repr__(self) -> str:
        return f"Checkpointing({self.checkpoints!r}, every={self.every!r}, policy={self.policy!r})"

    def run(self, info: StepInfo) -> StepReport | None:
        if info.evaluation:
            self.session.check_best_metric(set(info.evaluation))
            self._last_eval = (info.step, dict(info.evaluation))
        if self.policy is not None:
            with self._goodput.measure("checkpoint"):
                self.policy(info)
            return None
        every = self.every
        if info.at_boundary and every is not None and info.step % every == 0:
            with self._goodput.measure("checkpoint"):
                return StepReport(checkpoint=self.save(info.step, info.state, info.evaluation))
        return None

    def finish(self, info: StepInfo) -> StepReport | None:
        """The final checkpoint (unless this step has one, or a policy decides), then
        wait until every write is on disk."""
        with self._goodput.measure("checkpoint"):
            if self.policy is None and self.saved_at != info.step:
                # keep_best ranks a checkpoint by the evaluation of its own weights only
                last = self._last_eval
                fresh = last[1] if last and last[0] == info.step else None
                self.save(info.step, info.state, fresh)
            self.session.wait()
        if self.saved_at == info.step:
            return StepReport(checkpoint=self.path(info.step))
        return None

    def close(self) -> None:
        self.session.close()

    def acts_at(self, step: int) -> bool:
        """A checkpoint step (a step with an evaluation is the evaluation's); every
        step under a policy (it reads the state when it chooses)."""
        return self.policy is not None or (self.every is not None and step % self.every == 0)

    # ----------------------------------------------------------------- save
    def save(self, step: int, state, metrics: Mapping[str, float] | None = None) -> str:
        """Start writing a checkpoint of ``state`` at ``step`` with the data
        stream's position; returns its directory. (Its time counts in the caller's
        goodput bucket: ``checkpoint`` for this hook's own saves.)"""
        if self._batches is None:
            raise RuntimeError(
                "Checkpointing.save before the run's data stream was opened: a checkpoint "
                "is written from a hook, after a step"
            )
        self.session.save(step, state, self._batches, self._meta, metrics=metrics or None)
        self.saved_at = step
        return self.path(step)


def _batches_view(restored: Restored | None, per_batch: int) -> Restored | None:
    """``restored`` as the data stream sees it: one batch per ``per_batch`` steps."""
    if restored is None or per_batch == 1:
        return restored
    return dataclasses.replace(restored, step=restored.step // per_batch)

"""Where metrics go: stdout lines (or a progress bar on a TTY), a JSONL file
and TensorBoard event files in the run directory, and any experiment trackers
(`dew.train.trackers`: Weights & Biases, MLflow)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence

from dew.train.trackers import Tracker

METRICS = "metrics.jsonl"
SUPERSEDED = "metrics.superseded.jsonl"


def format_value(value: float) -> str:
    if isinstance(value, str):
        return value
    if value != value or math.isinf(value):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


class MetricsLog:
    """Writes one record per log step.

    run_dir: directory for ``metrics.jsonl`` and TensorBoard events; None =
      stdout only.
    is_main: only the main process (``jax.process_index() == 0``) writes.
    progress: a tqdm bar on a TTY; None decides from ``sys.stdout.isatty()``.
    total_steps: the step the run ends at (the progress bar's total).
    start_step: the step training starts from, when known now; None = call
      :meth:`start` once it is (after restoring a checkpoint).
    examples_per_step: examples in one global batch (examples/s on the bar).
    trackers: experiment trackers (:mod:`dew.train.trackers`) that get every
      record this log writes; closed by :meth:`close`.

    ``metrics.jsonl`` holds each step once. A run that resumes at step S from a
    checkpoint (``start(S)``) moves the rows a killed run wrote after S, which
    the resumed run writes again, to ``metrics.superseded.jsonl`` with
    ``"superseded": true`` and ``"resumed_from": S``.
    """

    def __init__(
        self,
        run_dir: str | None,
        *,
        is_main: bool = True,
        progress: bool | None = None,
        total_steps: int = 0,
        start_step: int | None = None,
        examples_per_step: int = 0,
        trackers: Sequence[Tracker] = (),
    ):
        for tracker in trackers:
            if not isinstance(tracker, Tracker):
                raise TypeError(
                    f"trackers must have log(step, values, kind) and close(), got "
                    f"{type(tracker).__name__}; use dew.train.trackers.WandbTracker, "
                    f"MLflowTracker or a class of your own with those two methods"
                )
        self.is_main = is_main
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.examples_per_step = examples_per_step
        self._jsonl = None
        self._tb = None
        self._bar = None
        self.trackers = list(trackers)
        self._last_time = time.perf_counter()
        self._last_step = start_step or 0
        if not is_main:
            return
        if run_dir is not None:
            try:
                os.makedirs(run_dir, exist_ok=True)
                self._jsonl = open(os.path.join(run_dir, METRICS), "a")
            except OSError as error:
                raise PermissionError(
                    f"cannot write metrics to {run_dir!r} ({type(error).__name__}: {error}); "
                    f"choose a run_dir this process can create and write"
                ) from error
            import tensorboardX  # noqa: F401  (fail here, not at the first log step)
        if progress is None:
            progress = sys.stdout.isatty()
        self._progress = progress
        if start_step is not None:
            self.start(start_step)
        elif progress:
            self._open_bar(0)

    def start(self, step: int) -> None:
        """Training (re)starts at ``step``: the progress bar begins there, and rows
        of ``metrics.jsonl`` after ``step`` move to ``metrics.superseded.jsonl``."""
        self._last_time, self._last_step = time.perf_counter(), step
        if not self.is_main:
            return
        if self._jsonl is not None:
            self._supersede_after(step)
        if self.run_dir is not None and self._tb is None:
            self._open_tensorboard(step)
        if self._progress:
            self._open_bar(step)

    def _supersede_after(self, step: int) -> None:
        """Move the rows with a step after ``step`` (and a line torn by a kill) out
        of ``metrics.jsonl``: the run goes on from ``step`` and writes them again."""
        path = os.path.join(self.run_dir, METRICS)
        self._jsonl.flush()
        with open(path) as f:
            text = f.read()
        kept, moved = [], []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                later = int(row["step"]) > step
            except (ValueError, KeyError, TypeError):  # torn by a kill mid-write
                row, later = {"unreadable": line}, True
            if later:
                moved.append({**row, "superseded": True, "resumed_from": step})
            else:
                kept.append(line)
        if not moved and (not text or text.endswith("\n")):
            return
        with open(os.path.join(self.run_dir, SUPERSEDED), "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in moved)
            f.flush()
            os.fsync(f.fileno())
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        self._jsonl.close()
        os.replace(temporary, path)  # atomic: a reader sees the old file or the new
        self._jsonl = open(path, "a")
        if moved:
            self.print(
                f"Training from step {step}: {len(moved)} row(s) of {path} written after "
                f"step {step} by an earlier run moved to {SUPERSEDED}"
            )

    def _open_tensorboard(self, step: int | None) -> None:
        """The event writer; on a restart at ``step`` over earlier event files it
        starts with a purge marker at ``step + 1``: TensorBoard hides the earlier
        runs' events after ``step``, as ``metrics.jsonl`` moves its rows."""
        from tensorboardX import SummaryWriter

        directory = os.path.join(self.run_dir, "tensorboard")
        earlier = os.path.isdir(directory) and any(
            name.startswith("events.") for name in os.listdir(directory)
        )
        purge_step = step + 1 if step is not None and earlier else None
        # tensorboardX names the file by the second and opens it "wb": a second
        # writer within the same second would overwrite the first run's events
        suffix = f".{time.time_ns()}"
        self._tb = SummaryWriter(directory, purge_step=purge_step, filename_suffix=suffix)

    def _open_bar(self, step: int) -> None:
        from tqdm import tqdm

        if self._bar is not None:
            self._bar.close()
        # tqdm shows step/total, steps per second and the ETA; the postfix
        # adds the loss and examples per second at each log step.
        self._bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True)

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` (cheap; called every step)."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def print(self, line: str) -> None:
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def log(
        self,
        step: int,
        metrics: Mapping[str, float],
        *,
        kind: str = "train",
        line: str | None = None,
    ) -> None:
        """Record ``metrics`` at ``step``; ``line`` is what stdout shows."""
        if not self.is_main:
            return
        now = time.perf_counter()
        record = {"step": step, "kind": kind, "time": time.time(), **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, default=float) + "\n")
            self._jsonl.flush()
        if self.run_dir is not None and self._tb is None:
            self._open_tensorboard(None)
        if self._tb is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(f"{kind}/{name}", value, step)
        for tracker in self.trackers:
            tracker.log(step, metrics, kind)
        if self._bar is not None and kind == "train":
            rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
            postfix = {"loss": format_value(metrics.get("loss", float("nan")))}
            if self.examples_per_step:
                postfix["examples_per_s"] = f"{rate * self.examples_per_step:.1f}"
            self._bar.set_postfix(postfix, refresh=False)
            self.advance(step)
            self._last_step, self._last_time = step, now
        if line is not None:
            self.print(line)

    def image(self, step: int, name: str, pixels) -> str | None:
        """Write an image or video preview (:mod:`dew.train.previews`) into the run
        directory and TensorBoard (as ``{name}``); returns the file's path, None when
        there is no run directory or this is not the main process."""
        if not self.is_main or self.run_dir is None:
            return None
        from dew.train.previews import tensorboard_image, write_preview

        path = write_preview(self.run_dir, step, pixels)
        if self._tb is None:
            self._open_tensorboard(None)
        self._tb.add_image(name, tensorboard_image(pixels), step, dataformats="HWC")
        self._tb.flush()
        return path

    def text(self, step: int, name: str, text: str) -> str | None:
        """Write a text preview into the run directory and TensorBoard (as ``{name}``);
        returns the file's path, None without a run directory or off the main process."""
        if not self.is_main or self.run_dir is None:
            return None
        from dew.train.previews import write_text_preview

        path = write_text_preview(self.run_dir, step, text)
        if self._tb is None:
            self._open_tensorboard(None)
        self._tb.add_text(name, text, step)
        self._tb.flush()
        return path

    def close(self) -> None:
        if self.is_main:
            for tracker in self.trackers:
                tracker.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()

"""``StopSignals``: SIGTERM and SIGINT ask a run to stop cleanly.

While ``fit`` runs, the first SIGTERM or SIGINT does not kill the process:
the step in flight finishes, a checkpoint is written, ``fit`` says where and
returns the state. The previous handlers come back as soon as the first
signal arrives (so a second Ctrl-C interrupts as usual) and when ``fit``
ends. In a multi-process run every process stops at the same step: the
request is combined over processes every ``sync_every`` steps (one small
all-gather, so a pod does not synchronise hosts on every step).
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager; ``requested()`` is true once a stop signal arrived
    (on any process)."""

    def __init__(self, signals=SIGNALS, *, sync_every: int = 10):
        self.signals = tuple(signals)
        self.sync_every = sync_every
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._single = jax.process_count() == 1  # read once: requested() runs every step

    def __enter__(self) -> StopSignals:
        # Handlers can only be installed from the main thread; elsewhere the
        # run keeps the process's behaviour.
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        self._restore()

    def requested(self, step: int = 0) -> bool:
        """Whether to stop after ``step``. With several processes the answer
        only turns true on steps that are multiples of ``sync_every``, where all
        processes compare notes."""
        if self._single:
            return self.received is not None
        if step % self.sync_every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        if self.received is None and np.any(flags):
            self.received = "a stop signal on another process"
        return bool(np.any(flags))

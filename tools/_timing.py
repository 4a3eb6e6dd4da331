"""The timings the benchmarks report, one definition for every script.

A run is timed as ``(first, per_step)`` seconds: ``first`` from the start (before
init) to the first step's result, so it holds the compiles; ``per_step`` the mean
of the following ``steps - 1`` steps, dispatched back to back and waited for once
at the end. :func:`best_of` times one call (a product, an attention layer) in a
child process of any side, torch's too: this module imports jax only where it waits
on jax arrays.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from typing import Any


class _GoodputRecord:
    """A tracker (``Trainer(trackers=)``) that keeps the run's goodput record: the
    ``Goodput:`` line's figures unrounded (the line prints hundredths of a second, a
    step's tenth at 20 ms steps over 8 steps)."""

    def __init__(self):
        self.values: dict = {}

    def log(self, step, values, kind) -> None:
        if kind == "goodput":
            self.values = dict(values)

    def close(self) -> None:
        pass


def fit_seconds(trainer, data, steps: int) -> tuple[float, float]:
    """``(first, per_step)`` of ``trainer.fit(data, steps=steps)``, from its goodput
    record ("first step after X s, ... (S of W s; ...)" in its ``Goodput:`` line):
    ``first = X``, ``per_step = (W - X) / (steps - 1)``."""
    record = _GoodputRecord()
    trainer.trackers = (*trainer.trackers, record)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(data, steps=steps, log_every=steps)
    finally:
        trainer.trackers = tuple(t for t in trainer.trackers if t is not record)
    first, wall = float(record.values["first_step"]), float(record.values["wall"])
    return first, (wall - first) / (steps - 1)


def loop_seconds(
    start: float, step: Callable[[Any, int], Any], state: Any, steps: int
) -> tuple[float, float]:
    """``(first, per_step)`` of a hand-written loop ``state = step(state, i)``, ``i = 0 ..
    steps - 1``: ``first`` from ``start`` (a ``time.perf_counter()`` taken before init)
    to step 0's result."""
    import jax

    state = jax.block_until_ready(step(state, 0))
    first = time.perf_counter() - start
    begin = time.perf_counter()
    for i in range(1, steps):
        state = step(state, i)
    jax.block_until_ready(state)
    return first, (time.perf_counter() - begin) / (steps - 1)


def best_of(
    call: Callable[[], Any],
    ready: Callable[[Any], Any],
    *,
    warm: int,
    repeats: int,
    calls: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call of ``call()``: ``warm`` calls first, then the best of
    ``repeats`` groups of ``calls`` calls dispatched back to back, each group waited
    for once with ``ready(out)``; ``clock`` is ``time.perf_counter`` (wall) or
    ``time.process_time`` (this process's CPU, every thread)."""
    for _ in range(warm):
        ready(call())
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            out = call()
        ready(out)
        best = min(best, (clock() - start) / calls)
    return best

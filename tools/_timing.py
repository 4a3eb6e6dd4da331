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
import re
import time
from collections.abc import Callable
from typing import Any


def fit_seconds(trainer, data, steps: int) -> tuple[float, float]:
    """``(first, per_step)`` of ``trainer.fit(data, steps=steps)``, read from its
    ``Goodput:`` line ("first step after X s, ... (S of W s; ...)"): ``first = X``,
    ``per_step = (W - X) / (steps - 1)``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(data, steps=steps, log_every=steps)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("Goodput:"))
    first = float(re.search(r"first step after ([\d.]+) s", line).group(1))
    wall = float(re.search(r"of ([\d.]+) s;", line).group(1))
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

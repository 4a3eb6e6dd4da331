"""The two timings the training benchmarks report, one definition for every script.

A run is timed as ``(first, per_step)`` seconds: ``first`` from the start (before
init) to the first step's result, so it holds the compiles; ``per_step`` the mean
of the following ``steps - 1`` steps, dispatched back to back and waited for once
at the end.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from collections.abc import Callable
from typing import Any

import jax


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
    state = jax.block_until_ready(step(state, 0))
    first = time.perf_counter() - start
    begin = time.perf_counter()
    for i in range(1, steps):
        state = step(state, i)
    jax.block_until_ready(state)
    return first, (time.perf_counter() - begin) / (steps - 1)

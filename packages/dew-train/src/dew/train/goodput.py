"""Goodput: where the wall time of ``fit`` went.

Buckets are measured with ``with goodput.measure("compile"):``; ``steps`` is
the time spent dispatching and waiting for training steps, and ``other``
what no bucket measured, so the parts add up to the wall time.
"""

from __future__ import annotations

import contextlib
import time

BUCKETS = ("init", "compile", "steps", "data", "eval", "checkpoint", "logging")


class Goodput:
    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.first_step_at: float | None = None

    @contextlib.contextmanager
    def measure(self, bucket: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[bucket] += time.perf_counter() - begin

    def first_step_done(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter() - self.start

    def report(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        parts = dict(self.seconds)
        parts["other"] = max(0.0, wall - sum(parts.values()))
        return {"wall": wall, "first_step": self.first_step_at or wall, **parts}

    def line(self) -> str:
        r = self.report()
        wall = max(r["wall"], 1e-9)
        parts = ", ".join(
            f"{name} {r[name]:.2f} s" for name in (*BUCKETS, "other") if name != "steps"
        )
        return (
            f"Goodput: first step after {r['first_step']:.2f} s, "
            f"{100 * r['steps'] / wall:.1f}% of the wall time in steps "
            f"({r['steps']:.2f} of {r['wall']:.2f} s; {parts})"
        )

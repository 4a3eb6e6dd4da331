"""Goodput: where the wall time of ``fit`` went.

Buckets are measured with ``with goodput.measure("compile"):`` and never
nest. ``steps`` is the time spent dispatching and waiting for training
steps; ``prepare`` an objective's prepare phase (rollouts); ``init``
building the initial state; ``compile`` compiling the step;
``data`` waiting for the next batch (and fast-forwarding a resumed stream);
``eval`` evaluation and previews; ``checkpoint`` reading, starting and
finishing checkpoint writes; ``logging`` metrics records; ``other`` what no
bucket measured, so the parts add up to the wall time exactly.
"""

from __future__ import annotations

import time

BUCKETS = ("init", "compile", "steps", "prepare", "data", "eval", "checkpoint", "logging")
PARTS = (*BUCKETS, "other")


class Goodput:
    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.first_step_at: float | None = None

    def measure(self, bucket: str) -> _Measure:
        """``with goodput.measure(bucket):`` adds the block's wall time to ``bucket``."""
        return _Measure(self.seconds, bucket)

    def first_step_done(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter() - self.start

    def report(self) -> dict[str, float]:
        """``wall``, ``first_step`` and the parts (:data:`PARTS`), in seconds;
        the parts sum to ``wall``."""
        wall = time.perf_counter() - self.start
        parts = dict(self.seconds)
        measured = sum(parts.values())
        # Buckets never nest, so ``measured <= wall``; if clocks say otherwise
        # by rounding, stretch the wall rather than report a negative part.
        wall = max(wall, measured)
        parts["other"] = wall - measured
        return {"wall": wall, "first_step": self.first_step_at or wall, **parts}

    def line(self, report: dict[str, float] | None = None) -> str:
        """``Goodput: first step after X s, Y% of the wall time in steps (...)``."""
        r = report if report is not None else self.report()
        wall = max(r["wall"], 1e-9)
        parts = ", ".join(f"{name} {r[name]:.2f} s" for name in PARTS if name != "steps")
        return (
            f"Goodput: first step after {r['first_step']:.2f} s, "
            f"{100 * r['steps'] / wall:.1f}% of the wall time in steps "
            f"({r['steps']:.2f} of {r['wall']:.2f} s; {parts})"
        )


class _Measure:
    """The context manager of :meth:`Goodput.measure`: a class, not a generator
    (``contextlib.contextmanager``), since ``fit`` enters two every step (~1 us each
    instead of ~3)."""

    __slots__ = ("seconds", "bucket", "begin")

    def __init__(self, seconds: dict, bucket: str):
        self.seconds, self.bucket = seconds, bucket

    def __enter__(self) -> None:
        self.begin = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.bucket] += time.perf_counter() - self.begin

"""What every side of the peer suite measures and prints, one definition for all.

Imported by each side's runner in its own venv (needs only numpy), so the
workloads and the clocks cannot drift between sides:

- training: ``SIZES`` (the network and batch), random token rows (``rows``),
  tokens/s over steps 2..N (wall time, and the process's CPU time beside it);
- time to first step: from the runner's process start (imports, building the
  model, initialisation, compilation, one step) to the end of step 1;
- generation: greedy, ``GEN_BATCH`` prompts of ``PROMPT_TOKENS`` tokens, exactly
  ``NEW_TOKENS`` new tokens, on the trained weights; new tokens/s of the best of
  ``GEN_REPEATS`` warm calls (the first call, which compiles, is not timed);
- peak resident memory of the process (``ru_maxrss``).

A side prints ``RESULT {json}``; tools/bench_peers/run.py reads it.
"""

from __future__ import annotations

import json
import resource
import time

import numpy as np

SIZES = {
    "seed": dict(emb=64, layers=2, heads=4, mlp=256, seq=64, batch=8),
    "medium": dict(emb=256, layers=4, heads=8, mlp=1024, seq=256, batch=16),
}
VOCAB = 264
GEN_BATCH, PROMPT_TOKENS, NEW_TOKENS, GEN_REPEATS = 4, 16, 48, 3


def check_size(size: str) -> None:
    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; use one of {sorted(SIZES)}")


def rows(size: str) -> np.ndarray:
    """``[4, batch, seq + 1]`` int32 token rows (inputs and shifted targets)."""
    s = SIZES[size]
    return np.random.default_rng(0).integers(0, 256, (4, s["batch"], s["seq"] + 1)).astype(np.int32)


def prompts(size: str) -> np.ndarray:
    """``[GEN_BATCH, PROMPT_TOKENS]`` int32 prompts (the same for every size)."""
    del size
    return np.random.default_rng(1).integers(1, 256, (GEN_BATCH, PROMPT_TOKENS)).astype(np.int32)


class Clock:
    """Wall and process CPU seconds since construction."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def per(self, n: int) -> tuple[float, float]:
        n = max(n, 1)
        return (time.perf_counter() - self.wall) / n, (time.process_time() - self.cpu) / n


def warm_generation(call) -> float:
    """New tokens/s of the best of ``GEN_REPEATS`` warm calls of ``call()``."""
    call()  # compiles
    best = float("inf")
    for _ in range(GEN_REPEATS):
        begin = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - begin)
    return GEN_BATCH * NEW_TOKENS / best


def result(size, first, wall, cpu, gen_rate, note="") -> dict:
    tokens = SIZES[size]["batch"] * SIZES[size]["seq"]
    return dict(
        tokens_per_s=tokens / wall,
        cpu_tokens_per_s=tokens / cpu,
        first_step_s=first,
        gen_tokens_per_s=gen_rate,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        note=note,
    )


def emit(side: str, result: dict) -> None:
    print("RESULT " + json.dumps({"side": side, **result}), flush=True)

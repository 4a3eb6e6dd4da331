"""Dew's training step under two Pythons (and the JAX each one's lock fork gets), side by side.

The workspace lock forks on Python: 3.11 gets jax 0.10 / flax 0.12.8, 3.12+ the newest
JAX. This runs the same seed-size `Trainer.fit` (or medium) in a fresh process of each
interpreter, alternating A B A B ..., and reports each side's steady-state tokens/s (wall,
after the first step) and CPU seconds per step, and the median of the per-pair ratios.
Each interpreter must be a venv with Dew installed, e.g.

    UV_PROJECT_ENVIRONMENT=/tmp/py313 uv sync --locked --python 3.13 --all-packages
    python tools/bench_pythons.py --pythons .venv/bin/python /tmp/py313/bin/python

Both sides run under Dew's allocator setting (dew.nn.allocator), one CPU device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

SIZES = ("seed", "medium")


def worker(size: str, steps: int) -> None:
    """One side: `bench_train.run_dew`'s Trainer.fit, with the process CPU time per step.

    CPU time of the steady steps = CPU(fit of `steps`) - CPU(fit of 2 steps), over `steps - 2`:
    both fits build, compile and take a first step, which cancels.
    """
    import time

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import bench_train  # applies the allocator setting before jax allocates
    import jax

    c0 = time.process_time()
    first, _ = bench_train.run_dew(size, 2)
    c1 = time.process_time()
    _, step = bench_train.run_dew(size, steps)
    c2 = time.process_time()
    _, seq_len, batch, _ = bench_train.make(size)
    print(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "jax": jax.__version__,
                "tokens_per_s": batch * seq_len / step,
                "first_step_s": first,
                "cpu_s_per_step": max((c2 - c1) - (c1 - c0), 0.0) / (steps - 2),
            }
        )
    )


def run(python: str, size: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run(
        [python, __file__, "--worker", "--sizes", size, "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode:
        raise SystemExit(f"{python} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythons", nargs="+", default=[], help="two venv interpreters: A B")
    parser.add_argument("--sizes", nargs="+", default=["seed"], choices=SIZES)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.sizes[0], args.steps)
    if not args.pythons:
        print(
            "bench_pythons: skipped; give two venv interpreters, e.g. --pythons "
            ".venv/bin/python /tmp/py313/bin/python"
        )
        return
    if len(args.pythons) != 2:
        parser.error(f"--pythons takes two interpreters (A B), got {len(args.pythons)}")
    for python in args.pythons:
        if not pathlib.Path(python).is_file():
            parser.error(f"--pythons: {python!r} does not exist; give a venv's bin/python")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for size in args.sizes:
        sides: list[list[dict]] = [[], []]
        for pair in range(args.pairs):
            order = (0, 1) if pair % 2 == 0 else (1, 0)
            for side in order:
                sides[side].append(run(args.pythons[side], size, args.steps))
                print(f"{size} pair {pair} side {'AB'[side]}: {sides[side][-1]}", flush=True)
        a, b = sides
        wall = statistics.median(y["tokens_per_s"] / x["tokens_per_s"] for x, y in zip(a, b))
        # the CPU difference of two fits can come out <= 0 under heavy load: such pairs say nothing
        cpus = [
            x["cpu_s_per_step"] / y["cpu_s_per_step"]
            for x, y in zip(a, b)
            if x["cpu_s_per_step"] > 0 and y["cpu_s_per_step"] > 0
        ]
        cpu = statistics.median(cpus) if cpus else float("nan")
        for runs in sides:
            print(
                f"{size}: python {runs[0]['python']} jax {runs[0]['jax']}: tokens/s "
                f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f}, first step "
                f"{statistics.median(r['first_step_s'] for r in runs):.2f} s, CPU s/step "
                f"{statistics.median(r['cpu_s_per_step'] for r in runs):.4f}"
            )
        print(
            f"{size}: B/A tokens/s {wall:.3f}x (median of {args.pairs} pairs), "
            f"A/B CPU time {cpu:.3f}x; load average {os.getloadavg()[0]:.2f}"
        )


if __name__ == "__main__":
    main()

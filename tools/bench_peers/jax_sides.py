"""JAX sides of the peer suite, one per process: ``dew`` (``Trainer.fit`` on a
``CausalTransformer`` configured as the GPT-2-style network of
tools/bench_model.py) and ``hand`` (that plain linen network in a hand-written
jitted loop with donation, optax adamw). Both under Dew's default allocator.

    python tools/bench_peers/jax_sides.py --side dew --size medium --steps 10

Prints one line: ``<side> <size>: <tokens/s> tokens/s after the first step,
first step <s> s from process start``.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import bench_model  # noqa: E402  (applies Dew's allocator setting first)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew import Dataset, Trainer  # noqa: E402
from dew.objectives.lm import LMObjective  # noqa: E402


def run_dew(size: str, steps: int) -> tuple[float, float]:
    s = bench_model.SIZES[size]
    model = bench_model.network("dew_gpt2", size)
    rows = np.random.default_rng(0).integers(0, 256, (4, s["batch"], s["seq"] + 1))
    rows = rows.astype(np.int32)
    data = Dataset(
        train=lambda p: ({"text": r} for r in itertools.cycle(rows)),
        val=None,
        records=4 * s["batch"],
        batch=s["batch"],
    )
    trainer = Trainer(
        LMObjective(model, seq_len=s["seq"]),
        optax.adamw(3e-3),
        key=jax.random.key(0),
        progress=False,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(data, steps=1, log_every=0)
        first = time.perf_counter() - START
        begin = time.perf_counter()
        state = trainer.fit(data, steps=steps, log_every=0)  # continues from step 1
        jax.block_until_ready(state)
    return first, (time.perf_counter() - begin) / max(steps - 1, 1)


def run_hand(size: str, steps: int) -> tuple[float, float]:
    entry = list(bench_model.build("plain", size))
    bench_model.timed(entry, 1)
    first = time.perf_counter() - START
    wall, _ = bench_model.timed(entry, max(steps - 1, 1))
    return first, wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", required=True, choices=["dew", "hand"])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.size not in bench_model.SIZES:
        raise SystemExit(f"unknown --size {args.size!r}; use one of {sorted(bench_model.SIZES)}")
    first, step = (run_dew if args.side == "dew" else run_hand)(args.size, args.steps)
    s = bench_model.SIZES[args.size]
    print(
        f"{args.side} {args.size}: {s['batch'] * s['seq'] / step:,.0f} tokens/s after the "
        f"first step, first step {first:.2f} s from process start"
    )


if __name__ == "__main__":
    main()

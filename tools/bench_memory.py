"""Peak resident memory of one training run: Dew's Trainer.fit or the
hand-written jax/flax/optax loop of tools/bench_train.py, one side per process.

    python tools/bench_memory.py --side dew --size medium --steps 10
    python tools/bench_memory.py --side hand --size medium --steps 10

Prints ``<side> <size>: peak RSS <MiB> MiB`` (``ru_maxrss`` of the process,
which includes jax's own import and compilation). Run the sides alternately
and compare medians; both run under Dew's allocator setting
(``DEW_ALLOCATOR=system`` for glibc's own). Under the tuned setting the heap
keeps its high-water mark and, at the medium size, grows in ~1 GiB jumps over
the first 3-4 steps on both sides (docs/performance.md, Memory): measure
with 10 steps or more, or the ratio only says which side reached its jump
first.
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import bench_train  # noqa: E402  (tunes the allocator first, for both sides)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", required=True, choices=["dew", "hand"])
    parser.add_argument("--size", default="medium", choices=list(bench_train.SIZES))
    parser.add_argument("--steps", type=int, default=10)  # >= 10: past the heap growth
    args = parser.parse_args(argv)
    run = bench_train.run_dew if args.side == "dew" else bench_train.run_hand
    first, step = run(args.size, args.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(
        f"{args.side} {args.size}: peak RSS {peak:,.0f} MiB; first step {first:.2f} s, "
        f"{step * 1e3:.1f} ms/step"
    )


if __name__ == "__main__":
    main()

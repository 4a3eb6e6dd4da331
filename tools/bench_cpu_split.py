"""Data-parallel splitting on the CPU: ``Trainer.fit`` on one CPU device against the
same run split over two, at sizes from the seed run's to the medium LM's; the
measurement behind ``dew.train.cpu_split.SPLIT_FROM_FLOPS`` (docs/performance.md,
"Data-parallel splitting on the CPU").

One process; Dew's ``DEW_CPU_DEVICES=auto`` gives it 2 CPU devices. Every size
builds two trainers of the GPT-2-style ``CausalTransformer`` (tools/bench_model.py's
``dew_gpt2``) under ``LMObjective`` and adamw: ``one`` on the first device
(``MeshSpec(devices=jax.devices()[:1])``) and ``two`` on both (``MeshSpec(data=2)``);
each is compiled by a first fit, then the timed fits alternate (the order rotates
every round). A fit's per-step time is ``(wall - first step) / (steps - 1)`` from its
Goodput line (tools/_timing.py). Printed per size: the trainer's FLOP estimate
(``cpu_split.step_flops_estimate``, what ``auto`` decides on), the median step times
and the ratio one / two (above 1: splitting is faster), with each round's ratio.

    python tools/bench_cpu_split.py
    python tools/bench_cpu_split.py --sizes seed s128 --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import _timing  # noqa: E402
import bench_model  # noqa: E402  (applies Dew's allocator setting first)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew import Dataset, MeshSpec, Trainer, models  # noqa: E402
from dew.objectives.lm import LMObjective  # noqa: E402
from dew.train import cpu_split  # noqa: E402

# emb, layers, heads, mlp, seq, batch: the seed run's size, three between, the medium LM
SIZES = {
    "seed": (64, 2, 4, 256, 64, 8),
    "s128": (128, 2, 4, 512, 128, 8),
    "s128b": (128, 4, 4, 512, 128, 16),
    "s256": (256, 4, 8, 1024, 128, 16),
    "medium": (256, 4, 8, 1024, 256, 16),
}
# timed steps per fit: about a second or more of steps at each size
STEPS = {"seed": 60, "s128": 30, "s128b": 15, "s256": 8, "medium": 5}


def trainer_for(size: str, mesh: MeshSpec) -> tuple[Trainer, Dataset]:
    emb, layers, heads, mlp, seq, batch = SIZES[size]
    model = models.build(
        "causal_transformer", vocab_size=bench_model.VOCAB, emb_features=emb,
        num_layers=layers, num_heads=heads, mlp_features=mlp, max_seq_len=seq,
        norm="layer", mlp_activation="gelu", position_embedding="learned", use_bias=True,
    )  # fmt: skip
    # four batches of random token rows, cycled: [4, batch, seq + 1]
    batches = np.random.default_rng(0).integers(0, 256, (4, batch, seq + 1)).astype(np.int32)
    data = Dataset(
        train=lambda p: ({"text": b} for b in itertools.cycle(batches)),
        val=None,
        records=4 * batch,
        batch=batch,
    )
    trainer = Trainer(
        LMObjective(model, seq_len=seq), optax.adamw(3e-3), key=jax.random.key(0),
        progress=False, mesh=mesh,
    )  # fmt: skip
    return trainer, data


def estimate(size: str) -> float:
    """The FLOPs ``auto`` would estimate for this size's step."""
    trainer, data = trainer_for(size, MeshSpec(devices=jax.devices()[:1]))
    trainer.state_shardings(None)
    closed, _ = next(iter(trainer._init_jaxprs.values()))
    return cpu_split.step_flops_estimate(closed, data.batch)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown --sizes {unknown}; use some of {list(SIZES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if len(jax.devices()) < 2:
        sys.exit(
            f"needs 2 CPU devices, found {len(jax.devices())}: run without XLA_FLAGS' device "
            f"count and with DEW_CPU_DEVICES unset (auto) on a host of 2 or more cores"
        )
    print("| size (emb, layers, heads, mlp, seq, batch) | estimated GFLOP a step | one device "
          "ms | two devices ms | one / two | per round |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        sides = {
            "one": trainer_for(size, MeshSpec(devices=jax.devices()[:1])),
            "two": trainer_for(size, MeshSpec(data=2)),
        }
        for trainer, data in sides.values():  # compile
            _timing.fit_seconds(trainer, data, 2)
        times = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in sorted(sides, reverse=bool(r % 2)):
                trainer, data = sides[name]
                times[name].append(_timing.fit_seconds(trainer, data, STEPS[size] + 1)[1])
        ratios = [a / b for a, b in zip(times["one"], times["two"])]
        one, two = statistics.median(times["one"]), statistics.median(times["two"])
        print(
            f"| {size} {SIZES[size]} | {estimate(size) / 1e9:.2f} | {1e3 * one:.1f} | "
            f"{1e3 * two:.1f} | {statistics.median(ratios):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

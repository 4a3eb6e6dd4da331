"""Data-parallel splitting on the CPU: ``Trainer.fit`` on one CPU device against the
same run split over two emulated ones (docs/performance.md, "Data-parallel splitting
on the CPU: not a default"); ``--loop``: the hand-written split loop that can stop in
XLA:CPU's all-reduce.

One process with 2 CPU devices (``--xla_force_host_platform_device_count=2``, set here
before JAX starts) and ``--threads`` threads in XLA:CPU's intra-op pool (``NPROC``,
which XLA reads when it starts its CPU backend; default 3: with 2, see ``--loop``).
Every size builds two trainers of the GPT-2-style ``CausalTransformer``
(tools/bench_model.py's ``dew_gpt2``) under ``LMObjective`` and adamw: ``one`` on the
first device (``MeshSpec(devices=jax.devices()[:1])``), ``two`` on both
(``MeshSpec(data=2)``); each is compiled by a first fit, then the timed fits
alternate (the order rotates every round). A fit's per-step time is ``(wall - first
step) / (steps - 1)`` from its Goodput line (tools/_timing.py). Printed per size: the
compiled step's FLOPs, the median step times and the ratio one / two (above 1:
splitting is faster), with each round's ratio. The one-device side shares its
process with the second device and the larger pool; to compare with a plain
one-device process, run ``tools/bench_peers/jax_sides.py --side dew`` under each
setting, alternating.

``--loop``: a hand-written jitted step (``value_and_grad``, adamw) of the seed-size
model over both devices (parameters replicated, batch split), dispatched 300 times
without waiting, as a user's loop is. On 2 cores (2026-12-02, AMD EPYC) with 2
threads it stopped in every run of 7: one device waits in the all-reduce's
rendezvous while the other cannot go on, and after 40 s XLA ends the process
("Termination timeout for all reduce"); with 3 threads it stopped in 2 runs of 5;
with 4 and with 8 it ran through (one run each).

    python tools/bench_cpu_split.py
    python tools/bench_cpu_split.py --sizes seed medium --rounds 5 --threads 2
    python tools/bench_cpu_split.py --loop --threads 2
"""

from __future__ import annotations

import os
import sys


def _threads(argv) -> str:
    return argv[argv.index("--threads") + 1] if "--threads" in argv[:-1] else "3"


# before JAX starts its CPU backend (the imports below do not start it)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ["NPROC"] = _threads(sys.argv)

import argparse  # noqa: E402
import itertools  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import _timing  # noqa: E402
import bench_model  # noqa: E402  (applies Dew's allocator setting first)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew import Dataset, MeshSpec, Trainer, models  # noqa: E402
from dew.objectives.language.lm import LMObjective  # noqa: E402

# emb, layers, heads, mlp, seq, batch: the seed run's size, four between, the medium LM
SIZES = {
    "seed": (64, 2, 4, 256, 64, 8),
    "s128": (128, 2, 4, 512, 128, 8),
    "s128c": (128, 2, 4, 512, 128, 16),
    "s128b": (128, 4, 4, 512, 128, 16),
    "s256": (256, 4, 8, 1024, 128, 16),
    "medium": (256, 4, 8, 1024, 256, 16),
}
# timed steps per fit: about a second or more of steps at each size
STEPS = {"seed": 60, "s128": 30, "s128c": 20, "s128b": 15, "s256": 8, "medium": 5}


def network(size: str):
    emb, layers, heads, mlp, seq, _ = SIZES[size]
    return models.build(
        "causal_transformer", vocab_size=bench_model.VOCAB, emb_features=emb,
        num_layers=layers, num_heads=heads, mlp_features=mlp, max_seq_len=seq,
        norm="layer", mlp_activation="gelu", position_embedding="learned", use_bias=True,
    )  # fmt: skip


def trainer_for(size: str, mesh: MeshSpec) -> tuple[Trainer, Dataset]:
    *_, seq, batch = SIZES[size]
    # four batches of random token rows, cycled: [4, batch, seq + 1]
    batches = np.random.default_rng(0).integers(0, 256, (4, batch, seq + 1)).astype(np.int32)
    data = Dataset(
        train=lambda p: ({"text": b} for b in itertools.cycle(batches)),
        val=None,
        records=4 * batch,
        batch=batch,
    )
    trainer = Trainer(
        LMObjective(model=network(size), seq_len=seq), optax.adamw(3e-3), key=jax.random.key(0),
        progress=False, mesh=mesh,
    )  # fmt: skip
    return trainer, data


def split_loop(steps: int = 300) -> None:
    """The hand-written split loop of ``--loop`` (see the module docstring)."""
    import flax.linen as nn
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    model = network("seed")
    *_, seq, batch = SIZES["seed"]
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32)))
    optimizer = optax.adamw(3e-3)
    state = jax.device_put(
        (params["params"], optimizer.init(params["params"])), NamedSharding(mesh, PartitionSpec())
    )
    rows = np.random.default_rng(0).integers(0, 256, (4, batch, seq + 1)).astype(np.int32)
    split = NamedSharding(mesh, PartitionSpec("data"))
    batches = [jax.device_put(r, split) for r in rows]

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    for i in range(steps):
        state, loss = step(state, batches[i % len(batches)])
    print(f"ran through: {steps} steps, loss {float(loss):.4f}, NPROC={os.environ['NPROC']}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=3, help="XLA:CPU intra-op threads")
    parser.add_argument("--loop", action="store_true", help="run the hand-written split loop")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown --sizes {unknown}; use some of {list(SIZES)}")
    if args.rounds < 1 or args.threads < 1:
        parser.error(f"--rounds and --threads must be >= 1, got {args.rounds}, {args.threads}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.loop:
        split_loop()
        return
    print(f"2 CPU devices, NPROC={os.environ['NPROC']}")
    print("| size (emb, layers, heads, mlp, seq, batch) | GFLOP a step | one device ms | "
          "two devices ms | one / two | per round |")  # fmt: skip
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
        flops = next(iter(sides["one"][0]._step_flops.values()))
        print(
            f"| {size} {SIZES[size]} | {flops / 1e9:.2f} | {1e3 * one:.1f} | "
            f"{1e3 * two:.1f} | {statistics.median(ratios):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""What the checkpoint checksums cost: save and restore at the medium LM size,
with each checksum algorithm and without checksums, side by side in one process.

    python tools/bench_checkpoints.py --rounds 5

The state is a ``Trainer``'s initial TrainState of the medium LM (emb 256, 4
layers, 8 heads, mlp 1024, seq 256, vocab 264; AdamW: params, mu and nu,
52 MB). Each round saves it once per variant (the order rotating from round to
round), each into a fresh directory through ``CheckpointSession.save``
(asynchronous, as ``fit`` saves), then restores each with
``CheckpointSession.restore``. The variants: ``none`` writes the same Orbax
items with an empty checksum record and skips the verification, so a
difference from it is the sums themselves (taking the shards: ``save``
returns; computing and writing them: the commit waits for them; recomputing
them on restore); ``xxh3-128-v1`` (what Dew records; a save sums on Orbax's
commit thread, a restore on ``_integrity.WORKERS`` (1) thread) and the same with
the restore on 2 threads; ``wsum64-v1`` and ``crc32`` (what Dew recorded before,
threaded the same way).

Reported, medians over the rounds: ``save`` (until ``save`` returns: what a
training step waits for), ``save+commit`` (until the checkpoint is on disk),
``restore``, wall time and the process's CPU time (all threads: the machine
may be shared, and CPU time is what the sums add wherever they run), each with
its ratio to ``none``. Then each algorithm alone on the same shards (host
arrays, one thread), the sums on the state a restore returns.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from dew.nn.allocator import configure_allocator

configure_allocator()

import jax  # noqa: E402
import optax  # noqa: E402

import dew.train.checkpoints as checkpoints  # noqa: E402
from dew import Checkpoints, Trainer, models  # noqa: E402
from dew.objectives.language.lm import LMObjective  # noqa: E402
from dew.train import _integrity  # noqa: E402

SIZE = dict(emb_features=256, num_layers=4, num_heads=8, mlp_features=1024, max_seq_len=256)


VARIANTS = (
    "none",
    "xxh3-128-v1",
    "xxh3-128-v1, 2 threads",
    "wsum64-v1",
    "crc32",
)  # 2 threads: restore


def use(variant: str) -> None:
    """Save and verify as ``variant`` does (see the docstring)."""
    _integrity.ALGORITHM = variant.split(",")[0] if variant != "none" else DEFAULT_ALGORITHM
    _integrity.WORKERS = 2 if "2 threads" in variant else DEFAULT_WORKERS
    if variant == "none":
        checkpoints.checksums_save_args = lambda tree, **kw: _integrity.save_args({}, **kw)
        checkpoints.verify = lambda tree, recorded: 0
    else:
        checkpoints.checksums_save_args = _integrity.save_args
        checkpoints.verify = _integrity.verify


DEFAULT_WORKERS = _integrity.WORKERS
DEFAULT_ALGORITHM = _integrity.ALGORITHM


def timed(fn):
    """``(result, wall seconds, process CPU seconds)`` of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def one(trainer, state, abstract, shardings, variant: str) -> list[float]:
    """``[save, save+commit, restore]`` wall then CPU seconds of one round."""
    use(variant)
    directory = tempfile.mkdtemp(prefix="dew-bench-ckpt-")
    try:
        session = Checkpoints(directory).open(print_fn=lambda line: None)
        jax.block_until_ready(state)
        wall, cpu = time.perf_counter(), time.process_time()
        session.save(1, state, iter(()), {})
        returned = (time.perf_counter() - wall, time.process_time() - cpu)
        session.wait()
        committed = (time.perf_counter() - wall, time.process_time() - cpu)
        session.close()
        session = Checkpoints(directory).open(print_fn=lambda line: None)

        def restore():
            restored = session.restore(abstract, shardings, root_key=trainer.key)
            return jax.block_until_ready(restored.state)

        _, *restored = timed(restore)
        session.close()
    finally:
        use(DEFAULT_ALGORITHM)
        shutil.rmtree(directory, ignore_errors=True)
    return [returned[0], committed[0], restored[0], returned[1], committed[1], restored[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=264, **SIZE)
    trainer = Trainer(
        LMObjective(model=model, seq_len=SIZE["max_seq_len"]),
        optax.adamw(3e-3),
        key=jax.random.key(0),
        progress=False,
    )
    state = trainer.init_state()
    abstract, shardings = trainer.state_shardings()
    saved = checkpoints.to_saved(state)
    megabytes = sum(x.nbytes for x in jax.tree.leaves(saved)) / 1e6
    for variant in VARIANTS:  # warm: imports, first writes
        one(trainer, state, abstract, shardings, variant)
    runs = {variant: [] for variant in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            runs[variant].append(one(trainer, state, abstract, shardings, variant))
    print(
        f"medium LM state, {megabytes:.1f} MB, {jax.device_count()} device(s), "
        f"{_integrity.WORKERS} checksum threads on restore, medians of {args.rounds} rounds "
        f"(ratio: to none):"
    )
    print(f"{'':22} {'save':>15} {'save+commit':>15} {'restore':>15}")
    for kind, offset in (("wall", 0), ("CPU", 3)):
        for variant in VARIANTS:
            cells = []
            for i in range(3):
                value = statistics.median(run[offset + i] for run in runs[variant])
                base = statistics.median(run[offset + i] for run in runs["none"])
                cells.append(f"{value * 1e3:6.1f}ms {value / base:5.2f}x")
            print(f"{kind + ' ' + variant:22} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15}")
    shards = [data for _, _, data in _integrity.host_shards(saved)]
    print(f"the sums alone, {len(shards)} shards, 1 thread, medians of {args.rounds}:")
    for algorithm in _integrity.ALGORITHMS:
        times = [
            timed(lambda a=algorithm: [_integrity.checksum(x, a) for x in shards])[1:]
            for _ in range(args.rounds)
        ]
        wall = statistics.median(t[0] for t in times)
        cpu = statistics.median(t[1] for t in times)
        print(
            f"  {algorithm:10} {wall * 1e3:6.1f}ms wall {cpu * 1e3:6.1f}ms CPU "
            f"({megabytes / 1e3 / cpu:.1f} GB/s of CPU)"
        )


if __name__ == "__main__":
    main()

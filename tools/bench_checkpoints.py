"""What the checkpoint checksums cost: save and restore at the medium LM size,
with and without them, side by side in one process.

    python tools/bench_checkpoints.py --rounds 5

The state is a ``Trainer``'s initial TrainState of the medium LM (emb 256, 4
layers, 8 heads, mlp 1024, seq 256, vocab 264; AdamW: params, mu and nu,
about 39 MB). Each round saves it once with checksums and once without (the
order alternating), each into a fresh directory through
``CheckpointSession.save`` (asynchronous, as ``fit`` saves), then restores each
with ``CheckpointSession.restore``. "Without" writes the same Orbax items with
an empty checksum record and skips the verification, so the difference is the
sums themselves: taking the shards (``save`` returns), computing and writing
them (the commit waits for them), and recomputing them on restore.

Reported, medians over the rounds: ``save`` (until ``save`` returns: what a
training step waits for), ``save+commit`` (until the checkpoint is on disk),
``restore``, each with / without and the ratio.
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
from dew.objectives.lm import LMObjective  # noqa: E402
from dew.train import _integrity  # noqa: E402

SIZE = dict(emb_features=256, num_layers=4, num_heads=8, mlp_features=1024, max_seq_len=256)


def without_checksums(enabled: bool):
    """Switch the checksums off (an empty record, no verification) or back on."""
    if enabled:
        checkpoints.checksums_save_args = _integrity.save_args
        checkpoints.verify = _integrity.verify
    else:
        checkpoints.checksums_save_args = lambda tree: _integrity.save_args({})
        checkpoints.verify = lambda tree, recorded: 0


def one(trainer, state, abstract, shardings, *, checksums: bool) -> tuple[float, float, float]:
    without_checksums(checksums)
    directory = tempfile.mkdtemp(prefix="dew-bench-ckpt-")
    try:
        session = Checkpoints(directory).open(print_fn=lambda line: None)
        jax.block_until_ready(state)
        start = time.perf_counter()
        session.save(1, state, iter(()), {})
        returned = time.perf_counter() - start
        session.wait()
        committed = time.perf_counter() - start
        session.close()
        session = Checkpoints(directory).open(print_fn=lambda line: None)
        start = time.perf_counter()
        restored = session.restore(abstract, shardings, root_key=trainer.key)
        jax.block_until_ready(restored.state)
        restore = time.perf_counter() - start
        session.close()
    finally:
        without_checksums(True)
        shutil.rmtree(directory, ignore_errors=True)
    return returned, committed, restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=264, **SIZE)
    trainer = Trainer(
        LMObjective(model, seq_len=SIZE["max_seq_len"]),
        optax.adamw(3e-3),
        key=jax.random.key(0),
        progress=False,
    )
    state = trainer.init_state()
    abstract, shardings = trainer.state_shardings()
    megabytes = sum(x.nbytes for x in jax.tree.leaves(checkpoints.to_saved(state))) / 1e6
    one(trainer, state, abstract, shardings, checksums=True)  # warm: imports, first writes
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for checksums in (True, False) if r % 2 == 0 else (False, True):
            runs[checksums].append(one(trainer, state, abstract, shardings, checksums=checksums))
    print(
        f"medium LM state, {megabytes:.1f} MB, {jax.device_count()} device(s), "
        f"medians of {args.rounds} rounds:"
    )
    print(f"{'':12} {'with':>9} {'without':>9} {'ratio':>7}")
    for i, name in enumerate(("save", "save+commit", "restore")):
        on = statistics.median(run[i] for run in runs[True])
        off = statistics.median(run[i] for run in runs[False])
        print(f"{name:12} {on * 1e3:7.1f}ms {off * 1e3:7.1f}ms {on / off:7.3f}")


if __name__ == "__main__":
    main()

"""A tiny diffusion training run for the resume test (tests/test_diffusion_train.py),
run as a real subprocess; the options are tests/train_child.py's.

    python tests/diffusion_child.py --dir D --steps 10 [--kill-at 7] --out state.npz
        [--reference-out reference.npz]

A class-conditional DiT trained with DiffusionObjective's defaults (DDPM eps, 10%
condition dropout, EMA): every step draws times, noise and dropout from its key. The
final parameters and moving average go to --out; with --reference-out the same process
then trains an uninterrupted run from scratch and writes it there.
"""

from __future__ import annotations

import argparse
import signal

import grain
import jax
import numpy as np
import optax
from train_child import Hook

from dew.data import Dataset
from dew.nn import models
from dew.objectives.diffusion import DiffusionObjective
from dew.train import Checkpoints, Trainer

BATCH, CLASSES = 8, 4


def rows(index: int) -> dict:
    rng = np.random.default_rng(index)
    return {
        "image": rng.integers(0, 256, (8, 8, 1), dtype=np.uint8),
        "label": np.int32(index % CLASSES),
    }


def batches():
    """Batches that change every step: a shuffled, repeated Grain pipeline."""
    ds = grain.MapDataset.range(64).shuffle(seed=3).repeat().map(rows).batch(BATCH)
    return iter(ds.to_iter_dataset())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference-out", default=None)
    args = parser.parse_args()

    def train(partition):
        inner = batches()
        return Hook(inner, args.kill_at, signal.SIGKILL) if args.kill_at >= 0 else inner

    model = models.build(
        "dit",
        sample_size=8,
        patch_size=2,
        in_channels=1,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        num_classes=CLASSES,
    )
    objective = DiffusionObjective(model)
    trainer = Trainer(
        objective,
        optax.adamw(1e-2),
        key=jax.random.key(0),
        checkpoints=Checkpoints(args.dir, keep=2),
    )
    data = Dataset(train=train, val=None, records=64, batch=BATCH)
    state = trainer.fit(data, steps=args.steps, log_every=1, checkpoint_every=args.checkpoint_every)
    save(state, args.out)
    if args.reference_out:
        plain = Dataset(train=lambda p: batches(), val=None, records=64, batch=BATCH)
        reference = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(0))
        save(reference.fit(plain, steps=args.steps, log_every=0), args.reference_out)
    print("child: done", flush=True)


def save(state, path):
    leaves = {
        f"{tree}{jax.tree_util.keystr(p)}": np.asarray(v)
        for tree in ("params", "averaged")
        for p, v in jax.tree_util.tree_leaves_with_path(getattr(state, tree))
    }
    np.savez(
        path,
        step=int(state.step),
        microstep=int(state.microstep),
        updates=int(state.updates),
        **leaves,
    )


if __name__ == "__main__":
    main()

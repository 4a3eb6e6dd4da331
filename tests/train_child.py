"""A tiny training run for the resume tests (tests/test_resume_kill.py,
tests/test_preemption.py, tests/test_diffusion_train.py), run as a real subprocess.

    python tests/train_child.py --dir D --steps 10 [--objective lm] [--data grain]
        [--kill-at 7] [--signal-at 5 --signal SIGTERM] --out params.npz

--objective lm (default): a tiny causal LM on token rows; --objective diffusion: a
class-conditional DiT trained with DiffusionObjective's defaults (DDPM eps, 10%
condition dropout, EMA), whose every step draws times, noise and dropout from its key.

--kill-at N sends this process SIGKILL when the trainer asks for batch N
(after N steps, while the async checkpoint of an earlier step may still be
writing); --signal-at N sends --signal instead (the run stops cleanly).
The final state goes to --out as .npz (params and moving-average leaves, counters); with
--reference-out, the same process then trains an uninterrupted run from
scratch (no checkpoints) and writes it there.
"""

from __future__ import annotations

import argparse
import os
import signal

import grain
import jax
import numpy as np
import optax

from dew.data import Dataset
from dew.nn import models
from dew.objectives.language.lm import LMObjective
from dew.train import Checkpoints, Trainer

SEQ_LEN, BATCH, VOCAB, CLASSES = 8, 8, 32, 4


def lm_rows(index: int) -> dict:
    """Example ``index``: a deterministic row of SEQ_LEN + 1 token ids."""
    rng = np.random.default_rng(index)
    return {"text": rng.integers(0, VOCAB, SEQ_LEN + 1, dtype=np.int32)}


def image_rows(index: int) -> dict:
    """Example ``index``: a deterministic 8x8 uint8 image and its class."""
    rng = np.random.default_rng(index)
    return {
        "image": rng.integers(0, 256, (8, 8, 1), dtype=np.uint8),
        "label": np.int32(index % CLASSES),
    }


def lm_objective():
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=SEQ_LEN,
    )
    return LMObjective(model=model, seq_len=SEQ_LEN)


def diffusion_objective():
    from dew.objectives.diffusion.images import DiffusionObjective  # only this run pays its import

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
    return DiffusionObjective(model=model)


RUNS = {"lm": (lm_rows, lm_objective), "diffusion": (image_rows, diffusion_objective)}


def grain_iterator(rows):
    """Batches that change every step: a shuffled, repeated Grain pipeline."""
    ds = grain.MapDataset.range(64).shuffle(seed=3).repeat().map(rows).batch(BATCH)
    return iter(ds.to_iter_dataset())


def repeat_iterator(rows):
    """The same batch every step (a plain Python iterator: no saved position)."""
    examples = [rows(i) for i in range(BATCH)]
    batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
    while True:
        yield batch


class Hook:
    """Forwards an iterator (and its get_state/set_state when it has them);
    sends this process ``signum`` when batch ``at`` is asked for."""

    def __init__(self, inner, at: int, signum: int):
        self.inner, self.at, self.signum, self.count = inner, at, signum, 0
        if hasattr(inner, "get_state"):
            self.get_state, self.set_state = inner.get_state, self._set_state

    def _set_state(self, state):
        self.inner.set_state(state)

    def __iter__(self):
        return self

    def __next__(self):
        if self.count == self.at:
            print(
                f"child: sending {signal.Signals(self.signum).name} at batch {self.count}",
                flush=True,
            )
            os.kill(os.getpid(), self.signum)
        self.count += 1
        return next(self.inner)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--objective", choices=tuple(RUNS), default="lm")
    parser.add_argument("--data", choices=("grain", "repeat"), default="grain")
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--signal", default="SIGTERM")
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference-out", default=None)
    args = parser.parse_args()

    rows, make_objective = RUNS[args.objective]

    def batches():
        return grain_iterator(rows) if args.data == "grain" else repeat_iterator(rows)

    def train(partition):
        inner = batches()
        if args.kill_at >= 0:
            return Hook(inner, args.kill_at, signal.SIGKILL)
        if args.signal_at >= 0:
            return Hook(inner, args.signal_at, getattr(signal, args.signal))
        return inner

    objective = make_objective()
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
    leaves = {  # state.averaged is None without a moving average (no leaves)
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

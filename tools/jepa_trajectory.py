"""JEPA on digits with probes along the way: how the context and target encoders move
against the random-initialised one as a run goes on.

Trains ``examples/jepa_digits.py``'s setting (``tools/jepa_ablation.py``'s variant
"example N steps": predictor 128 x 4, AdamW 1e-4 with warm-up 50 + cosine, momentum
0.996 -> 1, the schedule and momentum stretched to ``--steps``) and, every ``--every``
steps, probes the context and the target encoder (mean-pooled features, the
standardised ridge probe and the cosine k-NN, k = 20, on the 1400 / 397 split).
docs/jepa.md quotes what it prints.

    python tools/jepa_trajectory.py --steps 1500 --every 250 --seed 0
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jepa_ablation as ablation  # tools/, beside this file
import numpy as np

from dew.data import Dataset
from dew.sampling.features import knn_accuracy, linear_probe_accuracy
from dew.train import MeshSpec, Trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sample, ((xa, ya), (xb, yb)) = ablation.digits_data()
    setup = ablation.digits_setup(**{**ablation.EXAMPLE, "steps": args.steps})
    pooled = jax.jit(lambda p, x: setup.encoder.apply({"params": p}, x).mean(axis=1))

    def scores(params) -> str:
        params = nn.unbox(jax.device_get(params))
        fa, fb = (np.asarray(pooled(params, x), np.float64) for x in (xa, xb))
        return (
            f"{linear_probe_accuracy(fa, ya, fb, yb):.3f} / "
            f"{knn_accuracy(fa, ya, fb, yb, k=20):.3f}"
        )

    objective = ablation.ref.dew_objective(setup)

    def train(partition):
        rng = np.random.default_rng(args.seed + 1000)  # the ablation tool's draws
        while True:
            yield {"image": sample(rng, setup.batch)[0]}

    trainer = Trainer(
        objective,
        setup.optimizer(),
        key=jax.random.key(args.seed),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        progress=False,
    )
    print(f"step 0 (random init): linear / k-NN {scores(trainer.init_state().params['encoder'])}")
    start = time.perf_counter()

    def probe_hook(info):
        print(
            f"step {info.step} ({time.perf_counter() - start:.0f} s): context "
            f"{scores(info.state.params['encoder'])}, target "
            f"{scores(info.state.averaged['encoder'])}",
            flush=True,
        )

    trainer.add_hook(probe_hook, every=args.every)
    trainer.fit(Dataset(train, None, records=0, batch=setup.batch), steps=args.steps,
                log_every=args.every)  # fmt: skip


if __name__ == "__main__":
    main()

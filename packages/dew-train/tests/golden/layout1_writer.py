"""Writes ``golden/layout1``: checkpoints in the layout of Dew before trained
parameters were keyed by role (layout 1: no ``layout`` in their meta; written at
commit b5d5b98), and what that code's own continuation of each run ends with.

Run once with that commit's code (``cd <checkout at b5d5b98> && uv run --locked python
<this file> <out>``); ``test_layout_versions.py`` imports the objectives from here.
Both runs are tiny: a one-layer causal LM with an EMA (one trained role: its tree
unkeyed in layout 1) and a two-role regression (``policy`` and ``value``: keyed in
every layout).
"""

from __future__ import annotations

import itertools
import shutil
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

STEPS, SAVED = 4, 2
BATCH = 4


def lm_objective():
    from dew.nn.testing import tiny_lm
    from dew.objectives import EMA
    from dew.objectives.lm import LMObjective

    small = dict(vocab_size=16, emb_features=8, num_layers=1, num_kv_heads=None)
    model = tiny_lm(**small, num_heads=2, mlp_features=16, max_seq_len=8)
    return LMObjective(model=model, seq_len=8, ema=EMA(decay=0.9))


def stream(batch_at):
    """An endless deterministic stream: batch ``i`` is ``batch_at(i)``."""
    from dew.data import Dataset

    train = lambda partition: map(batch_at, itertools.count())  # noqa: E731
    return Dataset(train=train, val=None, records=10**6, batch=BATCH)


def lm_data():
    def batch_at(step):
        return {"text": np.random.default_rng(step).integers(0, 16, (BATCH, 9), dtype=np.int32)}

    return stream(batch_at)


def two_roles_objective():
    """A linear policy and a linear value model, both trained (keyed by role in every
    checkpoint layout)."""
    from dew.objectives import Objective, Role

    class TwoRoles(Objective):
        model = nn.Dense(2)
        value = nn.Dense(1)

        def roles(self):
            return (Role(name="policy", module=self.model), Role(name="value", module=self.value))

        def init(self, key, spec=None):
            k1, k2 = jax.random.split(key)
            x = jnp.zeros((1, 3))
            return {
                "params": {
                    "policy": self.model.init(k1, x)["params"],
                    "value": self.value.init(k2, x)["params"],
                }
            }

        def loss(self, variables, batch, step):
            params = variables["params"]
            pred = self.model.apply({"params": params["policy"]}, batch["x"])
            value = self.value.apply({"params": params["value"]}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2) + jnp.mean((value - 1.0) ** 2), {}

    return TwoRoles()


def two_roles_data():
    def batch_at(step):
        x = np.random.default_rng(step).normal(size=(BATCH, 3)).astype(np.float32)
        return {"x": x, "y": np.stack([x.sum(1), x[:, 0]], 1).astype(np.float32)}

    return stream(batch_at)


RUNS = {"lm": (lm_objective, lm_data), "two_roles": (two_roles_objective, two_roles_data)}


def trainer(name: str, directory):
    from dew.train import Checkpoints, MeshSpec, Trainer

    objective, _ = RUNS[name]
    return Trainer(
        objective(),
        optax.adam(1e-2),
        key=jax.random.key(0),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        checkpoints=Checkpoints(directory, keep=None, use_async=False),
        progress=False,
    )


def flat(state) -> dict[str, np.ndarray]:
    """``{'<field>/<path>': array}`` of a state's arrays, in the layout of the code
    that runs it."""
    out = {}
    for field in ("params", "opt_state", "averaged", "step", "microstep", "updates"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, field)):
            out[f"{field}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


def main(out: Path) -> None:
    scratch = out / "scratch"
    for name, (_, data) in RUNS.items():
        shutil.rmtree(scratch, ignore_errors=True)
        trainer(name, scratch / "run").fit(data(), steps=SAVED, log_every=0)
        shutil.copytree(scratch / "run" / str(SAVED), out / name / str(SAVED))
        # the old code's own continuation from that checkpoint
        final = trainer(name, scratch / "run").fit(data(), steps=STEPS, log_every=0)
        np.savez(out / f"{name}_continued.npz", **flat(final))
    shutil.rmtree(scratch)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""``plan`` compiles the step ``fit`` runs: for LM, GRPO (with a host reward
stage) and PPO (two minibatches), plan's step FLOPs, temporary and peak bytes
equal those of the update program ``fit`` compiled and ran, and they differ
from the loss over the raw data batch (what ``plan`` compiled before for the
families with a prepare phase)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.objectives import Updates
from dew.objectives.cores.rewards import TextReward, TokenReward
from dew.objectives.language.lm import LMObjective
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.ppo import PPOObjective
from dew.train import MeshSpec, Trainer, plan
from dew.train.plan import peak_bytes

V, NEW, PROMPTS = 16, 4, 8
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


def policy():
    return CausalTransformer(
        vocab_size=V, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=8
    )


def sevens(completion, mask, batch):
    return jnp.sum((completion == 7) & mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1)


def ends_in_seven(prompts, completions):
    return [float(c.endswith("\x07")) for c in completions]


def lm():
    data = Dataset(
        train=lambda p: iter(
            lambda: {"text": np.arange(8 * 9, dtype=np.int32).reshape(8, 9) % V}, None
        ),
        val=None,
        records=0,
        batch=8,
    )
    return LMObjective(model=policy(), seq_len=8), data, {"text": ((8, 9), jnp.int32)}, 1


def prompt_data():
    def train(partition):
        rng = np.random.default_rng(0)
        while True:
            yield {
                "prompt": rng.integers(0, V, (PROMPTS, 1)).astype(np.int32),
                "prompt_mask": np.ones((PROMPTS, 1), bool),
            }

    shapes = {"prompt": ((PROMPTS, 1), jnp.int32), "prompt_mask": ((PROMPTS, 1), jnp.bool_)}
    return Dataset(train=train, val=None, records=0, batch=PROMPTS), shapes


def grpo():
    objective = GRPOObjective(
        model=policy(),
        rewards=[TokenReward(fn=sevens), TextReward(fn=ends_in_seven, weight=0.5)],
        group_size=4,
        max_new_tokens=NEW,
        beta=0.04,
        prepared_updates=Updates(epochs=1, minibatches=2),
    )
    return objective, *prompt_data(), 2


def ppo():
    objective = PPOObjective(
        model=policy(),
        reward=TokenReward(fn=sevens),
        max_new_tokens=NEW,
        prepared_updates=Updates(epochs=1, minibatches=2),
    )
    return objective, *prompt_data(), 2


@pytest.mark.parametrize("family", [lm, grpo, ppo], ids=lambda f: f.__name__)
def test_plan_measures_the_step_fit_runs(family):
    objective, data, shapes, steps = family()
    optimizer = optax.adam(1e-3)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), mesh=ONE, progress=False)
    trainer.fit(data, steps=steps, log_every=0)
    (update,) = trainer.programs.cache.update.values()
    program, flops = update.program, update.flops
    memory = program.memory_analysis()

    report = plan(objective, optimizer, mesh=ONE, batch=shapes)
    assert report.flops == flops > 0
    assert report.temporary_bytes == memory.temp_size_in_bytes
    assert report.peak_bytes == peak_bytes(memory)
    if objective.has_prepare:
        # the update reads the prepared rows (prompt x group + completion), not the
        # prompt batch: the loss over the data batch alone would count other FLOPs
        assert report.flops > 0 and set(shapes) < set(
            k for k, _, _, _ in next(iter(trainer.programs.cache.update))
        )

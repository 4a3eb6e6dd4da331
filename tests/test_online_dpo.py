"""OnlineDPOObjective: rollouts read right-aligned by a reward model (against a
loop), the frozen reward model scoring inside the compiled prepare, the loss
against numpy DPO on the pair each judge picks, bad input, and the "emit token
7" toy (OBJECTIVES.md section 7) learned from a token-reward judge."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn.testing import tiny_lm
from dew.objectives import Step
from dew.objectives.cores.rewards import TokenReward
from dew.objectives.cores.rollouts import Rollout, right_aligned
from dew.objectives.preference.online_dpo import OnlineDPOObjective
from dew.objectives.preference.reward_model import CausalRewardModel
from dew.sampling import Sampling
from dew.train import MeshSpec, Trainer

V = 16
MODEL = tiny_lm(vocab_size=V, num_layers=1, max_seq_len=8)
STEPS = 80
STEP = Step(index=jnp.int32(0), key=jax.random.key(3))


def sevens(completion, mask, batch):
    return jnp.sum((completion == 7) & mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)


def test_right_aligned_matches_a_loop():
    prompt = np.array([[0, 0, 5, 6], [1, 2, 3, 4], [0, 0, 0, 9]], np.int32)
    prompt_mask = prompt > 0
    completion = np.array([[7, 8, 0], [9, 0, 0], [1, 2, 3]], np.int32)
    completion_mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
    ids, mask = right_aligned(Rollout(prompt, prompt_mask, completion, completion_mask))
    for r in range(3):
        real = prompt[r][prompt_mask[r]].tolist() + completion[r][completion_mask[r]].tolist()
        assert np.asarray(ids[r][: len(real)]).tolist() == real
        assert np.asarray(mask[r]).tolist() == [t < len(real) for t in range(7)]


@pytest.fixture(scope="module")
def reward_model():
    model = CausalRewardModel.of(MODEL)
    params = nn.unbox(model.init(jax.random.key(5), jnp.zeros((1, 8), jnp.int32))["params"])
    return model, params


def test_prepare_scores_with_the_frozen_reward_model_and_the_loss_is_dpo(reward_model):
    model, reward_model_params = reward_model
    beta = 0.3
    objective = OnlineDPOObjective(
        model=MODEL,
        reward_model=model,
        reward_model_params=reward_model_params,
        rewards=[TokenReward(fn=sevens, weight=0.5)],
        max_new_tokens=4,
        beta=beta,
    )
    prompts = {
        "prompt": np.array([[1, 2], [0, 3], [4, 5]], np.int32),
        "prompt_mask": np.array([[1, 1], [0, 1], [1, 1]], bool),
    }
    variables = objective.init(jax.random.key(0), spec={"prompt": jnp.zeros((2,))})
    variables["params"] = nn.unbox(variables["params"])
    variables["reference"] = {"params": nn.unbox(variables["reference"]["params"])}
    variables["reward"]["params"] = jax.tree.map(lambda x: x * 1.0, variables["reward"]["params"])
    # a reference other than the policy, so the ratios differ
    variables["reference"]["params"] = jax.tree.map(
        lambda x: x * 0.9, variables["reference"]["params"]
    )
    out = jax.jit(objective.prepare)(variables, prompts, STEP)
    rollout = Rollout.from_batch(out)
    ids, mask = right_aligned(rollout)
    want = model.apply({"params": reward_model_params}, ids, mask)
    np.testing.assert_allclose(out["model_rewards"], want, rtol=1e-6)
    host = objective.prepare_host(jax.device_get(out))
    batch = jax.jit(objective.prepare_finish)(variables, {**out, **host}, STEP)
    total = 0.5 * np.asarray(
        sevens(rollout.completion, rollout.completion_mask, None)
    ) + np.asarray(want)
    np.testing.assert_allclose(np.asarray(batch["reward"]).reshape(-1), total, rtol=1e-6)
    loss, metrics = jax.jit(objective.loss)(variables, batch, STEP)
    # numpy: each pair's chosen = the higher total; sequence log-probs summed
    policy = np.asarray(out["old_logps"], np.float64).sum(1)
    ref = np.asarray(out["ref_logps"], np.float64).sum(1)
    losses = []
    for p in range(3):
        a, b = 2 * p, 2 * p + 1
        if total[a] == total[b]:
            continue
        won, lost = (a, b) if total[a] > total[b] else (b, a)
        h = (policy[won] - ref[won]) - (policy[lost] - ref[lost])
        losses.append(np.logaddexp(0.0, -beta * h))
    assert losses
    np.testing.assert_allclose(loss.value, np.sum(losses) / 3, rtol=1e-5)  # ties add 0


def test_bad_input(reward_model):
    model, params = reward_model
    with pytest.raises(ValueError, match="needs a judge"):
        OnlineDPOObjective(model=MODEL)
    other = CausalRewardModel.of(tiny_lm(vocab_size=32))
    with pytest.raises(ValueError, match="vocabulary has 32 ids, the policy's 16"):
        OnlineDPOObjective(model=MODEL, reward_model=other, reward_model_params=params)
    with pytest.raises(ValueError, match="use one of \\['sigmoid', 'ipo'\\]"):
        OnlineDPOObjective(model=MODEL, rewards=[TokenReward(fn=sevens)], loss_type="simpo")


@pytest.mark.slow
def test_toy_reward_rises(tmp_path):
    """8 prompts x 2 completions per step; mean reward ~1/16 at first."""

    def prompts(partition):
        rng = np.random.default_rng(0)
        while True:
            yield {
                "prompt": rng.integers(0, V, (8, 1)).astype(np.int32),
                "prompt_mask": np.ones((8, 1), bool),
            }

    objective = OnlineDPOObjective(
        model=MODEL,
        rewards=[TokenReward(fn=sevens)],
        max_new_tokens=4,
        sampling=Sampling(temperature=1.0),
        beta=0.1,
        check_first_ratio=True,
    )
    mesh = MeshSpec(data=1, devices=jax.devices()[:1])
    trainer = Trainer(
        objective, optax.adam(3e-3), key=jax.random.key(0), mesh=mesh, run_dir=str(tmp_path)
    )
    trainer.fit(Dataset(prompts, None, records=0, batch=8), steps=STEPS, log_every=10)
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    rewards = [r["reward"] for r in records if r["kind"] == "train"]
    print([round(r, 3) for r in rewards])
    assert np.mean(rewards[:1]) < 0.15  # ~ 1/16 at the start
    assert rewards[-1] >= 0.5, rewards

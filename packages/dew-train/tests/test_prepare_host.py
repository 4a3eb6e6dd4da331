"""The prepare phase's host stage: compiled ``prepare``, host ``prepare_host`` on
numpy, compiled ``prepare_finish``. A bandit whose reward is computed on the
host trains exactly like the same bandit computing it in compiled code; a host
stage that raises stops ``fit`` before the batch's first update, with the
checkpoints already written intact; a bad host output is refused."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.objectives import Objective, Updates, Weighted
from dew.train import Checkpoints, MeshSpec, Trainer

ROWS, FEATURES, ACTIONS = 8, 4, 5
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


class Bandit(Objective):
    """``pi(a | x) = softmax(x W)``, reward 1 when ``a`` is the row's target."""

    model = None
    prepared_updates = Updates(epochs=2, minibatches=1, shuffle=False)

    def init(self, key):
        return {"params": {"policy": {"w": 0.1 * jax.random.normal(key, (FEATURES, ACTIONS))}}}

    def sample(self, variables, batch, step):
        logits = batch["x"] @ variables["params"]["policy"]["w"]
        actions = jax.random.categorical(step.key, logits)
        logp = jax.nn.log_softmax(logits)[jnp.arange(actions.shape[0]), actions]
        return {"x": batch["x"], "target": batch["target"], "action": actions, "old_logp": logp}

    def finish(self, out, reward):
        keep = {k: out[k] for k in ("x", "action", "old_logp")}
        return {**keep, "adv": reward - reward.mean()}

    def loss(self, variables, batch, step):
        logits = batch["x"] @ variables["params"]["policy"]["w"]
        logp = jax.nn.log_softmax(logits)[jnp.arange(batch["action"].shape[0]), batch["action"]]
        ratio = jnp.exp(logp - batch["old_logp"])
        return -jnp.mean(ratio * batch["adv"]), {"ratio": Weighted.mean(ratio)}


class Compiled(Bandit):
    def prepare(self, variables, batch, step):
        out = self.sample(variables, batch, step)
        return self.finish(out, (out["action"] == out["target"]).astype(jnp.float32))


class Host(Bandit):
    """The reward on the host, in numpy; ``fail_at``: raise on that call."""

    def __init__(self, fail_at=None, bad_rows=False):
        self.calls, self.fail_at, self.bad_rows = 0, fail_at, bad_rows

    def prepare(self, variables, batch, step):
        return self.sample(variables, batch, step)

    def prepare_host(self, rollout):
        self.calls += 1
        assert all(isinstance(v, np.ndarray) for v in rollout.values())
        if self.calls == self.fail_at:
            raise ValueError(f"reward failed on row 3 (call {self.calls})")
        reward = (rollout["action"] == rollout["target"]).astype(np.float32)
        return {"reward": reward[:-1] if self.bad_rows else reward}

    def prepare_finish(self, variables, batch, step):
        return self.finish(batch, batch["reward"])


def data():
    def batches(partition):
        rng = np.random.default_rng(0)
        for _ in itertools.count():
            yield {
                "x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
                "target": rng.integers(0, ACTIONS, ROWS).astype(np.int32),
            }

    return Dataset(train=batches, val=None, records=0, batch=ROWS)


def test_a_host_reward_trains_exactly_like_a_compiled_one(tmp_path):
    want = Trainer(Compiled(), optax.adam(0.1), key=jax.random.key(0), mesh=ONE).fit(
        data(), steps=6, log_every=0
    )
    host = Host()
    got = Trainer(host, optax.adam(0.1), key=jax.random.key(0), mesh=ONE).fit(
        data(), steps=6, log_every=0
    )
    assert host.calls == 3  # once per prepared batch
    np.testing.assert_array_equal(got.params["w"], want.params["w"])


def test_a_failing_host_stage_applies_nothing_and_keeps_the_checkpoints(tmp_path):
    directory = tmp_path / "run"
    trainer = Trainer(
        Host(fail_at=3),
        optax.adam(0.1),
        key=jax.random.key(0),
        mesh=ONE,
        checkpoints=Checkpoints(directory, use_async=False),
    )
    with pytest.raises(ValueError, match="reward failed on row 3"):
        trainer.fit(data(), steps=8, log_every=0, checkpoint_every=2)
    assert Checkpoints(directory).steps() == [2, 4]  # the third batch applied nothing
    again = Trainer(
        Host(),
        optax.adam(0.1),
        key=jax.random.key(0),
        mesh=ONE,
        checkpoints=Checkpoints(directory, use_async=False),
    )
    state = again.fit(data(), steps=8, log_every=0, checkpoint_every=2)
    want = Trainer(Compiled(), optax.adam(0.1), key=jax.random.key(0), mesh=ONE).fit(
        data(), steps=8, log_every=0
    )
    np.testing.assert_array_equal(state.params["w"], want.params["w"])
    assert int(state.updates) == 8


def test_host_output_without_the_rows_is_refused():
    trainer = Trainer(Host(bad_rows=True), optax.adam(0.1), key=jax.random.key(0), mesh=ONE)
    with pytest.raises(ValueError, match=r"prepare_host returned 'reward' of shape \(7,\); every"):
        trainer.fit(data(), steps=2, log_every=0)


class SlowUpdates(Compiled):
    """Each update also runs matrix products worth ~0.1 s (added with weight 0), so
    it is still running when ``fit`` has dispatched it and moves on."""

    def loss(self, variables, batch, step):
        loss, metrics = super().loss(variables, batch, step)
        w = variables["params"]["policy"]["w"]
        x = jnp.full((SLOW, SLOW), 1e-3) + 0.0 * jnp.sum(w)
        for _ in range(3):
            x = jnp.tanh(x @ x)
        return loss + 0.0 * jnp.mean(x), metrics


SLOW = 700  # rows of the square matrices


def test_prepare_time_leaves_out_the_previous_updates(tmp_path):
    # 3 batches x 2 updates; dispatch is asynchronous, so without a block the
    # timer of batch b's prepare would also hold batch b-1's two updates
    trainer = Trainer(
        SlowUpdates(), optax.adam(0.1), key=jax.random.key(0), mesh=ONE, run_dir=str(tmp_path)
    )
    trainer.fit(data(), steps=6, log_every=2)
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    goodput = next(r for r in records if r["kind"] == "goodput")
    update = goodput["steps"] / 6
    # three 8-row prepare programs, far less than one update
    assert goodput["prepare"] < 0.5 * update, goodput
    # one log line per batch, each with that batch's prepare time: together the
    # goodput line's prepare bucket
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert sum(r["prepare_seconds"] for r in train) == pytest.approx(goodput["prepare"], rel=1e-6)

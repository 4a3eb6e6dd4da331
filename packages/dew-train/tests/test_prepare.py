"""The prepare phase: a toy on-policy objective draws actions from the current
policy in ``prepare`` (compiled, no gradient, pre-update weights), then runs
two updates over them. Checked against a hand-written loop with the same
keys, the first update's importance ratio is exactly 1, a run killed between
prepare and the last update resumes bit-identically, and bad prepares are
refused before compiling."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.objectives import Objective, Updates, Weighted
from dew.train import Checkpoints, MeshSpec, Trainer
from dew.train.step import Stream

ROWS, FEATURES, ACTIONS, LR = 8, 4, 5, 0.5


class Bandit(Objective):
    """A contextual bandit: ``pi(a | x) = softmax(x W)``; reward 1 when ``a`` is
    the row's target. prepare samples ``a`` and keeps its log-prob; the loss is
    ``-mean(exp(logp - old_logp) * (reward - mean reward))``."""

    model = None

    def __init__(self, updates=Updates(epochs=2, minibatches=1, shuffle=False), rows_out=None):
        self.prepared_updates = updates
        self.rows_out = rows_out

    def init(self, key):
        return {"params": {"policy": {"w": 0.1 * jax.random.normal(key, (FEATURES, ACTIONS))}}}

    def prepare(self, variables, batch, step):
        logits = batch["x"] @ variables["params"]["policy"]["w"]
        actions = jax.random.categorical(step.key, logits)
        logp = jax.nn.log_softmax(logits)[jnp.arange(actions.shape[0]), actions]
        reward = (actions == batch["target"]).astype(jnp.float32)
        out = {"x": batch["x"], "action": actions, "old_logp": logp, "adv": reward - reward.mean()}
        if self.rows_out is not None:
            out["adv"] = out["adv"][: self.rows_out]
        return out

    def loss(self, variables, batch, step):
        logits = batch["x"] @ variables["params"]["policy"]["w"]
        logp = jax.nn.log_softmax(logits)[jnp.arange(batch["action"].shape[0]), batch["action"]]
        ratio = jnp.exp(logp - batch["old_logp"])
        return -jnp.mean(ratio * batch["adv"]), {"ratio": Weighted.mean(ratio)}


def batches():
    rng = np.random.default_rng(0)
    for _ in itertools.count():
        yield {
            "x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
            "target": rng.integers(0, ACTIONS, ROWS).astype(np.int32),
        }


def data():
    return Dataset(train=lambda p: batches(), val=None, records=0, batch=ROWS)


ONE = MeshSpec(data=1, devices=jax.devices()[:1])


def hand_loop(cycles: int):
    """The same run written out: per cycle, sample with the PREPARE stream of
    the cycle's first step, then two sgd steps on the surrogate loss."""
    objective = Bandit()
    k_init, k_run = jax.random.split(jax.random.key(0))
    params = objective.init(k_init)["params"]["policy"]
    stream = batches()
    ratios = []
    step = 0
    for _ in range(cycles):
        b = next(stream)
        key = jax.random.fold_in(jax.random.fold_in(k_run, step), Stream.PREPARE)
        logits = np.asarray(b["x"] @ params["w"])
        actions = np.asarray(jax.random.categorical(key, logits))
        logz = np.log(np.exp(logits).sum(1))
        old = logits[np.arange(ROWS), actions] - logz
        reward = (actions == b["target"]).astype(np.float32)
        adv = reward - reward.mean()
        for _ in range(2):
            w = np.asarray(params["w"], np.float64)
            lg = b["x"] @ w
            p = np.exp(lg - lg.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            logp = np.log(p[np.arange(ROWS), actions])
            ratio = np.exp(logp - old)
            ratios.append(ratio.mean())
            # d/dW of -mean(ratio * adv): ratio * adv * d logp; d logp / d logits = onehot - p
            coef = -(ratio * adv) / ROWS
            dlogits = coef[:, None] * (np.eye(ACTIONS)[actions] - p)
            grad = b["x"].T.astype(np.float64) @ dlogits
            params = {"w": (w - LR * grad).astype(np.float32)}
            step += 1
    return params, ratios


def test_prepare_then_two_updates_matches_a_hand_loop(tmp_path):
    trainer = Trainer(
        Bandit(), optax.sgd(LR), key=jax.random.key(0), mesh=ONE, run_dir=str(tmp_path)
    )
    state = trainer.fit(data(), steps=6, log_every=1)
    want, ratios = hand_loop(3)
    np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)
    import json

    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    logged = [r["ratio"] for r in rows if r["kind"] == "train"]
    assert logged[0::2] == [1.0, 1.0, 1.0]  # the first update of each batch: exactly 1
    np.testing.assert_allclose(logged, ratios, rtol=1e-5)
    assert logged[1] != 1.0  # the second update is off-policy
    assert (int(state.step), int(state.updates)) == (6, 6)
    goodput = next(r for r in rows if r["kind"] == "goodput")
    assert goodput["prepare"] > 0


class Crash(Exception):
    pass


def test_killed_between_prepare_and_last_update_resumes_bit_identically(tmp_path):
    whole = Trainer(Bandit(), optax.adam(0.1), key=jax.random.key(0), mesh=ONE)
    want = whole.fit(data(), steps=8, log_every=0)

    directory = tmp_path / "run"
    first = Trainer(
        Bandit(),
        optax.adam(0.1),
        key=jax.random.key(0),
        mesh=ONE,
        checkpoints=Checkpoints(directory, use_async=False),
    )

    def crash(info):
        if info.step == 5:  # after the first update of the third batch
            raise Crash

    first.add_hook(crash)
    with pytest.raises(Crash):
        first.fit(data(), steps=8, log_every=0, checkpoint_every=2)
    assert Checkpoints(directory).steps() == [2, 4]
    again = Trainer(
        Bandit(),
        optax.adam(0.1),
        key=jax.random.key(0),
        mesh=ONE,
        checkpoints=Checkpoints(directory, use_async=False),
    )
    state = again.fit(data(), steps=8, log_every=0, checkpoint_every=2)
    np.testing.assert_array_equal(state.params["w"], want.params["w"])
    jax.tree.map(np.testing.assert_array_equal, state.opt_state, want.opt_state)


def test_bad_prepares_are_refused_before_compiling():
    with pytest.raises(ValueError, match=r"different leading dimensions .*'adv': 6"):
        Trainer(Bandit(rows_out=6), optax.sgd(LR), key=jax.random.key(0), mesh=ONE).fit(
            data(), steps=2
        )
    three = Updates(epochs=1, minibatches=3)
    with pytest.raises(
        ValueError, match=r"returned 8 rows, which do not split into the declared 3"
    ):
        Trainer(Bandit(updates=three), optax.sgd(LR), key=jax.random.key(0), mesh=ONE).fit(
            data(), steps=3
        )
    with pytest.raises(ValueError, match=r"steps=3 must be a multiple of 2"):
        Trainer(Bandit(), optax.sgd(LR), key=jax.random.key(0), mesh=ONE).fit(data(), steps=3)

"""LoRA through the trainer: a LoRA policy (``dew.nn.lora.LoRA.apply``) with a frozen
reference that defaults to the initial policy, as DPO and GRPO declare it.

Checked: the optimizer state and the moving average hold the adapters only
(leaf and byte counts against adam's two moments); the base weights come out of
training bit-identical and the reference is the base (its logits equal the
plain model's on the initial weights) without a second copy in the state; a
run resumed from a checkpoint equals the uninterrupted one bit for bit."""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn.lora import LoRA, base_module, is_adapter, lora_of, split
from dew.nn.testing import tiny_lm
from dew.objectives import EMA, Objective, Role, Weighted, with_initial_values
from dew.objectives.language.lm import token_nll
from dew.train import Checkpoints, MeshSpec, Trainer, load_model

pytestmark = pytest.mark.slow  # three short runs

SEQ, ROWS, STEPS = 8, 4, 4
LORA = LoRA(rank=2, alpha=4.0, targets=("layers/attention", "layers/mlp/(up|down)"))
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


@dataclasses.dataclass(eq=False)
class Tuned(Objective):
    """Next-token NLL of a policy, with the reference's NLL as a metric; the
    reference is declared the initial policy (``Role(initial_from='policy')``), as
    DPO's and GRPO's default is, and ``target`` the policy's moving average
    (``Role(averages='policy')``, the objective's EMA)."""

    model: Any
    init_params: Any = None
    ema: EMA | None = EMA(decay=0.5)

    def roles(self):
        return (
            Role(name="policy", module=self.model),
            Role(name="reference", module=self.model, trained=False, initial_from="policy"),
            Role(name="target", module=self.model, trained=False, averages="policy"),
        )

    def init(self, key):
        params = self.model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
        if self.init_params is not None:
            params = with_initial_values(params, self.init_params)
        return {"params": {"policy": params}}  # the trainer makes the reference: the base, once

    def loss(self, variables, batch, step):
        tokens = batch["text"]
        logits = self.model.apply({"params": variables["params"]["policy"]}, tokens[:, :-1])
        ref = self.model.apply({"params": variables["reference"]["params"]}, tokens[:, :-1])
        nll = token_nll(logits, tokens[:, 1:])
        return Weighted.mean(nll), {"ref_nll": Weighted.mean(token_nll(ref, tokens[:, 1:]))}


def batches():
    rng = np.random.default_rng(0)
    while True:
        yield {"text": rng.integers(0, 32, (ROWS, SEQ + 1)).astype(np.int32)}


def data():
    return Dataset(train=lambda p: batches(), val=None, records=0, batch=ROWS)


@pytest.fixture(scope="module")
def pretrained():
    """A 'pretrained' base: the plain model's random weights."""
    model = tiny_lm(max_seq_len=SEQ)
    return model, nn.unbox(model.init(jax.random.key(7), jnp.zeros((1, SEQ), jnp.int32))["params"])


def trainer(pretrained, **kw):
    model, params = pretrained
    objective = Tuned(LORA.apply(model), init_params=params)
    return Trainer(objective, optax.adam(0.05), key=jax.random.key(0), mesh=ONE, **kw)


@pytest.fixture(scope="module")
def run(pretrained, tmp_path_factory):
    directory = tmp_path_factory.mktemp("whole")
    t = trainer(pretrained, checkpoints=Checkpoints(str(directory)))
    t.directory = directory
    initial = jax.device_get(t.init_state())
    log = []
    t.add_hook(lambda info: log.append(info.metrics), every=1)
    final = t.fit(data(), steps=STEPS, log_every=1)
    return t, initial, jax.device_get(final), log


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if np.ndim(x))


def test_only_adapters_are_trained(run, pretrained):
    _, initial, final, _ = run
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(final.params)]
    assert paths and all(is_adapter(p) for p in paths)
    abstract = jax.eval_shape(run[0].objective.init, jax.random.key(0))
    count = len(jax.tree.leaves(split(nn.unbox(abstract["params"]["policy"]))[1]))
    assert len(jax.tree.leaves(final.params)) == count == 12  # (4 attention + 2 mlp) x (A, B)
    # adam: two moments per adapter plus a scalar count; nothing the size of the base
    moments = [x for x in jax.tree.leaves(final.opt_state) if np.ndim(x)]
    assert len(moments) == 2 * count
    assert _bytes(final.opt_state) == 2 * _bytes(final.params)
    assert _bytes(final.averaged) == _bytes(final.params)  # the EMA: adapters only
    base_bytes = _bytes(pretrained[1])
    assert _bytes(final.params) < base_bytes / 4
    # B starts at zero and moves; the base is held once, frozen, and never moves
    b_leaves = [
        x
        for p, x in jax.tree_util.tree_leaves_with_path(initial.params)
        if "lora_b" in jax.tree_util.keystr(p)
    ]
    assert all(np.all(b == 0) for b in b_leaves)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(initial.params), jax.tree.leaves(final.params))
    )
    assert set(final.frozen) == {"lora_base"}  # no second copy for the reference
    jax.tree.map(np.testing.assert_array_equal, final.frozen["lora_base"]["policy"], pretrained[1])


def test_reference_is_the_base(run, pretrained):
    t, _, final, log = run
    model, params = pretrained
    tokens = np.asarray(next(batches())["text"])
    variables = final.variables()
    lora_model = t.objective.model
    plain = jax.jit(model.apply)({"params": params}, tokens[:, :-1])
    ref = jax.jit(lora_model.apply)(variables["reference"], tokens[:, :-1])
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(plain))
    # the trained policy differs from the base, and the reference metric stayed the base's
    policy = jax.jit(lora_model.apply)({"params": variables["params"]["policy"]}, tokens[:, :-1])
    assert np.abs(np.asarray(policy) - np.asarray(plain)).max() > 1e-3
    first = float(token_nll(plain, tokens[:, 1:]).mean())
    assert log[0]["ref_nll"] == pytest.approx(first, abs=1e-5)
    assert base_module(lora_model) is model


def test_load_model_rebuilds_the_lora_policy(run):
    t, _, final, _ = run
    model, params = load_model(str(t.directory), averaged=False)
    assert lora_of(model) == LORA
    tokens = np.asarray(next(batches())["text"])[:, :-1]
    live = final.variables(averaged=False)["params"]["policy"]
    want = jax.jit(t.objective.model.apply)({"params": live}, tokens)
    got = jax.jit(model.apply)({"params": params}, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # by default load_model follows the checkpoint: the EMA weights, as state.variables()
    _, default = load_model(str(t.directory))
    jax.tree.map(np.testing.assert_array_equal, default, final.variables()["params"]["policy"])
    # the declared relations come back too: the reference is the base without adapters
    # (stored once), the target the policy's moving average (the EMA of the adapters)
    base_model, base = load_model(str(t.directory), role="reference")
    assert lora_of(base_model) is None and base_model == base_module(t.objective.model)
    jax.tree.map(np.testing.assert_array_equal, base, final.frozen["lora_base"]["policy"])
    target_model, target = load_model(str(t.directory), role="target")
    assert lora_of(target_model) == LORA
    averaged = final.variables(averaged=True)
    jax.tree.map(np.testing.assert_array_equal, target, averaged["params"]["policy"])
    jax.tree.map(np.testing.assert_array_equal, averaged["target"]["params"], target)


def test_resume_equals_uninterrupted(run, pretrained, tmp_path):
    _, _, final, _ = run
    stopped = trainer(pretrained, checkpoints=Checkpoints(str(tmp_path)))
    stopped.fit(data(), steps=STEPS // 2, log_every=0)
    # fit again on the directory: restores step STEPS // 2 (the same compiled step)
    resumed = jax.device_get(stopped.fit(data(), steps=STEPS, log_every=0))
    assert int(resumed.step) == STEPS
    jax.tree.map(np.testing.assert_array_equal, resumed.params, final.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, final.opt_state)
    jax.tree.map(np.testing.assert_array_equal, resumed.frozen, final.frozen)
    assert math.isfinite(float(jax.tree.leaves(resumed.params)[0].sum()))


def test_grpo_rollouts_under_lora_have_ratio_one_and_zero_kl(pretrained):
    """GRPO samples with the cached decoder (the unrolled layer layout) and scores
    with the scanned forward: both adapt the same kernels, so the first update's
    ratio is 1 (asserted inside the step by check_first_ratio) and, with fresh
    adapters, the k3 KL to the base-view reference is 0."""
    from dew.objectives import Updates
    from dew.objectives.cores.rewards import TokenReward
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.sampling import Sampling

    model, params = pretrained

    def low_ids(completion, mask, batch):  # about half the tokens score: groups vary
        return jnp.sum((completion < 16) & mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)

    grpo = GRPOObjective(
        model=LORA.apply(model),
        rewards=[TokenReward(fn=low_ids)],
        group_size=4,
        max_new_tokens=3,
        sampling=Sampling(temperature=1.0),
        beta=0.1,
        prepared_updates=Updates(epochs=2, minibatches=1),
        check_first_ratio=True,
        init_params=params,
    )
    prompts = {"prompt": np.array([[1], [5]], np.int32), "prompt_mask": np.ones((2, 1), bool)}
    data = Dataset(train=lambda p: iter(lambda: prompts, None), val=None, records=0, batch=2)
    t = Trainer(grpo, optax.adam(0.05), key=jax.random.key(0), mesh=ONE)
    log = []
    t.add_hook(lambda info: log.append(info.metrics), every=1)
    state = jax.device_get(t.fit(data, steps=4, log_every=1))
    assert set(state.frozen) == {"lora_base"}  # the reference is the base view
    assert log[0]["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert log[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert log[0]["loss"] != 0 and log[2]["kl"] > 0  # the updates left the base


def test_ppo_under_lora_trains_only_adapters_with_ratio_one(pretrained):
    """PPO with a LoRA policy and its value head on the trunk: the policy's base
    stays frozen (once, in ``frozen['lora_base']``, bit-identical after training;
    the reference is its view), the optimizer holds the adapters and the value
    head only, and the first update's ratio is 1 (asserted in the step too)."""
    from dew.objectives import Updates
    from dew.objectives.cores.rewards import TokenReward
    from dew.objectives.rl.ppo import PPOObjective

    model, params = pretrained

    def low_ids(completion, mask, batch):
        return jnp.sum((completion < 16) & mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)

    ppo = PPOObjective(
        model=LORA.apply(model),
        reward=TokenReward(fn=low_ids),
        max_new_tokens=3,
        prepared_updates=Updates(epochs=2, minibatches=1),
        debug=True,
        init_params=params,
    )
    prompts = {
        "prompt": np.array([[1], [5], [9], [3]], np.int32),
        "prompt_mask": np.ones((4, 1), bool),
    }
    data = Dataset(train=lambda p: iter(lambda: prompts, None), val=None, records=0, batch=4)
    t = Trainer(ppo, optax.adam(0.05), key=jax.random.key(0), mesh=ONE)
    log = []
    t.add_hook(lambda info: log.append(info.metrics), every=1)
    state = jax.device_get(t.fit(data, steps=4, log_every=1))
    assert set(state.frozen) == {"lora_base"}  # the reference is the base view
    jax.tree.map(np.testing.assert_array_equal, state.frozen["lora_base"]["policy"], params)
    policy = state.params["policy"]
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(policy)]
    assert paths and all(is_adapter(p) for p in paths)  # only adapters in the trained policy
    adam_moments = 2 * _bytes(state.params)
    assert _bytes(state.opt_state) == adam_moments  # adapters + value head, nothing else
    assert log[0]["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert log[1]["ratio"] != pytest.approx(1.0, abs=1e-6)  # the adapters moved

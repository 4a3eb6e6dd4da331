"""PPO's math against numpy loops written from the definitions (GAE with masks,
the end-token score, whitening, the clipped losses), the GAE identity (gamma =
lambda = 1, no KL: every return is the final score), and the objective's
prepare + loss on a tiny policy: its loss is the numpy formula of its own
log-probs and values, the first ratio is 1, pads after the end count nowhere."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, Critic
from dew.objectives import Step, Updates
from dew.objectives.contract import weighted as wt
from dew.objectives.cores.rewards import TextReward, TokenReward
from dew.objectives.cores.rl import check_first_update, clipped_policy_loss
from dew.objectives.cores.rollouts import Rollout
from dew.objectives.rl.ppo import (
    PPOObjective,
    evaluate_rollout,
    explained_variance,
    gae,
    in_chunks,
    token_rewards,
    value_loss,
    whiten,
)

ROWS, NEW = 6, 5
RNG = np.random.default_rng(0)
LENGTHS = np.array([5, 3, 1, 0, 4, 5])  # new tokens per row, an end id included
MASK = np.arange(NEW)[None, :] < LENGTHS[:, None]  # [rows, new]


def numpy_gae(rewards, values, lengths, gamma, lam):
    """Row by row, from the last real token back; nothing after the end."""
    adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
            ret[b, t] = last + values[b, t]
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_is_the_numpy_loop_with_masks(gamma, lam):
    rewards = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    values = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    # garbage after the end must not leak into any real token's advantage
    rewards_padded = np.where(MASK, rewards, 100.0).astype(np.float32)
    values_padded = np.where(MASK, values, -100.0).astype(np.float32)
    adv, ret = jax.jit(gae, static_argnames=("gamma", "lam"))(
        rewards_padded, values_padded, MASK, gamma=gamma, lam=lam
    )
    want_adv, want_ret = numpy_gae(
        rewards.astype(np.float64), values.astype(np.float64), LENGTHS, gamma, lam
    )
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(adv)[~MASK]) and not np.any(np.asarray(ret)[~MASK])


def test_gae_identity_returns_are_the_final_score_everywhere():
    """gamma = lambda = 1 and no KL: R_t = sum_{k >= t} r_k = the score, whatever V is."""
    scores = RNG.normal(size=ROWS).astype(np.float32)
    kl = RNG.normal(size=(ROWS, NEW)).astype(np.float32)  # ignored at kl_coef 0
    values = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    rewards = token_rewards(scores, kl, MASK, kl_coef=0.0)
    adv, ret = gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    want = np.where(MASK, scores[:, None], 0.0)
    np.testing.assert_allclose(ret, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(adv, np.where(MASK, want - values, 0.0), rtol=1e-6, atol=1e-6)


def test_token_rewards_put_the_score_on_the_last_real_token():
    scores = np.arange(1, ROWS + 1, dtype=np.float32)
    kl = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    got = np.asarray(token_rewards(scores, kl, MASK, kl_coef=0.1))
    want = np.zeros((ROWS, NEW))
    for b, n in enumerate(LENGTHS):
        want[b, :n] = -0.1 * kl[b, :n]
        if n:
            want[b, n - 1] += scores[b]  # the end token; an empty row gets nothing
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_whitening_and_explained_variance_over_valid_tokens():
    x = RNG.normal(loc=3.0, scale=2.0, size=(ROWS, NEW)).astype(np.float32)
    valid = np.asarray(x, np.float64)[MASK]
    got = np.asarray(whiten(x, MASK))
    np.testing.assert_allclose(
        got[MASK], (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), rtol=1e-5
    )
    assert not np.any(got[~MASK])
    returns = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    values = (returns + 0.3 * RNG.normal(size=(ROWS, NEW))).astype(np.float32)
    r, v = returns.astype(np.float64)[MASK], values.astype(np.float64)[MASK]
    want = 1.0 - np.var(r - v) / np.var(r)
    assert float(explained_variance(values, returns, MASK)) == pytest.approx(want, rel=1e-5)


def test_clipped_losses_are_the_numpy_formulas():
    logps = RNG.normal(scale=0.5, size=(ROWS, NEW)).astype(np.float32)
    old = (logps + RNG.normal(scale=0.3, size=(ROWS, NEW))).astype(np.float32)
    adv = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    pg, ratio, pg_clipped = clipped_policy_loss(logps, old, adv, epsilon_low=0.2, epsilon_high=0.2)
    rho = np.exp(np.float64(logps) - old)
    want = np.maximum(-adv * rho, -adv * np.clip(rho, 0.8, 1.2))
    np.testing.assert_allclose(ratio, rho, rtol=1e-6)
    np.testing.assert_allclose(pg, want, rtol=1e-5, atol=1e-6)
    # the clip removes the gradient where the clipped term is the larger: TRL's PPO definition
    np.testing.assert_array_equal(pg_clipped, -adv * np.clip(rho, 0.8, 1.2) > -adv * rho + 1e-7)
    assert 0 < float(np.mean(pg_clipped)) < 1  # both branches are exercised

    values = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    old_values = (values + RNG.normal(scale=0.4, size=(ROWS, NEW))).astype(np.float32)
    returns = RNG.normal(size=(ROWS, NEW)).astype(np.float32)
    vf, vf_clipped = value_loss(values, old_values, returns, clip_range_value=0.2)
    moved = old_values + np.clip(np.float64(values) - old_values, -0.2, 0.2)
    want = 0.5 * np.maximum((values - np.float64(returns)) ** 2, (moved - returns) ** 2)
    np.testing.assert_allclose(vf, want, rtol=1e-5, atol=1e-6)
    assert 0 < float(np.mean(vf_clipped)) < 1


def test_in_chunks_is_the_whole_batch_in_row_order():
    tree = {"x": np.arange(8.0), "y": np.arange(24.0).reshape(8, 3)}
    seen = []

    def fn(t):
        seen.append(t["x"].shape)
        return {"a": t["x"] * 2 + t["y"].sum(-1), "b": t["y"][:, :2]}

    got = jax.jit(lambda t: in_chunks(fn, t, 2))(tree)
    want = fn(tree)
    assert seen[0] == (2,)  # the function ran on 2-row chunks
    np.testing.assert_array_equal(got["a"], want["a"])
    np.testing.assert_array_equal(got["b"], want["b"])


# ------------------------------------------------------- the objective itself
VOCAB, END = 16, 3
POLICY_CONFIG = dict(emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=8)
POLICY = CausalTransformer(vocab_size=VOCAB, **POLICY_CONFIG)
CRITIC = Critic(
    trunk=CausalTransformer(
        vocab_size=VOCAB,
        emb_features=8,
        num_layers=1,
        num_heads=2,
        mlp_features=16,
        max_seq_len=8,
        tie_embeddings=True,
    ),
    init_std=0.1,
)


def sevens(completion, mask, batch):
    """The fraction of a completion's tokens that are 7."""
    return jnp.sum((completion == 7) & mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1)


def objective(**kw):
    options = dict(
        reward=TokenReward(fn=sevens),
        max_new_tokens=4,
        end_ids=(END,),
        kl_coef=0.1,
        gamma=0.9,
        lam=0.8,
        debug=True,
    )
    return PPOObjective(model=POLICY, **{**options, **kw})


PROMPT = np.random.default_rng(1).integers(4, VOCAB, (8, 3)).astype(np.int32)
PROMPT_MASK = np.ones_like(PROMPT, bool)
PROMPT_MASK[0, :2] = PROMPT_MASK[5, :1] = False  # left padding


@pytest.fixture(scope="module", params=["trunk", "critic"])
def prepared(request):
    ppo = objective(critic=CRITIC if request.param == "critic" else None)
    variables = nn.unbox(jax.jit(ppo.init)(jax.random.key(0)))
    # a policy that drifted from its reference, so the KL term is not 0
    variables["params"]["policy"] = jax.tree.map(lambda x: x * 1.3, variables["params"]["policy"])
    step = Step(index=jnp.int32(0), key=jax.random.key(7))
    batch = {"prompt": PROMPT, "prompt_mask": PROMPT_MASK}
    out = jax.device_get(jax.jit(ppo.prepare)(variables, batch, step))
    fns = dict(loss=jax.jit(ppo.loss), evaluate=jax.jit(functools.partial(evaluate_rollout, ppo)))
    return ppo, variables, out, fns


def test_prepare_is_the_numpy_pipeline_of_its_own_logprobs_and_values(prepared):
    ppo, variables, out, fns = prepared
    mask = out["completion_mask"]
    lengths = mask.sum(-1)
    # the rollout ends at the end id, and nothing is kept after it
    for row, n in zip(out["completion"], lengths):
        assert END not in row[: n - 1] and (n == 4 or row[n - 1] == END)
        assert np.all(row[n:] == 0)
    assert lengths.min() < 4, "the test prompts should produce an early end id"
    logps, values = jax.device_get(fns["evaluate"](variables["params"], Rollout.from_batch(out)))
    np.testing.assert_array_equal(out["old_logps"], logps)
    np.testing.assert_array_equal(out["old_values"], values)
    ref = jax.device_get(
        fns["evaluate"](
            {"policy": variables["reference"]["params"], "value": variables["params"]["value"]},
            Rollout.from_batch(out),
        )[0]
    )
    kl = np.where(mask, np.float64(logps) - ref, 0.0)
    np.testing.assert_allclose(out["kl"], kl.sum(-1), rtol=1e-5, atol=1e-6)
    assert np.abs(out["kl"]).max() > 1e-3
    scores = (np.where(mask, out["completion"], -1) == 7).sum(-1) / lengths
    np.testing.assert_allclose(out["scores"], scores, rtol=1e-6)
    np.testing.assert_allclose(out["reward/sevens"], scores, rtol=1e-6)
    rewards = -0.1 * kl
    rewards[np.arange(len(lengths)), lengths - 1] += scores
    adv, ret = numpy_gae(rewards, np.float64(values), lengths, 0.9, 0.8)
    np.testing.assert_allclose(out["returns"], ret, rtol=1e-5, atol=1e-5)
    a = adv[mask]
    want = np.where(mask, (adv - a.mean()) / np.sqrt(a.var(ddof=1) + 1e-8), 0.0)
    np.testing.assert_allclose(out["advantages"], want, rtol=1e-4, atol=1e-5)


def test_loss_is_the_numpy_formula_and_the_first_ratio_is_one(prepared):
    ppo, variables, out, fns = prepared
    step = Step(index=jnp.int32(0), key=jax.random.key(8))
    loss, metrics = fns["loss"](variables, out, step)
    metrics = wt.to_float(metrics)
    assert metrics["ratio_max_deviation"] <= 1e-6  # the same weights as prepare
    assert metrics["approx_kl"] <= 1e-12 and metrics["policy_clip_fraction"] == 0.0
    # a moved policy and value: the loss vs numpy from the objective's own forward pass
    moved = jax.tree.map(lambda x: x * 0.9, variables["params"])
    later = Step(index=jnp.int32(1), key=step.key)  # not a first update: no ratio check
    loss, metrics = fns["loss"]({**variables, "params": moved}, out, later)
    logps, values = jax.device_get(fns["evaluate"](moved, Rollout.from_batch(out)))
    mask = out["completion_mask"]
    rho = np.exp(np.float64(logps) - out["old_logps"])
    adv = out["advantages"]
    pg = np.maximum(-adv * rho, -adv * np.clip(rho, 0.8, 1.2))[mask].mean()
    moved_v = out["old_values"] + np.clip(values - np.float64(out["old_values"]), -0.2, 0.2)
    vf = 0.5 * np.maximum((values - out["returns"]) ** 2, (moved_v - out["returns"]) ** 2)
    vf = vf[mask].mean()
    got = float(wt.loss_value(loss))
    assert got == pytest.approx(pg + 0.1 * vf, rel=1e-5, abs=1e-7)
    metrics = wt.to_float(metrics)
    assert metrics["policy_loss"] == pytest.approx(pg, rel=1e-5, abs=1e-7)
    assert metrics["value_loss"] == pytest.approx(vf, rel=1e-5, abs=1e-7)
    assert metrics["tokens"] == mask.sum()
    assert metrics["approx_kl"] == pytest.approx(
        0.5 * ((np.float64(logps) - out["old_logps"])[mask] ** 2).mean(), rel=1e-4
    )
    assert metrics["score"] == pytest.approx(out["scores"].mean(), rel=1e-6)
    # pads after the end id: any value there changes nothing
    garbage = dict(out, completion=np.where(mask, out["completion"], 9).astype(np.int32))
    garbage["advantages"] = np.where(mask, out["advantages"], 50.0).astype(np.float32)
    again, _ = fns["loss"]({**variables, "params": moved}, garbage, later)
    assert float(wt.loss_value(again)) == pytest.approx(got, rel=1e-6, abs=1e-8)


def test_debug_mode_raises_when_the_first_ratio_is_not_one(prepared):
    ppo, variables, out, fns = prepared
    moved = jax.tree.map(lambda x: x * 0.9, variables["params"])
    with pytest.raises(Exception, match="max \\|rho - 1\\|"):
        loss, _ = fns["loss"](
            {**variables, "params": moved}, out, Step(index=jnp.int32(0), key=jax.random.key(0))
        )
        jax.block_until_ready(loss)


def count_sevens(completion, mask, batch):
    return jnp.sum((completion == 7) & mask, -1).astype(jnp.float32)


def test_a_text_reward_runs_on_the_host_between_two_compiled_parts():
    """The count of 7s as decoded text (host) gives the batch the token reward gives."""
    token = objective(reward=TokenReward(fn=count_sevens, name="sevens"))
    text = objective(
        reward=TextReward(
            fn=lambda prompts, completions: [c.count("\x07") for c in completions], name="sevens"
        )
    )
    assert text.has_prepare_host and not token.has_prepare_host
    variables = nn.unbox(jax.jit(token.init)(jax.random.key(0)))
    step = Step(index=jnp.int32(0), key=jax.random.key(7))
    batch = {"prompt": PROMPT, "prompt_mask": PROMPT_MASK}
    want = jax.device_get(jax.jit(token.prepare)(variables, batch, step))
    rollout = jax.device_get(jax.jit(text.prepare)(variables, batch, step))
    host = text.prepare_host(rollout)
    got = jax.device_get(jax.jit(text.prepare_finish)(variables, {**rollout, **host}, step))
    assert sorted(got) == sorted(want) and want["scores"].max() >= 1
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_the_debug_check_allows_float32_rounding_only():
    """One unit in the last place of log p = -12 (~1e-6) passes; a temperature
    mismatch (log p / 0.7) fails."""
    old = jnp.asarray([[-12.0, -0.5, -3.0]])
    mask = jnp.asarray([[True, True, False]])
    check = jax.jit(
        functools.partial(check_first_update, what="PPOObjective"),
        static_argnames="updates_per_batch",
    )
    jax.block_until_ready(
        check(old + jnp.asarray([[1.9e-6, 0.0, 5.0]]), old, mask, step=0, updates_per_batch=4)
    )
    jax.block_until_ready(check(old / 0.7, old, mask, step=1, updates_per_batch=4))  # not first
    with pytest.raises(Exception, match="log-probs off the rollout's"):
        jax.block_until_ready(check(old / 0.7, old, mask, step=4, updates_per_batch=4))


def test_bad_input_is_refused_before_compiling():
    with pytest.raises(ValueError, match="kl_estimator"):
        objective(kl_estimator="k2")
    with pytest.raises(ValueError, match="lam must be in"):
        objective(lam=1.5)
    ppo = objective(prepared_updates=Updates(epochs=1, minibatches=3))
    with pytest.raises(ValueError, match="need 9 positions, more than the model's max_seq_len 8"):
        ppo.check_batch({"prompt": np.zeros((3, 5), np.int32), "prompt_mask": np.ones((3, 5))})
    with pytest.raises(ValueError, match="does not split into 3 minibatches"):
        ppo.check_batch({"prompt": PROMPT, "prompt_mask": PROMPT_MASK})
    with pytest.raises(KeyError, match="prompt_mask"):
        ppo.check_batch({"prompt": PROMPT})
    with pytest.raises(ValueError, match="vocabulary"):
        ppo.check_batch({"prompt": PROMPT[:6] + VOCAB, "prompt_mask": PROMPT_MASK[:6]})


def test_logits_in_chunks_give_todays_loss_and_gradient(prepared):
    """The policy's log-probs (and, on the trunk, the value head's states) from the model
    scoring in chunks of 3 positions: the loss and its gradient of the whole logits."""
    ppo, variables, out, fns = prepared
    chunked = objective(critic=ppo.critic, logits_chunk_size=3)
    moved = jax.tree.map(lambda x: x * 0.9, variables["params"])
    later = Step(index=jnp.int32(1), key=jax.random.key(8))

    def total(obj, params):
        loss, _ = obj.loss({**variables, "params": params}, out, later)
        return sum(t.value for t in loss) if isinstance(loss, tuple) else loss.value

    value, grads = jax.jit(jax.value_and_grad(lambda p: total(ppo, p)))(moved)
    chunked_value, chunked_grads = jax.jit(jax.value_and_grad(lambda p: total(chunked, p)))(moved)
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def reward_model_and_params():
    from dew.objectives.preference.reward_model import CausalRewardModel

    reward_model = CausalRewardModel.of(POLICY)
    init = jax.jit(reward_model.init)(jax.random.key(4), jnp.zeros((1, 7), jnp.int32))
    return reward_model, nn.unbox(init)["params"]


def fit_keeps_the_reward_model_frozen(train) -> None:
    """Through ``train`` (the dew.train module, which this package does not depend on:
    tests/test_reward_model_roles.py calls this): the reward model alone scores, two
    steps leave it frozen beside the reference."""
    import optax

    from dew.data import Dataset

    reward_model, reward_params = reward_model_and_params()

    def prompts(partition):
        while True:
            yield {"prompt": PROMPT, "prompt_mask": PROMPT_MASK}

    alone = objective(
        reward=None,
        reward_model=reward_model,
        reward_model_params=reward_params,
        prepared_updates=Updates(epochs=1, minibatches=1),
    )
    mesh = train.MeshSpec(data=1, devices=jax.devices()[:1])
    trainer = train.Trainer(alone, optax.adam(1e-3), key=jax.random.key(0), mesh=mesh)
    state = trainer.fit(Dataset(prompts, None, records=0, batch=8), steps=2, log_every=2)
    assert set(state.frozen) == {"reference", "reward"}
    np.testing.assert_array_equal(
        state.frozen["reward"]["params"]["score"]["kernel"], reward_params["score"]["kernel"]
    )


def test_a_reward_model_scores_rollouts_in_the_step_as_a_frozen_role():
    """reward_model=: the frozen role 'reward' scores each completion after its prompt
    (re-aligned to the right, rows built here by a loop) inside the compiled prepare,
    weighted and summed with the token reward; weights without a model, a model without
    weights or of another vocabulary are refused. (Through Trainer:
    tests/test_reward_model_roles.py.)"""
    from dew.objectives.preference.reward_model import CausalRewardModel

    reward_model, reward_params = reward_model_and_params()
    judged = dict(reward_model=reward_model, reward_model_params=reward_params)
    ppo = objective(**judged, reward_model_weight=0.5)
    assert [r.name for r in ppo.roles()] == ["policy", "value", "reference", "reward"]
    assert not ppo.has_prepare_host  # scored inside the one compiled prepare
    variables = nn.unbox(jax.jit(ppo.init)(jax.random.key(0)))
    jax.tree.map(np.testing.assert_array_equal, variables["reward"]["params"], reward_params)
    step = Step(index=jnp.int32(0), key=jax.random.key(7))
    out = jax.device_get(
        jax.jit(ppo.prepare)(variables, {"prompt": PROMPT, "prompt_mask": PROMPT_MASK}, step)
    )
    ids = np.zeros((len(PROMPT), PROMPT.shape[1] + 4), np.int32)
    real = np.zeros(ids.shape, bool)
    for r in range(len(ids)):
        row = out["prompt"][r][out["prompt_mask"][r]].tolist()
        row += out["completion"][r][out["completion_mask"][r]].tolist()
        ids[r, : len(row)], real[r, : len(row)] = row, True
    want = np.asarray(reward_model.apply({"params": reward_params}, ids, real), np.float64)
    assert np.ptp(want) > 1e-4  # the rows differ, so a misaligned row would show
    # atol: a score near 0 (-0.0053) carries the float32 rounding of sums of size ~0.2
    # (8e-9 measured); a misaligned row would be off by the rows' spread (ptp > 1e-4)
    np.testing.assert_allclose(out["reward/reward_model"], want, rtol=1e-6, atol=1e-7)
    mask = out["completion_mask"]
    sevens_ = (np.where(mask, out["completion"], -1) == 7).sum(-1) / mask.sum(-1)
    np.testing.assert_allclose(out["reward/sevens"], sevens_, rtol=1e-6)
    np.testing.assert_allclose(out["scores"], sevens_ + 0.5 * want, rtol=1e-6, atol=1e-7)
    _, metrics = jax.jit(ppo.loss)(variables, out, step)
    metrics = wt.to_float(metrics)
    assert metrics["reward/reward_model"] == pytest.approx(float(np.mean(want)), rel=1e-5)
    assert not [r for r in ppo.roles() if r.name == "reward" and r.trained]
    with pytest.raises(ValueError, match="reward_model= and reward_model_params= come together"):
        objective(reward_model_params=reward_params)
    with pytest.raises(ValueError, match="reward_model= and reward_model_params= come together"):
        objective(reward_model=reward_model)
    with pytest.raises(ValueError, match="needs a score: reward="):
        objective(reward=None)
    other = CausalRewardModel.of(CausalTransformer(**{**POLICY_CONFIG, "vocab_size": 32}))
    with pytest.raises(ValueError, match="vocabulary has 32 ids, the policy's 16"):
        objective(reward_model=other, reward_model_params=reward_params)

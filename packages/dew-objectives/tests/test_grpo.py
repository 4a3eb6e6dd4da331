"""GRPO's parts against numpy: group advantages (identical-reward groups give 0),
the clipped loss under each aggregation, k3, rollouts vs the decoder, rewards
(weights, host and jit, errors naming the function and the prompt), bad input,
and the first-ratio debug assertion."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.nn import CausalTransformer
from dew.objectives import Step
from dew.objectives.cores.rewards import (
    HostImageReward,
    ImageReward,
    ImageRewards,
    Reward,
    RewardError,
    Rewards,
    TextReward,
    TokenReward,
)
from dew.objectives.cores.rollouts import rollout_logprobs
from dew.objectives.rl.grpo import GRPOObjective, group_advantages
from dew.sampling import Sampling
from dew.sampling.causal.generate import decode

V, G, NEW = 16, 4, 5
TINY = dict(emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=12)
MODEL = CausalTransformer(vocab_size=V, **TINY)
SAMPLING = Sampling(temperature=0.8)


def sevens(completion, mask, batch):
    return jnp.sum((completion == 7) & mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)


def objective(**kw):
    base = dict(
        rewards=[TokenReward(fn=sevens)],
        group_size=G,
        max_new_tokens=NEW,
        sampling=SAMPLING,
        end_ids=(2,),
    )
    return GRPOObjective(model=MODEL, **{**base, **kw})


@pytest.fixture(scope="module")
def params():
    init = jax.jit(MODEL.init)
    return nn.unbox(init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]


PROMPT = np.array([[0, 0, 3, 4], [0, 5, 6, 9]], np.int32)
PROMPT_MASK = np.array([[0, 0, 1, 1], [0, 1, 1, 1]], bool)
ANSWER = np.array([[7, 7, 0], [8, 0, 0]], np.int32)  # right-padded, as dew.data.Prompts reads it


# ------------------------------------------------------------- advantages
def numpy_advantages(r, g, scale, eps):
    groups = np.asarray(r, np.float64).reshape(-1, g)
    centred = groups - groups.mean(1, keepdims=True)
    if scale == "group":
        centred = centred / (groups.std(1, ddof=1, keepdims=True) + eps)
    elif scale == "batch":
        centred = centred / (np.asarray(r, np.float64).std(ddof=1) + eps)
    constant = np.ptp(groups, axis=1) == 0
    centred[constant] = 0.0
    return centred.reshape(-1), np.repeat(constant, g)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_numpy_and_identical_groups_are_zero(scale):
    rng = np.random.default_rng(0)
    r = rng.normal(size=(3, G)).astype(np.float32)
    r[1] = 0.1  # identical rewards: sum/G is not 0.1 in float32, the advantage still is 0
    r = r.reshape(-1)
    adv, zero = jax.jit(lambda x: group_advantages(x, G, scale_rewards=scale, eps=1e-4))(r)
    want, constant = numpy_advantages(r, G, scale, 1e-4)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(adv)[G : 2 * G] == 0.0)  # exactly
    np.testing.assert_array_equal(zero, constant.astype(np.float32))


# ------------------------------------------------- one rollout, shared
KEY = jax.random.key(13)  # rows 2 and 6 end early (at id 2), three 7s drawn


def prepared_rows(params, obj):
    """A prepared batch as prepare -> prepare_host -> prepare_finish make it."""
    ref = jax.tree.map(lambda x: 0.9 * x, params)
    variables = {"params": {"policy": params}, "reference": {"params": ref}}
    batch = {
        "prompt": jnp.asarray(PROMPT),
        "prompt_mask": jnp.asarray(PROMPT_MASK),
        "answer": jnp.asarray(ANSWER),
        "answer_mask": jnp.asarray(ANSWER > 0),
    }
    step = Step(index=jnp.int32(0), key=KEY)
    first = jax.jit(obj.prepare)(variables, batch, step)
    host = obj.prepare_host(jax.device_get(first))
    merged = {**first, **{k: jnp.asarray(v) for k, v in host.items()}}
    return variables, jax.device_get(first), jax.jit(obj.prepare_finish)(variables, merged, step)


OBJ = objective(beta=0.05)


@pytest.fixture(scope="module")
def prepared(params):
    return prepared_rows(params, OBJ)


@pytest.fixture(scope="module")
def losses():
    """``(variables, batch, step) -> [(loss, metrics)]`` for each aggregation, one program."""
    objs = [objective(loss_aggregation=m, epsilon=0.1, epsilon_high=0.3, beta=0.05) for m in MODES]
    return jax.jit(lambda v, b, s: [o.loss(v, b, s) for o in objs])


MODES = ("sequence-mean", "token-mean", "dr_grpo")


@pytest.mark.slow
def test_rollout_is_the_decoder_repeated_per_group_and_old_logps_score_it(params, prepared):
    _, first, batch = prepared
    rows = np.repeat(PROMPT, G, 0), np.repeat(PROMPT_MASK, G, 0)
    tokens, raw_logps, lengths = jax.jit(
        lambda p, t, m: decode(
            MODEL, p, t, m, max_new_tokens=NEW, key=KEY, sampling=SAMPLING, end_ids=(2,)
        )
    )(params, *rows)
    np.testing.assert_array_equal(batch["completion"], tokens)
    np.testing.assert_array_equal(batch["prompt"], rows[0])
    np.testing.assert_array_equal(batch["completion_mask"].sum(1), lengths)
    assert len(set(map(tuple, np.asarray(tokens)[:G]))) > 1  # a group's samples differ
    assert not np.all(np.asarray(batch["completion_mask"]))  # some rows ended at id 2
    # At temperature 1 the full-sequence log-probs equal the cached decoder's (float rounding).
    at_one = jax.jit(lambda p: rollout_logprobs(MODEL, p, _rollout(batch), sampling=Sampling()))
    np.testing.assert_allclose(at_one(params), raw_logps, atol=2e-5)
    # At the sampler's temperature: log_softmax(logits / T) of one forward pass, vs numpy.
    got = np.asarray(batch["old_logps"])
    ids = np.concatenate([rows[0], np.asarray(tokens)], 1)
    mask = np.concatenate([rows[1], np.ones_like(tokens, bool)], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    logits = jax.jit(MODEL.apply)({"params": params}, ids, positions=positions, attention_mask=mask)
    z = np.asarray(logits)[:, PROMPT.shape[1] - 1 : -1].astype(np.float64) / SAMPLING.temperature
    z = z - z.max(-1, keepdims=True)
    picked = np.take_along_axis(z, np.asarray(tokens)[..., None], -1)[..., 0]
    logp = picked - np.log(np.exp(z).sum(-1))
    valid = np.asarray(batch["completion_mask"])
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, logp, 0), atol=2e-5)
    assert np.all(got[~valid] == 0)


# ------------------------------------------------------------------ loss
def numpy_loss(logp, old, ref, adv, mask, *, eps_low, eps_high, beta, mode, clamp=20.0):
    logp, old, ref = (np.asarray(x, np.float64) for x in (logp, old, ref))
    mask = np.asarray(mask, np.float64)
    ratio = np.exp(logp - old)
    a = np.asarray(adv, np.float64)[:, None]
    per = -np.minimum(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    d = np.clip(ref - logp, -clamp, clamp)
    k3 = np.exp(d) - d - 1
    per = per + beta * k3
    if mode == "sequence-mean":
        loss = np.mean((per * mask).sum(1) / mask.sum(1))
    elif mode == "token-mean":
        loss = (per * mask).sum() / mask.sum()
    else:
        loss = (per * mask).sum() / (mask.shape[0] * mask.shape[1])
    clipped = ((ratio < 1 - eps_low) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))
    return loss, (clipped * mask).sum() / mask.sum(), (k3 * mask).sum() / mask.sum()


@pytest.mark.slow
def test_loss_matches_numpy_for_each_aggregation(params, prepared, losses):
    variables, _, batch = prepared
    mask = np.asarray(batch["completion_mask"])
    assert 0 < mask.sum() < mask.size  # some rows ended early: unequal lengths
    # an off-policy update: old log-probs moved, so some ratios leave the clip range
    noise = np.random.default_rng(1).normal(scale=0.3, size=mask.shape).astype(np.float32)
    advantages = jnp.asarray(np.linspace(-1.5, 1.5, mask.shape[0]), jnp.float32)
    moved = {**batch, "old_logps": batch["old_logps"] + noise * mask, "advantages": advantages}
    out = losses(variables, moved, Step(index=jnp.int32(1), key=KEY))
    logp = np.asarray(batch["old_logps"])  # the current policy's: prepare ran on these weights
    for mode, (loss, metrics) in zip(MODES, out):
        want, clip, kl = numpy_loss(
            logp,
            moved["old_logps"],
            batch["ref_logps"],
            advantages,
            mask,
            eps_low=0.1,
            eps_high=0.3,
            beta=0.05,
            mode=mode,
        )
        np.testing.assert_allclose(float(loss.value), want, rtol=1e-5, atol=1e-7, err_msg=mode)
        np.testing.assert_allclose(float(metrics["clip_fraction"].value), clip, rtol=1e-6)
        assert 0 < clip < 1
        np.testing.assert_allclose(float(metrics["kl"].value), kl, rtol=1e-5, atol=1e-8)
        assert float(metrics["tokens"].value) == mask.sum()
    # first update, on the weights prepare used: rho == 1 exactly, nothing clipped
    _, metrics = losses(variables, batch, Step(index=jnp.int32(0), key=KEY))[0]
    assert float(metrics["ratio"].value) == pytest.approx(1.0, abs=1e-6)
    assert float(metrics["clip_fraction"].value) == 0.0


def _rollout(batch):
    from dew.objectives.cores.rollouts import Rollout

    return Rollout.from_batch(batch)


def test_k3_is_float32_and_clamped_where_the_policy_drifted():
    from dew.objectives.cores.logprobs import kl_k3

    logp = jnp.asarray([-1.0, -2.0, -200.0], jnp.bfloat16)
    ref = jnp.asarray([-1.5, -1.0, -1.0], jnp.float32)
    got = kl_k3(logp, ref, clamp=20.0)
    d = np.clip(np.asarray(ref, np.float64) - np.asarray(logp, np.float64), -20, 20)
    assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np.exp(d) - d - 1, rtol=1e-5)


# --------------------------------------------------------------- rewards
def test_token_and_text_rewards_are_weighted_summed(params, prepared):
    variables, first, _ = prepared
    seen = {}

    def answer_match(prompts, completions, answer):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(len(c)) for c in completions]

    obj = objective(
        rewards=[
            TokenReward(fn=sevens, weight=2.0),
            TextReward(fn=answer_match, weight=-0.5, name="length"),
        ],
        beta=0.05,
    )
    assert obj.reward_set.names == ("sevens", "length")
    rewards = obj.prepare_host(first)["rewards"]
    completion, mask = first["completion"], first["completion_mask"]
    want_sevens = ((completion == 7) & mask).sum(1) / mask.sum(1)
    # the text reward sees each completion without its end id, the answer decoded
    want_len = (mask & (completion != 2)).sum(1)
    np.testing.assert_allclose(rewards[:, 0], want_sevens, rtol=1e-6)
    np.testing.assert_array_equal(rewards[:, 1], want_len)
    assert seen["answer"] == ["\x07\x07"] * G + ["\x08"] * G  # repeated per completion
    assert len(seen["prompts"]) == 2 * G and seen["prompts"][0] == "\x03\x04"
    step = Step(index=jnp.int32(0), key=KEY)
    merged = {**first, "rewards": rewards}
    finished = jax.jit(obj.prepare_finish)(variables, merged, step)
    total = 2.0 * want_sevens - 0.5 * want_len
    np.testing.assert_allclose(finished["reward"], total, rtol=1e-6)
    want_adv, _ = numpy_advantages(total, G, "group", 1e-4)
    np.testing.assert_allclose(finished["advantages"], want_adv, rtol=1e-5, atol=1e-6)


def test_bad_rewards_name_the_function_and_the_prompt(prepared):
    _, first, _ = prepared

    def nan_on_sixth(prompts, completions):
        return [float("nan") if i == 5 else 0.0 for i in range(len(completions))]

    def too_few(prompts, completions):
        return [0.0] * (len(completions) - 1)

    def breaks_on_prompt_one(prompts, completions):
        return [1.0 / (p != "\x05\x06\t") for p in prompts]

    def with_text(fn):
        return objective(rewards=[TokenReward(fn=sevens), fn])

    with pytest.raises(
        RewardError, match=r"'nan_on_sixth' returned nan for completion 5 \(prompt 1"
    ):
        with_text(nan_on_sixth).prepare_host(first)
    with pytest.raises(RewardError, match=r"'too_few' returned shape \(7,\) for 8 completions"):
        with_text(too_few).prepare_host(first)
    with pytest.raises(
        RewardError,
        match=r"'breaks_on_prompt_one' raised ZeroDivisionError.*completion 4 \(prompt 1 of the "
        r"batch, sample 0",
    ):
        with_text(breaks_on_prompt_one).prepare_host(first)
    # a token reward: NaN found on the host stage, the wrong shape when traced (before compiling)
    token = dict(first)
    token["token_rewards"] = np.where(np.arange(8)[:, None] == 6, np.nan, first["token_rewards"])
    with pytest.raises(RewardError, match=r"token reward 'sevens' returned nan for completion 6 "):
        OBJ.prepare_host(token)
    wide = objective(rewards=[TokenReward(fn=lambda c, m, b: c, name="wide")])
    with pytest.raises(RewardError, match=r"'wide' returned shape \(8, 5\)"):
        jax.eval_shape(
            wide.reward_set.token_values, first["completion"], first["completion_mask"], {}
        )


def test_bad_input_is_refused_before_compiling():
    with pytest.raises(ValueError, match="group_size >= 2"):
        objective(group_size=1)
    with pytest.raises(ValueError, match="greedy"):
        objective(sampling=Sampling(temperature=0))
    with pytest.raises(ValueError, match="no rewards"):
        objective(rewards=[])
    with pytest.raises(ValueError, match="loss_aggregation"):
        objective(loss_aggregation="mean")
    obj = objective()  # max_seq_len 12, max_new_tokens 5: prompts of at most 7 tokens
    long = {"prompt": np.zeros((2, 8), np.int32), "prompt_mask": np.ones((2, 8), bool)}
    with pytest.raises(ValueError, match="prompts of 8 tokens plus max_new_tokens=5 need 13"):
        obj.check_batch(long)
    from dew.data import Field

    with pytest.raises(ValueError, match="at most 7 tokens"):
        obj.init(jax.random.key(0), spec={"prompt": Field((8,), np.int32)})
    obj.check_batch({"prompt": np.zeros((2, 7), np.int32), "prompt_mask": np.ones((2, 7), bool)})


def test_logits_in_chunks_give_todays_log_probs_and_gradient(prepared):
    """Completions scored in chunks of 3 positions (not dividing prompt 4 + new 5): the
    rollout's old log-probs again (the first update's ratio is 1), and the loss and its
    gradient of the whole-logits objective, on unequal completion lengths."""
    from dew.objectives.cores.rollouts import Rollout, rollout_logprobs

    variables, _, batch = prepared
    chunked = objective(beta=0.05, logits_chunk_size=3)
    rollout = Rollout.from_batch(batch)
    again = rollout_logprobs(
        MODEL, variables["params"]["policy"], rollout, sampling=SAMPLING, logits_chunk_size=3
    )
    np.testing.assert_allclose(again, batch["old_logps"], atol=1e-5)
    advantages = jnp.asarray(np.linspace(-1.5, 1.5, again.shape[0]), jnp.float32)
    moved = {**batch, "advantages": advantages}

    def total(obj, params):
        loss, _ = obj.loss(
            {**variables, "params": params}, moved, Step(index=jnp.int32(1), key=KEY)
        )
        return loss.value

    value, grads = jax.jit(jax.value_and_grad(lambda p: total(OBJ, p)))(variables["params"])
    chunked_value, chunked_grads = jax.jit(jax.value_and_grad(lambda p: total(chunked, p)))(
        variables["params"]
    )
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-5, abs=1e-7)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match=r"truncates \(top_k=4.*logits_chunk_size=None"):
        objective(sampling=Sampling(temperature=0.8, top_k=4), logits_chunk_size=3)


# ------------------------------------------- methods by name (issue 43)
@pytest.mark.parametrize("estimator", ["rloo", "reinforce"])
def test_advantage_estimators_by_name(params, prepared, estimator):
    """prepare_finish's advantages: RLOO's leave-one-out (the paper's, unscaled) and
    REINFORCE++'s batch-normalised rewards, against numpy."""
    variables, first, batch = prepared
    obj = objective(beta=0.05, advantage_estimator=estimator, scale_rewards="none")
    merged = {**first, **OBJ.prepare_host(first)}
    out = jax.jit(obj.prepare_finish)(variables, merged, Step(index=jnp.int32(0), key=KEY))
    r = np.asarray(out["reward"], np.float64)
    groups = r.reshape(-1, G)
    if estimator == "rloo":
        want = (groups - (groups.sum(1, keepdims=True) - groups) / (G - 1)).reshape(-1)
    else:
        want = r - r.mean()
    np.testing.assert_allclose(out["advantages"], want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).max() > 0


def test_gspo_loss_is_the_sequence_ratio_clipped_per_completion(params, prepared):
    """importance_sampling_level="sequence" against a numpy loop of GSPO's eq. 5-7 (with
    the k3 term), off-policy so that the paper's tiny clip acts on some completions."""
    variables, _, batch = prepared
    eps_low, eps_high, beta = 3e-4, 4e-4, 0.05
    obj = objective(
        beta=beta, importance_sampling_level="sequence", epsilon=eps_low, epsilon_high=eps_high
    )
    mask = np.asarray(batch["completion_mask"], np.float64)
    shift = np.linspace(-1e-3, 1e-3, mask.shape[0])[:, None] * mask  # per-row log-ratio offsets
    advantages = np.where(np.arange(mask.shape[0]) % 2, 1.0, -1.0).astype(np.float32)
    moved = {
        **batch,
        "old_logps": batch["old_logps"] - shift.astype(np.float32),
        "advantages": jnp.asarray(advantages),
    }
    loss, metrics = jax.jit(obj.loss)(variables, moved, Step(index=jnp.int32(1), key=KEY))
    logp = np.asarray(batch["old_logps"], np.float64)  # the policy's own: prepare's weights
    old = np.asarray(moved["old_logps"], np.float64)
    ref = np.asarray(batch["ref_logps"], np.float64)
    per_row, clipped = [], []
    for i in range(mask.shape[0]):
        n = mask[i].sum()
        s = np.exp(((logp[i] - old[i]) * mask[i]).sum() / n)
        a = advantages[i]
        bounded = min(max(s, 1 - eps_low), 1 + eps_high)
        d = np.clip(ref[i] - logp[i], -20, 20)
        k3 = ((np.exp(d) - d - 1) * mask[i]).sum() / n
        per_row.append(max(-a * s, -a * bounded) + beta * k3)
        clipped.append((s < 1 - eps_low and a < 0) or (s > 1 + eps_high and a > 0))
    np.testing.assert_allclose(float(loss.value), np.mean(per_row), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_fraction"].value), np.mean(clipped))
    assert 0 < np.mean(clipped) < 1


def test_rloo_as_trl_through_prepare_finish_and_the_loss(params, prepared):
    """RLOO with TRL's loss on the model's own rollout: the advantages of the rewards
    less beta times the rollout's summed k1, the loss of the completions' probability
    ratios (no k3 term), ``kl`` the rollout's k1 per token, ``reward`` without the
    penalty; against numpy."""
    variables, first, batch = prepared
    beta, eps = 0.05, 0.2
    obj = objective(
        beta=beta,
        advantage_estimator="rloo",
        scale_rewards="none",
        importance_sampling_level="sequence-sum",
        kl_penalty="reward",
    )
    step = Step(index=jnp.int32(1), key=KEY)
    merged = {**first, **OBJ.prepare_host(first)}
    out = jax.jit(obj.prepare_finish)(variables, merged, step)
    mask = np.asarray(batch["completion_mask"], np.float64)
    logp = np.asarray(batch["old_logps"], np.float64)  # the policy's own: prepare's weights
    k1 = (logp - np.asarray(batch["ref_logps"], np.float64)) * mask
    reward = np.asarray(batch["reward"], np.float64)
    groups = (reward - beta * k1.sum(1)).reshape(-1, G)
    want = (groups - (groups.sum(1, keepdims=True) - groups) / (G - 1)).reshape(-1)
    np.testing.assert_allclose(out["advantages"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["reward"], reward, rtol=1e-6)
    # an off-policy update: each completion's log-ratio shifted, some past the clip
    shift = np.linspace(-0.5, 0.5, mask.shape[0])
    moved = {
        **out,
        "old_logps": out["old_logps"]
        - (shift[:, None] * mask / mask.sum(1, keepdims=True)).astype(np.float32),
    }
    loss, metrics = jax.jit(obj.loss)(variables, moved, step)
    s = np.exp(shift)  # the completions' probability ratios
    a = np.asarray(out["advantages"], np.float64)
    per_row = np.maximum(-a * s, -a * np.clip(s, 1 - eps, 1 + eps))
    np.testing.assert_allclose(float(loss.value), per_row.mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["kl"].value), k1.sum() / mask.sum(), rtol=1e-5)
    clipped = ((s < 1 - eps) & (a < 0)) | ((s > 1 + eps) & (a > 0))
    np.testing.assert_allclose(float(metrics["clip_fraction"].value), clipped.mean())
    assert 0 < clipped.mean() < 1


def test_method_names_are_listed_when_wrong():
    with pytest.raises(ValueError, match=r"advantage_estimator must be one of .*'rloo'.*got 'gae'"):
        objective(advantage_estimator="gae")
    with pytest.raises(ValueError, match=r"importance_sampling_level must be one of .*'sequence'"):
        objective(importance_sampling_level="seq")


def reward_model_and_params():
    from dew.objectives.preference.reward_model import CausalRewardModel

    reward_model = CausalRewardModel.of(MODEL)
    init = jax.jit(reward_model.init)(jax.random.key(4), jnp.zeros((1, 8), jnp.int32))
    return reward_model, nn.unbox(init)["params"]


def fit_keeps_the_reward_model_frozen(train) -> None:
    """Through ``train`` (the dew.train module, which this package does not depend on:
    tests/test_reward_model_roles.py calls this): two steps leave the role frozen."""
    from dew.data import Dataset

    reward_model, reward_params = reward_model_and_params()
    obj = objective(
        rewards=(), beta=0.0, reward_model=reward_model, reward_model_params=reward_params
    )

    def prompts(partition):
        while True:
            yield {"prompt": PROMPT, "prompt_mask": PROMPT_MASK}

    mesh = train.MeshSpec(data=1, devices=jax.devices()[:1])
    trainer = train.Trainer(obj, optax.adam(1e-3), key=jax.random.key(0), mesh=mesh)
    state = trainer.fit(Dataset(prompts, None, records=0, batch=2), steps=2, log_every=2)
    assert set(state.frozen) == {"reward"}
    np.testing.assert_array_equal(
        state.frozen["reward"]["params"]["score"]["kernel"], reward_params["score"]["kernel"]
    )


def test_a_reward_model_scores_rollouts_in_the_step_as_a_frozen_role(params):
    """reward_model=: the frozen role 'reward' scores each completion after its prompt
    (re-aligned to the right, rows built here by a loop) inside prepare; a reward model
    of another vocabulary is refused. (Through Trainer: tests/test_reward_model_roles.py.)"""
    from dew.objectives.preference.reward_model import CausalRewardModel

    reward_model, reward_params = reward_model_and_params()
    obj = objective(
        rewards=(), beta=0.0, reward_model=reward_model, reward_model_params=reward_params
    )
    assert [r.name for r in obj.roles()] == ["policy", "reward"]
    variables = {"params": {"policy": params}, "reward": {"params": reward_params}}
    step = Step(index=jnp.int32(0), key=KEY)
    prompts = {"prompt": jnp.asarray(PROMPT), "prompt_mask": jnp.asarray(PROMPT_MASK)}
    first = jax.device_get(jax.jit(obj.prepare)(variables, prompts, step))
    merged = {**first, **obj.prepare_host(first)}
    batch = jax.jit(obj.prepare_finish)(variables, merged, step)
    length = PROMPT.shape[1] + NEW
    ids = np.zeros((len(first["prompt"]), length), np.int32)
    real = np.zeros(ids.shape, bool)
    for r in range(len(ids)):
        row = first["prompt"][r][first["prompt_mask"][r]].tolist()
        row += first["completion"][r][first["completion_mask"][r]].tolist()
        ids[r, : len(row)], real[r, : len(row)] = row, True
    want = reward_model.apply({"params": reward_params}, ids, real)
    # atol: a reward near 0 carries the float32 rounding of sums of size ~0.2 (as test_ppo)
    np.testing.assert_allclose(batch["reward"], want, rtol=1e-6, atol=1e-7)
    _, metrics = jax.jit(obj.loss)(variables, batch, Step(index=jnp.int32(0), key=KEY))
    assert float(metrics["reward/reward_model"].value) == pytest.approx(
        float(np.mean(want)), rel=1e-5
    )
    assert not [r for r in obj.roles() if r.name == "reward" and r.trained]
    other = CausalRewardModel.of(CausalTransformer(**{**TINY, "vocab_size": 32}))
    with pytest.raises(ValueError, match="vocabulary has 32 ids, the policy's 16"):
        objective(reward_model=other, reward_model_params=reward_params)


def test_one_reward_type_for_tokens_text_and_images():
    """Every kind is a Reward (jitted, or host=True); a plain callable is a host one; the
    same Reward objects score completions and images, in the order given."""
    kinds = [
        TokenReward(fn=sevens),
        TextReward(fn=len, name="chars"),
        ImageReward(fn=sevens, name="image", pixels=False),
        HostImageReward(fn=len, name="host_image"),
    ]
    assert [type(r) for r in kinds] == [Reward] * 4
    assert [r.host for r in kinds] == [False, True, False, True]
    assert [r.host for r in Rewards.of([len, kinds[0]]).items] == [True, False]

    points = np.linspace(-1, 1, 10, dtype=np.float32).reshape(5, 2)  # 2-D samples
    rewards = ImageRewards.of(
        [
            Reward(fn=lambda images: images.sum(1), name="host_sum", host=True, pixels=False),
            Reward(fn=lambda x, batch: x[:, 0] * batch["w"], name="first", pixels=False),
            Reward(fn=lambda images: images[:, 1], name="pixel", host=True),
        ]
    )
    jitted = rewards.compiled_values(jnp.asarray(points), {"w": 2.0})
    got = rewards.host_stage(points, jitted, {}, group_size=5)
    pixels = np.clip(np.round((points + 1) * 127.5), 0, 255)
    want = np.stack([points.sum(1), 2 * points[:, 0], pixels[:, 1]], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(
        RewardError, match=r"host image reward 'host_sum' returned nan for sample 2"
    ):
        rewards.host_stage(np.where(points == points[2, 0], np.nan, points), jitted, {}, 5)

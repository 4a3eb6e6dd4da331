"""FlowGRPOObjective's prepare and loss, called directly on a tiny class-conditional
flow MLP (2-D samples) with classifier-free guidance 2.

- The log-prob the loss recomputes for a stored transition equals the sampler's within
  1e-6 whether the 24-row rollout (3 conditions x 8) is drawn 1 row at a time or all at
  once, and both draw the same samples (draws are fold_in(key, global row index)); the
  first update's ratio is 1 (max |rho - 1| <= 1e-6); ``check_first_ratio`` lets 5e-6 of
  rounding through and refuses a loss that reconstructs with another guidance scale.
- The loss on moved weights against a float64 numpy transcription: the velocity from the
  network, the SDE step's mean and Gaussian log-prob, global-std group advantages
  (clipped), the clipped ratio and the KL with either Delta t convention.
- Rewards (compiled and host) weighted and summed, each one's metric; a reward of the
  wrong shape, NaN or raising names the function and the sample.
- The bad-input list of the issue, refused before compiling.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import DiT
from dew.nn.backbones.dit import timestep_embedding
from dew.objectives import Step, Updates
from dew.objectives.cores.rewards import RewardError
from dew.objectives.cores.rl import RatioError, raising_ratio_errors, relative_logprob_gap
from dew.objectives.rl.flow_grpo import FlowGRPOObjective, HostImageReward, ImageReward
from dew.sampling import DDPMSchedule, FlowSDE

CLASSES, G, CONDITIONS = 3, 8, 3
ROWS = CONDITIONS * G


class CondMLP(nn.Module):
    """2-D flow velocity of ``[x, time features, label embedding]`` (label 3 = null)."""

    num_classes: int = CLASSES

    @nn.compact
    def __call__(self, x, t, label=None, context=None):
        h = jnp.concatenate(
            [x, timestep_embedding(t, 16), nn.Embed(self.num_classes + 1, 8)(label)], -1
        )
        h = nn.silu(nn.Dense(32)(h))
        return nn.Dense(2)(nn.silu(nn.Dense(32)(h)))


def far_right(x, batch):
    """The sample's first coordinate (float samples)."""
    return x[:, 0]


def objective(**options):
    base = dict(
        rewards=[ImageReward(fn=far_right, pixels=False)],
        group_size=G,
        sample_shape=(2,),
        sampler=FlowSDE(num_steps=4),
        guidance=2.0,
        timestep_fraction=1.0,
        epsilon=0.2,
    )
    return FlowGRPOObjective(model=CondMLP(), **{**base, **options})


BATCH = {"label": np.asarray([0, 1, 2], np.int32)}


def prepared_batch(obj, variables, key=0):
    step = Step(index=jnp.int32(0), key=jax.random.key(key))
    rollout = jax.jit(obj.prepare)(variables, BATCH, step)
    host = obj.prepare_host(jax.device_get(rollout))
    return rollout, jax.jit(obj.prepare_finish)(variables, {**rollout, **host}, step)


@pytest.fixture(scope="module")
def setup():
    obj = objective()
    variables = obj.init(jax.random.key(0))
    variables = nn.unbox(variables)
    return obj, variables


def test_recomputed_log_probs_equal_the_samplers_at_rollout_rows_1_and_24(setup):
    obj, variables = setup
    one = objective(rollout_rows=1)
    whole, batch = prepared_batch(obj, variables)
    single, batch_one = prepared_batch(one, variables)
    np.testing.assert_allclose(single["latents"], whole["latents"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(single["old_logps"], whole["old_logps"], rtol=0, atol=1e-6)
    assert batch["latents"].shape == (ROWS, 5, 2) and batch["old_logps"].shape == (ROWS, 4)
    for o, b in ((obj, batch), (one, batch_one)):
        logps, _ = jax.jit(o.policy.step_log_probs)(variables["params"]["policy"], b)
        np.testing.assert_allclose(logps, b["old_logps"], rtol=1e-6, atol=1e-6)
        assert max_ratio_deviation(logps, b["old_logps"]) <= 1e-6  # every row and step
        _, metrics = jax.jit(o.loss)(variables, b, Step(index=jnp.int32(0), key=jax.random.key(1)))
        assert abs(float(metrics["ratio"].value) - 1) <= 1e-6
        assert float(metrics["kl"].value) == 0.0  # the reference is the initial model
    # the groups differ inside and rows of one condition share its label
    assert np.all(np.asarray(batch["label"]) == np.repeat([0, 1, 2], G))
    assert np.std(np.asarray(whole["samples"])[:G, 0]) > 0.05


def test_first_ratio_check_allows_rounding_and_refuses_another_guidance(setup):
    """``check_first_ratio``: old log-probs off by 5e-6 of themselves (rounding that a
    step's 1/std amplifies; over the language policies' 1e-6) pass at
    ``FIRST_RATIO_TOLERANCE``; a loss that reconstructs the rollout with another
    guidance scale is a ``RatioError``."""
    obj, variables = setup
    _, batch = prepared_batch(obj, variables)
    step = Step(index=jnp.int32(0), key=jax.random.key(1))
    checked = objective(check_first_ratio=True)
    rounded = {**batch, "old_logps": batch["old_logps"] * (1 + 5e-6)}
    assert float(relative_logprob_gap(batch["old_logps"], rounded["old_logps"], True)) > 1e-6
    with raising_ratio_errors():
        jax.block_until_ready(jax.jit(checked.loss)(variables, rounded, step))
    other_guidance = objective(check_first_ratio=True, guidance=1.0)
    with pytest.raises(RatioError, match="FlowGRPOObjective: the first update"):
        with raising_ratio_errors():
            jax.block_until_ready(jax.jit(other_guidance.loss)(variables, batch, step))


@pytest.mark.slow  # ~7 s: a DiT's rollout and loss compiled
def test_bfloat16_dit_log_probs_are_float32_and_the_first_ratio_is_1():
    """A class-conditional DiT computing in bfloat16 (float32 parameters): the sampler's
    per-step log-probs and the loss's recomputed ones are float32 and agree, max
    |rho - 1| <= 1e-6 (measured: 0; the two programs run the bfloat16 network on other
    batches, rows vs rows x steps, and still round it alike)."""
    dit = DiT(sample_size=4, patch_size=2, in_channels=1, emb_features=16, num_layers=1,
              num_heads=2, mlp_features=32, num_classes=CLASSES, dtype=jnp.bfloat16)  # fmt: skip
    obj = FlowGRPOObjective(
        model=dit,
        rewards=[ImageReward(fn=lambda pixels, b: jnp.mean(pixels / 255.0, (1, 2, 3)))],
        group_size=4,
        sampler=FlowSDE(num_steps=3),
        guidance=2.0,
        epsilon=0.2,
        beta=0.0,
        timestep_fraction=1.0,
    )
    variables = nn.unbox(obj.init(jax.random.key(2)))
    # a "pretrained" DiT: a fresh one's zero gates and head would give velocity 0
    variables = jax.tree.map(
        lambda p: p + 0.2 * jax.random.normal(jax.random.key(4), p.shape), variables
    )
    rollout, batch = prepared_batch(obj, variables)
    logps, _ = jax.jit(obj.policy.step_log_probs)(variables["params"]["policy"], batch)
    assert rollout["old_logps"].dtype == logps.dtype == jnp.float32
    assert np.all(np.isfinite(logps)) and np.ptp(np.asarray(logps)) > 0
    assert max_ratio_deviation(logps, batch["old_logps"]) <= 1e-6


def max_ratio_deviation(logps, old_logps) -> float:
    """``max |rho - 1|`` over every row and step, ``rho = exp(logp - old)`` in float32
    as the loss computes it."""
    logps, old_logps = np.asarray(logps), np.asarray(old_logps)
    assert logps.dtype == old_logps.dtype == np.float32
    return float(np.max(np.abs(np.exp(logps - old_logps) - np.float32(1))))


def reference_loss(obj, variables, batch, params):
    """The loss in float64 numpy from the network's raw velocities."""
    table = {k: np.asarray(v, np.float64) for k, v in obj.sampler.table().items()}
    lat = np.asarray(batch["latents"], np.float64)
    steps = np.asarray(batch["train_steps"])
    labels = np.asarray(batch["label"])
    rows, k = steps.shape
    w = obj.guidance

    null = np.full_like(labels, CLASSES)

    def velocity(p, x, t):
        def net(lbl):
            out = obj.model.apply(
                {"params": p},
                jnp.asarray(x, jnp.float32),
                jnp.full((len(x),), 1000.0 * t, jnp.float32),
                label=jnp.asarray(lbl),
            )
            return np.asarray(out, np.float64)

        return net(null) + w * (net(labels) - net(null))

    total = np.asarray(batch["rewards"], np.float64) @ np.asarray([1.0])
    groups = total.reshape(-1, G)
    adv = ((groups - groups.mean(1, keepdims=True)) / (total.std(ddof=1) + 1e-4)).reshape(-1)
    adv = np.clip(adv, -5, 5)
    losses, kls = np.zeros((rows, k)), np.zeros((rows, k))
    for j in range(k):
        i = steps[:, j]
        assert np.all(i == j)
        x, x_next = lat[np.arange(rows), i], lat[np.arange(rows), i + 1]
        t = table["t"][j]
        mean = table["c_x"][j] * x + table["c_v"][j] * velocity(params, x, t)
        ref = table["c_x"][j] * x + table["c_v"][j] * velocity(variables["params"]["policy"], x, t)
        std = table["std"][j]
        logp = (
            -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        ).mean(1)
        ratio = np.exp(logp - np.asarray(batch["old_logps"], np.float64)[:, j])
        losses[:, j] = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
        var = table["sigma"][j] ** 2 if obj.kl_convention == "reference" else std**2
        kls[:, j] = ((mean - ref) ** 2 / (2 * var)).mean(1)
    return (losses + obj.beta * kls).mean(), kls.mean()


@pytest.mark.parametrize("convention", ["reference", "exact"])
def test_loss_on_moved_weights_matches_numpy(setup, convention):
    obj, variables = setup
    obj = objective(kl_convention=convention, beta=0.5)
    _, batch = prepared_batch(obj, variables)
    moved = jax.tree.map(
        lambda p: p + 0.05 * jax.random.normal(jax.random.key(3), p.shape), variables["params"]
    )
    loss, metrics = jax.jit(obj.loss)(
        {**variables, "params": moved}, batch, Step(index=jnp.int32(1), key=jax.random.key(1))
    )
    want, kl = reference_loss(obj, variables, batch, moved["policy"])
    np.testing.assert_allclose(float(loss.value), want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["kl"].value), kl, rtol=2e-5)
    assert float(metrics["kl"].value) > 0 and abs(float(metrics["ratio"].value) - 1) > 1e-4


def test_evaluation_samples_with_the_ode_at_eval_steps_not_the_rollouts_steps(setup):
    """Rollouts take the sampler's 4 SDE steps; ``policy.sample`` (evaluation and
    previews, with ``eval_steps`` = 7) runs the ODE in 7 Euler steps and the same
    guidance: a float64 numpy Euler loop over ``t = 1 .. 0`` on the network's guided
    velocity, from the key's noise; the rollouts' 4 steps give other samples."""
    _, variables = setup
    obj = objective(eval_steps=7)
    assert obj.sampler.num_steps == 4
    labels = np.asarray([0, 1, 2, 1], np.int32)
    key = jax.random.key(11)
    params = variables["params"]["policy"]
    got = obj.policy.sample(params, key, label=labels, num_steps=obj.eval_steps)
    got = np.asarray(got, np.float64)

    def velocity(x, t):
        def net(lbl):
            out = obj.model.apply(
                {"params": variables["params"]["policy"]},
                jnp.asarray(x, jnp.float32),
                jnp.full((len(x),), 1000.0 * t, jnp.float32),
                label=jnp.asarray(lbl),
            )
            return np.asarray(out, np.float64)

        null = net(np.full_like(labels, CLASSES))
        return null + obj.guidance * (net(labels) - null)

    x = np.asarray(jax.random.normal(key, (len(labels), 2), jnp.float32), np.float64)
    times = np.linspace(1.0, 0.0, 8)
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, t)
    np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-5)
    fewer = np.asarray(obj.policy.sample(params, key, label=labels, num_steps=4))
    assert np.abs(fewer - got).max() > 1e-3
    with pytest.raises(ValueError, match="eval_steps must be >= 1, got 0"):
        objective(eval_steps=0)


def test_timestep_fraction_draws_a_subset_per_row(setup):
    _, variables = setup
    obj = objective(timestep_fraction=0.5)
    _, batch = prepared_batch(obj, variables)
    steps = np.asarray(batch["train_steps"])
    assert obj.policy.train_steps == 2 and steps.shape == (ROWS, 2)
    assert all(len(set(r)) == 2 and set(r) <= {0, 1, 2, 3} for r in steps.tolist())
    assert len({tuple(r) for r in steps.tolist()}) > 1  # rows draw their own subsets


def test_rewards_are_weighted_and_each_is_logged(setup):
    _, variables = setup

    def up(x, batch):
        return x[:, 1]

    seen = []

    def host_up(images, label):
        seen.append(label)
        return np.asarray(images)[:, 1] * 0 + label

    obj = objective(
        rewards=[
            ImageReward(fn=far_right, pixels=False, weight=2.0),
            HostImageReward(fn=host_up, pixels=False, weight=-1.0),
            ImageReward(fn=up, pixels=False, weight=0.0),
        ]
    )
    rollout, batch = prepared_batch(obj, variables)
    samples = np.asarray(rollout["samples"], np.float64)
    labels = np.repeat([0, 1, 2], G)
    np.testing.assert_allclose(
        batch["rewards"], np.stack([samples[:, 0], labels, samples[:, 1]], 1), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(batch["reward"], 2 * samples[:, 0] - labels, rtol=1e-5, atol=1e-5)
    _, metrics = jax.jit(obj.loss)(
        variables, batch, Step(index=jnp.int32(0), key=jax.random.key(1))
    )
    for name, want in (("far_right", samples[:, 0]), ("host_up", labels), ("up", samples[:, 1])):
        np.testing.assert_allclose(
            float(metrics[f"reward/{name}"].value), want.mean(), rtol=1e-5, atol=1e-6
        )


def test_bad_rewards_name_the_function_and_the_sample(setup):
    _, variables = setup

    def nan_at_5(images):
        out = np.zeros(len(images))
        out[5] = np.nan
        return out

    def raises_at_9(images):
        if len(images) == 1 and images[0, 0] == RAISE[0]:
            raise RuntimeError("detector crashed")
        if len(images) > 1:
            RAISE[:] = [np.asarray(images)[9, 0]]
            raise RuntimeError("detector crashed")
        return np.zeros(len(images))

    RAISE = [None]
    cases = [
        (HostImageReward(fn=nan_at_5, pixels=False), r"nan_at_5.*nan for sample 5 \(condition 0"),
        (
            HostImageReward(fn=raises_at_9, pixels=False),
            r"raises_at_9.*RuntimeError.*sample 9 \(condition 1",
        ),
        (
            HostImageReward(fn=lambda images: np.zeros(3), name="short", pixels=False),
            r"'short' returned shape \(3,\)",
        ),
    ]
    for reward, message in cases:
        obj = objective(rewards=[reward])
        with pytest.raises(RewardError, match=message):
            prepared_batch(obj, variables)
    obj = objective(rewards=[ImageReward(fn=lambda x, b: x, name="whole", pixels=False)])
    with pytest.raises(RewardError, match=r"'whole' returned shape \(24, 2\)"):
        prepared_batch(obj, variables)

    def nan_at_11(x, batch):  # compiled: checked on the host before the advantages
        return jnp.where(jnp.arange(x.shape[0]) == 11, jnp.nan, x[:, 0])

    def not_jittable(x, batch):
        return np.asarray(x)[:, 0]

    for fn, message in (
        (nan_at_11, r"'nan_at_11' returned nan for sample 11 \(condition 1 of the batch, sample 3"),
        (not_jittable, r"(?s)'not_jittable' raised TracerArrayConversionError.*while traced"),
    ):
        obj = objective(rewards=[ImageReward(fn=fn, pixels=False)])
        with pytest.raises(RewardError, match=message):
            prepared_batch(obj, variables)


def test_bad_input_is_refused_before_compiling():
    with pytest.raises(ValueError, match="noise_level"):
        FlowSDE(noise_level=-0.5)
    with pytest.raises(ValueError, match=r"num_steps=1 must be a whole number >= 2"):
        FlowSDE(num_steps=1)
    with pytest.raises(ValueError, match="window"):
        FlowSDE(num_steps=10, window=(8, 12))
    with pytest.raises(ValueError, match="group_size >= 2"):
        objective(group_size=1)
    with pytest.raises(ValueError, match="DDPMSchedule"):
        objective(schedule=DDPMSchedule(), target="eps")
    with pytest.raises(ValueError, match="no stochastic step"):
        objective(sampler=FlowSDE(noise_level=0.0))
    with pytest.raises(ValueError, match="kl_convention"):
        objective(kl_convention="paper")
    with pytest.raises(ValueError, match="no rewards"):
        objective(rewards=[])
    obj = objective(prepared_updates=Updates(minibatches=5))
    with pytest.raises(
        ValueError, match=r"24 rows \(3 conditions x group_size 8\) does not split into 5"
    ):
        obj.check_batch(BATCH)
    with pytest.raises(ValueError, match="num_classes=3"):
        objective().check_batch({"label": np.asarray([0, 7, 0, 1], np.int32)})

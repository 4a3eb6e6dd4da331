"""Flow-GRPO through the trainer (OBJECTIVES.md section 9's CPU checks).

- The ring toy: a flow MLP pretrained on the 2-D ring of 8 Gaussians; reward = 1 when
  a sample lies within 0.6 of mode 0 (jittable, on the float samples); 8 groups x 16
  SDE samples (10 steps, a = 0.7), one update per rollout batch, beta 0.04. The reward
  of ODE samples rises from ~1/8 to >= 3x within 100 iterations (the issue: 150), with
  the first-update assertion on (the loss's log-probs equal the sampler's within 1e-6).
- A class-conditional MLP with guidance 2, a compiled and a host reward, two updates
  per rollout batch: data=8 gives the same weights as one device after one iteration
  (1e-5), with the first update's max |rho - 1| <= 1e-6 on 8 devices; and a run killed in the
  host reward stage (between rollout and update) resumes bit-identically.
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn.backbones import DiT
from dew.nn.backbones.dit import timestep_embedding
from dew.nn.lora import LoRA, is_adapter
from dew.objectives import EMA, Step, Updates
from dew.objectives.cores.rewards import RewardError
from dew.objectives.cores.rl import max_ratio_deviation
from dew.objectives.diffusion.images import DiffusionObjective
from dew.objectives.rl import flow_grpo
from dew.objectives.rl.flow_grpo import (
    FIRST_RATIO_TOLERANCE,
    FlowGRPOObjective,
    HostImageReward,
    ImageReward,
    RolloutSizes,
)
from dew.sampling import FlowSchedule, FlowSDE
from dew.train import Checkpoints, MeshSpec, Trainer

ONE = MeshSpec(data=1, devices=jax.devices()[:1])
RADIUS, SIGMA, MODES = 4.0, 0.15, 8
ANGLES = 2 * np.pi * np.arange(MODES) / MODES
CENTRES = (RADIUS * np.stack([np.cos(ANGLES), np.sin(ANGLES)], 1)).astype(np.float32)


class FlowMLP(nn.Module):
    """A 2-D flow velocity of ``[x, time features(, label embedding)]``."""

    width: int = 64
    num_classes: int = 0

    @nn.compact
    def __call__(self, x, t, label=None, context=None):
        parts = [x, timestep_embedding(t, 32)]
        if self.num_classes:
            parts.append(nn.Embed(self.num_classes + 1, 8)(label))
        h = jnp.concatenate(parts, -1)
        for _ in range(3):
            h = nn.silu(nn.Dense(self.width)(h))
        return nn.Dense(2)(h)


# ------------------------------------------------------------------ ring toy
# measured: ODE reward 0.099 -> 0.81 at 150 iterations (rollout reward 0.14 -> 0.42 at 75)
PRETRAIN, ITERATIONS = 800, 100


@pytest.fixture(scope="module")
def ring_model():
    """Flow matching on the ring (logit-normal times, Adam 2e-3, batch 256), one scan."""
    model = FlowMLP()
    diffusion = DiffusionObjective(
        model=model,
        schedule=FlowSchedule(),
        input_key="x",
        sample_shape=(2,),
        cond_dropout=0.0,
        clip_denoised=None,
        ema=None,
    )
    params = nn.unbox(diffusion.init(jax.random.key(0))["params"]["policy"])
    rng = np.random.default_rng(0)
    data = CENTRES[rng.integers(0, MODES, (PRETRAIN, 256))]
    data = (data + SIGMA * rng.normal(size=data.shape)).astype(np.float32)
    optimizer = optax.adam(2e-3)

    @jax.jit
    def train(params, data):
        def body(carry, xs):
            p, s = carry
            x, i = xs
            step = Step(index=i, key=jax.random.fold_in(jax.random.key(1), i))
            g = jax.grad(
                lambda p: diffusion.loss({"params": {"policy": p}}, {"x": x}, step)[0].value
            )(p)
            u, s = optimizer.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        carry = (params, optimizer.init(params))
        return jax.lax.scan(body, carry, (data, jnp.arange(PRETRAIN)))[0][0]

    return model, train(params, data)


def near_mode_0(x, batch):
    return (jnp.linalg.norm(x - CENTRES[0], axis=-1) < 0.6).astype(jnp.float32)


def groups(count, labels=None):
    def train(partition):
        batch = {"index": np.arange(count, dtype=np.int32)}
        if labels is not None:
            batch["label"] = np.asarray(labels, np.int32)
        while True:
            yield batch

    return Dataset(train=train, val=None, records=0, batch=count)


@pytest.mark.slow
def test_ring_mode_reward_rises_threefold_with_the_first_ratio_asserted(ring_model):
    model, params = ring_model
    objective = FlowGRPOObjective(
        model=model,
        rewards=[ImageReward(fn=near_mode_0, pixels=False)],
        group_size=16,
        sample_shape=(2,),
        sampler=FlowSDE(num_steps=10, noise_level=0.7),
        epsilon=0.2,
        beta=0.04,
        timestep_fraction=1.0,
        init_params=params,
        check_first_ratio=True,
        ema=None,
    )

    def ode_reward(p):
        x = objective.policy.sample(p, jax.random.key(5), num=2000, num_steps=20)
        return float(np.mean(np.linalg.norm(np.asarray(x) - CENTRES[0], axis=-1) < 0.6))

    before = ode_reward(params)
    trainer = Trainer(objective, optax.adam(3e-4), key=jax.random.key(0), mesh=ONE, progress=False)
    state = trainer.fit(groups(8), steps=ITERATIONS, log_every=0)
    after = ode_reward(state.params)
    print("ODE reward", before, "->", after)
    assert 0.05 <= before <= 0.25, before
    assert after >= 3 * before, (before, after)


@pytest.mark.slow
def test_the_default_average_follows_a_short_run(ring_model):
    """After 30 updates the default EMA's weights (what ``evaluate``, ``export`` and
    ``state.variables()`` read) keep at least 80% of the live policy's gain in ODE reward:
    the average warms up from the first update (``EMA(use_warmup=True)``). The flat 0.99
    average of before, run alongside on the same trajectory, kept under half of it."""
    model, params = ring_model
    objective = FlowGRPOObjective(
        model=model,
        rewards=[ImageReward(fn=near_mode_0, pixels=False)],
        group_size=16,
        sample_shape=(2,),
        sampler=FlowSDE(num_steps=10, noise_level=0.7),
        epsilon=0.2,
        beta=0.04,
        timestep_fraction=1.0,
        init_params=params,
    )
    assert objective.ema == EMA(decay=0.99, use_warmup=True)

    def ode_reward(p):
        x = objective.policy.sample(p, jax.random.key(5), num=2000, num_steps=20)
        return float(np.mean(np.linalg.norm(np.asarray(x) - CENTRES[0], axis=-1) < 0.6))

    before = ode_reward(params)
    gains = {}
    for name, ema in (("warmup", objective.ema), ("flat", EMA(decay=0.99))):
        run = dataclasses.replace(objective, ema=ema)
        trainer = Trainer(run, optax.adam(1e-3), key=jax.random.key(0), mesh=ONE, progress=False)
        state = trainer.fit(groups(8), steps=30, log_every=0)
        live = ode_reward(state.params) - before
        gains[name] = (live, ode_reward(state.variables()["params"]["policy"]) - before)
    print("ODE reward gain (live, averaged) from", before, gains)
    live, averaged = gains["warmup"]
    assert live > 0.1, gains  # the run moved
    assert averaged >= 0.8 * live, gains
    assert gains["flat"][1] < 0.5 * gains["flat"][0], gains  # the lag this removes


# --------------------------------------------- mesh equivalence and resume
CLASSES, G, CONDITIONS = 3, 4, 8
LABELS = np.arange(CONDITIONS) % CLASSES


class Kill(BaseException):
    """A stand-in for SIGKILL (not an Exception, so no reward error wraps it)."""


class Brightness:
    """A host reward (the second coordinate); it records its inputs, raises
    :class:`Kill` on call ``kill_at`` and returns NaN for sample 5 on call ``nan_at``."""

    __name__ = "brightness"

    def __init__(self, kill_at=None, nan_at=None):
        self.seen, self.kill_at, self.nan_at = [], kill_at, nan_at

    def __call__(self, images):
        self.seen.append(np.asarray(images).copy())
        if self.kill_at is not None and len(self.seen) == self.kill_at:
            raise Kill
        out = np.asarray(images)[:, 1].copy()
        if self.nan_at is not None and len(self.seen) == self.nan_at:
            out[5] = np.nan
        return out


def conditional(host, debug=False, **sizes):
    return FlowGRPOObjective(
        model=FlowMLP(width=32, num_classes=CLASSES),
        rewards=[
            ImageReward(fn=lambda x, b: x[:, 0], name="right", pixels=False),
            HostImageReward(fn=host, pixels=False, weight=0.5),
        ],
        group_size=G,
        sample_shape=(2,),
        sampler=FlowSDE(num_steps=4),
        guidance=2.0,
        epsilon=0.2,
        beta=0.1,
        prepared_updates=Updates(epochs=2),
        check_first_ratio=debug,
        **sizes,
    )


def fit(mesh, *, steps, host=None, checkpoints=None, keep_at=(), debug=False, **sizes):
    host = host or Brightness()
    trainer = Trainer(
        conditional(host, debug, **sizes),
        optax.sgd(0.1),
        key=jax.random.key(0),
        mesh=mesh,
        checkpoints=checkpoints,
        progress=False,
    )
    kept = {}
    trainer.add_hook(
        lambda info: (
            kept.update({info.step: jax.device_get(info.state.params)})
            if info.step in keep_at
            else None
        )
    )
    state = trainer.fit(
        groups(CONDITIONS, LABELS),
        steps=steps,
        log_every=0,
        checkpoint_every=2 if checkpoints else 0,
    )
    return jax.device_get(state.params), host, kept


@pytest.fixture(scope="module")
def uninterrupted():
    return fit(ONE, steps=4, keep_at=(2,))


def close(a, b, tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=tol, atol=tol), a, b)


def test_sizes_derive_the_per_device_rows_and_the_accumulation():
    """8 groups x 4 samples, one minibatch: ``device_rows`` per device at once."""
    objective = conditional(Brightness(), groups=CONDITIONS, device_rows=2)
    assert RolloutSizes.of(objective, 8) == RolloutSizes(
        rows=32, device_conditions=1, device_rows=4, rollout_chunk=16, update_rows=32, accumulate=2
    )
    assert (
        RolloutSizes.of(objective, 1).accumulate == 16
        and RolloutSizes.of(objective, 1).rollout_chunk == 2
    )
    assert Trainer(objective, optax.sgd(0.1), key=jax.random.key(0), mesh=ONE).accumulate == 16
    with pytest.raises(ValueError, match="derives accumulate=2 on this mesh"):
        Trainer(objective, optax.sgd(0.1), key=jax.random.key(0), accumulate=4)
    with pytest.raises(ValueError, match=r"device_rows=3 does not divide the 4 rows each of 8"):
        RolloutSizes.of(conditional(Brightness(), groups=CONDITIONS, device_rows=3), 8)
    with pytest.raises(ValueError, match="8 groups x group_size 4 do not split over 16"):
        RolloutSizes.of(objective, 16)
    with pytest.raises(ValueError, match="needs the global group count"):
        conditional(Brightness(), device_rows=2)
    with pytest.raises(ValueError, match=r"groups=8\) got a data batch of 4 conditions"):
        objective.check_batch({"label": LABELS[:4]})


def recorded_first_ratios(monkeypatch) -> list[float]:
    """Wrap the first-update check the loss traces (with ``check_first_ratio``) so each
    first update's microbatch also reports ``max |rho - 1|`` from inside the step."""
    seen, original = [], flow_grpo.check_first_update

    def check(logps, old, mask, *, step, updates_per_batch, **options):
        original(logps, old, mask, step=step, updates_per_batch=updates_per_batch, **options)

        def record(deviation, step):
            if int(step) % updates_per_batch == 0:
                seen.append(float(deviation))

        jax.debug.callback(record, max_ratio_deviation(jnp.exp(logps - old), mask), step)

    monkeypatch.setattr(flow_grpo, "check_first_update", check)
    return seen


@pytest.mark.slow
def test_eight_devices_and_microbatches_equal_one_device_after_an_iteration(
    uninterrupted, monkeypatch
):
    """The recipe states groups=8, group_size=4 and device_rows; the trainer derives
    accumulate 2 on 8 devices (rollout chunks of 2 rows per device) and 8 on one device
    (chunks of 4 rows): the same rollout and the same two updates as one device with
    the whole batch at once, and the first update's max |rho - 1| <= 1e-6 on both."""
    _, host_one, kept = uninterrupted
    deviations = recorded_first_ratios(monkeypatch)
    for mesh, device_rows in ((MeshSpec(data=8), 2), (ONE, 4)):
        deviations.clear()
        params, host, _ = fit(
            mesh, steps=2, debug=True, groups=CONDITIONS, device_rows=device_rows
        )  # the relative log-prob gap asserted in the step, |rho - 1| recorded
        assert deviations and max(deviations) <= 1e-6, (mesh, deviations)
        np.testing.assert_allclose(host.seen[0], host_one.seen[0], rtol=0, atol=1e-6)
        close(params, kept[2], 1e-5)  # two updates over it, the second off-policy


@pytest.mark.slow
def test_killed_between_rollout_and_update_resumes_bit_identically(uninterrupted, tmp_path):
    """A kill in the second rollout's host stage leaves the checkpoint of step 2; a
    resumed run whose reward then fails raises before any update and leaves it too;
    the next resume repeats the rollout and ends equal to the uninterrupted run."""
    want, host_one, _ = uninterrupted
    killer = Brightness(kill_at=2)  # the second rollout batch dies in its host stage
    with pytest.raises(Kill):
        fit(ONE, steps=4, host=killer, checkpoints=Checkpoints(tmp_path, use_async=False))
    assert Checkpoints(tmp_path).steps() == [2]
    # a reward of NaN stops the resumed run before its update, naming it and the sample
    with pytest.raises(RewardError, match=r"'brightness' returned nan for sample 5 \(condition 1"):
        fit(ONE, steps=4, host=Brightness(nan_at=1), checkpoints=Checkpoints(tmp_path))
    assert Checkpoints(tmp_path).steps() == [2]  # nothing written lost, nothing applied
    params, host, _ = fit(ONE, steps=4, checkpoints=Checkpoints(tmp_path, use_async=False))
    np.testing.assert_array_equal(host.seen[0], host_one.seen[1])  # the same rollout again
    jax.tree.map(np.testing.assert_array_equal, params, want)


# ------------------------------------------------------------------- LoRA
LORA = LoRA(rank=2, alpha=4.0, targets=("layers/attention", "layers/mlp/(up|down)"))


def dit_brightness(pixels, batch):
    return jnp.mean(pixels.astype(jnp.float32), axis=(1, 2, 3)) / 255.0


def lora_fit(mesh):
    """One rollout of two updates of a class-conditional DiT under LoRA; returns the
    base, the initial adapters, the per-step metrics and adapters, the final state."""
    dit = DiT(sample_size=8, patch_size=4, in_channels=1, emb_features=32, num_layers=1,
              num_heads=2, mlp_features=64, num_classes=CLASSES)  # fmt: skip
    fresh = nn.unbox(dit.init(jax.random.key(3), jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,))))
    # a "pretrained" base: a fresh DiT's zero gates and head would hide the adapters
    noise = lambda p: p + 0.2 * jax.random.normal(jax.random.key(4), p.shape)  # noqa: E731
    base = jax.tree.map(noise, fresh["params"])
    objective = FlowGRPOObjective(
        model=LORA.apply(dit),
        rewards=[ImageReward(fn=dit_brightness)],
        group_size=G,
        sampler=FlowSDE(num_steps=3),
        guidance=2.0,
        epsilon=0.2,
        beta=0.1,
        prepared_updates=Updates(epochs=2),
        init_params=base,
        check_first_ratio=True,
        ema=EMA(decay=0.5),
        preview_count=0,
    )
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), mesh=mesh)
    initial = jax.device_get(trainer.init_state().params)
    log, seen = [], []
    trainer.add_hook(lambda info: log.append(info.metrics), every=1)
    trainer.add_hook(lambda info: seen.append(jax.device_get(info.state.params)), every=1)
    state = jax.device_get(trainer.fit(groups(4, LABELS[:4]), steps=2, log_every=1))
    return base, initial, log, seen, state


@pytest.mark.slow
def test_lora_trains_only_adapters_against_the_base_with_their_ema(capsys):
    """A class-conditional DiT under dew.nn.lora on a data x fsdp x tensor mesh (2 x 2 x
    2): the reference is the base (a view: nothing but ``lora_base`` is frozen, the
    first KL is 0 and the first ratio 1, asserted in the step), the base comes out
    bit-identical, only adapters are in the parameters, the moving average is the EMA
    of the adapters after each update, and the run equals one device's (1e-5)."""
    base, initial, log, seen, state = lora_fit(MeshSpec(data=2, fsdp=2, tensor=2))
    assert set(state.frozen) == {"lora_base"}  # the reference is the base view
    jax.tree.map(np.testing.assert_array_equal, state.frozen["lora_base"]["policy"], base)
    # the log: images per second of the prepare phase (16 images before step 1)
    assert log[0]["rollout_samples_per_second"] == pytest.approx(16 / log[0]["prepare_seconds"])
    assert re.search(r"step 1: .*, rollout [\d,.]+ samples/s", capsys.readouterr().out)
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
    assert paths and all(is_adapter(p) for p in paths)
    assert log[0]["ratio"] == pytest.approx(1.0, abs=FIRST_RATIO_TOLERANCE)
    assert log[0]["kl"] == pytest.approx(0.0, abs=1e-9) and log[1]["kl"] > 0  # off the base
    assert np.abs(seen[-1]["layers"]["mlp"]["up"]["kernel_lora_b"]).max() > 0  # B moved from 0
    averaged = initial  # the fresh adapters (B = 0)
    for params in seen:  # decay 0.5 after every update
        averaged = jax.tree.map(lambda a, p: 0.5 * a + 0.5 * p, averaged, params)
    close(state.averaged, averaged, 1e-6)
    *_, one = lora_fit(ONE)
    close(state.params, one.params, 1e-5)

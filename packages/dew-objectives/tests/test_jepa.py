"""JepaObjective against numpy: the loss (layer-normed targets, gathered blocks,
smooth-L1 / L1), no gradient into the target encoder, the momentum schedule,
the feature statistics, uint8 scaling, video tubes, and the batch checks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import ViT, ViTPredictor
from dew.objectives import Role, Step
from dew.objectives.jepa.jepa import JepaObjective, effective_rank, feature_std, momentum_schedule
from dew.objectives.jepa.masks import MultiBlock

SMALL = dict(image_size=8, patch_size=2, num_channels=1, position_embedding="learned")
ENCODER = ViT(emb_features=16, num_layers=1, num_heads=2, mlp_features=32, **SMALL)
PREDICTOR = ViTPredictor(
    encoder_features=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16, **SMALL
)
MASKS = MultiBlock(num_targets=2, min_keep=4)


def objective(**kw):
    return JepaObjective(
        encoder=ENCODER, predictor=PREDICTOR, planned_updates=10, masks=MASKS, **kw
    )


@pytest.fixture(scope="module")
def setup():
    obj = objective()
    variables = nn.unbox(obj.init(jax.random.key(0)))
    # a target encoder that differs from the context encoder
    noisy = jax.tree.map(lambda p: p + 0.05, variables["params"]["encoder"])
    variables = {**variables, "target": {"params": noisy}}
    pixels = np.random.default_rng(0).integers(0, 256, (3, 8, 8, 1)).astype(np.uint8)
    return obj, variables, pixels


def numpy_loss(obj, variables, pixels, key, loss_type):
    """The I-JEPA loss step by step in numpy around the two modules."""
    encoder, predictor = jax.jit(ENCODER.apply), jax.jit(PREDICTOR.apply)
    x = pixels.astype(np.float64) / 127.5 - 1.0
    masks = jax.device_get(obj.layout.sample(key, len(x)))
    xf = jnp.asarray(x, jnp.float32)
    h = np.asarray(encoder(variables["target"], xf), np.float64)
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-6)
    params = variables["params"]
    losses = []
    for b in range(len(x)):
        context = encoder({"params": params["encoder"]}, xf[b : b + 1], masks.context[b : b + 1])
        for t in range(obj.masks.num_targets):
            z = predictor(
                {"params": params["predictor"]},
                context,
                masks.context[b : b + 1],
                masks.targets[b : b + 1, t],
            )
            d = np.asarray(z[0], np.float64) - h[b, masks.targets[b, t]]
            a = np.abs(d)
            losses.append(np.where(a < 1, 0.5 * d * d, a - 0.5) if loss_type == "smooth_l1" else a)
    return np.mean(losses), h, masks


@pytest.mark.parametrize("loss_type", ["smooth_l1", "l1"])
def test_loss_matches_numpy(setup, loss_type):
    _, variables, pixels = setup
    obj = objective(loss_type=loss_type)
    key = jax.random.key(5)
    loss, metrics = jax.jit(lambda v, x: obj.loss(v, {"image": x}, Step(index=0, key=key)))(
        variables, pixels
    )
    want, h, masks = numpy_loss(obj, variables, pixels, key, loss_type)
    np.testing.assert_allclose(float(loss.value), want, rtol=2e-5)
    assert float(loss.weight) == 3 * 2 * obj.layout.target_keep * 16
    targets = np.stack([h[b, masks.targets[b].reshape(-1)] for b in range(3)])
    np.testing.assert_allclose(
        float(metrics["target_std"]), targets.std(axis=(0, 1)).mean(), rtol=1e-4
    )


def test_uint8_pixels_equal_scaled_floats(setup):
    obj, variables, pixels = setup
    step = Step(index=0, key=jax.random.key(1))
    a, _ = obj.loss(variables, {"image": pixels}, step)
    b, _ = obj.loss(variables, {"image": pixels.astype(np.float32) / 127.5 - 1}, step)
    np.testing.assert_allclose(float(a.value), float(b.value), rtol=1e-6)


def test_no_gradient_reaches_the_target_encoder_and_both_roles_learn(setup):
    obj, variables, pixels = setup
    step = Step(index=0, key=jax.random.key(2))

    def value(params, target):
        loss, _ = obj.loss(
            {**variables, "params": params, "target": {"params": target}}, {"image": pixels}, step
        )
        return loss.value

    g_params, g_target = jax.grad(value, argnums=(0, 1))(
        variables["params"], variables["target"]["params"]
    )
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_target))
    for role in ("encoder", "predictor"):
        assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(g_params[role])) > 0


def test_roles_ema_and_momentum_schedule():
    obj = JepaObjective(encoder=ENCODER, predictor=PREDICTOR, planned_updates=100, masks=MASKS)
    # the target encoder is a declared role: the moving average of the encoder alone
    assert obj.roles() == (
        Role(name="encoder", module=ENCODER),
        Role(name="predictor", module=PREDICTOR),
        Role(name="target", module=ENCODER, trained=False, averages="encoder", ema=obj.target_ema),
    )
    assert obj.ema is None and obj.keeps_average
    decays = [float(obj.target_ema.decay_at(u)) for u in (0, 50, 100, 400)]
    np.testing.assert_allclose(decays, [0.996, 0.998, 1.0, 1.0], rtol=0, atol=1e-7)
    schedule = momentum_schedule(0.998, 1.0, 8)
    np.testing.assert_allclose(float(schedule(2)), 0.9985, atol=1e-7)


def test_feature_statistics_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)) * np.arange(1, 9)
    np.testing.assert_allclose(float(feature_std(jnp.asarray(x))), x.std(0).mean(), rtol=1e-5)
    s = np.linalg.svd(x - x.mean(0), compute_uv=False)
    p = s / s.sum()
    want = np.exp(-(p * np.log(p)).sum())
    np.testing.assert_allclose(float(effective_rank(jnp.asarray(x))), want, rtol=1e-4)
    line = np.outer(rng.normal(size=32), rng.normal(size=8))  # rank one
    assert float(effective_rank(jnp.asarray(line))) < 1.01


def test_evaluate_is_the_loss_on_the_evaluation_key(setup):
    obj, variables, pixels = setup
    step = Step(index=0, key=jax.random.key(4))
    loss, _ = obj.loss(variables, {"image": pixels}, step)
    got = obj.evaluate(variables, {"image": pixels, "example_mask": np.ones(3, bool)}, step)
    np.testing.assert_allclose(float(got["loss"].value), float(loss.value), rtol=1e-6)
    half = obj.evaluate(variables, {"image": pixels, "example_mask": np.array([1, 0, 0])}, step)
    assert float(half["loss"].weight) == float(loss.weight) / 3


def test_video_runs_on_tubes():
    video = dict(image_size=8, patch_size=4, num_channels=1, num_frames=4, tubelet_size=2)
    enc = ViT(emb_features=16, num_layers=1, num_heads=2, mlp_features=32, **video)
    pred = ViTPredictor(
        encoder_features=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16, **video
    )
    obj = JepaObjective(
        encoder=enc,
        predictor=pred,
        planned_updates=5,
        loss_type="l1",
        masks=MultiBlock(num_targets=1, min_keep=2),
    )
    assert obj.data_key == "video" and obj.input_shape == (4, 8, 8, 1)
    variables = nn.unbox(obj.init(jax.random.key(0)))
    clip = np.random.default_rng(1).normal(size=(2, 4, 8, 8, 1)).astype(np.float32)
    obj.check_batch({"video": clip})
    loss, _ = obj.loss(variables, {"video": clip}, Step(index=0, key=jax.random.key(0)))
    assert np.isfinite(float(loss.value)) and float(loss.weight) == 2 * obj.layout.target_keep * 16
    masks = obj.layout.sample(jax.random.key(0), 2)
    blocks = np.asarray(masks.target_blocks).reshape(2, 1, 2, 4)
    np.testing.assert_array_equal(blocks[:, :, 0], blocks[:, :, 1])  # one tube over both tubelets


def test_wrong_batches_are_refused_before_compiling():
    obj = objective()
    with pytest.raises(KeyError, match=r"batch\['image'\]"):
        obj.check_batch({"pixels": np.zeros((2, 8, 8, 1), np.uint8)})
    with pytest.raises(
        ValueError, match=r"\(2, 7, 7, 1\), but JepaObjective reads \[rows, 8, 8, 1\]"
    ):
        obj.check_batch({"image": np.zeros((2, 7, 7, 1), np.uint8)})
    with pytest.raises(ValueError, match=r"reads \[rows, 8, 8, 1\] uint8\|floating \(image_size 8"):
        obj.check_batch({"image": np.zeros((2, 8, 8, 3), np.uint8)})
    with pytest.raises(TypeError, match="int32"):
        obj.check_batch({"image": np.zeros((2, 8, 8, 1), np.int32)})
    with pytest.raises(ValueError, match="planned_updates"):
        JepaObjective(encoder=ENCODER, predictor=PREDICTOR, planned_updates=0)
    with pytest.raises(ValueError, match="loss_type"):
        objective(loss_type="l2")


def test_collapse_alarm_warns_in_one_line_against_the_first_logged_values():
    from dew.objectives.jepa.jepa import CollapseAlarm

    obj = objective()
    assert obj.log_notes(10, {"loss": 0.1}) == []  # no statistics logged: nothing to say
    assert obj.log_notes(10, {"pooled_std": 0.2, "effective_rank": 6.0}) == []  # the first
    assert obj.log_notes(20, {"pooled_std": 0.06, "effective_rank": 2.0}) == []  # 0.3x, 0.33x
    (line,) = obj.log_notes(30, {"pooled_std": 0.04, "effective_rank": 6.0})
    assert line.startswith("warning: step 30: JEPA features are collapsing (pooled_std 0.04 < ")
    assert "\n" not in line and "0.25 x its first 0.2" in line
    (line,) = obj.log_notes(40, {"pooled_std": 0.2, "effective_rank": 1.2})
    assert "effective_rank 1.2 < 0.25 x its first 6" in line
    # a run that starts collapsed: the absolute floors
    fresh = objective()
    (line,) = fresh.log_notes(5, {"pooled_std": 0.004, "effective_rank": 1.1})
    assert "pooled_std 0.004 < 0.01" in line and "effective_rank 1.1 < 1.5" in line
    assert objective(alarm=None).log_notes(5, {"pooled_std": 0.0, "effective_rank": 0.0}) == []
    with pytest.raises(ValueError, match="std_fraction"):
        CollapseAlarm(std_fraction=1.5)

"""DiffusionObjective's loss against a numpy computation of the same noising and target.

The denoiser is a per-channel affine map with a time term and a label table, so numpy
can compute its output too: ``F(x, t, label) = w x + b t / 1000 + E[label]``. The random
draws (times, noise, dropout) come from the step key in the objective's documented
order, per row: ``k_time, k_noise, k_drop = split(split(step.key, rows)[row], 3)``;
everything after them is recomputed here from the papers' formulas.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import DiT
from dew.objectives.contract.objective import Step
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import DDPMSchedule, EDMSchedule, FlowSchedule

CHANNELS, CLASSES, ROWS = 3, 4, 6


class Affine(nn.Module):
    """``w x + b t / 1000 + E[label]`` per channel (``2C`` outputs with learn_sigma)."""

    num_classes: int = CLASSES
    learn_sigma: bool = False
    context_features: int = 0
    in_channels: int = CHANNELS
    sample_shape: tuple = (4, 4)

    @nn.compact
    def __call__(self, x, t, label=None, context=None):
        out = CHANNELS * (2 if self.learn_sigma else 1)
        init = nn.initializers.normal(0.5)
        w = self.param("w", init, (out,))
        b = self.param("b", init, (out,))
        table = self.param("table", init, (self.num_classes + 1, out))
        x = jnp.concatenate([x] * (2 if self.learn_sigma else 1), axis=-1)
        y = w * x + b * (t / 1000.0)[:, None, None, None] + table[label][:, None, None, :]
        if context is not None:
            y = y + context.mean(axis=(1, 2))[:, None, None, None]
        return y


def numpy_betas(kind, steps=1000):
    if kind == "linear":
        return np.linspace(1e-4 * 1000 / steps, 0.02 * 1000 / steps, steps)
    f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return np.array([min(1 - f((i + 1) / steps) / f(i / steps), 0.999) for i in range(steps)])


def batch_of(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (ROWS, 4, 4, CHANNELS)).astype(np.uint8),
        "label": rng.integers(0, CLASSES, (ROWS,)).astype(np.int32),
        "weight": rng.uniform(0.5, 2.0, (ROWS,)).astype(np.float32),
    }


def draws(objective, key, shape):
    """Row ``i``'s time, noise and dropout from ``split(split(key, rows)[i], 3)``: the
    loss's per-row draws (``Step.row_keys``)."""

    @jax.jit
    def draw(key):
        def row(row_key):
            k_time, k_noise, k_drop = jax.random.split(row_key, 3)
            t = objective.schedule.sample_time(k_time, ())
            noise = jax.random.normal(k_noise, shape[1:], jnp.float32)
            return t, noise, jax.random.bernoulli(k_drop, objective.cond_dropout)

        return jax.vmap(row)(jax.random.split(key, shape[0]))

    return [np.asarray(a, np.float64 if a.dtype != bool else bool) for a in draw(key)]


def init(objective, seed=0):
    return nn.unbox(jax.jit(objective.init)(jax.random.key(seed)))


def numpy_loss(objective, params, batch, key):
    """The weighted per-example loss, every formula written out in numpy."""
    per, w, _ = numpy_rows(objective, params, batch, key)
    return np.sum(w * per) / np.sum(w)


def numpy_rows(objective, params, batch, key):
    """``(loss per row, row weights, drawn time per row)``, in numpy."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x0 = batch["image"].astype(np.float64) / 127.5 - 1.0
    t, eps, drop = draws(objective, key, x0.shape)
    label = np.where(drop, CLASSES, batch["label"])
    sched = objective.schedule
    r = (slice(None), None, None, None)
    if sched.family == "ddpm":
        abar = np.cumprod(1 - numpy_betas(sched.kind))[t.astype(int)]
        a, s = np.sqrt(abar)[r], np.sqrt(1 - abar)[r]
        x_in, model_t = a * x0 + s * eps, t
    elif sched.family == "flow":
        a, s = (1 - t)[r], t[r]
        x_in, model_t = a * x0 + s * eps, 1000 * t
    else:
        sd, sig = sched.sigma_data, t[r]
        x_t = x0 + sig * eps
        x_in, model_t = x_t / np.sqrt(sig**2 + sd**2), np.log(t) / 4
    out = p["w"] * x_in + p["b"] * (model_t / 1000.0)[r] + p["table"][label][:, None, None, :]
    if sched.family == "edm":
        c_skip, c_out = sd**2 / (sig**2 + sd**2), sig * sd / np.sqrt(sig**2 + sd**2)
        d = c_skip * x_t + c_out * out
        per = (
            (sig[:, 0, 0, 0] ** 2 + sd**2)
            / (sig[:, 0, 0, 0] * sd) ** 2
            * np.mean((d - x0) ** 2, axis=(1, 2, 3))
        )
    else:
        target = {
            "eps": eps,
            "x0": x0,
            "v": a * eps - s * x0,
            "flow": eps - x0,
        }[objective.output_target]
        per = np.mean((out - target) ** 2, axis=(1, 2, 3))
    return per, batch["weight"].astype(np.float64), t


def numpy_time_edges(schedule, fractions):
    """Times at fractions of the range, as ``eval_times`` reads them: timestep
    ``round(f (T-1))``, flow time ``f``, EDM's rho-spaced sigma (``f = 1`` the noisiest)."""
    f = np.asarray(fractions, np.float64)
    if schedule.family == "ddpm":
        return np.round(f * (schedule.num_timesteps - 1))
    if schedule.family == "flow":
        return f
    lo, hi = (s ** (1 / schedule.rho) for s in (schedule.sigma_min, schedule.sigma_max))
    return (lo + f * (hi - lo)) ** schedule.rho


CASES = [
    (DDPMSchedule(kind="linear"), "eps"),
    (DDPMSchedule(kind="cosine"), "v"),
    (DDPMSchedule(kind="cosine"), "x0"),
    (FlowSchedule(time_sampling="logit_normal", shift=3.0), "flow"),
    (FlowSchedule(time_sampling="uniform"), "v"),
    (EDMSchedule(), "x0"),
]


@pytest.mark.parametrize("schedule,target", CASES, ids=[f"{s.family}-{t}" for s, t in CASES])
def test_loss_matches_numpy(schedule, target):
    objective = DiffusionObjective(
        model=Affine(), schedule=schedule, target=target, cond_dropout=0.5
    )
    params = init(objective)["params"]["policy"]
    batch = batch_of()
    key = jax.random.key(7)
    variables = {"params": {"policy": params}}
    loss, metrics = jax.jit(objective.loss)(variables, batch, Step(index=0, key=key))
    want = numpy_loss(objective, params, batch, key)
    np.testing.assert_allclose(float(loss.value), want, rtol=1e-5)
    np.testing.assert_allclose(float(loss.weight), batch["weight"].sum(), rtol=1e-6)
    assert np.isclose(float(metrics["mse"].value), want, rtol=1e-5) == (schedule.family != "edm")
    # the loss by time bin (the log line's headline): rows binned by their drawn time
    per, w, t = numpy_rows(objective, params, batch, key)
    names = objective.headline_metrics
    assert names == ("loss_t0-0.33", "loss_t0.33-0.67", "loss_t0.67-1")
    edges = numpy_time_edges(schedule, [1 / 3, 2 / 3])
    which = (t[:, None] >= edges[None]).sum(1)
    for b, name in enumerate(names):
        got = metrics[name]
        np.testing.assert_allclose(float(got.weight), w[which == b].sum(), rtol=1e-6)
        if (which == b).any():
            want_bin = np.sum((w * per)[which == b]) / np.sum(w[which == b])
            np.testing.assert_allclose(float(got.value), want_bin, rtol=1e-5)
    # the bins add up to the loss
    np.testing.assert_allclose(
        sum(float(metrics[n].total) for n in names), float(loss.total), rtol=1e-5
    )


def test_condition_dropout_rate_and_null_condition():
    model = Affine(context_features=5)
    objective = DiffusionObjective(model=model, schedule=FlowSchedule(), cond_dropout=0.1)
    rows = 8000
    context = np.ones((rows, 3, 5), np.float32)
    batch = {
        "image": np.zeros((rows, 4, 4, 3), np.float32),
        "label": np.zeros(rows, np.int32),
        "context": context,
    }
    cond = objective.conditions(batch, jax.random.key(4))
    dropped = np.asarray(cond["label"]) == CLASSES
    # binomial(8000, 0.1): std 0.0034; 4 sigma
    assert abs(dropped.mean() - 0.1) < 0.014
    ctx = np.asarray(cond["context"])
    np.testing.assert_array_equal(ctx[dropped], 0.0)  # the default null context: zeros
    np.testing.assert_array_equal(ctx[~dropped], 1.0)  # label and context drop together
    assert objective.conditions(batch, None)["label"].max() == 0  # no dropout in evaluation


def numpy_vb(x0, x_t, eps_pred, v, t, betas):
    """improved-diffusion ``_vb_terms_bpd`` (transcribed), bits per dimension ``[batch]``."""
    abar = np.cumprod(1 - betas)
    prev = np.append(1.0, abar[:-1])
    post_var = betas * (1 - prev) / (1 - abar)
    post_log = np.log(np.append(post_var[1], post_var[1:]))
    c0 = betas * np.sqrt(prev) / (1 - abar)
    ct = (1 - prev) * np.sqrt(1 - betas) / (1 - abar)
    r = (t, None, None, None)
    true_mean = c0[r] * x0 + ct[r] * x_t
    x0_hat = (x_t - np.sqrt(1 - abar)[r] * eps_pred) / np.sqrt(abar)[r]
    mean = c0[r] * x0_hat + ct[r] * x_t
    frac = (v + 1) / 2
    log_var = frac * np.log(betas)[r] + (1 - frac) * post_log[r]
    kl = 0.5 * (
        -1
        + log_var
        - post_log[r]
        + np.exp(post_log[r] - log_var)
        + (true_mean - mean) ** 2 * np.exp(-log_var)
    )
    cdf = lambda z: 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))  # noqa: E731
    inv = np.exp(-0.5 * log_var)
    plus, minus = cdf(inv * (x0 - mean + 1 / 255)), cdf(inv * (x0 - mean - 1 / 255))
    ll = np.where(
        x0 < -0.999,
        np.log(np.maximum(plus, 1e-12)),
        np.where(
            x0 > 0.999,
            np.log(np.maximum(1 - minus, 1e-12)),
            np.log(np.maximum(plus - minus, 1e-12)),
        ),
    )
    kl, nll = kl.mean(axis=(1, 2, 3)) / np.log(2), -ll.mean(axis=(1, 2, 3)) / np.log(2)
    return np.where(t == 0, nll, kl)


def test_learned_variance_hybrid_loss_and_stopped_mean():
    objective = DiffusionObjective(model=Affine(learn_sigma=True), cond_dropout=0.0)
    params = init(objective, 1)["params"]["policy"]
    batch = batch_of(1)
    batch["image"][0] = 0  # a row at exactly -1: the decoder's edge bin
    key = jax.random.key(3)
    step = Step(index=0, key=key)
    t, noise, _ = draws(objective, key, batch["image"].shape)
    t = t.astype(np.int64)
    t[0] = 0  # the decoder NLL term
    x0 = batch["image"].astype(np.float64) / 127.5 - 1
    loss, metrics = jax.jit(objective.per_example_loss, static_argnames="drop_key")(
        {"policy": params},
        batch,
        time=jnp.asarray(t),
        noise=jnp.asarray(noise, jnp.float32),
        drop_key=None,
    )
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    abar = np.cumprod(1 - numpy_betas("linear"))[t]
    r = (slice(None), None, None, None)
    x_t = np.sqrt(abar)[r] * x0 + np.sqrt(1 - abar)[r] * noise
    xx = np.concatenate([x_t, x_t], -1)
    out = p["w"] * xx + p["b"] * (t / 1000.0)[r] + p["table"][batch["label"]][:, None, None, :]
    eps_pred, v = out[..., :CHANNELS], out[..., CHANNELS:]
    want_vb = numpy_vb(x0, x_t, eps_pred, v, t, numpy_betas("linear"))
    want_mse = np.mean((eps_pred - noise) ** 2, axis=(1, 2, 3))
    np.testing.assert_allclose(metrics["vb"], want_vb, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(loss, want_mse + want_vb, rtol=2e-4, atol=1e-6)
    # the VLB term trains only the variance: no gradient reaches the mean's channels
    vb_total = lambda q: objective.loss({"params": {"policy": q}}, batch, step)[1]["vb"].total  # noqa: E731
    grad = jax.jit(jax.grad(vb_total))(params)
    np.testing.assert_array_equal(np.asarray(grad["w"])[:CHANNELS], 0.0)
    assert np.abs(np.asarray(grad["w"])[CHANNELS:]).max() > 0


def test_evaluate_uses_fixed_times_and_noise():
    objective = DiffusionObjective(model=Affine(), schedule=FlowSchedule())
    params = init(objective)
    batch = batch_of()
    evaluate = jax.jit(objective.evaluate)
    a = evaluate(params, batch, Step(index=0, key=jax.random.key(1)))
    b = evaluate(params, batch, Step(index=5, key=jax.random.key(2)))
    assert sorted(a) == ["loss", "loss_t0.1", "loss_t0.3", "loss_t0.5", "loss_t0.7", "loss_t0.9"]
    for name in a:
        assert float(a[name].value) == float(b[name].value)
    values = [float(a[f"loss_t{f:g}"].value) for f in objective.eval_times]
    np.testing.assert_allclose(float(a["loss"].value), np.mean(values), rtol=1e-6)
    assert len(set(values)) == len(values)


TINY_DIT = dict(
    sample_size=8,
    patch_size=2,
    in_channels=1,
    emb_features=16,
    num_layers=1,
    num_heads=2,
    mlp_features=32,
)


def test_bad_input_is_refused_before_compiling():
    dit = DiT(**TINY_DIT, num_classes=10)
    objective = DiffusionObjective(model=dit)
    good = {"image": np.zeros((2, 8, 8, 1), np.uint8), "label": np.array([0, 9], np.int32)}
    objective.check_batch(good)
    with pytest.raises(
        ValueError, match=r"\(2, 8, 8\), but DiffusionObjective reads \[rows, height"
    ):
        objective.check_batch({**good, "image": np.zeros((2, 8, 8), np.uint8)})
    with pytest.raises(ValueError, match="multiples of patch_size 2"):
        objective.check_batch({**good, "image": np.zeros((2, 7, 8, 1), np.uint8)})
    with pytest.raises(ValueError, match=r"0\.\.10.*num_classes=10"):
        objective.check_batch({**good, "label": np.array([0, 10], np.int32)})
    with pytest.raises(KeyError, match=r"reads batch\['label'\] \[rows\] integer.*num_classes=10"):
        objective.check_batch({"image": good["image"]})
    with pytest.raises(TypeError, match="int32"):
        objective.check_batch({**good, "image": np.zeros((2, 8, 8, 1), np.int32)})
    with pytest.raises(ValueError, match="cond_dropout=0"):
        DiffusionObjective(model=dit, cond_dropout=0.0, guidance=3.0)
    with pytest.raises(ValueError, match="cond_dropout=0"):
        DiffusionObjective(model=dit, cond_dropout=0.0).sample(
            {}, jax.random.key(0), label=np.zeros(2, np.int32), guidance=2.0
        )
    with pytest.raises(ValueError, match=r"EDMHeun samples 'edm' models.*DDPMSchedule"):
        objective.sample({}, jax.random.key(0), label=np.zeros(2, np.int32), sampler="edm_heun")
    with pytest.raises(ValueError, match=r"num_steps=0 must be a whole number >= 1"):
        objective.sample({}, jax.random.key(0), label=np.zeros(2, np.int32), num_steps=0)
    with pytest.raises(ValueError, match="pass label="):
        objective.sample({}, jax.random.key(0), num=2)
    with pytest.raises(ValueError, match="needs a DDPMSchedule"):
        DiffusionObjective(model=DiT(**TINY_DIT, learn_sigma=True), schedule=FlowSchedule())
    with pytest.raises(ValueError, match="use target='x0'"):
        DiffusionObjective(model=dit, schedule=EDMSchedule(), target="eps")
    text = DiffusionObjective(model=DiT(**TINY_DIT, context_features=6))
    with pytest.raises(ValueError, match=r"reads \[rows, tokens = 3, 6\]"):
        text.check_batch({"image": good["image"], "context": np.zeros((2, 3, 5), np.float32)})
    video = DiffusionObjective(model=DiT(**TINY_DIT), input_key="video")
    with pytest.raises(ValueError, match=r"reads \[rows, frames, height, width, 1\].*VideoDiT"):
        video.check_batch({"video": good["image"]})

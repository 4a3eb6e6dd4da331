"""The flow SDE sampler with log-probs (dew.sampling.flow_sde) against closed forms.

The 2-D ring of 8 Gaussians (R = 4, sigma = 0.15) has an exact flow velocity: for a
mixture prior, ``E[x0 | x_t]`` is the posterior-weighted mean of each component's
Gaussian posterior. Driven by it, the SDE (a = 0.7, either kind) must have the ODE's
marginal; a step's mean, noise and log-prob must match a float64 numpy transcription of
Flow-GRPO's ``sde_step_with_logprob``; ``a = 0`` must be FlowEuler; and row ``r``'s
draws must not depend on the batch around it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.sampling import Denoised, FlowEuler, FlowSchedule, FlowSDE, sample_flow_sde
from dew.sampling.flow_sde import transition_log_prob

RADIUS, SIGMA, MODES = 4.0, 0.15, 8
ANGLES = 2 * np.pi * np.arange(MODES) / MODES
CENTRES = (RADIUS * np.stack([np.cos(ANGLES), np.sin(ANGLES)], 1)).astype(np.float32)


def ring_denoiser(x, time):
    """The exact ``(x0, eps)`` of the ring's flow path ``x = (1 - t) x0 + t eps``."""
    t = jnp.broadcast_to(jnp.asarray(time, jnp.float32), x.shape[:1])[:, None]  # [rows, 1]
    a = 1.0 - t
    var = a**2 * SIGMA**2 + t**2  # [rows, 1]
    d2 = jnp.sum((x[:, None, :] - a[:, None] * CENTRES[None]) ** 2, axis=-1)  # [rows, modes]
    weights = jax.nn.softmax(-d2 / (2 * var), axis=-1)
    means = CENTRES[None] + (a * SIGMA**2 / var)[:, None] * (x[:, None, :] - a[:, None] * CENTRES)
    x0 = jnp.einsum("rm,rmd->rd", weights, means)
    return Denoised(x0=x0, eps=(x - a * x0) / t)


def ring(rng, n):
    return CENTRES[rng.integers(0, MODES, n)] + SIGMA * rng.normal(size=(n, 2))


def mmd(a, b, bandwidth=1.0):
    def k(x, y):
        return np.exp(-((x[:, None] - y[None]) ** 2).sum(-1) / (2 * bandwidth**2)).mean()

    return k(a, a) + k(b, b) - 2 * k(a, b)


@pytest.fixture(scope="module")
def sample():
    def call(sampler, rows=2000, key=1, initial=None):
        if initial is None:
            initial = jax.random.normal(jax.random.key(7), (rows, 2))
        fn = jax.jit(
            lambda k, x0: sample_flow_sde(
                ring_denoiser, sampler=sampler, key=k, shape=x0.shape, initial=x0
            )
        )
        return fn(jax.random.key(key), initial)

    return call


@pytest.fixture(scope="module")
def ode(sample):
    return np.asarray(sample(FlowSDE(num_steps=40, noise_level=0.0)).samples, np.float64)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_sde_has_the_ode_marginal_on_the_ring(sample, ode, kind):
    rng = np.random.default_rng(0)
    sde = sample(FlowSDE(num_steps=40, noise_level=0.7, kind=kind), key=3)
    sde = np.asarray(sde.samples, np.float64)
    baseline = mmd(ring(rng, 2000), ring(rng, 2000))
    gap = mmd(sde, ode)
    print(kind, "MMD(SDE, ODE)", gap, "data-vs-data", baseline)
    assert gap <= 3 * baseline, (gap, baseline)
    assert mmd(ode, ring(rng, 2000)) <= 3 * baseline  # and both are the ring


def test_a_zero_is_flow_euler():
    key, shape = jax.random.key(4), (64, 2)
    euler = jax.jit(lambda k: FlowEuler(num_steps=12).run(ring_denoiser, FlowSchedule(), k, shape))
    sde = jax.jit(
        lambda k: sample_flow_sde(
            ring_denoiser,
            sampler=FlowSDE(num_steps=12, noise_level=0.0),
            key=k,
            shape=shape,
            initial=jax.random.normal(k, shape, jnp.float32),
        )
    )
    out = sde(key)
    np.testing.assert_array_equal(np.asarray(out.samples), np.asarray(euler(key)))
    assert out.log_probs.shape == (64, 0) and FlowSDE(noise_level=0).window_steps == 0


def reference_step(x, v, t, t_next, t_1, a, kind, x_next):
    """Flow-GRPO's sde_step_with_logprob in float64 numpy (the Gaussian log-prob for both
    kinds, per element): ``(mean, std, log_prob per element)``."""
    dt = t_next - t
    if kind == "sde":
        std_dev = math.sqrt(t / (1 - (t_1 if t == 1 else t))) * a
        mean = x * (1 + std_dev**2 / (2 * t) * dt) + v * (1 + std_dev**2 * (1 - t) / (2 * t)) * dt
        std = std_dev * math.sqrt(-dt)
    else:
        std = t_next * math.sin(a * math.pi / 2)
        x0, x1 = x - t * v, x + v * (1 - t)
        mean = x0 * (1 - t_next) + x1 * math.sqrt(t_next**2 - std**2)
    logp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return mean, std, logp


@pytest.mark.parametrize("kind, reduction", [("sde", "mean"), ("cps", "sum")])
def test_steps_match_a_float64_transcription_of_the_reference(kind, reduction):
    """Every step of one trajectory (t = 1 included: the sigma_max guard) from its stored
    states: the mean, the noise and the log-prob; and the log-prob recomputed from the
    stored transition (the loss's function) equals the sampler's within 1e-6."""
    sampler = FlowSDE(num_steps=6, noise_level=0.7, kind=kind, shift=3.0, reduction=reduction)
    rows = 5
    out = jax.jit(
        lambda k: sample_flow_sde(ring_denoiser, sampler=sampler, key=k, shape=(rows, 2))
    )(jax.random.key(2))
    lat = np.asarray(out.latents, np.float64)  # [rows, W + 1, 2]
    ts = sampler.times()
    start, end = sampler.stochastic
    assert (start, end) == ((0, 6) if kind == "sde" else (0, 5))
    for j in range(end - start):
        i = start + j
        x = lat[:, j]
        d = ring_denoiser(jnp.asarray(x, jnp.float32), ts[i])
        v = np.asarray(d.eps - d.x0, np.float64)
        mean, std, per = reference_step(x, v, ts[i], ts[i + 1], ts[1], 0.7, kind, lat[:, j + 1])
        want = per.mean(1) if reduction == "mean" else per.sum(1)
        np.testing.assert_allclose(np.asarray(out.log_probs)[:, j], want, rtol=2e-5, atol=2e-5)
        z = (lat[:, j + 1] - mean) / std  # the draw is standard normal, not a constant
        assert np.all(np.abs(z) < 6) and np.std(z) > 0.1
        recomputed, _ = transition_log_prob(
            ring_denoiser,
            sampler,
            jnp.asarray(lat[:, j], jnp.float32),
            jnp.asarray(lat[:, j + 1], jnp.float32),
            jnp.full((rows,), j),
        )
        # within 1e-6 of max(1, |log p|), the RL core's first-update tolerance
        np.testing.assert_allclose(recomputed, out.log_probs[:, j], rtol=1e-6, atol=1e-6)


def test_a_row_draws_the_same_whatever_the_batch_around_it():
    """Row r of a batch of 24 == the same global index sampled alone (batch 1, another
    slot): the draws are fold_in(key, global index)."""
    sampler = FlowSDE(num_steps=5)
    fn = jax.jit(
        lambda k, rows: sample_flow_sde(
            ring_denoiser, sampler=sampler, key=k, shape=(rows.shape[0], 2), rows=rows
        )
    )
    key = jax.random.key(9)
    whole = fn(key, jnp.arange(24))
    alone = fn(key, jnp.asarray([17]))  # batch 1, slot 0 instead of slot 17 of 24
    np.testing.assert_allclose(alone.latents[0], whole.latents[17], rtol=0, atol=1e-6)
    np.testing.assert_allclose(alone.log_probs[0], whole.log_probs[17], rtol=0, atol=1e-6)
    assert not np.allclose(whole.latents[16], whole.latents[17])


def test_window_keeps_the_other_steps_deterministic():
    sampler = FlowSDE(num_steps=8, window=(2, 4))
    assert sampler.stochastic == (2, 4) and sampler.window_steps == 2
    initial = jax.random.normal(jax.random.key(0), (16, 2))
    fn = jax.jit(
        lambda k: sample_flow_sde(
            ring_denoiser, sampler=sampler, key=k, shape=(16, 2), initial=initial
        )
    )
    a, b = fn(jax.random.key(1)), fn(jax.random.key(2))
    assert a.latents.shape == (16, 3, 2) and a.log_probs.shape == (16, 2)
    np.testing.assert_array_equal(a.latents[:, 0], b.latents[:, 0])  # ODE steps 0, 1
    assert not np.allclose(a.latents[:, 1], b.latents[:, 1])  # step 2 drew noise
    # after the window: the ODE again, so the same start gives the same end
    table = sampler.table()
    assert np.all(table["std"][[0, 1, 4, 5, 6, 7]] == 0) and np.all(table["std"][2:4] > 0)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(noise_level=-0.1), "noise_level"),
        (dict(num_steps=1), r"num_steps=1 must be a whole number >= 2 \(FlowSDE"),
        (dict(num_steps=0), r"num_steps=0 must be a whole number >= 2 \(FlowSDE"),
        (dict(num_steps=True), r"num_steps=True must be a whole number >= 2"),
        (dict(num_steps=8.0), r"num_steps=8.0 must be a whole number >= 2"),
        (dict(noise_level=float("nan")), r"noise_level=nan must be a finite number >= 0"),
        (dict(shift=np.float32(0)), r"shift=np.float32\(0.0\) must be a finite number > 0"),
        (dict(num_steps=8, window=(3, 9)), "window"),
        (dict(num_steps=8, window=(4, 4)), "window"),
        (dict(num_steps=8, kind="cps", window=(0, 8)), "last CPS step"),
        (dict(kind="ito"), "kind"),
        (dict(reduction="max"), "reduction"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        FlowSDE(**options)


def test_numbers_in_every_numeric_form_are_accepted():
    """numpy scalars and 0-d arrays are numbers (issue 42): stored as Python numbers."""
    plain = FlowSDE(num_steps=8, noise_level=float(np.float32(0.7)), shift=3.0, window=(1, 4))
    for num_steps, noise_level in (
        (np.int64(8), np.float32(0.7)),
        (np.int32(8), np.array(np.float32(0.7))),
        (np.array(8), np.float64(np.float32(0.7))),
    ):
        sde = FlowSDE(num_steps=num_steps, noise_level=noise_level, shift=np.float32(3.0),
                      window=(np.int64(1), np.int64(4)))  # fmt: skip
        assert sde == plain and hash(sde) == hash(plain)
        assert type(sde.num_steps) is int and type(sde.noise_level) is float

"""Diffusion schedules, targets and samplers against closed forms.

With data ``x0 ~ N(mu, s^2)`` (per dimension) the optimal denoiser is analytic: on
``x = a x0 + sigma eps``, ``E[x0 | x] = mu + a s^2 / (a^2 s^2 + sigma^2) (x - a mu)``.
Every sampler driven by that exact denoiser must give samples with the data's mean and
standard deviation; the network is a fake ``apply_fn`` that answers with the exact
prediction of each target, so the conversions are exercised too.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from dew.sampling import (
    DDIM,
    DDPM,
    TARGETS,
    DDPMSchedule,
    EDMHeun,
    EDMSchedule,
    FlowEuler,
    FlowHeun,
    FlowSchedule,
    make_sampler,
    model_denoiser,
    predictions_of,
    sample_diffusion,
    target_of,
)

MU = np.array([1.0, -0.5], np.float32)
STD = np.array([0.5, 0.3], np.float32)
ROWS = 4096
# Standard errors at 4096 rows: mean 0.5/64 = 0.008, std 0.5/sqrt(2*4096) = 0.0055.
MEAN_TOL = 0.035
STD_REL_TOL = 0.05


def exact_network(schedule, target, mu=MU, std=STD):
    """``apply_fn(x_in, t, label=None, context=None)`` answering with the exact prediction
    of ``target``; with labels, class ``c`` has mean ``mu + c`` (the null class: ``mu``)."""

    def apply_fn(x_in, model_t, label=None, context=None):
        del context
        if schedule.family == "ddpm":
            t, x = model_t.astype(jnp.int32), x_in
            a, s = schedule.coefficients(t)
        elif schedule.family == "flow":
            t, x = model_t / schedule.time_scale, x_in
            a, s = schedule.coefficients(t)
        else:
            s = jnp.exp(4.0 * model_t)
            a = jnp.ones_like(s)
            x = x_in * jnp.sqrt(s**2 + schedule.sigma_data**2)[:, None]
        a, s = a[:, None], s[:, None]
        m = jnp.asarray(mu)
        if label is not None:
            m = m + jnp.where(label == 10, 0.0, label.astype(jnp.float32))[:, None]
        v = jnp.asarray(std) ** 2
        x0 = m + a * v / (a**2 * v + s**2) * (x - a * m)
        eps = (x - a * x0) / s
        if schedule.family == "edm":
            c_skip, c_out, _, _ = schedule.precondition(s[:, 0])
            return (x0 - c_skip[:, None] * x) / c_out[:, None]
        return target_of(target, x0, eps, a, s)

    return apply_fn


CASES = [
    (DDPMSchedule(kind="linear"), "eps", DDPM(num_steps=200)),
    (DDPMSchedule(kind="cosine"), "v", DDPM(num_steps=200)),
    # DDIM's error is discretization: on the linear schedule the std is 5% low at 50
    # steps, 1% at 200 (measured), so these cases take 200
    (DDPMSchedule(kind="linear"), "eps", DDIM(num_steps=200)),
    (DDPMSchedule(kind="cosine"), "x0", DDIM(num_steps=50)),
    (DDPMSchedule(kind="cosine"), "eps", DDIM(num_steps=200, eta=1.0)),
    (DDPMSchedule(kind="linear", zero_terminal_snr=True), "v", DDIM(num_steps=200)),
    # Euler's error is O(1/steps): std 4% low at 50 steps, 1% at 200 (measured)
    (FlowSchedule(), "flow", FlowEuler(num_steps=200)),
    (FlowSchedule(), "v", FlowHeun(num_steps=20)),
    (FlowSchedule(shift=3.0), "x0", FlowEuler(num_steps=200, shift=3.0)),
    # EDM's 18 steps leave the std 6% high on this data, 1% at 50 (measured)
    (EDMSchedule(), "x0", EDMHeun(num_steps=50)),
    (EDMSchedule(), "x0", EDMHeun(num_steps=50, s_churn=10.0)),
]


@functools.cache
def draw(schedule, target, sampler, guidance=1.0, label=None):
    apply_fn = exact_network(schedule, target)
    labels = None if label is None else jnp.full((ROWS,), label, jnp.int32)

    @jax.jit
    def run(key):
        denoise = model_denoiser(
            apply_fn,
            schedule=schedule,
            target=target,
            label=labels,
            null_label=10,
            guidance=guidance,
        )
        return sample_diffusion(
            denoise, schedule=schedule, sampler=sampler, key=key, shape=(ROWS, 2)
        )

    return np.asarray(run(jax.random.key(3)), np.float64)


@pytest.mark.parametrize(
    "schedule,target,sampler", CASES, ids=[f"{type(c[2]).__name__}-{c[1]}" for c in CASES]
)
def test_exact_denoiser_reproduces_the_data(schedule, target, sampler):
    x = draw(schedule, target, sampler)
    assert np.all(np.isfinite(x))
    np.testing.assert_allclose(x.mean(0), MU, atol=MEAN_TOL)
    np.testing.assert_allclose(x.std(0), STD, rtol=STD_REL_TOL)


def test_guidance_extrapolates_the_conditional_mean():
    """Class 2 has mean ``mu + 2``, the null class ``mu``: guidance ``w`` moves the
    guided denoiser's ``x0`` to ``mu + w * 2`` at low noise (same variance both ways)."""
    schedule, sampler = FlowSchedule(), FlowEuler(num_steps=50)
    conditional = draw(schedule, "flow", sampler, 1.0, 2)
    np.testing.assert_allclose(conditional.mean(0), MU + 2, atol=MEAN_TOL)
    guided = draw(schedule, "flow", sampler, 3.0, 2)
    np.testing.assert_allclose(guided.mean(0), MU + 6, atol=MEAN_TOL)
    np.testing.assert_allclose(guided.std(0), STD, rtol=STD_REL_TOL)


def test_guidance_is_one_batched_call():
    schedule = DDPMSchedule()
    calls = []
    network = exact_network(schedule, "eps")

    def apply_fn(x, t, label=None, context=None):
        calls.append((x.shape, label))
        return network(x, t, label=label)

    label = jnp.array([0, 3], jnp.int32)
    denoise = model_denoiser(
        apply_fn, schedule=schedule, target="eps", label=label, null_label=10, guidance=4.0
    )
    x = jnp.array([[0.3, 0.1], [-1.0, 2.0]])
    d = jax.jit(denoise)(x, jnp.int32(500))
    assert len(calls) == 1 and calls[0][0] == (4, 2)
    assert calls[0][1].shape == (4,)
    plain = model_denoiser(network, schedule=schedule, target="eps", label=label)
    null = model_denoiser(network, schedule=schedule, target="eps", label=jnp.full((2,), 10))
    c, u = jax.jit(lambda x: (plain(x, 500), null(x, 500)))(x)
    np.testing.assert_allclose(d.x0, u.x0 + 4.0 * (c.x0 - u.x0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d.eps, u.eps + 4.0 * (c.eps - u.eps), rtol=1e-5, atol=1e-5)


def ode_map(schedule, key):
    """Where the probability-flow ODE takes each initial noise row for Gaussian data:
    ``x_t = a mu + sqrt(a^2 s^2 + sigma^2) w`` with ``w`` constant along a path, so
    ``x0 = mu + s w``, ``w = (x_T - a_T mu) / sqrt(a_T^2 s^2 + sigma_T^2)``."""
    x_T = np.asarray(jax.random.normal(jax.random.split(key)[0], (ROWS, 2)), np.float64)
    a, s = (float(c) for c in schedule.coefficients(jnp.int32(schedule.num_timesteps - 1)))
    w = (x_T - a * MU) / np.sqrt(a**2 * STD**2 + s**2)
    return MU + STD * w


def test_ddim_eta_zero_follows_the_ode_row_by_row():
    """DDIM with eta = 0 is deterministic: each sample is the ODE image of its own
    initial noise (within 0.03 on every row, 0.01 on average: the 200-step
    discretization, ~1% of the std at 3 std from the mean); eta = 1 is not."""
    linear, cosine = DDPMSchedule(kind="linear"), DDPMSchedule(kind="cosine")
    ddim = draw(linear, "eps", DDIM(num_steps=200))
    gap = np.abs(ddim - ode_map(linear, jax.random.key(3)))
    assert gap.max() < 0.03 and gap.mean() < 0.01, (gap.max(), gap.mean())
    noisy = draw(cosine, "eps", DDIM(num_steps=200, eta=1.0))
    assert np.abs(noisy - ode_map(cosine, jax.random.key(3))).mean() > 0.1


def test_clip_denoised_keeps_cosine_eps_finite_at_the_last_timestep():
    """iDDPM's cosine schedule with beta <= 0.999 has abar_{T-1} ~ 4e-8: an eps
    prediction's x0 is ``x / 2e-4`` there; clip_denoised bounds it."""
    schedule = DDPMSchedule(kind="cosine")
    apply_fn = lambda x, t, label=None, context=None: jnp.zeros_like(x)  # noqa: E731
    x = jnp.full((1, 2), 1.0)
    raw = model_denoiser(apply_fn, schedule=schedule, target="eps")(x, jnp.int32(999))
    assert float(jnp.abs(raw.x0).max()) > 1e3
    clipped = model_denoiser(apply_fn, schedule=schedule, target="eps", clip_denoised=1.0)
    d = clipped(x, jnp.int32(999))
    np.testing.assert_allclose(d.x0, 1.0)
    a, s = schedule.coefficients(jnp.int32(999))
    np.testing.assert_allclose(a * d.x0 + s * d.eps, x, rtol=1e-5)


def test_fixed_key_same_samples_on_one_and_eight_devices():
    schedule, sampler = DDPMSchedule(), DDPM(num_steps=20)
    apply_fn = exact_network(schedule, "eps")
    labels = jnp.arange(64, dtype=jnp.int32) % 10
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def run(label, key):
        denoise = model_denoiser(
            apply_fn, schedule=schedule, target="eps", label=label, null_label=10, guidance=2.0
        )
        return sample_diffusion(denoise, schedule=schedule, sampler=sampler, key=key, shape=(64, 2))

    key = jax.random.key(11)
    one = jax.jit(run)(labels, key)
    eight = jax.jit(run, out_shardings=rows)(jax.device_put(labels, rows), key)
    assert len(eight.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(eight), np.asarray(one), rtol=1e-6, atol=1e-6)


def test_conversions_round_trip():
    rng = np.random.default_rng(0)
    x0, eps = rng.normal(size=(2, 64, 3))
    for alpha, sigma in [(0.8, 0.6), (0.3, 0.95), (0.7, 0.3)]:  # VP, VP, flow-like
        x = alpha * x0 + sigma * eps
        for target in TARGETS:
            p = target_of(target, x0, eps, alpha, sigma)
            got_x0, got_eps = predictions_of(target, p, x, alpha, sigma)
            np.testing.assert_allclose(got_x0, x0, atol=1e-10, err_msg=target)
            np.testing.assert_allclose(got_eps, eps, atol=1e-10, err_msg=target)
    vp = target_of("v", x0, eps, 0.6, 0.8)
    np.testing.assert_allclose(vp, 0.6 * eps - 0.8 * x0)
    np.testing.assert_allclose(target_of("flow", x0, eps, 0.5, 0.5), eps - x0)


def improved_diffusion_betas(kind, steps):
    """openai/improved-diffusion get_named_beta_schedule, transcribed."""
    if kind == "linear":
        scale = 1000 / steps
        return np.linspace(scale * 0.0001, scale * 0.02, steps, dtype=np.float64)
    f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return np.array([min(1 - f((i + 1) / steps) / f(i / steps), 0.999) for i in range(steps)])


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [1000, 250])
def test_schedules_match_improved_diffusion(kind, steps):
    schedule = DDPMSchedule(kind=kind, num_timesteps=steps)
    want = improved_diffusion_betas(kind, steps)
    np.testing.assert_allclose(schedule.betas, want, rtol=1e-12)
    assert schedule.betas.max() <= 0.999
    abar = np.cumprod(1 - want)
    a, s = schedule.coefficients(jnp.array([0, steps // 2, steps - 1]))
    np.testing.assert_allclose(a, np.sqrt(abar[[0, steps // 2, -1]]), rtol=1e-5)
    np.testing.assert_allclose(s, np.sqrt(1 - abar[[0, steps // 2, -1]]), rtol=1e-5)


def test_zero_terminal_snr_rescale():
    plain, rescaled = DDPMSchedule(), DDPMSchedule(zero_terminal_snr=True)
    a, b = plain.alphas_cumprod, rescaled.alphas_cumprod
    assert b[-1] == 0.0 and a[-1] > 1e-5
    np.testing.assert_allclose(b[0], a[0], rtol=1e-12)
    # sqrt(abar) is an affine map of the original (Lin et al. 2023 Algorithm 1)
    ra, rb = np.sqrt(a), np.sqrt(b)
    np.testing.assert_allclose(rb, (ra - ra[-1]) * ra[0] / (ra[0] - ra[-1]), atol=1e-12)


def test_flow_time_sampling():
    key = jax.random.key(0)
    uniform = np.asarray(FlowSchedule(time_sampling="uniform").sample_time(key, (50000,)))
    assert uniform.min() >= 0 and uniform.max() <= 1
    assert abs(uniform.mean() - 0.5) < 0.01
    logit = np.asarray(FlowSchedule().sample_time(key, (50000,)))
    z = np.log(logit / (1 - logit))
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1.0) < 0.02
    shifted = np.asarray(FlowSchedule(shift=3.0).sample_time(key, (50000,)))
    # the shift is monotone: the median 0.5 maps to 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert abs(np.median(shifted) - 0.75) < 0.01
    np.testing.assert_allclose(shifted, 3 * logit / (1 + 2 * logit), rtol=1e-5)


def test_edm_sigma_and_preconditioning():
    schedule = EDMSchedule()
    sigma = np.asarray(schedule.sample_time(jax.random.key(0), (50000,)))
    assert abs(np.log(sigma).mean() + 1.2) < 0.02 and abs(np.log(sigma).std() - 1.2) < 0.02
    s = np.array([0.01, 0.5, 3.0, 80.0])
    c_skip, c_out, c_in, c_noise = (np.asarray(c) for c in schedule.precondition(s))
    sd = 0.5
    np.testing.assert_allclose(c_skip, sd**2 / (s**2 + sd**2), rtol=1e-6)
    np.testing.assert_allclose(c_out, s * sd / np.sqrt(s**2 + sd**2), rtol=1e-6)
    np.testing.assert_allclose(c_in, 1 / np.sqrt(s**2 + sd**2), rtol=1e-6)
    np.testing.assert_allclose(c_noise, np.log(s) / 4, rtol=1e-6)
    np.testing.assert_allclose(schedule.loss_weight(s), (s**2 + sd**2) / (s * sd) ** 2, rtol=1e-6)
    # edm_sampler's step_indices spacing, sigma_N = 0
    n, rho = 18, 7
    i = np.arange(n)
    want = (80 ** (1 / rho) + i / (n - 1) * (0.002 ** (1 / rho) - 80 ** (1 / rho))) ** rho
    np.testing.assert_allclose(EDMHeun().sigmas(schedule), np.append(want, 0.0), rtol=1e-12)


def test_bad_pairs_and_steps_are_errors_before_compiling():
    with pytest.raises(ValueError, match=r"num_steps=0 must be a whole number >= 1"):
        DDIM(num_steps=0)
    with pytest.raises(ValueError, match=r"num_steps=0 must be a whole number >= 1"):
        make_sampler("ddim", schedule=DDPMSchedule(), num_steps=0)
    with pytest.raises(ValueError, match=r"EDMHeun samples 'edm' models.*DDPMSchedule"):
        make_sampler("edm_heun", schedule=DDPMSchedule())
    with pytest.raises(ValueError, match=r"use one of \['ddim', 'ddpm'\]"):
        make_sampler(FlowEuler(), schedule=DDPMSchedule())
    with pytest.raises(ValueError, match="exceeds the schedule's 100 timesteps"):
        draw(DDPMSchedule(num_timesteps=100), "eps", DDPM(num_steps=200))
    with pytest.raises(ValueError, match="use target='x0'"):
        model_denoiser(lambda *a, **k: None, schedule=EDMSchedule(), target="eps")
    with pytest.raises(ValueError, match="use target='v'"):
        model_denoiser(
            lambda *a, **k: None, schedule=DDPMSchedule(zero_terminal_snr=True), target="eps"
        )
    with pytest.raises(ValueError, match="needs a condition"):
        model_denoiser(lambda *a, **k: None, schedule=FlowSchedule(), target="flow", guidance=2)
    assert make_sampler(None, schedule=EDMSchedule()) == EDMHeun()
    assert make_sampler("ddim", schedule=DDPMSchedule(), num_steps=7, eta=0.5) == DDIM(
        num_steps=7, eta=0.5
    )

"""DiffusionObjective trained by dew.train.Trainer on toys with known answers.

- The 2-D ring of 8 Gaussians (OBJECTIVES.md section 2: R = 4, sigma = 0.15) with an MLP
  denoiser: flow matching + Euler and eps (cosine) + DDIM each put >= 85% of samples
  within 3 sigma of a mode, every mode >= 5%, MMD <= 5x the data-vs-data baseline.
- 8x8 digits (scikit-learn's bundled set), class-conditional with a tiny DiT and
  classifier-free guidance: per-pixel mean and std of samples near the data's, and a
  classifier trained on the real digits labels guided samples as the asked class.
- A diffusion run killed with SIGKILL mid-run resumes bit-identical
  (tests/train_child.py --objective diffusion): the noise, time and dropout draws repeat.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn.backbones.dit import timestep_embedding
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import DDPMSchedule, FlowSchedule
from dew.train import MeshSpec, Trainer

ONE = dict(mesh=MeshSpec(data=1, devices=jax.devices()[:1]))

# ---------------------------------------------------------------- the ring
RADIUS, SIGMA, MODES = 4.0, 0.15, 8
CENTRES = RADIUS * np.stack(
    [np.cos(2 * np.pi * np.arange(MODES) / MODES), np.sin(2 * np.pi * np.arange(MODES) / MODES)], 1
)
# OBJECTIVES.md's recipe trains 3000 steps; measured here (4000 samples, 50 sampler steps;
# untrained: within 0.05%, MMD 600-760x the baseline): flow within 92% at 1000 steps (95% at
# 2000; 88% at 750), smallest mode 11%, MMD 2.8x; eps within 91% at 1750 (92% at 2000; 85% at
# 1000), smallest mode 9%, MMD 2.4x
RING_BATCH, RING_SAMPLES = 512, 4000


def ring(rng, n):
    mode = rng.integers(0, MODES, n)
    return (CENTRES[mode] + SIGMA * rng.normal(size=(n, 2))).astype(np.float32)


class RingMLP(nn.Module):
    """3 x 128 SiLU MLP on ``[x, sin/cos features of t]`` (t in [0, 1000])."""

    width: int = 128

    @nn.compact
    def __call__(self, x, t, label=None, context=None):
        h = jnp.concatenate([x, timestep_embedding(t, 32)], axis=-1)
        for _ in range(3):
            h = nn.silu(nn.Dense(self.width)(h))
        return nn.Dense(2)(h)


def ring_data():
    rng = np.random.default_rng(0)
    pool = [ring(rng, RING_BATCH) for _ in range(64)]  # 32k points, drawn once

    def train(partition):
        step = 0
        while True:
            yield {"x": pool[step % len(pool)]}
            step += 1

    return Dataset(train, None, records=0, batch=RING_BATCH)


def mmd(a, b, bandwidth=1.0):
    """Biased RBF-kernel MMD^2 between sample sets ``a`` and ``b``."""

    def k(x, y):
        d = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
        return np.exp(-d / (2 * bandwidth**2)).mean()

    return k(a, a) + k(b, b) - 2 * k(a, b)


def ring_scores(samples):
    d = np.linalg.norm(samples[:, None, :] - CENTRES[None], axis=-1)  # [samples, modes]
    near = d.min(1) < 3 * SIGMA
    freq = np.bincount(d.argmin(1)[near], minlength=MODES) / len(samples)
    rng = np.random.default_rng(5)
    reference = ring(rng, 2000)
    return {
        "within": near.mean(),
        "min_mode": freq.min(),
        "mmd": mmd(samples[:2000], reference),
        "baseline": mmd(ring(rng, 2000), reference),
    }


RING_CASES = {
    # SD3's rf/lognorm(0, 1) with Euler
    "flow-euler": dict(schedule=FlowSchedule(), target="flow", sampler="euler", steps=1000),
    # DDPM's linear schedule. On the cosine one (abar_999 ~ 2e-9) the first DDIM steps'
    # x0 is only the clip (OBJECTIVES.md pitfalls): measured at 3000 steps, 96% within
    # but modes 10-16% and MMD 8x the baseline with DDIM 50, 3.2x with DDIM 200,
    # 1.3x with ancestral DDPM 250; the linear schedule: 1.7x with DDIM 50
    "eps-ddim": dict(
        schedule=DDPMSchedule(kind="linear"), target="eps", sampler="ddim", steps=1750
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RING_CASES))
def test_ring_of_gaussians(case):
    spec = RING_CASES[case]
    objective = DiffusionObjective(
        model=RingMLP(),
        schedule=spec["schedule"],
        target=spec["target"],
        input_key="x",
        sample_shape=(2,),
        clip_denoised=5.0,  # the ring lies within |x| < 4.6
    )
    trainer = Trainer(objective, optax.adam(2e-3), key=jax.random.key(0), **ONE)
    state = trainer.fit(ring_data(), steps=spec["steps"], log_every=0)
    samples = objective.sample(
        state.variables(averaged=True),
        jax.random.key(1),
        num=RING_SAMPLES,
        sampler=spec["sampler"],
        num_steps=50,
    )
    scores = ring_scores(np.asarray(samples, np.float64))
    print(case, scores)
    assert scores["within"] >= 0.85, scores
    assert scores["min_mode"] >= 0.05, scores
    assert scores["mmd"] <= 5 * scores["baseline"], scores


# ------------------------------------------------------------------- resume
CHILD = pathlib.Path(__file__).resolve().parent / "train_child.py"
STEPS, KILL_AT, EVERY = 10, 7, 3


def child(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHILD), "--objective", "diffusion", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )


@pytest.mark.slow
def test_killed_diffusion_run_resumes_bit_identical(tmp_path):
    directory = tmp_path / "run"
    common = ("--dir", directory, "--steps", STEPS, "--checkpoint-every", EVERY)
    killed = child(*common, "--kill-at", KILL_AT, "--out", tmp_path / "never.npz")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"step {KILL_AT}: loss" in killed.stdout and "child: done" not in killed.stdout
    resumed = child(
        *common, "--out", tmp_path / "resumed.npz", "--reference-out", tmp_path / "reference.npz"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = re.search(
        r"Resuming from step (\d+) \(.*\)\. Training from step \1 to 10", resumed.stdout
    )
    assert start and int(start.group(1)) in (3, 6), resumed.stdout
    got, want = np.load(tmp_path / "resumed.npz"), np.load(tmp_path / "reference.npz")
    assert sorted(got.files) == sorted(want.files)
    assert any(name.startswith("averaged") for name in want.files)
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (int(got["step"]), int(got["updates"])) == (10, 10)


# ------------------------------------------------------------------- digits
# measured: largest per-pixel mean gap 0.029, std gap 0.033 at 1250 steps (0.029 and 0.037
# at 1500; 0.028 and 0.043 at 1000; 0.038 and 0.054 at 750; untrained 0.53 and 0.37); the
# classifier agrees on 99.8% of guided samples (100% at 1500, 51% at 500, 8.6% untrained);
# 0.245 GFLOP per step
DIGIT_STEPS, DIGIT_BATCH, DIGIT_SAMPLES, DIGIT_SAMPLER_STEPS = 1250, 128, 1000, 25


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    from dew.nn.backbones import DiT

    bundle = load_digits()
    images = (bundle.images / 8.0 - 1.0).astype(np.float32)[..., None]  # [1797, 8, 8, 1]
    labels = bundle.target.astype(np.int32)

    def train(partition):
        rng = np.random.default_rng(0)
        while True:
            i = rng.integers(0, len(images), DIGIT_BATCH)
            yield {"image": images[i], "label": labels[i]}

    model = DiT(
        sample_size=8,
        patch_size=2,
        in_channels=1,
        emb_features=32,
        num_layers=2,
        num_heads=2,
        mlp_features=64,
        num_classes=10,
    )
    objective = DiffusionObjective(model=model, schedule=FlowSchedule())
    trainer = Trainer(objective, optax.adam(2e-3), key=jax.random.key(0), **ONE)
    data = Dataset(train, None, records=len(images), batch=DIGIT_BATCH)
    state = trainer.fit(data, steps=DIGIT_STEPS, log_every=0)
    real = (images[..., 0] + 1) / 2  # [1797, 8, 8] intensities in [0, 1]
    classifier = LogisticRegression(max_iter=1000).fit(real.reshape(len(real), -1), labels)
    return objective, state.variables(averaged=True), real, labels, classifier


def intensities(samples):
    return (np.clip(np.asarray(samples, np.float64)[..., 0], -1, 1) + 1) / 2


@pytest.mark.slow
def test_digits_pixel_statistics_match(digits):
    """Unguided class-conditional samples, labels drawn as often as in the data: every
    pixel's mean and std (intensity in [0, 1]) within 0.05 of the data's."""
    objective, variables, real, labels, _ = digits
    asked = labels[np.random.default_rng(1).integers(0, len(labels), DIGIT_SAMPLES)]
    samples = objective.sample(
        variables, jax.random.key(1), label=asked, num_steps=DIGIT_SAMPLER_STEPS, guidance=1.0
    )
    got = intensities(samples)
    mean_gap = np.abs(got.mean(0) - real.mean(0)).max()
    std_gap = np.abs(got.std(0) - real.std(0)).max()
    print("digits: largest per-pixel mean gap", mean_gap, "std gap", std_gap)
    assert mean_gap <= 0.05 and std_gap <= 0.05, (mean_gap, std_gap)


@pytest.mark.slow
def test_digits_guided_samples_are_the_asked_class(digits):
    objective, variables, _, _, classifier = digits
    asked = np.arange(500, dtype=np.int32) % 10
    samples = objective.sample(
        variables, jax.random.key(2), label=asked, num_steps=DIGIT_SAMPLER_STEPS, guidance=3.0
    )
    predicted = classifier.predict(intensities(samples).reshape(len(asked), -1))
    accuracy = (predicted == asked).mean()
    print("digits: classifier agrees on", accuracy, "of guided samples")
    assert accuracy >= 0.7, accuracy

"""Dew's JEPA against an independent minimal I-JEPA loop.

The loop below shares nothing with ``dew.objectives.jepa.jepa`` but the two Flax
modules it uses as layers (``dew.nn.ViT`` and ``dew.nn.ViTPredictor``): its
own block masks (numpy, drawn on the host, I-JEPA's multiblock rule with
rejection until the context keeps enough patches), its own EMA target
encoder, layer norm and smooth-L1 loss, and a plain ``optax`` step. With the
same modules, sizes, optimizer, data and budget, ``JepaObjective`` under
``Trainer`` (with its default mask sizes, which must be the loop's) must reach
the loop's linear-probe accuracy (no more than 0.05 below it) on two toy tasks
whose classes no single patch reveals, averaged over 3 seeds, both sides starting
from the same initial weights and reading the same data. The loop compiles its step once
for the 3 seeds, and the probe its feature function once per encoder.

``tools/jepa_ablation.py`` imports this module (by path) for the loop and the
toys.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

# ------------------------------------------------------------------ the toys
GRID = 6  # patches along each side


def waves(rng, n, patch=4):
    """Class = frequency of a phase advancing along the columns (random phase):
    one patch alone is uniform over the phase, so it says nothing."""
    patterns = np.random.default_rng(0).normal(size=(2, patch * patch))
    frequencies = np.array([0.5, 1.0, 1.5, 2.0])
    label = rng.integers(0, 4, n)
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1))
    column = np.arange(GRID)[None, None, :]
    theta = 2 * np.pi * frequencies[label][:, None, None] * column / GRID + phase
    theta = np.broadcast_to(theta, (n, GRID, GRID))
    patches = np.sin(theta)[..., None] * patterns[0] + np.cos(theta)[..., None] * patterns[1]
    patches = patches + 0.3 * rng.normal(size=patches.shape)  # [n, rows, cols, pixels]
    return _image(patches, patch), label.astype(np.int32)


def arrangements(rng, n, patch=3):
    """Class = how patterns repeat over the grid: along rows, along columns, in a
    checkerboard of two, or along diagonals. Each patch is one of 8 random
    patterns (uniform in every class), so only relations between patches tell."""
    patterns = np.random.default_rng(1).normal(size=(8, patch * patch))
    label = rng.integers(0, 4, n)
    r, c = np.arange(GRID)[:, None], np.arange(GRID)[None, :]
    index = np.stack(
        [
            np.broadcast_to(r, (GRID, GRID)),  # each row one pattern
            np.broadcast_to(c, (GRID, GRID)),  # each column one pattern
            (r + c) % 2,  # a checkerboard of two
            (r - c) % GRID,  # each diagonal one pattern
        ]
    )  # [4, rows, cols]: which of the image's own patterns sits where
    chosen = np.argsort(rng.uniform(size=(n, 8)), axis=1)[:, :GRID]  # [n, 6] distinct patterns
    which = np.take_along_axis(chosen, index[label].reshape(n, -1), axis=1)
    patches = patterns[which].reshape(n, GRID, GRID, -1)
    patches = patches + 0.3 * rng.normal(size=patches.shape)
    return _image(patches, patch), label.astype(np.int32)


def _image(patches, patch):
    n = len(patches)
    image = patches.reshape(n, GRID, GRID, patch, patch).transpose(0, 1, 3, 2, 4)
    return image.reshape(n, GRID * patch, GRID * patch, 1).astype(np.float32)


TOYS = {"waves": (waves, 4), "arrangements": (arrangements, 3)}


# --------------------------------------------------------------- the probe
def ridge_probe(train_x, train_y, test_x, test_y, ridge=1e-3) -> float:
    """Standardised closed-form ridge regression to one-hot labels, then argmax."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    a = np.c_[(train_x - mean) / std, np.ones(len(train_x))]
    b = np.c_[(test_x - mean) / std, np.ones(len(test_x))]
    y = np.eye(int(train_y.max()) + 1)[train_y]
    penalty = ridge * len(a) * np.eye(a.shape[1])
    penalty[-1, -1] = 0
    w = np.linalg.solve(a.T @ a + penalty, a.T @ y)
    return float(np.mean((b @ w).argmax(1) == test_y))


# ------------------------------------------------------- the minimal loop
@dataclasses.dataclass(frozen=True)
class Setup:
    """What both sides train with."""

    encoder: object
    predictor: object
    steps: int
    batch: int
    learning_rate: float = 1e-3
    weight_decay: float = 0.04
    warmup: int = 0  # linear warm-up updates, then constant (or cosine)
    cosine: bool = False  # after the warm-up, cosine decay to 1% of learning_rate
    momentum: tuple[float, float] = (0.996, 1.0)
    num_targets: int = 2
    target_scale: tuple[float, float] = (0.15, 0.2)
    target_aspect: tuple[float, float] = (0.75, 1.5)
    context_scale: tuple[float, float] = (0.85, 1.0)
    context_keep: int = 0  # context patches encoded (fixed, as a static shape)
    target_keep: int = 0  # patches predicted per target block

    def optimizer(self):
        lr = self.learning_rate
        if self.cosine:
            lr = optax.warmup_cosine_decay_schedule(0.0, lr, self.warmup, self.steps, lr / 100)
        elif self.warmup:
            lr = optax.linear_schedule(0.0, lr, self.warmup)
        return optax.adamw(lr, weight_decay=self.weight_decay)


def _block(rng, height, width, scale, aspect):
    """I-JEPA's ``_sample_block_size`` and placement: a boolean ``[height * width]``."""
    s, a = rng.uniform(*scale), rng.uniform(*aspect)
    area = height * width * s
    rows = min(max(int(round(math.sqrt(area * a))), 1), height - 1)
    cols = min(max(int(round(math.sqrt(area / a))), 1), width - 1)
    top, left = rng.integers(0, height - rows + 1), rng.integers(0, width - cols + 1)
    mask = np.zeros((height, width), bool)
    mask[top : top + rows, left : left + cols] = True
    return mask.reshape(-1)


def reference_masks(rng, setup: Setup, height, width, batch):
    """``(context [batch, K], targets [batch, n, T])``: per example, ``n`` target
    blocks and a context block minus every target, redrawn until the context
    keeps ``context_keep`` patches and every block ``target_keep``; then a random
    subset of that size of each (the reference collator truncates instead)."""
    context = np.zeros((batch, setup.context_keep), np.int32)
    targets = np.zeros((batch, setup.num_targets, setup.target_keep), np.int32)
    for b in range(batch):
        while True:
            blocks = [
                _block(rng, height, width, setup.target_scale, setup.target_aspect)
                for _ in range(setup.num_targets)
            ]
            if min(m.sum() for m in blocks) < setup.target_keep:
                continue
            free = _block(rng, height, width, setup.context_scale, (1.0, 1.0))
            free &= ~np.any(blocks, axis=0)
            if free.sum() >= setup.context_keep:
                break
        context[b] = np.sort(rng.choice(np.flatnonzero(free), setup.context_keep, replace=False))
        for t, m in enumerate(blocks):
            targets[b, t] = np.sort(rng.choice(np.flatnonzero(m), setup.target_keep, replace=False))
    return context, targets


_STEPS: dict[int, tuple[Setup, object]] = {}  # one compiled step per setup, shared by seeds


def _reference_step(setup: Setup):
    """The loop's jitted update ``(params, target, opt_state, i, x, ctx, tgt)``."""
    if id(setup) in _STEPS:
        return _STEPS[id(setup)][1]
    enc, pred = setup.encoder, setup.predictor
    optimizer = setup.optimizer()
    n, steps = setup.num_targets, setup.steps

    def loss_fn(params, target, x, ctx, tgt):
        h = enc.apply({"params": target}, x)
        h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-6)
        h = jax.lax.stop_gradient(h)
        z_ctx = enc.apply({"params": params["encoder"]}, x, ctx)
        loss = 0.0
        for t in range(n):
            z = pred.apply({"params": params["predictor"]}, z_ctx, ctx, tgt[:, t])
            d = z - jnp.take_along_axis(h, tgt[:, t, :, None], axis=1)
            loss += jnp.mean(jnp.where(jnp.abs(d) < 1, 0.5 * d * d, jnp.abs(d) - 0.5))
        return loss / n

    @jax.jit
    def step(params, target, opt_state, i, x, ctx, tgt):
        loss, grads = jax.value_and_grad(loss_fn)(params, target, x, ctx, tgt)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        m0, m1 = setup.momentum
        m = m0 + (m1 - m0) * i / steps
        target = jax.tree.map(lambda a, p: m * a + (1 - m) * p, target, params["encoder"])
        return params, target, opt_state, loss

    step.optimizer = optimizer
    _STEPS[id(setup)] = (setup, step)
    return step


def train_reference(setup: Setup, data, seed: int, initial: dict | None = None):
    """``(initial encoder params, context encoder params, losses)`` after
    ``setup.steps`` updates on ``data(rng, batch) -> images``.

    initial: ``{'encoder': ..., 'predictor': ...}`` to start from (the test gives
      Dew's run's own initial weights, so the two sides differ only in what they
      implement: masks, moving average, loss); None = initialised here from ``seed``."""
    enc, pred = setup.encoder, setup.predictor
    height, width = enc.grid.shape
    if initial is None:
        k_enc, k_pred = jax.random.split(jax.random.key(seed))
        pixels = jnp.zeros((1, *enc.grid.pixel_shape(enc.num_channels)), jnp.float32)
        initial = {"encoder": enc.init(k_enc, pixels)["params"]}
        context = jnp.zeros((1, setup.context_keep, enc.emb_features))
        positions = jnp.zeros((1, setup.context_keep), jnp.int32)
        initial["predictor"] = pred.init(
            k_pred, context, positions, jnp.zeros((1, setup.target_keep), jnp.int32)
        )["params"]
    params = jax.tree.map(jnp.asarray, nn.unbox(initial))
    target = params["encoder"]
    step = _reference_step(setup)
    opt_state = step.optimizer.init(params)
    initial = params["encoder"]
    data_rng, mask_rng = np.random.default_rng(seed + 1000), np.random.default_rng(seed + 2000)
    losses = []
    for i in range(setup.steps):
        x = jnp.asarray(data(data_rng, setup.batch)[0])
        ctx, tgt = reference_masks(mask_rng, setup, height, width, setup.batch)
        params, target, opt_state, loss = step(params, target, opt_state, i, x, ctx, tgt)
        losses.append(loss)
    return initial, params["encoder"], np.asarray(jax.device_get(losses))


# ------------------------------------------------------------------ Dew's side
@dataclasses.dataclass(frozen=True)
class DewRun:
    """What :func:`train_dew` gives: every trained role's initial params, and the
    encoder's context (trained) and target (moving-average) params."""

    initial_params: dict
    context: dict
    target: dict

    @property
    def initial(self) -> dict:
        """The encoder's initial params."""
        return self.initial_params["encoder"]


def dew_objective(setup: Setup, **objective_options):
    """``setup`` as a ``JepaObjective``: its modules, masks, momentum and length."""
    from dew.objectives.jepa.jepa import JepaObjective
    from dew.objectives.jepa.masks import MultiBlock

    masks = MultiBlock(
        num_targets=setup.num_targets,
        target_scale=setup.target_scale,
        target_aspect=setup.target_aspect,
        context_scale=setup.context_scale,
        min_keep=min(4, setup.context_keep),
    )
    objective_options = {"momentum": setup.momentum, **objective_options}
    return JepaObjective(
        encoder=setup.encoder,
        predictor=setup.predictor,
        planned_updates=setup.steps,
        masks=masks,
        **objective_options,
    )


def train_dew(setup: Setup, data, seed: int, **objective_options) -> DewRun:
    """The same through ``JepaObjective`` and ``Trainer``."""
    from dew.data import Dataset
    from dew.train import MeshSpec, Trainer

    objective = dew_objective(setup, **objective_options)
    layout = objective.layout  # Dew's default sizes are the loop's
    assert (layout.context_keep, layout.target_keep) == (setup.context_keep, setup.target_keep)

    def train(partition):
        rng = np.random.default_rng(seed + 1000)
        while True:
            yield {"image": data(rng, setup.batch)[0]}

    trainer = Trainer(
        objective,
        setup.optimizer(),
        key=jax.random.key(seed),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        progress=False,
    )
    initial = jax.device_get(trainer.init_state())
    state = trainer.fit(Dataset(train, None, records=0, batch=setup.batch), steps=setup.steps)
    return DewRun(
        initial_params=nn.unbox(initial.params),
        context=jax.device_get(state.params["encoder"]),
        target=jax.device_get(state.averaged["encoder"]),
    )


_POOLED: dict[int, tuple[object, object]] = {}  # one compiled feature function per encoder


def probe_accuracy(encoder, params, data, seed=0, n_train=512, n_test=512) -> float:
    """Linear probe on mean-pooled features of fresh labelled examples."""
    params = nn.unbox(params)
    if id(encoder) not in _POOLED:
        pooled = jax.jit(lambda p, x: encoder.apply({"params": p}, x).mean(axis=1))
        _POOLED[id(encoder)] = (encoder, pooled)
    apply = _POOLED[id(encoder)][1]
    rng = np.random.default_rng(10_000 + seed)
    (xa, ya), (xb, yb) = data(rng, n_train), data(rng, n_test)
    fa, fb = np.asarray(apply(params, xa), np.float64), np.asarray(apply(params, xb), np.float64)
    return ridge_probe(fa, ya, fb, yb)


# --------------------------------------------------------------------- tests
def toy_setup(toy: str) -> Setup:
    """Tiny sizes (a few seconds a run on two CPU cores), the same on both sides."""
    from dew.nn import ViT, ViTPredictor

    patch = TOYS[toy][1]
    grid = dict(image_size=GRID * patch, patch_size=patch, num_channels=1)
    grid["position_embedding"] = "learned"
    return Setup(
        encoder=ViT(emb_features=32, num_layers=2, num_heads=2, mlp_features=64, **grid),
        predictor=ViTPredictor(
            encoder_features=32, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, **grid
        ),
        steps=300,
        batch=32,
        warmup=30,  # warm-up + cosine on both sides, as the examples train
        cosine=True,
        momentum=(0.99, 1.0),  # a short run: the EMA must not lag (OBJECTIVES.md section 5)
        num_targets=2,
        context_keep=18,
        target_keep=4,
    )


@pytest.mark.slow
@pytest.mark.parametrize("toy", sorted(TOYS))
def test_dew_matches_an_independent_ijepa_loop(toy):
    data = TOYS[toy][0]
    setup = toy_setup(toy)
    got, want, before = [], [], []
    for seed in range(3):
        dew = train_dew(setup, data, seed)
        got.append(probe_accuracy(setup.encoder, dew.context, data, seed))
        # the loop starts from the same weights and reads the same data stream
        initial, trained, losses = train_reference(setup, data, seed, dew.initial_params)
        assert np.all(np.isfinite(losses)) and losses[-20:].mean() < losses[:20].mean()
        want.append(probe_accuracy(setup.encoder, trained, data, seed))
        before.append(probe_accuracy(setup.encoder, initial, data, seed))
    # the loop learns (chance 0.25): one that learned nothing would make the match vacuous
    assert np.mean(want) >= np.mean(before) + 0.05, (before, want)
    # Dew learns at least as well as the loop, to 0.05. Not two-sided: single seeds
    # spread by about 0.08 and the sides' 3-seed means by up to 0.09 in Dew's favour on
    # some CPUs (waves, docs/jepa.md), the same code and seeds 0.02 on others.
    assert np.mean(got) >= np.mean(want) - 0.05, (got, want)

"""I-JEPA on a toy image task, then a linear probe against a random-initialised encoder.

Each 24 x 24 image is 6 x 6 patches; a patch is ``sin(theta) U + cos(theta) V``
plus noise for two fixed 4 x 4 patterns, with ``theta`` advancing along the
columns at one of four frequencies (the label) from a random phase. One patch
alone says nothing about the frequency, so a random encoder's pooled features
probe near chance; predicting hidden blocks of patches from the others teaches
the encoder the frequency. Runs in about a minute on two CPU cores.

From the repository root (``uv run`` installs what it needs; nothing besides Dew):

    uv run --locked python examples/jepa_waves.py [--steps 500]

Elsewhere: ``pip install dew-jax`` (packages/dew/README.md), then
``python examples/jepa_waves.py``.
"""

import argparse
import tempfile

import jax
import numpy as np
import optax

from dew.data import Dataset
from dew.nn import ViT, ViTPredictor
from dew.objectives.jepa.jepa import JepaObjective, probe
from dew.objectives.jepa.masks import MultiBlock
from dew.sampling import FeatureExtractor
from dew.train import MeshSpec, Trainer

GRID, PATCH, BATCH = 6, 4, 64
PATTERNS = np.random.default_rng(0).normal(size=(2, PATCH * PATCH)).astype(np.float32)
FREQUENCIES = np.array([0.5, 1.0, 1.5, 2.0])  # cycles over the 6 columns; the label


def waves(rng, n):
    label = rng.integers(0, len(FREQUENCIES), n)
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1))
    column = np.arange(GRID)[None, None, :]
    theta = np.broadcast_to(
        2 * np.pi * FREQUENCIES[label][:, None, None] * column / GRID + phase, (n, GRID, GRID)
    )
    patches = np.sin(theta)[..., None] * PATTERNS[0] + np.cos(theta)[..., None] * PATTERNS[1]
    patches = patches + 0.3 * rng.normal(size=patches.shape)  # [n, rows, columns, pixels]
    image = patches.reshape(n, GRID, GRID, PATCH, PATCH).transpose(0, 1, 3, 2, 4)
    return image.reshape(n, GRID * PATCH, GRID * PATCH, 1).astype(np.float32), label


def dataset(batch):
    def train(partition):
        rng = np.random.default_rng(1)
        while True:
            image, label = waves(rng, batch)
            yield {"image": image, "label": label}

    def val(partition):
        rng = np.random.default_rng(2)
        for _ in range(4):
            image, label = waves(rng, 128)
            yield {"image": image, "label": label}

    return Dataset(train, val, records=0, batch=batch)


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=500)
steps = parser.parse_args().steps

grid = dict(image_size=GRID * PATCH, patch_size=PATCH, num_channels=1, position_embedding="learned")
encoder = ViT(emb_features=64, num_layers=2, num_heads=4, mlp_features=128, **grid)
predictor = ViTPredictor(
    encoder_features=64, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, **grid
)
objective = JepaObjective(
    encoder=encoder,
    predictor=predictor,
    planned_updates=steps,
    momentum=(0.99, 1.0),  # short run: a slower EMA would still lag at the end
    masks=MultiBlock(num_targets=2, min_keep=4),  # 2 target blocks on a 6 x 6 grid
)
trainer = Trainer(
    objective,
    optax.adamw(1e-3, weight_decay=0.04),
    key=jax.random.key(0),
    mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
)
probe_data = dataset(128)
initial = trainer.init_state()
baseline = probe(objective.feature_extractor(initial, encoder="context"), probe_data)

state = trainer.fit(dataset(BATCH), steps=steps, log_every=100)
context = probe(objective.feature_extractor(state, encoder="context"), probe_data)
target = probe(objective.feature_extractor(state, encoder="target"), probe_data)
print(f"linear probe accuracy: random-init encoder {baseline:.3f}")
print(f"linear probe accuracy: context encoder {context:.3f}, target encoder {target:.3f}")

with tempfile.TemporaryDirectory() as directory:
    objective.inference_task(state).save(directory)  # the target encoder, mean-pooled
    features = FeatureExtractor.load(directory)(waves(np.random.default_rng(3), 4)[0])
print(f"features of 4 images: {features.shape}")

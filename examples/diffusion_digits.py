"""Class-conditional diffusion on scikit-learn's 8 x 8 digits with a tiny DiT.

The 1797 bundled digits (``sklearn.datasets.load_digits``; scikit-learn and
pillow come with the ``dew-jax[examples]`` extra) become uint8 images ``[8, 8, 1]``; the DiT
cuts them into 2 x 2 patches, reads the digit's class, and is trained by flow
matching (rectified flow, logit-normal times) with 10% condition dropout, so
classifier-free guidance works at sampling time. The trainer writes a preview
grid every ``--steps // 4`` steps; at the end the exported pipeline (EMA
weights) draws four samples of every digit with guidance 3 into
``samples.png`` and saves itself. A few minutes on two CPU cores.

From the repository root (``uv run`` installs what it needs: the workspace's dev
group holds ``dew-jax[examples]``):

    uv run --locked python examples/diffusion_digits.py [--steps 2000] [--out runs/diffusion_digits]

Elsewhere: ``pip install "dew-jax[examples]"`` (packages/dew/README.md), then
``python examples/diffusion_digits.py``.
"""

import argparse
import pathlib

import jax
import numpy as np
import optax
from PIL import Image
from sklearn.datasets import load_digits

from dew.data import Dataset
from dew.nn.backbones import DiT
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import FlowSchedule, Pretrained, sample_grid
from dew.train import MeshSpec, Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2000)
parser.add_argument("--out", default="runs/diffusion_digits")
args = parser.parse_args()
out = pathlib.Path(args.out)

digits = load_digits()
images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]  # [n, 8, 8, 1]
labels = digits.target.astype(np.int32)
BATCH = 64


def train(partition):
    rng = np.random.default_rng(partition.index)
    while True:
        rows = rng.choice(len(images), BATCH, replace=False)
        yield {"image": images[rows], "label": labels[rows]}


model = DiT(
    sample_size=8,
    patch_size=2,
    in_channels=1,
    emb_features=64,
    num_layers=4,
    num_heads=4,
    mlp_features=256,
    num_classes=10,
)
objective = DiffusionObjective(
    model=model, schedule=FlowSchedule(), guidance=3.0, preview_count=20, preview_steps=20
)
warmup = min(100, args.steps // 2)
trainer = Trainer(
    objective,
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 2e-3, warmup, args.steps), b2=0.99),
    key=jax.random.key(0),
    mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
    run_dir=str(out),
    progress=False,
)
state = trainer.fit(
    Dataset(train=train, val=None, records=len(images), batch=BATCH),
    steps=args.steps,
    log_every=max(args.steps // 10, 1),
    eval_every=max(args.steps // 4, 1),
)

pipe = objective.inference_task(state)  # ClassToImage over the EMA weights
samples = pipe(list(range(10)) * 4, num_steps=30, seed=0)  # [40, 8, 8, 1] uint8
grid = sample_grid(samples, columns=10)  # [32, 80, 1]: a row per seed, a column per digit
Image.fromarray(grid[..., 0]).resize((320, 128), Image.Resampling.NEAREST).save(out / "samples.png")
pipe.save(out / "pipeline")
reloaded = Pretrained.load(out / "pipeline").pipeline()
assert (reloaded(list(range(10)) * 4, num_steps=30, seed=0) == samples).all()
print(f"pixel mean {samples.mean() / 255:.3f} (data {images.mean() / 255:.3f}), "
      f"std {samples.std() / 255:.3f} (data {images.std() / 255:.3f})")  # fmt: skip
print(f"wrote {out / 'samples.png'} and the pipeline {out / 'pipeline'}")

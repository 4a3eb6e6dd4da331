"""A moving-square video toy: VideoDiT + DiffusionObjective (flow matching) trained by
the Trainer on 4-frame 8x8 clips of a 2x2 square on rows 3-4 moving one pixel right per
frame from a random start column.

Sampled clips (through ``objective.inference_task(state)``, the EMA weights) must show a
square that moves as the data's does: the centroid's displacement from the first to
the last frame is 3 pixels right in every training clip; most samples must move
1.5..4.5 pixels right and not vertically, and most within 0.75 of 3. That last share
is compared with a control made of the model's own frames: the first frame of one
sample with the last three of another keeps every frame's look (the start columns a
model that drew frames alone would get right) but not the motion of one clip.
The preview the trainer wrote (an animated GIF) must decode to the objective's
preview samples.
"""

import jax
import numpy as np
import optax
import pytest
from PIL import Image

from dew.data import Dataset
from dew.nn import models
from dew.objectives.contract.objective import EMA
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import ClassToVideo, FlowSchedule
from dew.train import MeshSpec, Trainer
from dew.train.step import Stream, microbatch_key

FRAMES, SIZE, SQUARE, STEPS, BATCH = 4, 8, 2, 1000, 32

pytestmark = pytest.mark.slow


def clips(rng, rows):
    """``uint8 [rows, FRAMES, SIZE, SIZE, 1]``: a white square on rows 3-4 from a random
    start column (0..3), one pixel right per frame."""
    x0 = rng.integers(0, SIZE - SQUARE - FRAMES + 2, rows)
    y0 = np.full(rows, 3)
    cells = np.arange(SIZE)
    left = x0[:, None] + np.arange(FRAMES)[None]  # [rows, frames]
    in_x = (cells >= left[..., None]) & (cells < left[..., None] + SQUARE)  # [rows, F, W]
    in_y = (cells >= y0[:, None]) & (cells < y0[:, None] + SQUARE)  # [rows, H]
    video = in_y[:, None, :, None] & in_x[:, :, None, :]  # [rows, F, H, W]
    return (255 * video[..., None]).astype(np.uint8)


def centroid_shift(videos):
    """``(dx, dy)`` per clip: the centroid of the bright pixels (>= 128) of the last
    frame minus the first's (the threshold keeps a faint haze from pulling it)."""
    v = (videos[..., 0] >= 128).astype(np.float64)  # [rows, F, H, W]
    ys, xs = np.mgrid[:SIZE, :SIZE]

    def centre(frame):  # [rows, H, W] -> ([rows], [rows])
        mass = frame.sum((1, 2)) + 1e-9
        return (frame * xs).sum((1, 2)) / mass, (frame * ys).sum((1, 2)) / mass

    (x_first, y_first), (x_last, y_last) = centre(v[:, 0]), centre(v[:, -1])
    return x_last - x_first, y_last - y_first


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    def train(partition):
        rng = np.random.default_rng(partition.index)
        while True:
            yield {"video": clips(rng, BATCH)}

    model = models.build(
        "video_dit", sample_size=SIZE, patch_size=2, in_channels=1, emb_features=32,
        num_layers=2, num_heads=4, mlp_features=64, num_frames=FRAMES,
    )  # fmt: skip
    objective = DiffusionObjective(
        model=model, schedule=FlowSchedule(), ema=EMA(decay=0.99), preview_count=4, preview_steps=10
    )
    directory = tmp_path_factory.mktemp("video")
    trainer = Trainer(
        objective,
        optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, STEPS)),
        key=jax.random.key(0),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        run_dir=str(directory),
        progress=False,
    )
    data = Dataset(train=train, val=None, records=10**6, batch=BATCH)
    state = trainer.fit(data, steps=STEPS, log_every=STEPS, eval_every=STEPS)
    return objective, state, directory


def test_the_data_moves_three_pixels_right():
    dx, dy = centroid_shift(clips(np.random.default_rng(1), 64))
    np.testing.assert_allclose(dx, 3.0, atol=1e-9)
    np.testing.assert_allclose(dy, 0.0, atol=1e-9)


def test_sampled_squares_move_as_the_data_does(run):
    objective, state, _ = run
    pipe = objective.inference_task(state)
    assert isinstance(pipe, ClassToVideo)
    # 64 samples: the tight-vs-control comparison below is a difference of two
    # proportions, whose noise at 32 samples (one sample = 0.03) was its margin
    videos = pipe(count=64, num_steps=20, seed=1)
    assert videos.shape == (64, FRAMES, SIZE, SIZE, 1) and videos.dtype == np.uint8
    dx, dy = centroid_shift(videos)
    # measured (1000 steps, per-row draws): 40 of 64 within 0.75 of 3 against 23 of
    # 64 for the control (with 32 samples, before the per-row draws: 25 against 18)
    assert 2.0 <= np.median(dx) <= 4.0, dx
    assert np.mean((dx >= 1.5) & (dx <= 4.5)) >= 0.75, dx
    assert np.median(np.abs(dy)) <= 0.5, dy
    tight = np.mean(np.abs(dx - 3) <= 0.75)
    other = np.random.default_rng(0).permutation(len(videos))
    control, _ = centroid_shift(np.concatenate([videos[:, :1], videos[other, 1:]], axis=1))
    assert tight >= 0.6 and tight >= np.mean(np.abs(control - 3) <= 0.75) + 0.1, (dx, control)
    bright = (videos[:, [0, -1]] >= 128).sum((2, 3, 4))  # [64, 2]
    assert np.all(np.median(bright, axis=0) >= 2), bright  # a square (4 pixels) in both


def test_the_preview_gif_holds_the_preview_samples(run):
    objective, state, directory = run
    path = directory / "previews" / f"step_{STEPS:08d}.gif"
    with Image.open(path) as gif:
        frames = []
        for index in range(gif.n_frames):
            gif.seek(index)
            frames.append(np.asarray(gif.convert("L")))
    key = microbatch_key(state.key, state.step, Stream.PREVIEW)
    expected = objective.preview(state.variables(averaged=True), key)
    assert expected.shape == (FRAMES, 2 * SIZE, 2 * SIZE, 1)  # 2 x 2 clips of 4 frames
    np.testing.assert_array_equal(np.stack(frames)[..., None], expected)  # grey GIF: exact

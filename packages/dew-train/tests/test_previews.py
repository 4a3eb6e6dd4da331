"""Image and video previews: written into the run directory (PNG, GIF) and to
TensorBoard, read back with pillow and compared with the arrays the objective
returned."""

from __future__ import annotations

import io
import itertools
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from PIL import Image

from dew.data import Dataset
from dew.objectives import Objective
from dew.train import Trainer

RNG = np.random.default_rng(0)
PICTURES = {
    "rgb image": RNG.integers(0, 256, (6, 10, 3), dtype=np.uint8),
    "grey video": RNG.integers(0, 256, (4, 5, 7, 1), dtype=np.uint8),
}


class Pictures(Objective):
    """A one-parameter quadratic whose preview is a fixed picture per step (the
    step is read from the key, so each preview differs)."""

    model = None

    def __init__(self, picture):
        self.picture = picture

    def init(self, key):
        return {"params": {"policy": {"w": jnp.zeros(2)}}}

    def loss(self, variables, batch, step):
        return jnp.mean((batch["x"] - variables["params"]["policy"]["w"]) ** 2), {}

    def preview(self, variables, key):
        return self.picture


def read_images(path) -> list[tuple[str, int, np.ndarray]]:
    """``(tag, step, pixels)`` of every image summary in a TensorBoard event file."""
    from tensorboardX.proto import event_pb2

    out = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            event = event_pb2.Event.FromString(f.read(length))
            f.read(4)
            for value in event.summary.value:
                if value.HasField("image"):
                    image = Image.open(io.BytesIO(value.image.encoded_image_string))
                    out.append((value.tag, event.step, np.asarray(image)))
    return out


@pytest.mark.parametrize("kind", sorted(PICTURES))
def test_pixel_previews_are_files_and_tensorboard_images(tmp_path, kind, capsys):
    picture = PICTURES[kind]
    rows = np.ones((8, 2), np.float32)
    data = Dataset(train=lambda p: itertools.repeat({"x": rows}), val=None, records=8, batch=8)
    trainer = Trainer(
        Pictures(picture), optax.sgd(0.1), key=jax.random.key(0), run_dir=tmp_path, progress=False
    )
    trainer.fit(data, steps=2, eval_every=2)
    suffix = ".png" if picture.ndim == 3 else ".gif"
    path = tmp_path / "previews" / f"step_00000002{suffix}"
    assert f"preview step 2: uint8 {'x'.join(map(str, picture.shape))}, {path}" in (
        capsys.readouterr().out
    )
    with Image.open(path) as image:
        frames = []
        for index in range(getattr(image, "n_frames", 1)):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB" if picture.shape[-1] == 3 else "L")))
    frames = np.stack(frames).reshape((-1, *picture.shape[-3:]))
    # exact: PNG is lossless, and a grey GIF's 256-entry palette holds every level
    np.testing.assert_array_equal(frames.reshape(picture.shape), picture)

    (events,) = (tmp_path / "tensorboard").iterdir()
    ((tag, step, shown),) = read_images(events)
    assert (tag, step) == ("preview", 2)
    if picture.ndim == 4:  # the frames side by side
        picture = np.concatenate(list(picture), axis=1)
    shown = shown[..., :1] if picture.shape[-1] == 1 else shown[..., :3]
    np.testing.assert_array_equal(shown.reshape(picture.shape), picture)

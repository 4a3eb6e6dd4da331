"""examples/diffusion_digits.py runs end to end (a few steps): previews, the sample grid
and a saved pipeline that loads back to the same samples (the example asserts that)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_example_writes_previews_the_grid_and_the_pipeline(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples/diffusion_digits.py"), "--steps", "8",
         "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == f"wrote {tmp_path / 'samples.png'} and the pipeline {tmp_path / 'pipeline'}"
    # previews every 8 // 4 = 2 steps: 20 samples in a 5 x 4 grid of 8 x 8 digits
    for step in (2, 4, 6, 8):
        with Image.open(tmp_path / "previews" / f"step_{step:08d}.png") as preview:
            assert preview.size == (40, 32) and preview.mode == "L"
    with Image.open(tmp_path / "samples.png") as grid:
        pixels = np.asarray(grid)
    assert pixels.shape == (128, 320)  # 4 x 10 digits, 4x nearest-neighbour upscaled
    np.testing.assert_array_equal(pixels[::4, ::4].repeat(4, 0).repeat(4, 1), pixels)
    assert (tmp_path / "pipeline" / "dew_config.json").exists()

"""Previews that are pictures: an objective's ``preview`` returning uint8 pixels is
written into the run directory (PNG for an image, an animated GIF for a video)
and logged to TensorBoard as an image.

Pixels are ``uint8 [height, width, channels]`` (one image; a grid of samples is
one image) or ``uint8 [frames, height, width, channels]`` (a video), with 1
(grey) or 3 (RGB) channels. Files are ``previews/step_{step:08d}.png`` (or
``.gif``) under the run directory. A grey GIF is exact; an RGB GIF holds at most
256 colours a frame (pillow's adaptive palette), so more colourful frames are
quantized. TensorBoard gets the image, or a video's frames side by side. Writing needs
pillow, the ``[images]`` extra (``pip install "dew-train[images]"``).

A preview that is text (a language model's sample) is written as
``previews/step_{step:08d}.txt`` (UTF-8) and logged to TensorBoard as text.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

DIRECTORY = "previews"
FRAME_MILLISECONDS = 125


def as_pixels(sample: Any) -> np.ndarray | None:
    """``sample`` as a uint8 image or video array, or None when it is not pixels
    (text, a dict, a float array)."""
    if not hasattr(sample, "shape") or not hasattr(sample, "dtype"):
        return None
    pixels = np.asarray(sample)
    if pixels.dtype != np.uint8 or pixels.ndim not in (3, 4) or pixels.shape[-1] not in (1, 3):
        return None
    return pixels


def _pil_image():
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError(
            "writing an image preview needs pillow, which is not installed: pip install "
            "'dew-train[images]'; with uv: uv add 'dew-train[images]' in your project, or "
            "uv sync --all-packages --extra images in a Dew checkout"
        ) from error
    return Image


def _frame(Image, pixels: np.ndarray):
    return Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)


def write_preview(run_dir: str, step: int, pixels: np.ndarray) -> str:
    """Write ``pixels`` (see the module docstring) under ``run_dir``; returns the path."""
    Image = _pil_image()
    directory = os.path.join(run_dir, DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    if pixels.ndim == 3:
        path = os.path.join(directory, f"step_{step:08d}.png")
        _frame(Image, pixels).save(path)
        return path
    path = os.path.join(directory, f"step_{step:08d}.gif")
    frames = [_frame(Image, frame) for frame in pixels]
    # optimize=False and disposal 1: every frame is stored whole, read back as written
    frames[0].save(
        path,
        save_all=True,
        append_images=frames[1:],
        duration=FRAME_MILLISECONDS,
        loop=0,
        optimize=False,
        disposal=1,
    )
    return path


def write_text_preview(run_dir: str, step: int, text: str) -> str:
    """Write a text preview under ``run_dir``; returns the path."""
    directory = os.path.join(run_dir, DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:08d}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def tensorboard_image(pixels: np.ndarray) -> np.ndarray:
    """``[height, width, channels]`` for TensorBoard: the image, or a video's frames
    side by side along the width."""
    if pixels.ndim == 3:
        return pixels
    frames, height, width, channels = pixels.shape
    return pixels.transpose(1, 0, 2, 3).reshape(height, frames * width, channels)

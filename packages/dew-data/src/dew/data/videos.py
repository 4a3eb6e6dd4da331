"""``Videos``: clips of local video files (numpy arrays, GIFs) as uint8 batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dew.data._corpus import expand_paths
from dew.data.dataset import Dataset
from dew.data.images import fit_image
from dew.data.records import RecordError, SkipCount, from_records, held_out_count

SUFFIXES = (".npy", ".gif")


def _npy_header(path: str) -> tuple[int, int, int]:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(
            f"a clip array must be uint8 [frames, height, width, 3], got "
            f"{array.dtype} {list(array.shape)}"
        )
    frames, height, width, _ = array.shape
    return frames, height, width


def _gif_header(path: str) -> tuple[int, int, int]:
    from PIL import Image  # the [hf] extra

    with Image.open(path) as image:
        if image.format != "GIF":
            raise ValueError(f"not a GIF (PIL reads it as {image.format})")
        width, height = image.size
        return getattr(image, "n_frames", 1), height, width


def read_header(path: str) -> tuple[int, int, int]:
    """``(frames, height, width)`` of a clip file, or :class:`RecordError` naming it."""
    try:
        return _npy_header(path) if path.endswith(".npy") else _gif_header(path)
    except (OSError, ValueError, SyntaxError) as error:
        raise RecordError(path, f"{type(error).__name__}: {error}") from error


def read_frames(path: str, frame_indices: range) -> np.ndarray:
    """Frames ``frame_indices`` of a clip file: uint8 ``[frames, height, width, 3]``."""
    if path.endswith(".npy"):
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        return np.array(array[frame_indices.start : frame_indices.stop : frame_indices.step])
    from PIL import Image

    with Image.open(path) as image:
        frames = []
        for index in frame_indices:
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB"), np.uint8))
    return np.stack(frames)


class _Clips:
    """Clips ``(file, first frame)``, read and resized on demand."""

    def __init__(self, clips: list[tuple[str, int]], *, frames: int, stride: int, size: int | None):
        self._clips = clips
        self._frames, self._stride, self._size = frames, stride, size

    def __len__(self) -> int:
        return len(self._clips)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        path, first = self._clips[index]
        indices = range(first, first + (self._frames - 1) * self._stride + 1, self._stride)
        try:
            video = read_frames(path, indices)
            if self._size is not None:
                from PIL import Image

                video = np.stack([fit_image(Image.fromarray(f), self._size) for f in video])
        except (OSError, ValueError, EOFError, SyntaxError) as error:
            raise RecordError(
                f"{path} (frames {indices.start}..{indices[-1]})",
                f"{type(error).__name__}: {error}",
            ) from error
        return {"video": video}


@dataclasses.dataclass(frozen=True)
class Videos:
    """Fixed-length clips cut from local video files.

    A file with ``T`` frames gives the clips starting at frames 0, ``hop``,
    ``2 * hop``, ... that fit; a clip takes ``frames`` frames, ``stride``
    apart (it spans ``(frames - 1) * stride + 1`` frames). Batches hold
    ``"video"``: uint8 ``[rows, frames, height, width, 3]`` in 0..255.

    paths: clip files, directories of them, glob patterns, or a list: ``.npy``
      arrays (uint8 ``[T, height, width, 3]``, read memory-mapped) and ``.gif``
      (decoded with pillow, the ``[hf]`` extra).
    frames: frames per clip.
    stride: frames between consecutive frames of a clip (1 = every frame).
    hop: frames between the starts of consecutive clips of a file; None =
      the clip's span (clips do not overlap).
    size: resize (shorter side) and centre-crop every frame to ``size x size``
      pixels; None = keep frames as they are (all files must then share one
      height and width).
    val_fraction: share of the clips (the last ones, in file order) held out
      for validation; 0 = no validation set.
    seed: shuffle seed of the training clips.
    skip_errors: skip unreadable files and clips (counted in a ``dew.data``
      warning) instead of stopping with an error naming them.
    read_threads: Grain threads decoding ahead (0 = in the caller's thread).
    prefetch: batches decoded ahead.
    """

    paths: Any
    _: dataclasses.KW_ONLY
    frames: int = 8
    stride: int = 1
    hop: int | None = None
    size: int | None = None
    val_fraction: float = 0.0
    seed: int = 0
    skip_errors: bool = False
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        for name in ("frames", "stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"Videos.{name} must be >= 1 frames, got {getattr(self, name)}")
        if self.hop is not None and self.hop < 1:
            raise ValueError(f"Videos.hop must be >= 1 frames or None, got {self.hop}")
        if self.size is not None and self.size < 1:
            raise ValueError(f"Videos.size must be >= 1 pixels or None, got {self.size}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"Videos.val_fraction must be in [0, 1), got {self.val_fraction}")

    @property
    def span(self) -> int:
        """Frames of the file one clip covers."""
        return (self.frames - 1) * self.stride + 1

    def clips(self) -> list[tuple[str, int]]:
        """Every clip as ``(file, first frame)``, in file order."""
        files = expand_paths(self.paths, SUFFIXES, what="Videos")
        skips = SkipCount("Videos")
        hop = self.hop or self.span
        clips: list[tuple[str, int]] = []
        shapes: dict[tuple[int, int], str] = {}
        longest = 0
        for path in files:
            try:
                count, height, width = read_header(path)
            except RecordError as error:
                if not self.skip_errors:
                    raise RecordError(
                        error.record,
                        f"{error.reason}; pass skip_errors=True to "
                        f"skip unreadable clips (they are counted in the log)",
                    ) from error
                skips.note(error)
                continue
            longest = max(longest, count)
            if count < self.span:
                continue
            if self.size is None:
                shapes.setdefault((height, width), path)
                if len(shapes) > 1:
                    (size_a, file_a), (size_b, file_b) = list(shapes.items())[:2]
                    raise ValueError(
                        f"Videos: frames differ in size: {file_a} is {size_a[0]}x{size_a[1]}, "
                        f"{file_b} is {size_b[0]}x{size_b[1]} (height x width); pass size= to "
                        f"resize and crop every frame to one size"
                    )
            clips.extend((path, first) for first in range(0, count - self.span + 1, hop))
        if not clips:
            raise ValueError(
                f"Videos: no file of {self.paths!r} is long enough for one clip of "
                f"{self.frames} frames {self.stride} apart ({self.span} frames); the longest "
                f"has {longest} frames"
            )
        return clips

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` clips per global batch (see ``dew.data.records``)."""
        clips = self.clips()
        held_out = held_out_count(len(clips), self.val_fraction, what="Videos")
        options = {"frames": self.frames, "stride": self.stride, "size": self.size}
        train = _Clips(clips[: len(clips) - held_out], **options)
        val = _Clips(clips[len(clips) - held_out :], **options) if held_out else None
        return from_records(
            train,
            val,
            batch=batch,
            seed=self.seed,
            skip_errors=self.skip_errors,
            read_threads=self.read_threads,
            prefetch=self.prefetch,
            name="Videos",
        )

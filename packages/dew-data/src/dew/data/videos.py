"""``Videos``: clips of local video files (MP4, WebM, numpy arrays, GIFs) as uint8 batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dew.data import _pyav
from dew.data._corpus import expand_paths
from dew.data._extra import hf_import
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.dataset import Dataset, Field
from dew.data.images import fit_image
from dew.data.records import RecordError, SkipCount

SUFFIXES = (".npy", ".gif", *_pyav.SUFFIXES)


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
    Image = hf_import("PIL.Image", needed_by=f"Videos reading the GIF {path}")

    with Image.open(path) as image:
        if image.format != "GIF":
            raise ValueError(f"not a GIF (PIL reads it as {image.format})")
        width, height = image.size
        return getattr(image, "n_frames", 1), height, width


def read_header(path: str) -> tuple[int, int, int]:
    """``(frames, height, width)`` of a clip file, or :class:`RecordError` naming it."""
    try:
        if path.endswith(".npy"):
            return _npy_header(path)
        if path.endswith(".gif"):
            return _gif_header(path)
        return _pyav.header(path)
    except (OSError, ValueError, SyntaxError) as error:
        raise RecordError(path, f"{type(error).__name__}: {error}") from error


def read_frames(path: str, frame_indices: range) -> np.ndarray:
    """Frames ``frame_indices`` of a clip file: uint8 ``[frames, height, width, 3]``."""
    if path.endswith(".npy"):
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        return np.array(array[frame_indices.start : frame_indices.stop : frame_indices.step])
    if not path.endswith(".gif"):
        return _pyav.frames(path, frame_indices)
    Image = hf_import("PIL.Image", needed_by=f"Videos reading the GIF {path}")

    with Image.open(path) as image:
        frames = []
        for index in frame_indices:
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB"), np.uint8))
    return np.stack(frames)


class _ClipFormat:
    """Clip ``c`` of ``clips`` (``(file, first frame)``), read and resized on demand."""

    def __init__(
        self,
        clips: list[tuple[str, int]],
        *,
        frames: int,
        stride: int,
        size: int | None,
        frame_shape: tuple[int, int],
    ):
        self._clips = clips
        self._frames, self._stride, self._size = frames, stride, size
        height, width = (size, size) if size is not None else frame_shape
        self.spec = {"video": Field((frames, height, width, 3), np.uint8)}

    def example(self, index: int) -> dict[str, np.ndarray]:
        path, first = self._clips[index]
        indices = range(first, first + (self._frames - 1) * self._stride + 1, self._stride)
        try:
            video = read_frames(path, indices)
            if self._size is not None:
                Image = hf_import("PIL.Image", needed_by="Videos resizing frames (size=)")

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
    ``"video"``: uint8 ``[rows, frames, height, width, 3]`` in 0..255 (the
    spec; height and width are ``size``, or the files' frame size).
    The validation set is the last ``val_fraction`` of the clips in file
    order (``val_from="head"``: the first), or every clip of ``val_paths``.

    paths: clip files, directories of them, glob patterns, or a list: ``.npy``
      arrays (uint8 ``[T, height, width, 3]``, read memory-mapped), ``.gif``
      (decoded with pillow, the ``[hf]`` extra), and ``.mp4``, ``.webm``,
      ``.mkv``, ``.mov``, ``.avi`` (the first video stream, decoded to RGB with
      PyAV, the ``[video]`` extra: ``pip install "dew-data[video]"``).
    frames: frames per clip.
    stride: frames between consecutive frames of a clip (1 = every frame).
    hop: frames between the starts of consecutive clips of a file; None =
      the clip's span (clips do not overlap).
    size: resize (shorter side, bicubic, with pillow) and centre-crop every
      frame to ``size x size`` pixels; None = keep frames as they are (all files must then share one
      height and width).
    val_fraction: share of the clips held out for validation; 0 = no
      validation set. Not used with ``val_paths``.
    val_from: where the held-out clips are taken, in file order: ``"tail"``
      (the last clips) or ``"head"`` (the first).
    val_paths: separate validation files (the same kinds as ``paths``), all of
      whose clips validate; None = hold out ``val_fraction`` of ``paths``.
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
    val_from: str = "tail"
    val_paths: Any = None
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
        check_split("Videos", self.val_fraction, self.val_from)

    @property
    def span(self) -> int:
        """Frames of the file one clip covers."""
        return (self.frames - 1) * self.stride + 1

    def clips(self) -> list[tuple[str, int]]:
        """Every clip of ``paths`` as ``(file, first frame)``, in file order."""
        return self._scan(self.paths, "Videos")[0]

    def _scan(self, paths: Any, what: str) -> tuple[list[tuple[str, int]], tuple[int, int]]:
        """The clips of ``paths`` and the (height, width) their frames share (that of the
        first file when ``size`` resizes them)."""
        files = expand_paths(paths, SUFFIXES, what=what)
        skips = SkipCount(what)
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
            shapes.setdefault((height, width), path)
            if self.size is None:
                if len(shapes) > 1:
                    (size_a, file_a), (size_b, file_b) = list(shapes.items())[:2]
                    raise ValueError(
                        f"{what}: frames differ in size: {file_a} is {size_a[0]}x{size_a[1]}, "
                        f"{file_b} is {size_b[0]}x{size_b[1]} (height x width); pass size= to "
                        f"resize and crop every frame to one size"
                    )
            clips.extend((path, first) for first in range(0, count - self.span + 1, hop))
        if not clips:
            raise ValueError(
                f"{what}: no file of {paths!r} is long enough for one clip of "
                f"{self.frames} frames {self.stride} apart ({self.span} frames); the longest "
                f"has {longest} frames"
            )
        return clips, next(iter(shapes))

    def _format(self, clips: list[tuple[str, int]], frame_shape) -> _ClipFormat:
        return _ClipFormat(
            clips, frames=self.frames, stride=self.stride, size=self.size, frame_shape=frame_shape
        )

    def splits(self) -> tuple[Rows, Rows]:
        """The training and validation clips, as rows (what ``dew.data.Mixture`` reads)."""
        clips, frame_shape = self._scan(self.paths, "Videos")
        if self.val_paths is not None:
            val_clips, val_shape = self._scan(self.val_paths, "Videos (val_paths)")
            train = Rows(self._format(clips, frame_shape), np.arange(len(clips)))
            val = Rows(self._format(val_clips, val_shape), np.arange(len(val_clips)))
        else:
            train_rows, val_rows = split_rows(
                len(clips), val_fraction=self.val_fraction, val_from=self.val_from, what="Videos"
            )
            clip_format = self._format(clips, frame_shape)
            train, val = Rows(clip_format, train_rows), Rows(clip_format, val_rows)
        return train, val

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` clips per global batch (see ``dew.data.records``)."""
        return compose(*self.splits(), batch=batch, reader=self, name="Videos")

"""``HFImages``: an image dataset of the ``datasets`` library as fixed-size uint8 batches."""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import numpy as np

from dew.data._hf import load_split, pick_column
from dew.data._padding import pad_id_of, pad_right
from dew.data.dataset import Dataset
from dew.data.records import RecordError, from_records, held_out_count, stack
from dew.data.tokenizers import ByteTokenizer


def fit_image(image, size: int) -> np.ndarray:
    """A PIL image as RGB uint8 ``[size, size, 3]``: the shorter side resized to
    ``size`` (bicubic), then the centre ``size x size`` cropped.

    JPEGs are decoded at a reduced scale first when they are at least twice
    the target size (PIL's ``draft``), which is much faster and changes pixels
    only by the resampling difference.
    """
    from PIL import Image  # the [hf] extra

    width, height = image.size
    scale = size / min(width, height)
    target = (max(size, round(width * scale)), max(size, round(height * scale)))
    if image.format == "JPEG":
        image.draft("RGB", target)
    image = image.convert("RGB")
    if image.size != target:
        image = image.resize(target, Image.Resampling.BICUBIC)
    left = (target[0] - size) // 2
    top = (target[1] - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return np.asarray(image, np.uint8)


def open_image(value: Any):
    """A PIL image from what a ``datasets`` image column holds: ``{"bytes", "path"}``,
    bytes, a path, or an already decoded image."""
    from PIL import Image

    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        return Image.open(io.BytesIO(data)) if data else Image.open(path)
    if isinstance(value, bytes | bytearray):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str | os.PathLike):
        return Image.open(value)
    if isinstance(value, Image.Image):
        return value
    raise TypeError(f"expected image bytes, a path or a PIL image, got {type(value).__name__}")


def _record_name(value: Any, row: int, what: str) -> str:
    if isinstance(value, dict):
        path = value.get("path")
    else:
        path = value if isinstance(value, str) else None
    return f"row {row} of {what}" + (f" ({path})" if path else "")


class _Images:
    """Rows ``indices`` of a dataset, decoded to fixed-size images (and labels, captions)."""

    def __init__(
        self,
        dataset,
        indices: np.ndarray,
        *,
        image: str,
        label: str | None,
        text: str | None,
        size: int,
        tokenizer,
        text_len: int,
        pad_id: int,
        what: str,
    ):
        import datasets

        columns = [c for c in (image, label, text) if c is not None]
        dataset = dataset.select_columns(columns)
        if isinstance(dataset.features[image], datasets.Image):
            dataset = dataset.cast_column(image, datasets.Image(decode=False))
        self._dataset = dataset
        self._indices = indices
        self._image, self._label, self._text = image, label, text
        self._size = size
        self._tokenizer, self._text_len, self._pad_id = tokenizer, text_len, pad_id
        self._what = what

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row_index = int(self._indices[index])
        return self._example(self._dataset[row_index], row_index)

    def read_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``indices`` fetched from the table in one call, then decoded."""
        row_indices = [int(i) for i in self._indices[np.asarray(indices)]]
        table = self._dataset[row_indices]
        return stack(
            [
                self._example({name: values[k] for name, values in table.items()}, row)
                for k, row in enumerate(row_indices)
            ]
        )

    def _example(self, row: dict, row_index: int) -> dict[str, np.ndarray]:
        value = row[self._image]
        try:
            pixels = fit_image(open_image(value), self._size)
        except (OSError, ValueError, TypeError, SyntaxError) as error:  # PIL's decode errors
            raise RecordError(
                _record_name(value, row_index, self._what), f"{type(error).__name__}: {error}"
            ) from error
        example = {"image": pixels}
        if self._label is not None:
            label = row[self._label]
            if not isinstance(label, int | np.integer):
                raise TypeError(
                    f"{self._what}: labels must be integers (a ClassLabel column); column "
                    f"{self._label!r} holds {type(label).__name__} at row {row_index}"
                )
            example["label"] = np.asarray(label, np.int32)
        if self._text is not None:
            ids = self._tokenizer.encode(row[self._text] or "")
            example["text"], example["text_mask"] = pad_right(ids, self._text_len, self._pad_id)
        return example


@dataclasses.dataclass(frozen=True)
class HFImages:
    """Images from the ``datasets`` library, decoded, resized and centre-cropped.

    Batches hold ``"image"``: uint8 ``[rows, image_size, image_size, 3]`` in
    0..255; ``"label"``: int32 ``[rows]`` when the dataset has labels; and
    ``"text"``: int32 ``[rows, text_len]`` caption ids padded with the
    tokenizer's pad id, with ``"text_mask"`` (bool, True on real ids), when it
    has captions.

    path_or_name: a ``datasets.Dataset`` or ``DatasetDict``, a local image
      folder (``class/xxx.png`` subfolders become labels), a directory of
      parquet files, a parquet file, a ``save_to_disk`` directory, or a Hub name.
    split: the split to train on.
    image_size: the side of the square images, in pixels.
    val_split: a split to validate on; None = hold out ``val_fraction`` of ``split``.
    val_fraction: share of ``split``'s rows (the last ones) held out for
      validation when ``val_split`` is None; 0 = no validation set.
    image_field: the image column; "auto" = the first column of type ``Image``
      (else one named "image" or "img").
    label_field: the label column (integers); "auto" = "label" or "labels" when
      present; None = no labels.
    text_field: the caption column; "auto" = "text" or "caption" when present;
      None = no captions.
    tokenizer: encodes captions.
    text_len: caption ids kept (the rest is cut), in tokens.
    seed: shuffle seed of the training rows.
    skip_errors: skip unreadable images (counted in a ``dew.data`` warning)
      instead of stopping with an error naming the record.
    cache_dir: where ``datasets`` prepares local folders and downloads (None = its default).
    read_threads: Grain threads decoding ahead (0 = in the caller's thread).
    prefetch: batches decoded ahead.
    """

    path_or_name: Any
    _: dataclasses.KW_ONLY
    split: str = "train"
    image_size: int = 64
    val_split: str | None = None
    val_fraction: float = 0.0
    image_field: str = "auto"
    label_field: str | None = "auto"
    text_field: str | None = "auto"
    tokenizer: Any = dataclasses.field(default_factory=ByteTokenizer)
    text_len: int = 64
    seed: int = 0
    skip_errors: bool = False
    cache_dir: str | os.PathLike | None = None
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.image_size < 1:
            raise ValueError(f"HFImages.image_size must be >= 1 pixels, got {self.image_size}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"HFImages.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.text_len < 1:
            raise ValueError(f"HFImages.text_len must be >= 1 tokens, got {self.text_len}")

    def _columns(self, dataset) -> tuple[str, str | None, str | None]:
        import datasets

        what = "HFImages"
        if self.image_field == "auto":
            typed = [n for n, f in dataset.features.items() if isinstance(f, datasets.Image)]
            named = [n for n in ("image", "img") if n in dataset.column_names]
            if not (typed or named):
                raise KeyError(
                    f"{what}: no image column (of type Image, or named 'image'); "
                    f"the columns are {list(dataset.column_names)}"
                )
            image = (typed or named)[0]
        else:
            image = pick_column(dataset, self.image_field, auto=(), what=what, role="image")
        label = pick_column(
            dataset, self.label_field, auto=("label", "labels"), what=what, role="label"
        )
        text = pick_column(
            dataset, self.text_field, auto=("text", "caption"), what=what, role="caption"
        )
        return image, label, text

    def _source(self, dataset, indices, columns) -> _Images:
        image, label, text = columns
        return _Images(
            dataset,
            indices,
            image=image,
            label=label,
            text=text,
            size=self.image_size,
            tokenizer=self.tokenizer,
            text_len=self.text_len,
            pad_id=pad_id_of(self.tokenizer, None),
            what=f"HFImages({self.split})",
        )

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` images per global batch (see ``dew.data.records``)."""
        cache_dir = None if self.cache_dir is None else os.fspath(self.cache_dir)
        dataset = load_split(self.path_or_name, self.split, what="HFImages", cache_dir=cache_dir)
        if len(dataset) == 0:
            raise ValueError(f"HFImages: split {self.split!r} of {self.path_or_name!r} is empty")
        columns = self._columns(dataset)
        rows = np.arange(len(dataset))
        val = None
        if self.val_split is not None:
            val_dataset = load_split(
                self.path_or_name, self.val_split, what="HFImages", cache_dir=cache_dir
            )
            val = self._source(val_dataset, np.arange(len(val_dataset)), self._columns(val_dataset))
        elif self.val_fraction > 0:
            held_out = held_out_count(
                len(rows), self.val_fraction, what=f"HFImages (split {self.split!r})"
            )
            val = self._source(dataset, rows[-held_out:], columns)
            rows = rows[:-held_out]
        train = self._source(dataset, rows, columns)
        return from_records(
            train,
            val,
            batch=batch,
            seed=self.seed,
            skip_errors=self.skip_errors,
            read_threads=self.read_threads,
            prefetch=self.prefetch,
            name="HFImages",
        )

"""``HFImages``: an image dataset of the ``datasets`` library as fixed-size uint8 batches."""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import numpy as np

from dew.data._extra import hf_import
from dew.data._hf import load_split, pick_column
from dew.data._padding import pad_id_of, pad_right
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.dataset import Dataset, Field
from dew.data.records import RecordError, stack
from dew.data.tokenizers import ByteTokenizer


def fit_image(image, size: int) -> np.ndarray:
    """A PIL image as RGB uint8 ``[size, size, 3]``: the shorter side resized to
    ``size`` (bicubic), then the centre ``size x size`` cropped.

    JPEGs are decoded at a reduced scale first when they are at least twice
    the target size (PIL's ``draft``), which is much faster and changes pixels
    only by the resampling difference.
    """
    Image = hf_import("PIL.Image", needed_by="decoding images")

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
    Image = hf_import("PIL.Image", needed_by="decoding images")

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


class _ImageFormat:
    """Row ``r`` of a dataset, decoded to a fixed-size image (and its label, caption)."""

    def __init__(
        self,
        dataset,
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
        datasets = hf_import("datasets", needed_by="HFImages")

        columns = [c for c in (image, label, text) if c is not None]
        dataset = dataset.select_columns(columns)
        if isinstance(dataset.features[image], datasets.Image):
            dataset = dataset.cast_column(image, datasets.Image(decode=False))
        self._dataset = dataset
        self._image, self._label, self._text = image, label, text
        self._size = size
        self._tokenizer, self._text_len, self._pad_id = tokenizer, text_len, pad_id
        self._what = what
        self.spec = {"image": Field((size, size, 3), np.uint8)}
        if label is not None:
            self.spec["label"] = Field((), np.int32)
        if text is not None:
            self.spec["text"] = Field((text_len,), np.int32)
            self.spec["text_mask"] = Field((text_len,), np.bool_)

    def example(self, row: int) -> dict[str, np.ndarray]:
        return self._example(self._dataset[row], row)

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``rows`` fetched from the table in one call, then decoded."""
        row_indices = [int(i) for i in rows]
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
    has captions. The Dataset's spec states these keys and sizes.

    The validation set is ``val_split`` when given (all of its rows), else
    ``val_fraction`` of ``split``'s rows taken from its end (``val_from=
    "tail"``) or its start (``"head"``), in order.

    path_or_name: a ``datasets.Dataset`` or ``DatasetDict``, a local image
      folder (``class/xxx.png`` subfolders become labels), a directory of
      parquet files, a parquet file, a ``save_to_disk`` directory, or a Hub name.
    split: the split to train on.
    image_size: the side of the square images, in pixels.
    val_split: a split to validate on; None = hold out ``val_fraction`` of ``split``.
    val_fraction: share of ``split``'s rows held out for validation when
      ``val_split`` is None; 0 = no validation set.
    val_from: where the held-out rows are taken: ``"tail"`` (the last rows) or
      ``"head"`` (the first).
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
    val_from: str = "tail"
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
        check_split("HFImages", self.val_fraction, self.val_from)
        if self.text_len < 1:
            raise ValueError(f"HFImages.text_len must be >= 1 tokens, got {self.text_len}")

    def _columns(self, dataset) -> tuple[str, str | None, str | None]:
        datasets = hf_import("datasets", needed_by="HFImages")

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

    def _format(self, dataset, split: str) -> _ImageFormat:
        image, label, text = self._columns(dataset)
        return _ImageFormat(
            dataset,
            image=image,
            label=label,
            text=text,
            size=self.image_size,
            tokenizer=self.tokenizer,
            text_len=self.text_len,
            pad_id=pad_id_of(self.tokenizer, None),
            what=f"HFImages({split})",
        )

    def splits(self) -> tuple[Rows, Rows]:
        """The training and validation images, as rows (what ``dew.data.Mixture`` reads)."""
        cache_dir = None if self.cache_dir is None else os.fspath(self.cache_dir)
        dataset = load_split(self.path_or_name, self.split, what="HFImages", cache_dir=cache_dir)
        if len(dataset) == 0:
            raise ValueError(f"HFImages: split {self.split!r} of {self.path_or_name!r} is empty")
        images = self._format(dataset, self.split)
        if self.val_split is not None:
            val_dataset = load_split(
                self.path_or_name, self.val_split, what="HFImages", cache_dir=cache_dir
            )
            train = Rows(images, np.arange(len(dataset)))
            val = Rows(self._format(val_dataset, self.val_split), np.arange(len(val_dataset)))
        else:
            train_rows, val_rows = split_rows(
                len(dataset),
                val_fraction=self.val_fraction,
                val_from=self.val_from,
                what=f"HFImages (split {self.split!r})",
            )
            train, val = Rows(images, train_rows), Rows(images, val_rows)
        return train, val

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` images per global batch (see ``dew.data.records``)."""
        return compose(*self.splits(), batch=batch, reader=self, name="HFImages")

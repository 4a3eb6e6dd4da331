"""The one skeleton every built-in reader shares: a source, a format, a split, on Grain.

A reader (``TokenWindows``, ``HFImages``, ``Videos``, ``PreferencePairs``,
``Prompts``) is three choices, composed here into a :class:`Dataset`:

- a **source**: what there is to count and address by a row number: the
  windows of a token stream, the rows of a table (JSON lines, parquet, a
  ``datasets.Dataset``), the clips of video files;
- a **format**: how row ``r`` of the source becomes one example (a dict of
  numpy arrays), and the :class:`Field` of each key, declared once from the
  reader's arguments (``seq_len``, ``image_size``, ``frames``) as the spec;
- a **split**: which rows validate. ``val_fraction`` of the rows, taken from
  the ``"tail"`` (the end of the source, the default) or the ``"head"``, or
  every row of a separate validation source (``val_paths``, ``val_split``,
  ``val_source``).

:func:`compose` hands the chosen rows to :func:`dew.data.from_records`, which
owns the Grain pipeline: per-epoch shuffling, partitions, the padded last
validation batch with ``example_mask``, skipped records and positions.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dew.data.dataset import Batch, Dataset, Field
from dew.data.records import from_records

VAL_FROM = ("tail", "head")


class Format(Protocol):
    """Row ``r`` of a source as one example, and the spec every example has.

    ``example(r)`` returns a dict of numpy arrays shaped as ``spec`` says, or
    raises :class:`dew.data.RecordError`. A format may also define
    ``examples(rows) -> Batch`` (the examples of ``rows`` stacked), a faster
    vectorized read.
    """

    spec: dict[str, Field]

    def example(self, row: int) -> dict[str, np.ndarray]: ...


class Rows:
    """The records :func:`from_records` reads: the ``rows`` of a source, in a format."""

    def __init__(self, format: Format, rows: np.ndarray):
        self.format = format
        self.rows = np.asarray(rows, np.int64)
        self.spec = format.spec
        if hasattr(format, "examples"):
            self.read_batch = self._read_batch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.format.example(int(self.rows[index]))

    def _read_batch(self, indices: np.ndarray) -> Batch:
        return self.format.examples(self.rows[np.asarray(indices)])


def check_split(what: str, val_fraction: float, val_from: str) -> None:
    """Validate a reader's split arguments when it is built."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"{what}.val_fraction must be in [0, 1), got {val_fraction}")
    if val_from not in VAL_FROM:
        raise ValueError(
            f"{what}.val_from must be one of {VAL_FROM} (where the validation rows are taken "
            f"from), got {val_from!r}"
        )


def held_out_count(count: int, val_fraction: float, *, what: str) -> int:
    """How many of ``count`` rows a ``val_fraction`` holds out for validation:
    ``round(count * val_fraction)``, at least one when the fraction is above 0; an
    error when none would be left to train on."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"{what}: val_fraction must be in [0, 1), got {val_fraction}")
    count_out = 0 if val_fraction == 0 else max(1, round(count * val_fraction))
    if count_out >= count:
        raise ValueError(
            f"{what}: {count} record(s) and val_fraction={val_fraction} holds out {count_out}, "
            f"leaving none to train on; lower val_fraction or add data"
        )
    return count_out


def split_rows(
    count: int, *, val_fraction: float, val_from: str, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(train rows, validation rows)`` of rows ``0 .. count - 1``: the validation
    rows are the last (``val_from="tail"``) or first (``"head"``) ``held_out_count``
    rows, in source order; the rest train."""
    held_out = held_out_count(count, val_fraction, what=what)
    rows = np.arange(count)
    if val_from == "head":
        return rows[held_out:], rows[:held_out]
    return rows[: count - held_out], rows[count - held_out :]


def compose(
    train: Rows,
    val: Rows | None,
    *,
    batch: int,
    reader: Any,
    name: str,
) -> Dataset:
    """The :class:`Dataset` of a reader: ``train`` and ``val`` rows on Grain.

    reader: the reader's configuration, read for ``seed``, ``read_threads``,
      ``prefetch`` and (when it has one) ``skip_errors``.
    """
    if val is not None and len(val) and val.spec != train.spec:
        raise ValueError(
            f"{name}: the validation examples ({_describe(val.spec)}) differ from the "
            f"training examples ({_describe(train.spec)}); give a validation source with "
            f"the same columns and sizes"
        )
    return from_records(
        train,
        val,
        batch=batch,
        seed=reader.seed,
        skip_errors=getattr(reader, "skip_errors", False),
        read_threads=reader.read_threads,
        prefetch=reader.prefetch,
        name=name,
        spec=train.spec,
    )


def _describe(spec: dict[str, Field]) -> str:
    return ", ".join(f"{key} {field.dtype} {list(field.shape)}" for key, field in spec.items())

"""A ``Dataset`` from random-access records, on Grain.

Every built-in reader describes its examples as a random-access source
(``len(source)`` and ``source[i] -> dict of numpy arrays``) and hands it to
:func:`from_records`, which does the rest the same way for all of them:

- **train** is endless: the records are shuffled with ``seed``, and shuffled
  again differently each epoch (Grain's ``MapDataset.shuffle(seed).repeat()``).
  Global batch ``g`` is the examples ``g * batch ... (g + 1) * batch - 1`` of
  that stream; process ``p`` of ``count`` reads the contiguous rows
  ``p * rows ... (p + 1) * rows - 1`` of it (``rows = batch / count``), so the
  processes' shares put side by side are exactly the one-process batch.
- **val** is one pass in record order. Its last global batch is padded to the
  full ``batch`` so every process sees the same shapes (and the step compiles
  once); every validation batch carries ``example_mask`` (bool ``[rows]``),
  False on padding. Objectives weight their sums by it, so evaluation totals
  are exactly the sums over the real examples.
- The train iterator is a Grain ``DatasetIterator``: ``get_state()`` /
  ``set_state()`` save and restore its position exactly, and the trainer's
  checkpoints store it.

Unreadable records: a reader raises :class:`RecordError` naming the record.
By default that stops the run. With ``skip_errors=True`` the record is
skipped and counted in a warning on the ``dew.data`` logger: in training it
is replaced by the next readable record of the source (positions stay
deterministic and partitions stay in step); in validation its row is padding
(``example_mask`` False), which keeps evaluation sums exact.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grain
import numpy as np

from dew.data.dataset import Batch, Dataset, Partition

logger = logging.getLogger("dew.data")


class RecordError(ValueError):
    """A record could not be read or decoded.

    record: what names the record for a person (a file, ``row 12 of ...``).
    reason: what went wrong.
    """

    def __init__(self, record: str, reason: str):
        super().__init__(f"could not read record {record}: {reason}")
        self.record = record
        self.reason = reason


class Records(Protocol):
    """What :func:`from_records` reads: a sized, random-access source of examples."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...


class SkipCount:
    """Counts skipped records (thread-safe) and logs each one on ``dew.data``.

    name: the reader, as it appears in the log line.
    """

    def __init__(self, name: str):
        self.name = name
        self.count = 0
        self._lock = threading.Lock()

    def note(self, error: RecordError) -> None:
        with self._lock:
            self.count += 1
            count = self.count
        logger.warning(
            "%s: skipped unreadable record %s (%s); %d skipped so far",
            self.name, error.record, error.reason, count,
        )


def stack(examples: Sequence[dict[str, Any]]) -> Batch:
    """Stack examples (dicts of arrays with equal shapes) along a new first axis."""
    first = examples[0]
    return {name: np.stack([example[name] for example in examples]) for name in first}


class _Guarded:
    """A source whose unreadable records are raised with a hint, or skipped.

    In "train" mode a skipped record is replaced by the next readable one. In
    "val" mode the source is padded to ``length`` records; padding and skipped
    records become rows shaped like a real one, zeros, ``example_mask`` False.
    """

    def __init__(self, source: Records, *, mode: str, skips: SkipCount | None,
                 length: int | None = None):
        self._source = source
        self._size = len(source)
        self._mode = mode
        self._skips = skips
        self._length = self._size if length is None else length
        self._template: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self._length

    def _read(self, index: int) -> dict[str, np.ndarray]:
        try:
            return self._source[index]
        except RecordError as error:
            if self._skips is None:
                raise RecordError(
                    error.record,
                    f"{error.reason}; pass skip_errors=True to skip unreadable records "
                    f"(they are counted in the log)",
                ) from error
            self._skips.note(error)
            raise

    def _padding(self) -> dict[str, np.ndarray]:
        if self._template is None:
            for index in range(self._size):
                try:
                    example = self._source[index]
                except RecordError:
                    continue
                self._template = {k: np.zeros_like(v) for k, v in example.items()}
                break
            else:
                raise RecordError(
                    f"0..{self._size - 1}", "no record of the validation source is readable"
                )
        return {**self._template, "example_mask": np.asarray(False)}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if self._mode == "val":
            if index >= self._size:
                return self._padding()
            try:
                example = self._read(index)
            except RecordError:
                if self._skips is None:
                    raise
                return self._padding()
            return {**example, "example_mask": np.asarray(True)}
        if self._skips is None:
            return self._read(index)
        for offset in range(self._size):
            try:
                return self._read((index + offset) % self._size)
            except RecordError:
                continue
        raise RecordError(f"0..{self._size - 1}", "no record of the training source is readable")


class _PartitionRows(grain.MapDataset):
    """This process's contiguous rows of each global batch of its parent.

    Local element ``i`` is row ``i % rows`` of this process's share of global
    batch ``i // rows``: parent index ``(i // rows) * batch + index * rows + i % rows``.
    """

    def __init__(self, parent: grain.MapDataset, *, batch: int, partition: Partition):
        super().__init__(parent)
        self._batch = batch
        self._rows = partition.rows(batch)
        self._first = partition.index * self._rows
        parent_length = len(parent)
        self._length = (
            sys.maxsize if parent_length >= sys.maxsize
            else parent_length // batch * self._rows
        )

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        return f"PartitionRows(batch={self._batch}, rows={self._rows}, first={self._first})"

    def _global_index(self, index: int) -> int:
        group, row = divmod(index, self._rows)
        return group * self._batch + self._first + row

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[self._global_index(index)]

    def _getitems(self, indices):
        return self._parent._getitems([self._global_index(i) for i in indices])


def held_out_count(count: int, val_fraction: float, *, what: str) -> int:
    """How many of ``count`` records (the last ones) a ``val_fraction`` holds out for
    validation: ``round(count * val_fraction)``, at least one when the fraction is
    above 0; an error when none would be left to train on."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"{what}: val_fraction must be in [0, 1), got {val_fraction}")
    count_out = 0 if val_fraction == 0 else max(1, round(count * val_fraction))
    if count_out >= count:
        raise ValueError(
            f"{what}: {count} record(s) and val_fraction={val_fraction} holds out {count_out}, "
            f"leaving none to train on; lower val_fraction or add data"
        )
    return count_out


def from_records(
    train: Records,
    val: Records | None = None,
    *,
    batch: int,
    seed: int = 0,
    skip_errors: bool = False,
    read_threads: int = 2,
    prefetch: int = 4,
    name: str = "records",
) -> Dataset:
    """A :class:`Dataset` over random-access records (see the module docstring).

    train: the training examples; ``train[i]`` is a dict of numpy arrays, the
      same keys and shapes for every ``i``.
    val: the validation examples, or None for no validation set.
    batch: the global batch, in examples, summed over all processes.
    seed: the shuffle seed, ``0 <= seed < 2**32``; epoch ``e`` uses ``seed + e``.
    skip_errors: skip records that raise :class:`RecordError` (counted in a
      warning) instead of stopping.
    read_threads: Grain threads reading batches ahead (0 = read in the caller's thread).
    prefetch: batches read ahead (0 = none).
    name: the reader's name in errors and logs.
    """
    if batch < 1:
        raise ValueError(f"{name}: batch must be >= 1 examples, got {batch}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"{name}: seed must be in 0..2**32-1, got {seed}")
    if read_threads < 0 or prefetch < 0:
        raise ValueError(
            f"{name}: read_threads and prefetch must be >= 0, got {read_threads} and {prefetch}"
        )
    if len(train) < 1:
        raise ValueError(f"{name}: the training source has no records")
    if val is not None and len(val) < 1:
        val = None
    skips = SkipCount(name) if skip_errors else None
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    train_source = _Guarded(train, mode="train", skips=skips)

    def open_train(partition: Partition):
        shuffled = grain.MapDataset.source(train_source).shuffle(seed=seed).repeat()
        local = _PartitionRows(shuffled, batch=batch, partition=partition)
        batches = local.batch(partition.rows(batch), drop_remainder=True, batch_fn=stack)
        return iter(batches.to_iter_dataset(options))

    open_val: Callable[[Partition], Any] | None = None
    if val is not None:
        padded = -(-len(val) // batch) * batch
        val_source = _Guarded(val, mode="val", skips=skips, length=padded)

        def open_val(partition: Partition):
            local = _PartitionRows(grain.MapDataset.source(val_source), batch=batch,
                                   partition=partition)
            batches = local.batch(partition.rows(batch), drop_remainder=True, batch_fn=stack)
            return iter(batches.to_iter_dataset(options))

    return Dataset(train=open_train, val=open_val, records=len(train), batch=batch)

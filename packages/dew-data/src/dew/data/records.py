"""A ``Dataset`` from random-access records, on Grain.

Every built-in reader describes its examples as a random-access source
(``len(source)`` and ``source[i] -> dict of numpy arrays``, optionally
``source.read_batch(indices)`` for a faster vectorized read) and hands it to
:func:`from_records`, which does the rest the same way for all of them:

- **train** is endless and shuffled: epoch ``e`` visits the records in a
  permutation drawn from ``(seed, e)``, so every epoch is shuffled anew.
  Global batch ``g`` is positions ``g * batch ... (g + 1) * batch - 1`` of
  that stream; process ``p`` of ``count`` reads the contiguous rows
  ``p * rows ... (p + 1) * rows - 1`` of it (``rows = batch / count``), so the
  processes' shares put side by side are exactly the one-process batch.
- **val** is one pass in record order. Its last global batch is padded to the
  full ``batch`` so every process sees the same shapes (and the step compiles
  once); every validation batch carries ``example_mask`` (bool ``[rows]``),
  False on padding. Objectives weight their sums by it, so evaluation totals
  are exactly the sums over the real examples.
- Both are Grain pipelines (``MapDataset.range(...).map(read a batch)``,
  read ahead by Grain's threads): the train iterator is a Grain
  ``DatasetIterator`` whose ``get_state()`` / ``set_state()`` save and restore
  its position (the number of batches read) exactly, and the trainer's
  checkpoints store it. A position is computed, not replayed: restoring one
  is instant however far into the run it is.

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
    """What :func:`from_records` reads: a sized, random-access source of examples.

    ``source[i]`` returns one example, a dict of numpy arrays with the same
    keys and shapes for every ``i``, or raises :class:`RecordError`. A source
    may also define ``read_batch(indices) -> dict of arrays`` (the examples
    ``indices`` stacked), which is then used instead of one call per example.
    """

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
            self.name,
            error.record,
            error.reason,
            count,
        )


def stack(examples: Sequence[dict[str, Any]]) -> Batch:
    """Stack examples (dicts of arrays with equal shapes) along a new first axis."""
    first = examples[0]
    return {name: np.stack([example[name] for example in examples]) for name in first}


class EpochOrder:
    """The record order of every epoch: epoch ``e`` is a permutation of ``0..count-1``
    drawn from ``(seed, e)``, so each epoch is shuffled anew and any position of the
    endless stream is computed, not replayed. The most recent epochs' permutations
    are kept (threads reading ahead ask for neighbouring epochs).

    count: records per epoch.
    seed: the shuffle seed.
    """

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            order = self._cache.get(epoch)
            if order is None:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
                self._cache[epoch] = order
                while len(self._cache) > 3:
                    del self._cache[min(self._cache)]
            return order

    def records(self, positions: np.ndarray) -> np.ndarray:
        """The record at each position of the endless stream."""
        epochs, within = np.divmod(positions, self.count)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.permutation(int(epoch))[within[chosen]]
        return out


class _Reader:
    """Reads one process's rows of a batch from a source, with the unreadable-record policy.

    A source with ``read_batch(indices) -> Batch`` is read in one call (the
    fast path); otherwise, or when that call meets an unreadable record while
    skipping, record by record.
    """

    def __init__(self, source: Records, *, skips: SkipCount | None):
        self._source = source
        self._size = len(source)
        self._skips = skips
        self._read_batch = getattr(source, "read_batch", None)
        self._template: dict[str, np.ndarray] | None = None

    def _hint(self, error: RecordError) -> RecordError:
        return RecordError(
            error.record,
            f"{error.reason}; pass skip_errors=True to skip "
            f"unreadable records (they are counted in the log)",
        )

    def _read(self, index: int) -> dict[str, np.ndarray]:
        """Record ``index``; an unreadable one is raised with a hint, or noted and raised."""
        try:
            return self._source[index]
        except RecordError as error:
            if self._skips is None:
                raise self._hint(error) from error
            self._skips.note(error)
            raise

    def _fast(self, indices: np.ndarray) -> Batch | None:
        if self._read_batch is None:
            return None
        try:
            return self._read_batch(indices)
        except RecordError as error:
            if self._skips is None:
                raise self._hint(error) from error
            return None  # read record by record, skipping the bad ones

    def train(self, indices: np.ndarray) -> Batch:
        """Records ``indices``; a skipped record is replaced by the next readable one."""
        batch = self._fast(indices)
        if batch is not None:
            return batch
        return stack([self._train_record(int(i)) for i in indices])

    def _train_record(self, index: int) -> dict[str, np.ndarray]:
        if self._skips is None:
            return self._read(index)
        for offset in range(self._size):
            try:
                return self._read((index + offset) % self._size)
            except RecordError:
                continue
        raise RecordError(f"0..{self._size - 1}", "no record of the training source is readable")

    def val(self, indices: np.ndarray) -> Batch:
        """Records ``indices`` with ``example_mask``; indices past the end, and skipped
        records, are padding rows (zeros shaped like a record, mask False)."""
        real = indices < self._size
        batch = self._fast(indices) if real.all() else None
        if batch is not None:
            return {**batch, "example_mask": np.ones(len(indices), bool)}
        rows = []
        for index in indices:
            example = None
            if index < self._size:
                try:
                    example = {**self._read(int(index)), "example_mask": np.asarray(True)}
                except RecordError:
                    if self._skips is None:
                        raise
            rows.append(example if example is not None else self._padding())
        return stack(rows)

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
    train_reader = _Reader(train, skips=skips)
    order = EpochOrder(len(train), seed)

    def rows_of(partition: Partition) -> np.ndarray:
        """This process's rows of a global batch: a contiguous share."""
        rows = partition.rows(batch)
        return np.arange(partition.index * rows, (partition.index + 1) * rows)

    def open_train(partition: Partition):
        rows = rows_of(partition)
        steps = grain.MapDataset.range(sys.maxsize)  # global batch numbers, endless
        batches = steps.map(lambda step: train_reader.train(order.records(step * batch + rows)))
        return iter(batches.to_iter_dataset(options))

    open_val: Callable[[Partition], Any] | None = None
    if val is not None:
        val_reader = _Reader(val, skips=skips)
        val_steps = -(-len(val) // batch)

        def open_val(partition: Partition):
            rows = rows_of(partition)
            steps = grain.MapDataset.range(val_steps)
            batches = steps.map(lambda step: val_reader.val(step * batch + rows))
            return iter(batches.to_iter_dataset(options))

    return Dataset(train=open_train, val=open_val, records=len(train), batch=batch)

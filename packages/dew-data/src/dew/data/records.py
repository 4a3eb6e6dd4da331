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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from dew.data.dataset import (
    EXAMPLE_MASK,
    Batch,
    Dataset,
    Field,
    Partition,
    as_spec,
    spec_of_batch,
)

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
    out = {}
    for name in first:
        try:
            out[name] = np.stack([np.asarray(example[name]) for example in examples])
        except (KeyError, ValueError):
            shapes = sorted({str(list(np.shape(example.get(name)))) for example in examples})
            keys = sorted({tuple(sorted(example)) for example in examples})
            raise ValueError(
                f"examples differ: key {name!r} has shapes {', '.join(shapes)} and the "
                f"examples have keys {keys}; every example of a source must have the same "
                f"keys and shapes (pad or crop them to one size)"
            ) from None
    return out


def check_batch(batch: Batch, spec: dict[str, Field], rows: int, *, name: str) -> Batch:
    """``batch`` if it holds exactly the keys of ``spec``, each ``(rows, *shape)`` of
    its dtype; else an error naming the key, what it is and what the spec says."""
    if batch.keys() != spec.keys():
        raise ValueError(
            f"{name}: a batch has keys {sorted(batch)} but the spec declares {sorted(spec)}; "
            f"every record must have the declared keys"
        )
    for key, field in spec.items():
        value = batch[key]
        if value.shape != field.rows(rows) or value.dtype != field.dtype:
            raise ValueError(
                f"{name}: batch key {key!r} is {value.dtype} {list(value.shape)} but the spec "
                f"declares {field.dtype} {list(field.rows(rows))} ({rows} rows of "
                f"{list(field.shape)}); make the records match the spec, or fix the spec"
            )
    return batch


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


class RecordReader:
    """Reads one process's rows of a batch from a source, with the unreadable-record policy.

    A source with ``read_batch(indices) -> Batch`` is read in one call (the
    fast path); otherwise, or when that call meets an unreadable record while
    skipping, record by record.
    """

    def __init__(self, source: Records, spec: dict[str, Field], *, skips: SkipCount | None):
        self._source = source
        self.spec = spec
        self.size = len(source)
        self._skips = skips
        self._read_batch = getattr(source, "read_batch", None)
        self._template = {key: np.zeros(f.shape, f.dtype) for key, f in spec.items()}

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
        for offset in range(self.size):
            try:
                return self._read((index + offset) % self.size)
            except RecordError:
                continue
        raise RecordError(f"0..{self.size - 1}", "no record of the training source is readable")

    def val(self, indices: np.ndarray) -> Batch:
        """Records ``indices`` with ``example_mask``; indices past the end, and skipped
        records, are padding rows (zeros shaped like a record, mask False)."""
        real = indices < self.size
        batch = self._fast(indices) if real.all() else None
        if batch is not None:
            return {**batch, EXAMPLE_MASK: np.ones(len(indices), bool)}
        rows = []
        for index in indices:
            example = None
            if index < self.size:
                try:
                    example = {**self._read(int(index)), EXAMPLE_MASK: np.asarray(True)}
                except RecordError:
                    if self._skips is None:
                        raise
            rows.append(example if example is not None else self._padding())
        return stack(rows)

    def _padding(self) -> dict[str, np.ndarray]:
        return {**self._template, EXAMPLE_MASK: np.asarray(False)}


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
    spec: Mapping[str, Any] | None = None,
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
    spec: each key's per-row ``Field(shape, dtype)`` (see :class:`Dataset`);
      None = ``train.spec`` when the source has one, else the keys, shapes and
      dtypes of its first readable record. Every batch read is checked
      against it: a record of another shape is an error naming the key.
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
    if batch > len(train):
        raise ValueError(
            f"{name}: the global batch of {batch} examples is larger than the {len(train)} "
            f"training records (after the validation ones are held out), so one batch would "
            f"hold some records twice; use batch <= {len(train)}, more data, or a smaller "
            f"validation share"
        )
    if val is not None and len(val) < 1:
        val = None
    skips = SkipCount(name) if skip_errors else None
    if spec is None:
        spec = getattr(train, "spec", None)
    spec = first_spec(train, name=name) if spec is None else as_spec(spec, what=f"{name}: spec")
    # imported here: grain (and the orbax it loads) costs about a second at
    # startup, which a run that never builds a reader should not pay
    import grain

    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    train_reader = RecordReader(train, spec, skips=skips)
    order = EpochOrder(len(train), seed)

    def open_train(partition: Partition):
        rows = rows_of(partition, batch)
        steps = grain.MapDataset.range(sys.maxsize)  # global batch numbers, endless
        batches = steps.map(
            lambda step: check_batch(
                train_reader.train(order.records(step * batch + rows)), spec, len(rows), name=name
            )
        )
        return iter(batches.to_iter_dataset(options))

    open_val = None
    if val is not None:
        open_val = one_pass(
            RecordReader(val, spec, skips=skips), batch=batch, options=options, name=name
        )
    return Dataset(train=open_train, val=open_val, records=len(train), batch=batch, spec=spec)


def rows_of(partition: Partition, batch: int) -> np.ndarray:
    """The rows of a global batch of ``batch`` one process reads: a contiguous share."""
    rows = partition.rows(batch)
    return np.arange(partition.index * rows, (partition.index + 1) * rows)


def one_pass(
    reader: RecordReader, *, batch: int, options: Any, name: str
) -> Callable[[Partition], Any]:
    """``val(partition)`` of a :class:`Dataset`: one pass over ``reader``'s records in
    order, the last global batch padded, every batch with ``example_mask``.

    options: the ``grain.ReadOptions`` of the read-ahead.
    """
    import grain

    steps = -(-reader.size // batch)
    val_spec = {**reader.spec, EXAMPLE_MASK: Field((), np.bool_)}

    def open_val(partition: Partition):
        rows = rows_of(partition, batch)
        batches = grain.MapDataset.range(steps).map(
            lambda step: check_batch(
                reader.val(step * batch + rows), val_spec, len(rows), name=f"{name} (val)"
            )
        )
        return iter(batches.to_iter_dataset(options))

    return open_val


def first_spec(source: Records, *, name: str) -> dict[str, Field]:
    """The spec of a source's first readable record (each array's shape and dtype)."""
    for index in range(len(source)):
        try:
            example = source[index]
        except RecordError:
            continue
        return spec_of_batch({key: np.asarray(value)[None] for key, value in example.items()})
    raise RecordError(
        f"0..{len(source) - 1}", f"{name}: no record of the training source is readable"
    )

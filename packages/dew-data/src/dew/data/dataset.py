"""``Dataset`` (two iterator factories) and ``Partition`` (one process's share)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which share of every global batch one process reads.

    index: this process's index, ``0 <= index < count`` (``jax.process_index()``).
    count: the number of processes reading (``jax.process_count()``).
    """

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"Partition.count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"Partition.index {self.index} is outside 0..{self.count - 1} (count {self.count})"
            )

    def rows(self, batch: int) -> int:
        """Rows of a global batch of ``batch`` examples that this process reads."""
        if batch % self.count:
            raise ValueError(
                f"global batch {batch} does not divide over {self.count} processes; "
                f"use a multiple of {self.count}"
            )
        return batch // self.count

    def slice(self, batch: int) -> slice:
        """The rows of a global batch that belong to this process."""
        rows = self.rows(batch)
        return slice(self.index * rows, (self.index + 1) * rows)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Two iterator factories and the sizes the trainer needs.

    train: ``train(partition)`` opens an endless, shuffled iterator of batches,
      each a dict of arrays with ``batch / partition.count`` rows (this
      process's share). An iterator with ``get_state``/``set_state`` (a Grain
      iterator) has its position saved in checkpoints.
    val: ``val(partition)`` opens one pass over held-out batches, then stops;
      None when there is no validation set. Policy for the last, partial
      batch: it is padded to the full batch (every process sees the same
      shapes, the evaluation step compiles once) and every validation batch
      carries ``example_mask``, bool ``[rows]``, False on padding rows.
      Objectives weight their sums by it, so evaluation totals are exactly
      the sums over the real examples (``dew.data.from_records`` does this).
    records: number of training examples (used for epochs in logs; 0 = unknown).
    batch: the global batch size, in examples, summed over all processes.
    """

    train: Callable[[Partition], Iterator[Batch]]
    val: Callable[[Partition], Iterable[Batch]] | None
    records: int
    batch: int

    def __post_init__(self):
        if not callable(self.train):
            raise TypeError(
                f"Dataset.train must be a function of a Partition returning an iterator, "
                f"got {type(self.train).__name__}"
            )
        if self.val is not None and not callable(self.val):
            raise TypeError(
                f"Dataset.val must be None or a function of a Partition, "
                f"got {type(self.val).__name__}"
            )
        if self.batch < 1:
            raise ValueError(f"Dataset.batch must be >= 1 examples, got {self.batch}")
        if self.records < 0:
            raise ValueError(f"Dataset.records must be >= 0, got {self.records}")

"""``Dataset`` (two iterator factories and its batch spec), ``Field`` (one key's rows)
and ``Partition`` (one process's share)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Field:
    """The shape and dtype of one row of a batch key.

    shape: the shape of one example's array, without the batch axis: ``(65,)``
      for windows of 65 token ids, ``()`` for a label.
    dtype: a numpy dtype or its name (``"int32"``, ``"uint8"``, ``"bool"``);
      kept as a ``numpy.dtype``.

    A batch of ``rows`` examples holds, under this key, an array of
    ``(rows, *shape)`` and ``dtype`` (:meth:`rows`).
    """

    shape: tuple[int, ...]
    dtype: Any

    def __post_init__(self):
        try:
            shape = tuple(int(size) for size in self.shape)
        except TypeError:
            raise TypeError(
                f"Field.shape must be a tuple of ints, got {self.shape!r}; write (65,) for "
                f"a vector of 65 and () for a scalar"
            ) from None
        if any(size < 0 for size in shape):
            raise ValueError(f"Field.shape must hold sizes >= 0, got {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    def rows(self, count: int) -> tuple[int, ...]:
        """The shape of this key in a batch of ``count`` rows: ``(count, *shape)``."""
        return (count, *self.shape)

    @classmethod
    def of(cls, array: Any) -> Field:
        """The field of each row of a batched array (its shape past the first axis)."""
        array = np.asarray(array)
        if array.ndim < 1:
            raise ValueError(
                f"a batch array needs a leading rows axis, got a scalar of {array.dtype}"
            )
        return cls(array.shape[1:], array.dtype)


Spec = Mapping[str, Field]
EXAMPLE_MASK = "example_mask"


def spec_of_batch(batch: Batch) -> dict[str, Field]:
    """The spec a batch has: ``{key: Field(per-row shape, dtype)}``, keys sorted."""
    return {key: Field.of(batch[key]) for key in sorted(batch)}


def as_spec(spec: Mapping[str, Any], *, what: str = "Dataset.spec") -> dict[str, Field]:
    """``spec`` with every value a :class:`Field` (a ``(shape, dtype)`` pair is made one)."""
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"{what} must be a dict of batch key -> Field(shape, dtype), got {type(spec).__name__}"
        )
    out = {}
    for key, value in spec.items():
        if not isinstance(value, Field):
            try:
                shape, dtype = value
            except (TypeError, ValueError):
                raise TypeError(
                    f"{what}[{key!r}] must be a Field(shape, dtype) or a (shape, dtype) pair, "
                    f"got {value!r}"
                ) from None
            value = Field(shape, dtype)
        out[key] = value
    if EXAMPLE_MASK in out:
        raise ValueError(
            f"{what} declares {EXAMPLE_MASK!r}, which only validation batches carry and "
            f"the Dataset adds itself (Dataset.val_spec); leave it out of the spec"
        )
    return out


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
    records: the number of training examples in one epoch, after the
      validation examples are held out (0 = unknown, e.g. a generated
      stream). Logs count epochs with it, and a global ``batch`` above it is
      an error in the readers and the trainer: one batch would hold some
      examples twice.
    batch: the global batch size, in examples, summed over all processes.
    spec: each batch key's per-row shape and dtype, ``{key: Field(shape,
      dtype)}`` (a ``(shape, dtype)`` pair is taken as a Field): what the
      model is built for, stated once by the reader (``seq_len``, image size,
      frames). Training batches hold exactly these keys, each ``(rows,
      *shape)``; validation batches hold them plus ``example_mask``
      (:attr:`val_spec`). None = not declared (a Dataset built by hand from
      iterators); the trainer then reads it from the first batch.
    """

    train: Callable[[Partition], Iterator[Batch]]
    val: Callable[[Partition], Iterable[Batch]] | None
    records: int
    batch: int
    spec: Spec | None = None

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
        if self.spec is not None:
            object.__setattr__(self, "spec", as_spec(self.spec))

    def spec_of(self, key: str) -> Field:
        """The :class:`Field` of batch key ``key``; a KeyError names the keys there are."""
        if self.spec is None:
            raise KeyError(
                f"this Dataset declares no spec (spec=None), so the shape of {key!r} is not "
                f"known before a batch is read; pass spec={{key: Field(shape, dtype)}} to "
                f"Dataset, or read it from a batch with dew.data.spec_of_batch"
            )
        if key not in self.spec:
            raise KeyError(
                f"no batch key {key!r} in this Dataset; its keys are {sorted(self.spec)}"
            )
        return self.spec[key]

    @property
    def val_spec(self) -> dict[str, Field] | None:
        """The spec of validation batches: :attr:`spec` plus ``example_mask``, bool per row."""
        if self.spec is None:
            return None
        return {**self.spec, EXAMPLE_MASK: Field((), np.bool_)}

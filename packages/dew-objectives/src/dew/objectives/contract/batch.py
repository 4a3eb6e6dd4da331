"""The batch contract: the fields an objective reads, matched against the data.

An objective declares what it reads (:meth:`Objective.batch_fields`): per key,
the shape of one row and the dtypes it accepts. A size is a number or a
symbol (``"length"``): a symbol binds to the first size it meets and every
other use of it must agree, so ``chosen`` and ``chosen_mask`` of one length
is one declaration. :func:`check_batch_spec` compares the declaration with a
dataset's ``Dataset.spec`` (``{key: Field(shape per row, dtype)}``) once,
before anything is compiled, with one error naming the key, the shape wanted
and the shape given; :meth:`Objective.check_batch` compares it with a batch's
own spec (:func:`spec_of`) when the data declared none. What is left to an
objective is the values (out-of-vocabulary ids, ties, empty completions):
:func:`check_token_ids` and :func:`first_row` are the shared parts of those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

IDS = ("integer",)
MASK = ("bool", "integer", "floating")  # 0/1 masks and loss weights
PIXELS = ("uint8", "floating")
FLOATS = ("floating",)
_KINDS = {"integer": np.integer, "bool": np.bool_, "floating": np.floating}


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One batch key an objective reads.

    key: the batch key.
    shape: one row's shape (no batch axis); each size an int, or a symbol (a
      str) that takes the first size it meets; every use of a symbol in one
      declaration must agree. None = any row shape (a model that does not state
      its input's: only the key and the dtype are matched).
    dtype: the dtypes accepted: kinds ``"integer"``, ``"bool"``, ``"floating"``
      or numpy dtype names (``"uint8"``).
    required: False = read when present (precomputed reference log-probs).
    note: how the objective derives the shape, shown in errors
      (``"seq_len + 1 = 9"``).
    """

    key: str
    shape: tuple[int | str, ...] | None
    dtype: tuple[str, ...]
    required: bool = True
    note: str = ""

    def accepts(self, dtype) -> bool:
        dtype = np.dtype(dtype)
        return any(
            np.issubdtype(dtype, _KINDS[k]) if k in _KINDS else dtype == np.dtype(k)
            for k in self.dtype
        )

    def wanted(self, sizes: Mapping[str, int]) -> str:
        """``[rows, length = 12] integer`` with the sizes bound so far."""
        if self.shape is None:
            return f"[rows, ...] {'|'.join(self.dtype)}"
        dims = [f"{d} = {sizes[d]}" if isinstance(d, str) and d in sizes else d for d in self.shape]
        note = f" ({self.note})" if self.note else ""
        return f"{_rows(dims)} {'|'.join(self.dtype)}{note}"


def _rows(dims, rows=None) -> str:
    """``(8, 6)`` for a batch of known rows, ``[rows, 6]`` for a spec."""
    if rows is not None:
        return str((rows, *dims))
    return f"[{', '.join(map(str, ('rows', *dims)))}]"


def spec_of(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A batch's own spec: ``{key: (shape per row, dtype)}`` (the rows axis dropped)."""
    out = {}
    for key, value in batch.items():
        shape, dtype = np.shape(value), getattr(value, "dtype", None)
        dtype = np.asarray(value).dtype if dtype is None else dtype
        out[key] = _Given(tuple(shape[1:]), dtype, shape[0] if shape else None)
    return out


@dataclasses.dataclass(frozen=True)
class _Given:
    shape: tuple[int, ...]
    dtype: Any
    rows: int | None = None


def check_batch_spec(
    fields: Sequence[BatchField], spec: Mapping[str, Any], *, what: str
) -> dict[str, int]:
    """Match ``fields`` (an objective's declaration) against ``spec`` (``Dataset.spec``
    or :func:`spec_of` a batch: values with ``.shape`` per row and ``.dtype``).

    Returns the sizes the symbols bound (``{"length": 12}``). Raises ``KeyError`` for
    a missing required key, ``ValueError`` for a shape and ``TypeError`` for a dtype
    the objective does not read, each naming the key, what ``what`` wants and what
    the data gives.
    """
    sizes: dict[str, int] = {}
    for field in fields:
        if field.key not in spec:
            if not field.required:
                continue
            raise KeyError(
                f"{what} reads batch[{field.key!r}] {field.wanted(sizes)}, which the data "
                f"does not have (it has {sorted(spec)}); use a reader that makes it or rename "
                f"the key in the objective"
            )
        given = spec[field.key]
        shape = tuple(int(s) for s in given.shape)
        fits = field.shape is None or len(shape) == len(field.shape)
        # another rank binds no symbol: the error shows the declaration as it is
        for want, size in zip(field.shape or (), shape if fits else (), strict=False):
            if isinstance(want, str):
                fits &= sizes.setdefault(want, size) == size
            else:
                fits &= want == size
        if not fits:
            rows = given.rows if isinstance(given, _Given) else None  # a batch's, not a spec's
            raise ValueError(
                f"batch[{field.key!r}] has shape {_rows(shape, rows)}, but {what} reads "
                f"{field.wanted(sizes)}; make the data and the objective agree"
            )
        if not field.accepts(given.dtype):
            raise TypeError(
                f"batch[{field.key!r}] holds {np.dtype(given.dtype)}, but {what} reads "
                f"{field.wanted(sizes)}; convert it in the reader"
            )
    return sizes


def check_token_ids(ids: np.ndarray, vocab_size: int | None, *, key: str, what: str) -> None:
    """Integer ids in ``[0, vocab_size)``, or an error naming the key and the bad id."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"batch[{key!r}] must hold integer ids, got {ids.dtype}")
    if vocab_size is None or not ids.size:
        return
    largest, smallest = int(ids.max()), int(ids.min())
    if largest >= vocab_size or smallest < 0:
        bad = largest if largest >= vocab_size else smallest
        raise ValueError(
            f"batch[{key!r}] holds token id {bad} outside {what}'s vocabulary (vocab_size "
            f"{vocab_size}, largest id {largest}, smallest {smallest}); check the tokenizer "
            f"matches the model"
        )


def first_row(flags: np.ndarray) -> tuple[int, int] | None:
    """``(first row where flags is True, how many)``, or None when none is."""
    rows = np.flatnonzero(np.asarray(flags))
    return (int(rows[0]), int(rows.size)) if rows.size else None

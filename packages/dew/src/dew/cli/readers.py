"""``NpzArrays``: rows of arrays from a ``.npz`` file, for recipes whose data is
already arrays (small image sets, features); the rest is ``dew.data.from_records``."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

__all__ = ["NpzArrays"]


class _Rows:
    def __init__(self, arrays: dict[str, np.ndarray], rows: np.ndarray):
        self.arrays, self.rows = arrays, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[self.rows[index]] for k, v in self.arrays.items()}

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        take = self.rows[np.asarray(indices)]
        return {k: v[take] for k, v in self.arrays.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class NpzArrays:
    """path: a ``.npz`` file whose arrays share their first dimension (rows).
    keys: the arrays to read (batch key = array name); () = all of them.
    val_fraction: the last rows held out for validation (0 = none).
    seed: shuffle seed of the training rows."""

    path: str
    keys: tuple[str, ...] = ()
    val_fraction: float = 0.0
    seed: int = 0
    read_threads: int = 0
    prefetch: int = 2

    def load(self, *, batch: int):
        from dew.data import from_records

        if not os.path.exists(self.path):
            raise FileNotFoundError(f"NpzArrays: no file {self.path!r}")
        with np.load(self.path) as npz:
            keys = self.keys or tuple(npz.files)
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise ValueError(
                    f"NpzArrays: {self.path} has no array {missing[0]!r} ({npz.files})"
                )
            arrays = {k: npz[k] for k in keys}
        rows = {len(v) for v in arrays.values()}
        if len(rows) != 1:
            raise ValueError(f"NpzArrays: the arrays of {self.path} differ in rows: {rows}")
        (n,) = rows
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"NpzArrays: val_fraction must be in [0, 1), got {self.val_fraction}")
        held = int(round(n * self.val_fraction))
        train = _Rows(arrays, np.arange(n - held))
        val = _Rows(arrays, np.arange(n - held, n)) if held else None
        return from_records(
            train,
            val,
            batch=batch,
            seed=self.seed,
            read_threads=self.read_threads,
            prefetch=self.prefetch,
            name="NpzArrays",
        )

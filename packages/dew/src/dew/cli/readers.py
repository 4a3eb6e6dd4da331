"""Readers only recipes need: ``NpzArrays`` (rows of arrays from a ``.npz`` file, for
recipes whose data is already arrays; the rest is ``dew.data.from_records``) and
``MixtureOf`` (a ``dew.data.Mixture`` of readers named as recipes name them)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

__all__ = ["MixtureOf", "NpzArrays"]


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureOf:
    """A recipe's ``dew.data.Mixture`` (``data: {name: mixture, args: {sources: [...]}}``).

    sources: one entry a source: ``{name, reader, weight, args}``; ``reader`` is a
      reader's short name (``token_windows``, ...) or ``module:Class``, ``args`` its
      arguments (the tokenizer is the recipe's), ``weight`` its share (>= 0).
    schedule: ``[{step, weights: {name: weight}}]``: the weights from global batch
      ``step`` on.
    exhausted, read_threads, prefetch: as ``dew.data.Mixture``'s.
    tokenizer: set by the command.
    """

    sources: list[dict[str, Any]]
    schedule: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    exhausted: str = "repeat"
    read_threads: int = 2
    prefetch: int = 4
    tokenizer: Any = None

    def load(self, *, batch: int):
        from dew.cli.recipe import READERS, RecipeError, checked_arguments, resolve
        from dew.data import Mixture

        readers, weights = {}, {}
        for index, source in enumerate(self.sources):
            where = f"data.args.sources[{index}]"
            unknown = sorted(set(source) - {"name", "reader", "weight", "args"})
            if unknown or "name" not in source or "reader" not in source:
                raise RecipeError(
                    f"{where} must be {{name, reader, weight, args}}, got keys {sorted(source)}"
                )
            cls = resolve(source["reader"], READERS, "reader")
            fields = [f.name for f in dataclasses.fields(cls) if f.init]
            supplied = {"tokenizer": self.tokenizer} if "tokenizer" in fields else {}
            args = checked_arguments(
                cls, source.get("args", {}), f"{where}.args", supplied=supplied
            )
            readers[source["name"]] = cls(**args)
            weights[source["name"]] = source.get("weight", 1.0)
        stages = [(stage.get("step"), stage.get("weights")) for stage in self.schedule]
        return Mixture(
            readers,
            weights,
            schedule=stages,
            exhausted=self.exhausted,
            read_threads=self.read_threads,
            prefetch=self.prefetch,
        ).load(batch=batch)

"""Losses and metrics that carry their weight, so means are exact wherever they are split.

A mean over a batch is a ``Weighted(total, weight)``: ``total`` is the sum of
the per-item values times their weights, ``weight`` the sum of the weights
(token count, pair count, rows). Microbatches, data-parallel shards, processes
and evaluation batches add totals and weights separately and divide once at
the end (Praxis ``WeightedScalars``, Tunix's accumulator with a denominator,
flax lm1b's ``(sum, count)`` metrics), so ``accumulate=4`` on 8 devices gives
the same number as one full batch on one device even when rows carry
different weights (loss masks, padding, unequal completions).

What an objective may return:

- ``loss``: a plain scalar (the seed's form: a mean with **equal weight per
  example row**), one :class:`Weighted`, or a tuple of ``Weighted`` terms
  (e.g. a per-token NLL plus a per-row auxiliary loss); the optimized value
  is ``sum_t total_t / weight_t`` over the whole global batch.
- ``metrics``: a dict whose values are plain scalars (means with equal weight
  per row), :class:`Weighted` (means with their own weight) or
  :class:`Summed` (totals, such as a token count).

:func:`reduce` turns accumulated metrics into the numbers people read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Weighted:
    """A mean carried as a sum and its weight: ``value = total / weight``."""

    total: jax.Array
    weight: jax.Array

    @classmethod
    def mean(cls, values: jax.Array, weights: jax.Array | None = None) -> Weighted:
        """The weighted mean of ``values`` (``weights`` broadcast against them;
        None = weight 1 each)."""
        values = jnp.asarray(values, jnp.float32)
        if weights is None:
            weights = jnp.ones_like(values)
        weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), values.shape)
        return cls(total=jnp.sum(values * weights), weight=jnp.sum(weights))

    @classmethod
    def of(cls, value: jax.Array, weight: jax.Array) -> Weighted:
        """A mean ``value`` that was taken over ``weight`` items."""
        weight = jnp.asarray(weight, jnp.float32)
        return cls(total=jnp.asarray(value, jnp.float32) * weight, weight=weight)

    @property
    def value(self) -> jax.Array:
        """``total / weight``; NaN when the weight is 0 (nothing was counted)."""
        return self.total / self.weight

    def __float__(self) -> float:
        return float(self.value)

    def scale(self, factor) -> Weighted:
        """``factor * value`` with the same weight (a loss coefficient)."""
        return Weighted(total=self.total * factor, weight=self.weight)

    def __add__(self, other: Weighted) -> Weighted:
        return Weighted(total=self.total + other.total, weight=self.weight + other.weight)


@flax.struct.dataclass
class Summed:
    """A total that adds up over microbatches, shards and batches (a count)."""

    total: jax.Array

    @property
    def value(self) -> jax.Array:
        return self.total

    def __float__(self) -> float:
        return float(self.total)

    def __add__(self, other: Summed) -> Summed:
        return Summed(total=self.total + other.total)


def is_metric(x: Any) -> bool:
    return isinstance(x, (Weighted, Summed))


def loss_terms(loss: Any, rows: int) -> tuple[Weighted, ...]:
    """The loss as ``Weighted`` terms; a plain scalar is a mean over ``rows`` rows."""
    if isinstance(loss, Weighted):
        return (loss,)
    if isinstance(loss, Sequence) and loss and all(isinstance(t, Weighted) for t in loss):
        return tuple(loss)
    if isinstance(loss, Summed) or isinstance(loss, Mapping):
        raise TypeError(
            f"an objective's loss must be a scalar, a Weighted or a tuple of Weighted terms; "
            f"got {type(loss).__name__}"
        )
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise TypeError(
            f"an objective's loss must be a scalar (or Weighted), got an array of shape "
            f"{loss.shape}; reduce it with a mean, or return Weighted.mean(values, weights)"
        )
    return (Weighted.of(loss, rows),)


def loss_value(terms: Sequence[Weighted]) -> jax.Array:
    """``sum_t total_t / weight_t``: the number that is optimized and logged."""
    return sum(t.value for t in terms)


def as_metrics(metrics: Mapping[str, Any], rows: int) -> dict[str, Weighted | Summed]:
    """Every metric as ``Weighted`` or ``Summed``; a plain scalar is a mean over ``rows`` rows."""
    out: dict[str, Weighted | Summed] = {}
    for name, value in metrics.items():
        if is_metric(value):
            out[name] = value
            continue
        value = jnp.asarray(value)
        if value.shape != ():
            raise TypeError(
                f"metric {name!r} has shape {value.shape}; metrics are scalars, Weighted "
                f"means or Summed totals (use Weighted.mean(values, weights))"
            )
        out[name] = Weighted.of(value, rows)
    return out


def add(a, b):
    """Add two metric trees of the same structure (totals and weights separately)."""
    return jax.tree.map(lambda x, y: x + y, a, b, is_leaf=is_metric)


def reduce(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The values people read: ``total / weight`` for means, totals for sums."""
    return {name: (value.value if is_metric(value) else value) for name, value in metrics.items()}


def to_float(metrics: Mapping[str, Any]) -> dict[str, float]:
    """:func:`reduce` on host values, as Python floats (for logs)."""
    return {name: float(value) for name, value in reduce(metrics).items()}

"""A step's metrics leave the device as one array per dtype, not one per metric.

The compiled step returns a pytree of scalars (``loss``, ``grad_norm``, each
:class:`~dew.objectives.Weighted` metric's total and weight, ...). Fetching it
costs one device-to-host transfer per leaf; on a CPU host, where Python shares
the cores with the step, that is measurable (about 0.1 ms a leaf). Inside the
program the leaves are concatenated per dtype (float32 values stay float32,
integer counts stay integers, so nothing is rounded), and :meth:`Packing.unpack`
rebuilds the same pytree of numpy values on the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Packing:
    """Where each leaf of the metrics tree sits in the packed arrays; filled in
    when the step is traced (:func:`packed_step`)."""

    treedef: Any = None
    # per leaf: (group index, offset, shape)
    places: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    dtypes: list[str] = dataclasses.field(default_factory=list)

    def pack(self, tree) -> tuple[jax.Array, ...]:
        leaves, self.treedef = jax.tree.flatten(tree)
        groups: dict[str, list[jax.Array]] = {}
        sizes: dict[str, int] = {}
        self.places = []
        for leaf in leaves:
            leaf = jnp.asarray(leaf)
            name = str(leaf.dtype)
            groups.setdefault(name, [])
            offset = sizes.get(name, 0)
            self.places.append((list(groups).index(name), offset, tuple(leaf.shape)))
            groups[name].append(leaf.reshape(-1))
            sizes[name] = offset + math.prod(leaf.shape)
        self.dtypes = list(groups)
        return tuple(jnp.concatenate(parts) for parts in groups.values())

    def unpack(self, packed) -> Any:
        """The metrics tree from fetched (numpy) packed arrays (views into them; a
        scalar leaf, nearly all of them, is a 0-d view: one index, ~0.1 us a leaf)."""
        arrays = [np.asarray(a) for a in packed]
        leaves = [
            arrays[g][o, ...] if not shape else arrays[g][o : o + math.prod(shape)].reshape(shape)
            for g, o, shape in self.places
        ]
        return jax.tree.unflatten(self.treedef, leaves)


def packed_step(step_fn: Callable) -> tuple[Callable, Packing]:
    """``(state, batch, *args) -> (state, packed metrics)`` and the :class:`Packing` that
    unpacks them (complete once the returned function has been traced)."""
    packing = Packing()

    def step(state, batch, *args):
        state, metrics = step_fn(state, batch, *args)
        return state, packing.pack(metrics)

    return step, packing

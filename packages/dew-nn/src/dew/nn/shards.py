"""How many ways the current mesh and logical-axis rules split a logical axis.

Model code names logical axes only; the trainer sets the mesh
(``jax.set_mesh``) and the rules (``nn.logical_axis_rules``). A sharding
constraint on a dimension that does not divide over its mesh axes is
silently dropped (the array stays replicated), so modules check the
dimensions they split with :func:`check_divides` while tracing, before
anything is compiled.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax


def mesh_axes_of(logical_axis: str) -> tuple[str, ...]:
    """The mesh axes ``logical_axis`` is split over now; () outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    spec = nn.logical_to_mesh_axes((logical_axis,))
    names = spec[0] if spec else None
    if names is None:
        return ()
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(n for n in names if n in mesh.shape)


def shard_count(logical_axis: str) -> int:
    """Number of shards ``logical_axis`` is split into now (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(int(mesh.shape[n]) for n in mesh_axes_of(logical_axis))


def check_divides(size: int, logical_axis: str, what: str) -> None:
    """Raise ``ValueError`` unless ``size`` divides over the mesh axes of ``logical_axis``."""
    ways = shard_count(logical_axis)
    if size % ways:
        names = "x".join(mesh_axes_of(logical_axis))
        raise ValueError(
            f"{what}: {logical_axis!r} of size {size} does not divide over mesh axis {names} "
            f"of size {ways}; make that {logical_axis} size a multiple of {ways} or use a "
            f"smaller MeshSpec.{names.split('x')[0]}"
        )

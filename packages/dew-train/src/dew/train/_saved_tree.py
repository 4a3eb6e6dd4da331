"""The tree Orbax writes for a ``TrainState``, and back."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dew.train.state import TrainState

SAVED_NAMES = {"params_by_role": "params", "averaged_by_role": "averaged"}
"""The state's fields under their names on disk (the other fields keep theirs)."""


def to_saved(state: TrainState, *, shardings: TrainState | None = None) -> dict[str, Any]:
    """The tree Orbax writes: the TrainState's fields, a typed PRNG key as its
    key data (``jax.random.key_data``). With ``shardings``, ``state`` is
    abstract and the result a tree of ``jax.ShapeDtypeStruct`` to restore into. The
    trained parameters are saved as ``params`` and their average as ``averaged``
    (:data:`SAVED_NAMES`)."""
    fields = {saved_name(f.name): getattr(state, f.name) for f in array_fields(state)}
    if shardings is None:
        if is_typed_key(fields["key"]):
            fields["key"] = jax.random.key_data(fields["key"])
        return fields
    sharding_of = {saved_name(f.name): getattr(shardings, f.name) for f in array_fields(shardings)}
    out = {}
    for name, value in fields.items():
        if name == "key" and is_typed_key(value):
            data = jax.eval_shape(jax.random.key_data, value)
            out[name] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding_of[name])
        else:
            out[name] = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                value,
                sharding_of[name],
            )
    return out


def array_fields(state: TrainState):
    """The fields holding arrays (not static ones such as ``lora_views``, which the
    run's own abstract state carries)."""
    return [f for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]


def from_saved(tree: dict[str, Any], *, key_impl: Any, key_sharding: Any) -> TrainState:
    """The TrainState of a tree read back by :func:`to_saved`'s inverse."""
    fields = {_FIELD_NAMES.get(name, name): value for name, value in tree.items()}
    if key_impl is not None:
        fields["key"] = jax.device_put(
            jax.random.wrap_key_data(fields["key"], impl=key_impl), key_sharding
        )
    return TrainState(**fields)


def saved_name(field: str) -> str:
    return SAVED_NAMES.get(field, field)


_FIELD_NAMES = {saved: field for field, saved in SAVED_NAMES.items()}


def is_typed_key(value) -> bool:
    return jnp.issubdtype(value.dtype, jax.dtypes.prng_key)

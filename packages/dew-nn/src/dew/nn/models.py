"""The model registry: build a registered module by name, and recover the
name and configuration of a built one so a saved run can rebuild it.

    >>> from dew.nn import models
    >>> model = models.build("causal_transformer", vocab_size=256, emb_features=64,
    ...                      num_layers=2, num_heads=4, mlp_features=256, max_seq_len=128)
    >>> name, config = models.config_of(model)
    >>> models.build(name, **config) == model
    True
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

_REGISTRY: dict[str, type[nn.Module]] = {}

# Module fields that belong to Flax, not to the model's configuration.
_FLAX_FIELDS = ("parent", "name")


def register(name: str):
    """Class decorator: register a ``flax.linen.Module`` under ``name``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"model name {name!r} is already registered to "
                f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}; pick another name"
            )
        _REGISTRY[name] = cls
        cls.registry_name = name
        return cls

    return wrap


def names() -> list[str]:
    """The registered model names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type[nn.Module]:
    """The class registered under ``name``; an unknown name lists the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(
            f"unknown model name {name!r}; registered models: {', '.join(names())}.{hint}"
        ) from None


def build(name: str, **config: Any) -> nn.Module:
    """Build the module registered under ``name`` with keyword ``config``."""
    cls = get(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.name not in _FLAX_FIELDS}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise TypeError(
            f"{name!r} ({cls.__qualname__}) has no option(s) {unknown}; "
            f"its options are: {', '.join(sorted(fields))}"
        )
    return cls(**{k: _canonical_dtype(v) for k, v in _decode(cls, config).items()})


def _canonical_dtype(value: Any) -> Any:
    """A dtype as its ``jax.numpy`` scalar type (``jnp.float32``), however it is spelt
    (``np.dtype('float32')`` from a saved config, ``np.float32``, ``jnp.float32``): equal
    and of equal hash, so a model rebuilt from its saved config hits the compiled-program
    caches of the original. Anything else is returned as it is."""
    if isinstance(value, np.dtype) or (isinstance(value, type) and hasattr(value, "dtype")):
        return getattr(jnp, jnp.dtype(value).name, value)
    return value


def config_of(module: nn.Module) -> tuple[str, dict[str, Any]]:
    """``(registry name, JSON-serialisable config)`` of a registered module.

    ``models.build(*config_of(m))`` rebuilds a module equal to ``m``.
    """
    name = getattr(type(module), "registry_name", None)
    if name is None or _REGISTRY.get(name) is not type(module):
        raise ValueError(
            f"{type(module).__qualname__} is not registered; decorate it with "
            f"@models.register('name') so runs can rebuild it"
        )
    config = {}
    for field in dataclasses.fields(module):
        if field.name in _FLAX_FIELDS or not field.init:
            continue
        config[field.name] = _encode(getattr(module, field.name))
    return name, config


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__dataclass__": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, jnp.dtype) or (isinstance(value, type) and hasattr(value, "dtype")):
        return {"__dtype__": jnp.dtype(value).name}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(cls: type[nn.Module], config: dict[str, Any]) -> dict[str, Any]:
    decoders = getattr(cls, "config_decoders", {})
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and "__dtype__" in value:
            value = jnp.dtype(value["__dtype__"])
        elif isinstance(value, dict) and "__dataclass__" in value and key in decoders:
            fields = {k: v for k, v in value.items() if k != "__dataclass__"}
            value = decoders[key](**fields)
        elif key in decoders and isinstance(value, dict):
            value = decoders[key](**value)
        out[key] = value
    return out

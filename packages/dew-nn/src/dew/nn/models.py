"""The model registry: build a registered module by name, and recover the
name and configuration of a built one so a saved run can rebuild it.

    >>> from dew.nn import models
    >>> model = models.build("causal_transformer", vocab_size=256, emb_features=64,
    ...                      num_layers=2, num_heads=4, mlp_features=256, max_seq_len=128)
    >>> name, config = models.config_of(model)
    >>> models.build(name, **config) == model
    True
    >>> models.config_differences(("causal_transformer", {**config, "emb_features": 32}), model)
    ['emb_features: 32 in the saved model, 64 in this one']
"""

from __future__ import annotations

import dataclasses
import difflib
import json
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


def _record(model: Any) -> tuple[str | None, dict[str, Any]]:
    """``(name, config)`` of a registered module, a ``(name, config)`` pair or a
    ``{"name": ..., "config": ...}`` record (as checkpoints store it), in JSON form."""
    if isinstance(model, nn.Module):
        name, config = config_of(model)
    elif isinstance(model, dict):
        name, config = model.get("name"), model.get("config") or {}
    else:
        name, config = model
    # one spelling for both sides: tuples as lists, dtypes as {"__dtype__": ...},
    # dataclass options (RopeScaling, MaskPolicy) as the dicts config_of writes
    config = {key: _encode(value) for key, value in config.items()}
    return name, json.loads(json.dumps(config, default=str))


def config_differences(
    saved: Any,
    current: Any,
    *,
    saved_label: str = "the saved model",
    current_label: str = "this one",
) -> list[str]:
    """One line per configuration field where two models differ, with both values.

    saved, current: a registered module, a ``(name, config)`` pair
      (:func:`config_of`) or a ``{"name", "config"}`` record (a checkpoint's).
      A field one side does not record counts as its default (configs saved
      before the field existed).
    saved_label, current_label: how the lines name the two sides.

    For errors about weights of another size: the fields that differ, not the
    whole configuration of either model.
    """
    saved_name, saved_config = _record(saved)
    name, config = _record(current)
    if saved_name != name:
        return [f"model: {saved_name!r} in {saved_label}, {name!r} in {current_label}"]
    defaults = {}
    if name in _REGISTRY:
        for field in dataclasses.fields(_REGISTRY[name]):
            if field.name not in _FLAX_FIELDS and field.default is not dataclasses.MISSING:
                defaults[field.name] = _record((name, {field.name: _encode(field.default)}))[1][
                    field.name
                ]
    missing = object()
    lines = []
    for key in sorted(set(saved_config) | set(config)):
        a = saved_config.get(key, defaults.get(key, missing))
        b = config.get(key, defaults.get(key, missing))
        if a != b:
            a, b = (_shown(v, missing) for v in (a, b))
            lines.append(f"{key}: {a} in {saved_label}, {b} in {current_label}")
    return lines


def _shown(value: Any, missing: object) -> str:
    if value is missing:
        return "(not recorded)"
    if isinstance(value, dict) and set(value) == {"__dtype__"}:
        return value["__dtype__"]
    return json.dumps(value)

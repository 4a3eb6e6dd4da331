"""The objective names recipes use, registered next to each family.

    @registry.register("grpo")
    @dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
    class GRPOObjective(Objective): ...

:func:`get` returns the class of a name; :data:`OBJECTIVES` is the read-only mapping
``name -> "module:Class"`` the ``dew`` command resolves a recipe's ``objective.name``
with. Both import the family folders (:data:`FAMILY_FOLDERS`) on first use, so every
family has registered itself by then; the contract imports none of them itself.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Iterator, Mapping

PACKAGE = "dew.objectives"
FAMILY_FOLDERS = ("language", "preference", "rl", "diffusion", "jepa")

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(name: str):
    """Class decorator: register an objective class under ``name`` (an identifier,
    unique: a second class under a taken name is a ValueError naming the first)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"an objective name is an identifier (lm, grpo), got {name!r}")

    def wrap(cls: type) -> type:
        taken = _REGISTRY.get(name)
        if taken is not None and _path(taken) != _path(cls):
            raise ValueError(
                f"objective name {name!r} is already registered to {_path(taken)}; "
                f"pick another name for {_path(cls)}"
            )
        _REGISTRY[name] = cls
        return cls

    return wrap


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_families() -> None:
    """Import every module of the family folders once: each registers its names."""
    global _loaded
    if _loaded:
        return
    for folder in FAMILY_FOLDERS:
        package = importlib.import_module(f"{PACKAGE}.{folder}")
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            if not info.name.rpartition(".")[2].startswith("_"):
                importlib.import_module(info.name)
    _loaded = True


def names() -> list[str]:
    """The registered objective names, sorted."""
    _load_families()
    return sorted(_REGISTRY)


def get(name: str) -> type:
    """The objective class registered under ``name``; an unknown name is a KeyError
    listing the registered ones and the nearest."""
    _load_families()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(unknown(name)) from None


def unknown(name: str) -> str:
    """The message for an objective name that is not registered."""
    close = difflib.get_close_matches(str(name), names(), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown objective {name!r}{hint} registered objectives: {', '.join(names())}"


class _Paths(Mapping[str, str]):
    """``name -> "module:Class"`` of every registered objective, read on use."""

    def __getitem__(self, name: str) -> str:
        _load_families()
        return _path(_REGISTRY[name])

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __len__(self) -> int:
        return len(names())

    def __repr__(self) -> str:
        return f"OBJECTIVES({dict(self)!r})"


OBJECTIVES: Mapping[str, str] = _Paths()

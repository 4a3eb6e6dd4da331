"""Checks of configuration arguments: unknown keywords answered with the valid
names and the nearest match, and :func:`is_whole_number` for counts and ids.

Config classes across Dew (``Trainer``, ``Checkpoints``, ``MeshSpec``,
``Sampling``) are keyword-heavy; a typo should say which name was meant,
not only that one was unexpected::

    @check_keywords
    @dataclasses.dataclass(frozen=True)
    class Sampling: ...

    Sampling(temprature=0)
    # TypeError: Sampling got unknown keyword(s) 'temprature' (did you mean
    # 'temperature'?); valid: temperature, top_k, ...
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np


def is_whole_number(value: Any) -> bool:
    """An ``int`` or numpy integer: a count or a token id (not a bool, not a
    float such as 2.0)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def unknown_keywords(where: str, unknown: Sequence[str], valid: Sequence[str]) -> str:
    """The message for ``unknown`` keywords given to ``where``."""
    parts = []
    for name in unknown:
        near = difflib.get_close_matches(name, valid, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return f"{where} got unknown keyword(s) {', '.join(parts)}; valid: {', '.join(valid)}"


def check_keywords(cls):
    """Wrap ``cls.__init__`` so unknown keywords raise :func:`unknown_keywords`'s
    TypeError; the signature and docstring stay the class's own."""
    init = cls.__init__
    signature = inspect.signature(init)
    names = [
        n
        for n, p in signature.parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise TypeError(unknown_keywords(cls.__name__, unknown, names))
        init(self, *args, **kwargs)

    cls.__init__ = checked
    return cls

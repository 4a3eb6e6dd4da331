"""Checks of configuration arguments: unknown keywords answered with the valid
names and the nearest match; :func:`is_whole_number`, :func:`is_real_number` and the
checkers :func:`whole_number` and :func:`real_number`, which accept a number in every
numeric form (Python, numpy scalars, 0-d arrays) and refuse bools and non-finite values.

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
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np


def _scalar(value: Any) -> Any:
    """A 0-d numpy (or JAX) array as its Python scalar; anything else as it is."""
    if getattr(value, "shape", None) == () and hasattr(value, "dtype") and hasattr(value, "item"):
        if not isinstance(value, np.generic):
            return value.item() if np.dtype(value.dtype).kind in "biuf" else value
    return value


def is_whole_number(value: Any) -> bool:
    """An integer in any numeric form: ``int``, a numpy integer, a 0-d integer array
    (a count or a token id; not a bool, not a float such as 2.0)."""
    value = _scalar(value)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def is_real_number(value: Any) -> bool:
    """A finite real number in any numeric form: ``int``, ``float``, numpy scalars,
    0-d arrays (not a bool, a complex number, NaN or an infinity)."""
    value = _scalar(value)
    if not isinstance(value, numbers.Real) or isinstance(value, bool | np.bool_):
        return False
    return math.isfinite(value)


def _range(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return "(any value)"


def whole_number(
    value: Any,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    meaning: str = "",
    what: str = "",
) -> int:
    """``value`` as an ``int`` when it is a whole number in ``[low, high]`` (None = no
    bound), else a ValueError naming ``what``, the value, the range and ``meaning``."""
    if is_whole_number(value):
        number = int(_scalar(value))
        if (low is None or number >= low) and (high is None or number <= high):
            return number
    raise ValueError(
        f"{what + ': ' if what else ''}{name}={value!r} must be a whole number "
        f"{_range(low, high, False, False)}{f' ({meaning})' if meaning else ''}"
    )


def real_number(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    meaning: str = "",
    what: str = "",
) -> float:
    """``value`` as a ``float`` when it is a finite real number in the range (``low`` /
    ``high`` None = unbounded; ``*_open`` excludes the end), else a ValueError naming
    ``what``, the value, the range and ``meaning``."""
    if is_real_number(value):
        number = float(_scalar(value))
        above = low is None or (number > low if low_open else number >= low)
        below = high is None or (number < high if high_open else number <= high)
        if above and below:
            return number
    raise ValueError(
        f"{what + ': ' if what else ''}{name}={value!r} must be a finite number "
        f"{_range(low, high, low_open, high_open)}{f' ({meaning})' if meaning else ''}"
    )


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

"""Errors an objective raises on the host from inside a compiled program (through
``jax.debug.callback``), handed to the caller as themselves: XLA wraps them in a
``JaxRuntimeError``, and ``except RatioError`` should still catch a
``RatioError``. The trainer's ``fit`` runs inside :func:`raising_host_errors`."""

from __future__ import annotations

import contextlib

import jax

_RAISED: list[Exception] = []  # set by a callback (an XLA thread), read by the caller


def raise_on_host(error: Exception) -> None:
    """Raise ``error`` in a host callback, kept so :func:`raising_host_errors` can hand
    it to the caller unwrapped."""
    _RAISED[:] = [error]
    raise error


@contextlib.contextmanager
def raising_host_errors():
    """Re-raise an error that :func:`raise_on_host` raised inside a compiled program
    as itself (from the ``JaxRuntimeError`` XLA wraps it in). Other errors pass
    unchanged."""
    _RAISED.clear()
    try:
        yield
    except jax.errors.JaxRuntimeError as wrapped:
        raised, _RAISED[:] = list(_RAISED), []
        if raised and str(raised[0]) in str(wrapped):
            raise raised[0] from wrapped
        raise

"""The one place ``dew.train`` reaches into another library's private modules, each
behind a function that says what it needs and which versions it was written for
(:data:`WRITTEN_FOR`; ``packages/dew-train/tests/test_compat.py`` fails on another
version, so an upgrade re-reads these lines before it lands). ``dew.cli.compat`` is
the command line's.

- :func:`orbax_async_handler`: Orbax's base class of an asynchronous checkpoint
  handler and the commit future a handler's ``async_save`` returns (the checksums
  handler of :mod:`dew.train._integrity` writes its record in Orbax's commit
  thread); Orbax exports neither.
"""

from __future__ import annotations

__all__ = ["WRITTEN_FOR", "orbax_async_handler"]

# distribution -> the versions the private names below were read from
WRITTEN_FOR = {"orbax-checkpoint": ("0.12.8",)}


def orbax_async_handler() -> tuple[type, type]:
    """``(AsyncCheckpointHandler, CommitFutureAwaitingContractedSignals)`` of Orbax."""
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.handlers import async_checkpoint_handler

    return (
        async_checkpoint_handler.AsyncCheckpointHandler,
        future.CommitFutureAwaitingContractedSignals,
    )

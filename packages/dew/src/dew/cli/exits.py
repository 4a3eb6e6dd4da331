"""The exit codes of ``dew`` (docs/command-line.md) and the one an error maps to."""

from __future__ import annotations

__all__ = ["EXIT", "exit_code_of"]

EXIT = {
    "finished": 0,
    "failed": 1,
    "bad_config": 2,
    "non_finite": 3,
    "does_not_fit": 4,
    "preempted": 75,
}


def exit_code_of(error: BaseException) -> int:
    from dew.train import (
        CheckpointMismatchError,
        NonFiniteError,
        NoUsableCheckpointError,
        OptimizerMismatchError,
        StepDoesNotFit,
    )

    if isinstance(error, NonFiniteError):
        return EXIT["non_finite"]
    if isinstance(
        error, CheckpointMismatchError | OptimizerMismatchError | NoUsableCheckpointError
    ):
        return EXIT["bad_config"]
    if isinstance(error, StepDoesNotFit):
        return EXIT["does_not_fit"]
    return EXIT["failed"]

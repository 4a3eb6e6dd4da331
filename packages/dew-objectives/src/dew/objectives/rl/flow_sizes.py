"""Flow-GRPO's sizes on a mesh: the recipe states the global group count (``groups``,
the data batch) and ``group_size``, and, for memory, ``device_rows`` (the samples one
device computes at once); :func:`rollout_sizes` derives the rest for ``D``
data-parallel devices, each split checked to divide before compiling."""

from __future__ import annotations

from typing import NamedTuple

from dew.objectives.cores.rollouts import check_rollout_rows


class RolloutSizes(NamedTuple):
    """What :func:`rollout_sizes` derives (rows are samples)."""

    rows: int  # the rollout batch, all devices: groups x group_size
    device_conditions: int  # conditions per device
    device_rows: int  # rollout samples per device
    rollout_chunk: int  # rows sampled at once, all devices
    update_rows: int  # rows of one update (rows / minibatches)
    accumulate: int  # microbatches of an update

    @classmethod
    def of(cls, objective, data_parallel: int) -> RolloutSizes:
        """A Flow-GRPO objective's sizes on ``data_parallel`` devices (the mesh's data
        and fsdp axes), from its ``groups``, ``group_size``, updates' minibatches,
        ``device_rows`` and ``rollout_rows``; a ValueError when a split does not divide
        (:func:`rollout_sizes`)."""
        return rollout_sizes(
            data_parallel,
            groups=objective.groups,
            group_size=objective.group_size,
            minibatches=objective.prepared_updates.minibatches,
            device_rows=objective.device_rows,
            rollout_rows=objective.rollout_rows,
            what=type(objective).__name__,
        )


def rollout_sizes(
    data_parallel: int,
    *,
    groups: int | None,
    group_size: int,
    minibatches: int,
    device_rows: int | None,
    rollout_rows: int | None,
    what: str,
) -> RolloutSizes:
    """The per-device sizes and the accumulation of ``groups x group_size`` rollout rows
    on ``data_parallel`` devices (the mesh's data and fsdp axes), updated in
    ``minibatches``, ``device_rows`` a device at once (None = all its rows of an
    update); a ValueError naming ``what`` when a split does not divide."""
    if groups is None:
        raise ValueError(f"{what}'s rollout sizes need groups= (the global group count)")
    dp, rows = int(data_parallel), groups * group_size
    made = f"{groups} groups x group_size {group_size}"
    if groups % dp:
        raise ValueError(
            f"{what}: {made} do not split over {dp} data-parallel devices (conditions per "
            f"device); use groups that are a multiple of {dp}"
        )
    check_rollout_rows(
        rows, minibatches=minibatches, scoring_rows=None, what=what, made=f" ({made})"
    )
    update = rows // minibatches
    if update % dp:
        raise ValueError(
            f"{what}: an update of {update} rows ({rows} rows / {minibatches} minibatches) "
            f"does not split over {dp} data-parallel devices; use groups x group_size "
            f"that is a multiple of {minibatches * dp}"
        )
    chunk = device_rows or update // dp
    if (update // dp) % chunk:
        divisors = [d for d in range(1, update // dp + 1) if (update // dp) % d == 0]
        raise ValueError(
            f"{what}: device_rows={chunk} does not divide the {update // dp} rows each of "
            f"{dp} device(s) computes per update ({update} rows); use one of {divisors}"
        )
    return RolloutSizes(
        rows=rows,
        device_conditions=groups // dp,
        device_rows=rows // dp,
        rollout_chunk=chunk * dp if device_rows else (rollout_rows or rows),
        update_rows=update,
        accumulate=update // (dp * chunk),
    )

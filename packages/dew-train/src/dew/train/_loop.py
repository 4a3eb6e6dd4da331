"""The loop: data -> prepare -> updates, one :class:`StepRecord` a step.

:func:`training_steps` is the whole of it; ``Trainer.fit`` runs the hooks
(:mod:`dew.train.hooks`) over its records and closes it to stop early.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from dew.data import Partition
from dew.train._programs import Compiled, Programs
from dew.train.goodput import Goodput
from dew.train.placement import host_rows, layout, signature, to_global
from dew.train.state import TrainState
from dew.train.step import is_logged_step, logged_flag


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step of the loop.

    step: steps done after it (``state.step``).
    state: the state after it (on the devices; the next step donates it).
    metrics: its packed metrics, still on the devices (``compiled.packing``
      unpacks them).
    compiled: the update program that ran (its FLOPs and metric packing).
    at_boundary: the last update of its data batch (always True without a
      prepare phase).
    prepare_seconds: seconds of the prepare phase that fed it (on a batch's first
      update; 0 otherwise).
    is_first: the first step of this loop (it compiled the update).
    """

    step: int
    state: TrainState
    metrics: Any
    compiled: Compiled
    at_boundary: bool
    prepare_seconds: float = 0.0
    is_first: bool = False


def training_steps(
    programs: Programs,
    state: TrainState,
    shardings: TrainState,
    batches: Iterator,
    *,
    partition: Partition,
    global_rows: int,
    steps: int,
    log_every: int,
    goodput: Goodput,
    check_batch: Callable[[dict, bool], None],
) -> Iterator[StepRecord]:
    """Steps from ``state.step`` to ``steps``: each data batch (``next(batches)``,
    this process's rows, checked by ``check_batch(batch, first)`` and placed on
    the mesh) goes through the objective's prepare phase, then feeds
    ``programs.per_batch`` updates, one record each. Time goes to ``goodput``'s
    ``data``, ``prepare``, ``compile`` and ``steps``."""
    mesh, rules = programs.device_mesh, programs.rules
    per_batch = programs.per_batch
    has_prepare = programs.objective.has_prepare
    # one device, no prepare phase: host rows go straight into the compiled update
    direct = mesh.size == 1 and partition.count == 1 and not has_prepare
    flags = {f: logged_flag(mesh, f) for f in (False, True)}
    start = step = int(jax.device_get(state.step))
    previous = batch = prepared = compiled = None
    by_signature: dict[tuple, Compiled] = {}  # host batch signature -> update program
    measure = goodput.measure
    while step < steps:
        prepare_seconds = 0.0
        if step % per_batch == 0:
            with measure("data"):
                local = next(batches, None)
                if local is None:  # the data ended (a reader that ends): the run ends here
                    return
                check_batch(local, step == start)
                if step == start or not _unchanged(local, previous):
                    key = signature(local)
                    compiled = by_signature.get(key)
                    if direct and compiled is not None:
                        batch = host_rows(local, partition, global_rows)
                    else:
                        batch = to_global(local, partition, global_rows, mesh, rules)
                previous = local
            if has_prepare:
                compiled = None
                if step > start:
                    # the previous batch's updates finish in "steps", not "prepare"
                    with measure("steps"):
                        jax.block_until_ready(state)
                began = goodput.seconds["prepare"]  # compilation not counted
                prepared = programs.prepare(state, batch, shardings, goodput)
                prepare_seconds = goodput.seconds["prepare"] - began
            else:
                prepared = batch
        if compiled is None:
            compiled = programs.cache.update.get(layout(prepared))
            if compiled is None:
                with measure("compile"):
                    compiled = programs.update(state, prepared, shardings)
            if not has_prepare:
                by_signature[signature(local)] = compiled
                if direct:  # the first call takes host rows, as the later ones do: the
                    # call's one-time setup for numpy arguments (~4 ms) falls in this step
                    prepared = host_rows(local, partition, global_rows)
        is_first = step == start
        with measure("steps"):
            # diagnostics only on the steps the log reads (dew.objectives.Step)
            logged = flags[is_logged_step(step + 1, steps, log_every)]
            state, metrics = compiled.program(state, prepared, logged)
            step += 1
            if goodput.first_step_at is None:
                jax.block_until_ready(metrics)
                goodput.first_step_done()
        yield StepRecord(
            step=step,
            state=state,
            metrics=metrics,
            compiled=compiled,
            at_boundary=step % per_batch == 0,
            prepare_seconds=prepare_seconds,
            is_first=is_first,
        )


def _unchanged(local, previous) -> bool:
    """``local`` holds the very arrays of ``previous`` and none of them can have
    changed in between (read-only numpy, or jax arrays): its global batch is
    the one already on the devices."""
    if previous is None or local.keys() != previous.keys():
        return False
    for name, value in local.items():
        if value is not previous[name]:
            return False
        if isinstance(value, np.ndarray) and value.flags.writeable:
            return False
        if not isinstance(value, np.ndarray | jax.Array):
            return False
    return True

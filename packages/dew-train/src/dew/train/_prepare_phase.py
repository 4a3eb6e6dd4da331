"""The prepare phase's programs of a :class:`dew.train.Programs`: the compiled
``prepare`` (and, with a host stage, ``prepare_host`` between it and the compiled
``prepare_finish``), cached by batch layout in ``programs.cache.prepare``.

``fit`` runs :func:`prepared` (``Programs.prepare``); :func:`dew.train.plan` compiles
the same programs through :func:`abstract_prepared`, so it measures the update over
the prepared minibatch ``fit`` runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew.train._compiled import Compiled
from dew.train.goodput import Goodput
from dew.train.placement import (
    abstract_batch,
    check_batch_rows,
    compile_with_flops,
    from_host,
    layout,
    to_host,
)
from dew.train.step import build_prepare, build_prepare_finish

# a dew.train._programs.Programs: not imported, that module imports this one
Programs = Any


def prepared(programs: Programs, state, batch, shardings, goodput: Goodput):
    """``batch`` after the objective's prepare phase (``batch`` itself without one)."""
    objective = programs.objective
    if not objective.has_prepare:
        return batch
    has_host = objective.has_prepare_host
    out = _run(programs, "prepare", state, batch, shardings, goodput, not has_host)
    if not has_host:
        return out
    with goodput.measure("prepare"):
        extra = objective.prepare_host(to_host(out))
        merged = _merge_host(programs, extra, out)
    return _run(programs, "finish", state, merged, shardings, goodput, True)


def _merge_host(programs: Programs, extra, out) -> dict:
    name = type(programs.objective).__name__
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{name}.prepare_host must return a dict of numpy arrays, got {type(extra).__name__}"
        )
    rows = next(iter(out.values())).shape[0]
    for key, value in extra.items():
        shape = np.shape(value)
        if not shape or shape[0] != rows:
            raise ValueError(
                f"{name}.prepare_host returned {key!r} of shape {shape}; every array needs "
                f"the {rows} rows of the prepared batch as its leading axis"
            )
    return {**out, **from_host(extra, programs.device_mesh, programs.rules)}


def compiled_prepare(
    programs: Programs, part: str, state, batch, shardings, *, final: bool
) -> Compiled:
    """The compiled ``part`` (``"prepare"`` or ``"finish"``) of the prepare
    phase for ``batch``'s layout (arrays or ``ShapeDtypeStruct`` with shardings)."""
    key = (part, layout(batch))
    cache = programs.cache.prepare
    if key not in cache:
        objective = programs.objective
        fn = build_prepare(objective) if part == "prepare" else build_prepare_finish(objective)
        out = jax.eval_shape(fn, state, batch)
        if final:
            _check_prepared(programs, out)
        mesh, rules = programs.device_mesh, programs.rules
        out_shardings = {k: v.sharding for k, v in abstract_batch(out, mesh, rules).items()}
        program, flops = compile_with_flops(
            fn,
            (state, batch),
            in_shardings=(shardings, jax.tree.map(lambda x: x.sharding, batch)),
            out_shardings=out_shardings,
        )
        cache[key] = Compiled(program, flops)
    return cache[key]


def _run(programs: Programs, part, state, batch, shardings, goodput, final):
    key = (part, layout(batch))
    if key not in programs.cache.prepare:
        with goodput.measure("compile"):
            compiled_prepare(programs, part, state, batch, shardings, final=final)
    with goodput.measure("prepare"):
        out = programs.cache.prepare[key].program(state, batch)
        jax.block_until_ready(out)
    return out


def _check_prepared(programs: Programs, out) -> None:
    objective = programs.objective
    name = type(objective).__name__
    if not isinstance(out, Mapping) or not out:
        raise TypeError(
            f"{name}.prepare must return a dict of arrays with a leading rows axis, got "
            f"{type(out).__name__}"
        )
    rows = {k: (v.shape[0] if v.ndim else None) for k, v in out.items()}
    if len(set(rows.values())) != 1 or None in rows.values():
        raise ValueError(
            f"{name}.prepare returned arrays with different leading dimensions {rows}; "
            f"every array needs the same number of rows"
        )
    count = next(iter(rows.values()))
    updates = objective.prepared_updates
    if count % updates.minibatches:
        raise ValueError(
            f"{name}.prepare returned {count} rows, which do not split into the declared "
            f"{updates.minibatches} minibatches ({updates}); return a multiple of "
            f"{updates.minibatches} rows"
        )
    check_batch_rows(
        programs.device_mesh,
        programs.rules,
        count // updates.minibatches,
        programs.accumulate,
        what=f"{name}.prepare minibatch ({count} rows / {updates.minibatches})",
    )


def abstract_prepared(programs: Programs, state, batch, shardings) -> dict:
    """The prepared batch ``fit`` would hand the update step, as
    ``ShapeDtypeStruct`` with its shardings, from abstract ``state`` and ``batch``.
    The host stage (``prepare_host``) runs on a rollout of zeros of the
    compiled prepare's output shapes: only its output shapes are read."""
    objective = programs.objective
    if not objective.has_prepare:
        return batch
    has_host = objective.has_prepare_host
    mesh, rules = programs.device_mesh, programs.rules
    with programs.context():
        compiled_prepare(programs, "prepare", state, batch, shardings, final=not has_host)
        out = abstract_batch(jax.eval_shape(build_prepare(objective), state, batch), mesh, rules)
        if not has_host:
            return out
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in out.items()}
        extra = abstract_batch(objective.prepare_host(zeros), mesh, rules)
        merged = {**out, **extra}
        compiled_prepare(programs, "finish", state, merged, shardings, final=True)
        finished = jax.eval_shape(build_prepare_finish(objective), state, merged)
        return abstract_batch(finished, mesh, rules)

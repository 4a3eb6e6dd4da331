"""A trainer's compiled programs: the prepare phase (compiled, then with
``prepare_host`` host Python and a compiled ``prepare_finish``) and the update
step, each compiled once per batch layout and kept on the trainer, so a later
``fit`` with the same layout reuses them (``trainer._compiled``,
``trainer._packings``, ``trainer._step_flops``)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from dew.train.packing import packed_step
from dew.train.placement import (
    abstract_batch,
    check_batch_rows,
    compile_fn,
    compile_with_flops,
    from_host,
    layout,
    replicated,
    to_host,
)
from dew.train.step import (
    LOGGED_SPEC,
    build_prepare,
    build_prepare_finish,
    build_train_step,
    minibatch_fn,
    with_minibatch,
)


def prepared(trainer, state, batch, shardings, goodput):
    """``batch`` after the objective's prepare phase (``batch`` itself without one)."""
    if not trainer.objective.has_prepare:
        return batch
    objective = trainer.objective
    has_host = objective.has_prepare_host
    prepared = _run_prepare(
        trainer, "prepare", build_prepare(objective), state, batch, shardings, goodput, not has_host
    )
    if not has_host:
        return prepared
    with goodput.measure("prepare"):
        extra = objective.prepare_host(to_host(prepared))
        _check_host(trainer, extra, prepared)
        merged = {**prepared, **from_host(extra, trainer.device_mesh, trainer.rules)}
    finish = build_prepare_finish(objective)
    return _run_prepare(trainer, "finish", finish, state, merged, shardings, goodput, True)


def _run_prepare(trainer, part, fn, state, batch, shardings, goodput, final):
    """One compiled part of the prepare phase, compiled once per batch layout."""
    key = (part, layout(batch))
    cache = trainer.__dict__.setdefault("_compiled_prepare", {})
    if key not in cache:
        with goodput.measure("compile"):
            out = jax.eval_shape(fn, state, batch)
            if final:
                _check_prepared(trainer, out)
            out_shardings = {
                k: v.sharding
                for k, v in abstract_batch(out, trainer.device_mesh, trainer.rules).items()
            }
            cache[key] = compile_fn(
                fn,
                (state, batch),
                in_shardings=(shardings, jax.tree.map(lambda x: x.sharding, batch)),
                out_shardings=out_shardings,
            )
    with goodput.measure("prepare"):
        prepared = cache[key](state, batch)
        jax.block_until_ready(prepared)
    return prepared


def _check_host(trainer, extra, prepared) -> None:
    name = type(trainer.objective).__name__
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{name}.prepare_host must return a dict of numpy arrays, got {type(extra).__name__}"
        )
    rows = next(iter(prepared.values())).shape[0]
    for key, value in extra.items():
        shape = np.shape(value)
        if not shape or shape[0] != rows:
            raise ValueError(
                f"{name}.prepare_host returned {key!r} of shape {shape}; every array needs "
                f"the {rows} rows of the prepared batch as its leading axis"
            )


def _check_prepared(trainer, out) -> None:
    name = type(trainer.objective).__name__
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
    updates = trainer.objective.prepared_updates
    if count % updates.minibatches:
        raise ValueError(
            f"{name}.prepare returned {count} rows, which do not split into the declared "
            f"{updates.minibatches} minibatches ({updates}); return a multiple of "
            f"{updates.minibatches} rows"
        )
    check_batch_rows(
        trainer.device_mesh,
        trainer.rules,
        count // updates.minibatches,
        trainer.accumulate,
        what=f"{name}.prepare minibatch ({count} rows / {updates.minibatches})",
    )


def compiled_update(trainer, state, batch, shardings, goodput):
    """The update step compiled for this batch layout, and the :class:`Packing`
    of its metrics (:mod:`dew.train.packing`); a later ``fit`` with the same
    layout reuses them."""
    key = layout(batch)
    cache = trainer.__dict__.setdefault("_compiled", {})
    packings = trainer.__dict__.setdefault("_packings", {})
    if key not in cache:
        with goodput.measure("compile"):
            step_fn = build_train_step(
                trainer.objective,
                trainer.optimizer,
                accumulate_steps=trainer.accumulate,
                learning_rate=trainer.learning_rate,
                one_device=trainer.device_mesh.size == 1,
            )
            if trainer.objective.has_prepare:
                step_fn = with_minibatch(minibatch_fn(trainer.objective.prepared_updates), step_fn)
            step_fn, packings[key] = packed_step(step_fn)
            cache[key], flops = compile_with_flops(
                step_fn,
                (state, batch, LOGGED_SPEC),
                in_shardings=(
                    shardings,
                    jax.tree.map(lambda x: x.sharding, batch),
                    replicated(trainer.device_mesh),
                ),
                out_shardings=(shardings, replicated(trainer.device_mesh)),
                donate_argnums=(0,),
            )
            trainer.__dict__.setdefault("_step_flops", {})[key] = flops
    return cache[key], packings[key]

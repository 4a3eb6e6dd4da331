"""Pipeline parallelism for a stack of identical layers: GPipe and a circular schedule.

The ``[layers, ...]`` parameters of a scanned stack are viewed as ``[stages,
layers / stages, ...]``; the logical axis ``layers`` is split over the
``stage`` mesh axis by the trainer's rules, so each stage's device group
holds its own contiguous block of layers and the reshape moves nothing.

The batch is cut into ``num_microbatches`` microbatches (microbatch ``j``
holds rows ``j, j + M, j + 2M, ...``, so every data-parallel shard keeps an
equal share of each one). A state buffer ``[stages, microbatch, ...]``
holds what each stage works on. Each of the ``M + S - 1`` iterations

    1. feeds microbatch ``t`` into stage 0,
    2. runs every stage on its slot at once (``vmap`` over the stage axis,
       which the sharding splits over the ``stage`` devices),
    3. stores the last stage's result as finished microbatch ``t - S + 1``,
    4. shifts the buffer by one stage (``jnp.roll``: a collective permute
       between neighbouring stage groups).

Stage ``s`` works on microbatch ``t - s`` at iteration ``t``; the
``(S - 1)`` iterations at either end leave some stages idle (the bubble,
a fraction ``(S - 1) / (M + S - 1)`` of the time), computing on zeros that
are never read. The backward pass is the reverse schedule, derived by
autodiff through the loop. (Huang et al., 2019, GPipe; the loop follows
MaxText's ``pipeline.py``.)

The circular schedule (``num_repeats = R > 1``, MaxText's
``num_pipeline_repeats``; the interleaved stages of Narayanan et al., 2021)
cuts the layers into ``S * R`` chunks of ``L / (S R)``: chunk ``r S + s``
runs on stage ``s``, so a microbatch goes round the stages ``R`` times, and
each iteration runs ``L / (S R)`` layers per stage instead of ``L / S``. Stage
``s`` works on item ``w = t - s`` at iteration ``t`` (microbatch ``w mod M``,
round ``w // M``); what the last stage finishes waits in a buffer
``[microbatch, ...]`` until stage 0 takes it for the next round (``M >= S``:
it is finished before it is needed). There are ``M R + S - 1`` iterations of
``1 / R`` the work each, so the bubble is ``(S - 1) / (M R + S - 1)``
(:func:`bubble_fraction`), about ``R`` times smaller than GPipe's at the same
microbatches, for ``R`` times as many stage-to-stage transfers. The chunks
of a stage are not contiguous layers: under a ``stage`` mesh axis that splits
the ``[layers]`` parameters in contiguous blocks, the partitioner moves
weights to their stage inside the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes
from dew.nn.shards import check_divides


def bubble_fraction(num_stages: int, num_microbatches: int, num_repeats: int = 1) -> float:
    """The fraction of a pipelined step each stage is idle: ``(S - 1) / (M R + S - 1)``
    (GPipe at ``num_repeats`` 1)."""
    s, m, r = num_stages, num_microbatches, num_repeats
    return (s - 1) / (m * r + s - 1)


def check_pipeline(
    num_layers: int, num_stages: int, batch: int, num_microbatches: int, num_repeats: int = 1
) -> None:
    """Raise ``ValueError`` unless the layers split evenly into stages (times
    ``num_repeats`` chunks each) and the batch into microbatches; a circular
    schedule also needs at least as many microbatches as stages."""
    if num_stages < 1 or num_microbatches < 1 or num_repeats < 1:
        raise ValueError(
            f"num_stages ({num_stages}), pipeline_microbatches ({num_microbatches}) and "
            f"pipeline_repeats ({num_repeats}) must be >= 1"
        )
    chunks = num_stages * num_repeats
    if num_layers % chunks:
        what = f"num_stages {num_stages}" + (
            f" x pipeline_repeats {num_repeats}" if num_repeats > 1 else ""
        )
        raise ValueError(
            f"num_layers {num_layers} does not divide into {what} = {chunks} pipeline "
            f"chunks; use a number of layers that is a multiple of {chunks} or fewer "
            f"stages or repeats"
        )
    if num_repeats > 1 and num_stages > 1 and num_microbatches < num_stages:
        raise ValueError(
            f"the circular pipeline (pipeline_repeats {num_repeats}) needs at least as many "
            f"microbatches as stages ({num_stages}), got pipeline_microbatches "
            f"{num_microbatches}: a microbatch must finish a round before stage 0 takes it "
            f"again; use pipeline_microbatches >= {num_stages}"
        )
    if batch % num_microbatches:
        raise ValueError(
            f"batch {batch} does not divide into pipeline_microbatches {num_microbatches}; "
            f"use a batch that is a multiple of {num_microbatches}"
        )


def _constrain(tree, leading: tuple):
    """Constrain ``[leading..., batch, ...]`` leaves by logical axes: float
    activations ``[batch, length, embed]``, integer and boolean leaves
    ``[batch, length, ...]`` (positions, padding, segment ids, a ``[batch,
    query, key]`` mask), any other leaf (a conditioning vector) by batch only."""

    def one(x):
        rest = x.ndim - len(leading)
        if jnp.issubdtype(x.dtype, jnp.floating):
            names = (axes.BATCH, axes.LENGTH, axes.EMBED) if rest == 3 else (axes.BATCH,)
        else:
            names = (axes.BATCH, axes.LENGTH)
        names = (*names, *([None] * rest))[:rest]
        return nn.with_logical_constraint(x, (*leading, *names))

    return jax.tree.map(one, tree)


def pipeline(
    layer_fn: Callable[[Any, Any], tuple[Any, jax.Array]],
    layer_params: Any,
    inputs: Any,
    *,
    num_stages: int,
    num_microbatches: int,
    num_repeats: int = 1,
) -> tuple[Any, jax.Array]:
    """Run ``num_layers`` layers over ``inputs`` as a ``num_stages``-stage pipeline:
    GPipe (``num_repeats`` 1) or the circular schedule over ``num_repeats`` rounds.

    layer_fn: ``(params of one layer, carry) -> (carry, aux)``; ``carry`` is a
      tree of ``[rows, ...]`` arrays (activations, positions, masks) that the
      layer maps to the same shapes; ``aux`` a scalar or a per-row ``[rows]``
      value (e.g. a load-balancing loss; 0 when there is none), or a dict of
      them (each reduced on its own).
    layer_params: a tree of ``[num_layers, ...]`` arrays (a scanned stack).
    inputs: the carry for the whole batch, ``[batch, ...]`` leaves.

    Returns ``(outputs, aux)``: the carry after all layers, ``[batch, ...]``,
    identical (up to float rounding) to applying the layers in sequence, and
    the mean of ``aux`` over layers (of each value of a dict): per row
    ``[batch]`` when ``layer_fn`` gives ``[rows]``, else a scalar (also
    averaged over microbatches).
    """
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    batch = jax.tree.leaves(inputs)[0].shape[0]
    check_pipeline(num_layers, num_stages, batch, num_microbatches, num_repeats)
    stages, micro_rows = num_stages, batch // num_microbatches
    repeats, per_stage = num_repeats, num_layers // (num_stages * num_repeats)
    check_divides(
        micro_rows,
        axes.BATCH,
        f"pipeline microbatch (batch {batch} / {num_microbatches} microbatches)",
    )
    items = num_microbatches * repeats  # (microbatch, round) pairs each stage works on
    iterations = items + stages - 1

    chunk_params = jax.tree.map(
        lambda p: jnp.swapaxes(p.reshape(repeats, stages, per_stage, *p.shape[1:]), 0, 1),
        layer_params,
    )  # [stage, round, layers / chunk, ...]: chunk r * S + s
    micro = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape(micro_rows, num_microbatches, *x.shape[1:]), 0, 1),
        inputs,
    )  # [microbatch, rows / microbatch, ...]
    micro = _constrain(micro, (None,))

    def stage_fn(params, carry):
        def one_layer(c, p):
            c, aux = layer_fn(p, c)
            return c, aux

        return jax.lax.scan(one_layer, carry, params)  # aux: [layers / stage]

    is_first = jnp.arange(stages) == 0  # [stage]
    stage_index = jnp.arange(stages)

    def iteration(loop, t):
        state, outputs = loop
        # stage 0 takes item t: microbatch t mod M, from the inputs in round 0,
        # else from the buffer the last stage filled in the round before
        slot = t % num_microbatches
        new_input = jax.tree.map(
            lambda m, o: jnp.where(t < num_microbatches, m[slot], o[slot]), micro, outputs
        )
        if repeats == 1:  # GPipe: each stage's one chunk, sliced statically
            stage_params = jax.tree.map(lambda p: p[:, 0], chunk_params)
        else:  # each stage's chunk of the round it works on (a slice on its own device)
            rounds = jnp.clip((t - stage_index) // num_microbatches, 0, repeats - 1)  # [stage]
            stage_params = jax.tree.map(
                lambda p: jax.vmap(lambda q, r: q[r])(p, rounds), chunk_params
            )  # [stage, layers / chunk, ...]
        state = jax.tree.map(
            lambda s, m: jnp.where(is_first.reshape(-1, *([1] * m.ndim)), m[None], s),
            state,
            new_input,
        )
        state = _constrain(state, (axes.LAYERS,))
        state, aux = jax.vmap(stage_fn)(stage_params, state)  # aux: [stage, layers / stage]
        finished = (t - stages + 1) % num_microbatches
        # Before the pipeline fills, this writes garbage that a later
        # iteration overwrites with the real microbatch.
        outputs = jax.tree.map(lambda o, s: o.at[finished].set(s[stages - 1]), outputs, state)
        state = jax.tree.map(lambda s: jnp.roll(s, 1, axis=0), state)
        return (state, outputs), aux

    state = jax.tree.map(lambda m: jnp.zeros((stages, *m.shape[1:]), m.dtype), micro)
    outputs = jax.tree.map(jnp.zeros_like, micro)
    (_, outputs), aux = jax.lax.scan(iteration, (state, outputs), jnp.arange(iterations))
    outputs = _constrain(outputs, (None,))
    outputs = jax.tree.map(
        lambda o: jnp.swapaxes(o, 0, 1).reshape(batch, *o.shape[2:]), outputs
    )  # [batch, ...]

    # Stage s works on microbatch m of round r at iteration r M + m + s; the
    # bubble's idle iterations computed on zeros and are left out.
    work = jnp.arange(items).reshape(repeats, num_microbatches).T  # [microbatch, round]
    iteration_index = work[:, :, None] + stage_index  # [microbatch, round, stage]

    def layer_mean(aux):  # [iteration, stage, layers / chunk, rows?] -> [batch] or []
        aux = aux.astype(jnp.float32)[iteration_index, stage_index]
        aux = jnp.mean(aux, axis=(1, 2, 3))  # [microbatch, rows?]
        if aux.ndim == 1:
            return jnp.mean(aux)
        return jnp.swapaxes(aux, 0, 1).reshape(batch)  # [batch]

    return outputs, jax.tree.map(layer_mean, aux)

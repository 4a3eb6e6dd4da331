"""Pipeline parallelism for a stack of identical layers: a GPipe schedule.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes
from dew.nn.shards import check_divides


def check_pipeline(num_layers: int, num_stages: int, batch: int, num_microbatches: int) -> None:
    """Raise ``ValueError`` unless the layers split evenly into stages and the
    batch into microbatches."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_stages ({num_stages}) and pipeline_microbatches ({num_microbatches}) must be >= 1"
        )
    if num_layers % num_stages:
        raise ValueError(
            f"num_layers {num_layers} does not divide into num_stages {num_stages} pipeline "
            f"stages; use a number of layers that is a multiple of {num_stages} or another "
            f"num_stages"
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
) -> tuple[Any, jax.Array]:
    """Run ``num_layers`` layers over ``inputs`` as a ``num_stages``-stage pipeline.

    layer_fn: ``(params of one layer, carry) -> (carry, aux)``; ``carry`` is a
      tree of ``[rows, ...]`` arrays (activations, positions, masks) that the
      layer maps to the same shapes; ``aux`` a scalar or a per-row ``[rows]``
      value (e.g. a load-balancing loss; 0 when there is none).
    layer_params: a tree of ``[num_layers, ...]`` arrays (a scanned stack).
    inputs: the carry for the whole batch, ``[batch, ...]`` leaves.

    Returns ``(outputs, aux)``: the carry after all layers, ``[batch, ...]``,
    identical (up to float rounding) to applying the layers in sequence, and
    the mean of ``aux`` over layers: per row ``[batch]`` when ``layer_fn``
    gives ``[rows]``, else a scalar (also averaged over microbatches).
    """
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    batch = jax.tree.leaves(inputs)[0].shape[0]
    check_pipeline(num_layers, num_stages, batch, num_microbatches)
    stages, micro_rows, per_stage = num_stages, batch // num_microbatches, num_layers // num_stages
    check_divides(
        micro_rows,
        axes.BATCH,
        f"pipeline microbatch (batch {batch} / {num_microbatches} microbatches)",
    )
    iterations = num_microbatches + stages - 1

    stage_params = jax.tree.map(
        lambda p: p.reshape(stages, per_stage, *p.shape[1:]), layer_params
    )  # [stage, layers / stage, ...]
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

    def iteration(loop, t):
        state, outputs = loop
        new_input = jax.tree.map(lambda m: m[t % num_microbatches], micro)
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

    # Stage s works on microbatch m at iteration m + s; the bubble's idle
    # iterations computed on zeros and are left out.
    aux = aux.astype(jnp.float32)  # [iteration, stage, layers / stage, rows?]
    stage_index = jnp.arange(stages)
    iteration_index = jnp.arange(num_microbatches)[:, None] + stage_index[None, :]
    aux = aux[iteration_index, stage_index[None, :]]  # [microbatch, stage, layers / stage, rows?]
    aux = jnp.mean(aux, axis=(1, 2))  # [microbatch, rows?]
    if aux.ndim == 1:
        return outputs, jnp.mean(aux)
    return outputs, jnp.swapaxes(aux, 0, 1).reshape(batch)  # [batch]

"""The training step, composed from its features when it is built.

    grads  = accumulate(loss_and_grad, k)      # k microbatches, mean gradient
    state' = reject_nonfinite(apply_update)    # nothing applied if not finite
    state' = with_ema(state')                  # moving average after each update

Each feature is a function wrapping another; the compiled step holds no
``if config.flag`` branches.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from dew.objectives import EMA, Objective, Step
from dew.train.state import TrainState


def microbatch_key(root: jax.Array, step: jax.Array, microbatch) -> jax.Array:
    """The key of one microbatch: ``fold_in(fold_in(root, step), microbatch)``."""
    return jax.random.fold_in(jax.random.fold_in(root, step), microbatch)


def loss_and_grad_fn(objective: Objective) -> Callable:
    """``(state, batch, microbatch) -> (loss, metrics, grads)`` for one microbatch."""

    def fn(state: TrainState, batch, microbatch):
        step = Step(index=state.step, key=microbatch_key(state.key, state.step, microbatch))

        def loss_of(params):
            variables = {"params": params, **state.frozen}
            if objective.uses_averaged:
                variables["averaged"] = jax.lax.stop_gradient(state.averaged)
            return objective.loss(variables, batch, step)

        (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        return loss, metrics, grads

    return fn


def accumulate(fn: Callable, k: int) -> Callable:
    """Split the batch into ``k`` microbatches; return the mean loss and gradient
    and the summed metrics. ``k == 1`` is the plain function."""
    if k == 1:
        return lambda state, batch: fn(state, batch, 0)

    def split(x):
        # microbatch j takes rows j, j + k, j + 2k, ...: every data-parallel
        # shard keeps an equal share of each microbatch.
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    def accumulated(state, batch):
        micro = jax.tree.map(split, batch)
        first = jax.tree.map(lambda x: x[0], micro)
        loss0, metrics0, grads0 = jax.eval_shape(lambda: fn(state, first, 0))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (loss0, metrics0, grads0))

        def body(carry, xs):
            j, mb = xs
            out = fn(state, mb, j)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, out), None

        (loss, metrics, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(k), micro))
        grads = jax.tree.map(lambda g, s: (g / k).astype(s.dtype), grads, grads0)
        return loss / k, metrics, grads

    return accumulated


def all_finite(loss, grads) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
    return jnp.isfinite(loss) & jnp.all(jnp.stack(leaves)) if leaves else jnp.isfinite(loss)


def ema_update_fn(ema: EMA | None) -> Callable:
    """``(averaged, params, updates) -> averaged``; identity when there is no EMA."""
    if ema is None:
        return lambda averaged, params, updates: averaged

    def update(averaged, params, updates):
        decay = ema.decay_at(updates)

        def leaf(path, avg, new):
            if ema.include is not None and not ema.include(path_string(path)):
                return new
            return (decay * avg.astype(jnp.float32) + (1 - decay) * new.astype(jnp.float32)).astype(
                new.dtype
            )

        return jax.tree_util.tree_map_with_path(leaf, averaged, params)

    return update


def path_string(path) -> str:
    parts = []
    for p in path:
        parts.append(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))))
    return "/".join(parts)


def build_train_step(
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    accumulate_steps: int = 1,
) -> Callable:
    """``(state, batch) -> (state, metrics)``: one attempt of the training step.

    metrics: the objective's (summed over microbatches) plus ``loss`` (mean) and
    ``accepted`` (1.0 when the update was applied).
    """
    grads_fn = accumulate(loss_and_grad_fn(objective), accumulate_steps)
    ema_fn = ema_update_fn(objective.ema)

    def train_step(state: TrainState, batch):
        loss, metrics, grads = grads_fn(state, batch)
        finite = all_finite(loss, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        averaged = ema_fn(state.averaged, params, state.updates)

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_state = state.replace(
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            averaged=keep(averaged, state.averaged),
            step=state.step + 1,
            microstep=state.microstep + finite.astype(jnp.int32) * accumulate_steps,
            updates=state.updates + finite.astype(jnp.int32),
        )
        metrics = {**metrics, "loss": loss, "accepted": finite.astype(jnp.float32)}
        return new_state, metrics

    return train_step

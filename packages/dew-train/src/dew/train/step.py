"""The training step, composed from its features when it is built.

    grads  = accumulate(loss_and_grad, k)      # k microbatches, divided once by the weight
    state' = reject_nonfinite(apply_update)    # nothing applied if not finite
    state' = with_ema(state')                  # moving average after each update

and, for an objective with ``prepare``:

    prepared = prepare(state, batch)           # compiled, no gradient, pre-update weights
    prepared = finish(state, host(prepared))   # optional host stage (text rewards), then
                                               # compiled again
    for u in range(epochs * minibatches):      # one trainer step each
        state = train_step(state, minibatch(prepared, u))

Each feature is a function wrapping another; the compiled step holds no
``if config.flag`` branches.

Weights: an objective's loss is one or more :class:`~dew.objectives.Weighted`
terms (a plain scalar is a mean with equal weight per row). With ``k``
microbatches the optimized value is ``sum_t (sum_j total_tj) / (sum_j weight_tj)``:
a first pass adds up each term's weight over the microbatches (XLA drops the
forward pass when the weights come from the batch alone, as masks do), the
second differentiates ``sum_t total_tj / W_t`` per microbatch and adds the
gradients, so the result equals one full batch even when rows carry different
weights. Data-parallel shards and processes are inside the one compiled
program, so they divide by the same global weight.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.objectives import EMA, Objective, Step, Updates, check_roles
from dew.objectives.contract import weighted as wt
from dew.train._roles import role_emas
from dew.train.state import TrainState


class Stream(enum.IntEnum):
    """Named key streams of a step, folded into ``fold_in(root, step)``.

    Microbatch ``j`` of an update draws from stream ``j`` (0, 1, ...); the
    other phases draw from these, far from any microbatch index.
    """

    PREPARE = 0x7FFFFFFD
    SHUFFLE = 0x7FFFFFFC
    PREVIEW = 0x7FFFFFFE
    EVALUATE = 0x7FFFFFFF


def microbatch_key(root: jax.Array, step: jax.Array, microbatch) -> jax.Array:
    """The key of one microbatch (or named stream): ``fold_in(fold_in(root, step), j)``."""
    return jax.random.fold_in(jax.random.fold_in(root, step), microbatch)


def rows_of(batch) -> int:
    leaves = jax.tree.leaves(batch)
    return int(leaves[0].shape[0]) if leaves else 1


def objective_variables(objective: Objective, state: TrainState, params) -> dict:
    """What the objective reads: ``params`` as the trained parameters, the frozen
    roles, and each averaged role (``Role(averages=...)``) from ``state.averaged_by_role``
    without gradient (:meth:`TrainState.variables_with`)."""
    return state.variables_with(params)


def weighted_loss_fn(objective: Objective, accumulate_steps: int = 1) -> Callable:
    """``(params, state, batch, microbatch, is_logged) -> (terms, metrics)``, both
    weighted; ``is_logged`` is :attr:`Step.is_logged`. The step's ``rows`` are the
    microbatch's rows' indices in the whole batch (:func:`accumulate` gives
    microbatch ``j`` rows ``j, j + k, ...``), its ``row_key`` microbatch 0's key, so
    at ``accumulate=1`` ``Step.row_keys()`` is ``split(step.key, rows)``."""

    def fn(params, state: TrainState, batch, microbatch, is_logged=True):
        step = Step(
            index=state.step,
            key=microbatch_key(state.key, state.step, microbatch),
            is_logged=is_logged,
            rows=jnp.arange(rows_of(batch), dtype=jnp.int32) * accumulate_steps + microbatch,
            row_key=microbatch_key(state.key, state.step, 0),
            batch_rows=rows_of(batch) * accumulate_steps,
        )
        loss, metrics = objective.loss(objective_variables(objective, state, params), batch, step)
        rows = rows_of(batch)
        return wt.loss_terms(loss, rows), wt.as_metrics(metrics, rows)

    return fn


def _grads(fn, state, batch, microbatch, weights, is_logged):
    """Gradient of ``sum_t total_t / weights_t`` for one microbatch."""

    def objective_of(params):
        terms, metrics = fn(params, state, batch, microbatch, is_logged)
        value = sum(t.total / w for t, w in zip(terms, weights))
        return value, (terms, metrics)

    (_, aux), grads = jax.value_and_grad(objective_of, has_aux=True)(state.params_by_role)
    return aux, grads


def accumulate(fn: Callable, k: int) -> Callable:
    """``(state, batch, is_logged) -> (terms, metrics, grads)`` over ``k`` microbatches,
    divided once by each term's total weight. ``k == 1`` differentiates the batch
    directly."""
    if k == 1:

        def whole(state, batch, is_logged=True):
            (terms, metrics), grads = _grads_with_own_weights(fn, state, batch, is_logged)
            return terms, metrics, grads

        return whole

    def split(x):
        # microbatch j takes rows j, j + k, j + 2k, ...: every data-parallel
        # shard keeps an equal share of each microbatch.
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    def accumulated(state, batch, is_logged=True):
        micro = jax.tree.map(split, batch)
        index = jnp.arange(k)

        def weights_of(carry, xs):
            j, mb = xs
            # the weights only: no diagnostics
            terms, _ = fn(jax.lax.stop_gradient(state.params_by_role), state, mb, j, False)
            return [c + t.weight for c, t in zip(carry, terms)], None

        first = jax.tree.map(lambda x: x[0], micro)
        terms0, metrics0 = jax.eval_shape(lambda: fn(state.params_by_role, state, first, 0))
        zero_weights = [jnp.zeros((), jnp.float32) for _ in terms0]
        weights, _ = jax.lax.scan(weights_of, zero_weights, (index, micro))

        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, jnp.float32), (terms0, metrics0, state.params_by_role)
        )

        def body(carry, xs):
            j, mb = xs
            (terms, metrics), grads = _grads(fn, state, mb, j, weights, is_logged)
            out = (terms, metrics, grads)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, out), None

        (terms, metrics, grads), _ = jax.lax.scan(body, zeros, (index, micro))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params_by_role)
        return terms, metrics, grads

    return accumulated


def _grads_with_own_weights(fn, state, batch, is_logged):
    """Gradient of ``sum_t total_t / W_t`` with each ``W_t`` this batch's own
    weight, a constant of the differentiation."""

    def objective_of(params):
        terms, metrics = fn(params, state, batch, 0, is_logged)
        value = sum(t.total / jax.lax.stop_gradient(t.weight) for t in terms)
        return value, (terms, metrics)

    (_, aux), grads = jax.value_and_grad(objective_of, has_aux=True)(state.params_by_role)
    return aux, grads


def ema_update_fn(ema: EMA | None, by_role: dict[str, EMA] | None = None) -> Callable:
    """``(averaged, params, updates) -> averaged`` over ``{trained role: tree}``;
    identity when there is no EMA.

    ema: the objective's, over every trained role.
    by_role: the averaged roles' own EMAs by their trained role
      (``{'encoder': EMA(...)}``); they take precedence over ``ema`` where they apply.
      Either EMA's ``include`` sees the paths inside the role
      (``"layers/mlp/up/kernel"``). Leaves no EMA covers hold the live values.
    """
    by_role = dict(by_role or {})
    if ema is None and not by_role:
        return lambda averaged, params, updates: averaged

    def update(averaged, params, updates):
        decays = {name: e.decay_at(updates) for name, e in by_role.items()}
        default = ema.decay_at(updates) if ema is not None else None

        def leaf(path, avg, new):
            role, _, name = path_string(path).partition("/")
            if role in by_role:
                this, decay = by_role[role], decays[role]
            elif ema is not None:
                this, decay = ema, default
            else:
                return new
            if this.include is not None and not this.include(name):
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


def learning_rate_of(opt_state, schedule: Callable | None, updates: jax.Array):
    """The learning rate in effect: ``schedule(updates)`` when given, else a
    ``learning_rate`` hyperparameter in the optimizer state
    (``optax.inject_hyperparams``), else None."""
    if schedule is not None:
        return jnp.asarray(schedule(updates) if callable(schedule) else schedule, jnp.float32)
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    if not found:
        return None
    return jnp.asarray(found[0][1], jnp.float32)


def is_logged_step(step: int, steps: int, log_every: int) -> bool:
    """Whether the log reads the metrics of the step that ends at ``step`` (counted
    after it): ``log_every`` divides it, or it is the run's last (``steps``)."""
    return step == steps or bool(log_every and step % log_every == 0)


@functools.lru_cache(maxsize=16)
def _flags(mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    replicated = NamedSharding(mesh, PartitionSpec())
    return tuple(jax.device_put(np.bool_(v), replicated) for v in (False, True))


def logged_flag(mesh: Mesh, is_logged: bool) -> jax.Array:
    """The compiled step's ``is_logged`` argument: a bool scalar replicated on
    ``mesh`` (made once per mesh, so a step costs no transfer)."""
    return _flags(mesh)[bool(is_logged)]


LOGGED_SPEC = jax.ShapeDtypeStruct((), jnp.bool_)
"""The abstract ``is_logged`` argument the step is compiled for."""


# Up to this many elements, a tree's norm on one device is one reduction over its leaves
# concatenated (XLA fuses the concatenate into the reduce): one kernel, where
# `optax.tree.norm` runs one per leaf, which on a small model costs more than the
# arithmetic (measured: JEPA's tiny step, 50 leaves, 0.929 -> 0.948 of a hand-written step
# without the norm). Larger trees, and any mesh (a concatenate of differently sharded
# leaves would gather them), keep the per-leaf sums.
FUSED_NORM_ELEMENTS = 1 << 22


def tree_norm(tree, *, fused: bool = False) -> jax.Array:
    """The global L2 norm of ``tree``, as ``optax.tree.norm`` but squared and summed in
    float32 (a bfloat16 leaf's squares would lose ~1e-3); ``fused`` (one device): one
    reduction when the tree is small (:data:`FUSED_NORM_ELEMENTS`)."""
    leaves = [jnp.asarray(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
    if fused and 0 < sum(x.size for x in leaves) <= FUSED_NORM_ELEMENTS:
        return jnp.sqrt(jnp.sum(jnp.square(jnp.concatenate([jnp.ravel(x) for x in leaves]))))
    return jnp.sqrt(sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.zeros((), jnp.float32)))


def update_norm_if(is_logged, updates, *, fused: bool = False) -> jax.Array:
    """:func:`tree_norm` of ``updates`` when ``is_logged`` (a traced bool: under
    ``lax.cond``, so a step the log does not read skips the pass over every
    parameter), else 0.

    updates: the updates tree, or a function of no arguments that computes it, which
    then runs inside the branch only: the step's own updates are fused into each
    weight's update and never written out, where a tree given to the branch is one
    buffer a leaf, written on every step."""
    compute = updates if callable(updates) else (lambda: updates)

    def norm(_):
        return tree_norm(compute(), fused=fused)

    if isinstance(is_logged, bool):
        return norm(None) if is_logged else jnp.zeros((), jnp.float32)
    return jax.lax.cond(is_logged, norm, lambda _: jnp.zeros((), jnp.float32), None)


def after(flag: jax.Array, tree) -> jax.Array:
    """``flag``, computed after every leaf of ``tree``: it reads one element of each,
    through a test XLA does not fold (every 32-bit pattern with its low bit set is
    nonzero), so the value is ``flag``'s. An update that reads it is ordered after
    ``tree``'s producers, which lets XLA write a donated buffer in place that those
    producers read (without the order it copies the buffer first). For leaves whole
    on each device: an element of a split leaf would be gathered."""
    parts = [
        jax.lax.bitcast_convert_type(
            jnp.asarray(x)[(0,) * jnp.ndim(x)].astype(jnp.float32), jnp.uint32
        )
        for x in jax.tree.leaves(tree)
        if jnp.size(x)
    ]
    if not parts:
        return flag
    token = functools.reduce(jnp.bitwise_or, parts)
    return flag & ((token | 1) != 0)


def orders_selects(platform: str, *, whole: bool) -> bool:
    """Whether the non-finite guard's selects are ordered (:func:`after`) on
    ``platform`` (a device's ``platform``: ``"cpu"``, ``"tpu"``, ``"gpu"``) when every
    trained leaf is ``whole`` on each device. Yes on the CPU, where the order removes
    XLA's copies of the donated optimizer state (PPO's update at the TPU size: 116
    copies, 435 MiB, unordered; none ordered). Not on a TPU: on a v5e chip the order made the
    plain GPT-2 step slower (seq 1024 batch 8: 97.1 ms unordered, 100.2 ms ordered,
    against 95.7 ms with no guard; compile 74 s against 138 s), and GRPO's update
    0.936x its hand-written step, against 0.950x unordered (docs/performance.md, tenth
    chip session). GPUs keep XLA's own order (not measured)."""
    return whole and platform == "cpu"


def kept_if(ok: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """``new`` where ``ok``, else ``old``: an elementwise select (typed PRNG keys, as an
    optimizer state may hold, through their data)."""
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
        data = jnp.where(ok, jax.random.key_data(new), jax.random.key_data(old))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
    return jnp.where(ok, new, old)


def build_train_step(
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    accumulate_steps: int = 1,
    learning_rate: Callable | float | None = None,
    one_device: bool = False,
    ordered_selects: bool | None = None,
    update_norm: bool = False,
) -> Callable:
    """``(state, batch, is_logged=True) -> (state, metrics)``: one attempt of the
    training step.

    is_logged: a bool scalar, True on the steps whose metrics the log reads
      (:attr:`dew.objectives.Step.is_logged`): the objective's diagnostics
      (:meth:`~dew.objectives.Step.diagnostic`) and ``update_norm`` are computed
      only then, in the same compiled program; nothing else depends on it, so
      the new state is the same either way.
    metrics: the objective's (``Weighted``/``Summed``, accumulated over the
    microbatches) plus ``loss``, ``accepted`` (1.0 when the update was
    applied), ``grad_norm`` (every step: the non-finite check reads it),
    ``update_norm`` (a ``Weighted`` of weight 1 on a logged step and 0 on any
    other, so a log interval's mean is the logged step's value; 0 when rejected; only
    with ``update_norm``), and ``learning_rate`` when it can be read (a
    ``learning_rate=`` schedule, or ``optax.inject_hyperparams``).

    one_device: the step runs on one device: small trees' norms are one fused
    reduction (:func:`tree_norm`).
    ordered_selects: the non-finite guard's selects are ordered further (:func:`after`:
    the average's, then the weights', then the optimizer state's; every one waits for
    the updates' norm either way), so XLA writes the state in place, not a copy of it;
    only where every weight and state leaf is whole on each device (an element of a
    split leaf would be gathered). None: :func:`orders_selects` of the default
    backend and ``one_device``.
    update_norm: log ``update_norm``. Off by default, as MaxText and the Hugging Face
    trainer log the gradients' norm but not the updates': its branch reads the
    gradients, so XLA writes each one out in float32 where a bfloat16 model's were
    converted inside the update's fusions (TPU v5e, GRPO's update at the chip size:
    0.5 ms of a 16 ms step, docs/performance.md), and orders the guard's selects after
    it.
    """
    grads_fn = accumulate(weighted_loss_fn(objective, accumulate_steps), accumulate_steps)
    if ordered_selects is None:
        ordered_selects = orders_selects(jax.default_backend(), whole=one_device)
    ema_fn = ema_update_fn(objective.ema, role_emas(objective, check_roles(objective)))

    def train_step(state: TrainState, batch, is_logged=True):
        terms, metrics, grads = grads_fn(state, batch, is_logged)
        loss = wt.loss_value(terms)
        grad_norm = tree_norm(grads, fused=one_device)
        # one reduction serves the log and the check: the global norm is finite iff
        # every gradient is (and its square sum does not overflow float32)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        logged = jnp.asarray(is_logged, jnp.float32)

        old_params, old_opt_state, old_averaged = (
            state.params_by_role,
            state.opt_state,
            state.averaged_by_role,
        )
        updates, new_opt_state = optimizer.update(grads, old_opt_state, old_params)
        new_params = optax.apply_updates(old_params, updates)
        new_averaged = ema_fn(old_averaged, new_params, state.updates)
        if update_norm:
            # the same updates again, computed in the logged steps' branch only
            again = lambda: optimizer.update(grads, old_opt_state, old_params)[0]  # noqa: E731
            norm = jnp.where(finite, update_norm_if(is_logged, again, fused=one_device), 0.0)

        # a select per leaf, not a branch: fused into each weight's update, it writes
        # the donated buffers in place, where lax.cond's operands cost copies (TPU v5e:
        # 7.5 ms of a 123 ms step; docs/performance.md). XLA recomputes the updates
        # inside each fusion that needs them (the weights', their average's, the
        # updates' norm's), so these read the old weights and optimizer state; a select
        # writing a donated buffer in place that another fusion still reads makes XLA
        # copy it first (PPO's update at the TPU size: 435 MiB of copies on the CPU).
        # Where ordered (orders_selects) they run in turn: the average, then the
        # weights, then the optimizer state.
        averaged = jax.tree.map(lambda a, b: kept_if(finite, a, b), new_averaged, old_averaged)
        if update_norm:
            # The selects run after the updates' norm on every backend: its branch reads
            # the old weights and optimizer state, which the selects overwrite in place;
            # with no order XLA copies every one of them first (TPU v5e, the GPT-2's loop
            # of blocks: 600 copies, 6.2 ms of a 105 ms step). A scalar, whole anywhere.
            finite = after(finite, norm)
        params_ok = after(finite, averaged) if ordered_selects else finite
        params = jax.tree.map(lambda a, b: kept_if(params_ok, a, b), new_params, old_params)
        state_ok = after(finite, params) if ordered_selects else finite
        opt_state = jax.tree.map(lambda a, b: kept_if(state_ok, a, b), new_opt_state, old_opt_state)
        new_state = state.replace(
            params_by_role=params,
            opt_state=opt_state,
            averaged_by_role=averaged,
            step=state.step + 1,
            microstep=state.microstep + finite.astype(jnp.int32) * accumulate_steps,
            updates=state.updates + finite.astype(jnp.int32),
        )
        out = {
            **metrics,
            "loss": loss,
            "accepted": finite.astype(jnp.float32),
            "loss_weight": jnp.min(jnp.stack([t.weight for t in terms])),
            "grad_norm": grad_norm,
        }
        if update_norm:
            out["update_norm"] = wt.Weighted(total=norm, weight=logged)
        # inject_hyperparams stores the rate it used for this update in the new state
        lr = learning_rate_of(opt_state, learning_rate, state.updates)
        if lr is not None:
            out["learning_rate"] = lr
        return new_state, out

    return train_step


def build_prepare(objective: Objective) -> Callable:
    """``(state, batch) -> prepared batch``: the objective's prepare phase on the
    pre-update weights, without gradients, drawing from the PREPARE stream."""

    def prepare(state: TrainState, batch):
        variables = jax.lax.stop_gradient(state.variables_with(state.params_by_role))
        step = Step(index=state.step, key=microbatch_key(state.key, state.step, Stream.PREPARE))
        return objective.prepare(variables, batch, step)

    return prepare


def build_prepare_finish(objective: Objective) -> Callable:
    """``(state, batch) -> prepared batch``: the objective's ``prepare_finish`` (after
    its host stage) on the same pre-update weights, without gradients; its key
    is ``fold_in(prepare key, 1)``."""

    def finish(state: TrainState, batch):
        variables = jax.lax.stop_gradient(state.variables_with(state.params_by_role))
        key = jax.random.fold_in(microbatch_key(state.key, state.step, Stream.PREPARE), 1)
        return objective.prepare_finish(variables, batch, Step(index=state.step, key=key))

    return finish


def minibatch_fn(updates: Updates) -> Callable:
    """``(state, prepared) -> minibatch``: the rows update ``u`` of the cycle reads.

    The cycle started at step ``s0 = step - u`` (``u = step % per_batch``);
    epoch ``e = u // minibatches`` reads slice ``u % minibatches`` of the rows,
    in an order drawn from ``fold_in(fold_in(root, s0), SHUFFLE)`` and ``e``
    when ``shuffle`` (epoch 0 of a single-epoch cycle keeps the prepared order).
    """
    per_batch, count = updates.per_batch, updates.minibatches

    def select(state: TrainState, prepared):
        rows = rows_of(prepared)
        size = rows // count
        u = state.step % per_batch
        epoch, slot = u // count, u % count
        if updates.shuffle and updates.epochs > 1:
            key = microbatch_key(state.key, state.step - u, Stream.SHUFFLE)
            order = jax.random.permutation(jax.random.fold_in(key, epoch), rows)
        else:
            order = jnp.arange(rows)
        take = jax.lax.dynamic_slice_in_dim(order, slot * size, size)
        return jax.tree.map(lambda x: jnp.take(x, take, axis=0), prepared)

    return select


def with_minibatch(select: Callable, step_fn: Callable) -> Callable:
    """A step that first selects its minibatch of a prepared batch (further
    arguments, such as ``is_logged``, pass through)."""
    return lambda state, prepared, *args: step_fn(state, select(state, prepared), *args)

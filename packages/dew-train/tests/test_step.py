"""The compiled step's features against numpy: gradient accumulation,
rejection of non-finite steps, the moving average; and the trainer's use of
them (log lines, NonFiniteError, averaged weights in evaluation/preview)."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.objectives import EMA, Objective, Summed
from dew.objectives.language.lm import LMObjective
from dew.train import NonFiniteError, Trainer, TrainState, build_train_step

ROWS, IN, OUT = 8, 3, 2


class Linear(Objective):
    """Least squares, ``loss = mean_rows sum_out (x W + b - y)^2``; its
    gradient has the closed form ``(2/n) X^T E`` (:func:`numpy_grads`)."""

    model = None

    def __init__(self, ema=None, evaluate_averaged=True):
        self.ema, self.evaluate_averaged = ema, evaluate_averaged
        self.previews = []

    def init(self, key):
        return {"params": {"policy": {"w": jax.random.normal(key, (IN, OUT)), "b": jnp.zeros(OUT)}}}

    def loss(self, variables, batch, step):
        p = variables["params"]["policy"]
        err = batch["x"] @ p["w"] + p["b"] - batch["y"]
        total = jnp.sum(err**2)
        return total / batch["x"].shape[0], {"se_sum": Summed(total)}

    def evaluate(self, variables, batch, step):
        return {"w_sum": jnp.sum(variables["params"]["policy"]["w"])}

    def preview(self, variables, key):
        self.previews.append(np.asarray(variables["params"]["policy"]["w"]))
        return None


def numpy_grads(params, x, y):
    err = x @ params["w"] + params["b"] - y
    return {"w": 2 / len(x) * x.T @ err, "b": 2 / len(x) * err.sum(0)}


def batch_at(i: int, poison=False):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(ROWS, IN)).astype(np.float32)
    if poison:
        x[3, 1] = np.nan
    return {"x": x, "y": rng.normal(size=(ROWS, OUT)).astype(np.float32)}


def fresh_state(objective, optimizer) -> TrainState:
    params = objective.init(jax.random.key(0))["params"]
    return TrainState(
        params_by_role=params,
        opt_state=optimizer.init(params),
        key=jax.random.key(1),
        step=jnp.int32(0),
        microstep=jnp.int32(0),
        updates=jnp.int32(0),
        averaged_by_role=params if objective.ema is not None else None,
    )


def as_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def test_accumulated_gradient_equals_full_batch_and_numpy():
    objective, lr = Linear(), 0.1
    state = fresh_state(objective, optax.sgd(lr))
    batch = batch_at(0)
    full, _ = jax.jit(build_train_step(objective, optax.sgd(lr)))(state, batch)
    accumulated, metrics = jax.jit(build_train_step(objective, optax.sgd(lr), accumulate_steps=4))(
        state, batch
    )
    # 4 microbatches of 2 rows, averaged: the same float32 gradient up to
    # summation order (a few ulps of values of order 1).
    for a, b in zip(jax.tree.leaves(accumulated.params), jax.tree.leaves(full.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    want = jax.tree.map(
        lambda p, g: p - lr * g,
        as_numpy(state.params),
        numpy_grads(as_numpy(state.params), *map(np.float64, batch.values())),
    )
    for a, b in zip(jax.tree.leaves(accumulated.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 vs float64
    # metrics are summed over microbatches; loss is their mean
    err = batch["x"] @ np.asarray(state.params["w"]) - batch["y"]
    assert float(metrics["se_sum"].total) == pytest.approx(float((err**2).sum()), rel=1e-5)
    assert float(metrics["loss"]) == pytest.approx(float((err**2).sum()) / ROWS, rel=1e-5)
    counters = (accumulated.step, accumulated.microstep, accumulated.updates)
    assert tuple(map(int, counters)) == (1, 4, 1)


def test_non_finite_step_changes_nothing_but_the_step_counter():
    objective = Linear(ema=EMA(decay=0.5))
    optimizer = optax.adam(0.1)
    step = jax.jit(build_train_step(objective, optimizer, accumulate_steps=2, update_norm=True))
    state, _ = step(fresh_state(objective, optimizer), batch_at(0))
    after, metrics = step(state, batch_at(1, poison=True))
    assert float(metrics["accepted"]) == 0.0
    assert float(metrics["update_norm"].total) == 0.0  # the rejected update's norm is NaN
    for field in ("params", "opt_state", "averaged"):
        for a, b in zip(
            jax.tree.leaves(getattr(after, field)), jax.tree.leaves(getattr(state, field))
        ):
            np.testing.assert_array_equal(a, b)
    assert (int(after.step), int(after.microstep), int(after.updates)) == (2, 2, 1)
    again, metrics = step(after, batch_at(2))
    assert float(metrics["accepted"]) == 1.0
    assert (int(again.step), int(again.microstep), int(again.updates)) == (3, 4, 2)


def test_a_rejected_step_keeps_typed_keys_in_the_optimizer_state():
    def init(params):
        return {"key": jax.random.key(3), "count": jnp.int32(0)}

    def update(updates, state, params=None):
        return updates, {"key": jax.random.split(state["key"])[0], "count": state["count"] + 1}

    optimizer = optax.chain(optax.GradientTransformation(init, update), optax.sgd(0.1))
    objective = Linear()
    step = jax.jit(build_train_step(objective, optimizer))
    state = fresh_state(objective, optimizer)
    rejected, _ = step(state, batch_at(1, poison=True))
    accepted, _ = step(state, batch_at(1))
    data = [jax.random.key_data(s.opt_state[0]["key"]) for s in (state, rejected, accepted)]
    np.testing.assert_array_equal(data[1], data[0])
    assert not np.array_equal(data[2], data[0])
    assert int(rejected.opt_state[0]["count"]) == 0 and int(accepted.opt_state[0]["count"]) == 1


@pytest.mark.parametrize(
    "ema",
    [
        EMA(decay=0.8, warmup_steps=2, include=lambda path: path.endswith("w")),
        EMA(decay=lambda updates: 0.5 + 0.1 * jnp.minimum(updates, 4.0)),
        EMA(decay=np.float32(0.5), use_warmup=True),
    ],
    ids=["constant-warmup-include", "schedule", "use-warmup"],
)
def test_moving_average_matches_numpy(ema):
    objective, optimizer = Linear(ema=ema), optax.sgd(0.3)
    step = jax.jit(build_train_step(objective, optimizer))
    state = fresh_state(objective, optimizer)
    averaged = as_numpy(state.params)
    for i in range(5):
        state, _ = step(state, batch_at(i))
        if ema.use_warmup:  # min(decay, (1 + u) / (10 + u)): 0.1, 0.18, 0.25, ...
            decay = min(0.5, (1 + i) / (10 + i))
        elif ema.warmup_steps:
            decay = 0.8 * min(1.0, i / 2)
        else:
            decay = 0.5 + 0.1 * min(i, 4)
        averaged = {
            name: decay * averaged[name] + (1 - decay) * np.asarray(state.params[name])
            for name in averaged
        }
        if ema.include is not None:  # not averaged: the live values
            averaged["b"] = np.asarray(state.params["b"], np.float64)
        for name in averaged:
            np.testing.assert_allclose(state.averaged[name], averaged[name], rtol=1e-6, atol=1e-7)
    if ema.include is not None:
        np.testing.assert_array_equal(state.averaged["b"], state.params["b"])
    assert not np.allclose(state.averaged["w"], state.params["w"])


def test_bad_ema_options_are_refused_with_the_range():
    with pytest.raises(ValueError, match=r"EMA: warmup_steps=-1 must be a whole number >= 0"):
        EMA(warmup_steps=-1)
    with pytest.raises(ValueError, match=r"EMA: decay=1.0 must be a finite number in \[0, 1\)"):
        EMA(decay=1.0)
    with pytest.raises(ValueError, match=r"EMA: decay=nan must be a finite number"):
        EMA(decay=float("nan"))
    with pytest.raises(TypeError, match=r"use_warmup must be True or False, got 1"):
        EMA(use_warmup=1)
    assert EMA(decay=np.float32(0.5), warmup_steps=np.int64(3)) == EMA(decay=0.5, warmup_steps=3)


def data(poisoned: set[int]) -> Dataset:
    """Batch i feeds step i + 1; the steps in ``poisoned`` get a NaN input."""
    return Dataset(
        train=lambda p: (batch_at(i, poison=i + 1 in poisoned) for i in itertools.count()),
        val=lambda p: iter([batch_at(100)]),
        records=0,
        batch=ROWS,
    )


@pytest.fixture(scope="module")
def trainer():
    return Trainer(
        Linear(ema=EMA(decay=0.9)),
        optax.adam(0.05),
        key=jax.random.key(0),
        max_rejected=2,
        progress=False,
    )


def test_trainer_logs_a_rejected_step_and_goes_on(trainer, capsys):
    state = trainer.fit(data({3}), steps=5, log_every=0)
    out = capsys.readouterr().out
    assert "step 3: rejected (loss nan or its gradients not finite); nothing applied" in out
    assert (int(state.step), int(state.microstep), int(state.updates)) == (5, 4, 4)


def test_too_many_consecutive_rejections_stop_the_run(trainer):
    with pytest.raises(
        NonFiniteError,
        match=r"3 consecutive steps .*\(steps \[3, 4, 5\]\), "
        r"more than max_rejected=2",
    ):
        trainer.fit(data({3, 4, 5, 6, 7, 8}), steps=8, log_every=0)
    # a rejection run that ends in time does not stop it
    state = trainer.fit(data({2, 3, 5, 6}), steps=7, log_every=0)
    assert (int(state.step), int(state.updates)) == (7, 3)


@pytest.mark.parametrize("use_averaged", [True, False])
def test_evaluation_and_preview_use_averaged_weights_when_asked(use_averaged, capsys):
    objective = Linear(ema=EMA(decay=0.9), evaluate_averaged=use_averaged)
    trainer = Trainer(objective, optax.sgd(0.3), key=jax.random.key(0), progress=False)
    state = trainer.fit(data(set()), steps=3, log_every=0, eval_every=3)
    weights = state.averaged if use_averaged else state.params
    assert not np.allclose(state.averaged["w"], state.params["w"])
    assert trainer.evaluate(state, data(set()))["w_sum"] == pytest.approx(
        float(np.sum(weights["w"])), rel=1e-6
    )
    np.testing.assert_array_equal(objective.previews[-1], weights["w"])
    live = trainer.evaluate(state, data(set()), averaged=False)["w_sum"]
    assert live == pytest.approx(float(np.sum(state.params["w"])), rel=1e-6)
    out = capsys.readouterr().out
    if use_averaged:  # the log shows both: the average's and, as live/, the live weights'
        line = "eval (ema; live/ = the live weights) step 3: w_sum "
        assert line in out and "live/w_sum -" in out, out
    else:
        assert "eval step 3: w_sum" in out and "live/" not in out


def test_pipeline_wraps_averaged_weights():
    from dew.nn import models

    model = models.build(
        "causal_transformer",
        vocab_size=32,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=8,
    )
    state = TrainState(
        params_by_role={"policy": {"live": 1}},
        opt_state=None,
        key=None,
        step=0,
        microstep=0,
        updates=0,
        averaged_by_role={"policy": {"averaged": 1}},
    )
    assert LMObjective(model=model, seq_len=8, ema=EMA()).inference_task(state).params == {
        "averaged": 1
    }
    assert LMObjective(model=model, seq_len=8).inference_task(state).params == {"live": 1}


def test_accumulate_that_does_not_divide_the_batch_is_refused(trainer):
    bad = Trainer(trainer.objective, optax.sgd(0.1), key=jax.random.key(0), accumulate=3)
    with pytest.raises(
        ValueError,
        match=r"global batch 8 does not split into accumulate=3 "
        r"microbatches of a multiple of 8 data-parallel",
    ):
        bad.fit(data(set()), steps=1)
    with pytest.raises(ValueError, match="accumulate must be >= 1 microbatches, got 0"):
        Trainer(trainer.objective, optax.sgd(0.1), key=jax.random.key(0), accumulate=0)


# ------------------------------------------------------------ the fused norm
def test_fused_tree_norm_is_one_reduction_and_equals_numpy():
    from dew.train.step import FUSED_NORM_ELEMENTS, tree_norm

    rng = np.random.default_rng(0)
    tree = {
        "a": rng.normal(size=(3, 5)).astype(np.float32),
        "b": {"c": rng.normal(size=(7,)).astype(np.float32), "d": np.float32(2.5)},
        "e": jnp.asarray(rng.normal(size=(4, 2, 3)), jnp.bfloat16),
    }
    want = np.sqrt(
        sum(np.sum(np.float64(np.asarray(x, np.float32)) ** 2) for x in jax.tree.leaves(tree))
    )
    for fused in (False, True):
        got = jax.jit(lambda t, f=fused: tree_norm(t, fused=f))(tree)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(float(got), want, rtol=1e-6)

    def reductions(fused):
        jaxpr = jax.make_jaxpr(lambda t: tree_norm(t, fused=fused))(tree)
        return sum(e.primitive.name == "reduce_sum" for e in jaxpr.jaxpr.eqns)

    assert reductions(True) == 1  # one kernel for the whole tree
    assert reductions(False) == len(jax.tree.leaves(tree))  # as optax: one per leaf
    big = {"w": jax.ShapeDtypeStruct((FUSED_NORM_ELEMENTS + 1,), jnp.float32)}
    jaxpr = jax.make_jaxpr(lambda t: tree_norm(t, fused=True))(big)
    assert not any(e.primitive.name == "concatenate" for e in jaxpr.jaxpr.eqns)  # no copy


def test_after_keeps_the_flag_whatever_the_leaves_hold():
    from dew.train.step import after

    odd = {
        "zero": jnp.zeros((2, 3)),
        "negative_zero": jnp.full((2,), -0.0),
        "nan": jnp.full((3,), jnp.nan),
        "inf": jnp.asarray(-jnp.inf),
        "bf16": jnp.ones((2, 2), jnp.bfloat16),
        "int": jnp.arange(4, dtype=jnp.int32),
        "empty": jnp.zeros((0, 3)),
    }
    for leaves in (odd, {}, {"empty": jnp.zeros((0,))}):
        for flag in (True, False):
            got = jax.jit(after)(jnp.asarray(flag), leaves)
            assert got.dtype == jnp.bool_ and bool(got) is flag


def copied_arguments(compiled) -> list[str]:
    """The arguments the compiled program copies before it runs (its entry
    computation's copies of a parameter)."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    arguments = set(re.findall(r"%([\w.\-]+) = \S+ parameter\(", entry))
    return [name for name in re.findall(r" copy\(%([\w.\-]+)\)", entry) if name in arguments]


@pytest.mark.parametrize("rejected", [False, True])
@pytest.mark.parametrize("clip_first", [False, True])
@pytest.mark.parametrize("ema", [True, False])
@pytest.mark.parametrize("update_norm", [True, False])
def test_one_device_step_writes_the_optimizer_state_in_place(
    rejected, clip_first, ema, update_norm
):
    # an AdamW state (moments read by the weights' fusions, the weights by the decay)
    # and an EMA: ordered, the donated step copies nothing. Unordered (a TPU's, a split
    # mesh's) with the update norm, every select still waits for the norm, whose branch
    # reads the old weights and state: without that order XLA copied every moment,
    # weight and the count first (7 here; on a TPU v5e 600 copies, 6 ms of the GPT-2's
    # 105 ms step); what is left is the weights the EMA's fusion reads (2), none without
    # an EMA. Unordered without the norm (no branch) the CPU's scheduler copies the 7
    # again, which is why the CPU orders them; a TPU's does not (GRPO's update at the chip
    # size: 5 entry copies, all scalars). The values are those of the unordered selects.
    objective = Linear(ema=EMA(decay=0.5)) if ema else Linear()
    optimizer = optax.adamw(0.1, weight_decay=0.1)
    if clip_first:  # a clip ahead of AdamW: its global norm reads every gradient first
        optimizer = optax.chain(optax.clip_by_global_norm(0.5), optimizer)
    built = {
        one: jax.jit(
            build_train_step(objective, optimizer, one_device=one, update_norm=update_norm),
            donate_argnums=0,
        )
        for one in (True, False)
    }
    state = fresh_state(objective, optimizer)
    state, _ = jax.jit(build_train_step(objective, optimizer))(state, batch_at(0))
    batch = batch_at(1, poison=rejected)
    compiled = built[True].lower(state, batch).compile()
    assert copied_arguments(compiled) == []
    unordered = copied_arguments(built[False].lower(state, batch).compile())
    if update_norm:
        assert len(unordered) == (2 if ema else 0), unordered
    copy = jax.tree.map(jnp.copy, state)
    got, metrics = compiled(jax.tree.map(jnp.copy, state), batch)
    want, _ = built[False](copy, batch)
    assert float(metrics["accepted"]) == float(not rejected)
    for field in ("params", "opt_state", "averaged")[: 3 if ema else 2]:
        for a, b in zip(
            jax.tree.leaves(getattr(got, field)), jax.tree.leaves(getattr(want, field))
        ):
            np.testing.assert_array_equal(a, b)


def test_the_logged_update_norm_is_optax_s_and_an_unlogged_step_the_same_state():
    # the norm is computed again inside the logged steps' branch (the step's own updates
    # are never written out): it must be the norm of the updates optax applies
    objective = Linear(ema=EMA(decay=0.5))
    optimizer = optax.adamw(0.1, weight_decay=0.1)
    step = jax.jit(build_train_step(objective, optimizer, one_device=True, update_norm=True))
    state, _ = step(fresh_state(objective, optimizer), batch_at(0), jnp.asarray(False))
    batch = batch_at(1)
    params = state.params_by_role
    grads = jax.grad(lambda p: objective.loss({"params": p}, batch, None)[0])(params)
    updates, _ = optimizer.update(grads, state.opt_state, params)
    want = np.sqrt(sum(np.sum(np.asarray(u, np.float64) ** 2) for u in jax.tree.leaves(updates)))
    logged, metrics = step(state, batch, jnp.asarray(True))
    assert float(metrics["update_norm"].weight) == 1.0
    np.testing.assert_allclose(float(metrics["update_norm"].total), want, rtol=1e-5)
    unlogged, metrics = step(state, batch, jnp.asarray(False))
    assert float(metrics["update_norm"].weight) == 0.0
    # and by default (no update_norm: no branch) the same state, the norm not logged
    plain, metrics = jax.jit(build_train_step(objective, optimizer, one_device=True))(state, batch)
    assert "update_norm" not in metrics and "grad_norm" in metrics
    for a, b, c in zip(
        jax.tree.leaves(logged.params_by_role),
        jax.tree.leaves(unlogged.params_by_role),
        jax.tree.leaves(plain.params_by_role),
    ):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_the_selects_are_ordered_on_the_cpu_alone():
    from dew.train.step import orders_selects

    # on a TPU v5e the order made the step slower (docs/performance.md, tenth chip
    # session); a split leaf would be gathered for the element the order reads
    assert orders_selects("cpu", whole=True)
    assert not orders_selects("cpu", whole=False)
    for platform in ("tpu", "gpu", "cuda", "rocm"):
        assert not orders_selects(platform, whole=True)


def test_fit_orders_the_selects_where_the_state_is_whole_on_every_device():
    # 8 devices of data parallelism hold every weight and moment whole: the guard's
    # selects are ordered there too, so the compiled update copies no argument
    data = Dataset(
        train=lambda partition: (batch_at(i) for i in itertools.count()),
        val=None,
        records=0,
        batch=ROWS,
    )
    trainer = Trainer(Linear(ema=EMA(decay=0.9)), optax.adamw(0.05), key=jax.random.key(0),
                      progress=False)  # fmt: skip
    assert trainer.device_mesh.size == jax.device_count() == 8
    trainer.fit(data, steps=1, log_every=0)
    (compiled,) = trainer.programs.cache.update.values()
    assert copied_arguments(compiled.program) == []

"""The trainer's default hooks: listed in order, replaced by a user's own (a
checkpoint policy), left out, or followed by the user's; what a hook sees
checked against numpy; the EMA weights as the default of evaluation and
``state.variables()``."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.objectives import EMA, Objective, Weighted
from dew.train import (
    DEFAULT_HOOKS,
    Checkpointing,
    Checkpoints,
    EarlyStop,
    EarlyStopping,
    Evaluation,
    LogMetrics,
    MeshSpec,
    StepReport,
    Trainer,
)

ROWS, IN = 8, 3
ONE = MeshSpec(data=1, devices=jax.devices()[:1])
W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


class Regression(Objective):
    """Least squares on a fixed linear map; ``evaluate`` reports the mean squared error."""

    model = None

    def __init__(self, ema=None):
        self.ema = ema

    def init(self, key, spec=None):
        return {"params": {"policy": {"w": jax.random.normal(key, (IN,))}}}

    def loss(self, variables, batch, step):
        err = batch["x"] @ variables["params"]["policy"]["w"] - batch["y"]
        return jnp.mean(err**2), {}

    def evaluate(self, variables, batch, step):
        err = batch["x"] @ variables["params"]["policy"]["w"] - batch["y"]
        return {"mse": Weighted.mean(err**2)}


def rows(i):
    x = np.random.default_rng(i).normal(size=(ROWS, IN)).astype(np.float32)
    return {"x": x, "y": x @ W_TRUE}


VAL = [rows(100), rows(101)]
DATA = Dataset(
    train=lambda p: (rows(i) for i in itertools.count()),
    val=lambda p: iter(VAL),
    records=0,
    batch=ROWS,
)


def numpy_mse(w, val=VAL) -> float:
    """The validation error of weights ``w`` over ``val``, in float64 numpy."""
    errors = [b["x"].astype(np.float64) @ np.asarray(w, np.float64) - b["y"] for b in val]
    return float(np.mean(np.concatenate(errors) ** 2))


def trainer(**kw) -> Trainer:
    return Trainer(Regression(), optax.sgd(0.05), key=jax.random.key(0), mesh=ONE, **kw)


def test_the_default_hooks_are_listed_in_order_before_the_users():
    t = trainer()
    t.add_hook(lambda info: None, name="report")
    assert t.hook_names() == [*DEFAULT_HOOKS, "report"]
    assert DEFAULT_HOOKS == (
        "rejections",
        "log",
        "evaluation",
        "checkpoints",
        "early_stopping",
        "stop_signals",
    )

    def policy(info):
        pass

    t.replace_hook("checkpoints", policy)
    t.replace_hook("log", None)
    names = t.hook_names()
    assert names == [
        "rejections",
        "evaluation",
        "checkpoints (policy)",
        *DEFAULT_HOOKS[4:],
        "report",
    ]


def test_replacing_a_hook_that_does_not_exist_lists_the_ones_that_do():
    with pytest.raises(
        ValueError,
        match=r"no default hook 'checkpoint' to replace; the default hooks are \['rejections', "
        r"'log', 'evaluation', 'checkpoints', 'early_stopping', 'stop_signals'\]",
    ):
        trainer().replace_hook("checkpoint", lambda info: None)


def test_an_own_checkpoint_policy_replaces_the_default_and_resumes_exactly(tmp_path):
    """The policy saves at steps 3 and 5 only (no final checkpoint: the policy
    decides); a run resumed from step 5 (the replacement restores it: it owns all of
    checkpointing) reaches the weights of an uninterrupted run bit for bit."""

    def odd_steps_after_two(info):
        if info.step in (3, 5):
            assert info.save_checkpoint() == str(tmp_path / "run" / str(info.step))

    def own(policy=odd_steps_after_two):
        t = trainer()
        spec = Checkpoints(tmp_path / "run", use_async=False)
        t.replace_hook("checkpoints", Checkpointing(spec, policy=policy))
        return t

    own().fit(DATA, steps=6, log_every=0)
    assert Checkpoints(tmp_path / "run").steps() == [3, 5]

    lines = []
    t = own(policy=lambda info: None)
    t.add_hook(lambda info: lines.append(info.step))
    resumed = t.fit(DATA, steps=6, log_every=0)
    assert lines == [6]  # resumed from step 5
    straight = trainer().fit(DATA, steps=6, log_every=0)
    np.testing.assert_array_equal(resumed.params["w"], straight.params["w"])

    # a function in its place replaces all of it: nothing restores, nothing writes
    t = trainer()
    t.replace_hook("checkpoints", odd_steps_after_two)
    with pytest.raises(ValueError, match=r"save_checkpoint needs somewhere to write"):
        t.fit(DATA, steps=3, log_every=0)
    # and goes without Trainer(checkpoints=), which configures the default it replaced
    t = trainer(checkpoints=Checkpoints(tmp_path / "other"))
    t.replace_hook("checkpoints", odd_steps_after_two)
    with pytest.raises(ValueError, match=r"the replacement owns all of checkpointing"):
        t.fit(DATA, steps=3, log_every=0)
    assert not (tmp_path / "other" / "3").exists()


def test_checkpointing_bad_arguments_name_their_values(tmp_path):
    with pytest.raises(TypeError, match=r"needs a dew.train.Checkpoints .*got str"):
        Checkpointing(str(tmp_path))
    for every in (-2, 0, 1.5):
        with pytest.raises(
            ValueError,
            match=rf"Checkpointing: every={every} must be a whole number >= 1 \(steps "
            rf"between checkpoints; None = only at the end\)",
        ):
            Checkpointing(Checkpoints(tmp_path), every=every)
    with pytest.raises(ValueError, match=r"the policy decides when to save; drop every="):
        Checkpointing(Checkpoints(tmp_path), every=2, policy=lambda info: None)


def test_leaving_out_the_log_hook_leaves_out_its_lines_only(capsys):
    t = trainer()
    t.replace_hook("log", None)
    t.fit(DATA, steps=4, log_every=2)
    out = capsys.readouterr().out
    assert "step 2: loss" not in out and "Throughput:" not in out
    assert "Training from step 0 to 4" in out and "Goodput:" in out


def test_a_hook_sees_this_steps_evaluation_and_the_interval_metrics():
    """At each evaluation step, ``info.evaluation['mse']`` is the numpy error of the
    weights the hook sees; on log steps ``info.metrics['loss']`` is the mean of the
    interval's training losses (each recomputed in numpy from the weights before it)."""
    seen, weights = [], [None]
    t = trainer()

    def watch(info):
        seen.append((info.step, info.evaluation, dict(info.metrics)))

    def keep_weights(info):
        weights.append(np.asarray(info.state.params["w"]))

    t.add_hook(watch)
    t.add_hook(keep_weights)
    start = np.asarray(t.init_state().params["w"])
    weights[0] = start
    t.fit(DATA, steps=4, log_every=2, eval_every=2)
    evaluations = {s: e for s, e, _ in seen if e is not None}
    assert sorted(evaluations) == [2, 4]
    for step, results in evaluations.items():
        assert results["mse"] == pytest.approx(numpy_mse(weights[step]), rel=1e-5)
    losses = []
    for i in range(4):
        b = rows(i)
        losses.append(np.mean((b["x"] @ weights[i].astype(np.float64) - b["y"]) ** 2))
    metrics = {s: m for s, _, m in seen}
    assert metrics[2]["loss"] == pytest.approx(np.mean(losses[:2]), rel=1e-5)
    assert metrics[4]["loss"] == pytest.approx(np.mean(losses[2:]), rel=1e-5)
    assert metrics[4]["eval/mse"] == evaluations[4]["mse"]
    assert metrics[1] == {}


def test_a_rejection_count_fetch_leaves_a_quiet_steps_metrics_for_the_next(monkeypatch):
    """With ``max_rejected=3`` the metrics leave the devices every 3 steps for the
    rejection count. Where a hook acts at that step (every step below) the fetch takes
    them all; where none does, it leaves the step just dispatched, which may still be
    running, for the next fetch (no wait on the devices): a hook that acts at step 7
    only. Each step's loss arrives once either way, equal to numpy's from the weights
    before the step."""
    from dew.train import _run

    groups, fetch = [], _run.Pending.fetch

    def spy(self, *, keep=0):
        out = fetch(self, keep=keep)
        if out:
            groups.append([(s, float(v["loss"])) for s, v in out])
        return out

    monkeypatch.setattr(_run.Pending, "fetch", spy)
    t = trainer(max_rejected=3)
    weights = [np.asarray(t.init_state().params["w"])]
    t.add_hook(lambda info: weights.append(np.asarray(info.state.params["w"])))
    t.fit(DATA, steps=10, log_every=0)
    acting = groups
    assert [[s for s, _ in g] for g in acting] == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]
    groups = []
    quiet = trainer(max_rejected=3)
    quiet.add_hook(lambda info: None, every=7)
    quiet.fit(DATA, steps=10, log_every=0)
    assert [[s for s, _ in g] for g in groups] == [[1, 2], [3, 4], [5, 6, 7], [8, 9, 10]]
    losses = dict(x for g in groups for x in g)
    assert losses == dict(x for g in acting for x in g)
    for step, loss in losses.items():
        b = rows(step - 1)
        expected = np.mean((b["x"] @ weights[step - 1].astype(np.float64) - b["y"]) ** 2)
        assert loss == pytest.approx(expected, rel=1e-5)


def test_evaluation_and_variables_default_to_the_moving_average():
    """With ``ema=``, ``state.variables()`` (what ``objective.sample``/``export`` are
    given) and the trainer's evaluation read the averaged weights; the live ones
    stay one argument away. ``EMA(decay=0.5)`` after sgd updates: the average is
    recomputed here from the live weights of each step."""
    objective = Regression(ema=EMA(decay=0.5))
    t = Trainer(objective, optax.sgd(0.05), key=jax.random.key(0), mesh=ONE)
    live = [np.asarray(t.init_state().params["w"], np.float64)]
    t.add_hook(lambda info: live.append(np.asarray(info.state.params["w"], np.float64)))
    state = t.fit(DATA, steps=3, log_every=0)
    average = live[0]
    for w in live[1:]:
        average = 0.5 * average + 0.5 * w
    np.testing.assert_allclose(state.variables()["params"]["policy"]["w"], average, rtol=1e-6)
    np.testing.assert_array_equal(
        state.variables(averaged=False)["params"]["policy"]["w"], live[-1]
    )
    assert not np.allclose(average, live[-1])
    assert t.evaluate(state, DATA)["mse"] == pytest.approx(numpy_mse(average), rel=1e-5)
    # an objective that evaluates with its live weights keeps them as the default
    objective.evaluate_averaged = False
    other = Trainer(objective, optax.sgd(0.05), key=jax.random.key(0), mesh=ONE)
    state = other.fit(DATA, steps=3, log_every=0)
    np.testing.assert_array_equal(state.variables()["params"]["policy"]["w"], state.params["w"])


# the timing fields of a metrics.jsonl record: the same run gives other values
TIMES = {"time", "step_seconds", "examples_per_second", "mfu", "step_flops"}


def jsonl(path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` without their timings (the goodput
    record: its names)."""
    rows = [json.loads(line) for line in open(path / "metrics.jsonl")]
    return [
        sorted(r) if r["kind"] == "goodput" else {k: v for k, v in r.items() if k not in TIMES}
        for r in rows
    ]


def test_fits_cadences_are_shorthands_for_the_hooks_settings(tmp_path):
    """``fit(log_every=2, eval_every=2, eval_batches=1, checkpoint_every=2)`` and the
    hooks built with those settings (``fit()`` at its defaults) record the same
    ``metrics.jsonl`` (timings aside), write the same checkpoints, end at the same
    weights; the settings win over ``fit``'s defaults; the order is the defaults'."""
    shorthand = trainer(run_dir=tmp_path / "a", checkpoints=Checkpoints(tmp_path / "ca"))
    shorthand_final = shorthand.fit(
        DATA, steps=4, log_every=2, eval_every=2, eval_batches=1, checkpoint_every=2
    )

    own = trainer(run_dir=tmp_path / "b")
    own.replace_hook("log", LogMetrics(every=2))
    own.replace_hook("evaluation", Evaluation(every=2, batches=1))
    own.replace_hook("checkpoints", Checkpointing(Checkpoints(tmp_path / "cb"), every=2))
    assert own.hook_names() == list(DEFAULT_HOOKS)
    weights = {}
    own.add_hook(lambda info: weights.update({info.step: np.asarray(info.state.params["w"])}))
    own.fit(DATA, steps=4)

    a, b = jsonl(tmp_path / "a"), jsonl(tmp_path / "b")
    assert a == b
    assert [(r["kind"], r["step"]) for r in a[:-1]] == [
        ("train", 2),
        ("eval", 2),
        ("train", 4),
        ("eval", 4),
    ]
    # batches=1: the first validation batch only, as numpy computes it
    for r in a[:-1]:
        if r["kind"] == "eval":
            assert r["mse"] == pytest.approx(numpy_mse(weights[r["step"]], VAL[:1]), rel=1e-5)
            assert r["mse"] != pytest.approx(numpy_mse(weights[r["step"]]), rel=1e-3)
    assert Checkpoints(tmp_path / "cb").steps() == Checkpoints(tmp_path / "ca").steps() == [2, 4]
    np.testing.assert_array_equal(shorthand_final.params["w"], weights[4])


def test_a_hooks_settings_are_checked_when_it_is_built():
    for every in (0, -1, 2.5, True):
        with pytest.raises(
            ValueError,
            match=rf"LogMetrics: every={every!r} must be a whole number >= 1 \(steps between "
            rf"log lines; None = none\)",
        ):
            LogMetrics(every=every)
        with pytest.raises(
            ValueError, match=rf"Evaluation: every={every!r} must be a whole number >= 1"
        ):
            Evaluation(every=every)
    for batches in (0, -1):
        with pytest.raises(
            ValueError,
            match=rf"Evaluation: batches={batches} must be a whole number >= 1 \(batches per "
            rf"evaluation; None = all\)",
        ):
            Evaluation(every=2, batches=batches)
    with pytest.raises(ValueError, match=r"patience must be >= 1 evaluations, got 0"):
        EarlyStop(metric="mse", patience=0)
    with pytest.raises(ValueError, match=r"an EarlyStopping or its settings as keywords, not"):
        EarlyStop(EarlyStopping(), patience=2)
    with pytest.raises(TypeError, match=r"needs a dew.train.EarlyStopping .*got str"):
        EarlyStop("mse")
    with pytest.raises(
        ValueError,
        match=r"LogMetrics\(every=10\) is the 'log' hook: replace_hook\('log', \.\.\.\) puts "
        r"it in its place; in the place of 'evaluation'",
    ):
        trainer().replace_hook("evaluation", LogMetrics(every=10))
    assert repr(LogMetrics(every=10)) == "LogMetrics(every=10)"
    assert repr(Evaluation(every=5)) == "Evaluation(every=5, batches=None)"
    assert EarlyStop(metric="mse", patience=2).spec == EarlyStopping(metric="mse", patience=2)


def test_later_hooks_read_the_results_of_earlier_ones_from_a_frozen_record(tmp_path):
    """A user's hook sees the default evaluation's results (numpy's error of the
    weights it sees), the checkpoint the default hook wrote at this step, and what an
    earlier user hook reported (``StepReport``); the record itself cannot be written."""
    t = trainer(checkpoints=Checkpoints(tmp_path / "run", use_async=False))
    t.replace_hook("evaluation", Evaluation(every=2))
    seen = {}

    def first(info):
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.evaluation = {}
        with pytest.raises(TypeError):
            info.metrics["mse"] = 0.0
        if info.evaluation:
            return StepReport(metrics={"double_mse": 2 * info.evaluation["mse"]})
        return None

    def second(info):
        w = np.asarray(info.state.params["w"])
        seen[info.step] = (info.evaluation, dict(info.metrics), info.checkpoint, w)

    t.add_hook(first)
    t.add_hook(second)
    t.fit(DATA, steps=4, log_every=0, checkpoint_every=2)
    assert sorted(seen) == [1, 2, 3, 4]
    for step, (evaluation, metrics, _, w) in seen.items():
        if step % 2:
            assert (evaluation, metrics) == (None, {})
            continue
        assert evaluation["mse"] == pytest.approx(numpy_mse(w), rel=1e-5)
        assert metrics["eval/mse"] == evaluation["mse"]
        assert metrics["double_mse"] == 2 * evaluation["mse"]
    path = str(tmp_path / "run")
    assert [seen[s][2] for s in (1, 2, 3, 4)] == [None, f"{path}/2", None, f"{path}/4"]


def test_an_early_stop_with_settings_of_its_own_replaces_the_default():
    """``min_delta`` larger than any change: the first evaluation (step 2) is the
    best, the second (step 4) does not improve on it, so ``patience=1`` stops there;
    the same hook object starts afresh in a second fit."""
    t = trainer()
    t.replace_hook("evaluation", Evaluation(every=2))
    t.replace_hook("early_stopping", EarlyStop(metric="mse", patience=1, min_delta=1e9))
    for _ in range(2):
        t.fit(DATA, steps=8, log_every=0)
        assert (t.result.reason, t.result.step) == ("early_stopped", 4)

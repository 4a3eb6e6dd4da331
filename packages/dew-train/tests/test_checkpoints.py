"""Checkpoints: what they hold, exact resume in-process, skipping unusable
ones, load_model, and the errors. The reference is an uninterrupted run
whose own checkpoints give the state at every second step."""

from __future__ import annotations

import json
import os
import shutil
import signal

import grain
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from dew.data import Dataset
from dew.nn import models
from dew.objectives import EMA
from dew.objectives.lm import LMObjective
from dew.train import CheckpointMismatchError, Checkpoints, Trainer, load_model

SEQ, BATCH, VOCAB, STEPS = 8, 8, 32, 6


class WithReference(LMObjective):
    """An LM objective with a frozen collection beside the params (a
    reference policy, as DPO keeps): twice the initial weights."""

    def init(self, key):
        variables = dict(super().init(key))
        variables["reference"] = jax.tree.map(
            lambda x: 2 * x,
            jax.tree.map(
                lambda b: b.unbox() if hasattr(b, "unbox") else b,
                variables["params"],
                is_leaf=lambda b: hasattr(b, "unbox"),
            ),
        )
        return variables


def make_trainer(directory=None, *, emb=16, **kwargs) -> Trainer:
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=emb,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=SEQ,
    )
    objective = WithReference(model, seq_len=SEQ, ema=EMA(decay=0.9))
    if directory is not None:
        kwargs["checkpoints"] = Checkpoints(directory, keep=None)
    return Trainer(objective, optax.adamw(1e-2), key=jax.random.key(0), progress=False, **kwargs)


def row(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, VOCAB, SEQ + 1, dtype=np.int32)


def grain_data() -> Dataset:
    """A Grain pipeline whose batches change every step (position saved)."""
    ds = grain.MapDataset.range(64).shuffle(seed=3).repeat().map(lambda i: {"text": row(i)})
    return Dataset(
        train=lambda p: iter(ds.batch(BATCH).to_iter_dataset()), val=None, records=64, batch=BATCH
    )


def plain_data() -> Dataset:
    """A deterministic generator whose batches change every step (no position)."""

    def train(partition):
        step = 0
        while True:
            yield {"text": np.stack([row(1000 + step * BATCH + i) for i in range(BATCH)])}
            step += 1

    return Dataset(train=train, val=None, records=0, batch=BATCH)


def assert_same_state(a, b):
    for name in ("step", "microstep", "updates"):
        assert int(getattr(a, name)) == int(getattr(b, name)), name
    for field in ("params", "opt_state", "averaged", "frozen"):
        for x, y in zip(
            jax.tree.leaves(getattr(a, field)), jax.tree.leaves(getattr(b, field)), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field)
    np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One Trainer on one checkpoint directory, reused by the tests (a later
    ``fit`` reuses the compiled step); ``run.reset(steps)`` puts copies of
    the reference run's checkpoints at ``steps`` in its directory."""
    directory = tmp_path_factory.mktemp("run")
    trainer = make_trainer(directory)

    class Run:
        pass

    run = Run()
    run.trainer, run.directory = trainer, directory
    # The reference: an uninterrupted run on Grain data, checkpointed at 2, 4, 6.
    run.final = trainer.fit(grain_data(), steps=STEPS, log_every=0, checkpoint_every=2)
    run.reference = tmp_path_factory.mktemp("reference")
    shutil.copytree(directory, run.reference, dirs_exist_ok=True)

    def reset(*steps):
        shutil.rmtree(directory)
        directory.mkdir()
        for step in steps:
            shutil.copytree(run.reference / str(step), directory / str(step))

    run.reset = reset
    return run


@pytest.mark.slow
def test_checkpoint_holds_the_whole_state(run):
    directory, state = run.reference, run.final
    assert Checkpoints(directory).steps() == [2, 4, 6]
    step_dir = os.path.join(directory, "6")
    saved = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
    for field in ("params", "averaged", "frozen"):
        for x, y in zip(
            jax.tree.leaves(saved[field]), jax.tree.leaves(getattr(state, field)), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(saved["key"], jax.random.key_data(state.key))
    for x, y in zip(
        jax.tree.leaves(saved["opt_state"]), jax.tree.leaves(state.opt_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (int(saved["step"]), int(saved["microstep"]), int(saved["updates"])) == (6, 6, 6)
    # the frozen collection is twice the initial params, and never optimized
    init = run.trainer.init_state()
    np.testing.assert_array_equal(
        np.asarray(state.frozen["reference"]["embed"]["embedding"]),
        2 * np.asarray(init.params["embed"]["embedding"]),
    )
    meta = json.load(open(os.path.join(step_dir, "meta", "metadata")))
    assert meta["model"] == dict(
        zip(("name", "config"), models.config_of(run.trainer.objective.model))
    )
    position = json.load(open(os.path.join(step_dir, "data_iter", "process_0-of-1.json")))
    it = grain_data().train(None)
    for _ in range(6):
        next(it)
    assert position == {"state": it.get_state()}


@pytest.mark.slow
def test_resume_continues_exactly_from_grain_position(run, capsys):
    run.reset(2)
    capsys.readouterr()
    state = run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    out = capsys.readouterr().out
    assert f"Resuming from step 2 ({run.directory}/2). Training from step 2 to {STEPS} on " in out
    assert "Warning" not in out
    assert_same_state(state, run.final)


@pytest.mark.slow
def test_plain_iterator_is_fast_forwarded_with_a_warning(run, capsys):
    run.reset()
    final = run.trainer.fit(plain_data(), steps=4, log_every=0, checkpoint_every=2)
    shutil.rmtree(run.directory / "4")  # as if killed after the checkpoint of step 2
    capsys.readouterr()
    state = run.trainer.fit(plain_data(), steps=4, log_every=0)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "Warning" in line]
    assert len(warnings) == 1
    assert "cannot save its position" in warnings[0]
    assert "skipping the 2 batches" in warnings[0]
    assert_same_state(state, final)


@pytest.mark.slow
# Orbax leaves a tensorstore callback behind when a truncated file fails a restore.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unusable_newest_checkpoint_is_set_aside(run, capsys):
    directory = run.directory
    run.reset(2, 4)
    # 1. no commit marker: the save of step 4 never finished
    os.remove(directory / "4" / "commit_success.txt")
    files = sorted(p.relative_to(directory / "4") for p in (directory / "4").rglob("*"))
    capsys.readouterr()
    state = run.trainer.fit(grain_data(), steps=4, log_every=0)
    out = capsys.readouterr().out
    assert f"Skipping checkpoint {directory}/4: it has no commit marker" in out
    assert f"Resuming from step 2 ({directory}/2)" in out
    kept = directory / "4.unusable"
    assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == files  # nothing deleted
    _, params = load_model(run.reference, step=4)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # 2. truncated data files in the newest checkpoint (the rewritten 4)
    for path in (directory / "4" / "state" / "d").iterdir():
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    state = run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    out = capsys.readouterr().out
    assert f"Skipping checkpoint {directory}/4: it cannot be read" in out
    assert f"Resuming from step 2 ({directory}/2)" in out
    assert (directory / "4.unusable-1" / "state").is_dir()
    assert_same_state(state, run.final)


def test_load_model_rebuilds_model_and_weights(run):
    state = run.final
    model, params = load_model(run.reference)
    assert models.config_of(model) == models.config_of(run.trainer.objective.model)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _, averaged = load_model(run.reference, averaged=True)
    for x, y in zip(jax.tree.leaves(averaged), jax.tree.leaves(state.averaged), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(
        FileNotFoundError,
        match="no committed checkpoint for step 5 in .*committed steps: \\[2, 4, 6\\]",
    ):
        load_model(run.reference, step=5)


def test_checkpoint_of_another_model_names_the_parameter(run, tmp_path):
    shutil.copytree(run.reference / "6", tmp_path / "6")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'params/embed/embedding' has shape \(32, 16\) in the checkpoint "
        r"and \(32, 24\) in this run",
    ):
        make_trainer(tmp_path, emb=24).fit(grain_data(), steps=STEPS)
    assert Checkpoints(tmp_path).steps() == [6]  # an error, not skipped


def test_unwritable_directory_fails_before_the_first_step(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="cannot write checkpoints to .*file/run"):
        make_trainer(blocker / "run").fit(grain_data(), steps=2)
    with pytest.raises(PermissionError, match="cannot write metrics to .*file/run"):
        make_trainer(run_dir=str(blocker / "run")).fit(grain_data(), steps=2)
    assert "Training from" not in capsys.readouterr().out


def test_bad_arguments_name_their_values(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1 steps .*got -1"):
        make_trainer(tmp_path).fit(grain_data(), steps=2, checkpoint_every=-1)
    with pytest.raises(ValueError, match="checkpoint_every=5 needs somewhere to write"):
        make_trainer().fit(grain_data(), steps=2, checkpoint_every=5)
    with pytest.raises(ValueError, match="keep must be >= 1 .*got 0"):
        Checkpoints(tmp_path, keep=0)
    with pytest.raises(TypeError, match="checkpoints must be a dew.train.Checkpoints"):
        make_trainer(checkpoints=str(tmp_path))


@pytest.mark.slow
def test_sigint_stops_cleanly_and_restores_the_handler(run, capsys):
    run.reset()
    data = grain_data()

    class Interrupt:
        """Sends this process SIGINT when batch 2 is asked for."""

        def __init__(self):
            self.inner, self.count = data.train(None), 0
            self.get_state, self.set_state = self.inner.get_state, self.inner.set_state

        def __iter__(self):
            return self

        def __next__(self):
            if self.count == 2:
                os.kill(os.getpid(), signal.SIGINT)
            self.count += 1
            return next(self.inner)

    before = signal.getsignal(signal.SIGINT)
    interrupted = Dataset(train=lambda p: Interrupt(), val=None, records=64, batch=BATCH)
    capsys.readouterr()
    state = run.trainer.fit(interrupted, steps=STEPS, log_every=0)
    out = capsys.readouterr().out
    assert int(state.step) == 3  # step 3 was in flight and finished
    assert f"Stopped by SIGINT at step 3; checkpoint written to {run.directory}/3" in out
    assert signal.getsignal(signal.SIGINT) is before
    assert Checkpoints(run.directory).steps() == [3]
    state = run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    assert_same_state(state, run.final)

"""Checkpoints: what they hold, exact resume in-process, skipping unusable
ones, load_model, and the errors. The reference is an uninterrupted run
whose own checkpoints give the state at every second step."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from dew.data import Dataset
from dew.nn import models
from dew.objectives import EMA
from dew.objectives.language.lm import LMObjective
from dew.train import CheckpointMismatchError, Checkpoints, Trainer, load_model
from dew.train._integrity import ChecksumsMissingError, read_recorded
from dew.train.checkpoints import NoUsableCheckpointError, OptimizerMismatchError
from dew.train.state import TrainState

SEQ, BATCH, VOCAB, STEPS = 8, 8, 32, 6


class WithReference(LMObjective):
    """An LM objective with a frozen collection beside the params (a
    reference policy, as DPO keeps): twice the initial weights."""

    init_reads_spec = False  # the seed's init(key), overriding LMObjective's

    def init(self, key):
        variables = dict(super().init(key))
        variables["reference"] = jax.tree.map(
            lambda x: 2 * x,
            jax.tree.map(
                lambda b: b.unbox() if hasattr(b, "unbox") else b,
                variables["params"]["policy"],
                is_leaf=lambda b: hasattr(b, "unbox"),
            ),
        )
        return variables


def make_trainer(directory=None, *, emb=16, optimizer=None, **kwargs) -> Trainer:
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=emb,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=SEQ,
    )
    objective = WithReference(model=model, seq_len=SEQ, ema=EMA(decay=0.9))
    if directory is not None:
        kwargs["checkpoints"] = Checkpoints(directory, keep=None)
    optimizer = optax.adamw(1e-2) if optimizer is None else optimizer
    return Trainer(objective, optimizer, key=jax.random.key(0), progress=False, **kwargs)


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

    return Dataset(train=train, val=None, records=10**6, batch=BATCH)


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
    kept = directory / "4.unfinished"  # a save that never finished: it held no progress
    assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == files  # nothing deleted
    _, params = load_model(run.reference, step=4, averaged=False)
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
    assert (directory / "4.unusable" / "state").is_dir()  # a committed one, proven damaged
    assert_same_state(state, run.final)


def test_load_model_rebuilds_model_and_weights(run):
    state = run.final
    model, params = load_model(run.reference, averaged=False)
    assert models.config_of(model) == models.config_of(run.trainer.objective.model)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _, averaged = load_model(run.reference, averaged=True)
    for x, y in zip(jax.tree.leaves(averaged), jax.tree.leaves(state.averaged), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the default follows the checkpoint: this run kept an EMA and evaluated with it, so
    # load_model gives the weights its evaluation, previews and export read
    _, default = load_model(run.reference)
    want = state.variables()["params"]["policy"]
    for x, y in zip(jax.tree.leaves(default), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(
        np.asarray(default["lm_head"]["kernel"]), np.asarray(state.params["lm_head"]["kernel"])
    )
    meta = json.loads((run.reference / "6" / "meta" / "metadata").read_text())
    assert meta["averaged"] is True and meta["evaluate_averaged"] is True
    with pytest.raises(
        FileNotFoundError,
        match="no committed checkpoint for step 5 in .*committed steps: \\[2, 4, 6\\]",
    ):
        load_model(run.reference, step=5)


def test_checkpoint_of_another_model_names_the_parameters(run, tmp_path):
    shutil.copytree(run.reference / "6", tmp_path / "6")
    before = listing(tmp_path)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"does not match this run's model .*: 'params/policy/embed/embedding' has "
        r"shape \(32, 16\) in the checkpoint and \(32, 24\) in this run; "
        r"'params/policy/final_norm/scale' has shape \(16,\) in the checkpoint and \(24,\) in "
        r"this run; .* and \d+ more",
    ) as error:
        make_trainer(tmp_path, emb=24).fit(grain_data(), steps=STEPS)
    assert not isinstance(error.value, OptimizerMismatchError)
    # the configuration fields that differ, with both values, not the whole config
    assert "(it differs in emb_features: 16 in the checkpoint, 24 in this run)" in str(error.value)
    assert "num_layers" not in str(error.value) and "mlp_features" not in str(error.value)
    assert listing(tmp_path) == before  # an error, not skipped


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


# ------------------------------------------------- damage told from a mistake
def listing(directory) -> dict[str, int]:
    """Every checkpoint file under ``directory`` and its size (not the run's
    logs): what 'unchanged' compares."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.relative_to(directory).parts[0][0].isdigit()
    }


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


DAMAGE = {  # kind: (damage, reason); a save that never finished is kept as <step>.unfinished
    "no commit marker": (
        lambda step: os.remove(step / "commit_success.txt"),
        "it has no commit marker (commit_success.txt), so its save never finished",
    ),
    "truncated array files": (
        lambda step: [truncate(p) for p in (step / "state" / "d").iterdir()],
        "it cannot be read (ValueError: ",
    ),
    "deleted array files": (
        lambda step: [os.remove(p) for p in (step / "state" / "d").iterdir()],
        "it cannot be read (ValueError: NOT_FOUND",
    ),
    "deleted state metadata": (
        lambda step: os.remove(step / "state" / "_METADATA"),
        "it cannot be read (FileNotFoundError: ",
    ),
    "truncated meta json": (
        lambda step: truncate(step / "meta" / "metadata"),
        "it cannot be read (JSONDecodeError: ",
    ),
}


@pytest.mark.slow
# Orbax leaves a tensorstore callback behind when a damaged file fails a restore.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_sets_the_checkpoint_aside(run, kind, capsys):
    directory = run.directory
    run.reset(2, 4)
    damage, reason = DAMAGE[kind]
    damage(directory / "4")
    files = listing(directory / "4")
    capsys.readouterr()
    state = run.trainer.fit(grain_data(), steps=4, log_every=0)
    out = capsys.readouterr().out
    kept = "4.unfinished" if kind == "no commit marker" else "4.unusable"
    assert f"Skipping checkpoint {directory}/4: {reason}" in out
    assert f"kept as {directory}/{kept}, nothing deleted" in out
    assert f"Resuming from step 2 ({directory}/2)" in out
    assert listing(directory / kept) == files  # set aside as it was
    _, params = load_model(run.reference, step=4, averaged=False)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ("orbax.checkpoint.StandardCheckpointer.restore", AssertionError("")),
        ("dew.train.checkpoints.from_saved", TypeError("from_saved() got an unexpected 'x'")),
        ("dew.train.checkpoints.check_compatible", KeyError("opt_state")),
    ],
    ids=["library_assertion", "type_error", "key_error"],
)
def test_a_mistake_while_restoring_propagates_and_changes_nothing(run, target, error, monkeypatch):
    """The issue's run: an AssertionError inside Orbax set every checkpoint
    aside and trained from step 0. A mistake is not damage."""
    run.reset(2, 4)
    before = listing(run.directory)

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(target, broken)
    with pytest.raises(type(error)) as raised:
        run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    assert raised.value is error
    monkeypatch.undo()
    assert listing(run.directory) == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_no_usable_checkpoint_stops_unless_start_fresh(run, capsys):
    directory = run.directory
    run.reset(2, 4)
    os.remove(directory / "4" / "commit_success.txt")
    for path in (directory / "2" / "state" / "d").iterdir():
        truncate(path)
    with pytest.raises(NoUsableCheckpointError) as raised:
        run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    message = str(raised.value)
    assert f"no usable checkpoint in {directory}, so this run would start over from step 0" in (
        message
    )
    assert f"{directory}/2 kept as {directory}/2.unusable (it cannot be read (ValueError" in message
    assert "4.unfinished" not in message  # a save that never finished held no progress
    assert "start_fresh=True" in message
    steps = sorted(n for n in os.listdir(directory) if n != ".lock")  # (fit's run lock)
    assert steps[:2] == ["2.unusable", "4.unfinished"]
    # the next run does not start over either
    with pytest.raises(NoUsableCheckpointError, match="set aside by an earlier run: 2.unusable"):
        run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    # asked to start fresh, it does: steps 0..2 as the reference ran them
    spec = run.trainer.checkpoints
    run.trainer.checkpoints = dataclasses.replace(spec, start_fresh=True)
    try:
        capsys.readouterr()
        state = run.trainer.fit(grain_data(), steps=2, log_every=0)
    finally:
        run.trainer.checkpoints = spec
    out = capsys.readouterr().out
    assert "Starting from step 0 (Checkpoints(start_fresh=True))" in out
    assert "Training from step 0 to 2" in out
    _, params = load_model(run.reference, step=2, averaged=False)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (directory / "2.unusable").is_dir() and (directory / "2").is_dir()


# ------------------------------------------------------- another optimizer
@pytest.mark.slow
def test_another_optimizer_is_named_or_reset(run, tmp_path):
    shutil.copytree(run.reference / "6", tmp_path / "6")
    before = listing(tmp_path)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    with pytest.raises(
        OptimizerMismatchError,
        match=r"checkpoint .*/6 was written with another optimizer: the model matches but the "
        r"optimizer state does not. Saved: 25 arrays \[opt_state/0/count, opt_state/0/mu/\*, "
        r"opt_state/0/nu/\*\]; this run's optimizer: 25 arrays \[opt_state/1/0/count, "
        r"opt_state/1/0/mu/\*, opt_state/1/0/nu/\*\] .* First differences: 'opt_state/1/0/count' "
        r"\(shape \(\)\) is not in the checkpoint;.*reset_optimizer=True\) to keep the weights",
    ):
        make_trainer(tmp_path, optimizer=optimizer).fit(grain_data(), steps=STEPS)
    assert listing(tmp_path) == before

    trainer = make_trainer(optimizer=optimizer)
    trainer.checkpoints = Checkpoints(tmp_path, keep=None, reset_optimizer=True)
    state = trainer.fit(grain_data(), steps=STEPS)  # restores step 6, runs nothing
    for field in ("params", "averaged", "frozen"):
        for x, y in zip(
            jax.tree.leaves(getattr(state, field)),
            jax.tree.leaves(getattr(run.final, field)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field)
    for name in ("step", "microstep", "updates"):
        assert int(getattr(state, name)) == int(getattr(run.final, name)) == STEPS
    fresh = optimizer.init(run.final.params)
    for x, y in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the new optimizer state trains on
    state = trainer.fit(grain_data(), steps=STEPS + 1, log_every=0)
    assert int(state.opt_state[1][0].count) == 1


# ----------------------------------------- saves that never finished, damage
@pytest.mark.slow
def test_unfinished_saves_never_count_as_progress(run, capsys):
    """The issue's stuck directory: killed while its first checkpoint was being
    written, restarted (the temporary directory set aside, training from 0),
    killed again at step 2, restarted: every later restart trains from 0 (not
    NoUsableCheckpointError), whichever run set the unfinished saves aside; a
    committed checkpoint beside them is resumed from."""
    directory = run.directory
    run.reset()
    shutil.copytree(run.reference / "6", directory / "5.orbax-checkpoint-tmp")
    os.remove(directory / "5.orbax-checkpoint-tmp" / "commit_success.txt")  # half written
    (directory / "3.unusable").mkdir()  # what earlier versions named an unfinished save
    _, at_2 = load_model(run.reference, step=2, averaged=False)
    for restart in range(3):
        capsys.readouterr()
        state = run.trainer.fit(grain_data(), steps=2, log_every=0)
        out = capsys.readouterr().out
        assert "Training from step 0 to 2" in out, out
        if restart == 0:
            assert (
                f"Skipping checkpoint {directory}/5.orbax-checkpoint-tmp: it is an Orbax "
                f"temporary directory, so its save never finished; kept as "
                f"{directory}/5.unfinished, nothing deleted"
            ) in out
        for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(at_2), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        shutil.rmtree(directory / "2")  # as if killed before the checkpoint of step 2 committed
        if restart == 1:  # and once more while writing it
            shutil.copytree(run.reference / "2", directory / "2.orbax-checkpoint-tmp")
    steps = sorted(n for n in os.listdir(directory) if n != ".lock")  # (fit's run lock)
    assert steps[:3] == ["2.unfinished", "3.unusable", "5.unfinished"]
    # a committed checkpoint among them: resumed from, and the run ends exact
    shutil.copytree(run.reference / "4", directory / "4")
    shutil.copytree(run.reference / "6", directory / "6.orbax-checkpoint-tmp")
    capsys.readouterr()
    state = run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    out = capsys.readouterr().out
    assert f"Resuming from step 4 ({directory}/4)" in out
    assert f"kept as {directory}/6.unfinished, nothing deleted" in out
    assert_same_state(state, run.final)


def largest_data_file(step_dir):
    """The largest file of the OCDBT database the state is read from."""
    return max((step_dir / "state" / "d").iterdir(), key=lambda p: (p.stat().st_size, p.name))


def zero_bytes(step_dir):
    path = largest_data_file(step_dir)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(64))


def flip_bit(path, offset, bit=4):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


CORRUPTION = {
    "64 zeroed bytes": zero_bytes,
    "one flipped bit": lambda step: flip_bit(
        largest_data_file(step), largest_data_file(step).stat().st_size // 2
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", CORRUPTION)
def test_corrupt_newest_checkpoint_falls_back_to_the_one_before(run, kind, capsys):
    directory = run.directory
    run.reset(2, 4)
    CORRUPTION[kind](directory / "4")
    capsys.readouterr()
    state = run.trainer.fit(grain_data(), steps=STEPS, log_every=0)
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("Skipping checkpoint")]
    assert len(skipped) == 1, out
    assert skipped[0].startswith(f"Skipping checkpoint {directory}/4: it cannot be read (")
    assert "array '" in skipped[0] and len(skipped[0]) < 600, skipped[0]  # names the array
    assert skipped[0].endswith(f"kept as {directory}/4.unusable, nothing deleted")
    assert f"Resuming from step 2 ({directory}/2)" in out
    assert_same_state(state, run.final)


def stored_chunk(state_dir, key: bytes) -> bytes:
    """The bytes OCDBT stores for one zarr chunk (``key``), as written."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
    return store.read(key).result().value


def big_state(seed: int) -> TrainState:
    """A state whose one array is large enough (32 KiB) for OCDBT to store it
    outside its checksummed b-tree nodes, as a model's weights are."""
    w = np.random.default_rng(seed).standard_normal(8192).astype(np.float32)
    return TrainState(
        params_by_role={"policy": {"w": jnp.asarray(w)}},
        opt_state=(optax.EmptyState(),),
        key=jax.random.key(seed),
        step=jnp.int32(seed),
        microstep=jnp.int32(seed),
        updates=jnp.int32(seed),
    )


def xxh3_of(array) -> str:
    """xxh3-128-v1 of an array's bytes: xxhash on numpy's C-order copy (what the
    algorithm is; dew.train._integrity cuts the shards and computes it)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(array).tobytes())


def test_a_flipped_bit_the_storage_layer_misses_is_caught_by_the_checksum(tmp_path):
    """One bit flipped in the middle of an array's stored chunk: zstd decodes it
    and OCDBT does not check it, so Orbax restores other numbers without an
    error; the checksum saved with the checkpoint names the array and the
    restore falls back to the checkpoint before, bit for bit."""
    states = {1: big_state(1), 2: big_state(2)}
    session = Checkpoints(tmp_path, use_async=True).open(print_fn=lambda line: None)
    for step, state in states.items():
        session.save(step, state, iter(()), {})
    session.close()
    state_dir = tmp_path / "2" / "state"
    chunk = stored_chunk(state_dir, b"params.policy.w/0")
    files = [p for p in state_dir.rglob("*") if p.is_file() and chunk in p.read_bytes()]
    assert len(chunk) > 1024 and files, "the chunk is stored outside the b-tree nodes"
    for path in files:  # the database, and the per-process copy it was merged from
        flip_bit(path, path.read_bytes().find(chunk) + len(chunk) // 2)
    read = np.asarray(ocp.StandardCheckpointer().restore(state_dir)["params"]["policy"]["w"])
    saved = np.asarray(states[2].params["w"])
    assert (read != saved).sum() == 1  # read back without an error: one number differs

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: states[1])
    shardings = jax.tree.map(lambda _: device, abstract)
    lines = []
    restored = (
        Checkpoints(tmp_path)
        .open(print_fn=lines.append)
        .restore(abstract, shardings, root_key=jax.random.key(0))
    )
    assert lines == [
        f"Skipping checkpoint {tmp_path}/2: it is damaged: array 'params/policy/w' "
        f"(shard [0:8192]) does not match the checksum saved with it "
        f"(xxh3-128-v1 {xxh3_of(saved)} saved, "
        f"{xxh3_of(read)} read back); kept as {tmp_path}/2.unusable, nothing deleted"
    ]
    assert restored.step == 1
    assert_same_state(restored.state, states[1])


def test_a_checkpoint_that_lost_its_checksums_is_set_aside_like_a_damaged_one(tmp_path):
    """One bit flipped in an array and ``checksums/`` deleted: a checkpoint whose
    format records checksums (2) is not restored unverified but set aside with one
    line, and the restore falls back to the checkpoint before, bit for bit."""
    states = {1: big_state(1), 2: big_state(2)}
    session = Checkpoints(tmp_path, use_async=True).open(print_fn=lambda line: None)
    for step, state in states.items():
        session.save(step, state, iter(()), {})
    session.close()
    state_dir = tmp_path / "2" / "state"
    chunk = stored_chunk(state_dir, b"params.policy.w/0")
    for path in [p for p in state_dir.rglob("*") if p.is_file() and chunk in p.read_bytes()]:
        flip_bit(path, path.read_bytes().find(chunk) + len(chunk) // 2)
    shutil.rmtree(tmp_path / "2" / "checksums")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: states[1])
    shardings = jax.tree.map(lambda _: device, abstract)
    lines = []
    restored = (
        Checkpoints(tmp_path)
        .open(print_fn=lines.append)
        .restore(abstract, shardings, root_key=jax.random.key(0))
    )
    assert lines == [
        f"Skipping checkpoint {tmp_path}/2: it is damaged: its checksums/ folder is missing, "
        f"though it was written with checksums of its arrays (checkpoint format 2), so its "
        f"arrays cannot be verified; kept as {tmp_path}/2.unusable, nothing deleted"
    ]
    assert restored.step == 1
    assert_same_state(restored.state, states[1])
    # what load_model reads too: a checkpoint of format 2 without them is refused
    shutil.rmtree(tmp_path / "1" / "checksums")
    with pytest.raises(ChecksumsMissingError, match="checksums/ folder is missing"):
        read_recorded(str(tmp_path / "1"), format=2)
    assert read_recorded(str(tmp_path / "1"), format=1) is None


@pytest.mark.parametrize("use_async", [True, False])
def test_both_save_modes_record_the_checksums_and_a_restore_checks_them(tmp_path, use_async):
    """An asynchronous save sums in the background once ``save`` has returned,
    a synchronous one at once; both record xxh3-128-v1 of the array, and the
    restore verifies it (a changed record sets the checkpoint aside)."""
    state = big_state(3)
    session = Checkpoints(tmp_path, use_async=use_async).open(print_fn=lambda line: None)
    session.save(3, state, iter(()), {})
    session.close()
    path = tmp_path / "3" / "checksums" / "process_0-of-1.json"
    record = json.loads(path.read_text())
    assert record["arrays"]["params/policy/w"] == {"[0:8192]": xxh3_of(state.params["w"])}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: state)
    shardings = jax.tree.map(lambda _: device, abstract)
    restored = (
        Checkpoints(tmp_path)
        .open(print_fn=lambda line: None)
        .restore(abstract, shardings, root_key=jax.random.key(0))
    )
    assert_same_state(restored.state, state)
    record["arrays"]["params/policy/w"]["[0:8192]"] = "0" * 32
    path.write_text(json.dumps(record))
    lines = []
    with pytest.raises(NoUsableCheckpointError):
        Checkpoints(tmp_path).open(print_fn=lines.append).restore(
            abstract, shardings, root_key=jax.random.key(0)
        )
    assert "array 'params/policy/w' (shard [0:8192]) does not match" in lines[0]


def test_checksums_match_an_independent_reference(run, tmp_path):
    """The saved sums are xxh3-128-v1 of each shard's bytes in C order, for
    every array of the state, checked against xxh3_of of the final
    state; a checkpoint written without them restores, with a note."""
    import re

    from dew.train.checkpoints import to_saved

    record = json.load(open(run.reference / "6" / "checksums" / "process_0-of-1.json"))
    assert record["algorithm"] == "xxh3-128-v1"
    flat = {
        "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in p): x
        for p, x in jax.tree_util.tree_flatten_with_path(to_saved(run.final))[0]
    }
    assert sorted(record["arrays"]) == sorted(flat)
    for name, shards in record["arrays"].items():
        whole = np.asarray(flat[name])
        for index, saved in shards.items():
            cut = tuple(slice(int(a), int(b)) for a, b in re.findall(r"(\d+):(\d+)", index))
            assert saved == xxh3_of(whole[cut]), name
    # written without checksums (an earlier version of Dew, checkpoint format 1):
    # restored, unverified, said so
    shutil.copytree(run.reference / "6", tmp_path / "6")
    shutil.rmtree(tmp_path / "6" / "checksums")
    meta_file = tmp_path / "6" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["format"] == 2
    meta_file.write_text(json.dumps({**meta, "format": 1}))
    lines = []
    abstract, shardings = run.trainer.state_shardings()
    restored = (
        Checkpoints(tmp_path)
        .open(print_fn=lines.append)
        .restore(abstract, shardings, root_key=run.trainer.key)
    )
    assert_same_state(restored.state, run.final)
    assert lines == [
        f"Note: checkpoint {tmp_path}/6 has no checksums of its arrays (written by an earlier "
        f"version of Dew); its arrays are restored unverified"
    ]


HOLD = (
    "import sys, time; from dew.train.run_lock import lock_run; "
    "lock_run(sys.argv[1]); print('held', flush=True); time.sleep(120)"
)


def test_fit_on_a_directory_another_process_writes_is_refused(tmp_path):
    """One process writes a checkpoint directory (dew.train.run_lock): fit refuses
    before it writes anything, naming the holder."""
    from dew.train.run_lock import RunInUseError

    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    try:
        with pytest.raises(RunInUseError, match=f"pid {process.pid} on host"):
            make_trainer(tmp_path).fit(grain_data(), steps=2, log_every=0)
        assert os.listdir(tmp_path) == [".lock"]  # nothing written
    finally:
        process.kill()
        process.wait()

"""Where metrics go: stdout, metrics.jsonl, TensorBoard events, the progress
bar; and the goodput record, whose parts add up to the wall time."""

from __future__ import annotations

import itertools
import json
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.objectives import Objective
from dew.train import Checkpoints, Goodput, Trainer
from dew.train import goodput as goodput_module
from dew.train.goodput import PARTS
from dew.train.logs import MetricsLog


class Quadratic(Objective):
    """``loss = mean (x - w)^2`` over a batch of rows: a tiny, fast step."""

    model = None

    def init(self, key):
        return {"params": {"policy": {"w": jnp.zeros(4)}}}

    def loss(self, variables, batch, step):
        err = batch["x"] - variables["params"]["policy"]["w"]
        return jnp.mean(err**2), {"se_sum": jnp.sum(err**2)}


def read_events(path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of every scalar in a TensorBoard event file
    (TFRecord framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    out = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            event = event_pb2.Event.FromString(f.read(length))
            f.read(4)
            for value in event.summary.value:
                out.append((value.tag, event.step, value.simple_value))
    return out


def test_metrics_go_to_jsonl_tensorboard_and_stdout(tmp_path, capsys):
    rows = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    data = Dataset(train=lambda p: itertools.repeat({"x": rows}), val=None, records=8, batch=8)
    # checkpoints given and no run_dir: the metrics go to the checkpoint directory
    trainer = Trainer(
        Quadratic(),
        optax.sgd(0.1),
        key=jax.random.key(0),
        checkpoints=Checkpoints(tmp_path),
        progress=False,
    )
    trainer.fit(data, steps=4, log_every=2, checkpoint_every=2)
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]

    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    # numpy: SGD on the mean over 8 x 4 squared errors, grad = 2 / 4 (w - mean_rows x);
    # a log line holds the mean over the steps since the last one
    w, losses = np.zeros(4), []
    for _ in range(4):
        losses.append(float(np.mean((rows - w) ** 2)))
        w = w - 0.1 * 2 / 4 * (w - rows.mean(0))
    want = [None, np.mean(losses[:2]), None, np.mean(losses[2:])]
    np.testing.assert_allclose([r["loss"] for r in train], [want[1], want[3]], rtol=1e-6)
    step_lines = [line for line in out if line.startswith("step ")]
    assert [line.split(",")[0] for line in step_lines] == [
        f"step 2: loss {want[1]:.4f}",
        f"step 4: loss {want[3]:.4f}",
    ]
    # then the rates: examples/s (Quadratic counts no tokens) and MFU
    assert all(re.search(r", [\d,.]+ examples/s, MFU [\d.]+%$", line) for line in step_lines)
    assert [r["se_sum"] for r in train] == pytest.approx([32 * want[1], 32 * want[3]], rel=1e-6)

    (good,) = [r for r in records if r["kind"] == "goodput"]
    assert sum(good[name] for name in PARTS) == pytest.approx(good["wall"], rel=1e-12)
    assert good["checkpoint"] > 0 and good["compile"] > 0 and good["steps"] > 0
    assert 0 < good["first_step"] <= good["wall"]
    (line,) = [line for line in out if line.startswith("Goodput: ")]
    assert line.startswith("Goodput: first step after ")
    for name in ("compile", "data", "eval", "checkpoint", "other"):
        assert f" {name} " in line

    (events,) = (tmp_path / "tensorboard").iterdir()
    scalars = read_events(events)
    losses = [(step, value) for tag, step, value in scalars if tag == "train/loss"]
    assert [s for s, _ in losses] == [2, 4]
    np.testing.assert_allclose([v for _, v in losses], [want[1], want[3]], rtol=1e-6)
    assert any(tag == "goodput/wall" for tag, _, _ in scalars)


def test_goodput_line_with_a_fake_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(goodput_module.time, "perf_counter", lambda: now[0])
    goodput = Goodput()
    for bucket, seconds in (
        ("init", 1.0),
        ("compile", 2.0),
        ("steps", 4.0),
        ("data", 0.5),
        ("checkpoint", 1.5),
    ):
        with goodput.measure(bucket):
            now[0] += seconds
        if bucket == "steps":
            goodput.first_step_done()
    now[0] += 1.0  # unmeasured
    report = goodput.report()
    assert report == {
        "wall": 10.0,
        "first_step": 7.0,
        "init": 1.0,
        "compile": 2.0,
        "steps": 4.0,
        "data": 0.5,
        "prepare": 0.0,
        "eval": 0.0,
        "checkpoint": 1.5,
        "logging": 0.0,
        "other": 1.0,
    }
    assert goodput.line(report) == (
        "Goodput: first step after 7.00 s, 40.0% of the wall time in steps (4.00 of 10.00 s; "
        "init 1.00 s, compile 2.00 s, prepare 0.00 s, data 0.50 s, eval 0.00 s, checkpoint 1.50 s, "
        "logging 0.00 s, other 1.00 s)"
    )


def test_progress_bar_shows_step_loss_throughput_and_eta(capsys):
    log = MetricsLog(None, progress=True, total_steps=10, examples_per_step=8)
    for step in range(1, 6):
        log.advance(step)
    log.log(5, {"loss": 1.5}, line="step 5: loss 1.5000")
    log.close()
    captured = capsys.readouterr()
    bar = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert " 5/10 " in bar and "loss=1.5000" in bar and "examples_per_s=" in bar
    assert "<" in bar and "step/s" in bar  # elapsed<remaining (the ETA), rate
    assert "step 5: loss 1.5000" in captured.out


def test_plain_lines_off_a_tty(capsys):
    log = MetricsLog(None, progress=None, total_steps=10)  # pytest's stdout is no TTY
    log.advance(5)
    log.log(5, {"loss": 1.5}, line="step 5: loss 1.5000")
    log.close()
    captured = capsys.readouterr()
    assert captured.out == "step 5: loss 1.5000\n"
    assert captured.err == ""


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_resume_moves_rows_after_the_checkpoint_to_superseded(tmp_path, capsys):
    # a first run logs steps 2, 4, 6 (+ eval at 4), is killed after 6 with its
    # newest checkpoint at step 4, and the line it was writing is torn
    first = MetricsLog(str(tmp_path), progress=False)
    first.start(0)
    for step, loss in ((2, 3.0), (4, 2.0), (6, 1.5)):
        first.log(step, {"loss": loss})
    first.log(4, {"loss": 2.25}, kind="eval")
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "kind": "tra')  # SIGKILL mid-write

    resumed = MetricsLog(str(tmp_path), progress=False)
    resumed.start(4)  # restored from the checkpoint at step 4
    for step, loss in ((6, 1.25), (8, 1.0)):
        resumed.log(step, {"loss": loss})
    resumed.close()

    rows = rows_of(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["kind"], r["loss"]) for r in rows] == [
        (2, "train", 3.0),
        (4, "train", 2.0),
        (4, "eval", 2.25),
        (6, "train", 1.25),
        (8, "train", 1.0),
    ]
    steps = [(r["step"], r["kind"]) for r in rows]
    assert len(steps) == len(set(steps))  # each (step, kind) once
    superseded = rows_of(tmp_path / "metrics.superseded.jsonl")
    assert superseded[0] == {**superseded[0], "step": 6, "kind": "train", "loss": 1.5}
    assert superseded[1] == {"unreadable": '{"step": 8, "kind": "tra'} | {
        "superseded": True,
        "resumed_from": 4,
    }
    assert all(r["superseded"] is True and r["resumed_from"] == 4 for r in superseded)
    assert len(superseded) == 2
    out = capsys.readouterr().out
    assert "Training from step 4: 2 row(s) of " in out and "metrics.superseded.jsonl" in out

    # TensorBoard: the resumed run's event file starts with a purge marker at step 5
    # (a SessionLog START: TensorBoard hides earlier events at steps >= 5)
    from tensorboardX.proto import event_pb2

    first_file, second_file = sorted((tmp_path / "tensorboard").iterdir())
    assert [(s, v) for t, s, v in read_events(first_file) if t == "train/loss"] == [
        (2, 3.0),
        (4, 2.0),
        (6, 1.5),
    ]
    assert [(s, v) for t, s, v in read_events(second_file) if t == "train/loss"] == [
        (6, 1.25),
        (8, 1.0),
    ]
    starts = []
    with open(second_file, "rb") as f:
        while header := f.read(12):
            event = event_pb2.Event.FromString(f.read(struct.unpack("<Q", header[:8])[0]))
            f.read(4)
            if event.session_log.status == event_pb2.SessionLog.START:
                starts.append(event.step)
    assert starts == [5]


def test_start_without_later_rows_leaves_the_file_alone(tmp_path, capsys):
    log = MetricsLog(str(tmp_path), progress=False)
    log.log(2, {"loss": 1.0})
    log.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    log = MetricsLog(str(tmp_path), progress=False, start_step=2)  # known at construction
    log.log(4, {"loss": 0.5})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().startswith(before)
    assert [r["loss"] for r in rows_of(tmp_path / "metrics.jsonl")] == [1.0, 0.5]
    assert not (tmp_path / "metrics.superseded.jsonl").exists()
    assert capsys.readouterr().out == ""


def test_a_fresh_run_in_an_old_run_dir_supersedes_every_row(tmp_path):
    old = MetricsLog(str(tmp_path), progress=False)
    old.log(2, {"loss": 1.0})
    old.log(4, {"loss": 0.5})
    old.close()
    new = MetricsLog(str(tmp_path), progress=False)
    new.start(0)  # no checkpoint: training starts over
    new.log(2, {"loss": 0.75})
    new.close()
    assert [(r["step"], r["loss"]) for r in rows_of(tmp_path / "metrics.jsonl")] == [(2, 0.75)]
    superseded = rows_of(tmp_path / "metrics.superseded.jsonl")
    assert [(r["step"], r["loss"], r["resumed_from"]) for r in superseded] == [
        (2, 1.0, 0),
        (4, 0.5, 0),
    ]


class Recorder:
    """A tracker that keeps what it is given."""

    def __init__(self):
        self.calls, self.closed = [], 0

    def log(self, step, values, kind):
        self.calls.append((step, kind, dict(values)))

    def close(self):
        self.closed += 1


def test_trainer_resume_keeps_each_step_once_and_feeds_trackers(tmp_path):
    import shutil

    rows = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    data = Dataset(train=lambda p: itertools.repeat({"x": rows}), val=None, records=8, batch=8)

    def trainer(tracker):
        return Trainer(
            Quadratic(),
            optax.sgd(0.1),
            key=jax.random.key(0),
            checkpoints=Checkpoints(tmp_path, keep=5),
            progress=False,
            trackers=[tracker],
        )

    first = Recorder()
    trainer(first).fit(data, steps=4, log_every=2, checkpoint_every=2)
    # a kill after step 4 was logged but before its checkpoint was written
    shutil.rmtree(tmp_path / "4")
    before = rows_of(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in before] == [(2, "train"), (4, "train"), (4, "goodput")]

    second = Recorder()
    trainer(second).fit(data, steps=6, log_every=2, checkpoint_every=2)
    after = rows_of(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in after] == [
        (2, "train"),
        (4, "train"),
        (6, "train"),
        (6, "goodput"),
    ]
    # the resumed run repeats steps 3-4 exactly: its step-4 row equals the superseded one
    superseded = rows_of(tmp_path / "metrics.superseded.jsonl")
    assert [(r["step"], r["kind"], r["resumed_from"]) for r in superseded] == [
        (4, "train", 2),
        (4, "goodput", 2),
    ]
    assert after[1]["loss"] == superseded[0]["loss"]

    # trackers got what metrics.jsonl got, record for record
    for tracker, written in ((first, before), (second, after[1:])):
        assert tracker.closed == 1
        assert [(s, k) for s, k, _ in tracker.calls] == [(r["step"], r["kind"]) for r in written]
        for (_, _, values), row in zip(tracker.calls, written):
            assert {k: row[k] for k in values} == pytest.approx(values, rel=1e-12)

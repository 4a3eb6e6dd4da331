"""Experiment trackers, in their offline/local modes: what MetricsLog writes to
metrics.jsonl reaches Weights & Biases (offline run files) and MLflow (a
``file:`` store), read back and compared value by value."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from dew.train.logs import MetricsLog
from dew.train.trackers import MLflowTracker, Tracker, WandbTracker, scalars

# (step, kind, metrics): what a short run logs; numpy scalars as the trainer has them
RECORDS = [
    (2, "train", {"loss": np.float32(2.5), "tokens": 64, "note": "warmup"}),
    (4, "train", {"loss": 1.75, "tokens": 64}),
    (4, "eval", {"loss": np.float64(2.125)}),
    (4, "goodput", {"wall": 3.5, "steps": 1.25}),
]


def logged(tmp_path, trackers):
    log = MetricsLog(str(tmp_path / "run"), progress=False, trackers=trackers)
    for step, kind, metrics in RECORDS:
        log.log(step, metrics, kind=kind)
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # {(step, "kind/name"): value} of every number metrics.jsonl holds
    want = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("step", "kind", "time") and not isinstance(value, str):
                want[(row["step"], f"{row['kind']}/{name}")] = value
    return want


def test_scalars_keeps_numbers_under_kind_prefix():
    values = {"loss": np.float32(0.5), "n": 3, "rate": np.array(2.0), "tag": "x", "bad": None}
    assert scalars(values, "eval") == {"eval/loss": 0.5, "eval/n": 3.0, "eval/rate": 2.0}


class Recorder:
    def __init__(self):
        self.calls, self.closed = [], 0

    def log(self, step, values, kind):
        self.calls.append((step, kind, dict(values)))

    def close(self):
        self.closed += 1


def test_metrics_log_sends_every_record_to_each_tracker(tmp_path):
    first, second = Recorder(), Recorder()
    assert isinstance(first, Tracker)
    logged(tmp_path, [first, second])
    assert first.calls == second.calls == [(s, k, m) for s, k, m in RECORDS]
    assert first.closed == second.closed == 1


def test_trackers_without_a_run_dir_and_only_on_the_main_process(tmp_path):
    main, other = Recorder(), Recorder()
    log = MetricsLog(None, progress=False, trackers=[main])
    log.log(3, {"loss": 1.0})
    log.close()
    assert main.calls == [(3, "train", {"loss": 1.0})] and main.closed == 1
    log = MetricsLog(None, is_main=False, progress=False, trackers=[other])
    log.log(3, {"loss": 1.0})
    log.close()
    assert other.calls == [] and other.closed == 0


def test_a_tracker_without_log_and_close_is_refused():
    with pytest.raises(TypeError, match="log\\(step, values, kind\\) and close\\(\\).*dict"):
        MetricsLog(None, trackers=[{}])


def read_wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file (``run-<id>.wandb``): a
    LevelDB-style log of 32 KiB blocks (a 7-byte file header ``:W&B``, then
    records of crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle,
    4 last) whose payloads are ``wandb_internal_pb2.Record`` protos."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    rows, position, pending = [], 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                # an item names itself by `key` or by `nested_key` parts (wandb >= 0.2x)
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_wandb_offline_run_holds_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(project="dew-test", name="tiny", mode="offline", config={"lr": 0.1})
    want = logged(tmp_path, [tracker])
    assert tracker.run is None  # finished by MetricsLog.close

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    got = {}
    for row in read_wandb_history(run_file):
        for name, value in row.items():
            if not name.startswith("_"):
                got[(row["_step"], name)] = value
    assert got == pytest.approx(want, rel=0, abs=0)
    assert want[(4, "eval/loss")] == 2.125 and want[(2, "train/loss")] == 2.5
    assert (2, "train/note") not in got  # strings stay in metrics.jsonl


def test_wandb_tracker_rejects_an_unknown_mode():
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match="mode='ofline'.*'offline'"):
        WandbTracker(project="p", mode="ofline")


def test_mlflow_file_store_holds_what_metrics_jsonl_holds(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()  # file:///...
    tracker = MLflowTracker(experiment="dew-test", tracking_uri=uri, run_name="tiny")
    want = logged(tmp_path, [tracker])
    assert tracker.run_id is None  # ended by MetricsLog.close

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("dew-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    got = {}
    for name in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, name):
            got[(metric.step, name)] = metric.value
    assert got == pytest.approx(want, rel=0, abs=0)


def test_mlflow_second_fit_is_a_second_run_in_the_same_experiment(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    tracker = MLflowTracker(experiment="dew-test", tracking_uri=uri)
    for loss in (1.5, 0.5):
        log = MetricsLog(None, progress=False, trackers=[tracker])
        log.log(1, {"loss": loss})
        log.close()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("dew-test").experiment_id])
    assert sorted(run.data.metrics["train/loss"] for run in runs) == [0.5, 1.5]


def test_mlflow_without_a_store_it_can_use_says_which_to_give(monkeypatch):
    pytest.importorskip("mlflow")
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow is installed: its default sqlite store works")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="mlflow-skinny; give tracking_uri='http://host:5000'"):
        MLflowTracker(experiment="dew-test")


def test_missing_package_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    uv = r"; with uv: uv add 'dew-train\[wandb\]' in your project, or uv sync --all-packages"
    with pytest.raises(ImportError, match=r"pip install 'dew-train\[wandb\]'" + uv):
        WandbTracker(project="p")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r"pip install 'dew-train\[mlflow\]'"):
        MLflowTracker(experiment="e", tracking_uri="file:/tmp/never")

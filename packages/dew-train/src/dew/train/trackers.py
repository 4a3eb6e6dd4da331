"""Experiment trackers: the records `MetricsLog` writes to ``metrics.jsonl``,
also sent to Weights & Biases or MLflow.

Both are optional extras, off unless a tracker is passed
(``MetricsLog(..., trackers=[...])``, ``Trainer(..., trackers=[...])``)::

    pip install "dew-train[wandb]"    # WandbTracker
    pip install "dew-train[mlflow]"   # MLflowTracker (mlflow-skinny: the client, no server)

A tracker sees every record of the main process: ``log(step, values, kind)``
with ``kind`` one of ``train``, ``eval``, ``goodput``. Names reach the tracker
as ``"{kind}/{name}"``, as in TensorBoard (``train/loss``, ``eval/loss``).
Only numbers are sent; a string in a record stays in ``metrics.jsonl``.

A tracker starts its run at its first record and ends it at ``close()``; a
later ``fit`` with the same tracker starts a new run (for Weights & Biases,
pass ``id=..., resume="allow"`` to continue one). Rows that ``metrics.jsonl``
marks superseded after a resume were already sent: trackers keep them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """Receives the records of a run, one call per log step."""

    def log(self, step: int, values: Mapping[str, Any], kind: str) -> None:
        """Record ``values`` (name -> number) of ``kind`` at ``step``."""

    def close(self) -> None:
        """End the run: flush, and mark it finished."""


def scalars(values: Mapping[str, Any], kind: str) -> dict[str, float]:
    """``{"{kind}/{name}": float}`` for every value that is a number (Python,
    numpy or a 0-d array); strings and other objects are left out."""
    out = {}
    for name, value in values.items():
        if isinstance(value, str | bytes):
            continue
        try:
            out[f"{kind}/{name}"] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def _require(module: str, tracker: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{tracker} needs the {module!r} package, which is not installed "
            f"({error}); install it with: pip install 'dew-train[{extra}]'; with uv: uv add "
            f"'dew-train[{extra}]' in your project, or uv sync --all-packages --extra {extra} "
            f"in a Dew checkout"
        ) from error


class WandbTracker:
    """Weights & Biases: one ``wandb`` run, ``run.log(values, step=step)``.

    project: the W&B project (None = W&B's default, ``WANDB_PROJECT``).
    name: the run's display name (None = W&B picks one).
    mode: ``"online"``, ``"offline"`` (files under ``WANDB_DIR``/``dir``, to
      upload later with ``wandb sync``) or ``"disabled"``; None = W&B's default
      (``WANDB_MODE``).
    init_kwargs: anything else ``wandb.init`` takes (``config``, ``dir``,
      ``tags``, ``id``, ``resume``, ``entity``, ...).
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        mode: str | None = None,
        **init_kwargs: Any,
    ):
        modes = ("online", "offline", "disabled", "shared")
        if mode is not None and mode not in modes:
            raise ValueError(f"WandbTracker mode={mode!r}; use one of {modes} or None")
        self._wandb = _require("wandb", "WandbTracker", "wandb")
        self.project, self.name, self.mode = project, name, mode
        self.init_kwargs = init_kwargs
        self.run = None

    def _start(self):
        kwargs = {"project": self.project, "name": self.name, "mode": self.mode}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        # a run of its own, not wandb's global one: several trackers can coexist
        return self._wandb.init(**kwargs, **self.init_kwargs, reinit="create_new")

    def log(self, step: int, values: Mapping[str, Any], kind: str) -> None:
        numbers = scalars(values, kind)
        if not numbers:
            return
        if self.run is None:
            self.run = self._start()
        self.run.log(numbers, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MLflowTracker:
    """MLflow: one run in ``experiment``, metrics through ``MlflowClient.log_batch``.

    experiment: the experiment's name; created when it does not exist.
    tracking_uri: where runs go: ``http://host:5000`` (a tracking server),
      ``databricks``, ``file:/path/mlruns`` (local files), ...; None =
      ``MLFLOW_TRACKING_URI``, else MLflow's ``sqlite:///mlflow.db``, which
      needs the full ``mlflow`` package (the extra installs mlflow-skinny).
      For a ``file:`` URI this sets ``MLFLOW_ALLOW_FILE_STORE=true`` unless it
      is already set: MLflow 3 keeps its file store in maintenance mode and
      refuses it otherwise.
    run_name: the run's name (None = MLflow picks one).
    tags: tags set on the run.
    """

    def __init__(
        self,
        experiment: str = "dew",
        *,
        tracking_uri: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        self._tracking = _require("mlflow.tracking", "MLflowTracker", "mlflow")
        self._entities = _require("mlflow.entities", "MLflowTracker", "mlflow")
        if tracking_uri is not None and tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        no_database = importlib.util.find_spec("sqlalchemy") is None
        if tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI") and no_database:
            raise ValueError(
                "MLflowTracker(tracking_uri=None) with MLFLOW_TRACKING_URI unset: MLflow's "
                "default store is sqlite:///mlflow.db, which needs the full `mlflow` package "
                "(sqlalchemy), and dew-train[mlflow] installs mlflow-skinny; give "
                "tracking_uri='http://host:5000' (a tracking server) or 'file:./mlruns' "
                "(local files), set MLFLOW_TRACKING_URI, or install the full package (pip install "
                "mlflow; with uv: uv add mlflow)"
            )
        self.experiment, self.tracking_uri = experiment, tracking_uri
        self.run_name, self.tags = run_name, dict(tags or {})
        self.client = None
        self.run_id: str | None = None

    def _start(self) -> None:
        self.client = self._tracking.MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id if found else self.client.create_experiment(self.experiment)
        )
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id

    def log(self, step: int, values: Mapping[str, Any], kind: str) -> None:
        numbers = scalars(values, kind)
        if not numbers:
            return
        if self.run_id is None:
            self._start()
        now = int(time.time() * 1000)  # MLflow timestamps are milliseconds
        metrics = [
            self._entities.Metric(name, value, now, int(step)) for name, value in numbers.items()
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None

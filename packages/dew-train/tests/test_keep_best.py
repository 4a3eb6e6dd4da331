"""Checkpoints(keep_best=...): the best checkpoints by an evaluation metric kept
beside the newest, ranked again by a later run; its argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from dew.train import Checkpoints
from dew.train.state import TrainState


def tiny_state(value: float) -> TrainState:
    return TrainState(
        params_by_role={"policy": {"w": jnp.full((2,), value)}},
        opt_state=(optax.EmptyState(), {"mu": jnp.zeros(2)}),
        key=jax.random.key(0),
        step=jnp.int32(0),
        microstep=jnp.int32(0),
        updates=jnp.int32(0),
    )


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_keeps_the_best_beside_the_newest(tmp_path, mode):
    spec = Checkpoints(
        tmp_path, keep=2, keep_best=2, best_metric="loss", best_mode=mode, use_async=False
    )
    losses = {1: None, 2: 1.0, 3: 4.0, 4: 0.5, 5: 3.0, 6: float("nan"), 7: 6.0, 8: 7.0}
    session = spec.open(print_fn=lambda line: None)
    for step, loss in losses.items():
        metrics = None if loss is None else {"loss": loss, "accuracy": 0.5}
        session.save(step, tiny_state(step), iter(()), {}, metrics=metrics)
    session.close()
    ranked = sorted(
        (s for s, v in losses.items() if v is not None and v == v),
        key=lambda s: losses[s],
        reverse=mode == "max",
    )
    newest = {7, 8}
    assert spec.steps() == sorted(newest | set(ranked[:2]))
    assert spec.steps() == ([2, 4, 7, 8] if mode == "min" else [7, 8])
    # a later run reads the metrics back: its own saves rank against them
    session = spec.open(print_fn=lambda line: None)
    session.save(9, tiny_state(9), iter(()), {}, metrics={"loss": 0.1 if mode == "min" else 9.0})
    session.save(10, tiny_state(10), iter(()), {}, metrics=None)
    session.close()
    assert spec.steps() == ([4, 9, 10] if mode == "min" else [8, 9, 10])
    params = ocp.StandardCheckpointer().restore(tmp_path / "9" / "state")["params"]
    np.testing.assert_array_equal(params["policy"]["w"], [9.0, 9.0])


def test_best_metric_must_be_one_evaluation_produces(tmp_path):
    session = Checkpoints(tmp_path, keep_best=1, best_metric="loss").open()
    session.check_best_metric({"loss", "accuracy"})
    with pytest.raises(
        ValueError,
        match=r"best_metric='loss'\) is not among the metrics evaluation produces "
        r"\(\['accuracy', 'perplexity'\]\)",
    ):
        session.check_best_metric({"accuracy", "perplexity"})
    with pytest.raises(ValueError, match=r"metrics evaluation produces \(none: no evaluation runs"):
        session.check_best_metric(set())
    with pytest.raises(ValueError, match=r"have no 'loss' .*only \['accuracy'\]"):
        session.save(1, tiny_state(1), iter(()), {}, metrics={"accuracy": 1.0})
    Checkpoints(tmp_path).open().check_best_metric(set())  # no keep_best: nothing to check
    with pytest.raises(ValueError, match=r"keep_best=2\) needs best_metric="):
        Checkpoints(tmp_path, keep_best=2)
    with pytest.raises(ValueError, match="best_mode must be 'min' .*got 'lowest'"):
        Checkpoints(tmp_path, keep_best=1, best_metric="loss", best_mode="lowest")

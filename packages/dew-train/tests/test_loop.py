"""``training_steps``, the public loop, driven by hand: the same final state as
``fit`` on the same data, and both the numpy SGD of the same least squares."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Dataset, Partition
from dew.objectives import Objective
from dew.train import MeshSpec, Trainer, training_steps
from dew.train.goodput import Goodput

ROWS, IN, STEPS, LR = 8, 3, 5, 0.05
ONE = MeshSpec(data=1, devices=jax.devices()[:1])
W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


class LeastSquares(Objective):
    model = None

    def init(self, key):
        return {"params": {"policy": {"w": jax.random.normal(key, (IN,))}}}

    def loss(self, variables, batch, step):
        err = batch["x"] @ variables["params"]["policy"]["w"] - batch["y"]
        return jnp.mean(err**2), {}


def rows(i):
    x = np.random.default_rng(i).normal(size=(ROWS, IN)).astype(np.float32)
    return {"x": x, "y": x @ W_TRUE}


def batches(partition):
    return (rows(i) for i in itertools.count())


def trainer() -> Trainer:
    return Trainer(LeastSquares(), optax.sgd(LR), key=jax.random.key(0), mesh=ONE, progress=False)


def test_training_steps_by_hand_equals_fit_and_numpy_sgd(capsys):
    fitted = trainer().fit(Dataset(batches, None, records=0, batch=ROWS), steps=STEPS, log_every=0)
    capsys.readouterr()

    t = trainer()
    programs = t.programs
    partition = Partition(0, 1)
    seen, losses = [], []
    with programs.context():
        _, shardings = programs.state_shardings(None, key=t.key)
        state = programs.init_state(t.key)
        w0 = np.asarray(state.params["w"], np.float64)
        records = training_steps(
            programs,
            state,
            shardings,
            batches(partition),
            partition=partition,
            global_rows=ROWS,
            steps=STEPS,
            log_every=1,
            goodput=Goodput(),
            check_batch=lambda batch, first: seen.append(first),
        )
        for record in records:  # an earlier record's state is donated to the next step
            state = record.state
            metrics = record.compiled.packing.unpack(jax.device_get(record.metrics))
            losses.append(float(metrics["loss"]))  # the step's mean over its 8 rows
            assert float(metrics["loss_weight"]) == ROWS
            assert record.at_boundary and record.is_first == (record.step == 1)
    assert seen == [True] + [False] * (STEPS - 1)
    assert int(state.step) == int(state.updates) == int(state.microstep) == STEPS

    # the generator's final state is fit's, bit for bit (the same compiled step)
    for name in ("params", "opt_state"):
        for a, b in zip(
            jax.tree.leaves(getattr(state, name)),
            jax.tree.leaves(getattr(fitted, name)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(fitted.key))

    # and the numpy SGD of the same batches: w <- w - lr 2/N X^T (X w - y)
    w, want_losses = w0, []
    for i in range(STEPS):
        x, y = (rows(i)[k].astype(np.float64) for k in ("x", "y"))
        err = x @ w - y
        want_losses.append(float(np.mean(err**2)))
        w = w - LR * 2 / ROWS * x.T @ err
    # float32 step against float64 numpy, 5 steps
    np.testing.assert_allclose(np.asarray(state.params["w"]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)

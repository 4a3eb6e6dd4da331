"""ClassifierDistillationObjective (Hinton soft targets, any logits model): the loss
against numpy float64 at several beta, T and alpha with padded rows, the gradient
against its closed form ``(1 - alpha) T (p_S - p_T) + alpha (softmax(z_S) - y)``,
and a small MLP student that learns a bigger teacher's soft targets."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dew.data import Field
from dew.objectives import Step
from dew.objectives.language.classifier_distillation import ClassifierDistillationObjective

CLASSES, FEATURES, ROWS = 10, 12, 16
STEP = Step(index=np.int32(0), key=jax.random.key(0))


class MLP(nn.Module):
    width: int
    depth: int = 1

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth - 1):
            x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(CLASSES)(x)  # [rows, classes] logits


STUDENT, TEACHER = MLP(width=CLASSES), MLP(width=64, depth=3)
SPEC = {"image": Field((FEATURES,), np.float32), "label": Field((), np.int32)}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, FEATURES)).astype(np.float32)
TEACHER_PARAMS = jax.tree.map(
    lambda p: 2.0 * p, TEACHER.init(jax.random.key(1), X[:1])["params"]
)  # sharper than its init
LABELS = np.asarray(jax.jit(TEACHER.apply)({"params": TEACHER_PARAMS}, X).argmax(-1), np.int32)
MASK = np.arange(ROWS) < 13  # three padded rows
BATCH = {"image": X, "label": LABELS, "example_mask": MASK}


def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def make(**kw):
    return ClassifierDistillationObjective(
        student=STUDENT, teacher=TEACHER, teacher_params=TEACHER_PARAMS, **kw
    )


@pytest.mark.parametrize(
    "beta,temperature,alpha", [(0.0, 2.0, 0.5), (0.5, 1.0, 0.0), (1.0, 4.0, 0.2)]
)
def test_loss_and_gradient_match_numpy(beta, temperature, alpha):
    objective = make(beta=beta, temperature=temperature, alpha=alpha)
    variables = objective.init(jax.random.key(2), SPEC)

    def value(params):
        loss, metrics = objective.loss({**variables, "params": params}, BATCH, STEP)
        return loss.value, (loss, metrics)

    grads, (loss, metrics) = jax.jit(jax.grad(value, has_aux=True))(variables["params"])
    zs = np.asarray(STUDENT.apply({"params": variables["params"]["policy"]}, X), np.float64)
    zt = np.asarray(TEACHER.apply({"params": TEACHER_PARAMS}, X), np.float64)
    s, t = log_softmax(zs / temperature), log_softmax(zt / temperature)
    ps, pt = np.exp(s), np.exp(t)
    if beta == 0:
        d = (pt * (t - s)).sum(-1)
    elif beta == 1:
        d = (ps * (s - t)).sum(-1)
    else:
        m = np.log(beta * pt + (1 - beta) * ps)
        d = (beta * (pt * (t - m)).sum(-1) + (1 - beta) * (ps * (s - m)).sum(-1)) / (
            beta * (1 - beta)
        )
    nll = -np.take_along_axis(log_softmax(zs), LABELS[:, None], -1)[:, 0]
    w = MASK.astype(np.float64)
    want = (((1 - alpha) * temperature**2 * d + alpha * nll) * w).sum() / w.sum()
    assert float(loss.weight) == 13
    np.testing.assert_allclose(loss.value, want, rtol=1e-5)
    np.testing.assert_allclose(metrics["divergence"].value, (d * w).sum() / w.sum(), rtol=1e-5)
    agree = (zs.argmax(-1) == zt.argmax(-1)) * w
    np.testing.assert_allclose(metrics["agreement"].value, agree.sum() / w.sum())
    if beta == 0:  # Hinton's gradient in the logits, through the student's Dense layer
        onehot = np.eye(CLASSES)[LABELS]
        dz = (1 - alpha) * temperature * (ps - pt) + alpha * (np.exp(log_softmax(zs)) - onehot)
        dz = dz * w[:, None] / w.sum()
        dense = grads["policy"]["Dense_0"]
        np.testing.assert_allclose(dense["kernel"], X.T.astype(np.float64) @ dz, atol=1e-6)
        np.testing.assert_allclose(dense["bias"], dz.sum(0), atol=1e-6)


def test_a_small_student_learns_the_teachers_soft_targets():
    objective = make(beta=0.0, temperature=2.0, alpha=0.5)
    variables = objective.init(jax.random.key(3), SPEC)
    optimizer = optax.adam(3e-2)
    data = {"image": X, "label": LABELS}

    def step(carry, _):
        params, state = carry

        def value(p):
            return objective.loss({**variables, "params": p}, data, STEP)[0].value

        updates, state = optimizer.update(jax.grad(value)(params), state, params)
        return (optax.apply_updates(params, updates), state), None

    @jax.jit
    def metrics(params):
        return objective.evaluate({**variables, "params": params}, data, STEP)

    params = variables["params"]
    before = metrics(params)
    (params, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, length=150))(
        (params, optimizer.init(params))
    )
    after = metrics(params)
    assert float(after["divergence"].value) <= float(before["divergence"].value) / 5
    assert float(after["agreement"].value) >= 0.9 > float(before["agreement"].value)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="label_key=None"):
        make(label_key=None)
    with pytest.raises(ValueError, match=r"temperature=0 must be a finite number > 0"):
        make(temperature=0)
    with pytest.raises(ValueError, match=r"beta=2 must be a finite number in \[0, 1\]"):
        make(beta=2)
    with pytest.raises(ValueError, match="needs the data's spec with 'image'"):
        make().init(jax.random.key(0))
    with pytest.raises(KeyError, match=r"reads batch\['label'\] \[rows\] integer"):
        make().check_batch({"image": X})


def test_alpha_one_without_a_teacher_is_the_hard_label_cross_entropy():
    """No teacher weights at ``alpha=1``: one trained role, the loss is numpy's
    cross-entropy over the unpadded rows (how a teacher of one's own is trained);
    below 1 the weights are required."""
    objective = ClassifierDistillationObjective(student=STUDENT, alpha=1.0)
    assert [r.name for r in objective.roles()] == ["policy"]
    variables = objective.init(jax.random.key(4), SPEC)
    assert set(variables) == {"params"}
    loss, metrics = jax.jit(lambda v: objective.loss(v, BATCH, STEP))(variables)
    zs = np.asarray(STUDENT.apply({"params": variables["params"]["policy"]}, X), np.float64)
    nll = -np.take_along_axis(log_softmax(zs), LABELS[:, None], -1)[:, 0]
    np.testing.assert_allclose(loss.value, nll[MASK].mean(), rtol=1e-5)
    assert float(metrics["divergence"].value) == 0 and float(metrics["agreement"].value) == 1
    with pytest.raises(ValueError, match=r"alpha=0.5\) needs the teacher's weights"):
        ClassifierDistillationObjective(student=STUDENT, alpha=0.5)

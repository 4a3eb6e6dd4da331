"""LMObjective's mixture-of-experts metrics: ``moe_dropped_fraction`` against a
numpy count of the assignments past capacity (choice first, then token),
``moe_z_loss`` against its closed form ``mean_t logsumexp(logits_t)^2``, both
from the router inputs each MoE layer saw; the scanned stack reports the same;
a model without experts reports none of them.

Tolerances: the dropped fraction is a count, exact up to float32 division
(1e-6); the z-loss is float32 router logits against float64 ones (1e-5 relative).
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, MoE
from dew.nn.testing import TINY_LM, TINY_MOE
from dew.objectives import Step
from dew.objectives.lm import LMObjective

SEQ, ROWS, FACTOR = 8, 4, 1.0
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))
# init_std 0.5: a router confident enough that the loads are uneven and some drop
CAPACITY = dict(TINY_MOE, moe_dispatch="capacity", moe_capacity_factor=FACTOR, init_std=0.5)


def np_router_metrics(x, router, k, capacity_factor):
    """Per row ``(dropped share, z-loss)`` of one MoE layer from its input ``x
    [rows, length, embed]``, in float64, one assignment at a time."""
    x, router = np.asarray(x, np.float64), np.asarray(router, np.float64)
    rows, length, _ = x.shape
    num = router.shape[1]
    logits = x @ router  # [rows, length, expert]
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    z = (lse**2).mean(-1)  # [rows]
    chosen = np.argsort(-logits.reshape(-1, num), axis=-1, kind="stable")[:, :k]  # [tokens, k]
    tokens = rows * length
    capacity = math.ceil(capacity_factor * tokens * k / num)
    load, dropped = np.zeros(num, int), np.zeros((tokens, k), bool)
    for j in range(k):  # every token's first choice before any second choice
        for t in range(tokens):
            e = chosen[t, j]
            dropped[t, j] = load[e] >= capacity
            load[e] += not dropped[t, j]
    return dropped.reshape(rows, -1).mean(-1), z


def record_moe_inputs(store):
    """A method interceptor that keeps each MoE layer's input by its module path."""

    def intercept(next_fun, args, kwargs, context):
        if isinstance(context.module, MoE) and context.method_name == "__call__":
            store["/".join(context.module.path)] = np.asarray(args[0])
        return next_fun(*args, **kwargs)

    return intercept


@pytest.fixture(scope="module")
def unrolled():
    model = CausalTransformer(**CAPACITY, use_scan=False)
    objective = LMObjective(model, seq_len=SEQ)
    variables = nn.unbox(objective.init(jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, TINY_LM["vocab_size"], (ROWS, SEQ + 1))
    return objective, variables, tokens.astype(np.int32)


def test_dropped_fraction_and_z_loss_match_numpy(unrolled):
    objective, variables, tokens = unrolled
    inputs = {}
    with nn.intercept_methods(record_moe_inputs(inputs)):
        _, metrics = objective.loss(variables, {"text": tokens}, STEP)
    assert sorted(inputs) == ["layer_0/mlp", "layer_1/mlp"]
    per_layer = [
        np_router_metrics(x, variables["params"][path.split("/")[0]]["mlp"]["router"], 2, FACTOR)
        for path, x in sorted(inputs.items())
    ]
    dropped = np.mean([d for d, _ in per_layer], axis=0)  # [rows]: the mean over layers
    z = np.mean([z for _, z in per_layer], axis=0)
    assert 0 < dropped.mean() < 0.5, dropped  # some dropped, most kept
    got = metrics["moe_dropped_fraction"]
    assert float(got.value) == pytest.approx(dropped.mean(), abs=1e-6)
    assert float(got.weight) == ROWS  # weighted by rows, as aux_loss
    assert float(metrics["moe_z_loss"].value) == pytest.approx(z.mean(), rel=1e-5)
    assert float(metrics["moe_z_loss"].weight) == float(metrics["aux_loss"].weight) == ROWS

    # padded rows of a last batch (example_mask) leave the means, as they leave aux_loss;
    # the batch's total is the same in any queue order, these rows' share is not
    rows = np.array([True, False, True, True])
    _, masked = objective.loss(variables, {"text": tokens, "example_mask": rows}, STEP)
    assert float(masked["moe_dropped_fraction"].value) == pytest.approx(
        dropped[rows].mean(), abs=1e-6
    )
    assert float(masked["moe_z_loss"].value) == pytest.approx(z[rows].mean(), rel=1e-5)
    assert float(masked["moe_z_loss"].weight) == rows.sum()


def test_scanned_stack_reports_the_same(unrolled):
    objective, variables, tokens = unrolled
    _, want = objective.loss(variables, {"text": tokens}, STEP)
    params = dict(variables["params"])
    layers = [params.pop(f"layer_{i}") for i in range(TINY_LM["num_layers"])]
    params["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    scanned = LMObjective(CausalTransformer(**CAPACITY), seq_len=SEQ)
    _, got = jax.jit(scanned.loss)({"params": params}, {"text": tokens}, STEP)
    for name in ("aux_loss", "moe_z_loss", "moe_dropped_fraction"):
        assert float(got[name].value) == pytest.approx(float(want[name].value), rel=1e-5), name


def test_only_models_that_sow_them_report_them(unrolled):
    _, _, tokens = unrolled
    cases = {
        "dense": (TINY_LM, {"nll", "tokens"}),
        "dropless": (TINY_MOE, {"nll", "tokens", "aux_loss", "moe_z_loss"}),
    }
    for name, (config, want) in cases.items():
        objective = LMObjective(CausalTransformer(**config), seq_len=SEQ)
        variables = jax.eval_shape(objective.init, jax.random.key(0))
        _, metrics = jax.eval_shape(objective.loss, variables, {"text": tokens}, STEP)
        assert set(metrics) == want, name

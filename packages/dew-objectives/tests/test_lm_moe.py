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
from dew.objectives.language.lm import LMObjective

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
    objective = LMObjective(model=model, seq_len=SEQ)
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
        np_router_metrics(
            x, variables["params"]["policy"][path.split("/")[0]]["mlp"]["router"], 2, FACTOR
        )
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
    params = dict(variables["params"]["policy"])
    layers = [params.pop(f"layer_{i}") for i in range(TINY_LM["num_layers"])]
    params["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    scanned = LMObjective(model=CausalTransformer(**CAPACITY), seq_len=SEQ)
    _, got = jax.jit(scanned.loss)({"params": {"policy": params}}, {"text": tokens}, STEP)
    for name in ("aux_loss", "moe_z_loss", "moe_dropped_fraction"):
        assert float(got[name].value) == pytest.approx(float(want[name].value), rel=1e-5), name


def test_only_models_that_sow_them_report_them(unrolled):
    _, _, tokens = unrolled
    cases = {
        "dense": (TINY_LM, {"nll", "tokens"}),
        "dropless": (TINY_MOE, {"nll", "tokens", "aux_loss", "moe_z_loss"}),
    }
    for name, (config, want) in cases.items():
        objective = LMObjective(model=CausalTransformer(**config), seq_len=SEQ)
        variables = jax.eval_shape(objective.init, jax.random.key(0))
        _, metrics = jax.eval_shape(objective.loss, variables, {"text": tokens}, STEP)
        assert set(metrics) == want, name


def np_balance_loss(x, router, k):
    """Per row: the load-balancing loss ``E sum_e f_e P_e`` of one MoE layer, float64."""
    x, router = np.asarray(x, np.float64), np.asarray(router, np.float64)
    num = router.shape[1]
    logits = x @ router  # [rows, length, expert]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[..., :k]  # [rows, length, k]
    fraction = np.stack([(chosen == e).sum((1, 2)) for e in range(num)], -1) / chosen[0].size
    return num * (fraction * probs.mean(1)).sum(-1)  # [rows]


def test_the_backbones_router_z_loss_weight_enters_the_loss_and_its_gradient(unrolled):
    """``CausalTransformer(moe_router_z_loss_weight=w)``: the ``aux_loss`` term is
    ``aux_loss_weight * mean_rows(mean_layers(balance + w z))``, the loss moves by
    ``aux_loss_weight * w * mean(z)`` from ``w = 0``, and the last router's
    gradient by that term's closed-form gradient ``mean_t 2 lse_t x_t softmax_t^T``
    (numpy, float64); a negative weight is refused when the model is built."""
    from dew.objectives.contract.weighted import loss_value

    _, variables, tokens = unrolled
    w = 0.5
    losses, grads, metrics, inputs = {}, {}, {}, {}
    for weight in (0.0, w):
        model = CausalTransformer(**TINY_MOE, use_scan=False, moe_router_z_loss_weight=weight)
        objective = LMObjective(model=model, seq_len=SEQ)

        def total(params, objective=objective):
            terms, out = objective.loss({"params": params}, {"text": tokens}, STEP)
            return loss_value(terms), out

        (losses[weight], metrics[weight]), grads[weight] = jax.value_and_grad(total, has_aux=True)(
            variables["params"]
        )
    with nn.intercept_methods(record_moe_inputs(inputs)):  # each layer's router input
        objective.loss(variables, {"text": tokens}, STEP)
    routers = {
        p: variables["params"]["policy"][p.split("/")[0]]["mlp"]["router"] for p in sorted(inputs)
    }
    z = np.mean([np_router_metrics(inputs[p], r, 2, 1.0)[1] for p, r in routers.items()], 0)
    balance = np.mean([np_balance_loss(inputs[p], r, 2) for p, r in routers.items()], 0)
    coefficient = objective.aux_loss_weight  # 0.01, the default
    assert float(metrics[0.0]["aux_loss"].value) == pytest.approx(balance.mean(), rel=1e-5)
    assert float(metrics[w]["aux_loss"].value) == pytest.approx((balance + w * z).mean(), rel=1e-5)
    assert float(metrics[w]["moe_z_loss"].value) == pytest.approx(z.mean(), rel=1e-5)
    assert float(losses[w] - losses[0.0]) == pytest.approx(coefficient * w * z.mean(), rel=1e-4)

    # the last layer's router: only its own z-loss depends on it through the z term
    x = np.asarray(inputs["layer_1/mlp"], np.float64)  # [rows, length, embed]
    logits = x @ np.asarray(routers["layer_1/mlp"], np.float64)
    top = logits.max(-1, keepdims=True)
    soft = np.exp(logits - top)
    lse = top[..., 0] + np.log(soft.sum(-1))
    soft /= soft.sum(-1, keepdims=True)
    dz = np.einsum("rt,rte,rtx->ex", 2 * lse, x, soft) / (ROWS * SEQ)  # d mean_rows(z) / dR
    want = coefficient * w * dz / TINY_LM["num_layers"]  # the mean over the 2 MoE layers
    got = (
        grads[w]["policy"]["layer_1"]["mlp"]["router"]
        - grads[0.0]["policy"]["layer_1"]["mlp"]["router"]
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-8)
    assert np.abs(want).max() > 1e-4  # a gradient the tolerance can see

    with pytest.raises(ValueError, match=r"moe_router_z_loss_weight must be .* got -0.1"):
        CausalTransformer(**TINY_MOE, moe_router_z_loss_weight=-0.1)

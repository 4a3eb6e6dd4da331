"""Routed mixture-of-experts dispatch: 'capacity' and 'ragged' against the dense
reference and a float64 numpy MoE (values, gradients, the exact dropped set),
the gating variants, shared experts, the router losses against closed forms,
and expert parallelism over an 8-device mesh against one device."""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import MoE

EMBED, FEATURES = 8, 6


def np_softmax(z):
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def np_swiglu(x, gate, up, down):
    g = x @ gate
    return ((g / (1 + np.exp(-g))) * (x @ up)) @ down


def np_moe(p, x, k, *, gating="softmax_topk", norm=None, capacity_factor=None, shared=False):
    """One token at a time in float64; the capacity order: choice first, then token.
    Returns (out, kept [tokens, k])."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    tokens, num = rows.shape[0], p["router"].shape[1]
    logits = rows @ p["router"]
    chosen, weights = np.zeros((tokens, k), int), np.zeros((tokens, k))
    for t in range(tokens):
        if gating == "topk_softmax":
            chosen[t] = np.argsort(-logits[t])[:k]
            weights[t] = np_softmax(logits[t, chosen[t]])
        else:
            probs = np_softmax(logits[t])
            chosen[t] = np.argsort(-probs)[:k]
            weights[t] = probs[chosen[t]]
            if norm or (norm is None and k > 1):
                weights[t] /= weights[t].sum()
    capacity = tokens if capacity_factor is None else math.ceil(capacity_factor * tokens * k / num)
    load, kept = np.zeros(num, int), np.zeros((tokens, k), bool)
    for j in range(k):
        for t in range(tokens):
            if load[chosen[t, j]] < capacity:
                load[chosen[t, j]] += 1
                kept[t, j] = True
    out = np.zeros_like(rows)
    for t in range(tokens):
        for j in range(k):
            e = chosen[t, j]
            if kept[t, j]:
                out[t] += weights[t, j] * np_swiglu(rows[t], p["gate"][e], p["up"][e], p["down"][e])
        if shared:
            s = p["shared_expert"]
            gated = 1 / (1 + np.exp(-(rows[t] @ p["shared_expert_gate"])))
            out[t] += gated * np_swiglu(
                rows[t], s["gate"]["kernel"], s["up"]["kernel"], s["down"]["kernel"]
            )
    return out.reshape(x.shape), kept, chosen


def make(dispatch, **kw):
    kw = {"num_experts": 4, "experts_per_token": 2, "features": FEATURES, "init_std": 0.5} | kw
    return MoE(dispatch=dispatch, **kw)


X = jax.random.normal(jax.random.key(1), (2, 6, EMBED))
CASES = {
    "top2": {},
    "top1": {"experts_per_token": 1},
    "topk_softmax": {"gating": "topk_softmax"},
    "unnormalised_shared": {"norm_topk_prob": False, "shared_features": 5},
    "fine_grained": {"num_experts": 16, "experts_per_token": 4, "features": 2},
    "dropping": {"capacity_factor": 1.0},
}


def np_options(kw):
    return dict(
        gating=kw.get("gating", "softmax_topk"),
        norm=kw.get("norm_topk_prob"),
        capacity_factor=kw.get("capacity_factor"),
        shared=bool(kw.get("shared_features")),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_every_dispatch_equals_numpy_and_the_dense_reference(case):
    kw = CASES[case]
    params = nn.unbox(make("dense", **kw).init(jax.random.key(0), X)["params"])
    k = kw.get("experts_per_token", 2)
    want, kept, chosen = np_moe(params, np.asarray(X), k, **np_options(kw))
    loads = np.bincount(chosen.reshape(-1), minlength=kw.get("num_experts", 4))
    assert len(set(loads.tolist())) > 1, loads  # unequal expert loads
    if "capacity_factor" in kw:
        assert 0 < (~kept).sum() < kept.size  # some, not all, dropped
    r = jax.random.normal(jax.random.key(2), X.shape)
    grads, outputs = {}, {}
    for dispatch in ("dense", "capacity", "blocked", "ragged"):
        module = make(dispatch, **kw)

        def loss(p, x, module=module):
            y, sown = module.apply({"params": p}, x, mutable=["intermediates"])
            return jnp.sum(y * r), (y, sown["intermediates"])

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, (y, sown)), g = step(params, X)
        if dispatch == "capacity" and case == "top2":
            # tokens move by gathers both ways: no scatter(-add) of [.., embed] rows in
            # the step (the index maps' integer ones and top-k's [.., expert] remain)
            hlo = step.lower(params, X).compile().as_text()
            shapes = re.findall(r"= f32\[([\d,]*)\]\S* scatter\(", hlo)
            assert not [x for x in shapes if x.endswith(f",{EMBED}")], shapes
        np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-6, err_msg=dispatch)
        if "capacity_factor" in kw:
            (dropped,) = sown["dropped_fraction"]  # [batch]: each row's dropped share
            want_dropped = (~kept).reshape(X.shape[0], -1).mean(1)
            np.testing.assert_allclose(np.asarray(dropped), want_dropped, atol=1e-7)
        grads[dispatch], outputs[dispatch] = g, np.asarray(y)
    for dispatch in ("capacity", "blocked", "ragged"):  # routed == dense within 1e-5
        np.testing.assert_allclose(
            outputs[dispatch], outputs["dense"], rtol=1e-5, atol=1e-6, err_msg=dispatch
        )
        jax.tree.map(
            lambda a, b, d=dispatch: np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-6, err_msg=d
            ),
            grads[dispatch],
            grads["dense"],
        )


def test_capacity_drops_exactly_the_assignments_past_capacity():
    """Six tokens that all prefer expert 0: with capacity 3 (factor 1, 4 experts,
    top-2 of 6 tokens) expert 0 keeps the first three first choices; no token
    alone sees a drop, and dropped tokens get only their kept choices."""
    module = make("capacity", capacity_factor=1.0)
    params = nn.unbox(module.init(jax.random.key(0), X)["params"])
    params["router"] = params["router"].at[:, 0].add(5.0 * jnp.sign(X[0, 0]))
    x = jnp.broadcast_to(X[:1, :1], (1, 6, EMBED)) + 0.01 * X[:1]
    _, kept, chosen = np_moe(params, np.asarray(x), 2, capacity_factor=1.0)
    assert (chosen[:, 0] == 0).all() and kept[:, 0].tolist() == [True] * 3 + [False] * 3
    for dispatch in ("dense", "capacity", "blocked", "ragged"):
        y, sown = make(dispatch, capacity_factor=1.0).apply(
            {"params": params}, x, mutable=["intermediates"]
        )
        want, _, _ = np_moe(params, np.asarray(x), 2, capacity_factor=1.0)
        np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-6, err_msg=dispatch)
        (dropped,) = sown["intermediates"]["dropped_fraction"]  # [batch], one row here
        assert dropped.shape == (1,) and float(dropped[0]) == pytest.approx((~kept).mean())


def test_capacity_order_is_choice_first_then_token():
    """Expert 0 is the second choice of tokens 0, 1, 4 and the first of tokens 2, 3:
    with 2 slots it keeps the two first choices, though tokens 0 and 1 come earlier."""
    from dew.nn._moe_dispatch import capacity_of, positions

    chosen = jnp.array([[1, 0], [2, 0], [0, 1], [0, 2], [3, 0]])
    rank = np.asarray(positions(chosen, 4))
    np.testing.assert_array_equal(rank, [[0, 2], [0, 3], [0, 1], [1, 1], [0, 4]])
    capacity = capacity_of(5, 2, 4, 0.8)  # ceil(0.8 * 5 * 2 / 4) = 2
    kept = rank < capacity
    assert capacity == 2
    np.testing.assert_array_equal(kept[:, 1], [False, False, True, True, False])
    assert kept[:, 0].all()


def test_router_losses_against_closed_forms_and_in_float32():
    module = make("capacity", router_z_loss_weight=0.1, dtype=jnp.bfloat16)
    params = nn.unbox(module.init(jax.random.key(0), X)["params"])
    _, sown = module.apply({"params": params}, X, mutable=["intermediates"])
    (aux,), (z,) = sown["intermediates"]["aux_loss"], sown["intermediates"]["z_loss"]
    assert aux.dtype == jnp.float32 and z.dtype == jnp.float32
    # the router sees the bf16 input and weights, multiplied and reduced in float32
    xb = np.asarray(X.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    wb = np.asarray(params["router"].astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    logits = xb @ wb  # [batch, length, expert]
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    want_z = (lse**2).mean(-1)
    probs = np_softmax(logits)
    want_balance = []
    for row in probs:
        chosen = np.argsort(-row, -1)[:, :2].reshape(-1)
        f = np.bincount(chosen, minlength=4) / chosen.size
        want_balance.append(4 * np.sum(f * row.mean(0)))
    np.testing.assert_allclose(np.asarray(z), want_z, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(aux), np.array(want_balance) + 0.1 * want_z, rtol=1e-5)
    # a zero router: logits 0, logsumexp = log(num_experts), z = log(4)^2
    zero = jax.tree.map(jnp.zeros_like, params)
    _, sown = module.apply({"params": zero}, X, mutable=["intermediates"])
    np.testing.assert_allclose(np.asarray(sown["intermediates"]["z_loss"][0]), np.log(4) ** 2)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"experts_per_token": 5}, "experts_per_token 5 must be between 1 and num_experts 4"),
        ({"capacity_factor": 0.0}, "capacity_factor must be > 0"),
        ({"dispatch": "sparse"}, "unknown MoE dispatch 'sparse'"),
        ({"gating": "sigmoid"}, "unknown MoE gating 'sigmoid'"),
    ],
)
def test_bad_moe_options_are_refused(options, message):
    from dew.nn._moe_dispatch import resolve

    accelerator = jax.default_backend() in ("gpu", "tpu")
    assert resolve("auto", None) == ("ragged" if accelerator else "blocked")
    assert resolve("auto", 1.25) == ("ragged" if accelerator else "capacity")
    with pytest.raises(ValueError, match=message):
        make(options.pop("dispatch", "capacity"), **options).init(jax.random.key(0), X)


RULES = [  # dew.train.DEFAULT_RULES' entries for these axes
    ("expert", "expert"),
    ("batch", ("data", "fsdp", "expert")),
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
]


def mesh_of(**sizes):
    names = ("data", "expert", "fsdp", "tensor")
    shape = tuple(sizes.get(n, 1) for n in names)
    devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


@pytest.mark.parametrize(
    "sizes, capacity_factor",
    [
        ({"data": 2, "expert": 4}, None),
        ({"expert": 2, "fsdp": 2, "tensor": 2}, None),
        ({"data": 2, "expert": 4}, 1.0),
    ],
)
def test_expert_parallel_equals_one_device_and_uses_all_to_all(sizes, capacity_factor):
    x = jax.random.normal(jax.random.key(3), (8, 4, EMBED))
    kw = {"shared_features": 4, "capacity_factor": capacity_factor}
    params = nn.unbox(make("dense", **kw).init(jax.random.key(0), x)["params"])
    r = jax.random.normal(jax.random.key(2), x.shape)

    def loss(p, x, module):
        y, sown = module.apply({"params": p}, x, mutable=["intermediates"])
        return jnp.sum(y * r), (y, sown["intermediates"]["aux_loss"][0])

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    if capacity_factor is None:  # dropless: the single-device dense reference
        (_, (want, want_aux)), want_grads = jax.jit(step, static_argnums=2)(
            params, x, make("dense", **kw)
        )
    else:  # capacity per device: the reference is each device's batch on its own
        module = make("capacity", **kw)
        apply = jax.jit(lambda xs: module.apply({"params": params}, xs, mutable=["intermediates"]))
        parts = [apply(xs) for xs in np.split(np.asarray(x), sizes["data"] * sizes["expert"])]
        want = np.concatenate([y for y, _ in parts])
        want_aux = np.concatenate([s["intermediates"]["aux_loss"][0] for _, s in parts])
    mesh = mesh_of(**sizes)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        fn = jax.jit(step, static_argnums=2)
        (_, (y, aux)), grads = fn(params, x, make("capacity", **kw))
        hlo = fn.lower(params, x, make("capacity", **kw)).compile().as_text()
    assert "all-to-all" in hlo
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(aux), np.asarray(want_aux), rtol=1e-5)
    if capacity_factor is None:
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grads, want_grads
        )


def test_experts_that_do_not_divide_over_the_expert_axis_are_refused():
    x = jax.random.normal(jax.random.key(3), (8, 4, EMBED))
    with jax.set_mesh(mesh_of(expert=8)), nn.logical_axis_rules(RULES):
        with pytest.raises(ValueError, match="MoE num_experts: 'expert' of size 4 does not divide"):
            make("capacity").init(jax.random.key(0), x)


@pytest.mark.slow
def test_causal_transformer_routes_with_the_same_parameters():
    from dew.nn import CausalTransformer
    from dew.nn.testing import TINY_MOE

    tokens = jnp.arange(16).reshape(2, 8) % 32
    dense = CausalTransformer(**TINY_MOE)
    params = nn.unbox(dense.init(jax.random.key(0), tokens)["params"])
    want = jax.jit(dense.apply)({"params": params}, tokens)
    routed = CausalTransformer(**TINY_MOE, moe_dispatch="capacity")
    got = jax.jit(routed.apply)({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the scanned stack under a data x expert mesh: all-to-all inside the scan, same logits
    tokens8 = jnp.arange(64).reshape(8, 8) % 32
    want = jax.jit(dense.apply)({"params": params}, tokens8)
    with jax.set_mesh(mesh_of(data=2, expert=4)), nn.logical_axis_rules(RULES):
        parallel = jax.jit(routed.apply)
        got = parallel({"params": params}, tokens8)
        assert "all-to-all" in parallel.lower({"params": params}, tokens8).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        CausalTransformer(**TINY_MOE, moe_capacity_factor=-1.0).init(jax.random.key(0), tokens)


def test_blocked_dispatch_spans_an_expert_over_several_blocks():
    """20 tokens that all pick expert 0 (k=1): its group fills three blocks of 8."""
    from dew.nn._moe_dispatch import block_rows

    module = make("blocked", experts_per_token=1)
    params = nn.unbox(module.init(jax.random.key(0), X)["params"])
    x = jnp.broadcast_to(X[:1, :1], (1, 20, EMBED)) + 0.01 * jax.random.normal(
        jax.random.key(4), (1, 20, EMBED)
    )
    _, _, chosen = np_moe(params, np.asarray(x), 1)
    params["router"] = params["router"].at[:, int(chosen[0, 0])].add(5.0 * jnp.sign(x[0, 0]))
    want, _, chosen = np_moe(params, np.asarray(x), 1)
    assert len(set(chosen[:, 0].tolist())) == 1 and block_rows(20, 4) == 8
    y = jax.jit(module.apply)({"params": params}, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-6)


def test_an_expert_axis_that_does_not_split_the_batch_is_refused():
    x = jax.random.normal(jax.random.key(3), (8, 4, EMBED))
    rules = [("expert", "expert"), ("batch", "data")]
    with jax.set_mesh(mesh_of(data=2, expert=4)), nn.logical_axis_rules(rules):
        with pytest.raises(ValueError, match="needs the batch split over it too"):
            make("capacity").init(jax.random.key(0), x)


def test_a_batch_that_does_not_split_is_routed_in_one_program():
    """The trainer initialises on one example: under data=2 x expert=4 it cannot be
    split 8 ways, so it is routed unsplit (no shard_map), with the same values."""
    x = X[:1]
    params = nn.unbox(make("dense").init(jax.random.key(0), x)["params"])
    want = make("dense").apply({"params": params}, x)
    with jax.set_mesh(mesh_of(data=2, expert=4)), nn.logical_axis_rules(RULES):
        fn = jax.jit(make("capacity").apply)
        got = fn({"params": params}, x)
        assert "all-to-all" not in fn.lower({"params": params}, x).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

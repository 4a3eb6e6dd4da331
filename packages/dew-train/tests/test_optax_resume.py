"""Any optax optimizer resumes exactly: each one trains 4 steps uninterrupted
(checkpointing at step 2), and a NEW Trainer given only the checkpoint of
step 2 continues to step 4; params, opt_state and counters must be
bit-identical to the uninterrupted run's, on one device and under fsdp.

The model is a two-layer MLP on 16 features (the smallest with kernels and
biases on the ``embed``/``mlp`` axes, so fsdp and tensor splits apply and
Adafactor factors its kernels), which keeps each case to a few compiles."""

from __future__ import annotations

import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import axes, models
from dew.objectives import Objective
from dew.objectives.language.lm import LMObjective
from dew.train import Checkpoints, MeshSpec, Trainer
from dew.train.mesh import optimizer_specs

EMB, HIDDEN, BATCH, STEPS = 16, 8, 8, 4


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):  # [batch, embed]
        def dense(features, names, name):
            return nn.Dense(
                features,
                kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.5), names),
                bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), names[1:]),
                name=name,
            )

        h = jnp.tanh(dense(HIDDEN, (axes.EMBED, axes.MLP), "up")(x))  # [batch, mlp]
        return dense(EMB, (axes.MLP, axes.EMBED), "down")(h)  # [batch, embed]


class Regression(Objective):
    """Squared error of the MLP against a fixed target map."""

    def __init__(self):
        self.model = MLP()

    def init(self, key):
        return {"params": {"policy": self.model.init(key, jnp.zeros((1, EMB)))["params"]}}

    def loss(self, variables, batch, step):
        params = {"params": variables["params"]["policy"]}
        error = jnp.sum((self.model.apply(params, batch["x"]) - batch["y"]) ** 2)
        rows = batch["x"].shape[0]
        return error / rows, {"loss": error / rows, "error_sum": error, "rows": rows}


def data() -> Dataset:
    """A deterministic stream whose batches change every step."""

    def train(partition):
        step = 0
        while True:
            rng = np.random.default_rng(step)
            x = rng.normal(size=(BATCH, EMB)).astype(np.float32)
            yield {"x": x, "y": np.sin(3 * x[:, ::-1]).astype(np.float32)}
            step += 1

    return Dataset(train=train, val=None, records=10**6, batch=BATCH)


def kernels(params):
    """True at kernels: weight decay on kernels only. Works on the boxed
    parameters ``init`` sees and the plain ones ``update`` sees."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) == "kernel" for k in path), params
    )


def labels(params):
    return jax.tree.map(lambda is_kernel: "decay" if is_kernel else "plain", kernels(params))


warmup_cosine = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=4)
OPTIMIZERS = {
    "linear": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, 4)),
    "cosine": lambda: optax.adamw(optax.cosine_decay_schedule(1e-2, 4)),
    "warmup_cosine": lambda: optax.adamw(warmup_cosine),
    "join_schedules": lambda: optax.sgd(
        optax.join_schedules(
            [optax.constant_schedule(1e-2), optax.linear_schedule(1e-2, 0.0, 2)], [2]
        ),
        momentum=0.9,
    ),
    # the recipe: a leafless EmptyState before states with arrays
    "clip_then_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(warmup_cosine, weight_decay=0.01)
    ),
    "adam_then_clip": lambda: optax.chain(
        optax.scale_by_adam(),
        optax.clip_by_global_norm(1.0),
        optax.scale_by_learning_rate(warmup_cosine),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=warmup_cosine, weight_decay=0.01
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"decay": optax.adamw(1e-2, weight_decay=0.1), "plain": optax.adam(1e-2)}, labels
    ),
    "masked_decay": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(warmup_cosine, weight_decay=0.1, mask=kernels),
    ),
    "multi_steps": lambda: optax.MultiSteps(
        optax.adam(1e-2), every_k_schedule=2
    ).gradient_transformation(),
    # as users pass it: the MultiSteps object itself, and an ExtraArgs transformation;
    # k = 3, so the checkpoint at step 2 holds a half-accumulated gradient (mini_step 2)
    "multi_steps_as_built": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
    "extra_args": lambda: optax.with_extra_args_support(optax.adam(1e-2)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "muon": lambda: optax.contrib.muon(1e-2),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
    "prodigy": lambda: optax.contrib.prodigy(1.0),
    "mechanize": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "ademamix": lambda: optax.contrib.ademamix(1e-2),
    "adopt": lambda: optax.contrib.adopt(1e-2),
    "dog": lambda: optax.contrib.dog(),
}
FAST = {"clip_then_adamw", "adafactor", "multi_transform", "multi_steps_as_built"}  # the rest slow
MESHES = {
    "one_device": lambda: MeshSpec(data=1, devices=jax.devices()[:1]),
    "fsdp": lambda: MeshSpec(fsdp=8),
    "fsdp_tensor": lambda: MeshSpec(data=2, fsdp=2, tensor=2),
}


def tiny_lm_objective():
    """The tiniest causal transformer of the other tests, on bytes."""
    model = models.build(
        "causal_transformer",
        vocab_size=32,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=8,
    )
    return LMObjective(model=model, seq_len=8)


def lm_data() -> Dataset:
    def train(partition):
        step = 0
        while True:
            rng = np.random.default_rng(step)
            yield {"text": rng.integers(0, 32, (BATCH, 9), dtype=np.int32)}
            step += 1

    return Dataset(train=train, val=None, records=10**6, batch=BATCH)


def make_trainer(name: str, mesh: str, directory=None, objective=Regression) -> Trainer:
    return Trainer(
        objective(),
        OPTIMIZERS[name](),
        key=jax.random.key(0),
        mesh=MESHES[mesh](),
        checkpoints=None if directory is None else Checkpoints(directory, keep=None),
        progress=False,
    )


def assert_same_state(resumed, reference):
    for name in ("step", "microstep", "updates"):
        assert int(getattr(resumed, name)) == int(getattr(reference, name)), name
    for field in ("params", "opt_state"):
        a = jax.tree_util.tree_leaves_with_path(getattr(resumed, field))
        b = jax.tree_util.tree_leaves_with_path(getattr(reference, field))
        assert [p for p, _ in a] == [p for p, _ in b], field
        for (path, x), (_, y) in zip(a, b):
            np.testing.assert_array_equal(
                np.asarray(x), np.asarray(y), err_msg=f"{field}{jax.tree_util.keystr(path)}"
            )


CASES = [
    pytest.param(name, mesh, marks=() if name in FAST and mesh == "fsdp" else pytest.mark.slow)
    for name in OPTIMIZERS
    for mesh in ("one_device", "fsdp")
] + [
    pytest.param(name, "fsdp_tensor", marks=pytest.mark.slow)
    for name in ("clip_then_adamw", "adafactor")
]


@pytest.mark.parametrize(("name", "mesh"), CASES)
def test_resumed_run_is_bit_identical(name, mesh, tmp_path):
    reference = make_trainer(name, mesh, tmp_path / "reference")
    final = reference.fit(data(), steps=STEPS, log_every=0, checkpoint_every=2)
    # The state moved: a resume that restored nothing would not pass.
    assert int(final.updates) >= 1
    shutil.copytree(tmp_path / "reference" / "2", tmp_path / "resumed" / "2")
    resumed = make_trainer(name, mesh, tmp_path / "resumed").fit(data(), steps=STEPS, log_every=0)
    assert_same_state(resumed, final)


def test_factored_moments_get_specs_that_fit_their_shape():
    """Adafactor's factored moments drop a dimension of their kernel: each
    keeps the mesh axis of the dimension it kept, and the [1] placeholders
    are replicated (the shapes are optax's own)."""
    abstract, shardings = make_trainer("adafactor", "fsdp").state_shardings()
    moments, specs = abstract.opt_state[0], shardings.opt_state[0]

    def spec(tree, *path):
        for key in ("policy", *path):
            tree = tree[key]
        return tuple(tree.spec)

    # up/kernel is [embed 16, mlp 8]: v_row drops embed (its largest), v_col drops mlp
    assert moments.v_row["policy"]["up"]["kernel"].shape == (HIDDEN,)
    assert moments.v_col["policy"]["up"]["kernel"].shape == (EMB,)
    assert spec(specs.v_row, "up", "kernel") == ("tensor",)  # mlp
    assert spec(specs.v_col, "up", "kernel") == ("fsdp",)  # embed, 16 over 8 devices
    assert spec(specs.v, "up", "kernel") == (None,)  # the [1] placeholder
    assert spec(specs.v, "up", "bias") == ("tensor",)  # not factored: like the bias
    # down/kernel is [mlp 8, embed 16]: v_row drops embed, v_col drops mlp
    assert moments.v_row["policy"]["down"]["kernel"].shape == (HIDDEN,)
    assert spec(specs.v_row, "down", "kernel") == ("tensor",)
    assert spec(specs.v_col, "down", "kernel") == ("fsdp",)


def test_optimizer_specs_fit_each_shape_and_replicate_what_does_not_divide():
    mesh = MeshSpec(fsdp=8).make()
    rules = (("embed", "fsdp"), ("mlp", "tensor"))

    def box(*shape):
        return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), ("embed", "mlp"))

    params = {"w": box(16, 24), "u": box(4, 16)}
    state = {
        "mu": {"w": box(16, 24), "u": box(4, 16)},
        "row": {"w": box(16), "u": box(4)},  # u: embed 4 does not split over 8
        "col": {"w": box(24), "u": box(16)},
        "odd": {"w": box(12), "u": box(1)},  # no dimension of that size: replicated
        "count": jax.ShapeDtypeStruct((), jnp.int32),
    }
    specs = optimizer_specs(state, params, mesh, rules)
    assert specs == {
        "mu": {"w": jax.P("embed", "mlp"), "u": jax.P(None, "mlp")},
        "row": {"w": jax.P("embed"), "u": jax.P(None)},
        "col": {"w": jax.P("mlp"), "u": jax.P("mlp")},
        "odd": {"w": jax.P(None), "u": jax.P(None)},
        "count": jax.P(),
    }


@pytest.mark.slow
def test_transformer_with_adafactor_resumes_under_fsdp_and_tensor(tmp_path):
    """The issue's second run: Adafactor on a causal transformer, whose
    factored moments were given their kernel's two-axis spec, under fsdp x
    tensor."""
    name = "adafactor"
    reference = make_trainer(name, "fsdp_tensor", tmp_path / "reference", tiny_lm_objective)
    final = reference.fit(lm_data(), steps=STEPS, log_every=0, checkpoint_every=2)
    shutil.copytree(tmp_path / "reference" / "2", tmp_path / "resumed" / "2")
    resumed = make_trainer(name, "fsdp_tensor", tmp_path / "resumed", tiny_lm_objective)
    assert_same_state(resumed.fit(lm_data(), steps=STEPS, log_every=0), final)

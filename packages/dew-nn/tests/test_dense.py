"""Dense contractions over token rows (dew.nn.dense): same values as over
``[batch, length, ...]``, and a compiled gradient without transposed copies of
the activation gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.mlp import MLP

BATCH, LENGTH, EMBED, FEATURES = 4, 32, 16, 64
TOKENS = BATCH * LENGTH  # 128: distinct from every width, so a shape names its axes


def transposed_activations(compiled_text: str) -> list[str]:
    """Top-level instructions holding an activation-sized array laid out
    ``[features or embed, tokens]``: a transposing copy of an activation (gradient)."""
    entry = compiled_text.split("ENTRY", 1)[1]
    wanted = {f"f32[{FEATURES},{TOKENS}]", f"f32[{EMBED},{TOKENS}]"}
    return [line.strip() for line in entry.splitlines() if any(w in line for w in wanted)]


def mlp_and_inputs():
    mlp = MLP(features=FEATURES, activation="swiglu")
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, EMBED))
    params = nn.meta.unbox(mlp.init(jax.random.key(0), x)["params"])
    return mlp, params, x


def unflattened_swiglu(params, x):
    """The same MLP with every contraction over ``[batch, length, ...]`` (the form
    before dew.nn.dense)."""

    def dense(name, h):
        kernel = params[name]["kernel"]
        return jax.lax.dot_general(h, kernel, (((2,), (0,)), ((), ())))

    return dense("down", nn.silu(dense("gate", x)) * dense("up", x))


def test_mlp_equals_numpy_and_the_unflattened_contraction():
    mlp, params, x = mlp_and_inputs()
    got = np.asarray(mlp.apply({"params": params}, x))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    xs = np.asarray(x, np.float64)
    gate, up = xs @ p["gate"]["kernel"], xs @ p["up"]["kernel"]
    want = (gate / (1 + np.exp(-gate)) * up) @ p["down"]["kernel"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32 against float64
    np.testing.assert_array_equal(got, np.asarray(unflattened_swiglu(params, x)))


def test_mlp_kernel_gradients_read_activation_gradients_untransposed():
    mlp, params, x = mlp_and_inputs()

    def loss(apply_fn):
        return lambda p, x: jnp.sum(apply_fn(p, x) ** 2)

    dew_grad = jax.jit(jax.grad(loss(lambda p, x: mlp.apply({"params": p}, x)), argnums=(0, 1)))
    reference_grad = jax.jit(jax.grad(loss(unflattened_swiglu), argnums=(0, 1)))
    # the detector sees the copies the [batch, length, ...] contraction compiles to ...
    assert transposed_activations(reference_grad.lower(params, x).compile().as_text())
    # ... and Dew's MLP has none (they were a fifth of the medium LM's step)
    assert transposed_activations(dew_grad.lower(params, x).compile().as_text()) == []
    got, want = dew_grad(params, x), reference_grad(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # summation order may differ


def test_token_rows_flattens_leading_axes():
    from dew.nn.dense import token_rows

    x = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    np.testing.assert_array_equal(token_rows(jnp.asarray(x)), x.reshape(24, 5))
    np.testing.assert_array_equal(token_rows(jnp.asarray(x), 2), x.reshape(6, 4, 5))

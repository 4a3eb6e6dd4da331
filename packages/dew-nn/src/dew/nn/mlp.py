"""Feed-forward blocks: gated (SwiGLU, Shazeer 2020) or plain GELU (GPT-2)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes
from dew.nn.dense import token_rows

ACTIVATIONS = ("swiglu", "gelu", "gelu_exact", "relu")


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` for ``'swiglu'``; ``down(act(up(x)))`` otherwise.

    ``'gelu'`` is the tanh approximation (GPT-2's ``gelu_new``), ``'gelu_exact'`` the erf form.
    """

    features: int
    activation: str = "swiglu"
    use_bias: bool = False
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _dense(self, name, features, in_axis, out_axis, x):
        return nn.Dense(
            features,
            use_bias=self.use_bias,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(self.init_std), (in_axis, out_axis)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )(x)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; use one of {ACTIVATIONS}")
        # over the tokens flattened (dew.nn.dense): the kernels' gradients then
        # contract one token axis, which XLA:CPU does without transposing copies
        rows = token_rows(x)  # [tokens, embed]
        up = self._dense("up", self.features, axes.EMBED, axes.MLP, rows)  # [tokens, mlp]
        if self.activation == "swiglu":
            hidden = nn.silu(self._dense("gate", self.features, axes.EMBED, axes.MLP, rows)) * up
        elif self.activation == "gelu":
            hidden = nn.gelu(up, approximate=True)
        elif self.activation == "gelu_exact":
            hidden = nn.gelu(up, approximate=False)
        else:
            hidden = nn.relu(up)
        hidden = hidden.reshape(*x.shape[:-1], self.features)
        hidden = nn.with_logical_constraint(hidden, (axes.BATCH, axes.LENGTH, axes.MLP))
        out = self._dense("down", x.shape[-1], axes.MLP, axes.EMBED, token_rows(hidden))
        return out.reshape(x.shape)  # [batch, length, embed]

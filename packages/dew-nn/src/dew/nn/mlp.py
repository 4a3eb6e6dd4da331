"""Feed-forward blocks: gated (SwiGLU, Shazeer 2020) or plain GELU (GPT-2), and the
one table of their activations that every feed-forward block reads (:class:`MLP`,
:class:`dew.nn.moe.MoE`'s experts, every backbone's ``mlp_activation``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dew.nn import axes
from dew.nn.dense import token_rows

# name -> the nonlinearity; a gated activation applies it to the gate projection and
# multiplies by the up projection (``act(x W_gate) * x W_up``), the others apply it
# to the up projection alone.
ACTIVATION_FNS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "swiglu": nn.silu,  # gated SiLU (Shazeer, 2020; Llama)
    "gelu": functools.partial(nn.gelu, approximate=True),  # tanh form (GPT-2's gelu_new, DiT)
    "gelu_exact": functools.partial(nn.gelu, approximate=False),  # erf form (ViT, I-JEPA)
    "relu": nn.relu,
}
GATED_ACTIVATIONS = frozenset({"swiglu"})
ACTIVATIONS = tuple(ACTIVATION_FNS)


def is_gated(activation: str) -> bool:
    """Whether ``activation`` multiplies a gate projection (has a ``gate`` weight)."""
    return activation in GATED_ACTIVATIONS


def check_activation(activation: str, owner: str = "") -> None:
    """Raise ``ValueError`` unless ``activation`` is in :data:`ACTIVATION_FNS`."""
    if activation not in ACTIVATION_FNS:
        where = f"{owner} has " if owner else ""
        raise ValueError(f"{where}unknown activation {activation!r}; use one of {ACTIVATIONS}")


def activate(activation: str, up: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    """The hidden activations: ``act(gate) * up`` for a gated ``activation``,
    ``act(up)`` otherwise (``gate`` is then not read)."""
    fn = ACTIVATION_FNS[activation]
    return fn(gate) * up if is_gated(activation) else fn(up)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` for ``'swiglu'``; ``down(act(up(x)))`` otherwise.

    ``activation`` names an entry of :data:`ACTIVATION_FNS`: ``'gelu'`` is the tanh
    approximation (GPT-2's ``gelu_new``), ``'gelu_exact'`` the erf form.
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
        check_activation(self.activation)
        # over the tokens flattened (dew.nn.dense): the kernels' gradients then
        # contract one token axis, which XLA:CPU does without transposing copies
        rows = token_rows(x)  # [tokens, embed]
        # the names a remat policy keeps or drops (dew.nn.stack.REMAT_POLICIES, MaxText's)
        up = self._dense("up", self.features, axes.EMBED, axes.MLP, rows)  # [tokens, mlp]
        up = checkpoint_name(up, "mlpwi")
        gate = None
        if is_gated(self.activation):
            gate = self._dense("gate", self.features, axes.EMBED, axes.MLP, rows)  # [tokens, mlp]
            gate = checkpoint_name(gate, "mlpwi")
        hidden = checkpoint_name(activate(self.activation, up, gate), "mlp_activation")
        hidden = hidden.reshape(*x.shape[:-1], self.features)
        hidden = nn.with_logical_constraint(hidden, (axes.BATCH, axes.LENGTH, axes.MLP))
        out = self._dense("down", x.shape[-1], axes.MLP, axes.EMBED, token_rows(hidden))
        out = checkpoint_name(out, "mlpwo")
        return out.reshape(x.shape)  # [batch, length, embed]

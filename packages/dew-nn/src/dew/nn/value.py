"""Value functions over token positions, for actor-critic training (PPO).

A value head maps the hidden state of position ``t`` to a scalar estimate of
the return from there (Schulman et al., 2017; Ziegler et al., 2019):

    V(s_t) = h_t . w + b        h_t: the trunk's final hidden state at ``t``

:class:`ValueHead` is that projection alone, applied to the policy's own
hidden states (``CausalTransformer(..., return_hidden=True)``): one trunk,
two heads, the value loss also trains the trunk. :class:`Critic` is a
separate critic model: its own :class:`~dew.nn.CausalTransformer` trunk and
a head, as TRL and Tunix use (built with ``tie_embeddings=True`` it holds no
output matrix it never reads).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes


class ValueHead(nn.Module):
    """``hidden [batch, length, embed] -> values [batch, length]`` (float32).

    init_std: standard deviation of the normal kernel initialiser; 0 = zeros,
      so every value starts at 0 (the bias is zero either way).
    dtype: computation dtype. param_dtype: parameter dtype.
    """

    init_std: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:
        if self.init_std < 0:
            raise ValueError(f"ValueHead init_std must be >= 0 (0 = zeros), got {self.init_std}")
        init = nn.initializers.normal(self.init_std) if self.init_std else nn.initializers.zeros
        values = nn.Dense(
            1,
            kernel_init=nn.with_logical_partitioning(init, (axes.EMBED, None)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="value",
        )(hidden)  # [batch, length, 1]
        return values[..., 0].astype(jnp.float32)  # [batch, length]


class Critic(nn.Module):
    """A separate critic: ``tokens [batch, length] -> values [batch, length]``.

    trunk: a :class:`~dew.nn.CausalTransformer` (any module that takes
      ``return_hidden=True`` and returns ``(logits, hidden)``); its parameters
      live under ``trunk``, the head's under ``head``.
    init_std: the head's kernel initialiser (:class:`ValueHead`).

    ``positions`` and ``attention_mask`` are passed to the trunk as
    :class:`~dew.nn.CausalTransformer` takes them (left-padded prompts).
    """

    trunk: nn.Module
    init_std: float = 0.0

    @nn.compact
    def __call__(self, tokens, *, positions=None, attention_mask=None) -> jax.Array:
        # the trunk's logits are never read: XLA drops their computation
        _, hidden = self.trunk(
            tokens, positions=positions, attention_mask=attention_mask, return_hidden=True
        )  # [batch, length, embed]
        head = ValueHead(
            init_std=self.init_std,
            dtype=getattr(self.trunk, "dtype", jnp.float32),
            param_dtype=getattr(self.trunk, "param_dtype", jnp.float32),
            name="head",
        )
        return head(hidden)  # [batch, length]

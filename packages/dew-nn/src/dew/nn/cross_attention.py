"""Cross-attention: queries from the residual stream, keys and values from a context.

A text-conditioned diffusion transformer reads text embeddings through it
(PixArt-alpha, Chen et al., 2023; diffusers' ``BasicTransformerBlock`` with
``cross_attention_dim``): ``softmax(q k^T / sqrt(head_dim)) v`` with
``q = x W_q``, ``k = c W_k``, ``v = c W_v`` for ``x [batch, length, embed]`` and
``c [batch, tokens, context_features]``, then ``W_o``. No positions: the
context is a set of tokens for the purpose of the attention (their order is
in the embeddings already).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes


class CrossAttention(nn.Module):
    """Multi-head attention of ``x`` over ``context``.

    num_heads: attention heads.
    head_dim: features per head.
    use_bias: biases on the query/key/value and output projections.
    zero_init_out: the output projection starts at zero, so the block adds
      nothing at initialisation (PixArt-alpha's choice, kept by adaLN-Zero DiTs).
    init_std: standard deviation of the normal initialiser of the other kernels.
    """

    num_heads: int
    head_dim: int
    use_bias: bool = True
    zero_init_out: bool = True
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _param(self, name, init, shape, names):
        return self.param(name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)

    def _project(self, name, x):
        """``[batch, n, features] -> [batch, n, heads, head_dim]``."""
        kernel = self._param(
            f"{name}_kernel",
            nn.initializers.normal(self.init_std),
            (x.shape[-1], self.num_heads, self.head_dim),
            (axes.EMBED, axes.HEADS, axes.HEAD_DIM),
        )
        y = jnp.einsum("bne,ehd->bnhd", x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            bias = self._param(
                f"{name}_bias",
                nn.initializers.zeros,
                (self.num_heads, self.head_dim),
                (axes.HEADS, axes.HEAD_DIM),
            )
            y = y + bias.astype(self.dtype)
        return y

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array, context_mask: jax.Array | None = None):
        """``x [batch, length, embed]``, ``context [batch, tokens, context_features]`` ->
        ``[batch, length, embed]``.

        context_mask: optional boolean ``[batch, tokens]``; False hides a token
          (padding of a shorter prompt). A row with every token hidden gets zeros.
        """
        q = self._project("query", x)  # [batch, length, heads, head_dim]
        k = self._project("key", context)  # [batch, tokens, heads, head_dim]
        v = self._project("value", context)
        mask = None
        if context_mask is not None:
            mask = context_mask.astype(jnp.bool_)[:, None, None, :]  # [batch, 1, 1, tokens]
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        if context_mask is not None:
            # softmax over no visible key is uniform; such a row reads nothing instead
            seen = jnp.any(context_mask, axis=-1)[:, None, None, None]
            out = jnp.where(seen, out, 0)
        init = nn.initializers.normal(self.init_std)
        if self.zero_init_out:
            init = nn.initializers.zeros
        kernel = self._param(
            "out_kernel",
            init,
            (self.num_heads, self.head_dim, x.shape[-1]),
            (axes.HEADS, axes.HEAD_DIM, axes.EMBED),
        )
        y = jnp.einsum("blhd,hde->ble", out.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            y = y + self._param(
                "out_bias", nn.initializers.zeros, (x.shape[-1],), (axes.EMBED,)
            ).astype(self.dtype)
        return y  # [batch, length, embed]

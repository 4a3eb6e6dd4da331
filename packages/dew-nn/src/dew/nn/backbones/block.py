"""The transformer blocks of every backbone, built from one :class:`BlockConfig`.

Two residual forms share the same self-attention (:func:`self_attention`) and
feed-forward block (:func:`feed_forward`, a dense :class:`dew.nn.MLP` or a
:class:`dew.nn.moe.MoE`), with the same parameter names (``attention/...``,
``mlp/...``):

- :class:`DecoderBlock`, pre-norm: ``x + attn(norm(x))``, then ``x +
  mlp(norm(x))``, the norms learning their scale (and bias). The attention sees
  what ``config.mask`` allows, so it serves decoders
  (:class:`dew.nn.CausalTransformer`), encoders (:class:`dew.nn.Transformer`)
  and vision transformers (:class:`dew.nn.ViT`, :class:`dew.nn.ViTPredictor`).
- :class:`DiTBlock`, adaLN-Zero (Peebles & Xie, 2023): ``(shift1, scale1, gate1,
  shift2, scale2, gate2) = W silu(c) + b``; ``x += gate1 * attn(LN(x) (1 +
  scale1) + shift1)``, with a text context ``x += crossattn(LN(x), context)``,
  then ``x += gate2 * mlp(LN(x) (1 + scale2) + shift2)``; parameter-free norms
  (:class:`dew.nn.DiT`, :class:`dew.nn.VideoDiT`).

Each backbone derives its :class:`BlockConfig` from the shared options
(:mod:`dew.nn.backbones._options`) and runs its blocks through a
:class:`dew.nn.stack.LayerStack`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dew.nn import axes
from dew.nn.attention import Attention
from dew.nn.backbones._options import ACTIVATION_AXES, BlockConfig
from dew.nn.cross_attention import CrossAttention
from dew.nn.mlp import MLP
from dew.nn.moe import MoE
from dew.nn.norms import make_norm

IMAGE_AXES = (axes.BATCH, axes.LENGTH, axes.EMBED)  # [batch, patches, embed]

__all__ = [
    "IMAGE_AXES",
    "BlockConfig",
    "DecoderBlock",
    "DiTBlock",
    "feed_forward",
    "modulate",
    "plain_norm",
    "self_attention",
]


def self_attention(c: BlockConfig, name: str = "attention") -> Attention:
    """The block's self-attention: ``c``'s heads, rotation, mask, biases and dtypes."""
    return Attention(
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        mask=c.mask,
        use_qkv_bias=c.use_qkv_bias,
        use_out_bias=c.use_bias,
        init_std=c.init_std,
        dtype=c.dtype,
        param_dtype=c.param_dtype,
        qk_norm=c.qk_norm,
        qk_norm_eps=c.norm_eps,
        kernel=c.attention_kernel,
        kernel_block_size=c.attention_block_size,
        name=name,
    )


def feed_forward(c: BlockConfig, name: str = "mlp") -> nn.Module:
    """The block's feed-forward block: :class:`dew.nn.MLP`, or :class:`dew.nn.moe.MoE`
    when ``c.num_experts > 0``."""
    shared = dict(
        features=c.mlp_features,
        activation=c.mlp_activation,
        init_std=c.init_std,
        dtype=c.dtype,
        param_dtype=c.param_dtype,
        name=name,
    )
    if c.num_experts:
        return MoE(
            num_experts=c.num_experts,
            experts_per_token=c.experts_per_token,
            dispatch=c.moe_dispatch,
            capacity_factor=c.moe_capacity_factor,
            gating=c.moe_gating,
            norm_topk_prob=c.moe_norm_topk_prob,
            shared_features=c.moe_shared_features,
            shared_expert_gate=c.moe_shared_gate,
            router_z_loss_weight=c.moe_router_z_loss_weight,
            **shared,
        )
    return MLP(use_bias=c.use_bias, **shared)


class DecoderBlock(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (pre-norm); the attention
    sees what ``config.mask`` allows, so the same block serves decoders and encoders."""

    config: BlockConfig
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x,
        positions,
        valid,
        segment_ids=None,
        query_key_mask=None,
        visible=None,
        *,
        output_length: int | None = None,
    ):
        """``x [batch, length, embed] -> [batch, length, embed]``; the rest as
        :class:`dew.nn.Attention` takes them (``visible``: the mask its backbone
        computed once for every layer).

        output_length: only the first ``output_length`` slots come out, ``[batch,
          output_length, embed]``: every slot gives the attention its keys and values,
          but the queries, the attention output, the second norm and the
          feed-forward block run on those slots alone (the last layer of block
          diffusion's ``[noisy | clean]`` pass). None = every slot.
        """
        c = self.config
        # the names a remat policy keeps or drops (dew.nn.stack.REMAT_POLICIES): the
        # norms' outputs, and the residual between the attention and the MLP
        h = make_norm(c.norm, c.norm_eps, c.dtype, c.param_dtype, "attention_norm")(x)
        h = checkpoint_name(h, "attention_norm")
        h = self_attention(c)(
            h,
            positions,
            valid,
            segment_ids=segment_ids,
            query_key_mask=query_key_mask,
            decode=self.decode,
            visible=visible,
            query_length=output_length,
        )
        x = checkpoint_name(x[:, : h.shape[1]] + h, "attention_residual")
        h = make_norm(c.norm, c.norm_eps, c.dtype, c.param_dtype, "mlp_norm")(x)
        h = checkpoint_name(h, "mlp_norm")
        h = feed_forward(c)(h)
        return nn.with_logical_constraint(x + h, ACTIVATION_AXES)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """``x (1 + scale) + shift`` with ``shift, scale [batch, embed]`` broadcast over tokens."""
    return x * (1 + scale[:, None]) + shift[:, None]


def plain_norm(eps: float, dtype, name: str) -> nn.LayerNorm:
    """LayerNorm without scale or bias (adaLN supplies them)."""
    return nn.LayerNorm(epsilon=eps, use_bias=False, use_scale=False, dtype=dtype, name=name)


class DiTBlock(nn.Module):
    """One adaLN-Zero block (module docstring) over ``x [batch, length, embed]``.

    config: the attention and feed-forward block (heads, ``mlp_activation``,
      ``norm_eps`` of the attention norm, ``use_qkv_bias``; ``use_bias`` biases
      the attention output and the MLP, as DiT has them).
    mlp_norm_eps: epsilon of the norm before the feed-forward block.
    use_cross_attention: read a text context after the self-attention.
    token_axes: the logical axes of ``x`` constrained at the block's output
      (``(batch, length, embed)``; a temporal block's tokens are frames).
    use_zero_init: the modulation and the cross-attention output start at 0.
    """

    config: BlockConfig
    mlp_norm_eps: float
    use_cross_attention: bool
    token_axes: tuple[str, ...] = IMAGE_AXES
    use_zero_init: bool = True

    @nn.compact
    def __call__(self, x, condition, context=None, context_mask=None, position_embed=None):
        """``x [batch, length, embed] -> [batch, length, embed]``.

        condition: ``silu(c)`` ``[batch, embed]``.
        context, context_mask: ``[batch, tokens, context_features]``, ``[batch, tokens]``.
        position_embed: optional ``[length, embed]`` added to the modulated
          input of the attention (a temporal block's frame positions).
        """
        c = self.config
        batch, length, embed = x.shape
        zero_or_normal = (
            nn.initializers.zeros if self.use_zero_init else nn.initializers.normal(c.init_std)
        )
        modulation = nn.Dense(
            6 * embed,
            kernel_init=nn.with_logical_partitioning(zero_or_normal, (axes.EMBED, axes.MLP)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes.MLP,)),
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="modulation",
        )(condition)  # [batch, 6 * embed]
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(modulation, 6, axis=-1)
        h = modulate(plain_norm(c.norm_eps, c.dtype, "attention_norm")(x), shift1, scale1)
        if position_embed is not None:
            h = h + position_embed.astype(h.dtype)[None]
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        # numpy: no padding, known while tracing (a fused kernel then needs no segments)
        h = self_attention(c)(h, positions, np.ones((batch, length), bool))
        x = x + gate1[:, None] * h
        if self.use_cross_attention:
            h = plain_norm(c.norm_eps, c.dtype, "cross_attention_norm")(x)
            x = x + CrossAttention(
                num_heads=c.num_heads,
                head_dim=c.head_dim,
                use_bias=True,
                zero_init_out=self.use_zero_init,
                init_std=c.init_std,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                name="cross_attention",
            )(h, context, context_mask)
        h = modulate(plain_norm(self.mlp_norm_eps, c.dtype, "mlp_norm")(x), shift2, scale2)
        x = x + gate2[:, None] * feed_forward(c)(h)
        return nn.with_logical_constraint(x, self.token_axes)

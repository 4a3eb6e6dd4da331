"""A bidirectional transformer encoder over tokens or continuous vectors.

The blocks, the layer stack and the attention are :class:`CausalTransformer`'s
(:class:`DecoderBlock`, :class:`dew.nn.stack.LayerStack`); only the mask
policy differs: every token sees every other (``masks.full()``) unless
another policy is given (a sliding window, block-causal for block diffusion).
That is the encoder of BERT (Devlin et al., 2019) in pre-norm form, and the
backbone of masked-diffusion language models and JEPA predictors.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes, masks, models
from dew.nn.backbones.causal import ACTIVATION_AXES, BlockConfig, DecoderBlock
from dew.nn.norms import make_norm
from dew.nn.rope import RopeScaling
from dew.nn.shards import check_divides
from dew.nn.stack import LayerStack


@models.register("transformer")
class Transformer(nn.Module):
    """Encoder returning ``[batch, length, out_features]`` (float32).

    Attributes:
      emb_features: width of the residual stream.
      num_layers: transformer layers.
      num_heads: query heads.
      mlp_features: hidden width of the feed-forward block.
      max_seq_len: the longest sequence, in positions.
      vocab_size: token ids in; None = continuous inputs ``[batch, length,
        features]``, projected to ``emb_features`` by ``input_projection``.
      out_features: width of the output projection ``head``; None = ``vocab_size``
        for token inputs (logits) and no head for continuous inputs (the
        final-normed residual stream, ``emb_features`` wide).
      mask: which keys each query sees (:mod:`dew.nn.masks`); default
        ``masks.full()``, bidirectional.
      num_kv_heads: key/value heads; None = num_heads.
      head_dim: features per head; None = emb_features // num_heads.
      mlp_activation: 'swiglu', 'gelu', 'gelu_exact' or 'relu'.
      norm: 'rms' or 'layer'.
      norm_eps: epsilon of the norms.
      position_embedding: 'rope' or 'learned' (a ``[max_seq_len, embed]`` table).
      rope_theta: RoPE base.
      rope_scaling: optional :class:`RopeScaling`.
      use_qkv_bias: biases on the query/key/value projections.
      use_bias: biases on every dense layer.
      dtype: computation dtype; outputs are float32.
      param_dtype: parameter dtype.
      use_remat, remat_policy, use_scan, num_stages, pipeline_microbatches: the
        layer stack, as in :class:`CausalTransformer`.
      init_std: standard deviation of the normal weight initialiser; None =
        ``emb_features ** -0.5``.
    """

    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    vocab_size: int | None = None
    out_features: int | None = None
    mask: masks.MaskPolicy = masks.full()
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_activation: str = "swiglu"
    norm: str = "rms"
    norm_eps: float = 1e-6
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    use_qkv_bias: bool = False
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    use_remat: bool = False
    remat_policy: str | None = None
    use_scan: bool = True
    num_stages: int = 1
    pipeline_microbatches: int | None = None
    init_std: float | None = None

    config_decoders = {"rope_scaling": RopeScaling, "mask": masks.MaskPolicy}

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def weight_std(self) -> float:
        return self.init_std if self.init_std is not None else self.emb_features**-0.5

    @property
    def head_features(self) -> int | None:
        """Width of the output projection; None = no projection."""
        return self.out_features if self.out_features is not None else self.vocab_size

    def check(self) -> None:
        """Raise ``ValueError`` on an inconsistent configuration."""
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}"
            )
        if self.head_dim is None and self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features {self.emb_features} does not divide over num_heads "
                f"{self.num_heads}; set head_dim explicitly"
            )
        if self.position_embedding not in ("rope", "learned"):
            raise ValueError(
                f"unknown position_embedding {self.position_embedding!r}; use 'rope' or 'learned'"
            )

    def layer_stack(self) -> LayerStack:
        return LayerStack(
            num_layers=self.num_layers,
            use_scan=self.use_scan,
            use_remat=self.use_remat,
            remat_policy=self.remat_policy,
            num_stages=self.num_stages,
            num_microbatches=self.pipeline_microbatches,
        )

    def block_config(self) -> BlockConfig:
        return BlockConfig(
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim or self.emb_features // self.num_heads,
            mlp_features=self.mlp_features,
            mlp_activation=self.mlp_activation,
            norm=self.norm,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta if self.position_embedding == "rope" else None,
            rope_scaling=self.rope_scaling,
            mask=self.mask,
            use_qkv_bias=self.use_qkv_bias,
            use_bias=self.use_bias,
            init_std=self.weight_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )

    def _dense(self, features, in_axis, out_axis, name):
        return nn.Dense(
            features,
            use_bias=self.use_bias,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(self.weight_std), (in_axis, out_axis)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        query_key_mask: jax.Array | None = None,
    ) -> jax.Array:
        """``[batch, length, out]`` for token ids ``[batch, length]`` (with
        ``vocab_size``) or vectors ``[batch, length, features]`` (without).

        positions: ``[batch, length]`` (default 0..length-1).
        attention_mask: ``[batch, length]``, False marks padding: no token sees it.
        segment_ids: ``[batch, length]`` ids of sequences packed in a row.
        query_key_mask: boolean ``[batch, length, length]`` ANDed with ``mask``.
        """
        self.check()
        is_tokens = self.vocab_size is not None
        if inputs.ndim != (2 if is_tokens else 3):
            raise ValueError(
                f"Transformer inputs have shape {inputs.shape}; with vocab_size="
                f"{self.vocab_size} give "
                + (
                    "token ids [batch, length]"
                    if is_tokens
                    else "vectors [batch, length, features]"
                )
            )
        batch, length = inputs.shape[:2]
        check_divides(length, axes.LENGTH, "Transformer inputs [batch, length, ...]")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        valid = (
            jnp.ones((batch, length), jnp.bool_)
            if attention_mask is None
            else attention_mask.astype(jnp.bool_)
        )
        if is_tokens:
            embed = nn.Embed(
                self.vocab_size,
                self.emb_features,
                embedding_init=nn.with_logical_partitioning(
                    nn.initializers.normal(self.weight_std), (axes.VOCAB, axes.EMBED)
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="embed",
            )
            # gathered from a table split over vocab only, as CausalTransformer does
            table = nn.with_logical_constraint(embed.embedding, (axes.VOCAB, None))
            x = jnp.take(table, inputs, axis=0).astype(self.dtype)  # [batch, length, embed]
        else:
            x = self._dense(self.emb_features, None, axes.EMBED, "input_projection")(inputs)
        if self.position_embedding == "learned":
            table = self.param(
                "position_embed",
                nn.with_logical_partitioning(
                    nn.initializers.normal(self.weight_std), (None, axes.EMBED)
                ),
                (self.max_seq_len, self.emb_features),
                self.param_dtype,
            )
            x = x + jnp.take(table, positions, axis=0).astype(self.dtype)
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)

        x = self.layer_stack()(
            self,
            DecoderBlock,
            dict(config=self.block_config()),
            x,
            positions,
            valid,
            segment_ids,
            query_key_mask,
        )
        x = make_norm(self.norm, self.norm_eps, self.dtype, self.param_dtype, "final_norm")(x)
        if self.head_features is not None:
            out_axis = axes.VOCAB if self.head_features == self.vocab_size else None
            x = self._dense(self.head_features, axes.EMBED, out_axis, "head")(x)
        return x.astype(jnp.float32)  # [batch, length, out]

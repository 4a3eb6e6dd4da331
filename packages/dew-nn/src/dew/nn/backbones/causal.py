"""A modern decoder-only transformer: pre-norm, RoPE, SwiGLU, grouped-query attention.

One module covers Llama, Mistral (sliding window), Qwen2 (q/k/v biases) and
GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) through
its options, so Hugging Face checkpoints of those families load into it.

Its layers are :class:`DecoderBlock` run by a :class:`dew.nn.stack.LayerStack`
under the mask policy ``masks.causal(window=sliding_window)``; the
bidirectional :class:`dew.nn.Transformer` runs the same blocks and stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes, masks, models
from dew.nn.attention import Attention
from dew.nn.mlp import MLP
from dew.nn.moe import MoE
from dew.nn.norms import make_norm
from dew.nn.rope import RopeScaling
from dew.nn.shards import check_divides
from dew.nn.stack import LayerStack

ACTIVATION_AXES = (axes.BATCH, axes.LENGTH, axes.EMBED)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """What one transformer layer needs; derived from the backbone's options.

    mask: which keys a query sees (:mod:`dew.nn.masks`): causal for a decoder,
      full for an encoder.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_features: int
    mlp_activation: str
    norm: str
    norm_eps: float
    rope_theta: float | None
    rope_scaling: RopeScaling | None
    mask: masks.MaskPolicy
    use_qkv_bias: bool
    use_bias: bool
    init_std: float
    dtype: Any
    param_dtype: Any
    num_experts: int = 0
    experts_per_token: int = 2


class DecoderBlock(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (pre-norm); the attention
    sees what ``config.mask`` allows, so the same block serves decoders and encoders."""

    config: BlockConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x, positions, valid, segment_ids=None, query_key_mask=None):
        """``x [batch, length, embed] -> [batch, length, embed]``; the rest as
        :class:`dew.nn.Attention` takes them."""
        c = self.config
        h = make_norm(c.norm, c.norm_eps, c.dtype, c.param_dtype, "attention_norm")(x)
        h = Attention(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            mask=c.mask,
            use_qkv_bias=c.use_qkv_bias or c.use_bias,
            use_out_bias=c.use_bias,
            init_std=c.init_std,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="attention",
        )(
            h,
            positions,
            valid,
            segment_ids=segment_ids,
            query_key_mask=query_key_mask,
            decode=self.decode,
        )
        x = x + h
        h = make_norm(c.norm, c.norm_eps, c.dtype, c.param_dtype, "mlp_norm")(x)
        shared = dict(
            features=c.mlp_features,
            activation=c.mlp_activation,
            init_std=c.init_std,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="mlp",
        )
        if c.num_experts:
            mlp = MoE(num_experts=c.num_experts, experts_per_token=c.experts_per_token, **shared)
        else:
            mlp = MLP(use_bias=c.use_bias, **shared)
        h = mlp(h)
        return nn.with_logical_constraint(x + h, ACTIVATION_AXES)


@models.register("causal_transformer")
class CausalTransformer(nn.Module):
    """Decoder-only transformer returning logits ``[batch, length, vocab]``.

    Attributes:
      vocab_size: number of token ids.
      emb_features: width of the residual stream.
      num_layers: decoder layers.
      num_heads: query heads.
      mlp_features: hidden width of the feed-forward block.
      max_seq_len: the longest sequence (prompt + generated tokens) in positions.
      num_kv_heads: key/value heads (grouped-query attention); None = num_heads.
      head_dim: features per head; None = emb_features // num_heads.
      mlp_activation: 'swiglu' (gated SiLU), 'gelu' (tanh approx.), 'gelu_exact', 'relu'.
      norm: 'rms' (RMSNorm) or 'layer' (LayerNorm with bias).
      norm_eps: epsilon of the norms.
      position_embedding: 'rope' or 'learned' (a [max_seq_len, embed] table, GPT-2).
      rope_theta: RoPE base.
      rope_scaling: optional :class:`RopeScaling` ('linear' or 'llama3').
      sliding_window: attend to at most this many positions back (Mistral); None = all.
      use_qkv_bias: biases on the query/key/value projections (Qwen2).
      use_bias: biases on every dense layer (GPT-2).
      tie_embeddings: the output projection is the transposed token embedding.
      dtype: computation dtype; logits are returned in float32.
      param_dtype: parameter dtype.
      use_remat: recompute each layer's activations in the backward pass.
      remat_policy: with ``use_remat``, a ``jax.checkpoint_policies`` name saying
        what to keep (:class:`dew.nn.stack.LayerStack`); None = nothing.
      use_scan: one scanned layer with a leading 'layers' axis (fast compiles).
      init_std: standard deviation of the normal weight initialiser; None =
        ``emb_features ** -0.5`` (0.125 at width 64, 0.016 at 4096).
      num_experts: experts of a mixture-of-experts feed-forward block in every
        layer (:class:`dew.nn.moe.MoE`: dropless top-k routing, a
        load-balancing loss sown as ``intermediates/.../aux_loss``); 0 = the
        dense MLP.
      experts_per_token: experts each token is routed to (k); read only when
        ``num_experts > 0``.
      num_stages: pipeline stages of the layer stack (:mod:`dew.nn.pipeline`,
        a GPipe schedule); 1 = no pipeline. Needs ``use_scan`` and
        ``num_layers`` a multiple of it; the trainer's ``stage`` mesh axis
        should equal it. Decoding (``decode=True``) runs the plain stack.
      pipeline_microbatches: microbatches the batch is cut into for the
        pipeline; None = ``num_stages``. More microbatches, a smaller bubble
        (``(stages - 1) / (microbatches + stages - 1)`` of the time idle).
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_activation: str = "swiglu"
    norm: str = "rms"
    norm_eps: float = 1e-6
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    use_qkv_bias: bool = False
    use_bias: bool = False
    tie_embeddings: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    use_remat: bool = False
    remat_policy: str | None = None
    use_scan: bool = True
    init_std: float | None = None
    num_experts: int = 0
    experts_per_token: int = 2
    num_stages: int = 1
    pipeline_microbatches: int | None = None

    config_decoders = {"rope_scaling": RopeScaling}

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

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
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0 = dense MLP), got {self.num_experts}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be between 1 and "
                f"num_experts {self.num_experts}"
            )
        self.layer_stack()

    def layer_stack(self) -> LayerStack:
        """The layer stack (validated when built)."""
        return LayerStack(
            num_layers=self.num_layers,
            use_scan=self.use_scan,
            use_remat=self.use_remat,
            remat_policy=self.remat_policy,
            num_stages=self.num_stages,
            num_microbatches=self.pipeline_microbatches,
        )

    @property
    def microbatches(self) -> int:
        return self.pipeline_microbatches or self.num_stages

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
            mask=masks.causal(window=self.sliding_window),
            use_qkv_bias=self.use_qkv_bias,
            use_bias=self.use_bias,
            init_std=self.weight_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
        )

    @property
    def weight_std(self) -> float:
        return self.init_std if self.init_std is not None else self.emb_features**-0.5

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        query_key_mask: jax.Array | None = None,
        decode: bool = False,
    ) -> jax.Array:
        """Logits ``[batch, length, vocab]`` (float32) for ``tokens [batch, length]``.

        positions: ``[batch, length]`` position of each token (default 0..length-1);
          give them when rows are left-padded or when decoding.
        attention_mask: ``[batch, length]``, False marks padding (default all True).
        segment_ids: ``[batch, length]`` ids of sequences packed in a row; a token
          attends within its own segment only (give ``positions`` restarting at 0
          per segment). Not with ``decode``.
        query_key_mask: boolean ``[batch, length, keys]`` ANDed with the causal mask
          (``keys`` = ``length``, or the cache length when decoding).
        decode: read and append to the ``cache`` collection (see :class:`Attention`).
        """
        self.check()
        batch, length = tokens.shape
        if not decode:
            check_divides(length, axes.LENGTH, "CausalTransformer tokens [batch, length]")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        valid = (
            jnp.ones((batch, length), jnp.bool_)
            if attention_mask is None
            else attention_mask.astype(jnp.bool_)
        )
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
        # Look rows up in a table gathered whole along embed (split only over
        # vocab): a gather from an embed-split table leaves its output split
        # along embed, which the partitioner cannot turn into a batch split.
        table = nn.with_logical_constraint(embed.embedding, (axes.VOCAB, None))
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)  # [batch, length, embed]
        if self.position_embedding == "learned":
            table = self.param(
                "position_embed",
                nn.with_logical_partitioning(
                    nn.initializers.normal(self.weight_std), (None, axes.EMBED)
                ),
                (self.max_seq_len, self.emb_features),
                self.param_dtype,
            )
            # Gathered from a whole table, as the token embedding: a gather from
            # an embed-split table leaves its output split along embed (and XLA
            # rematerializes it in full under fsdp).
            table = nn.with_logical_constraint(table, (None, None))
            x = x + jnp.take(table, positions, axis=0).astype(self.dtype)
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)

        x = self.layer_stack()(
            self,
            DecoderBlock,
            dict(config=self.block_config(), decode=decode),
            x,
            positions,
            valid,
            segment_ids,
            query_key_mask,
            use_pipeline=not decode,
        )
        x = make_norm(self.norm, self.norm_eps, self.dtype, self.param_dtype, "final_norm")(x)
        if self.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(
                self.vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(self.weight_std), (axes.EMBED, axes.VOCAB)
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="lm_head",
            )(x)
        return logits.astype(jnp.float32)  # [batch, length, vocab]

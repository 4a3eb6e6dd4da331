"""A modern decoder-only transformer: pre-norm, RoPE, SwiGLU, grouped-query attention.

One module covers Llama, Mistral (sliding window), Qwen2 (q/k/v biases) and
GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) through
its options, so Hugging Face checkpoints of those families load into it.

Its layers are :class:`~dew.nn.backbones.block.DecoderBlock` (the one block
module, :mod:`dew.nn.backbones.block`) run by a :class:`dew.nn.stack.LayerStack`
under the mask policy ``masks.causal(window=sliding_window)``; the
bidirectional :class:`dew.nn.Transformer` runs the same blocks and stack.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes, masks, models
from dew.nn._moe_dispatch import DISPATCHES
from dew.nn.backbones._options import (
    ACTIVATION_AXES,  # noqa: F401 (re-exported: dew.nn.backbones.causal.ACTIVATION_AXES)
    BlockConfig,
    TransformerOptions,
    positions_and_valid,
)
from dew.nn.backbones.block import DecoderBlock
from dew.nn.dense import token_rows
from dew.nn.keywords import is_real_number, is_whole_number
from dew.nn.shards import check_divides
from dew.nn.stack import LayerStack
from dew.nn.token_scores import TokenScores, chunked_scores, scores_of_logits


@models.register("causal_transformer")
class CausalTransformer(TransformerOptions, kw_only=True):
    """Decoder-only transformer returning logits ``[batch, length, vocab]``.

    Attributes:
      vocab_size: number of token ids.
      sliding_window: attend to at most this many positions back (Mistral); None = all.
      tie_embeddings: the output projection is the transposed token embedding.
      num_experts: experts of a mixture-of-experts feed-forward block in every
        layer (:class:`dew.nn.moe.MoE`: dropless top-k routing, a
        load-balancing loss sown as ``intermediates/.../aux_loss``); 0 = the
        dense MLP.
      experts_per_token: experts each token is routed to (k); read only when
        ``num_experts > 0``.
      moe_dispatch: how tokens reach their experts: 'dense' (every expert on
        every token, the reference), 'capacity', 'ragged' or 'auto'
        (:class:`dew.nn.moe.MoE`; docs/moe.md); the same parameters for all.
      moe_capacity_factor: None = dropless; a number > 0 = each expert's slots
        as ``ceil(factor * tokens * k / num_experts)``, the rest dropped.
      moe_gating: 'softmax_topk' (softmax, then the k largest) or 'topk_softmax'
        (the softmax of the k largest logits).
      moe_norm_topk_prob: renormalise the k ``softmax_topk`` weights to sum 1
        (Mixtral, Qwen3-MoE: True; Qwen2-MoE: False); None = when k > 1.
      moe_shared_features: width of a shared expert every token also goes
        through (Qwen2-MoE, DeepSeek-MoE); 0 = none.
      moe_shared_gate: scale the shared expert by a learned per-token
        ``sigmoid(x w)`` (Qwen2-MoE); False adds it ungated.
      moe_router_z_loss_weight: the router z-loss (ST-MoE), ``mean_t
        logsumexp(router_logits_t)^2`` per row, added to each MoE layer's sown
        ``aux_loss`` with this weight relative to the load-balancing loss, so
        ``LMObjective`` trains on ``aux_loss_weight * (balance + weight * z)``;
        0 = not trained on (still logged as ``moe_z_loss``). ST-MoE's 1e-3 is
        0.1 here with ``LMObjective(aux_loss_weight=0.01)``. A training setting:
        Hugging Face configs have no field for it, so set it after loading
        (``pre.model.clone(moe_router_z_loss_weight=0.1)``).
      qk_norm: an RMSNorm (epsilon ``norm_eps``) over each head's queries and
        keys before the rotary embedding (Qwen3, Qwen3-MoE).
      moe_layers: the layers (0-based, ascending) whose feed-forward block is
        the MoE, the others a dense MLP of width ``dense_mlp_features``
        (Qwen2/3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``,
        DeepSeek-MoE's first dense layers); None = every layer. A stack that
        mixes both runs its layers unrolled (``layer_{i}`` parameters, no scan,
        no pipeline): they differ.
      dense_mlp_features: the hidden width of the dense layers' MLP when
        ``moe_layers`` leaves some out; None = ``mlp_features``.

    The rest (widths, heads, norms, positions, dtypes, the layer stack) are
    :class:`~dew.nn.backbones._options.TransformerOptions`' fields; decoding
    (``decode=True``) runs the plain stack even when ``num_stages > 1``.
    Every field is keyword-only.
    """

    vocab_size: int
    sliding_window: int | None = None
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 2
    moe_dispatch: str = "dense"
    moe_capacity_factor: float | None = None
    moe_gating: str = "softmax_topk"
    moe_norm_topk_prob: bool | None = None
    moe_shared_features: int = 0
    moe_shared_gate: bool = True
    moe_router_z_loss_weight: float = 0.0
    qk_norm: bool = False
    moe_layers: tuple[int, ...] | None = None
    dense_mlp_features: int | None = None

    EXTRA_POSITIVE = ("vocab_size",)
    EXTRA_OPTIONAL = ("sliding_window", "dense_mlp_features")
    EXTRA_NON_NEGATIVE = ("num_experts", "moe_shared_features")

    @property
    def mask(self) -> masks.MaskPolicy:
        """Causal, within ``sliding_window`` positions when one is set."""
        return masks.causal(window=self.sliding_window)

    def __post_init__(self):
        if self.moe_layers is not None and not isinstance(self.moe_layers, tuple):
            # a list from a saved (JSON) config, a range: a tuple (hashable, compares equal)
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        super().__post_init__()

    def check(self) -> None:
        super().check()
        if not self.num_experts:
            return
        if self.moe_dispatch not in DISPATCHES:
            raise ValueError(f"unknown moe_dispatch {self.moe_dispatch!r}; use one of {DISPATCHES}")
        factor = self.moe_capacity_factor
        if factor is not None and not factor > 0:
            raise ValueError(
                f"moe_capacity_factor must be > 0 (slots per expert as a multiple of the "
                f"balanced load) or None for dropless routing, got {factor}"
            )
        weight = self.moe_router_z_loss_weight
        if not is_real_number(weight) or not 0 <= weight:
            raise ValueError(
                f"moe_router_z_loss_weight must be a finite number >= 0 (the router "
                f"z-loss's weight relative to the load-balancing loss; 0 = off), got {weight!r}"
            )

    @property
    def is_mixed(self) -> bool:
        """Whether some layers run the MoE and others a dense MLP (``moe_layers``)."""
        return (
            bool(self.num_experts)
            and self.moe_layers is not None
            and (tuple(self.moe_layers) != tuple(range(self.num_layers)))
        )

    def layer_stack(self) -> LayerStack:
        """The stack; unrolled (``layer_{i}``) when the layers mix MoE and dense blocks."""
        stack = super().layer_stack()
        layers = self.moe_layers
        if layers is None:
            return stack
        if not self.num_experts:
            raise ValueError(
                f"moe_layers={list(layers)} lists expert layers but num_experts is 0; set "
                "num_experts or leave moe_layers None"
            )
        wrong = [i for i in layers if not is_whole_number(i) or not 0 <= i < self.num_layers]
        if wrong or not layers or list(layers) != sorted(set(layers)):
            raise ValueError(
                f"moe_layers={list(layers)} must be distinct layer indices in 0..."
                f"{self.num_layers - 1}, ascending, at least one (out of range or repeated: "
                f"{wrong or 'none'}); use None for experts in every layer, or num_experts=0 "
                "for none"
            )
        if not self.is_mixed:
            return stack
        if self.num_stages > 1:
            raise ValueError(
                f"num_stages {self.num_stages} (a pipeline) needs every layer alike, but "
                f"moe_layers={list(layers)} mixes MoE and dense layers; use num_stages=1 or "
                "experts in every layer"
            )
        return dataclasses.replace(stack, use_scan=False, unroll=1)

    def layer_configs(self) -> list[BlockConfig]:
        """Each layer's :class:`BlockConfig` (all the same unless ``is_mixed``)."""
        config = self.block_config()
        if not self.is_mixed:
            return [config] * self.num_layers
        dense = dataclasses.replace(
            config, num_experts=0, mlp_features=self.dense_mlp_features or self.mlp_features
        )
        return [config if i in self.moe_layers else dense for i in range(self.num_layers)]

    def block_config(self) -> BlockConfig:
        return dataclasses.replace(
            super().block_config(),
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            moe_dispatch=self.moe_dispatch,
            moe_capacity_factor=self.moe_capacity_factor,
            moe_gating=self.moe_gating,
            moe_norm_topk_prob=self.moe_norm_topk_prob,
            moe_shared_features=self.moe_shared_features,
            moe_shared_gate=self.moe_shared_gate,
            moe_router_z_loss_weight=self.moe_router_z_loss_weight,
            qk_norm=self.qk_norm,
        )

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
        return_hidden: bool = False,
        targets: jax.Array | None = None,
        logits_chunk_size: int | None = None,
        temperature: float = 1.0,
    ) -> jax.Array | TokenScores | tuple[jax.Array | TokenScores, jax.Array]:
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
        return_hidden: also return the final hidden states (after the output norm,
          what the output projection reads): ``(logits, hidden [batch, length, embed])``,
          for a value head on the trunk (:class:`dew.nn.value.ValueHead`).
        targets: ``[batch, length]`` ids; given, the result is their
          :class:`~dew.nn.token_scores.TokenScores` (``log_probs``, ``logsumexp``,
          ``is_argmax``, each ``[batch, length]``) instead of the logits.
        logits_chunk_size: with ``targets``, project this many positions of every
          row at a time (:func:`dew.nn.token_scores.chunked_scores`), so the
          ``[batch, length, vocab]`` float32 logits are never held whole, in the
          forward or the backward pass; None = the whole logits at once.
        temperature: with ``targets``, score under ``softmax(logits / temperature)``.
        """
        batch, length = tokens.shape
        if not decode:
            check_divides(length, axes.LENGTH, "CausalTransformer tokens [batch, length]")
        given = positions
        positions, valid = positions_and_valid(batch, length, positions, attention_mask)
        embed, x = self.embed_tokens(self.vocab_size, tokens)  # [batch, length, embed]
        x = self.add_positions(x, given, length=length)
        stack = self.layer_stack()
        # one mask for every layer (a constant when nothing varies per batch); not
        # for decoding, which masks against the cache, nor for a pipeline, which
        # cuts every layer argument into microbatches
        visible = None
        if not decode and stack.num_stages == 1:
            visible = self.visible_mask(
                length,
                positions,
                valid,
                segment_ids,
                query_key_mask,
                is_default=given is None
                and attention_mask is None
                and segment_ids is None
                and query_key_mask is None,
            )

        x = stack(
            self,
            DecoderBlock,
            [dict(config=c, decode=decode) for c in self.layer_configs()]
            if self.is_mixed
            else dict(config=self.block_config(), decode=decode),
            x,
            positions,
            valid,
            segment_ids,
            query_key_mask,
            visible,
            use_pipeline=not decode,
        )
        x = self.norm_output(x)
        if targets is not None and logits_chunk_size is not None:
            scores = chunked_scores(
                self,
                lambda mdl, rows: mdl.project(embed, rows),
                x,
                targets,
                chunk_size=logits_chunk_size,
                temperature=temperature,
            )
            return (scores, x) if return_hidden else scores
        rows = token_rows(x)  # [batch * length, embed]: one token axis (dew.nn.dense)
        logits = self.project(embed, rows)
        logits = logits.reshape(batch, length, -1).astype(jnp.float32)  # [batch, length, vocab]
        # split as the residual stream was before the flattening (batch, and length
        # under a sequence mesh axis), which the reshape back does not carry
        logits = nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.VOCAB))
        if targets is not None:
            logits = scores_of_logits(logits, targets, temperature=temperature)
        return (logits, x) if return_hidden else logits

    def project(self, embed: nn.Embed, rows: jax.Array) -> jax.Array:
        """The output projection of ``rows [tokens, embed]``: ``[tokens, vocab]`` logits
        in ``dtype``, through ``lm_head`` or the tied ``embed``; call from ``__call__``."""
        if self.tie_embeddings:
            return embed.attend(rows)
        return nn.Dense(
            self.vocab_size,
            use_bias=False,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(self.weight_std), (axes.EMBED, axes.VOCAB)
            ),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="lm_head",
        )(rows)

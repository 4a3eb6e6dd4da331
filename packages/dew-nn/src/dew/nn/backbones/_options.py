"""The one options vocabulary of every transformer backbone.

Field groups a backbone subclasses (Flax modules are dataclasses, so the
fields stay flat keywords of the backbone: ``ViT(emb_features=..., num_layers=...)``,
``models.build(name, **config)`` and saved configs read as before):

- :class:`StackOptions`: how the layers run (:class:`dew.nn.stack.LayerStack`);
- :class:`BlockOptions`: what each block reads (widths, heads, the feed-forward
  block, ``norm_eps``, q/k/v biases, initialisation, dtypes);
- :class:`PreNormOptions`: ``norm`` and ``use_bias`` of the pre-norm blocks;
- :class:`BackboneOptions`: the stack and block groups together, validated by one
  :meth:`BackboneOptions.check` when the backbone is built (``__post_init__``),
  so a bad configuration raises at ``models.build`` or the constructor, before
  anything is traced or compiled (:func:`check_counts` checks the counts).

A family declares its own fields on top and gives a shared field its own
default by declaring it again (ViT's ``mlp_activation='gelu_exact'``, DiT's
``use_qkv_bias=True``): one table of them is in docs/models.md.
:class:`TransformerOptions` is the token backbones' family
(:class:`dew.nn.CausalTransformer`, :class:`dew.nn.Transformer`): positions, the
input embeddings and the final norm. :class:`BlockConfig` is what one layer
needs, derived from the options (``block_config()``) and read by the blocks of
:mod:`dew.nn.backbones.block`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import axes, masks
from dew.nn._moe_dispatch import GATINGS
from dew.nn.fused_attention import check_kernel_options
from dew.nn.keywords import is_whole_number
from dew.nn.mlp import ACTIVATIONS
from dew.nn.norms import NORMS, make_norm
from dew.nn.rope import RopeScaling
from dew.nn.stack import LayerStack

ACTIVATION_AXES = (axes.BATCH, axes.LENGTH, axes.EMBED)

# Scanned stacks this deep or shallower compile with the loop unrolled: at the
# seed size (2 layers) the scanned step took 1.16x the CPU time of the same
# scan unrolled (tools/bench_model.py, docs/performance.md).
UNROLL_UP_TO = 4


# What each count is, for the message of check_counts.
COUNT_MEANINGS = {
    "emb_features": "the width of the residual stream",
    "num_layers": "transformer layers",
    "num_heads": "attention heads",
    "num_kv_heads": "key/value heads; None = num_heads",
    "head_dim": "features per head; None = emb_features // num_heads",
    "mlp_features": "the hidden width of the feed-forward block",
    "max_seq_len": "the longest sequence, in positions",
    "vocab_size": "token ids",
    "out_features": "the output width; None = vocab_size",
    "sliding_window": "positions a query sees back; None = all",
    "num_experts": "mixture-of-experts experts; 0 = a dense MLP",
    "moe_shared_features": "the width of the shared expert; 0 = none",
    "num_stages": "pipeline stages; 1 = no pipeline",
    "pipeline_microbatches": "microbatches of the pipeline; None = num_stages",
    "pipeline_repeats": "rounds of the circular pipeline schedule; 1 = GPipe",
    "encoder_features": "the encoder's feature width",
    "attention_block_size": "splash attention's block, a multiple of 128; None = chosen",
    "image_size": "pixels along a side of an image",
    "patch_size": "pixels along a side of a patch",
    "num_channels": "channels of a pixel",
    "in_channels": "channels of the input",
    "num_frames": "frames of a video; None = images",
    "tubelet_size": "frames per tubelet",
    "num_classes": "class labels; 0 = no label table",
    "context_features": "width of the text context; 0 = no cross-attention",
    "time_features": "features of the timestep embedding",
}


def check_counts(
    module: Any,
    *,
    positive: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
) -> None:
    """Raise ``ValueError`` naming every count field of ``module`` that is not a
    whole number in range, with its value and meaning: ``positive`` fields must
    be >= 1, ``optional`` ones >= 1 or None, ``non_negative`` ones >= 0. A zero
    width or head count would otherwise surface while tracing as a division by
    zero or an ``IndexError`` from inside JAX."""
    rules = (
        [(name, 1, False) for name in positive]
        + [(name, 1, True) for name in optional]
        + [(name, 0, False) for name in non_negative]
    )
    problems = []
    for name, minimum, may_be_none in rules:
        value = getattr(module, name)
        if (value is None and may_be_none) or (is_whole_number(value) and value >= minimum):
            continue
        # a backbone's own meaning of a shared name (a class attribute COUNT_MEANINGS)
        meaning = {**COUNT_MEANINGS, **getattr(type(module), "COUNT_MEANINGS", {})}.get(name)
        allowed = f"a whole number >= {minimum}" + (" or None" if may_be_none else "")
        what = f" ({meaning})" if meaning else ""
        problems.append((name, f"{name}={value!r}{what} must be {allowed}"))
    if problems:
        raise ValueError(
            f"{type(module).__name__} got an invalid count: {'; '.join(p for _, p in problems)}"
            f". Set {', '.join(n for n, _ in problems)} in range and build it again"
        )


def check_layer_kinds(module: Any) -> None:
    """Raise ``ValueError`` unless ``module``'s ``mlp_activation`` (and ``norm``, when
    it has one) name a known kind, listing the known ones."""
    owner = type(module).__name__
    norm = getattr(module, "norm", None)
    if norm is not None and norm not in NORMS:
        raise ValueError(f"{owner} has unknown norm {norm!r}; use one of {NORMS}")
    if module.mlp_activation not in ACTIVATIONS:
        raise ValueError(
            f"{owner} has unknown mlp_activation {module.mlp_activation!r}; use one of "
            f"{ACTIVATIONS}"
        )


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """What one transformer layer needs; derived from the backbone's options.

    mask: which keys a query sees (:mod:`dew.nn.masks`): causal for a decoder,
      full for an encoder.
    num_experts: experts of a mixture-of-experts feed-forward block; 0 = the
      dense MLP.
    experts_per_token: experts each token is routed to; read only when
      ``num_experts > 0``.
    moe_dispatch, moe_capacity_factor: :class:`dew.nn.moe.MoE`'s ``dispatch``
      and ``capacity_factor``.
    moe_gating, moe_norm_topk_prob, moe_shared_features, moe_shared_gate:
      :class:`dew.nn.moe.MoE`'s ``gating``, ``norm_topk_prob``,
      ``shared_features`` and ``shared_expert_gate``.
    moe_router_z_loss_weight: :class:`dew.nn.moe.MoE`'s ``router_z_loss_weight``.
    qk_norm: an RMSNorm over each head's queries and keys (:class:`dew.nn.Attention`).
    attention_kernel, attention_block_size: :class:`dew.nn.Attention`'s ``kernel``
      and ``kernel_block_size`` (:mod:`dew.nn.fused_attention`).
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
    moe_dispatch: str = "dense"
    moe_capacity_factor: float | None = None
    moe_gating: str = "softmax_topk"
    moe_norm_topk_prob: bool | None = None
    moe_shared_features: int = 0
    moe_shared_gate: bool = True
    moe_router_z_loss_weight: float = 0.0
    qk_norm: bool = False
    attention_kernel: str = "auto"
    attention_block_size: int | None = None

    def __post_init__(self):
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0 = dense MLP), got {self.num_experts}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be between 1 and "
                f"num_experts {self.num_experts}"
            )
        if self.num_experts and self.moe_gating not in GATINGS:
            raise ValueError(f"unknown moe_gating {self.moe_gating!r}; use one of {GATINGS}")


class StackOptions(nn.Module, kw_only=True):
    """How a backbone's layers run: the options of its :class:`dew.nn.stack.LayerStack`,
    shared by every transformer backbone (a field group: a backbone subclasses it).

    Attributes:
      num_layers: transformer layers (blocks; :class:`dew.nn.VideoDiT`: spatial +
        temporal pairs).
      use_scan: one scanned layer with a leading ``layers`` parameter axis (one
        compile whatever the depth); False = a Python loop (``layer_0/...``).
      use_remat: recompute each layer's activations in the backward pass.
      remat_policy: what each layer keeps for the backward pass, by name
        (:data:`dew.nn.stack.REMAT_POLICIES`, MaxText's names: 'none', 'full',
        'minimal', 'save_dot_except_mlp', 'save_qkv_proj', ...; or a
        ``jax.checkpoint_policies`` name); a name other than 'none' turns remat
        on. None = ``use_remat`` decides ('full' or 'none').
      num_stages: pipeline stages of the layer stack (:mod:`dew.nn.pipeline`,
        a GPipe schedule); 1 = no pipeline. Needs ``use_scan`` and
        ``num_layers`` a multiple of it; the trainer's ``stage`` mesh axis
        should equal it.
      pipeline_microbatches: microbatches the batch is cut into for the
        pipeline; None = ``num_stages``. More microbatches, a smaller bubble
        (``(stages - 1) / (microbatches + stages - 1)`` of the time idle).
      pipeline_repeats: 1 = the GPipe schedule; ``R > 1`` = the circular one
        (MaxText's ``num_pipeline_repeats``): each stage holds ``R`` chunks of
        ``num_layers / (num_stages R)`` layers and every microbatch goes round
        the stages ``R`` times, a bubble of ``(stages - 1) / (microbatches R +
        stages - 1)``. Needs ``num_layers`` a multiple of ``num_stages R`` and
        at least ``num_stages`` microbatches; the same parameters either way.
      unroll_layers: how a scanned stack (``use_scan``) runs, with the same
        ``[layers, ...]`` parameters either way: True = one straight program,
        layer after layer (on a TPU as fast as a Python loop of blocks, but its
        compile takes minutes: over 330 s to the first step of the 12-layer GPT-2
        of docs/performance.md on a v5e, against 47 s); False = one compiled loop
        over the layers (the shortest compile; on a TPU it writes each layer's
        residuals and gradients into stacked buffers: 1.29x the step time of that
        GPT-2 without remat); None = the compiled loop, unrolled for stacks of at
        most ``UNROLL_UP_TO`` layers (4 for the causal transformer).
    """

    num_layers: int
    use_scan: bool = True
    use_remat: bool = False
    remat_policy: str | None = None
    num_stages: int = 1
    pipeline_microbatches: int | None = None
    pipeline_repeats: int = 1
    unroll_layers: bool | None = None

    # A scanned stack this deep or shallower compiles unrolled (class attribute,
    # not a field): 0 = never (a backbone's own choice, kept as it was).
    UNROLL_UP_TO = 0
    STACK_POSITIVE = ("num_layers", "num_stages", "pipeline_repeats")
    STACK_OPTIONAL = ("pipeline_microbatches",)

    @property
    def microbatches(self) -> int:
        return self.pipeline_microbatches or self.num_stages

    def layer_stack(self) -> LayerStack:
        """The layer stack (validated when built). A scanned stack of at most
        ``UNROLL_UP_TO`` layers compiles unrolled (same parameters): its loop's
        per-layer weight slicing and gradient stacking cost more than they save
        (docs/performance.md)."""
        straight = bool(self.unroll_layers)
        shallow = self.num_layers <= self.UNROLL_UP_TO
        unrolled = straight or (self.unroll_layers is None and shallow)
        return LayerStack(
            num_layers=self.num_layers,
            unroll=self.num_layers if unrolled else 1,
            straight=straight,
            use_scan=self.use_scan,
            use_remat=self.use_remat,
            remat_policy=self.remat_policy,
            num_stages=self.num_stages,
            num_microbatches=self.pipeline_microbatches,
            num_repeats=self.pipeline_repeats,
        )


def layer_stack_of(module: Any) -> LayerStack | None:
    """The :class:`~dew.nn.stack.LayerStack` of a Dew backbone (a
    :class:`StackOptions` module, a LoRA-wrapped one included), None for any other
    module (one without a stack of layers, or not built on ``StackOptions``)."""
    return module.layer_stack() if isinstance(module, StackOptions) else None


class BlockOptions(nn.Module, kw_only=True):
    """What every transformer block reads: widths, heads, the feed-forward block,
    norm epsilon, biases of q/k/v, initialisation and dtypes, shared by every
    transformer backbone (a field group: a backbone subclasses it, and may give
    a field its own default by declaring it again).

    Attributes:
      emb_features: width of the residual stream.
      num_heads: query heads.
      mlp_features: hidden width of the feed-forward block.
      num_kv_heads: key/value heads (grouped-query attention); None = num_heads.
      head_dim: features per head; None = emb_features // num_heads.
      mlp_activation: a name of :data:`dew.nn.mlp.ACTIVATION_FNS`: 'swiglu'
        (gated SiLU), 'gelu' (tanh approx.), 'gelu_exact' (erf), 'relu'.
      norm_eps: epsilon of the norms.
      use_qkv_bias: biases on the query/key/value projections (Qwen2, DiT).
      init_std: standard deviation of the normal weight initialiser; None =
        ``emb_features ** -0.5`` (0.125 at width 64, 0.016 at 4096).
      dtype: computation dtype; outputs are returned in float32.
      param_dtype: parameter dtype.
      attention_kernel: which attention kernel the self-attention runs
        (:mod:`dew.nn.fused_attention`): 'auto' (splash on a TPU, cuDNN on a GPU,
        XLA on the CPU, where that kernel serves the mask; XLA otherwise), 'xla',
        'splash' or 'cudnn' (an error names the mask when it cannot serve it).
      attention_block_size: splash's query and key block size, a multiple of 128;
        None = the largest of 512, 256, 128 that divides the sequence.
    """

    emb_features: int
    num_heads: int
    mlp_features: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_activation: str = "swiglu"
    norm_eps: float = 1e-6
    use_qkv_bias: bool = False
    init_std: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention_kernel: str = "auto"
    attention_block_size: int | None = None

    BLOCK_POSITIVE = ("emb_features", "num_heads", "mlp_features")
    BLOCK_OPTIONAL = ("num_kv_heads", "head_dim", "attention_block_size")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def features_per_head(self) -> int:
        return self.head_dim or self.emb_features // self.num_heads

    @property
    def weight_std(self) -> float:
        return self.init_std if self.init_std is not None else self.emb_features**-0.5

    def block_config(self) -> BlockConfig:
        """One layer's configuration (validated when built), without a position
        rotation, under a full mask, with biased attention-output and MLP
        projections (as adaLN-Zero's DiT block has them)."""
        return BlockConfig(
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.features_per_head,
            mlp_features=self.mlp_features,
            mlp_activation=self.mlp_activation,
            norm="layer",
            norm_eps=self.norm_eps,
            rope_theta=None,
            rope_scaling=None,
            mask=masks.full(),
            use_qkv_bias=self.use_qkv_bias,
            use_bias=True,
            init_std=self.weight_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention_kernel=self.attention_kernel,
            attention_block_size=self.attention_block_size,
        )


class PreNormOptions(BlockOptions, kw_only=True):
    """:class:`BlockOptions` of a pre-norm block (``x + f(norm(x))``), whose norms
    learn their own scale (and bias): every backbone but the adaLN-Zero
    :class:`dew.nn.DiT`, whose norms take both from the conditioning.

    Attributes:
      norm: 'rms' (RMSNorm) or 'layer' (LayerNorm with bias).
      use_bias: biases on every dense layer, the query/key/value projections
        included (GPT-2, ViT).
    """

    norm: str = "rms"
    use_bias: bool = False

    def block_config(self) -> BlockConfig:
        return dataclasses.replace(
            super().block_config(),
            norm=self.norm,
            use_qkv_bias=self.use_qkv_bias or self.use_bias,
            use_bias=self.use_bias,
        )


class BackboneOptions(StackOptions, BlockOptions, kw_only=True):
    """The options every transformer backbone shares, validated by one :meth:`check`
    when the backbone is built (``__post_init__``), before anything is traced.

    A backbone subclasses it (or :class:`PreNormOptions` with it), adds its own
    fields and count names (``EXTRA_POSITIVE``, ``EXTRA_OPTIONAL``,
    ``EXTRA_NON_NEGATIVE``: class attributes, not fields) and extends ``check``.
    """

    # a family's (max_seq_len, patch_size, ...) and a backbone's own (vocab_size,
    # ...) count fields, checked with the shared ones (class attributes, not
    # annotated: not dataclass fields)
    FAMILY_POSITIVE = ()
    FAMILY_OPTIONAL = ()
    FAMILY_NON_NEGATIVE = ()
    EXTRA_POSITIVE = ()
    EXTRA_OPTIONAL = ()
    EXTRA_NON_NEGATIVE = ()

    def __post_init__(self):
        self.check()  # before Flax registers the module: a bad config never builds
        super().__post_init__()

    def check(self) -> None:
        """Raise ``ValueError`` on an inconsistent configuration (run when the
        module is built): every count in range (one message naming them all),
        the heads dividing, a known activation and norm, a valid layer stack."""
        cls = type(self)
        check_counts(
            self,
            positive=(
                *self.BLOCK_POSITIVE,
                *self.STACK_POSITIVE,
                *cls.FAMILY_POSITIVE,
                *cls.EXTRA_POSITIVE,
            ),
            optional=(
                *self.BLOCK_OPTIONAL,
                *self.STACK_OPTIONAL,
                *cls.FAMILY_OPTIONAL,
                *cls.EXTRA_OPTIONAL,
            ),
            non_negative=(*cls.FAMILY_NON_NEGATIVE, *cls.EXTRA_NON_NEGATIVE),
        )
        owner = cls.__name__
        if self.num_heads % self.kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(
                f"{owner} num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.kv_heads} (each key/value head serves a whole group of query heads); "
                f"use num_kv_heads in {divisors}"
            )
        if self.head_dim is None and self.emb_features % self.num_heads:
            raise ValueError(
                f"{owner} emb_features {self.emb_features} does not divide over num_heads "
                f"{self.num_heads}; use a multiple of num_heads or set head_dim explicitly"
            )
        check_layer_kinds(self)
        check_kernel_options(self.attention_kernel, self.attention_block_size)
        self.layer_stack()


class TransformerOptions(BackboneOptions, PreNormOptions, kw_only=True):
    """Fields, checks and input/output layers shared by the transformer backbones
    over token positions (:class:`dew.nn.CausalTransformer`, :class:`dew.nn.Transformer`).

    Not a model on its own: a backbone subclasses it (keyword-only, like it),
    adds its fields and gives ``mask``, the :class:`dew.nn.masks.MaskPolicy`
    of its layers (a field or a property).

    Attributes:
      max_seq_len: the longest sequence in positions (for a decoder, prompt +
        generated tokens).
      position_embedding: 'rope' or 'learned' (a [max_seq_len, embed] table, GPT-2).
      rope_theta: RoPE base.
      rope_scaling: optional :class:`RopeScaling` ('linear' or 'llama3').

    The rest are the shared options: :class:`BlockOptions` (widths, heads, the
    feed-forward block, ``init_std``, dtypes), :class:`PreNormOptions` (``norm``,
    ``use_bias``) and :class:`StackOptions` (the layer stack), with their defaults.
    """

    max_seq_len: int
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None

    config_decoders = {"rope_scaling": RopeScaling}
    UNROLL_UP_TO = UNROLL_UP_TO
    FAMILY_POSITIVE = ("max_seq_len",)

    def check(self) -> None:
        """Raise ``ValueError`` on an inconsistent configuration (run when the
        module is built)."""
        super().check()
        if self.position_embedding not in ("rope", "learned"):
            raise ValueError(
                f"unknown position_embedding {self.position_embedding!r}; use 'rope' or 'learned'"
            )
        self.block_config()

    def block_config(self) -> BlockConfig:
        """One layer's configuration (validated when built)."""
        return dataclasses.replace(
            super().block_config(),
            rope_theta=self.rope_theta if self.position_embedding == "rope" else None,
            rope_scaling=self.rope_scaling,
            mask=self.mask,
        )

    def embed_tokens(self, vocab_size: int, tokens: jax.Array) -> tuple[nn.Embed, jax.Array]:
        """The token embedding ``embed`` and its rows for ``tokens [batch, length]``
        (``[batch, length, embed]`` in ``dtype``); call from a compact method."""
        embed = nn.Embed(
            vocab_size,
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
        return embed, jnp.take(table, tokens, axis=0).astype(self.dtype)

    def add_positions(
        self, x: jax.Array, positions: jax.Array | None, *, length: int | None = None
    ) -> jax.Array:
        """``x [batch, length, embed]`` plus the learned ``position_embed`` rows
        at ``positions`` (unchanged for RoPE, which acts in the attention),
        constrained as the residual stream; call from a compact method.
        ``positions=None`` means ``0..length-1`` in every row: the first
        ``length`` rows of the table, sliced (no gather, no scatter-add in the
        gradient)."""
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
            if positions is None:
                length = length or x.shape[1]
                if length > self.max_seq_len:
                    raise ValueError(
                        f"{length} tokens in a row, more than max_seq_len {self.max_seq_len} "
                        f"learned positions; use rows of at most {self.max_seq_len} tokens or "
                        f"a model with a larger max_seq_len"
                    )
                rows = table[:length][None]  # [1, length, embed]
            else:
                rows = jnp.take(table, positions, axis=0)  # [batch, length, embed]
            x = x + rows.astype(self.dtype)
        return nn.with_logical_constraint(x, ACTIVATION_AXES)

    def visible_mask(
        self,
        length: int,
        positions: jax.Array,
        valid: jax.Array,
        segment_ids: jax.Array | None,
        query_key_mask: jax.Array | None,
        *,
        is_default: bool,
    ) -> jax.Array:
        """Boolean ``[batch, 1, query, key]``: :func:`dew.nn.masks.attention_mask` of
        ``mask`` with the padding, segments and explicit mask, computed once for
        every layer (layers would otherwise each build it, inside a scan too).
        ``is_default`` (positions ``0..length-1``, nothing masked): the policy
        alone, a ``[1, 1, query, key]`` constant of the compiled program."""
        index = jnp.arange(length)
        fused = self.attention_kernel != "xla" and (
            self.attention_kernel != "auto" or jax.default_backend() != "cpu"
        )
        if fused and not is_default:
            return None  # a fused kernel reads padding and segments; an XLA layer builds it
        if is_default:
            # numpy: a constant of the program, computed without compiling any op
            slots = np.arange(length)
            rows = slots[None]  # [1, length]
            return masks.attention_mask(
                self.mask, rows, rows, np.ones((1, length), bool), slots, slots
            )
        return masks.attention_mask(
            self.mask,
            positions,
            positions,
            valid,
            index,
            index,
            query_segments=segment_ids,
            key_segments=segment_ids,
            query_key_mask=query_key_mask,
        )

    def norm_output(self, x: jax.Array) -> jax.Array:
        """``x`` through the norm after the last layer (``final_norm``); call
        from a compact method."""
        return make_norm(self.norm, self.norm_eps, self.dtype, self.param_dtype, "final_norm")(x)


def positions_and_valid(
    batch: int, length: int, positions: jax.Array | None, attention_mask: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """``positions`` (default ``0..length-1`` in every row) and the boolean
    ``valid [batch, length]`` of ``attention_mask`` (default all True)."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    valid = (
        jnp.ones((batch, length), jnp.bool_)
        if attention_mask is None
        else attention_mask.astype(jnp.bool_)
    )
    return positions, valid

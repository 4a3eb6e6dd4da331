"""Vision transformers over patches of images and tubelets of video, and the
narrow JEPA predictor.

An image ``[batch, height, width, channels]`` is cut into non-overlapping
``patch_size x patch_size`` patches (Dosovitskiy et al., 2021, ViT); a video
``[batch, frames, height, width, channels]`` into tubelets of
``tubelet_size`` frames by ``patch_size x patch_size`` pixels (Arnab et al.,
2021, ViViT). Patches are numbered row-major over the grid ``(height,
width)`` or ``(time, height, width)``; a position is that number. Each patch
is flattened in ``(frame, row, column, channel)`` order (:class:`PatchGrid`),
projected to ``emb_features`` and given its position's embedding: the fixed
sine-cosine table of I-JEPA / V-JEPA (:func:`sincos_table`) or a learned one.
With ``position_embedding='rope'`` no embedding is added; instead the
attention rotates queries and keys by the patch's grid coordinates, as V-JEPA 2
does (Assran et al., 2025; :func:`dew.nn.rope.apply_axial_rope`).

The blocks are :class:`~dew.nn.backbones.block.DecoderBlock` run through
:class:`~dew.nn.stack.LayerStack` under a full (bidirectional) mask: pre-norm
``x + attn(norm(x))``, ``x + mlp(norm(x))``. Because positions travel with
the tokens, :class:`ViT` runs on any subset of patches (``positions [batch,
K]``: I-JEPA's context encoder sees only the kept patches), and
:class:`ViTPredictor` (I-JEPA's predictor, Assran et al., 2023) predicts the
encoder's features at target positions from context tokens.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import axes, models
from dew.nn.backbones._options import (
    ACTIVATION_AXES,
    BackboneOptions,
    BlockConfig,
    PreNormOptions,
)
from dew.nn.backbones.block import DecoderBlock
from dew.nn.norms import make_norm
from dew.nn.rope import axial_section_dim
from dew.nn.shards import check_divides

POSITION_EMBEDDINGS = ("sincos", "learned", "rope")
ROPE_THETA = 10000.0  # V-JEPA 2's rotary base


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchGrid:
    """How pixels become patches.

    image_size: pixels along each side of a (square) image or frame.
    patch_size: pixels along each side of a patch.
    num_frames: frames of a video; None = images (no frame axis).
    tubelet_size: frames per tubelet (video only; 1 = one frame per patch).
    """

    image_size: int
    patch_size: int
    num_frames: int | None = None
    tubelet_size: int = 1

    def __post_init__(self):
        if self.patch_size < 1 or self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}; crop or resize the images to a multiple of the patch size"
            )
        if self.tubelet_size < 1:
            raise ValueError(f"tubelet_size must be >= 1 frame, got {self.tubelet_size}")
        if self.num_frames is None and self.tubelet_size != 1:
            raise ValueError(
                f"tubelet_size {self.tubelet_size} is for video; set num_frames (frames per "
                f"video) or use tubelet_size=1 for images"
            )
        if self.num_frames is not None and (
            self.num_frames < self.tubelet_size or self.num_frames % self.tubelet_size
        ):
            raise ValueError(
                f"num_frames {self.num_frames} is not a positive multiple of tubelet_size "
                f"{self.tubelet_size}; give videos of a multiple of {self.tubelet_size} frames "
                f"(repeat frames of shorter clips) or a smaller tubelet_size"
            )

    @property
    def is_video(self) -> bool:
        return self.num_frames is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """Patches along each axis: ``(height, width)`` or ``(time, height, width)``."""
        side = self.image_size // self.patch_size
        if self.is_video:
            return (self.num_frames // self.tubelet_size, side, side)
        return (side, side)

    @property
    def num_patches(self) -> int:
        return int(np.prod(self.shape))

    def pixel_shape(self, channels: int) -> tuple[int, ...]:
        """One example's pixels: ``(H, W, C)`` or ``(F, H, W, C)``."""
        frames = (self.num_frames,) if self.is_video else ()
        return (*frames, self.image_size, self.image_size, channels)

    def patch_features(self, channels: int) -> int:
        return self.tubelet_size * self.patch_size**2 * channels

    def check_pixels(self, pixels, channels: int, where: str) -> None:
        """Raise (while tracing) unless ``pixels`` is a batch of this grid's images or videos."""
        want = self.pixel_shape(channels)
        if tuple(pixels.shape[1:]) == want:
            return
        kind = "videos [batch, frames, H, W, C]" if self.is_video else "images [batch, H, W, C]"
        hint = ""
        if self.is_video and pixels.ndim == 5 and pixels.shape[1] != self.num_frames:
            hint = (
                f"; the video has {pixels.shape[1]} frames, the model takes num_frames="
                f"{self.num_frames} in tubelets of {self.tubelet_size}: pad or repeat frames"
            )
        elif len(pixels.shape) >= 3 and pixels.shape[-2] % self.patch_size:
            hint = f"; width {pixels.shape[-2]} is not a multiple of patch_size {self.patch_size}"
        raise ValueError(
            f"{where} takes {kind} of shape [batch, {', '.join(map(str, want))}] "
            f"(image_size {self.image_size}, patch_size {self.patch_size}), got "
            f"{tuple(pixels.shape)}"
            f"{hint}; resize or crop the inputs, or build the model for this size"
        )

    def patchify(self, pixels: jax.Array) -> jax.Array:
        """``[batch, (F,) H, W, C] -> [batch, patches, patch_features]``; patches
        row-major over :attr:`shape`, each flattened as ``(frame, row, column, channel)``."""
        p, t = self.patch_size, self.tubelet_size
        batch, channels = pixels.shape[0], pixels.shape[-1]
        if not self.is_video:
            pixels = pixels[:, None]  # one frame
        grid_t, grid_h, grid_w = (1, *self.shape) if not self.is_video else self.shape
        x = pixels.reshape(batch, grid_t, t, grid_h, p, grid_w, p, channels)
        x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7)  # [batch, T, H, W, t, p, p, channels]
        return x.reshape(batch, self.num_patches, self.patch_features(channels))

    def unpatchify(self, patches: jax.Array, channels: int) -> jax.Array:
        """The inverse of :meth:`patchify`: ``[batch, patches, patch_features] ->
        [batch, (F,) H, W, C]``."""
        p, t = self.patch_size, self.tubelet_size
        batch = patches.shape[0]
        grid_t, grid_h, grid_w = (1, *self.shape) if not self.is_video else self.shape
        x = patches.reshape(batch, grid_t, grid_h, grid_w, t, p, p, channels)
        x = x.transpose(0, 1, 4, 2, 5, 3, 6, 7)  # [batch, T, t, H, p, W, p, channels]
        x = x.reshape(batch, grid_t * t, grid_h * p, grid_w * p, channels)
        return x if self.is_video else x[:, 0]


def sincos_1d(features: int, coordinates: np.ndarray) -> np.ndarray:
    """``[n, features]``: ``sin(c w_k)`` then ``cos(c w_k)``, ``w_k = 10000^(-2k/features)``
    (Vaswani et al., 2017), for coordinates ``c [n]``."""
    omega = 1.0 / 10000 ** (np.arange(features // 2, dtype=np.float64) / (features / 2))
    angles = np.asarray(coordinates, np.float64)[:, None] * omega[None]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_table(features: int, grid_shape: tuple[int, ...]) -> np.ndarray:
    """The fixed position table ``[patches, features]`` (float32) of I-JEPA and V-JEPA.

    2-D grid ``(H, W)``: half the features encode the column, half the row
    (I-JEPA's ``get_2d_sincos_pos_embed``). 3-D grid ``(T, H, W)``: half the
    time, a quarter the row, a quarter the column (V-JEPA's
    ``get_3d_sincos_pos_embed``).
    """
    index = np.indices(grid_shape).reshape(len(grid_shape), -1)  # [axes, patches]
    if len(grid_shape) == 2:
        if features % 4:
            raise ValueError(
                f"a 2-D sine-cosine table needs emb_features divisible by 4, got {features}; "
                f"use position_embedding='learned' or a multiple of 4"
            )
        rows, cols = index
        parts = [sincos_1d(features // 2, cols), sincos_1d(features // 2, rows)]
    else:
        if features % 8:
            raise ValueError(
                f"a 3-D sine-cosine table needs emb_features divisible by 8, got {features}; "
                f"use position_embedding='learned' or a multiple of 8"
            )
        times, rows, cols = index
        parts = [
            sincos_1d(features // 2, times),
            sincos_1d(features // 4, rows),
            sincos_1d(features // 4, cols),
        ]
    return np.concatenate(parts, axis=1).astype(np.float32)


def check_positions(positions, batch: int, what: str) -> None:
    """Raise unless ``positions`` is an integer ``[batch, K]`` array."""
    if positions.ndim != 2 or positions.shape[0] != batch:
        raise ValueError(
            f"{what} must be integer patch indices [batch, K] with batch {batch}, got shape "
            f"{tuple(positions.shape)}"
        )
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"{what} must be integer patch indices, got dtype {positions.dtype}")


class PatchOptions(BackboneOptions, PreNormOptions, kw_only=True):
    """What :class:`ViT` and :class:`ViTPredictor` share: the patch grid and its
    positions on top of the shared options (:class:`~dew.nn.backbones._options.BlockOptions`,
    :class:`~dew.nn.backbones._options.PreNormOptions`,
    :class:`~dew.nn.backbones._options.StackOptions`), with I-JEPA's defaults.

    Attributes:
      image_size: pixels along each side of a (square) image or frame.
      patch_size: pixels along each side of a patch.
      num_channels: channels of a pixel.
      num_frames: frames of a video input ``[batch, frames, H, W, C]``; None =
        images ``[batch, H, W, C]``.
      tubelet_size: frames per tubelet (video); 1 for images.
      position_embedding: 'sincos' (the fixed table of :func:`sincos_table`),
        'learned' (a ``[patches, embed]`` parameter ``position_embed``) or 'rope'
        (no table: the attention rotates queries and keys by each patch's grid
        coordinates, V-JEPA 2's 3-D rotary for video, its 2-D analogue for images;
        :func:`dew.nn.rope.apply_axial_rope`, base 10000).
      mlp_activation: default 'gelu_exact' (erf GELU, as I-JEPA).
      norm: default 'layer'.
      use_bias: default True: biases on every dense layer and the q/k/v projections.
      init_std: default 0.02, as I-JEPA.
    """

    image_size: int
    patch_size: int
    num_channels: int = 3
    num_frames: int | None = None
    tubelet_size: int = 1
    position_embedding: str = "sincos"
    # this family's own defaults of shared options
    mlp_activation: str = "gelu_exact"
    norm: str = "layer"
    use_bias: bool = True
    init_std: float | None = 0.02

    FAMILY_POSITIVE = ("image_size", "patch_size", "num_channels", "tubelet_size")
    FAMILY_OPTIONAL = ("num_frames",)

    @property
    def grid(self) -> PatchGrid:
        return PatchGrid(
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_frames=self.num_frames,
            tubelet_size=self.tubelet_size,
        )

    @property
    def num_patches(self) -> int:
        return self.grid.num_patches

    def check(self) -> None:
        """Raise ``ValueError`` on an inconsistent configuration (run when the
        module is built)."""
        super().check()
        grid = self.grid
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"unknown position_embedding {self.position_embedding!r}; use one of "
                f"{POSITION_EMBEDDINGS}"
            )
        if self.position_embedding == "sincos":
            sincos_table(self.emb_features, (1,) * len(grid.shape))
        head_dim = self.features_per_head
        if self.position_embedding == "rope" and not axial_section_dim(head_dim, len(grid.shape)):
            raise ValueError(
                f"position_embedding='rope' over a {len(grid.shape)}-D patch grid needs at "
                f"least 2 features per axis in each head, so head_dim >= {2 * len(grid.shape)}; "
                f"got head_dim {head_dim} (emb_features {self.emb_features} / num_heads "
                f"{self.num_heads}): use fewer heads or another position_embedding"
            )

    def block_config(self) -> BlockConfig:
        return dataclasses.replace(
            super().block_config(),
            rope_theta=ROPE_THETA if self.position_embedding == "rope" else None,
        )

    def add_positions(self, x: jax.Array, positions: jax.Array, table) -> jax.Array:
        """``x [batch, K, embed]`` plus the rows of ``table`` (:meth:`position_table`) at
        ``positions [batch, K]``; unchanged without a table ('rope' acts in the attention)."""
        if table is None:
            return x
        return x + jnp.take(table, positions, axis=0).astype(self.dtype)

    def grid_coordinates(self, positions: jax.Array) -> jax.Array:
        """``[batch, K, axes]``: the grid coordinates ``(time,) row, column`` of patch
        indices ``positions [batch, K]``."""
        return jnp.stack(jnp.unravel_index(positions, self.grid.shape), axis=-1).astype(jnp.int32)

    def position_table(self) -> jax.Array | None:
        """``[patches, emb_features]``: the fixed sine-cosine table or the learned
        ``position_embed``; None under 'rope'."""
        if self.position_embedding == "rope":
            return None
        if self.position_embedding == "sincos":
            return jnp.asarray(sincos_table(self.emb_features, self.grid.shape))
        table = self.param(
            "position_embed",
            nn.with_logical_partitioning(
                nn.initializers.normal(self.weight_std), (None, axes.EMBED)
            ),
            (self.num_patches, self.emb_features),
            self.param_dtype,
        )
        # Gathered from a whole table, as CausalTransformer's: a gather from an
        # embed-split table leaves its output split along embed (and XLA
        # rematerializes it in full under fsdp).
        return nn.with_logical_constraint(table, (None, None))

    def dense(self, features, in_axis, out_axis, name):
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

    def blocks_and_norm(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """The stack of bidirectional blocks and the final norm: ``[batch, tokens, embed]``."""
        check_divides(
            x.shape[1], axes.LENGTH, f"{type(self).__name__} tokens [batch, tokens, embed]"
        )
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)
        valid = jnp.ones(positions.shape, jnp.bool_)
        if self.position_embedding == "rope":
            positions = self.grid_coordinates(positions)  # [batch, tokens, axes]
        x = self.layer_stack()(
            self, DecoderBlock, dict(config=self.block_config()), x, positions, valid
        )
        return make_norm(self.norm, self.norm_eps, self.dtype, self.param_dtype, "final_norm")(x)


@models.register("vit")
class ViT(PatchOptions, kw_only=True):
    """A vision transformer encoder: pixels -> ``[batch, patches or K, emb_features]``
    (float32, after the final norm), the backbone of I-JEPA and V-JEPA.

    Its fields are :class:`PatchOptions`' (the patch grid, positions) and the
    options every backbone shares (``emb_features``, ``num_layers``,
    ``num_heads``, ``mlp_features``, ...: :mod:`dew.nn.backbones._options`), all
    keyword-only.
    """

    def example_inputs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract arguments to ``init`` with (one example of pixels)."""
        return (jax.ShapeDtypeStruct((1, *self.grid.pixel_shape(self.num_channels)), jnp.float32),)

    def patchify(self, pixels: jax.Array) -> jax.Array:
        """``[batch, (F,) H, W, C] -> [batch, patches, patch_features]``
        (:meth:`PatchGrid.patchify`)."""
        return self.grid.patchify(pixels)

    def unpatchify(self, patches: jax.Array) -> jax.Array:
        """``[batch, patches, patch_features] -> [batch, (F,) H, W, C]``."""
        return self.grid.unpatchify(patches, self.num_channels)

    @nn.compact
    def __call__(self, pixels: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Features ``[batch, K, emb_features]`` of the patches at ``positions``.

        pixels: images ``[batch, H, W, C]`` or videos ``[batch, F, H, W, C]``.
        positions: int ``[batch, K]`` indices of the patches to encode (the
          context), each in ``[0, num_patches)``; the others are dropped before
          the first block, so no kept patch sees them. None = every patch in
          order (``K = num_patches``).
        """
        grid = self.grid
        grid.check_pixels(pixels, self.num_channels, "ViT")
        batch = pixels.shape[0]
        patches = grid.patchify(pixels.astype(self.dtype))  # [batch, patches, patch_features]
        if positions is None:
            positions = jnp.broadcast_to(
                jnp.arange(grid.num_patches, dtype=jnp.int32), (batch, grid.num_patches)
            )
        else:
            check_positions(positions, batch, "ViT positions")
            patches = jnp.take_along_axis(patches, positions[:, :, None], axis=1)  # [batch, K, ...]
        x = self.dense(self.emb_features, None, axes.EMBED, "patch_embed")(patches)
        x = self.add_positions(x, positions, self.position_table())
        return self.blocks_and_norm(x, positions).astype(jnp.float32)  # [batch, K, embed]


def scale_pixels(x: jax.Array) -> jax.Array:
    """Pixels as float32: integer (``uint8``) pixels in [0, 255] map to [-1, 1], as the
    JEPA and diffusion objectives feed them; floats pass unchanged."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.float32) / 127.5 - 1.0
    return x.astype(jnp.float32)


@models.register("vit_classifier")
class ViTClassifier(ViT, kw_only=True):
    """A :class:`ViT` with a classification head: pixels -> logits ``[batch,
    num_classes]`` (float32), the model of
    :class:`~dew.objectives.language.classifier_distillation.ClassifierDistillationObjective`.

    The encoder's features are averaged over the patches (no class token) and
    projected by ``head`` (a dense layer, ``(embed, None)``); its parameters are the
    ViT's plus ``head``, so a JEPA-trained ``vit`` encoder's weights start it
    (``init_params``). ``uint8`` pixels are scaled to [-1, 1] first
    (:func:`scale_pixels`, what the JEPA objective feeds its encoder); floats pass
    unchanged.

    Attributes:
      num_classes: the number of classes (logits per image).

    The rest are :class:`ViT`'s fields, all keyword-only.
    """

    num_classes: int

    EXTRA_POSITIVE = ("num_classes",)
    COUNT_MEANINGS = {"num_classes": "the classes the head scores"}

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        """Logits ``[batch, num_classes]`` of images ``[batch, H, W, C]`` (or videos)."""
        features = super().__call__(scale_pixels(pixels))  # [batch, patches, embed]
        pooled = features.mean(axis=1).astype(self.dtype)  # [batch, embed]
        logits = self.dense(self.num_classes, axes.EMBED, None, "head")(pooled)
        return logits.astype(jnp.float32)  # [batch, num_classes]


@models.register("vit_predictor")
class ViTPredictor(PatchOptions, kw_only=True):
    """I-JEPA's predictor (Assran et al., 2023): a narrow ViT over context tokens
    and mask tokens that returns predicted encoder features at the targets.

    ``input_projection`` maps context tokens ``[batch, K, encoder_features]`` to
    ``emb_features`` and adds their positions' embeddings; each target gets the
    learned ``mask_token`` plus its position's embedding; the blocks see all
    ``K + T`` tokens (bidirectional); after the final norm,
    ``output_projection`` maps the ``T`` target tokens back to ``encoder_features``.

    Attributes:
      encoder_features: width of the encoder's features (in and out).
      emb_features: the predictor's own (narrower) width.

    The rest are :class:`ViT`'s fields, all keyword-only.
    """

    encoder_features: int

    EXTRA_POSITIVE = ("encoder_features",)

    def example_inputs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract arguments to ``init`` with: one context token, one target."""
        index = jax.ShapeDtypeStruct((1, 1), jnp.int32)
        return (jax.ShapeDtypeStruct((1, 1, self.encoder_features), jnp.float32), index, index)

    @nn.compact
    def __call__(
        self, context: jax.Array, context_positions: jax.Array, target_positions: jax.Array
    ) -> jax.Array:
        """Predicted features ``[batch, T, encoder_features]`` (float32) at the targets.

        context: encoder features of the context ``[batch, K, encoder_features]``.
        context_positions: int ``[batch, K]``, their patch indices.
        target_positions: int ``[batch, T]``, the patch indices to predict.
        """
        if context.ndim != 3 or context.shape[-1] != self.encoder_features:
            raise ValueError(
                f"ViTPredictor context must be [batch, K, encoder_features="
                f"{self.encoder_features}], got shape {tuple(context.shape)}"
            )
        batch, num_context = context.shape[:2]
        check_positions(context_positions, batch, "ViTPredictor context_positions")
        check_positions(target_positions, batch, "ViTPredictor target_positions")
        if context_positions.shape[1] != num_context:
            raise ValueError(
                f"ViTPredictor got {num_context} context tokens but context_positions for "
                f"{context_positions.shape[1]}; give one position per context token"
            )
        table = self.position_table()
        x = self.dense(self.emb_features, None, axes.EMBED, "input_projection")(
            context.astype(self.dtype)
        )
        x = self.add_positions(x, context_positions, table)
        mask_token = self.param(
            "mask_token",
            nn.with_logical_partitioning(nn.initializers.normal(self.weight_std), (axes.EMBED,)),
            (self.emb_features,),
            self.param_dtype,
        )
        targets = jnp.broadcast_to(
            mask_token.astype(self.dtype), (*target_positions.shape, self.emb_features)
        )
        targets = self.add_positions(targets, target_positions, table)  # [batch, T, embed]
        x = jnp.concatenate([x, targets], axis=1)  # [batch, K + T, embed]
        positions = jnp.concatenate([context_positions, target_positions], axis=1).astype(jnp.int32)
        x = self.blocks_and_norm(x, positions)[:, num_context:]  # [batch, T, embed]
        y = self.dense(self.encoder_features, axes.EMBED, None, "output_projection")(x)
        return y.astype(jnp.float32)  # [batch, T, encoder_features]

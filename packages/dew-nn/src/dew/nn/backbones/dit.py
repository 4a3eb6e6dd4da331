"""Diffusion transformers: DiT over images (Peebles & Xie, 2023, arXiv 2212.09748).

An image (or latent) ``x [batch, height, width, channels]`` at diffusion time
``t`` with an optional class label and text context becomes a prediction of
the same shape (``eps``, ``v``, ``x0`` or a flow velocity, as the objective
trains it; twice the channels with ``learn_sigma``):

1. **Patchify**: non-overlapping ``p x p`` patches, each flattened as
   ``(row, column, channel)``, a linear map to ``emb_features`` plus the fixed
   2-D sine-cosine position of the patch (half the features the column, half
   the row, as DiT / MAE / diffusers' ``get_2d_sincos_pos_embed``).
2. **Conditioning** ``c = MLP(sinusoid(t)) + E[label]``: the sinusoid has
   ``time_features`` (256) features ``[cos(t w_k), sin(t w_k)]``,
   ``w_k = 10000^(-k / (half - time_freq_shift))``; the MLP is
   ``Linear -> SiLU -> Linear``; ``E`` has ``num_classes + 1`` rows, the last
   one the null class of classifier-free guidance (Ho & Salimans, 2022).
3. **adaLN-Zero blocks**: ``(shift1, scale1, gate1, shift2, scale2, gate2) =
   W silu(c) + b`` with ``W = b = 0`` at initialisation;
   ``x += gate1 * attn(LN(x) (1 + scale1) + shift1)``, then with a text
   context ``x += crossattn(LN(x), context)`` (zero-initialised output, as
   PixArt-alpha), then ``x += gate2 * mlp(LN(x) (1 + scale2) + shift2)``.
   The norms have no parameters. Each block is therefore the identity at
   initialisation.
4. **Final layer**: ``(shift, scale) = W' silu(c) + b'``, ``LN(x) (1 + scale) +
   shift``, a linear map to ``p * p * out_channels`` (zero-initialised, so the
   model outputs 0 at initialisation), and **unpatchify**.

The attention is :class:`dew.nn.Attention` under a full mask without RoPE,
the feed-forward :class:`dew.nn.MLP`, the blocks run by
:class:`dew.nn.stack.LayerStack` (scan, remat). With ``time_freq_shift=1``,
``mlp_norm_eps=1e-5`` and ``mlp_features = 4 * emb_features`` the module
computes what diffusers' ``DiTTransformer2DModel`` computes (the Hugging Face
format :mod:`dew.nn.hf.dit` maps the weights).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import axes, models
from dew.nn.backbones._options import BackboneOptions
from dew.nn.backbones.block import IMAGE_AXES, DiTBlock, modulate, plain_norm
from dew.nn.backbones.vit import sincos_1d
from dew.nn.keywords import is_whole_number
from dew.nn.shards import check_divides

VIDEO_AXES = (axes.BATCH, axes.FRAMES, axes.LENGTH, axes.EMBED)  # [batch, frames, patches, embed]


def timestep_embedding(t: jax.Array, features: int, freq_shift: float = 1.0) -> jax.Array:
    """``[batch] -> [batch, features]`` (float32): ``[cos(t w_k), sin(t w_k)]``,
    ``w_k = exp(-ln(10000) k / (features / 2 - freq_shift))`` (DDPM's embedding, cosine
    first as DiT; ``freq_shift`` 0 = the DiT paper, 1 = diffusers' DiT)."""
    half = features // 2
    freqs = jnp.exp(-np.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    angles = t.astype(jnp.float32)[:, None] * freqs[None]
    out = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    if features % 2:
        out = jnp.pad(out, ((0, 0), (0, 1)))
    return out


def position_table(features: int, grid: tuple[int, int], base: tuple[int, int]) -> np.ndarray:
    """``[rows * cols, features]`` (float32): the 2-D sine-cosine positions of a
    ``grid = (rows, cols)`` of patches, half the features the column and half the row.

    Coordinates are scaled to the ``base`` grid the model was built for
    (``i * base / grid``), as diffusers' ``PatchEmbed`` does for another input
    size; at the base size they are the patch indices.
    """
    rows, cols = grid
    row = np.arange(rows, dtype=np.float64) * base[0] / rows
    col = np.arange(cols, dtype=np.float64) * base[1] / cols
    row, col = np.meshgrid(row, col, indexing="ij")
    parts = [sincos_1d(features // 2, col.reshape(-1)), sincos_1d(features // 2, row.reshape(-1))]
    return np.concatenate(parts, axis=1).astype(np.float32)


def patchify(x: jax.Array, patch: int) -> jax.Array:
    """``[batch, H, W, C] -> [batch, (H/p) * (W/p), p * p * C]``, patches row-major,
    each flattened as ``(row, column, channel)``."""
    batch, height, width, channels = x.shape
    x = x.reshape(batch, height // patch, patch, width // patch, patch, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5)  # [batch, rows, cols, p, p, channels]
    return x.reshape(batch, (height // patch) * (width // patch), patch * patch * channels)


def unpatchify(tokens: jax.Array, grid: tuple[int, int], patch: int) -> jax.Array:
    """The inverse of :func:`patchify`: ``[batch, rows * cols, p * p * C] -> [batch, H, W, C]``."""
    batch = tokens.shape[0]
    rows, cols = grid
    channels = tokens.shape[-1] // (patch * patch)
    x = tokens.reshape(batch, rows, cols, patch, patch, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5)  # [batch, rows, p, cols, p, channels]
    return x.reshape(batch, rows * patch, cols * patch, channels)


def _dense(features, in_axis, out_axis, *, init, use_bias=True, dtype, param_dtype, name):
    return nn.Dense(
        features,
        use_bias=use_bias,
        kernel_init=nn.with_logical_partitioning(init, (in_axis, out_axis)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)),
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
    )


class DiTOptions(BackboneOptions, kw_only=True):
    """Fields, checks and layers shared by :class:`DiT` and :class:`VideoDiT`.

    Attributes:
      sample_size: height = width of the input in pixels (or latent cells);
        a ``(height, width)`` pair for non-square inputs. The positions are
        laid out for this size; another size divisible by ``patch_size`` is
        accepted and its positions scaled to it (as diffusers does).
      patch_size: pixels (latent cells) along each side of a patch.
      in_channels: channels of the input (3 for RGB, 4 for SD-VAE latents).
      num_classes: classes of ``label``; the label table has one more row, the
        null class ``label == num_classes`` (classifier-free guidance). 0 = no
        label table (unconditional or text-only).
      learn_sigma: also predict the variance interpolation of improved DDPM
        (Nichol & Dhariwal, 2021): ``out_channels = 2 * in_channels``, the
        prediction first, then the variance values.
      context_features: width of the text embeddings ``context [batch, tokens,
        context_features]`` read by cross-attention in every block; 0 = no
        cross-attention (and ``context`` must not be given).
      time_features: features of the sinusoidal timestep embedding (256, DiT).
      time_freq_shift: ``w_k = 10000^(-k / (half - shift))``; 1 = diffusers'
        ``DiTTransformer2DModel`` (and its checkpoints), 0 = the DiT paper.
      mlp_norm_eps: epsilon of the norm before the feed-forward block; None =
        ``norm_eps`` (diffusers' DiT uses its ``norm_eps``, 1e-5, there).
      use_zero_init: adaLN-Zero's initialisation: the modulations, the
        cross-attention output and the final layer start at 0, so every block is
        the identity and the output 0 (Peebles & Xie, sec. 3.2); False = all
        weights normal(init_std) (an ablation; tests that need gradients in every
        block from the first step).

    The rest are the options every backbone shares
    (:class:`~dew.nn.backbones._options.BlockOptions`: ``emb_features``,
    ``num_heads``, ``mlp_features``, ``norm_eps`` (the attention and final norms),
    ``init_std`` (the weights not zero-initialised) ...;
    :class:`~dew.nn.backbones._options.StackOptions`: ``num_layers`` (adaLN-Zero
    blocks; :class:`VideoDiT`: spatial + temporal pairs), ``use_scan`` ...), with
    DiT's own defaults: ``mlp_activation='gelu'`` (tanh approximation),
    ``use_qkv_bias=True``, ``init_std=0.02``, ``norm_eps=1e-6``. The output
    projection and the MLP always have biases, and the norms have no parameters
    (adaLN supplies them), so DiT has no ``norm`` or ``use_bias`` option.
    """

    sample_size: int | tuple[int, int]
    patch_size: int
    in_channels: int
    num_classes: int = 0
    learn_sigma: bool = False
    context_features: int = 0
    time_features: int = 256
    time_freq_shift: float = 1.0
    mlp_norm_eps: float | None = None
    use_zero_init: bool = True
    # this family's own defaults of shared options
    mlp_activation: str = "gelu"
    use_qkv_bias: bool = True
    init_std: float | None = 0.02

    FAMILY_POSITIVE = ("patch_size", "in_channels", "time_features")
    FAMILY_NON_NEGATIVE = ("num_classes", "context_features")

    def __post_init__(self):
        if isinstance(self.sample_size, list):  # a JSON round trip turns the pair into a list
            object.__setattr__(self, "sample_size", tuple(self.sample_size))
        super().__post_init__()  # checks: a bad config never builds

    # ------------------------------------------------------------ derived

    @property
    def sample_shape(self) -> tuple[int, int]:
        """``(height, width)`` the model is built for."""
        size = self.sample_size
        return (int(size), int(size)) if is_whole_number(size) else (int(size[0]), int(size[1]))

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def base_grid(self) -> tuple[int, int]:
        """Patches along each side at ``sample_size``."""
        return tuple(s // self.patch_size for s in self.sample_shape)

    def block_kwargs(self, **overrides) -> dict[str, Any]:
        return dict(
            config=self.block_config(),
            mlp_norm_eps=self.norm_eps if self.mlp_norm_eps is None else self.mlp_norm_eps,
            use_cross_attention=self.context_features > 0,
            use_zero_init=self.use_zero_init,
            **overrides,
        )

    def check(self) -> None:
        """Raise ``ValueError`` on an inconsistent configuration (run when the
        module is built)."""
        name = type(self).__name__
        size = self.sample_size
        sides = size if isinstance(size, tuple) else (size,)
        if len(sides) not in (1, 2) or not all(is_whole_number(s) and s >= 1 for s in sides):
            raise ValueError(
                f"{name} sample_size={size!r} must be a whole number >= 1 (square inputs) or "
                f"a (height, width) pair of them, in pixels or latent cells"
            )
        super().check()
        if any(s % self.patch_size for s in self.sample_shape):
            raise ValueError(
                f"{name} sample_size {self.sample_size} is not a positive multiple of "
                f"patch_size {self.patch_size}; use a sample_size divisible by the patch size"
            )
        if self.emb_features % 4:
            raise ValueError(
                f"{name} emb_features {self.emb_features} must be a multiple of 4 for the 2-D "
                f"sine-cosine positions; use {self.emb_features // 4 * 4 or 4} or "
                f"{self.emb_features // 4 * 4 + 4}"
            )
        if self.time_features < 2 or self.time_freq_shift >= self.time_features // 2:
            raise ValueError(
                f"{name} time_features {self.time_features} with time_freq_shift "
                f"{self.time_freq_shift}: need time_features >= 2 and a shift below half of it"
            )

    # ------------------------------------------------------------ inputs

    def check_image(self, x, what: str) -> None:
        """Raise unless ``x [..., H, W, in_channels]`` has sides divisible by the patch size."""
        height, width, channels = x.shape[-3:]
        if channels != self.in_channels:
            raise ValueError(
                f"{what} has {channels} channels (shape {tuple(x.shape)}), the model takes "
                f"in_channels={self.in_channels}; give [..., height, width, {self.in_channels}] "
                f"(channels last)"
            )
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"{what} of {height}x{width} (shape {tuple(x.shape)}) does not divide into "
                f"{self.patch_size}x{self.patch_size} patches; crop or pad to a multiple of "
                f"patch_size {self.patch_size} (the model is built for {self.sample_shape})"
            )

    def check_conditions(self, batch: int, t, label, context, context_mask) -> None:
        """Raise on a timestep, label or context that does not fit the model."""
        name = type(self).__name__
        if t.ndim > 1 or (t.ndim == 1 and t.shape[0] != batch):
            raise ValueError(
                f"{name} t has shape {tuple(t.shape)}; give one timestep per example, "
                f"[batch={batch}] (or a scalar for all)"
            )
        if label is not None:
            if self.num_classes == 0:
                raise ValueError(
                    f"{name} got a label but num_classes=0 (an unconditional model has no "
                    f"label table); drop the label or build the model with num_classes > 0"
                )
            if label.shape != (batch,) or not jnp.issubdtype(label.dtype, jnp.integer):
                raise ValueError(
                    f"{name} label must be integer [batch={batch}] in [0, {self.num_classes}] "
                    f"({self.num_classes} = the null class); got {label.dtype} "
                    f"{tuple(label.shape)}"
                )
        if context is None and self.context_features:
            raise ValueError(
                f"{name} has context_features={self.context_features} (cross-attention) but got "
                f"no context; give context [batch, tokens, {self.context_features}] (the "
                f"null prompt's embeddings for the unconditional branch)"
            )
        if context is not None:
            if not self.context_features:
                raise ValueError(
                    f"{name} got a context of shape {tuple(context.shape)} but has "
                    f"context_features=0 (no cross-attention); build it with "
                    f"context_features={context.shape[-1]} or drop the context"
                )
            if context.ndim != 3 or context.shape[0] != batch:
                raise ValueError(
                    f"{name} context must be [batch={batch}, tokens, {self.context_features}], "
                    f"got shape {tuple(context.shape)}"
                )
            if context.shape[-1] != self.context_features:
                raise ValueError(
                    f"{name} context has {context.shape[-1]} features (shape "
                    f"{tuple(context.shape)}), the model takes context_features="
                    f"{self.context_features}"
                )
        if context_mask is not None and (
            context is None or tuple(context_mask.shape) != tuple(context.shape[:2])
        ):
            raise ValueError(
                f"{name} context_mask must be [batch, tokens] like the context's first two "
                f"axes {None if context is None else tuple(context.shape[:2])}, got "
                f"{tuple(context_mask.shape)}"
            )

    # ------------------------------------------------------------ layers

    def dense(self, features, in_axis, out_axis, name, *, zero: bool = False):
        """A dense layer; ``zero``: zero-initialised under ``use_zero_init``."""
        init = nn.initializers.normal(self.weight_std)
        if zero and self.use_zero_init:
            init = nn.initializers.zeros
        return _dense(
            features,
            in_axis,
            out_axis,
            init=init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def condition(self, t: jax.Array, label: jax.Array | None, batch: int) -> jax.Array:
        """``silu(c)`` ``[batch, embed]``: ``c = MLP(sinusoid(t)) + E[label]``; a missing
        label is the null class."""
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (batch,))
        h = timestep_embedding(t, self.time_features, self.time_freq_shift).astype(self.dtype)
        h = self.dense(self.emb_features, None, axes.EMBED, "time_in")(h)
        c = self.dense(self.emb_features, axes.EMBED, None, "time_out")(nn.silu(h))
        if self.num_classes:
            if label is None:
                label = jnp.full((batch,), self.num_classes, jnp.int32)
            table = self.param(
                "label_embed",
                nn.with_logical_partitioning(
                    nn.initializers.normal(self.weight_std), (None, axes.EMBED)
                ),
                (self.num_classes + 1, self.emb_features),
                self.param_dtype,
            )
            # gathered from the whole table (see TransformerOptions.embed_tokens)
            table = nn.with_logical_constraint(table, (None, None))
            c = c + jnp.take(table, label, axis=0).astype(self.dtype)
        return nn.silu(c)  # [batch, embed]

    def embed_patches(self, x: jax.Array) -> tuple[jax.Array, tuple[int, int]]:
        """``[batch, H, W, C] -> ([batch, patches, embed], (rows, cols))``: the patches'
        linear embedding plus their 2-D positions."""
        grid = (x.shape[1] // self.patch_size, x.shape[2] // self.patch_size)
        patches = patchify(x.astype(self.dtype), self.patch_size)  # [batch, patches, p*p*C]
        h = self.dense(self.emb_features, None, axes.EMBED, "patch_embed")(patches)
        table = position_table(self.emb_features, grid, self.base_grid)
        return h + jnp.asarray(table, self.dtype)[None], grid

    def final_layer(self, h: jax.Array, condition: jax.Array) -> jax.Array:
        """``[batch, tokens, embed] -> [batch, tokens, p * p * out_channels]`` (module
        docstring, step 4)."""
        modulation = self.dense(
            2 * self.emb_features, axes.EMBED, None, "final_modulation", zero=True
        )(condition)
        shift, scale = jnp.split(modulation, 2, axis=-1)
        h = modulate(plain_norm(self.norm_eps, self.dtype, "final_norm")(h), shift, scale)
        features = self.patch_size**2 * self.out_channels
        return self.dense(features, axes.EMBED, None, "head", zero=True)(h)

    def predict_frames(
        self, video, t, label, context, context_mask, *, block, frame_axis: bool
    ) -> jax.Array:
        """The body :class:`DiT` and :class:`~dew.nn.backbones.video_dit.VideoDiT` share:
        ``video [batch, frames, H, W, C] -> [batch, frames, H, W, out_channels]`` (float32).

        Conditions, patch embedding of every frame, ``num_layers`` ``block`` s over the
        tokens, the final layer and unpatchify. The blocks see ``[batch, frames, patches,
        embed]`` (``frame_axis``) or, for one frame, ``[batch, patches, embed]``.
        """
        what = type(self).__name__
        batch, frames = video.shape[:2]
        t = jnp.asarray(t)
        self.check_conditions(batch, t, label, context, context_mask)
        condition = self.condition(t, label, batch)
        h, grid = self.embed_patches(video.reshape(batch * frames, *video.shape[2:]))
        patches = h.shape[1]  # h: [batch * frames, patches, embed]
        if frame_axis:
            check_divides(patches, axes.LENGTH, f"{what} patches of a frame [.., patches, embed]")
            h = h.reshape(batch, frames, patches, -1)
        else:
            check_divides(patches, axes.LENGTH, f"{what} patches [batch, patches, embed]")
        h = nn.with_logical_constraint(h, VIDEO_AXES if frame_axis else IMAGE_AXES)
        h = self.layer_stack()(
            self, block, self.block_kwargs(), h, condition, context, context_mask
        )
        out = self.final_layer(h.reshape(batch, frames * patches, -1), condition)
        # out: [batch, frames * patches, p * p * out]
        out = unpatchify(out.reshape(batch * frames, patches, -1), grid, self.patch_size)
        return out.astype(jnp.float32).reshape(batch, frames, *out.shape[1:])

    def example_keywords(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Abstract keyword arguments of ``init`` (label, context) for one example."""
        out = {}
        if self.num_classes:
            out["label"] = jax.ShapeDtypeStruct((1,), jnp.int32)
        if self.context_features:
            out["context"] = jax.ShapeDtypeStruct((1, 1, self.context_features), jnp.float32)
        return out


@models.register("dit")
class DiT(DiTOptions, kw_only=True):
    """The diffusion transformer of Peebles & Xie (2023) over images or latents
    (module docstring); fields are :class:`DiTOptions`'. Every field is keyword-only.

    ``DiT(sample_size=32, patch_size=2, in_channels=4, emb_features=1152,
    num_layers=28, num_heads=16, mlp_features=4608, num_classes=1000,
    learn_sigma=True)`` is DiT-XL/2 on 256x256 ImageNet latents.
    """

    def example_inputs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract positional arguments of ``init``: one image and its timestep."""
        return (
            jax.ShapeDtypeStruct((1, *self.sample_shape, self.in_channels), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.float32),
        )

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        t: jax.Array,
        *,
        label: jax.Array | None = None,
        context: jax.Array | None = None,
        context_mask: jax.Array | None = None,
    ) -> jax.Array:
        """The prediction ``[batch, H, W, out_channels]`` (float32).

        x: ``[batch, height, width, in_channels]``, sides divisible by ``patch_size``.
        t: float ``[batch]`` (or a scalar): the timestep in the objective's scale
          (a DDPM index 0..999, flow ``1000 t``, EDM's ``c_noise``).
        label: int ``[batch]`` in ``[0, num_classes]``, ``num_classes`` = the null
          class; None = the null class for every row (class-conditional models).
        context: ``[batch, tokens, context_features]`` text embeddings (models
          with ``context_features > 0`` only, and then required).
        context_mask: optional boolean ``[batch, tokens]``; False = padding.
        """
        if x.ndim != 4:
            raise ValueError(
                f"DiT takes images [batch, height, width, channels], got shape "
                f"{tuple(x.shape)}; use VideoDiT for video [batch, frames, H, W, C]"
            )
        self.check_image(x, "DiT input x")
        out = self.predict_frames(
            x[:, None], t, label, context, context_mask, block=DiTBlock, frame_axis=False
        )
        return out[:, 0]

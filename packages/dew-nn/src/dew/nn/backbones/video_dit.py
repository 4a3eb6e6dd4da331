"""A video diffusion transformer with factorized space-time attention (Latte,
Ma et al., 2024, arXiv 2401.03048, its variant 1).

A video ``x [batch, frames, height, width, channels]`` is cut into the same
``p x p`` patches in every frame (:func:`dew.nn.backbones.dit.patchify`), each
embedded with its 2-D position, and conditioned as :class:`DiT` is (timestep,
class label, text context). Each of the ``num_layers`` layers is a pair of
adaLN-Zero blocks (:class:`dew.nn.backbones.block.DiTBlock`):

- **spatial**: attention among the patches of one frame (and cross-attention
  to the text context), frames folded into the batch: ``[batch * frames,
  patches, embed]``;
- **temporal**: attention among the frames at one patch position, patches
  folded into the batch: ``[batch * patches, frames, embed]``. The frame
  index enters as a 1-D sine-cosine embedding added to the block's modulated
  input (diffusers' ``BasicTransformerBlock(positional_embeddings='sinusoidal')``),
  computed for the frame count of the call: no fixed table, so one model runs
  on clips of any length.

A one-frame video has nothing to attend to in time: its temporal blocks are
skipped, and an image ``[batch, H, W, C]`` is read as such a video, so image
and video batches train the same spatial weights (Latte's image-video joint
training). A one-frame VideoDiT is then exactly the :class:`DiT` with its
spatial blocks.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import axes, models
from dew.nn.backbones.block import DiTBlock
from dew.nn.backbones.dit import VIDEO_AXES, DiTOptions
from dew.nn.backbones.vit import sincos_1d

TEMPORAL_AXES = (axes.BATCH, axes.FRAMES, axes.EMBED)  # [batch * patches, frames, embed]

_BLOCK_FIELDS = tuple(
    f.name for f in dataclasses.fields(DiTBlock) if f.name not in ("parent", "name")
)


class SpaceTimeBlock(DiTBlock):
    """A spatial then a temporal :class:`DiTBlock` (``spatial/``, ``temporal/``) over
    ``x [batch, frames, patches, embed]``; the temporal block has no cross-attention."""

    @nn.compact
    def __call__(self, x, condition, context=None, context_mask=None):
        batch, frames, patches, embed = x.shape
        fields = {name: getattr(self, name) for name in _BLOCK_FIELDS}
        h = x.reshape(batch * frames, patches, embed)
        repeat = None if context is None else jnp.repeat(context, frames, axis=0)
        repeat_mask = None if context_mask is None else jnp.repeat(context_mask, frames, axis=0)
        h = DiTBlock(**fields, name="spatial")(
            h, jnp.repeat(condition, frames, axis=0), repeat, repeat_mask
        )
        h = h.reshape(batch, frames, patches, embed)
        if frames > 1 or self.is_initializing():
            temporal = DiTBlock(
                **{**fields, "use_cross_attention": False, "token_axes": TEMPORAL_AXES},
                name="temporal",
            )
            h = h.transpose(0, 2, 1, 3).reshape(batch * patches, frames, embed)
            table = jnp.asarray(sincos_1d(embed, np.arange(frames)), jnp.float32)  # [frames, embed]
            h = temporal(h, jnp.repeat(condition, patches, axis=0), position_embed=table)
            h = h.reshape(batch, patches, frames, embed).transpose(0, 2, 1, 3)
        return nn.with_logical_constraint(h, VIDEO_AXES)


@models.register("video_dit")
class VideoDiT(DiTOptions, kw_only=True):
    """Latte's video DiT (module docstring): ``num_layers`` spatial + temporal block
    pairs. Fields are :class:`DiTOptions`' and:

    Attributes:
      num_frames: frames of the abstract example that ``init`` traces
        (``example_inputs``); None = 1. Calls take any frame count.
    """

    num_frames: int | None = None

    EXTRA_OPTIONAL = ("num_frames",)

    def example_inputs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract positional arguments of ``init``: one video and its timestep."""
        frames = self.num_frames or 1
        return (
            jax.ShapeDtypeStruct((1, frames, *self.sample_shape, self.in_channels), jnp.float32),
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
        """The prediction ``[batch, frames, H, W, out_channels]`` (float32); for an
        image batch ``[batch, H, W, C]`` (one frame) ``[batch, H, W, out_channels]``.

        x: ``[batch, frames, height, width, in_channels]`` (or an image batch).
        t, label, context, context_mask: as :class:`DiT` takes them (per clip).
        """
        if x.ndim not in (4, 5):
            raise ValueError(
                f"VideoDiT takes videos [batch, frames, height, width, channels] (or images "
                f"[batch, height, width, channels] as one-frame videos), got shape "
                f"{tuple(x.shape)}"
            )
        is_image = x.ndim == 4
        video = x[:, None] if is_image else x
        self.check_image(video, "VideoDiT input x")
        out = self.predict_frames(
            video, t, label, context, context_mask, block=SpaceTimeBlock, frame_axis=True
        )  # [batch, frames, H, W, out]
        return out[:, 0] if is_image else out

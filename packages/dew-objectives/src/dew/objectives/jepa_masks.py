"""Multi-block masks for JEPA: one context block and several target blocks.

I-JEPA (Assran et al., 2023, facebookresearch/ijepa ``src/masks/multiblock.py``):
on a grid of ``height x width`` patches, each target block has a scale
``s ~ U(0.15, 0.2)`` of the grid and an aspect ratio ``a ~ U(0.75, 1.5)``::

    area = floor(height * width * s);  rows = round(sqrt(area * a));  cols = round(sqrt(area / a))

(at most ``height - 1`` rows and ``width - 1`` columns), placed uniformly. The
context block has scale ``U(0.85, 1.0)`` and aspect 1, and every target patch
is removed from it. Video (V-JEPA ``multiblock3d``) draws the same spatial
blocks and extends each over all frames: tubes.

Everything is drawn from a key inside the compiled step, with arrays of a
static size, so a resumed run draws the same masks. The reference collator
truncates every mask of a batch to the shortest; here the sizes are fixed by
the configuration:

- a target block keeps ``target_keep`` of its patches (a random subset), the
  smallest area any block can have, so every kept index lies in its block;
- the context keeps ``context_keep`` patches: a random subset of the context
  block minus the targets, filled up from the other non-target patches when
  a draw leaves fewer; ``context_keep <= patches - num_targets * largest
  target`` guarantees that no target patch is ever in the context.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiBlock:
    """How context and target blocks are drawn (I-JEPA defaults).

    num_targets: target blocks per example (each predicted separately).
    target_scale: ``(low, high)`` fraction of the patch grid one target block covers.
    target_aspect: ``(low, high)`` rows / columns of a target block.
    context_scale: ``(low, high)`` fraction of the grid of the context block.
    context_aspect: ``(low, high)`` rows / columns of the context block.
    min_keep: the fewest context patches a configuration may keep; a grid too
      small for it is an error.
    context_keep: context patches kept per example (static); None = every
      patch no target can reach, ``patches - num_targets * largest target``.
    """

    num_targets: int = 4
    target_scale: tuple[float, float] = (0.15, 0.2)
    target_aspect: tuple[float, float] = (0.75, 1.5)
    context_scale: tuple[float, float] = (0.85, 1.0)
    context_aspect: tuple[float, float] = (1.0, 1.0)
    min_keep: int = 10
    context_keep: int | None = None

    def __post_init__(self):
        if self.num_targets < 1:
            raise ValueError(f"MultiBlock num_targets must be >= 1, got {self.num_targets}")
        for name in ("target_scale", "context_scale", "target_aspect", "context_aspect"):
            low, high = getattr(self, name)
            bound = 1.0 if "scale" in name else math.inf
            if not 0 < low <= high <= bound:
                raise ValueError(
                    f"MultiBlock {name} must be (low, high) with 0 < low <= high"
                    f"{' <= 1' if bound == 1.0 else ''}, got {(low, high)}"
                )
        if self.min_keep < 1:
            raise ValueError(f"MultiBlock min_keep must be >= 1 patches, got {self.min_keep}")

    def layout(self, frames: int, height: int, width: int) -> MaskLayout:
        """The static sizes for a grid of ``frames x height x width`` patches
        (``frames`` = 1 for images); raises ValueError when the grid is too small."""
        return MaskLayout(self, frames, height, width)


def _block_shape(area_scale, aspect, height, width, xp=jnp):
    """``(rows, cols)`` of a block: the I-JEPA formula, clipped to the grid."""
    area = xp.floor(height * width * area_scale)
    rows = xp.round(xp.sqrt(area * aspect))
    cols = xp.round(xp.sqrt(area / aspect))
    rows = xp.clip(rows, 1, max(height - 1, 1))
    cols = xp.clip(cols, 1, max(width - 1, 1))
    return rows, cols


def smallest_block(scale, aspect, height: int, width: int) -> int:
    """The smallest area the formula gives over ``scale x aspect`` (a dense scan)."""
    s = np.linspace(scale[0], scale[1], 65, dtype=np.float32)[:, None]
    a = np.linspace(aspect[0], aspect[1], 513, dtype=np.float32)[None, :]
    rows, cols = _block_shape(s, a, height, width, xp=np)
    return int(max(1, (rows * cols).min()))


def largest_block(scale, aspect, height: int, width: int) -> int:
    s = np.linspace(scale[0], scale[1], 65, dtype=np.float32)[:, None]
    a = np.linspace(aspect[0], aspect[1], 513, dtype=np.float32)[None, :]
    rows, cols = _block_shape(s, a, height, width, xp=np)
    area = rows * cols
    # a block topped up to the smallest area stays below smallest + one row or column
    topped = area.min() + max(rows.max(), cols.max()) - 1
    return int(min(height * width, max(area.max(), topped)))


@flax.struct.dataclass
class Masks:
    """One batch of masks; positions index the flattened ``[frames, height, width]`` grid.

    context: ``[batch, context_keep]`` int32, the patches the context encoder reads (sorted).
    targets: ``[batch, num_targets, target_keep]`` int32, the patches each
      target block asks the predictor for (sorted).
    context_block: ``[batch, patches]`` bool, the whole context block (before
      the targets are removed), for inspection.
    target_blocks: ``[batch, num_targets, patches]`` bool, the whole target blocks.
    """

    context: jax.Array
    targets: jax.Array
    context_block: jax.Array
    target_blocks: jax.Array


class MaskLayout:
    """:class:`MultiBlock` on one patch grid: the static sizes and the sampler."""

    def __init__(self, spec: MultiBlock, frames: int, height: int, width: int):
        self.spec, self.frames, self.height, self.width = spec, frames, height, width
        self.patches = frames * height * width
        self.target_keep = frames * smallest_block(
            spec.target_scale, spec.target_aspect, height, width
        )
        most = frames * largest_block(spec.target_scale, spec.target_aspect, height, width)
        free = self.patches - spec.num_targets * most
        keep = free if spec.context_keep is None else spec.context_keep
        if free < spec.min_keep or keep > free or keep < spec.min_keep:
            raise ValueError(
                f"a grid of {frames}x{height}x{width} patches leaves {free} patches that "
                f"{spec.num_targets} target blocks of up to {most} patches cannot reach; "
                f"context_keep={spec.context_keep} must be in [min_keep={spec.min_keep}, {free}]. "
                f"Use fewer or smaller target blocks (num_targets, target_scale), a larger "
                f"image or smaller patches"
            )
        self.context_keep = keep

    def __repr__(self):
        return (
            f"MaskLayout(grid={self.frames}x{self.height}x{self.width}, "
            f"context_keep={self.context_keep}, target_keep={self.target_keep}, "
            f"num_targets={self.spec.num_targets})"
        )

    def _block(self, key, scale, aspect, min_area):
        k_scale, k_aspect, k_top, k_left = jax.random.split(key, 4)
        s = jax.random.uniform(k_scale, (), minval=scale[0], maxval=scale[1])
        a = jax.random.uniform(k_aspect, (), minval=aspect[0], maxval=aspect[1])
        rows, cols = _block_shape(s, a, self.height, self.width)
        # float rounding on the device may differ from the host scan: top up to min_area
        max_rows, max_cols = max(self.height - 1, 1), max(self.width - 1, 1)
        cols = jnp.where(
            rows * cols < min_area, jnp.minimum(jnp.ceil(min_area / rows), max_cols), cols
        )
        rows = jnp.where(
            rows * cols < min_area, jnp.minimum(jnp.ceil(min_area / cols), max_rows), rows
        )
        rows, cols = rows.astype(jnp.int32), cols.astype(jnp.int32)
        top = jax.random.randint(k_top, (), 0, self.height - rows + 1)
        left = jax.random.randint(k_left, (), 0, self.width - cols + 1)
        r = jnp.arange(self.height)[:, None]
        c = jnp.arange(self.width)[None, :]
        inside = (r >= top) & (r < top + rows) & (c >= left) & (c < left + cols)
        # a tube: the same spatial block in every frame
        return jnp.broadcast_to(inside, (self.frames, self.height, self.width)).reshape(-1)

    def _one(self, key):
        spec = self.spec
        k_context, k_targets, k_pick_c, k_pick_t = jax.random.split(key, 4)
        min_area = self.target_keep // self.frames
        blocks = jax.vmap(
            lambda k: self._block(k, spec.target_scale, spec.target_aspect, min_area)
        )(jax.random.split(k_targets, spec.num_targets))  # [num_targets, patches]
        context_block = self._block(k_context, spec.context_scale, spec.context_aspect, 1)
        covered = blocks.any(axis=0)
        # priority: context block minus targets, then other non-target patches, never a target
        tier = jnp.where(covered, 0.0, jnp.where(context_block, 2.0, 1.0))
        noise = jax.random.uniform(k_pick_c, (self.patches,))
        _, context = jax.lax.top_k(tier + noise, self.context_keep)
        noise = jax.random.uniform(k_pick_t, blocks.shape)
        _, targets = jax.lax.top_k(blocks + noise, self.target_keep)
        return Masks(
            context=jnp.sort(context).astype(jnp.int32),
            targets=jnp.sort(targets, axis=-1).astype(jnp.int32),
            context_block=context_block,
            target_blocks=blocks,
        )

    def sample(self, key: jax.Array, batch: int) -> Masks:
        """Masks for ``batch`` examples, a pure function of ``key``."""
        return self.sample_rows(jax.random.split(key, batch))

    def sample_rows(self, keys: jax.Array) -> Masks:
        """Masks for one example per key (``Step.row_keys``: the same mask for a row
        whatever the accumulation and the device count)."""
        return jax.vmap(self._one)(keys)

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
- the context keeps ``context_keep`` patches of the context block minus the
  targets, as I-JEPA's context: by default the 5th percentile of that count
  over the sampler's own draws (I-JEPA truncates every context of a batch to
  the shortest), and never fewer than the patches no target can reach. A draw
  whose context block minus the targets is too small is redrawn (up to
  ``draws`` candidates, the first that fits is used, as the reference retries);
  when that count is below the worst case, the context is filled up from the
  other non-target patches. No target patch is ever in the context: should
  every candidate fail (a chance below ``0.05 ** draws``), the example's
  blocks are its first target block repeated.

Earlier versions kept only that worst case (every target block at its
largest, none overlapping): on 14 x 14 patches with 4 targets 28 patches,
where I-JEPA's collator keeps about 54 at a batch of 32 (docs/jepa.md).
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
    context_keep: context patches kept per example (static); None = I-JEPA's
      size: the ``context_quantile`` of ``|context block - targets|`` over the
      sampler's draws, or every patch no target can reach (``patches -
      num_targets * largest target``) where that is more.
    context_quantile: the quantile of the default ``context_keep`` (0.05).
    draws: candidate draws per example for a context of ``context_keep``
      (the first that fits is used; static, vectorised).
    """

    num_targets: int = 4
    target_scale: tuple[float, float] = (0.15, 0.2)
    target_aspect: tuple[float, float] = (0.75, 1.5)
    context_scale: tuple[float, float] = (0.85, 1.0)
    context_aspect: tuple[float, float] = (1.0, 1.0)
    min_keep: int = 10
    context_keep: int | None = None
    context_quantile: float = 0.05
    draws: int = 8

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
        if not 0.0 <= self.context_quantile <= 1.0:
            raise ValueError(
                f"MultiBlock context_quantile must be in [0, 1], got {self.context_quantile}"
            )
        if self.draws < 1:
            raise ValueError(f"MultiBlock draws must be >= 1, got {self.draws}")

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


def context_counts(spec: MultiBlock, height: int, width: int, samples: int = 2000) -> np.ndarray:
    """``|context block - targets|`` (spatial patches) of ``samples`` draws of the
    I-JEPA rule on the host (numpy, a fixed seed): what the default
    ``context_keep`` is a quantile of."""
    rng = np.random.default_rng(0)

    def blocks(n, scale, aspect):
        s = rng.uniform(*scale, (samples, n))
        a = rng.uniform(*aspect, (samples, n))
        rows, cols = _block_shape(s, a, height, width, xp=np)
        top = np.floor(rng.uniform(size=(samples, n)) * (height - rows + 1))
        left = np.floor(rng.uniform(size=(samples, n)) * (width - cols + 1))
        r = np.arange(height)[:, None]
        c = np.arange(width)[None, :]
        t, lf, h, w = (v[..., None, None] for v in (top, left, rows, cols))
        return (r >= t) & (r < t + h) & (c >= lf) & (c < lf + w)  # [samples, n, H, W]

    covered = blocks(spec.num_targets, spec.target_scale, spec.target_aspect).any(axis=1)
    context = blocks(1, spec.context_scale, spec.context_aspect)[:, 0]
    return (context & ~covered).sum(axis=(1, 2))


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
        largest = frames * largest_block(spec.target_scale, spec.target_aspect, height, width)
        # every patch no target can reach: a context this size never needs a redraw
        self.free = self.patches - spec.num_targets * largest
        # the fallback draw (one target block) must leave room for the context
        room = self.patches - largest
        if spec.context_keep is None:
            counts = context_counts(spec, height, width)
            typical = frames * int(np.floor(np.quantile(counts, spec.context_quantile)))
            keep = min(max(self.free, typical), room)
        else:
            keep = spec.context_keep
        if keep < spec.min_keep or keep > room:
            raise ValueError(
                f"a grid of {frames}x{height}x{width} patches with {spec.num_targets} target "
                f"blocks of up to {largest} patches keeps a context of {keep} patches "
                f"(context_keep={spec.context_keep}); it must be in [min_keep={spec.min_keep}, "
                f"{room}]. Use fewer or smaller target blocks (num_targets, target_scale), a "
                f"larger context block (context_scale), a larger image or smaller patches"
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

    def _draw(self, k_context, k_targets):
        """One candidate: ``(target blocks [n, patches], context block [patches])``."""
        spec = self.spec
        min_area = self.target_keep // self.frames
        blocks = jax.vmap(
            lambda k: self._block(k, spec.target_scale, spec.target_aspect, min_area)
        )(jax.random.split(k_targets, spec.num_targets))  # [num_targets, patches]
        context_block = self._block(k_context, spec.context_scale, spec.context_aspect, 1)
        return blocks, context_block

    def _one(self, key):
        spec = self.spec
        k_context, k_targets, k_pick_c, k_pick_t = jax.random.split(key, 4)
        if self.context_keep <= self.free:  # every draw fits
            blocks, context_block = self._draw(k_context, k_targets)
        else:  # the first of `draws` candidates whose context block minus targets fits
            keys = jax.random.split(k_context, (2, spec.draws))
            blocks, context_blocks = jax.vmap(self._draw)(keys[0], keys[1])
            room = (context_blocks & ~blocks.any(axis=1)).sum(axis=-1)  # [draws]
            fits = room >= self.context_keep
            first = jnp.argmax(fits)
            # none fits (< 0.05 ** draws): the first target block alone, repeated
            single = jnp.broadcast_to(blocks[0, :1], blocks.shape[1:])
            blocks = jnp.where(fits.any(), blocks[first], single)
            context_block = context_blocks[first]
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

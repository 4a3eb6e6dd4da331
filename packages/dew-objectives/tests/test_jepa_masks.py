"""Multi-block masks against a numpy reading of the I-JEPA rules: indices in
range, context disjoint from the targets, blocks are rectangles whose shapes the
scale/aspect formula can give, tubes over all frames, a pure function of the key."""

import itertools

import jax
import numpy as np
import pytest

from dew.objectives.jepa.masks import MultiBlock


def reachable_shapes(scale, aspect, height, width):
    """Every (rows, cols) the I-JEPA formula gives over a dense (scale, aspect) grid, float64."""
    shapes = set()
    for s, a in itertools.product(np.linspace(*scale, 401), np.linspace(*aspect, 401)):
        area = np.floor(height * width * s)
        rows = int(np.clip(np.round(np.sqrt(area * a)), 1, max(height - 1, 1)))
        cols = int(np.clip(np.round(np.sqrt(area / a)), 1, max(width - 1, 1)))
        shapes.add((rows, cols))
    return shapes


def rectangle(mask2d):
    """(rows, cols) of a mask that is exactly one filled rectangle, else None."""
    rows, cols = np.nonzero(mask2d)
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    if mask2d.sum() != (r1 - r0) * (c1 - c0):
        return None
    return int(r1 - r0), int(c1 - c0)


@pytest.fixture(scope="module")
def drawn():
    spec = MultiBlock()  # the I-JEPA defaults on ViT/14 at 224 pixels: 14 x 14 patches
    layout = spec.layout(1, 14, 14)
    masks = jax.device_get(jax.jit(lambda k: layout.sample(k, 64))(jax.random.key(3)))
    return spec, layout, masks


def test_indices_in_range_sorted_and_distinct(drawn):
    _, layout, masks = drawn
    assert masks.context.shape == (64, layout.context_keep)
    assert masks.targets.shape == (64, 4, layout.target_keep)
    for idx in [masks.context, masks.targets]:
        assert idx.min() >= 0 and idx.max() < 196
        assert np.all(np.diff(idx, axis=-1) > 0)  # sorted, no repeats


def test_context_is_disjoint_from_every_target_block(drawn):
    _, _, masks = drawn
    for b in range(64):
        covered = masks.target_blocks[b].any(axis=0)
        assert not covered[masks.context[b]].any()
        # the kept context lies in the context block whenever it has room
        room = (masks.context_block[b] & ~covered).sum()
        inside = masks.context_block[b][masks.context[b]].sum()
        assert inside == min(room, masks.context.shape[1])


def test_targets_lie_in_their_blocks(drawn):
    _, _, masks = drawn
    for b, t in itertools.product(range(64), range(4)):
        assert masks.target_blocks[b, t][masks.targets[b, t]].all()


def test_block_shapes_follow_the_scale_and_aspect_bounds(drawn):
    spec, layout, masks = drawn
    targets = reachable_shapes(spec.target_scale, spec.target_aspect, 14, 14)
    contexts = reachable_shapes(spec.context_scale, spec.context_aspect, 14, 14)
    seen = set()
    for b in range(64):
        shape = rectangle(masks.context_block[b].reshape(14, 14))
        assert shape in contexts, shape
        for t in range(4):
            shape = rectangle(masks.target_blocks[b, t].reshape(14, 14))
            assert shape in targets, (shape, sorted(targets))
            assert shape[0] * shape[1] >= layout.target_keep
            seen.add(shape)
    assert len(seen) >= 3  # sizes and aspects vary
    # 0.15..0.2 of 196 patches with aspect 0.75..1.5 (hand-worked: 29..39 patches)
    assert all(20 <= r * c <= 42 for r, c in seen)


def test_video_blocks_are_tubes_over_all_frames():
    layout = MultiBlock(num_targets=2, min_keep=4).layout(3, 6, 6)
    masks = jax.device_get(layout.sample(jax.random.key(0), 5))
    blocks = masks.target_blocks.reshape(5, 2, 3, 36)
    np.testing.assert_array_equal(
        blocks[:, :, 1:], np.broadcast_to(blocks[:, :, :1], blocks[:, :, 1:].shape)
    )
    context = masks.context_block.reshape(5, 3, 36)
    np.testing.assert_array_equal(
        context[:, 1:], np.broadcast_to(context[:, :1], context[:, 1:].shape)
    )
    assert layout.target_keep % 3 == 0 and masks.targets.max() < 108


def test_same_key_same_masks_other_key_other_masks():
    layout = MultiBlock().layout(1, 14, 14)
    a = jax.device_get(layout.sample(jax.random.key(7), 8))
    b = jax.device_get(layout.sample(jax.random.key(7), 8))
    c = jax.device_get(layout.sample(jax.random.key(8), 8))
    np.testing.assert_array_equal(a.context, b.context)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.targets, c.targets)
    assert not np.array_equal(a.context, c.context)


def test_a_grid_too_small_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"4x4 patches with 4 target blocks .*num_targets"):
        MultiBlock().layout(1, 4, 4)
    with pytest.raises(ValueError, match="context_keep=500"):
        MultiBlock(context_keep=500).layout(1, 14, 14)
    with pytest.raises(ValueError, match="target_scale"):
        MultiBlock(target_scale=(0.3, 0.2))


def test_default_context_is_ijepa_size_and_redraws_keep_it_disjoint(drawn):
    """The default context is the 5th percentile of |context block - targets| under
    I-JEPA's rule (here a numpy reading of it of its own), not the old worst case
    (every target at its largest, none overlapping: 196 - 4 * 42 = 28)."""
    _, layout, masks = drawn
    rng = np.random.default_rng(5)
    counts = []
    for _ in range(3000):
        covered = np.zeros((14, 14), bool)
        for scale, aspect, n in (((0.15, 0.2), (0.75, 1.5), 4), ((0.85, 1.0), (1.0, 1.0), 1)):
            for _ in range(n):
                area = np.floor(196 * rng.uniform(*scale))
                a = rng.uniform(*aspect)
                rows = int(np.clip(np.round(np.sqrt(area * a)), 1, 13))
                cols = int(np.clip(np.round(np.sqrt(area / a)), 1, 13))
                top, left = rng.integers(0, 15 - rows), rng.integers(0, 15 - cols)
                block = np.zeros((14, 14), bool)
                block[top : top + rows, left : left + cols] = True
                if n == 4:
                    covered |= block
        counts.append((block & ~covered).sum())
    assert abs(layout.context_keep - np.quantile(counts, 0.05)) <= 2, layout
    assert layout.context_keep >= 50 > layout.free == 28
    # every kept context lies inside its context block (the redraws found room)
    assert all(masks.context_block[b][masks.context[b]].all() for b in range(64))


def test_when_no_draw_fits_the_first_target_block_is_repeated():
    layout = MultiBlock(context_keep=100, draws=1).layout(1, 14, 14)
    masks = jax.device_get(layout.sample(jax.random.key(0), 32))
    room = (masks.context_block & ~masks.target_blocks.any(axis=1)).sum(-1)
    repeated = (masks.target_blocks == masks.target_blocks[:, :1]).all(axis=(1, 2))
    assert repeated.sum() >= 16  # most single draws leave fewer than 100
    for b in range(32):
        covered = masks.target_blocks[b].any(axis=0)
        assert not covered[masks.context[b]].any()
        assert repeated[b] or room[b] >= 100

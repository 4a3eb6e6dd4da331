"""Each mask policy against a numpy boolean mask built pair by pair from its
definition, and how padding, segments and explicit masks combine with it."""

import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import masks

RNG = np.random.default_rng(0)
# positions with left padding (row 1), and a packed row restarting at 0 (row 2)
POSITIONS = np.array(
    [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 0, 0, 0, 1, 2, 3, 4],
        [0, 1, 2, 0, 1, 2, 3, 4],
    ]
)
VALID = np.array([[True] * 8, [False] * 3 + [True] * 5, [True] * 8])
SEGMENTS = np.array([[0] * 8, [0] * 8, [0] * 3 + [1] * 5])
INDEX = np.arange(8)

POLICIES = {
    "causal": (masks.causal(), dict(kind="causal")),
    "full": (masks.full(), dict(kind="full")),
    "sliding": (masks.sliding_window(3), dict(kind="causal", window=3)),
    "sliding_bidirectional": (masks.sliding_window(2, causal=False), dict(kind="full", window=2)),
    "block_causal": (masks.block_causal(3), dict(kind="block_causal", block_size=3)),
    "block_causal_window": (
        masks.block_causal(2, window=3),
        dict(kind="block_causal", block_size=2, window=3),
    ),
}


def combine(allowed, valid, segments=None, explicit=None, slot_causal=False):
    """The documented combination, in numpy: AND everything, then a query that
    sees nothing sees its own slot."""
    out = allowed & valid[:, None, :]
    if slot_causal:
        out &= np.tril(np.ones((8, 8), bool))
    if segments is not None:
        out &= segments[:, :, None] == segments[:, None, :]
    if explicit is not None:
        out &= explicit
    return out | (np.eye(8, dtype=bool) & ~out.any(-1, keepdims=True))


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_equals_its_numpy_definition(name, reference):
    policy, definition = POLICIES[name]
    allowed = reference.allowed(**definition, query_positions=POSITIONS, key_positions=POSITIONS)
    got = policy.allows(jnp.asarray(POSITIONS), jnp.asarray(POSITIONS))
    np.testing.assert_array_equal(np.asarray(got), allowed)

    got = masks.attention_mask(
        policy,
        jnp.asarray(POSITIONS),
        jnp.asarray(POSITIONS),
        jnp.asarray(VALID),
        jnp.asarray(INDEX),
        jnp.asarray(INDEX),
        query_segments=jnp.asarray(SEGMENTS),
        key_segments=jnp.asarray(SEGMENTS),
    )
    want = combine(allowed, VALID, SEGMENTS, slot_causal=policy.is_causal)
    np.testing.assert_array_equal(np.asarray(got)[:, 0], want)


def test_hand_worked_block_causal():
    """Blocks of 2 over positions 0..5: a query sees its own block and earlier ones."""
    pos = jnp.arange(6)[None]
    got = np.asarray(masks.block_causal(2).allows(pos, pos))[0].astype(int)
    want = np.array(
        [
            [1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1],
        ]
    )
    np.testing.assert_array_equal(got, want)


def test_an_explicit_mask_is_anded_and_empty_rows_see_themselves():
    explicit = RNG.random((3, 8, 8)) < 0.3
    explicit[0, 5] = False  # a row with nothing visible
    got = masks.attention_mask(
        masks.full(),
        jnp.asarray(POSITIONS),
        jnp.asarray(POSITIONS),
        jnp.asarray(VALID),
        jnp.asarray(INDEX),
        jnp.asarray(INDEX),
        query_key_mask=jnp.asarray(explicit),
    )
    want = combine(np.ones((3, 8, 8), bool), VALID, explicit=explicit)
    np.testing.assert_array_equal(np.asarray(got)[:, 0], want)
    assert np.asarray(got)[0, 0, 5].tolist() == [False] * 5 + [True] + [False] * 2


def test_causal_hides_later_cache_slots_even_at_equal_positions():
    """Left padding repeats position 0; a query never reads a slot after its own."""
    pos = jnp.zeros((1, 4), jnp.int32)
    got = masks.attention_mask(
        masks.causal(), pos, pos, jnp.ones((1, 4), bool), jnp.arange(4), jnp.arange(4)
    )
    np.testing.assert_array_equal(np.asarray(got)[0, 0], np.tril(np.ones((4, 4), bool)))


def test_bad_policies_and_masks_are_refused():
    with pytest.raises(ValueError, match="unknown mask kind 'diagonal'"):
        masks.MaskPolicy(kind="diagonal")
    with pytest.raises(ValueError, match="window must be >= 1 position.*got 0"):
        masks.causal(window=0)
    with pytest.raises(ValueError, match="block_size 4 is for kind 'block_causal' only"):
        masks.MaskPolicy(kind="full", block_size=4)
    with pytest.raises(ValueError, match="block_size None is for kind 'block_causal' only"):
        masks.MaskPolicy(kind="block_causal")
    pos = jnp.zeros((1, 4), jnp.int32)
    args = (masks.full(), pos, pos, jnp.ones((1, 4), bool), jnp.arange(4), jnp.arange(4))
    with pytest.raises(ValueError, match=r"shape \(1, 4\); it must be \[batch, query, key\]"):
        masks.attention_mask(*args, query_key_mask=jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="give both query_segments and key_segments"):
        masks.attention_mask(*args, query_segments=pos)


@pytest.mark.parametrize("length,block_size", [(8, 2), (8, 4), (8, 8), (6, 1)])
def test_block_diffusion_mask_is_bd3lms_block_diff_mask(length, block_size):
    """Against a transcription of kuleshov-group/bd3lms models/dit.py::block_diff_mask."""
    q = np.arange(2 * length)[:, None]
    k = np.arange(2 * length)[None, :]
    x0_q, x0_k = q >= length, k >= length
    block_q = np.where(x0_q, (q - length) // block_size, q // block_size)
    block_k = np.where(x0_k, (k - length) // block_size, k // block_size)
    diagonal = (block_q == block_k) & (x0_q == x0_k)
    offset = (block_q > block_k) & x0_k & ~x0_q
    causal = (block_q >= block_k) & x0_k & x0_q
    want = diagonal | offset | causal
    np.testing.assert_array_equal(masks.block_diffusion_mask(length, block_size)[0], want)
    with pytest.raises(ValueError, match=r"length 8, block_size 3"):
        masks.block_diffusion_mask(8, 3)

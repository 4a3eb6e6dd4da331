"""Which keys each query may attend to: attention-mask policies and how they combine.

A :class:`MaskPolicy` decides visibility from token positions alone, so one
frozen value describes a backbone's attention and serialises with its config:

============================  ==========================================================
``causal()``                  key position <= query position (decoders; GPT, Llama)
``full()``                    every key (bidirectional encoders; BERT, ViT, DiT)
``sliding_window(w)``         causal and fewer than ``w`` positions back (Mistral);
                              ``causal=False``: fewer than ``w`` either side (Longformer)
``block_causal(b)``           keys in the query's own block of ``b`` positions or an
                              earlier one (block diffusion; Arriola et al., 2025)
============================  ==========================================================

Block diffusion's vectorised training pass reads ``[noisy | clean]`` rows whose two
halves share positions; :func:`block_diffusion_mask` is its ``[2L, 2L]`` mask: the
``block_causal`` policy over those positions AND which half each slot is in
(:class:`BlockDiffusionMask`, the same mask as a structure, lets attention skip its
empty blocks).

At call time :func:`attention_mask` ANDs the policy with what varies per
batch: padding (``key_valid``), packed-sequence segments (a query sees only
keys of its own segment) and an arbitrary boolean ``[batch, query, key]``
mask. Use ``full()`` with an explicit mask for a mask the policies cannot
express.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import check_keywords

KINDS = ("causal", "full", "block_causal")


@check_keywords
@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskPolicy:
    """A position-based visibility rule; build one with :func:`causal`, :func:`full`,
    :func:`sliding_window` or :func:`block_causal`.

    kind: ``'causal'`` (keys at or before the query's position), ``'full'``
      (every key) or ``'block_causal'`` (keys whose block ``position //
      block_size`` is at or before the query's block).
    window: in addition, only keys fewer than ``window`` positions away
      (``|query - key| < window``: for a causal kind, the query and the
      ``window - 1`` positions before it); None = no limit.
    block_size: positions per block; ``'block_causal'`` only.
    """

    kind: str = "causal"
    window: int | None = None
    block_size: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown mask kind {self.kind!r}; use one of {KINDS}")
        if self.window is not None and self.window < 1:
            raise ValueError(
                f"mask window must be >= 1 position (1 = the query's own position only), "
                f"got {self.window}; use None for no window"
            )
        if (self.kind == "block_causal") != (self.block_size is not None):
            raise ValueError(
                f"block_size {self.block_size} is for kind 'block_causal' only (got kind "
                f"{self.kind!r}); give block_size exactly when kind='block_causal'"
            )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 position, got {self.block_size}")

    @property
    def is_causal(self) -> bool:
        """True when no key after the query's position is ever visible."""
        return self.kind == "causal"

    def allows(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """Boolean ``[batch, query, key]``: the policy alone, from ``[batch, query]``
        and ``[batch, key]`` positions."""
        xp = _namespace(query_positions, key_positions)
        qp = query_positions[:, :, None]  # [batch, query, 1]
        kp = key_positions[:, None, :]  # [batch, 1, key]
        if self.kind == "causal":
            allowed = kp <= qp
        elif self.kind == "block_causal":
            allowed = kp // self.block_size <= qp // self.block_size
        else:
            allowed = xp.ones(np.broadcast_shapes(qp.shape, kp.shape), bool)
        if self.window is not None:
            allowed = allowed & (xp.abs(qp - kp) < self.window)
        return allowed


def _namespace(*arrays):
    """numpy when every array is a numpy array (a mask that is a constant of the
    program, computed on the host without compiling anything), else jax.numpy."""
    return np if all(isinstance(a, np.ndarray) for a in arrays if a is not None) else jnp


def causal(window: int | None = None) -> MaskPolicy:
    """Keys at or before the query's position (and within ``window`` of it)."""
    return MaskPolicy(kind="causal", window=window)


def full(window: int | None = None) -> MaskPolicy:
    """Every key (bidirectional), or those fewer than ``window`` positions away."""
    return MaskPolicy(kind="full", window=window)


def sliding_window(size: int, *, causal: bool = True) -> MaskPolicy:
    """Keys fewer than ``size`` positions from the query: behind it (causal, as
    Mistral) or on either side (``causal=False``)."""
    return MaskPolicy(kind="causal" if causal else "full", window=size)


def block_causal(block_size: int, window: int | None = None) -> MaskPolicy:
    """Keys in the query's block of ``block_size`` positions (both directions) or
    in an earlier block: block diffusion's attention (Arriola et al., 2025, BD3-LM)."""
    return MaskPolicy(kind="block_causal", block_size=block_size, window=window)


def block_diffusion_mask(length: int, block_size: int) -> np.ndarray:
    """Boolean ``[1, 2 length, 2 length]``: BD3-LM's mask over ``[noisy | clean]``
    (Arriola et al., 2025, ``models/dit.py::block_diff_mask``), for ``query_key_mask``.

    Slots ``0..length-1`` hold the noisy ``z_t`` and ``length..2 length-1`` the clean
    ``x0``, both at positions ``0..length-1``; ``b(i)`` is slot ``i``'s block of
    ``block_size`` positions. A noisy query sees the noisy keys of its own block
    (block-diagonal) and the clean keys of earlier blocks (offset block-causal); a
    clean query sees the clean keys of its block and earlier ones (block-causal)::

        M = (b_q == b_k & half_q == half_k) | (b_q > b_k & clean_k & noisy_q)
            | (b_q >= b_k & clean_k & clean_q)

    Every allowed pair is allowed by ``block_causal(block_size)`` over the positions,
    so the mask is that policy AND the halves' rule (a numpy constant).
    """
    if length < 1 or block_size < 1 or length % block_size:
        raise ValueError(
            f"block diffusion needs a length that is a multiple of block_size: length "
            f"{length}, block_size {block_size}; use rows of k * {block_size} tokens"
        )
    positions = np.concatenate([np.arange(length), np.arange(length)])[None]  # [1, 2L]
    allowed = block_causal(block_size).allows(positions, positions)  # [1, 2L, 2L]
    clean = np.arange(2 * length) >= length
    block = positions[0] // block_size
    same_block = block[:, None] == block[None, :]
    cq, ck = clean[:, None], clean[None, :]
    halves = (same_block & (cq == ck)) | (ck & ~cq & (block[:, None] > block[None, :])) | (cq & ck)
    return allowed & halves[None]


@dataclasses.dataclass(frozen=True)
class BlockDiffusionMask:
    """:func:`block_diffusion_mask` ``(length, block_size)`` as a structure, for
    ``query_key_mask``: :class:`dew.nn.Attention` then computes only its non-empty
    pieces (:func:`dew.nn.attention.attend_block_diffusion`: the clean half
    block-causal over ``length`` keys, the noisy half over its own block and the clean
    keys) instead of the dense ``[2 length, 2 length]`` scores; the same values.
    A static pytree (no leaves), so it passes through ``jit`` and ``nn.scan``."""

    length: int
    block_size: int

    def __post_init__(self):
        block_diffusion_mask(self.length, self.block_size)  # validates

    @property
    def shape(self) -> tuple[int, int, int]:
        return (1, 2 * self.length, 2 * self.length)

    def dense(self) -> np.ndarray:
        """The boolean ``[1, 2 length, 2 length]`` mask."""
        return block_diffusion_mask(self.length, self.block_size)


jax.tree_util.register_static(BlockDiffusionMask)


def attention_mask(
    policy: MaskPolicy,
    query_positions: jax.Array,
    key_positions: jax.Array,
    key_valid: jax.Array,
    query_index: jax.Array,
    key_index: jax.Array,
    *,
    query_segments: jax.Array | None = None,
    key_segments: jax.Array | None = None,
    query_key_mask: jax.Array | None = None,
) -> jax.Array:
    """Boolean ``[batch, 1, query, key]``: the policy AND padding AND segments AND
    the explicit mask.

    query_positions, key_positions: ``[batch, query]``, ``[batch, key]`` token positions.
    key_valid: ``[batch, key]``, False for padding (and for empty cache slots).
    query_index, key_index: ``[query]``, ``[key]`` slots in the sequence (or the
      cache). A causal policy also hides keys in later slots, so a slot that a
      cache has not filled, or a duplicated position, is never read early.
    query_segments, key_segments: optional ``[batch, query]``, ``[batch, key]``
      ids of packed sequences; a query sees keys of its own segment only.
    query_key_mask: optional boolean ``[batch, query, key]``; False hides a key.

    A query that would see no key at all (a padding token before the first real
    one) sees its own slot, so no softmax is empty and no NaN appears.
    """
    if isinstance(query_key_mask, BlockDiffusionMask):
        query_key_mask = query_key_mask.dense()
    xp = _namespace(
        query_positions, key_positions, key_valid, query_index, key_index,
        query_segments, key_segments, query_key_mask,
    )  # fmt: skip
    mask = key_valid[:, None, :] & policy.allows(query_positions, key_positions)
    own_slot = key_index[None, None, :] == query_index[None, :, None]  # [1, query, key]
    if policy.is_causal:
        mask = mask & (key_index[None, None, :] <= query_index[None, :, None])
    if query_segments is not None or key_segments is not None:
        if query_segments is None or key_segments is None:
            raise ValueError(
                "give both query_segments and key_segments, or neither "
                f"(got {'query' if key_segments is None else 'key'}_segments only)"
            )
        mask = mask & (query_segments[:, :, None] == key_segments[:, None, :])
    if query_key_mask is not None:
        want = mask.shape
        if query_key_mask.ndim != 3 or not all(
            a in (1, b) for a, b in zip(query_key_mask.shape, want, strict=True)
        ):
            raise ValueError(
                f"query_key_mask has shape {query_key_mask.shape}; it must be [batch, query, "
                f"key] = {want} (the key length is the cache length when decoding)"
            )
        mask = mask & query_key_mask.astype(bool)
    mask = mask | (own_slot & ~xp.any(mask, axis=-1, keepdims=True))
    return mask[:, None, :, :]

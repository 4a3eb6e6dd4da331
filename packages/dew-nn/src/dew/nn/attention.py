"""Multi-head attention with grouped-query heads, RoPE, a mask policy and a KV cache."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import axes
from dew.nn.dense import token_rows
from dew.nn.fused_attention import (
    check_kernel_options,
    choose_kernel,
    cudnn_attention,
    segments_of,
    splash_attention,
)
from dew.nn.masks import BlockDiffusionMask, MaskPolicy, attention_mask, causal, full
from dew.nn.norms import RMSNorm
from dew.nn.rope import RopeScaling, apply_axial_rope, apply_rope, inverse_frequencies
from dew.nn.shards import shard_count

# What a named remat policy (dew.nn.stack.REMAT_POLICIES) may keep: the projections'
# outputs carry these names (jax.ad_checkpoint.checkpoint_name), MaxText's.
checkpoint_name = jax.ad_checkpoint.checkpoint_name


class Attention(nn.Module):
    """Self-attention (Vaswani et al., 2017) with grouped-query heads (Ainslie
    et al., 2023): ``num_heads`` query heads share ``num_kv_heads`` key/value heads.

    Which keys a query sees is ``mask`` (a :class:`dew.nn.masks.MaskPolicy`:
    causal by default, full, sliding window, block-causal) AND the call's
    padding, segment ids and optional explicit ``[batch, query, key]`` mask
    (:func:`dew.nn.masks.attention_mask`).

    With ``decode=True`` keys and values go into the ``cache`` collection
    (``key``, ``value`` ``[batch, kv_heads, cache_length, head_dim]``,
    ``positions``, ``valid`` ``[batch, cache_length]`` and ``index``); the cache
    length is the length of the sequence the cache was initialised with.

    Tokens on a grid (patches, tubelets) give ``positions`` as coordinates
    ``[batch, length, axes]``: the rotary embedding is then V-JEPA 2's axial one
    (:func:`dew.nn.rope.apply_axial_rope`, base ``rope_theta``), and the mask
    must be ``masks.full()``, since coordinates do not order the tokens.

    On the CPU backend, causal self-attention over :data:`CAUSAL_BLOCKS_FROM`
    tokens or more runs in blocks of queries (:func:`attend_in_query_blocks`):
    the same values in less time.

    ``kernel``: which attention kernel runs outside cached decoding: ``'auto'``
    (splash on a TPU, cuDNN on a GPU, the XLA path on the CPU, when that kernel can
    serve the mask), ``'xla'``, ``'splash'`` or ``'cudnn'``
    (:mod:`dew.nn.fused_attention`, which says what each serves);
    ``kernel_block_size``: splash's block size (a multiple of 128; None = the
    largest of 512, 256, 128 dividing the length). Cached decoding always runs the
    XLA path over the cache.

    ``qk_norm``: an RMSNorm over each head's features of the queries and keys,
    after the projection and before the rotary embedding (Qwen3, OLMo 2);
    parameters ``query_norm/scale`` and ``key_norm/scale`` ``[head_dim]``, epsilon
    ``qk_norm_eps``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float | None = 10000.0
    rope_scaling: RopeScaling | None = None
    mask: MaskPolicy = causal()
    use_qkv_bias: bool = False
    use_out_bias: bool = False
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    kernel: str = "auto"
    kernel_block_size: int | None = None

    def __post_init__(self):
        check_kernel_options(self.kernel, self.kernel_block_size)
        super().__post_init__()

    def _param(self, name, init, shape, names):
        return self.param(name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)

    def _project(self, name, x, heads, head_axis):
        """``x [batch, length, embed] -> [batch, length, heads, head_dim]``."""
        kernel = self._param(
            f"{name}_kernel",
            nn.initializers.normal(self.init_std),
            (x.shape[-1], heads, self.head_dim),
            (axes.EMBED, head_axis, axes.HEAD_DIM),
        )
        # A dot_general (not an einsum), as every Dew kernel contraction: LoRA (qwix) adds
        # its adapters to dot_generals against a parameter. Over the tokens flattened
        # (dew.nn.dense.token_rows): the kernel's gradient is then one contraction over a
        # single token axis, which XLA:CPU runs without transposing the activations.
        y = jax.lax.dot_general(
            token_rows(x).astype(self.dtype), kernel.astype(self.dtype), (((1,), (0,)), ((), ()))
        )  # [batch * length, heads, head_dim]
        y = y.reshape(*x.shape[:-1], heads, self.head_dim)  # [batch, length, heads, head_dim]
        if self.use_qkv_bias:
            bias = self._param(
                f"{name}_bias",
                nn.initializers.zeros,
                (heads, self.head_dim),
                (head_axis, axes.HEAD_DIM),
            )
            y = y + bias.astype(self.dtype)
        return y

    @nn.compact
    def __call__(
        self,
        x,
        positions,
        valid,
        *,
        segment_ids=None,
        query_key_mask=None,
        decode: bool = False,
        visible=None,
        query_length: int | None = None,
    ):
        """``x [batch, length, embed] -> [batch, length, embed]``.

        positions: ``[batch, length]`` token positions (RoPE and the mask policy),
          or ``[batch, length, axes]`` grid coordinates (the axial RoPE; full mask only).
        valid: ``[batch, length]``, False marks padding, which no query sees.
        segment_ids: optional ``[batch, length]`` ids of packed sequences; a query
          sees keys of its own segment only. Not with ``decode``.
        query_key_mask: optional boolean ``[batch, length, keys]``, False hides a
          key (``keys`` = the cache length when decoding).
        visible: optional boolean ``[batch or 1, 1, length, length]``, the whole mask
          already combined (:func:`dew.nn.masks.attention_mask` of this module's
          policy): a backbone computes it once for all its layers. When given, the
          XLA path reads it instead of ``valid``, ``segment_ids`` and
          ``query_key_mask`` (a fused kernel reads those, and a numpy ``visible``
          tells it that nothing varies by row), and ``positions`` only rotate
          (RoPE). Not with ``decode``.
        query_length: only the first ``query_length`` slots query, and the output is
          theirs, ``[batch, query_length, embed]``; every slot still gives keys and
          values (the last layer of block diffusion's ``[noisy | clean]`` pass, whose
          clean half is read as keys only). None = every slot. Not with ``decode``.
        """
        length = x.shape[1]
        queries = length if query_length is None else query_length
        if query_length is not None and (decode or not 1 <= query_length <= length):
            raise ValueError(
                f"Attention query_length {query_length} must be in [1, {length}] (the "
                f"input's length) and not used with decode=True; use None for every slot"
            )
        coordinates = None
        if positions.ndim == 3:
            coordinates = positions
            positions = self._grid_mask_positions(coordinates, decode)
        q = self._project(
            "query", x[:, :queries], self.num_heads, axes.HEADS
        )  # [batch, queries, heads, head_dim]
        k = self._project("key", x, self.num_kv_heads, axes.KV_HEADS)
        v = self._project("value", x, self.num_kv_heads, axes.KV_HEADS)
        q = checkpoint_name(q, "query_proj")
        k = checkpoint_name(k, "key_proj")
        v = checkpoint_name(v, "value_proj")
        if self.qk_norm:
            norm = dict(
                eps=self.qk_norm_eps,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                axis=axes.HEAD_DIM,
            )
            q = RMSNorm(**norm, name="query_norm")(q)
            k = RMSNorm(**norm, name="key_norm")(k)
        if self.rope_theta is not None and coordinates is not None:
            q = apply_axial_rope(q, coordinates[:, :queries], self.rope_theta)
            k = apply_axial_rope(k, coordinates, self.rope_theta)
        elif self.rope_theta is not None:
            inv_freq = inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
            q = apply_rope(q, positions[:, :queries], inv_freq)
            k = apply_rope(k, positions, inv_freq)

        out_kernel = self._param(
            "out_kernel",
            nn.initializers.normal(self.init_std),
            (self.num_heads, self.head_dim, x.shape[-1]),
            (axes.HEADS, axes.HEAD_DIM, axes.EMBED),
        )
        if decode:
            if segment_ids is not None:
                raise ValueError(
                    "segment_ids are not kept in the decoding cache; decode packed "
                    "sequences one per row (decode=True without segment_ids)"
                )
            out = self._cached_attention(q, k, v, positions, valid, query_key_mask)
            # One flat contraction: XLA then lays out the small activation, not
            # the kernel, which it would otherwise transpose at every decode step.
            heads_dim = self.num_heads * self.head_dim
            y = jax.lax.dot_general(
                out.reshape(*out.shape[:2], heads_dim).astype(self.dtype),
                out_kernel.reshape(heads_dim, -1).astype(self.dtype),
                (((2,), (0,)), ((), ())),
            )
        else:
            halves = query_key_mask if isinstance(query_key_mask, BlockDiffusionMask) else None
            if halves is not None and (visible is not None or shard_count(axes.LENGTH) > 1):
                halves = None  # a precomputed mask, or halves split over devices: dense
            # what varies by row: padding and segments (a numpy constant mask does not)
            varies = not isinstance(visible, np.ndarray) and not (
                isinstance(valid, np.ndarray) and valid.all() and segment_ids is None
            )
            chosen = choose_kernel(
                self.kernel,
                policy=self.mask,
                query_key_mask=query_key_mask,
                queries=queries,
                keys=length,
                head_dim=self.head_dim,
                dtype=self.dtype,
                decode=False,
                varies_by_batch=varies,
                block_size=self.kernel_block_size,
            )
            if visible is None and chosen == "xla":
                index = jnp.arange(length)
                visible = attention_mask(
                    self.mask,
                    positions,
                    positions,
                    valid,
                    index,
                    index,
                    query_segments=segment_ids,
                    key_segments=segment_ids,
                    query_key_mask=query_key_mask,
                )  # [batch, 1, query, key]
            block = causal_query_block(length) if self.mask.is_causal else None
            if chosen == "splash":
                segments = segments_of(valid, segment_ids) if varies else None
                out = splash_attention(
                    q,
                    k,
                    v,
                    policy=self.mask,
                    query_key_mask=query_key_mask,
                    query_segments=None if segments is None else segments[:, :queries],
                    key_segments=segments,
                    block_size=self.kernel_block_size,
                )
            elif chosen == "cudnn":
                out = cudnn_attention(q, k, v, policy=self.mask)
            elif halves is not None and queries == halves.length:  # the noisy half only
                out = attend_noisy_half(q, k, v, visible, halves.block_size)
            elif halves is not None and queries == length:
                out = attend_block_diffusion(q, k, v, visible, halves.block_size)
            elif block is None or queries < length:
                out = attend(q, k, v, visible[:, :, :queries])  # [batch, queries, heads, hd]
            else:
                out = attend_in_query_blocks(q, k, v, visible, block)
            out = checkpoint_name(out, "context")
            y = jax.lax.dot_general(
                token_rows(out, 2).astype(self.dtype),
                out_kernel.astype(self.dtype),
                (((1, 2), (0, 1)), ((), ())),
            ).reshape(*x.shape[:1], queries, x.shape[-1])  # [batch, queries, embed]
            y = checkpoint_name(y, "out_proj")
        if self.use_out_bias:
            y = y + self._param(
                "out_bias", nn.initializers.zeros, (x.shape[-1],), (axes.EMBED,)
            ).astype(self.dtype)
        return y  # [batch, queries, embed]

    def _grid_mask_positions(self, coordinates, decode: bool):
        """``[batch, length]`` slot indices standing in for the positions of tokens
        given by grid coordinates, under the full mask that alone ignores them."""
        if decode:
            raise ValueError(
                f"Attention got grid coordinates {tuple(coordinates.shape)} [batch, length, "
                f"axes] with decode=True; the decoding cache keeps [batch, length] positions, "
                f"so decode with 1-D positions"
            )
        if self.mask != full():
            raise ValueError(
                f"Attention got grid coordinates {tuple(coordinates.shape)} [batch, length, "
                f"axes] under the mask {self.mask}; coordinates do not order tokens, so use "
                f"masks.full() (or give 1-D positions [batch, length])"
            )
        if self.rope_scaling is not None:
            raise ValueError(
                f"rope_scaling {self.rope_scaling} does not apply to the axial rotary "
                f"embedding of grid coordinates; use rope_scaling=None"
            )
        batch, length = coordinates.shape[:2]
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    def _cached_attention(self, q, k, v, positions, valid, query_key_mask):
        """Attention over the ``cache`` collection, appending this call's keys and values.

        The cache keeps keys and values as ``[batch, kv_heads, cache_length,
        head_dim]``: the layout both attention products read as they are, so a
        decode step does not copy the whole cache into another layout.
        """
        batch, length, heads, head_dim = q.shape
        k = k.transpose(0, 2, 1, 3)  # [batch, kv_heads, length, head_dim]
        v = v.transpose(0, 2, 1, 3)
        query_index = jnp.arange(length)
        key_positions, key_valid, key_index = positions, valid, query_index
        is_initialized = self.has_variable("cache", "key")
        cached_k = self.variable("cache", "key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "value", jnp.zeros, v.shape, v.dtype)
        cached_pos = self.variable("cache", "positions", jnp.zeros, positions.shape, jnp.int32)
        cached_valid = self.variable("cache", "valid", jnp.zeros, valid.shape, jnp.bool_)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if is_initialized:
            start = index.value
            cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, 0, start, 0))
            cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, 0, start, 0))
            cached_pos.value = jax.lax.dynamic_update_slice(
                cached_pos.value, positions.astype(jnp.int32), (0, start)
            )
            cached_valid.value = jax.lax.dynamic_update_slice(cached_valid.value, valid, (0, start))
            index.value = start + length
            k, v = cached_k.value, cached_v.value
            key_positions, key_valid = cached_pos.value, cached_valid.value
            key_index = jnp.arange(k.shape[2])
            query_index = start + query_index
        mask = attention_mask(
            self.mask,
            positions,
            key_positions,
            key_valid,
            query_index,
            key_index,
            query_key_mask=query_key_mask,
        )  # [batch, 1, query, key]
        kv_heads = k.shape[1]
        q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
        scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, :, None], scores * head_dim**-0.5, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [batch, kv, group, query, key]
        out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
        return out.reshape(batch, length, heads, head_dim)


def attend(q, k, v, visible):
    """``softmax(q k^T / sqrt(head_dim), hiding what is not visible) v``; the scores
    and the softmax in float32.

    q: ``[batch, length, heads, head_dim]``; k, v: ``[batch, keys, kv_heads,
    head_dim]`` (query head ``i`` reads kv head ``i // (heads // kv_heads)``);
    visible: boolean, broadcastable to ``[batch, 1, length, keys]``.

    The same values as ``jax.nn.dot_product_attention(implementation="xla")``,
    written out: that path vmaps over the query groups, which on the CPU
    transposes the ``[.., query, key]`` scores in and out of every product.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    if groups == 1:
        scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        scores = scores * jnp.float32(head_dim**-0.5)  # [batch, heads, query, key]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhts,bshd->bthd", probs, v)
    q = q.reshape(batch, length, kv_heads, groups, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(head_dim**-0.5)  # [batch, kv_heads, groups, query, key]
    scores = jnp.where(visible[:, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, heads, head_dim)


# Causal self-attention on the CPU runs in blocks of queries: block [lo, hi) reads only
# keys [0, hi), since a causal policy hides every later slot (dew.nn.masks.attention_mask).
# The same values as one product over every key (a hidden key adds exp(min - max) = 0 to
# the softmax), in less arithmetic and with smaller score blocks. Each block is its own
# set of ops for XLA to compile, so the count grows with the length only where it pays:
# 2 blocks up to 1023 tokens, then length // 256, at most 8. Measured (XLA:CPU, jax
# 0.10.2, 2 cores), forward + backward of one layer, 8 heads of 32, CPU time: 1024
# tokens 1.49x with 2 blocks, 1.70x with 4; 2048 tokens 1.34x / 1.67x / 2.0x with
# 2 / 4 / 8 (compile 0.66 / 1.23 / 1.63 s); the medium GPT-2 training step (256 tokens)
# 1.14-1.21x with 2, 3 or 4 blocks alike, 2 compiling 2 s less than 4
# (docs/performance.md, "Causal attention in query blocks").
CAUSAL_BLOCKS_FROM = 128
"""Sequence length from which causal self-attention runs in query blocks on the CPU."""


def causal_query_block(length: int) -> int | None:
    """Queries per block of causal self-attention over ``length`` tokens, or None for
    one product: on the CPU backend from :data:`CAUSAL_BLOCKS_FROM` tokens, in
    ``min(8, max(2, length // 256))`` blocks, when the mesh does not split the
    sequence; other backends keep one product (not measured there)."""
    if length < CAUSAL_BLOCKS_FROM or shard_count(axes.LENGTH) > 1:
        return None
    if jax.default_backend() != "cpu":
        return None
    blocks = min(8, max(2, length // 256))
    return -(-length // blocks)


def attend_in_query_blocks(q, k, v, visible, block: int):
    """:func:`attend` of causal self-attention (query slot ``i`` sees no key slot
    after ``i``), ``block`` queries at a time: block ``[lo, hi)`` against keys
    ``[0, hi)``. ``q``, ``k``, ``v`` and ``visible`` as :func:`attend`, with as many
    keys as queries."""
    length = q.shape[1]
    if k.shape[1] != length:
        raise ValueError(
            f"attention in query blocks is for self-attention: {length} queries but "
            f"{k.shape[1]} keys; use attend()"
        )
    xp = np if isinstance(visible, np.ndarray) else jnp  # a constant mask stays one
    visible = xp.broadcast_to(visible, (*visible.shape[:2], length, length))
    outs = []
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        outs.append(attend(q[:, lo:hi], k[:, :hi], v[:, :hi], visible[:, :, lo:hi, :hi]))
    return jnp.concatenate(outs, axis=1)  # [batch, length, heads, head_dim]


def attend_block_diffusion(q, k, v, visible, block_size: int):
    """:func:`attend` under a mask within BD3-LM's (:func:`dew.nn.masks.block_diffusion_mask`
    AND anything else), computing only the pieces it can make visible: of ``2L`` slots
    ``[noisy | clean]``, a clean query attends to the ``L`` clean keys, a noisy one to
    the ``block_size`` noisy keys of its own block and the ``L`` clean keys (one
    softmax over both, :func:`attend_noisy_half`). ``2 L^2 + L block_size`` scores per
    head instead of ``4 L^2``; the same values (a hidden key adds ``exp(min - max) = 0``
    to a softmax).

    q, k, v: as :func:`attend`, ``2L`` slots each; visible: broadcastable to
    ``[batch, 1, 2L, 2L]``.
    """
    slots = q.shape[1]
    length = slots // 2
    xp = np if isinstance(visible, np.ndarray) else jnp  # a constant mask stays one
    visible = xp.broadcast_to(visible, (*visible.shape[:2], slots, slots))
    clean = attend(q[:, length:], k[:, length:], v[:, length:], visible[:, :, length:, length:])
    noisy = attend_noisy_half(q[:, :length], k, v, visible, block_size)
    return jnp.concatenate([noisy, clean], axis=1)  # [batch, 2L, heads, head_dim]


def attend_noisy_half(q, k, v, visible, block_size: int):
    """The noisy half of :func:`attend_block_diffusion`: queries ``q`` of the ``L``
    noisy slots alone, each over the ``block_size`` noisy keys of its own block and
    the ``L`` clean keys (one softmax over both): ``L block_size + L^2`` scores per
    head. The last layer of the ``[noisy | clean]`` pass needs no more, its clean
    half being read as keys and values only.

    q: ``[batch, L, heads, head_dim]``; k, v: ``[batch, 2L, kv_heads, head_dim]``;
    visible: broadcastable to ``[batch, 1, L or 2L, 2L]`` (rows past ``L`` unread).
    Returns ``[batch, L, heads, head_dim]``.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if k.shape[1] != 2 * length:
        raise ValueError(
            f"the noisy half of block diffusion has {length} queries over [noisy | clean] "
            f"keys, so 2 x {length} keys; got {k.shape[1]}"
        )
    groups, blocks = heads // kv_heads, length // block_size
    xp = np if isinstance(visible, np.ndarray) else jnp  # a constant mask stays one
    visible = visible[:, :, :length]
    visible = xp.broadcast_to(visible, (*visible.shape[:2], length, 2 * length))
    q_noisy = q.reshape(batch, blocks, block_size, kv_heads, groups, head_dim)
    k_own = k[:, :length].reshape(batch, blocks, block_size, kv_heads, head_dim)
    v_own = v[:, :length].reshape(batch, blocks, block_size, kv_heads, head_dim)
    k_clean, v_clean = k[:, length:], v[:, length:]
    scale = jnp.float32(head_dim**-0.5)
    own = jnp.einsum("bnqkgd,bnskd->bkgnqs", q_noisy, k_own, preferred_element_type=jnp.float32)
    seen = jnp.einsum("bnqkgd,bskd->bkgnqs", q_noisy, k_clean, preferred_element_type=jnp.float32)
    # the mask's pieces: noisy -> own block's noisy keys (the diagonal blocks), -> clean
    diagonal = np.arange(blocks)
    noisy = visible[:, :, :, :length].reshape(-1, blocks, block_size, blocks, block_size)
    own_visible = xp.moveaxis(noisy[:, diagonal, :, diagonal, :], 0, 1)  # [b, n, q, s]
    seen_visible = visible[:, :, :, length:].reshape(-1, blocks, block_size, length)
    minimum = jnp.finfo(jnp.float32).min
    scores = jnp.concatenate(
        [
            jnp.where(own_visible[:, None, None], own * scale, minimum),
            jnp.where(seen_visible[:, None, None], seen * scale, minimum),
        ],
        axis=-1,
    )  # [batch, kv_heads, groups, blocks, block, block + length]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgnqs,bnskd->bnqkgd", probs[..., :block_size], v_own) + jnp.einsum(
        "bkgnqs,bskd->bnqkgd", probs[..., block_size:], v_clean
    )
    return out.reshape(batch, length, heads, head_dim)

"""Which attention kernel runs, chosen in one place by backend and shape, and the fused ones.

Every backbone's self-attention (:class:`dew.nn.Attention`) computes
``softmax(q k^T / sqrt(head_dim), hiding what is not visible) v`` with one of:

==========  ===================================================================
``xla``     the scores written out (:func:`dew.nn.attention.attend`): float32
            scores and softmax, any mask; on the CPU, causal attention in query
            blocks. Every backend; the reference.
``splash``  the Pallas splash-attention kernel that JAX ships
            (``jax.experimental.pallas.ops.tpu.splash_attention``): a fused, tiled
            kernel that never holds the ``[query, key]`` scores and skips blocks
            the mask hides. On a TPU; elsewhere it runs in Pallas interpret mode
            (slow: for tests).
``cudnn``   ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's
            fused attention, on a GPU.
``auto``    (default) splash on a TPU, cudnn on a GPU, xla on the CPU, when that
            kernel can serve the call (:func:`choose_kernel`); xla otherwise.
==========  ===================================================================

What splash serves: every :class:`~dew.nn.masks.MaskPolicy` (causal, full, sliding
window, block-causal), padding and packed segments (``segment_ids``, as splash
``SegmentIds``: a padding slot is its own segment), block diffusion's ``[noisy |
clean]`` mask (:class:`~dew.nn.masks.BlockDiffusionMask`), grouped-query heads (the
kernel reads each key/value head for its group, nothing repeated) and fewer queries
than keys (``output_length``: the first slots query). Its masks are by slot within a
segment: positions given by the caller must count up by one within a segment (packed
rows, left padding do); causal and windowed masks then agree with
:func:`dew.nn.masks.attention_mask` on every row that is not padding. Not served:
an arbitrary ``query_key_mask`` array, cached decoding (both run xla), a sequence
split over a ``sequence`` mesh axis, and lengths that the block size does not divide
(multiples of 128). Under a mesh the kernel runs in ``jax.shard_map``, each device
on its own batch rows and heads.

cudnn serves masks that do not vary by batch (causal or full, with a window) in
bfloat16 or float16 with ``head_dim`` a multiple of 8 up to 128.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import axes
from dew.nn.masks import BlockDiffusionMask, MaskPolicy, attention_mask
from dew.nn.shards import mesh_axes_of, shard_count

KERNELS = ("auto", "xla", "splash", "cudnn")
"""The values of a backbone's ``attention_kernel`` option."""

SPLASH_BLOCKS = (512, 256, 128)
"""Block sizes splash tries, largest first: the first that divides the queries and
the keys (MaxText's default is 512). The kernel's key blocks are multiples of 128."""

LANES = 128  # a splash key block is a multiple of the TPU's 128 lanes


class KernelError(ValueError):
    """An ``attention_kernel`` option that cannot serve the call: names the mask, the
    option and the kernels that can."""


def check_kernel_options(kernel: str, block_size: int | None) -> None:
    """Raise ``ValueError`` for an unknown kernel name or a block size that is not a
    positive multiple of 128 (checked when the backbone is built)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention_kernel {kernel!r}; use one of {KERNELS}")
    if block_size is not None and (
        isinstance(block_size, bool)
        or not isinstance(block_size, int | np.integer)
        or block_size < LANES
        or block_size % LANES
    ):
        raise ValueError(
            f"attention_block_size {block_size!r} must be a multiple of {LANES} (splash's "
            f"key blocks fill the TPU's {LANES} lanes), e.g. 512; None = the largest of "
            f"{SPLASH_BLOCKS} that divides the sequence"
        )


def describe_mask(policy: MaskPolicy, query_key_mask, segments: bool) -> str:
    """The mask of a call in words, for errors."""
    what = policy.kind + (f" window {policy.window}" if policy.window else "")
    if policy.block_size:
        what += f" block {policy.block_size}"
    if isinstance(query_key_mask, BlockDiffusionMask):
        what = f"block diffusion [noisy | clean] (block {query_key_mask.block_size})"
    elif query_key_mask is not None:
        what += " AND an explicit query_key_mask array"
    return what + (" with padding / segments" if segments else "")


def choose_kernel(
    option: str,
    *,
    policy: MaskPolicy,
    query_key_mask,
    queries: int,
    keys: int,
    head_dim: int,
    dtype,
    decode: bool,
    varies_by_batch: bool,
    block_size: int | None,
) -> str:
    """The kernel that runs: ``option`` itself when it can serve the call (else a
    :class:`KernelError` naming why and what can), or for ``'auto'`` the backend's
    fused kernel when it can, else ``'xla'``."""
    backend = jax.default_backend()
    if option == "xla":
        return "xla"
    why_not = {
        "splash": _splash_refusal(policy, query_key_mask, queries, keys, decode, block_size),
        "cudnn": _cudnn_refusal(policy, query_key_mask, head_dim, dtype, decode, varies_by_batch),
    }
    if option == "auto":
        fused = {"tpu": "splash", "gpu": "cudnn"}.get(backend)
        if fused is None or why_not[fused] is not None:
            return "xla"
        if varies_by_batch and policy.kind == "block_causal":
            return "xla"  # positions given by the caller decide blocks; splash's are slots
        return fused
    if option == "cudnn" and backend != "gpu":
        why_not["cudnn"] = f"cuDNN runs on a GPU and this process's backend is {backend!r}"
    if why_not[option] is not None:
        can = ["xla"] + [k for k in ("splash", "cudnn") if why_not[k] is None]
        raise KernelError(
            f"attention_kernel={option!r} cannot serve this attention (mask: "
            f"{describe_mask(policy, query_key_mask, varies_by_batch)}; {queries} queries, "
            f"{keys} keys, head_dim {head_dim}): {why_not[option]}. Use attention_kernel "
            f"'auto' or one of {can}"
        )
    return option


def _splash_refusal(policy, query_key_mask, queries, keys, decode, block_size):
    if decode:
        return "cached decoding masks against the cache's filled slots, which change each step"
    if query_key_mask is not None and not isinstance(query_key_mask, BlockDiffusionMask):
        return "an explicit query_key_mask array varies by batch, which a splash mask cannot"
    if shard_count(axes.LENGTH) > 1:
        return "the sequence is split over a mesh axis, and splash keeps each row's keys whole"
    if splash_block(queries, keys, block_size) is None:
        size = block_size or f"one of {SPLASH_BLOCKS}"
        return f"the block size ({size}) must divide the {queries} queries and {keys} keys"
    return None


def _cudnn_refusal(policy, query_key_mask, head_dim, dtype, decode, varies_by_batch):
    if decode:
        return "cached decoding masks against the cache's filled slots"
    if query_key_mask is not None or varies_by_batch or policy.kind == "block_causal":
        return "its mask must be causal or full (with a window), the same for every row"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it computes in bfloat16 or float16, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 128:
        return f"head_dim {head_dim} must be a multiple of 8 up to 128"
    return None


def splash_block(queries: int, keys: int, block_size: int | None) -> int | None:
    """The splash block size for ``queries`` and ``keys``: ``block_size`` when it
    divides both, else None; with ``block_size=None`` the largest of
    :data:`SPLASH_BLOCKS` that divides both (None if none does)."""
    for block in (block_size,) if block_size else SPLASH_BLOCKS:
        if queries % block == 0 and keys % block == 0:
            return block
    return None


def splash_mask(policy: MaskPolicy, query_key_mask, queries: int, keys: int):
    """The static splash mask ``[queries, keys]`` of ``policy`` over slots (and of
    block diffusion's halves), as lazy masks where splash has them (causal, full,
    local windows) and a numpy mask otherwise."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (queries, keys)
    if isinstance(query_key_mask, BlockDiffusionMask):
        length = query_key_mask.length
        slots = np.arange(2 * length)
        positions = np.concatenate([np.arange(length), np.arange(length)])[None]
        dense = attention_mask(
            policy, positions, positions, np.ones((1, 2 * length), bool), slots, slots,
            query_key_mask=query_key_mask.dense(),
        )  # fmt: skip
        return sm.NumpyMask(np.ascontiguousarray(dense[0, 0, :queries]))
    if policy.kind == "block_causal":
        slots = np.arange(keys)
        dense = attention_mask(policy, slots[None], slots[None], np.ones((1, keys), bool),
                               slots, slots)  # fmt: skip
        return sm.NumpyMask(np.ascontiguousarray(dense[0, 0, :queries]))
    window = policy.window
    if window is None:
        return sm.CausalMask(shape) if policy.is_causal else sm.FullMask(shape)
    right = 0 if policy.is_causal else window - 1
    return sm.LocalMask(shape, window_size=(window - 1, right), offset=0)


def _splash_kernel(policy, query_key_mask, heads, queries, keys, block, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = splash_mask(policy, query_key_mask, queries, keys)
    sizes = sk.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    # concrete mask tables (not values of the trace that first asks), so the cached
    # kernel serves every later trace
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(
            mask=sm.MultiHeadMask([mask] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            residual_checkpoint_name="context",
            interpret=interpret,
        )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    policy: MaskPolicy,
    query_key_mask=None,
    query_segments: jax.Array | None = None,
    key_segments: jax.Array | None = None,
    block_size: int | None = None,
) -> jax.Array:
    """Splash attention: ``q [batch, queries, heads, head_dim]``, ``k, v [batch, keys,
    kv_heads, head_dim]`` -> ``[batch, queries, heads, head_dim]``.

    The mask is ``policy`` over slots (:func:`splash_mask`) AND, when given, equal
    segments (``[batch, queries]``, ``[batch, keys]`` int32 ids). Scaled by
    ``head_dim ** -0.5`` on the queries. Under a mesh that splits the batch or the
    heads it runs in ``jax.shard_map`` over them.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    batch, queries, heads, head_dim = q.shape
    keys = k.shape[1]
    block = splash_block(queries, keys, block_size)
    interpret = jax.default_backend() != "tpu"
    q = q * jnp.asarray(head_dim**-0.5, q.dtype)
    # the kernel's layout: [batch, heads, length, head_dim]
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    segmented = query_segments is not None

    mesh = jax.sharding.get_abstract_mesh()

    def split(logical):  # the mesh axes of more than one device that split `logical`
        if mesh.empty:
            return ()
        return tuple(a for a in mesh_axes_of(logical) if mesh.shape[a] > 1)

    batch_axes, head_axes = split(axes.BATCH), split(axes.HEADS)
    ways = lambda names: math.prod(int(mesh.shape[a]) for a in names)  # noqa: E731
    if batch % ways(batch_axes):  # the one-example initialisation: one program
        batch_axes = ()
    if heads % ways(head_axes) or k.shape[1] % ways(head_axes):
        head_axes = ()

    def local(q, k, v, *segments):
        kernel = _splash_kernel(policy, query_key_mask, q.shape[1], queries, keys, block, interpret)
        if segments:
            return jax.vmap(lambda q, k, v, sq, sk_: kernel(q, k, v, sk.SegmentIds(sq, sk_)))(
                q, k, v, *segments
            )
        return jax.vmap(kernel)(q, k, v)

    args = (q, k, v) + ((query_segments, key_segments) if segmented else ())
    if batch_axes or head_axes:
        P = jax.sharding.PartitionSpec
        rows = P(batch_axes or None, head_axes or None, None, None)
        ids = P(batch_axes or None, None)
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(rows, rows, rows) + ((ids, ids) if segmented else ()),
            out_specs=rows,
            check_vma=False,
        )(*args)
    else:
        out = local(*args)
    return out.transpose(0, 2, 1, 3)  # [batch, queries, heads, head_dim]


def segments_of(valid: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Splash segment ids ``[batch, length]``: the caller's ``segment_ids`` (0 when
    None) on valid slots, and one segment of its own (the int32 minimum) for padding,
    so no valid query sees a padding key and no row is empty."""
    ids = jnp.zeros(valid.shape, jnp.int32) if segment_ids is None else segment_ids
    return jnp.where(valid, ids.astype(jnp.int32), jnp.iinfo(jnp.int32).min)


def cudnn_attention(q, k, v, *, policy: MaskPolicy) -> jax.Array:
    """cuDNN's fused attention through ``jax.nn.dot_product_attention``: shapes as
    :func:`splash_attention`; the mask is ``policy`` (causal or full, a window)."""
    window = None
    if policy.window is not None:
        window = (policy.window - 1, 0 if policy.is_causal else policy.window - 1)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=policy.is_causal,
        local_window_size=window,
        implementation="cudnn" if jax.default_backend() == "gpu" else None,
    )

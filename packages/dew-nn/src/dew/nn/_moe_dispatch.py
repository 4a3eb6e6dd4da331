"""How :class:`dew.nn.moe.MoE` sends tokens to its experts: the routing, the
capacity order, and the three dispatches over one weight layout.

All functions here are pure (no flax): tokens come flattened, ``x [tokens,
embed]``, with the router's choice ``chosen [tokens, k]`` (expert ids) and
combine weights ``weights [tokens, k]``; the experts' weights are ``gate/up
[expert, embed, mlp]`` and ``down [expert, mlp, embed]`` (``gate`` is None
for the ungated activations).

Capacity order (GShard, Lepikhin et al. 2020): an expert takes at most
``capacity`` assignments; they are ranked choice first, then token order:
every token's first choice before any token's second choice, and within
one choice the earlier token first. An assignment past its expert's
capacity is dropped (its weight is zero, the token keeps its residual).
Every dispatch drops the same set, so they agree exactly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dew.nn.mlp import activate, is_gated

GATINGS = ("softmax_topk", "topk_softmax")
DISPATCHES = ("auto", "dense", "capacity", "blocked", "ragged")


def route(logits, k: int, gating: str, norm_topk_prob: bool | None):
    """``(probs [.., expert], weights [.., k], chosen [.., k])`` from float32
    router logits.

    ``softmax_topk``: ``p = softmax(logits)``, the k largest ``p``; their sum
    renormalised to 1 when ``norm_topk_prob`` (None: when k > 1, so one expert
    per token keeps ``p`` itself, as Switch). ``topk_softmax`` (Mixtral's
    reference code): the softmax over the k largest logits, which sums to 1
    by construction (equal to ``softmax_topk`` with ``norm_topk_prob``).
    ``probs`` is always the full softmax (the balance loss reads it).
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if gating == "topk_softmax":
        top_logits, chosen = jax.lax.top_k(logits, k)
        return probs, jax.nn.softmax(top_logits, axis=-1), chosen
    weights, chosen = jax.lax.top_k(probs, k)
    if norm_topk_prob or (norm_topk_prob is None and k > 1):
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, chosen


def capacity_of(tokens: int, k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Slots per expert: ``tokens`` when dropless (None: no expert can receive
    more, each token picks an expert once), else ``ceil(capacity_factor *
    tokens * k / num_experts)``, at most ``tokens``."""
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))


def positions(chosen, num_experts: int):
    """Each assignment's rank in its expert's queue, ``[tokens, k]`` (0-based),
    in the capacity order (choice first, then token)."""
    tokens, k = chosen.shape
    by_choice = jax.nn.one_hot(chosen.T.reshape(-1), num_experts, dtype=jnp.int32)  # [k*T, E]
    rank = jnp.sum((jnp.cumsum(by_choice, axis=0) - 1) * by_choice, axis=-1)
    return rank.reshape(k, tokens).T


def experts_batched(x, gate, up, down, activation: str):
    """Each expert on its own rows: ``x [expert, rows, embed] -> [expert, rows, embed]``."""
    upped = jnp.einsum("xre,xem->xrm", x, up)
    return jnp.einsum("xrm,xme->xre", _activate(x, gate, upped, activation), down)


def _activate(x, gate, upped, activation, *, group_sizes=None):
    """The hidden activations from ``upped = x up``: SwiGLU also multiplies ``x gate``."""
    if not is_gated(activation):
        return activate(activation, upped)
    if group_sizes is not None:
        gated = jax.lax.ragged_dot(x, gate, group_sizes)
    else:
        gated = jnp.einsum("xre,xem->xrm", x, gate)
    return activate(activation, upped, gated)


def buckets(x, chosen, kept, num_experts: int, capacity: int, rank):
    """The tokens in ``[expert, capacity, embed]`` slots, and each assignment's
    slot ``[tokens, k]`` (``expert * capacity`` for a dropped one: a spare row)."""
    tokens, k = chosen.shape
    slot = jnp.where(kept, chosen * capacity + rank, num_experts * capacity)
    rows = jnp.zeros((num_experts * capacity + 1, x.shape[-1]), x.dtype)
    rows = rows.at[slot.reshape(-1)].add(jnp.repeat(x, k, axis=0))  # kept slots are unique
    return rows[:-1].reshape(num_experts, capacity, x.shape[-1]), slot


def combine(y, slot, kept, weights):
    """``y [expert, capacity, embed]`` back to the tokens: ``sum_j w_tj y[slot_tj]``."""
    rows = y.reshape(-1, y.shape[-1])
    picked = jnp.take(rows, jnp.minimum(slot, rows.shape[0] - 1), axis=0)  # [tokens, k, embed]
    picked = jnp.where(kept[..., None], picked, 0)
    return jnp.einsum("tke,tk->te", picked, weights.astype(y.dtype))


def capacity_dispatch(x, chosen, weights, kept, rank, gate, up, down, activation, capacity):
    """Batched matmuls over ``[expert, capacity, embed]`` buckets."""
    buf, slot = buckets(x, chosen, kept, up.shape[0], capacity, rank)
    return combine(experts_batched(buf, gate, up, down, activation), slot, kept, weights)


def ragged_dispatch(x, chosen, weights, kept, gate, up, down, activation):
    """Assignments sorted by expert (dropped ones last), grouped matmuls
    (``jax.lax.ragged_dot``), unsorted."""
    tokens, k = chosen.shape
    num = up.shape[0]
    expert_of = jnp.where(kept, chosen, num).reshape(-1)  # [T*k]; dropped sort last
    order = jnp.argsort(expert_of, stable=True)
    rows = jnp.take(x, order // k, axis=0)  # [T*k, embed], grouped by expert
    sizes = jnp.bincount(expert_of, length=num + 1)[:num].astype(jnp.int32)
    upped = jax.lax.ragged_dot(rows, up, sizes)
    hidden = _activate(rows, gate, upped, activation, group_sizes=sizes)
    out = jax.lax.ragged_dot(hidden, down, sizes)  # [T*k, embed]
    out = jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, -1)
    out = jnp.where(kept[..., None], out, 0)  # rows past the groups are not defined
    return jnp.einsum("tke,tk->te", out, weights.astype(out.dtype))


def block_rows(assignments: int, num_experts: int) -> int:
    """Rows of one block of :func:`blocked_dispatch`: a power of two near
    ``assignments / (4 * num_experts)``, 8 to 128, so the padding (at most
    ``num_experts`` blocks) stays under ~25% of the rows."""
    rows = max(1, assignments // (4 * num_experts))
    return max(8, min(128, 1 << (rows.bit_length() - 1)))


def blocked_dispatch(x, chosen, weights, kept, gate, up, down, activation):
    """Dropless grouped matmuls without ``ragged_dot``: the assignments sorted by
    expert, each expert's group padded to whole blocks of ``block_rows`` rows, and
    one batched matmul over the blocks with each block's expert's weights
    (``[blocks, block, embed] x [blocks, embed, mlp]``). At most ``assignments /
    block + num_experts`` blocks, a static bound, so the cost is ``(tokens * k +
    num_experts * block)`` rows whatever the load (MegaBlocks' block-sparse
    layout, Gale et al. 2022, in plain XLA)."""
    tokens, k = chosen.shape
    num, n = up.shape[0], tokens * k
    block = block_rows(n, num)
    blocks = -(-n // block) + num
    rows = blocks * block
    expert_of = jnp.where(kept, chosen, num).reshape(-1)  # [T*k]; dropped sort last
    order = jnp.argsort(expert_of, stable=True)
    ordered = expert_of[order]
    sizes = jnp.bincount(expert_of, length=num + 1)[:num]
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(padded)
    within = jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[jnp.minimum(ordered, num - 1)]
    dest = jnp.where(ordered < num, (ends - padded)[jnp.minimum(ordered, num - 1)] + within, rows)
    buf = jnp.zeros((rows + 1, x.shape[-1]), x.dtype).at[dest].set(jnp.take(x, order // k, axis=0))
    buf = buf[:rows].reshape(blocks, block, -1)
    # each block's expert: the group its first row falls in (blocks past the last are empty)
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), num - 1)
    y = experts_batched(
        buf, None if gate is None else gate[owner], up[owner], down[owner], activation
    ).reshape(rows, -1)
    y = jnp.concatenate([y, jnp.zeros((1, y.shape[-1]), y.dtype)])[dest]  # [T*k, embed], sorted
    out = jnp.zeros_like(y).at[order].set(y).reshape(tokens, k, -1)
    return jnp.einsum("tke,tk->te", out, (weights * kept).astype(out.dtype))


def resolve(dispatch: str, capacity_factor: float | None) -> str:
    """``auto``: ``ragged`` where ``ragged_dot`` is a grouped kernel (GPU, TPU);
    elsewhere (XLA:CPU lowers ``ragged_dot`` to a dense masked product, ~10x one
    matmul at 8 experts) ``capacity`` with a capacity factor, ``blocked`` without
    (dropless capacity buckets cost as much as the dense dispatch)."""
    if dispatch != "auto":
        return dispatch
    if jax.default_backend() in ("gpu", "tpu"):
        return "ragged"
    return "blocked" if capacity_factor is None else "capacity"


def expert_parallel(
    x,
    chosen,
    weights,
    gate,
    up,
    down,
    *,
    activation: str,
    capacity: int,
    expert_axes: tuple[str, ...],
    tensor_axes: tuple[str, ...],
):
    """Inside ``shard_map``: this device's tokens ``x [tokens, embed]`` go to the
    devices that hold their experts and come back, through two
    ``jax.lax.all_to_all`` over ``expert_axes``.

    ``gate/up/down`` are this device's ``experts / ep`` experts (their ``mlp``
    split over ``tensor_axes``, summed with ``psum``). Each device fills
    ``[expert, capacity, embed]`` buckets from its own tokens (capacity per
    device), sends expert ``e``'s bucket to the device that holds ``e``, runs its
    experts on ``[local experts, ep * capacity, embed]``, and sends the results
    back in the order they came. Returns ``(out [tokens, embed], kept [tokens, k])``.
    """
    local = up.shape[0]
    ep = jax.lax.psum(1, expert_axes)
    num = local * ep
    rank = positions(chosen, num)
    kept = rank < capacity
    buf, slot = buckets(x, chosen, kept, num, capacity, rank)  # [expert, capacity, embed]
    # expert e lives on device e // local: chunk j of the expert axis goes to device j
    got = jax.lax.all_to_all(buf, expert_axes, 0, 0, tiled=True)  # [source * local, C, embed]
    got = (
        got.reshape(ep, local, capacity, -1).transpose(1, 0, 2, 3).reshape(local, ep * capacity, -1)
    )
    y = experts_batched(got, gate, up, down, activation)
    if tensor_axes:
        y = jax.lax.psum(y, tensor_axes)
    y = y.reshape(local, ep, capacity, -1).transpose(1, 0, 2, 3).reshape(num, capacity, -1)
    back = jax.lax.all_to_all(y, expert_axes, 0, 0, tiled=True)  # [expert, capacity, embed]
    return combine(back, slot, kept, weights), kept

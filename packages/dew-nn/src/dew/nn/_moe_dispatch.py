"""How :class:`dew.nn.moe.MoE` sends tokens to its experts: the routing, the
capacity order, and the routed dispatches over one weight layout.

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

The routed dispatches place the assignments with one stable sort by expert
(:func:`layout`) and move token rows with gathers only (:func:`gather_rows`,
whose gradient is the inverse gather, not a scatter-add). The dense
reference ranks them independently (:func:`positions`: a one-hot running
count), so the tests that compare the two check the sort's ranks too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

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
    in the capacity order (choice first, then token), by a running count over a
    one-hot ``[tokens * k, expert]`` (the dense dispatch's; the routed ones take
    theirs from :func:`layout`'s sort)."""
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


class Layout(NamedTuple):
    """Where the (token, choice) assignments sit in a buffer of ``rows`` rows grouped
    by expert, and back: two index maps, inverse to each other on the kept rows.
    Built from one stable sort of the assignments by expert (:func:`layout`).

    dest: each assignment's buffer row, ``[tokens * k]`` (token-major: ``t * k + j``).
    kept: the assignments that have a row (within their expert's capacity).
    source: each buffer row's assignment (token-major), ``[rows]``.
    filled: the rows that hold an assignment (the rest are padding, zero).
    held: the assignments each expert holds, ``[expert]`` (the group sizes).
    offsets: the buffer row where each expert's group starts, ``[expert]``.
    """

    dest: jax.Array
    kept: jax.Array
    source: jax.Array
    filled: jax.Array
    held: jax.Array
    offsets: jax.Array


def layout(chosen, num_experts: int, capacity: int, *, group: str = "capacity", block: int = 1):
    """The :class:`Layout` of ``chosen [tokens, k]`` with ``capacity`` slots an expert.

    The assignments are sorted once by expert, stably, in the capacity order
    (choice-major, so within an expert: choice first, then token); an
    assignment's rank in its expert's group is its sorted position less the
    group's start (the inverse permutation, one integer scatter), and it is
    kept when the rank is below ``capacity``. Each expert's group then takes

    - ``group='capacity'``: ``capacity`` rows (``[expert, capacity]`` buckets);
    - ``'blocks'``: its kept assignments rounded up to whole blocks of ``block``
      rows, in ``(ceil(tokens * k / block) + num_experts) * block`` rows;
    - ``'packed'``: exactly its kept assignments, back to back, in ``tokens * k``
      rows (the groups of ``jax.lax.ragged_dot``; rows past them are empty).
    """
    tokens, k = chosen.shape
    n = tokens * k
    expert_of = chosen.T.reshape(-1).astype(jnp.int32)  # [k * tokens], choice-major
    order = jnp.argsort(expert_of, stable=True)  # sorted position -> assignment
    sorted_at = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    counts = jnp.bincount(expert_of, length=num_experts).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts  # each expert's first sorted position
    rank = sorted_at - starts[expert_of]  # [k * tokens]: the rank in the expert's queue
    kept = rank < capacity
    held = jnp.minimum(counts, capacity)
    if group == "capacity":
        rows, size = num_experts * capacity, jnp.full(num_experts, capacity, jnp.int32)
    elif group == "blocks":
        rows, size = (-(-n // block) + num_experts) * block, -(-held // block) * block
    else:
        rows, size = n, held
    offsets = jnp.cumsum(size) - size
    dest = jnp.where(kept, offsets[expert_of] + rank, rows)  # dropped: past the buffer
    row = jnp.arange(rows, dtype=jnp.int32)
    if group == "capacity":
        owner = row // capacity
    else:  # the group each row falls in (rows past the last group: the last expert)
        owner = jnp.searchsorted(offsets + size, row, side="right").astype(jnp.int32)
        owner = jnp.minimum(owner, num_experts - 1)
    within = row - offsets[owner]
    filled = within < held[owner]
    assignment = order[jnp.clip(starts[owner] + within, 0, n - 1)]  # choice-major
    source = (assignment % tokens) * k + assignment // tokens
    to_token_major = lambda a: a.reshape(k, tokens).T.reshape(-1)  # noqa: E731
    return Layout(
        dest=to_token_major(dest),
        kept=to_token_major(kept),
        source=jnp.where(filled, source, 0),
        filled=filled,
        held=held,
        offsets=offsets,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def gather_rows(x, index, valid, inverse, inverse_valid, repeats: int):
    """``where(valid, x_r[index], 0)``, ``[len(index), embed]``, where ``x_r`` is each
    row of ``x [n, embed]`` repeated ``repeats`` times (``[n * repeats, embed]``,
    never built: row ``i`` of ``x_r`` is ``x[i // repeats]``).

    The pick must be one-to-one on the valid rows, with ``inverse [n * repeats]``
    (valid where ``inverse_valid``) the rows they came from: then the gradient is
    the inverse pick, a gather too, summed over the repeats, where automatic
    differentiation would scatter-add (slow on CPU, MaxText's
    ``use_custom_sort_vjp`` for the same reason).
    """
    at = jnp.minimum(index // repeats, x.shape[0] - 1)
    return jnp.where(valid[:, None], x.at[at].get(mode="promise_in_bounds"), 0)


def _gather_rows_fwd(x, index, valid, inverse, inverse_valid, repeats):
    out = gather_rows(x, index, valid, inverse, inverse_valid, repeats)
    return out, (x.shape[0], index, inverse, inverse_valid)


def _gather_rows_bwd(repeats, residuals, grad):
    n, index, inverse, inverse_valid = residuals
    back = grad.at[jnp.minimum(inverse, grad.shape[0] - 1)].get(mode="promise_in_bounds")
    back = jnp.where(inverse_valid[:, None], back, 0)
    return back.reshape(n, repeats, -1).sum(axis=1), None, None, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def dispatch_rows(x, plan: Layout, k: int):
    """The tokens ``x [tokens, embed]`` in the layout's rows: ``[rows, embed]``."""
    return gather_rows(x, plan.source, plan.filled, plan.dest, plan.kept, k)


def combine_rows(y, plan: Layout, weights):
    """The expert outputs ``y [rows, embed]`` back to the tokens: ``sum_j w_tj y[dest_tj]``
    (a dropped assignment adds nothing)."""
    tokens, k = weights.shape
    picked = gather_rows(y, plan.dest, plan.kept, plan.source, plan.filled, 1)
    return jnp.einsum("tke,tk->te", picked.reshape(tokens, k, -1), weights.astype(y.dtype))


def capacity_dispatch(x, chosen, weights, gate, up, down, activation, capacity):
    """Batched matmuls over ``[expert, capacity, embed]`` buckets; ``(out, kept)``."""
    num = up.shape[0]
    plan = layout(chosen, num, capacity)
    buf = dispatch_rows(x, plan, chosen.shape[1]).reshape(num, capacity, -1)
    y = experts_batched(buf, gate, up, down, activation).reshape(num * capacity, -1)
    return combine_rows(y, plan, weights), plan.kept.reshape(chosen.shape)


def ragged_dispatch(x, chosen, weights, gate, up, down, activation, capacity):
    """Assignments sorted by expert (dropped ones last), grouped matmuls
    (``jax.lax.ragged_dot``), unsorted; ``(out, kept)``."""
    plan = layout(chosen, up.shape[0], capacity, group="packed")
    rows = dispatch_rows(x, plan, chosen.shape[1])  # [tokens * k, embed], grouped by expert
    upped = jax.lax.ragged_dot(rows, up, plan.held)
    hidden = _activate(rows, gate, upped, activation, group_sizes=plan.held)
    y = jax.lax.ragged_dot(hidden, down, plan.held)  # rows past the groups: not read back
    return combine_rows(y, plan, weights), plan.kept.reshape(chosen.shape)


def block_rows(assignments: int, num_experts: int) -> int:
    """Rows of one block of :func:`blocked_dispatch`: a power of two near
    ``assignments / (4 * num_experts)``, 8 to 128, so the padding (at most
    ``num_experts`` blocks) stays under ~25% of the rows."""
    rows = max(1, assignments // (4 * num_experts))
    return max(8, min(128, 1 << (rows.bit_length() - 1)))


def blocked_dispatch(x, chosen, weights, gate, up, down, activation, capacity):
    """Dropless grouped matmuls without ``ragged_dot``: the assignments sorted by
    expert, each expert's group padded to whole blocks of ``block_rows`` rows, and
    one batched matmul over the blocks with each block's expert's weights
    (``[blocks, block, embed] x [blocks, embed, mlp]``). At most ``assignments /
    block + num_experts`` blocks, a static bound, so the cost is ``(tokens * k +
    num_experts * block)`` rows whatever the load (MegaBlocks' block-sparse
    layout, Gale et al. 2022, in plain XLA); ``(out, kept)``."""
    tokens, k = chosen.shape
    num = up.shape[0]
    block = block_rows(tokens * k, num)
    plan = layout(chosen, num, capacity, group="blocks", block=block)
    buf = dispatch_rows(x, plan, k)
    blocks = buf.shape[0] // block
    # each block's expert: the group its first row falls in (blocks past the last are empty)
    ends = plan.offsets + -(-plan.held // block) * block
    owner = jnp.arange(blocks) * block
    owner = jnp.minimum(jnp.searchsorted(ends, owner, side="right"), num - 1)
    y = experts_batched(
        buf.reshape(blocks, block, -1),
        None if gate is None else gate[owner],
        up[owner],
        down[owner],
        activation,
    )
    return combine_rows(y.reshape(blocks * block, -1), plan, weights), plan.kept.reshape(
        chosen.shape
    )


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
    plan = layout(chosen, num, capacity)
    buf = dispatch_rows(x, plan, chosen.shape[1]).reshape(num, capacity, -1)
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
    out = combine_rows(back.reshape(num * capacity, -1), plan, weights)
    return out, plan.kept.reshape(chosen.shape)

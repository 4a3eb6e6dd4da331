"""Scores of given next tokens under a vocabulary head, over the vocabulary in chunks.

For final hidden states ``h_t`` and an output projection ``W [embed, vocab]`` (a
language model's head), the logits are ``z_t = h_t W`` and at temperature ``T``

    log p_T(y_t) = z_t[y_t] / T - logsumexp(z_t / T)

Computed whole, the ``[batch, length, vocab]`` float32 logits are the largest
array of a language model's step (32k ids x 8k tokens is 1 GiB, twice over with
the softmax the backward pass keeps). :func:`chunked_scores` projects
``chunk_size`` positions of every row at a time in a scan whose body is
rematerialised (``nn.remat``), so neither the forward nor the backward pass
holds more than one chunk's ``[batch, chunk_size, vocab]`` logits: the backward
pass recomputes each chunk's projection (one more head matmul per step, as
MaxText's vocabulary tiling and Levanter's blockwise cross-entropy pay) and
accumulates the head's gradient across chunks.

The projection runs inside the module (a Flax lifted scan with the parameters
broadcast), as a ``dot_general`` against the parameter itself: a LoRA adapter
on the head (qwix intercepts the module's contractions) and a tied embedding
work as in the whole-logits path, and the logits keep their logical axes
``(batch, length, vocab)`` so a vocabulary split over ``tensor`` stays split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes
from dew.nn.shards import check_divides


class TokenScores(NamedTuple):
    """Per-token scores of given targets, each ``[batch, length]``."""

    log_probs: jax.Array  # float32 log p_T(target) = z[target] / T - logsumexp(z / T)
    logsumexp: jax.Array  # float32 logsumexp(z / T) (a z-loss reads its square)
    is_argmax: jax.Array  # bool: the target is argmax(z) (the first maximum)


def scores_of_logits(
    logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0
) -> TokenScores:
    """:class:`TokenScores` of ``targets [...]`` under ``logits [..., vocab]``, in float32;
    ``temperature`` 1 divides nothing (the model's own distribution)."""
    logits = logits.astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    targets = targets.astype(jnp.int32)
    chosen = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logsumexp = jax.nn.logsumexp(logits, axis=-1)
    is_argmax = jnp.argmax(logits, axis=-1) == targets
    return TokenScores(chosen - logsumexp, logsumexp, is_argmax)


def check_chunk_size(chunk_size, *, what: str) -> None:
    """``chunk_size`` must be None (the whole length at once) or an int >= 1."""
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"{what}: logits_chunk_size must be a whole number of positions >= 1, or None "
            f"for the whole logits at once; got {chunk_size!r}. Use e.g. 512 or 1024 "
            f"positions per chunk (each chunk holds batch x chunk x vocab float32 logits)"
        )


def chunked_scores(
    module: nn.Module,
    project_fn: Callable[[nn.Module, jax.Array], jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int,
    temperature: float = 1.0,
) -> TokenScores:
    """:class:`TokenScores` of ``targets [batch, length]`` from the final hidden states
    ``hidden [batch, length, embed]``, ``chunk_size`` positions of every row at a time.

    module: the bound module whose parameters the head reads (call from its compact
      method); project_fn: ``(module, rows [tokens, embed]) -> logits [tokens, vocab]``,
      the module's own output projection (it may create the head submodule: the scan
      shares the module's parameters, so its path is unchanged).
    chunk_size: positions per chunk; a length it does not divide is padded up to a
      multiple (the padded positions are computed and dropped). Chunk ``j`` holds the
      positions ``j, j + n, j + 2n, ...`` (``n`` chunks): strided, so each chunk
      spans the whole row and keeps the batch and length splits of a mesh.

    Equal to :func:`scores_of_logits` of the whole logits up to the rounding of
    per-chunk matmuls; its gradient too (the chunk is recomputed in the backward pass).
    """
    check_chunk_size(chunk_size, what="chunked_scores")
    batch, length, features = hidden.shape
    chunk = min(chunk_size, length)
    check_divides(chunk, axes.LENGTH, f"logits_chunk_size {chunk} (positions per chunk)")
    count = -(-length // chunk)  # chunks
    pad = count * chunk - length

    def split(x):  # [batch, length, ...] -> [count, batch, chunk, ...], position i * count + j
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, chunk, count, *x.shape[2:]), 2, 0)

    def body(mdl, carry, xs):
        h, y = xs  # [batch, chunk, embed], [batch, chunk]
        logits = project_fn(mdl, h.reshape(batch * chunk, features))  # [batch * chunk, vocab]
        logits = logits.reshape(batch, chunk, -1).astype(jnp.float32)  # [batch, chunk, vocab]
        logits = nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.VOCAB))
        return carry, scores_of_logits(logits, y, temperature=temperature)

    # remat: the backward pass keeps each chunk's inputs, not its logits or softmax
    scan = nn.scan(
        nn.remat(body, prevent_cse=False),
        variable_broadcast="params",
        split_rngs={"params": False},
        length=count,
    )
    _, scores = scan(module, None, (split(hidden), split(targets)))  # each [count, batch, chunk]

    def join(x):  # [count, batch, chunk] -> [batch, length]
        return jnp.moveaxis(x, 0, 2).reshape(batch, count * chunk)[:, :length]

    return TokenScores(*(join(x) for x in scores))

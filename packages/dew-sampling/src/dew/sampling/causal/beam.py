"""Beam search with a KV cache, in one compiled loop.

Each prompt keeps ``num_beams`` live hypotheses ``y`` scored by their summed
log-probability ``s(y) = sum_t log p(y_t | x, y_<t)``. A step expands every
live beam over the vocabulary and ranks the ``num_beams * vocab`` candidates
by ``s``; of the best ``2 * num_beams``:

- a candidate that ends with an end id and ranks among the first
  ``num_beams`` is finished: it enters the row's pool of ``num_beams``
  finished hypotheses with the length-normalised score
  ``s(y) / |y| ** length_penalty`` (``|y|`` = new tokens, the end id included);
- the best ``num_beams`` candidates that do not end are the next live beams.

After ``max_new_tokens`` steps the live beams join the pool with the same
normalisation, and the pool's best is returned (Hugging Face's beam search
with ``early_stopping=False``). A row stops early only when no live beam can
still beat its pool: log-probabilities are <= 0, so a beam with summed score
``s`` can at best reach ``s / max_new_tokens ** length_penalty`` when
``length_penalty > 0`` and ``s / (t + 1) ** length_penalty`` otherwise. This
bound is exact, so stopping early never changes the result.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.nn.keywords import is_whole_number
from dew.sampling.causal.decoding import Generation, decode_step, init_cache, prefill, unrolled
from dew.sampling.causal.prompts import (
    PROMPT_BUCKET,
    check_prompts,
    end_id_tuple,
    pad_prompts,
    row_multiple,
)


@struct.dataclass
class Hypotheses:
    """``beams`` hypotheses per prompt row.

    tokens: ``[batch, beams, max_new_tokens]`` new tokens; ``pad_id`` past ``lengths``.
    logprobs: ``[batch, beams, max_new_tokens]`` their log-probabilities.
    scores: ``[batch, beams]``: live beams their summed log-probability, the
      pool of finished ones their length-normalised score; -inf = no hypothesis.
    lengths: ``[batch, beams]`` new tokens, the end id included.
    """

    tokens: jax.Array
    logprobs: jax.Array
    scores: jax.Array
    lengths: jax.Array


@struct.dataclass
class BeamState:
    """The carry of :func:`beam_decode`'s loop, after ``step`` new tokens.

    step: ``[]`` new tokens so far.
    cache: the model's ``cache`` collection, ``batch * beams`` rows (row-major: prompt, beam).
    position: ``[batch * beams]`` position of the next token fed.
    next_logprobs: ``[batch * beams, vocab]`` log-probabilities of each live beam's next token.
    live: the live beams.
    pool: the best finished hypotheses.
    """

    step: jax.Array
    cache: Any
    position: jax.Array
    next_logprobs: jax.Array
    live: Hypotheses
    pool: Hypotheses


def _batch_axes(model, params, length: int):
    """For each cache leaf, the axis that indexes rows (None for per-layer counters)."""
    one = init_cache(model, params, 1, length)
    two = init_cache(model, params, 2, length)

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return diff[0] if diff else None

    return jax.tree.map(axis, one, two)


def _take_rows(cache, axes, rows: jax.Array):
    """Gather cache rows (``rows [new_batch]`` indexes the old batch) along each leaf's row axis."""
    return jax.tree.map(
        lambda leaf, axis: leaf if axis is None else jnp.take(leaf, rows, axis=axis), cache, axes
    )


def _normalise(scores, length, length_penalty):
    return scores / jnp.asarray(length, jnp.float32) ** length_penalty


def _gather(x, beam):
    """``x [batch, beams, ...]`` at ``beam [batch, n]`` -> ``[batch, n, ...]``."""
    return jnp.take_along_axis(x, beam.reshape(beam.shape + (1,) * (x.ndim - 2)), axis=1)


def _select(h: Hypotheses, beam) -> Hypotheses:
    return jax.tree.map(lambda x: _gather(x, beam), h)


def _concat(a: Hypotheses, b: Hypotheses) -> Hypotheses:
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=1), a, b)


def beam_decode(
    model,
    params,
    tokens: jax.Array,
    mask: jax.Array,
    *,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float | jax.Array = 1.0,
    end_ids: tuple[int, ...] = (),
    pad_id: int = 0,
):
    """Traceable beam search over left-padded prompts ``tokens``/``mask [batch, prompt]``.

    A row without a real token (batch filling) is finished from the start.
    Returns ``(new_tokens [batch, max_new_tokens], logprobs [batch, max_new_tokens],
    lengths [batch], scores [batch])`` of each row's best hypothesis; tokens after
    its length hold ``pad_id``.
    """
    batch, prompt_len = tokens.shape
    beams, steps = num_beams, max_new_tokens
    model, params = unrolled(model, nn.meta.unbox(params))
    logits, cache, position = prefill(model, params, tokens, mask, prompt_len + steps)
    vocab = logits.shape[-1]
    if 2 * beams > beams * vocab:
        raise ValueError(f"num_beams {beams} needs a vocabulary of at least 2 ids, got {vocab}")
    axes = _batch_axes(model, params, prompt_len + steps)
    repeat = jnp.repeat(jnp.arange(batch), beams)  # [batch * beams] -> prompt row
    end = jnp.asarray(end_ids if end_ids else (-1,), jnp.int32)
    neg_inf = jnp.float32(-jnp.inf)
    rank_mask = jnp.arange(2 * beams) < beams  # only the top num_beams candidates may finish
    empty = ~jnp.any(mask, axis=-1)  # [batch] padding rows that fill the batch up

    def bound(scores, t):
        length = jnp.where(length_penalty > 0, steps, t + 1)
        return _normalise(scores, length, length_penalty)

    def cond(s: BeamState):
        full = jnp.all(s.pool.scores > neg_inf, axis=-1)
        best_live = jnp.max(bound(s.live.scores, s.step), axis=-1)
        hopeless = best_live <= jnp.min(s.pool.scores, axis=-1)
        return (s.step < steps) & ~jnp.all((full & hopeless) | empty)

    def body(s: BeamState) -> BeamState:
        t = s.step
        step_logprobs = s.next_logprobs.reshape(batch, beams, vocab)
        candidates = (s.live.scores[:, :, None] + step_logprobs).reshape(batch, beams * vocab)
        top_scores, top_index = jax.lax.top_k(candidates, 2 * beams)  # [batch, 2 * beams]
        top_beam, top_token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        top_logprob = jnp.take_along_axis(
            step_logprobs.reshape(batch, beams * vocab), top_index, axis=1
        )
        at_t = jnp.arange(steps) == t
        parents = _select(s.live, top_beam)
        top = Hypotheses(
            tokens=jnp.where(at_t, top_token[..., None], parents.tokens),
            logprobs=jnp.where(at_t, top_logprob[..., None], parents.logprobs),
            scores=top_scores,
            lengths=jnp.full((batch, 2 * beams), t + 1),
        )
        is_end = jnp.isin(top_token, end)

        # Finished candidates join the pool; keep its best num_beams.
        finished = jnp.where(
            is_end & rank_mask & (top_scores > neg_inf),
            _normalise(top_scores, t + 1, length_penalty),
            neg_inf,
        )
        merged = _concat(s.pool, top.replace(scores=finished))
        _, keep = jax.lax.top_k(merged.scores, beams)
        pool = _select(merged, keep)

        # The best candidates that do not end become the live beams.
        _, pick = jax.lax.top_k(jnp.where(is_end, neg_inf, top_scores), beams)
        live = _select(top, pick)
        parent = jnp.take_along_axis(top_beam, pick, axis=1)  # [batch, beams]
        rows = (jnp.arange(batch)[:, None] * beams + parent).reshape(-1)
        token = jnp.take_along_axis(top_token, pick, axis=1).reshape(-1)
        cache = _take_rows(s.cache, axes, rows)  # each live beam's parent's cache
        logits, cache = decode_step(model, params, cache, token, s.position)
        return BeamState(
            step=t + 1,
            cache=cache,
            position=s.position + 1,
            next_logprobs=jax.nn.log_softmax(logits, axis=-1),
            live=live,
            pool=pool,
        )

    def no_hypotheses(scores):
        return Hypotheses(
            tokens=jnp.full((batch, beams, steps), pad_id, jnp.int32),
            logprobs=jnp.zeros((batch, beams, steps), jnp.float32),
            scores=scores,
            lengths=jnp.zeros((batch, beams), jnp.int32),
        )

    first = jnp.where(jnp.arange(beams) == 0, 0.0, neg_inf)  # one real beam at first
    state = BeamState(
        step=jnp.int32(0),
        cache=_take_rows(cache, axes, repeat),
        position=position[repeat],
        next_logprobs=jnp.repeat(jax.nn.log_softmax(logits, axis=-1), beams, axis=0),
        live=no_hypotheses(jnp.broadcast_to(first, (batch, beams))),
        pool=no_hypotheses(jnp.full((batch, beams), neg_inf)),
    )
    state = jax.lax.while_loop(cond, body, state)
    # Live beams that ran the full length join the pool (a row stopped early
    # keeps its pool: no live beam could beat it).
    ran_out = state.step == steps
    live = state.live.replace(
        scores=jnp.where(ran_out, _normalise(state.live.scores, steps, length_penalty), neg_inf),
        lengths=jnp.full((batch, beams), steps),
    )
    every = _concat(state.pool, live)
    best = _select(every, jnp.argmax(every.scores, axis=1)[:, None])  # [batch, 1, ...]
    lengths = best.lengths[:, 0]
    keep = jnp.arange(steps)[None, :] < lengths[:, None]
    new_tokens = jnp.where(keep, best.tokens[:, 0], pad_id)
    logprobs = jnp.where(keep, best.logprobs[:, 0], 0.0)
    return new_tokens, logprobs, lengths, best.scores[:, 0]


@functools.lru_cache(maxsize=32)
def _compiled(model, max_new_tokens, num_beams, end_ids, pad_id):
    # length_penalty is traced: changing it does not recompile.
    return jax.jit(
        functools.partial(
            beam_decode,
            model,
            max_new_tokens=max_new_tokens,
            num_beams=num_beams,
            end_ids=end_ids,
            pad_id=pad_id,
        )
    )


def beam_search(
    model,
    params,
    prompt,
    max_new_tokens: int,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    end_ids=None,
    pad_id: int = 0,
) -> Generation:
    """The most likely continuation of each prompt found by beam search.

    model, params, prompt, max_new_tokens, end_ids, pad_id: as in
      :func:`dew.sampling.generate`.
    num_beams: hypotheses kept per prompt (>= 1; 1 is greedy decoding).
    length_penalty: exponent of the length normalisation
      ``sum(logprobs) / length ** length_penalty``; > 0 favours longer
      continuations, < 0 shorter ones, 0 compares raw sums.

    Returns a :class:`Generation` with each row's best hypothesis and its ``scores``.
    """
    if not is_whole_number(num_beams) or num_beams < 1:
        raise ValueError(f"num_beams must be a whole number >= 1, got {num_beams!r}")
    if not math.isfinite(float(length_penalty)):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    end_ids = end_id_tuple(end_ids)
    rows = check_prompts(model, prompt, max_new_tokens, pad_id=pad_id, end_ids=end_ids)
    tokens, mask = pad_prompts(rows, pad_id, multiple=PROMPT_BUCKET, rows=row_multiple())
    fn = _compiled(model, int(max_new_tokens), int(num_beams), end_ids, int(pad_id))
    new_tokens, logprobs, lengths, scores = jax.device_get(
        fn(nn.meta.unbox(params), tokens, mask, length_penalty=jnp.float32(length_penalty))
    )
    lengths = np.asarray(lengths)[: len(rows)].tolist()
    return Generation(
        tokens=[row + new_tokens[r, :n].tolist() for r, (row, n) in enumerate(zip(rows, lengths))],
        lengths=lengths,
        logprobs=[logprobs[r, :n].tolist() for r, n in enumerate(lengths)],
        scores=np.asarray(scores)[: len(rows)].tolist(),
    )

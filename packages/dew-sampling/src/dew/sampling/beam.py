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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.generate import (
    PROMPT_BUCKET,
    Generation,
    check_prompts,
    decode_step,
    end_id_tuple,
    init_cache,
    pad_prompts,
    prefill,
    unrolled,
)


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
    cache = _take_rows(cache, axes, repeat)
    position = position[repeat]
    logprobs_next = jnp.repeat(jax.nn.log_softmax(logits, axis=-1), beams, axis=0)
    end = jnp.asarray(end_ids if end_ids else (-1,), jnp.int32)
    neg_inf = jnp.float32(-jnp.inf)
    rank_mask = jnp.arange(2 * beams) < beams  # only the top num_beams candidates may finish

    def gather(x, beam):  # x [batch, beams, ...], beam [batch, n] -> [batch, n, ...]
        return jnp.take_along_axis(x, beam.reshape(beam.shape + (1,) * (x.ndim - 2)), axis=1)

    def bound(scores, t):
        length = jnp.where(length_penalty > 0, steps, t + 1)
        return _normalise(scores, length, length_penalty)

    def cond(carry):
        t, live_scores, pool_scores = carry[0], carry[6], carry[7]
        full = jnp.all(pool_scores > neg_inf, axis=-1)
        hopeless = jnp.max(bound(live_scores, t), axis=-1) <= jnp.min(pool_scores, axis=-1)
        return (t < steps) & ~jnp.all(full & hopeless)

    def body(carry):
        (
            t,
            cache,
            position,
            logprobs_next,
            live_tokens,
            live_logprobs,
            live_scores,
            pool_scores,
            pool_tokens,
            pool_logprobs,
            pool_lengths,
        ) = carry
        step_logprobs = logprobs_next.reshape(batch, beams, vocab)
        candidates = (live_scores[:, :, None] + step_logprobs).reshape(batch, beams * vocab)
        top_scores, top_index = jax.lax.top_k(candidates, 2 * beams)  # [batch, 2 * beams]
        top_beam, top_token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        top_logprob = jnp.take_along_axis(
            step_logprobs.reshape(batch, beams * vocab), top_index, axis=1
        )
        at_t = jnp.arange(steps) == t
        top_tokens = jnp.where(at_t, top_token[..., None], gather(live_tokens, top_beam))
        top_logprobs = jnp.where(at_t, top_logprob[..., None], gather(live_logprobs, top_beam))
        is_end = jnp.isin(top_token, end)

        # Finished candidates join the pool; keep its best num_beams.
        finished = jnp.where(
            is_end & rank_mask & (top_scores > neg_inf),
            _normalise(top_scores, t + 1, length_penalty),
            neg_inf,
        )
        merged_scores = jnp.concatenate([pool_scores, finished], axis=1)
        keep_scores, keep = jax.lax.top_k(merged_scores, beams)
        pool_tokens = gather(jnp.concatenate([pool_tokens, top_tokens], axis=1), keep)
        pool_logprobs = gather(jnp.concatenate([pool_logprobs, top_logprobs], axis=1), keep)
        pool_lengths = gather(
            jnp.concatenate([pool_lengths, jnp.full((batch, 2 * beams), t + 1)], axis=1), keep
        )

        # The best candidates that do not end become the live beams.
        live_scores, pick = jax.lax.top_k(jnp.where(is_end, neg_inf, top_scores), beams)
        live_tokens = gather(top_tokens, pick)
        live_logprobs = gather(top_logprobs, pick)
        parent = jnp.take_along_axis(top_beam, pick, axis=1)  # [batch, beams]
        rows = (jnp.arange(batch)[:, None] * beams + parent).reshape(-1)
        token = jnp.take_along_axis(top_token, pick, axis=1).reshape(-1)
        logits, cache = decode_step(model, params, _take_rows(cache, axes, rows), token, position)
        return (
            t + 1,
            cache,
            position + 1,
            jax.nn.log_softmax(logits, axis=-1),
            live_tokens,
            live_logprobs,
            live_scores,
            keep_scores,
            pool_tokens,
            pool_logprobs,
            pool_lengths,
        )

    live_scores = jnp.where(jnp.arange(beams) == 0, 0.0, neg_inf)  # one real beam at first
    carry = (
        jnp.int32(0),
        cache,
        position,
        logprobs_next,
        jnp.full((batch, beams, steps), pad_id, jnp.int32),
        jnp.zeros((batch, beams, steps), jnp.float32),
        jnp.broadcast_to(live_scores, (batch, beams)),
        jnp.full((batch, beams), neg_inf),
        jnp.full((batch, beams, steps), pad_id, jnp.int32),
        jnp.zeros((batch, beams, steps), jnp.float32),
        jnp.zeros((batch, beams), jnp.int32),
    )
    carry = jax.lax.while_loop(cond, body, carry)
    (
        t,
        _,
        _,
        _,
        live_tokens,
        live_logprobs,
        live_scores,
        pool_scores,
        pool_tokens,
        pool_logprobs,
        pool_lengths,
    ) = carry
    # Live beams that ran the full length join the pool (a row stopped early
    # keeps its pool: no live beam could beat it).
    ran_out = t == steps
    live_final = jnp.where(ran_out, _normalise(live_scores, steps, length_penalty), neg_inf)
    scores = jnp.concatenate([pool_scores, live_final], axis=1)
    best = jnp.argmax(scores, axis=1)[:, None]  # [batch, 1]
    all_tokens = jnp.concatenate([pool_tokens, live_tokens], axis=1)
    all_logprobs = jnp.concatenate([pool_logprobs, live_logprobs], axis=1)
    all_lengths = jnp.concatenate([pool_lengths, jnp.full((batch, beams), steps)], axis=1)
    lengths = jnp.take_along_axis(all_lengths, best, axis=1)[:, 0]
    keep = jnp.arange(steps)[None, :] < lengths[:, None]
    new_tokens = jnp.where(keep, gather(all_tokens, best)[:, 0], pad_id)
    logprobs = jnp.where(keep, gather(all_logprobs, best)[:, 0], 0.0)
    return new_tokens, logprobs, lengths, jnp.take_along_axis(scores, best, axis=1)[:, 0]


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
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    rows = check_prompts(model, prompt, max_new_tokens, pad_id=pad_id)
    tokens, mask = pad_prompts(rows, pad_id, multiple=PROMPT_BUCKET)
    fn = _compiled(model, int(max_new_tokens), int(num_beams), end_id_tuple(end_ids), int(pad_id))
    new_tokens, logprobs, lengths, scores = jax.device_get(
        fn(params, tokens, mask, length_penalty=jnp.float32(length_penalty))
    )
    out = [row + new_tokens[r, :n].tolist() for r, (row, n) in enumerate(zip(rows, lengths))]
    return Generation(
        tokens=out,
        lengths=np.asarray(lengths).tolist(),
        logprobs=[logprobs[r, :n].tolist() for r, n in enumerate(lengths)],
        scores=np.asarray(scores).tolist(),
    )

"""Autoregressive generation with a KV cache: prefill and decode in one compiled loop.

A batch of prompts of different lengths is left-padded to one length. The
prefill reads every prompt at once and fills the cache; a ``lax.while_loop``
then feeds one token per row per step until every row has produced an end id
or ``max_new_tokens`` tokens. Row ``b``'s token at position ``t`` sees only the
real tokens of row ``b`` at positions ``<= t``:

    p(x_t | x_<t) = softmax(model(x_<=t-1)[-1])

so a cached decode equals recomputing the whole sequence at every step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from dew.nn.keywords import is_whole_number
from dew.sampling.causal.beam import beam_search
from dew.sampling.causal.decoding import Generation, decode_step, prefill, unrolled
from dew.sampling.causal.prompts import (
    PROMPT_BUCKET,
    check_prompts,
    end_id_tuple,
    pad_prompts,
    row_multiple,
)
from dew.sampling.causal.sampling import Sampling, sample_logits


@struct.dataclass
class DecodeState:
    """The carry of :func:`decode`'s loop, after ``step`` new tokens.

    step: ``[]`` new tokens chosen so far; the next one goes to ``tokens[:, step]``.
    cache: the model's ``cache`` collection, holding every token fed so far.
    token: ``[batch]`` the last chosen token, fed at the next step.
    done: ``[batch]`` the row has ended (an end id, or an empty padding row).
    tokens: ``[batch, max_new_tokens]`` new tokens; ``pad_id`` after a row ends.
    logprobs: ``[batch, max_new_tokens]`` their log-probabilities; 0 after a row ends.

    Not carried, since they follow from the rest: the position each step feeds
    (``position - 1 + step``, from the prefill's ``position``) and each row's
    length (read off ``tokens`` once the loop has ended, :func:`_lengths`).
    """

    step: jax.Array
    cache: Any
    token: jax.Array
    done: jax.Array
    tokens: jax.Array
    logprobs: jax.Array


def decode(
    model,
    params,
    tokens: jax.Array,
    mask: jax.Array,
    *,
    max_new_tokens: int,
    key: jax.Array,
    sampling: Sampling,
    end_ids: tuple[int, ...] = (),
    pad_id: int = 0,
):
    """Traceable generation, for use inside compiled code (RL rollouts).

    tokens: ``[batch, prompt]`` left-padded prompts; mask: ``[batch, prompt]``,
      False on padding. A row without a real token is finished from the start.
    key: step ``i``'s draw uses ``fold_in(key, i)``; row ``b`` draws the same
      tokens whatever rows follow it.
    Returns ``(new_tokens [batch, max_new_tokens], logprobs [batch, max_new_tokens],
    lengths [batch])``; positions after a row's end id hold ``pad_id`` (and log-prob 0).
    """
    batch, prompt_len = tokens.shape
    model, params = unrolled(model, nn.meta.unbox(params))
    logits, cache, position = prefill(model, params, tokens, mask, prompt_len + max_new_tokens)
    end = jnp.asarray(end_ids, jnp.int32) if end_ids else None

    # A step does only what the returned values need, beyond the model call;
    # the rest is decided here, while tracing. Without end ids no row can end,
    # so the loop neither looks for them nor asks whether every row has ended,
    # and runs a fixed number of steps; greedy splits no keys.
    def choose(logits_last, i, done):
        step_key = None if sampling.is_greedy else jax.random.fold_in(key, i)
        token, logprob = sample_logits(logits_last, step_key, sampling)
        token = jnp.where(done, pad_id, token)
        logprob = jnp.where(done, 0.0, logprob)
        if end is not None:
            done = done | jnp.isin(token, end)
        return token, logprob, done

    empty = ~jnp.any(mask, axis=-1)  # padding rows that fill the batch up
    before_first = position - 1  # step s feeds the token at position before_first + s
    token, logprob, done = choose(logits, 0, empty)
    state = DecodeState(
        step=jnp.int32(1),
        cache=cache,
        token=token,
        done=done,
        tokens=jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token),
        logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(logprob),
    )

    def cond(s: DecodeState):
        if end is None:  # the rows that are done (empty ones) stay done and emit padding
            return s.step < max_new_tokens
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        logits, cache = decode_step(model, params, s.cache, s.token, before_first + s.step)
        token, logprob, done = choose(logits, s.step, s.done)
        return DecodeState(
            step=s.step + 1,
            cache=cache,
            token=token,
            done=done,
            tokens=jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step)),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, logprob[:, None], (0, s.step)),
        )

    state = jax.lax.while_loop(cond, body, state)
    return state.tokens, state.logprobs, _lengths(state, empty, end)


def _lengths(state: DecodeState, empty: jax.Array, end: jax.Array | None) -> jax.Array:
    """New tokens per row ``[batch]``, its end id included, from the loop's final state.

    A row that ended at step ``j`` holds its first end id at ``tokens[:, j]``
    (no earlier token was one, else it would have ended there): length ``j + 1``.
    A row still running when the loop stopped has a token at every step before
    ``state.step``; an empty row has none.
    """
    if end is None:
        running = state.step
    else:
        first_end = jnp.argmax(jnp.isin(state.tokens, end), axis=-1).astype(jnp.int32)
        running = jnp.where(state.done, first_end + 1, state.step)
    return jnp.where(empty, 0, running).astype(jnp.int32)


@functools.lru_cache(maxsize=64)
def _compiled(model, sampling, max_new_tokens, end_ids, pad_id):
    return jax.jit(
        functools.partial(
            decode,
            model,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            end_ids=end_ids,
            pad_id=pad_id,
        )
    )


def generate(
    model,
    params,
    prompt,
    max_new_tokens: int,
    key: jax.Array,
    *,
    sampling: Sampling | None = None,
    end_ids: Sequence[int] | int | None = None,
    pad_id: int = 0,
    num_beams: int = 1,
    length_penalty: float = 1.0,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    model: a causal module that decodes with a ``cache`` collection
      (:class:`dew.nn.CausalTransformer`).
    params: its parameters (``state.params``), possibly sharded on a mesh.
      Under ``jax.set_mesh`` and ``nn.logical_axis_rules`` (inside
      ``Trainer.fit``) the batch is filled up with empty rows to a multiple of
      the devices it is split over.
    prompt: a list of prompts, each a list of token ids; lengths may differ.
    key: the PRNG key of the draws; the same key gives the same output.
    sampling: :class:`Sampling`; None = ``Sampling()`` (temperature 1);
      ``Sampling(temperature=0)`` is greedy.
    end_ids: token id(s) that end a row (included in its output).
    pad_id: the id fed in place of left padding (masked out; any valid id).
    num_beams: > 1 switches to beam search (:func:`dew.sampling.beam_search`),
      which is deterministic: ``sampling`` must be None or greedy, ``key`` is unused.
    length_penalty: beam search only: a finished beam scores
      ``sum(logprobs) / length ** length_penalty``.
    """
    end_ids = end_id_tuple(end_ids)
    rows = check_prompts(model, prompt, max_new_tokens, pad_id=pad_id, end_ids=end_ids)
    if not is_whole_number(num_beams) or num_beams < 1:
        raise ValueError(f"num_beams must be a whole number >= 1 (1 = sampling), got {num_beams!r}")
    if num_beams != 1:
        if sampling is not None and not sampling.is_greedy:
            raise ValueError(
                f"beam search (num_beams={num_beams}) is deterministic; drop sampling={sampling} "
                f"or use num_beams=1 to sample"
            )
        return beam_search(
            model,
            params,
            rows,
            max_new_tokens,
            num_beams=num_beams,
            length_penalty=length_penalty,
            end_ids=end_ids,
            pad_id=pad_id,
        )
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise TypeError(
            f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}; pass "
            f"e.g. sampling=Sampling(temperature=0.7)"
        )
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and sampling.top_k > vocab:
        raise ValueError(
            f"Sampling top_k={sampling.top_k} is more than the model's vocab_size {vocab}; use "
            f"top_k <= {vocab} (0 = off)"
        )
    if sampling.is_greedy:  # every greedy rule is one program
        sampling = Sampling(temperature=0)
    tokens, mask = pad_prompts(rows, pad_id, multiple=PROMPT_BUCKET, rows=row_multiple())
    fn = _compiled(model, sampling, int(max_new_tokens), end_ids, int(pad_id))
    new_tokens, logprobs, lengths = jax.device_get(fn(nn.meta.unbox(params), tokens, mask, key=key))
    out, out_logprobs = [], []
    for r, (row, n) in enumerate(zip(rows, lengths.tolist())):
        out.append(row + new_tokens[r, :n].tolist())
        out_logprobs.append(logprobs[r, :n].tolist())
    return Generation(tokens=out, lengths=lengths[: len(rows)].tolist(), logprobs=out_logprobs)

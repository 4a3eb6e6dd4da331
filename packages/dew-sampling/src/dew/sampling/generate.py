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

import dataclasses
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.sampling import Sampling, sample_logits

# Prompts are left-padded to a multiple of this many positions, so prompts of
# nearby lengths share one compiled program.
PROMPT_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` returns.

    tokens: one list per prompt: the prompt followed by its new tokens (up to
      and including an end id, no padding).
    lengths: new tokens per row.
    logprobs: per row, the model's log-probability of each new token
      (``log_softmax`` of the raw logits, before temperature or filtering).
    scores: beam search only: each row's length-normalised score
      ``sum(logprobs) / lengths ** length_penalty``; None when sampling.
    """

    tokens: list[list[int]]
    lengths: list[int]
    logprobs: list[list[float]]
    scores: list[float] | None = None


def init_cache(model, params, batch: int, length: int, *, key: jax.Array | None = None):
    """A zeroed KV cache for ``batch`` rows of up to ``length`` positions.

    The shapes come from tracing one ``decode=True`` call (nothing is
    computed); ``key`` is accepted for backward compatibility and unused.
    """
    del key
    shapes = jax.eval_shape(
        lambda p: model.apply(
            {"params": p}, jnp.zeros((batch, length), jnp.int32), decode=True, mutable=["cache"]
        )[1]["cache"],
        params,
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def unrolled(model, params):
    """The same model and params with the layer stack unrolled, for decoding.

    A ``use_scan`` model keeps every layer's KV cache in one stacked array
    that the scan slices and re-stacks at every step; unrolled layers update
    their own caches in place. Same numbers, ~3x faster decode steps on CPU
    (tools/bench_generate.py). The slicing of the stacked params happens once
    per call, in the compiled program.
    """
    if not getattr(model, "use_scan", False) or "layers" not in params:
        return model, params
    changes = {"use_scan": False}
    if getattr(model, "num_stages", 1) != 1:
        changes["num_stages"] = 1  # decoding runs the plain stack anyway
    layers = params["layers"]
    flat = {k: v for k, v in params.items() if k != "layers"}
    for i in range(model.num_layers):
        flat[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], layers)
    return model.clone(**changes), flat


def prompt_positions(mask: jax.Array) -> jax.Array:
    """Positions ``[batch, prompt]`` of left-padded rows: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def prefill(model, params, tokens: jax.Array, mask: jax.Array, cache_length: int):
    """Run the prompts once and fill a fresh cache of ``cache_length`` slots.

    Returns ``(logits of each row's last prompt token [batch, vocab], cache,
    position of each row's first new token [batch])``.
    """
    batch = tokens.shape[0]
    cache = init_cache(model, params, batch, cache_length)
    positions = prompt_positions(mask)
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        tokens,
        positions=positions,
        attention_mask=mask,
        decode=True,
        mutable=["cache"],
    )
    return logits[:, -1], variables["cache"], positions[:, -1] + 1


def decode_step(model, params, cache, token: jax.Array, position: jax.Array):
    """One cached step of ``token``/``position`` ``[batch]``: ``(logits [batch, vocab], cache)``."""
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        token[:, None],
        positions=position[:, None],
        decode=True,
        mutable=["cache"],
    )
    return logits[:, -1], variables["cache"]


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
      False on padding.
    key: step ``i``'s draw uses ``fold_in(key, i)``.
    Returns ``(new_tokens [batch, max_new_tokens], logprobs [batch, max_new_tokens],
    lengths [batch])``; positions after a row's end id hold ``pad_id`` (and log-prob 0).
    """
    batch, prompt_len = tokens.shape
    model, params = unrolled(model, nn.meta.unbox(params))
    logits, cache, position = prefill(model, params, tokens, mask, prompt_len + max_new_tokens)
    end = jnp.asarray(end_ids if end_ids else (-1,), jnp.int32)

    def choose(logits_last, i, done):
        token, logprob = sample_logits(logits_last, jax.random.fold_in(key, i), sampling)
        if not end_ids:  # no row ends early: skip the bookkeeping
            return token, logprob, done
        token = jnp.where(done, pad_id, token)
        logprob = jnp.where(done, 0.0, logprob)
        return token, logprob, done | jnp.isin(token, end)

    done = jnp.zeros((batch,), jnp.bool_)
    token, logprob, done = choose(logits, 0, done)
    out_tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
    out_logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(logprob)
    lengths = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        i, _, _, _, done, *_ = carry
        return (i < max_new_tokens) & ~jnp.all(done) if end_ids else i < max_new_tokens

    def body(carry):
        i, cache, token, position, done, out_tokens, out_logprobs, lengths = carry
        logits, cache = decode_step(model, params, cache, token, position)
        lengths = lengths + (~done).astype(jnp.int32)
        token, logprob, done = choose(logits, i, done)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, i))
        out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, logprob[:, None], (0, i))
        return (i + 1, cache, token, position + 1, done, out_tokens, out_logprobs, lengths)

    carry = (jnp.int32(1), cache, token, position, done, out_tokens, out_logprobs, lengths)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[5], carry[6], carry[7]


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


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0, *, multiple: int = 1):
    """Left-pad prompts to one length, rounded up to ``multiple``.

    Returns ``(tokens [batch, prompt], mask [batch, prompt])``; mask is False on padding.
    """
    longest = max(len(p) for p in prompts)
    longest = -(-longest // multiple) * multiple
    tokens = np.full((len(prompts), longest), pad_id, np.int32)
    mask = np.zeros((len(prompts), longest), bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, longest - len(prompt) :] = prompt
            mask[row, longest - len(prompt) :] = True
    return tokens, mask


def check_prompts(model, prompts, max_new_tokens: int, *, pad_id: int = 0) -> list[list[int]]:
    """Validate prompts before compiling; returns them as lists of ints.

    Raises when a prompt is empty or not a list of ids, a token id (or
    ``pad_id``) lies outside ``0..vocab_size-1``, a prompt is longer than the
    model's ``max_seq_len``, or a prompt plus ``max_new_tokens`` would overrun it.
    """
    if isinstance(prompts, np.ndarray | jax.Array):
        prompts = np.asarray(prompts).tolist()
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], str)):
        raise TypeError(
            "generate takes token ids; encode text with a tokenizer (or use "
            "TextGeneration, which takes strings)"
        )
    if not prompts:
        raise ValueError("generate needs at least one prompt; got an empty list")
    if isinstance(prompts[0], int | np.integer):
        raise TypeError(
            "prompt must be a list of prompts (one list of ids per row); "
            "wrap a single prompt as [ids]"
        )
    rows = [[int(t) for t in p] for p in prompts]
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        largest = max(max(r) for r in rows)
        smallest = min(min(r) for r in rows)
        if largest >= vocab:
            row = next(i for i, r in enumerate(rows) if largest in r)
            raise ValueError(
                f"prompt {row} holds token id {largest}, the largest id in the batch, but the "
                f"model's vocab_size is {vocab}; ids must be in 0..{vocab - 1} (check the "
                f"tokenizer matches the model)"
            )
        if smallest < 0:
            raise ValueError(
                f"prompt token id {smallest} is negative; ids must be in 0..{vocab - 1}"
            )
        if not 0 <= pad_id < vocab:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary 0..{vocab - 1}")
    max_len = getattr(model, "max_seq_len", None)
    if max_len is not None:
        longest = max(len(r) for r in rows)
        if longest > max_len:
            raise ValueError(
                f"prompt of {longest} tokens is longer than the model's max_seq_len "
                f"{max_len}; shorten it"
            )
        if longest + max_new_tokens > max_len:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = "
                f"{longest + max_new_tokens} overruns max_seq_len {max_len}; use "
                f"max_new_tokens <= {max_len - longest}"
            )
    return rows


def end_id_tuple(end_ids: Sequence[int] | int | None) -> tuple[int, ...]:
    """``None``, one id or several ids, as a tuple of ints."""
    if end_ids is None:
        return ()
    if isinstance(end_ids, int | np.integer):
        return (int(end_ids),)
    return tuple(int(e) for e in end_ids)


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
    rows = check_prompts(model, prompt, max_new_tokens, pad_id=pad_id)
    end_ids = end_id_tuple(end_ids)
    if num_beams != 1:
        from dew.sampling.beam import beam_search  # beam search is its own mode

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
    if sampling.is_greedy:  # every greedy rule is one program
        sampling = Sampling(temperature=0)
    tokens, mask = pad_prompts(rows, pad_id, multiple=PROMPT_BUCKET)
    fn = _compiled(model, sampling, int(max_new_tokens), end_ids, int(pad_id))
    new_tokens, logprobs, lengths = jax.device_get(fn(nn.meta.unbox(params), tokens, mask, key=key))
    out, out_logprobs = [], []
    for r, (row, n) in enumerate(zip(rows, lengths.tolist())):
        out.append(row + new_tokens[r, :n].tolist())
        out_logprobs.append(logprobs[r, :n].tolist())
    return Generation(tokens=out, lengths=lengths.tolist(), logprobs=out_logprobs)

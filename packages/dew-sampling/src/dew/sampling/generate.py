"""Autoregressive generation with a KV cache: prefill and decode in one compiled loop."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.sampling import Sampling, sample_logits


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` returns.

    tokens: one list per prompt: the prompt followed by its new tokens (up to
      and including an end id, no padding).
    lengths: new tokens per row.
    logprobs: per row, the model's log-probability of each new token.
    """

    tokens: list[list[int]]
    lengths: list[int]
    logprobs: list[list[float]]


def init_cache(model, params, batch: int, length: int, *, key: jax.Array):
    """A zeroed KV cache for ``batch`` rows of up to ``length`` positions."""
    del params
    shapes = jax.eval_shape(
        functools.partial(model.init, decode=True), key, jnp.zeros((batch, length), jnp.int32)
    )["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


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
    Returns ``(new_tokens [batch, max_new_tokens], logprobs [batch, max_new_tokens],
    lengths [batch])``; positions after a row's end id hold ``pad_id``.
    """
    batch, prompt_len = tokens.shape
    k_cache, k_sample = jax.random.split(key)
    cache = init_cache(model, params, batch, prompt_len + max_new_tokens, key=k_cache)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        tokens,
        positions=positions,
        attention_mask=mask,
        decode=True,
        mutable=["cache"],
    )
    end = jnp.asarray(end_ids if end_ids else (-1,), jnp.int32)

    def choose(logits_last, i, done):
        token, logprob = sample_logits(logits_last, jax.random.fold_in(k_sample, i), sampling)
        token = jnp.where(done, pad_id, token)
        logprob = jnp.where(done, 0.0, logprob)
        return token, logprob, done | jnp.isin(token, end)

    out_tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
    out_logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32)
    done = jnp.zeros((batch,), jnp.bool_)
    lengths = jnp.zeros((batch,), jnp.int32)
    token, logprob, new_done = choose(logits[:, -1], 0, done)
    out_tokens = out_tokens.at[:, 0].set(token)
    out_logprobs = out_logprobs.at[:, 0].set(logprob)
    lengths = lengths + (~done).astype(jnp.int32)
    next_position = positions[:, -1] + 1

    def cond(carry):
        i, _, _, _, done, *_ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, cache, token, position, done, out_tokens, out_logprobs, lengths = carry
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            token[:, None],
            positions=position[:, None],
            decode=True,
            mutable=["cache"],
        )
        token, logprob, new_done = choose(logits[:, -1], i, done)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, i))
        out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, logprob[:, None], (0, i))
        lengths = lengths + (~done).astype(jnp.int32)
        return (i + 1, variables["cache"], token, position + 1, new_done, out_tokens,
                out_logprobs, lengths)

    carry = (jnp.int32(1), variables["cache"], token, next_position, new_done, out_tokens,
             out_logprobs, lengths)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[5], carry[6], carry[7]


@functools.lru_cache(maxsize=64)
def _compiled(model, sampling, max_new_tokens, end_ids, pad_id):
    return jax.jit(
        functools.partial(
            decode, model, max_new_tokens=max_new_tokens, sampling=sampling,
            end_ids=end_ids, pad_id=pad_id,
        )
    )


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0):
    """Left-pad prompts to one length: ``(tokens [batch, prompt], mask [batch, prompt])``."""
    longest = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), longest), pad_id, np.int32)
    mask = np.zeros((len(prompts), longest), bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, longest - len(prompt):] = prompt
            mask[row, longest - len(prompt):] = True
    return tokens, mask


def check_prompts(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Validate prompts before compiling; returns them as lists of ints."""
    if isinstance(prompts, np.ndarray | jax.Array):
        prompts = np.asarray(prompts).tolist()
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
        if largest >= vocab or min(min(r) for r in rows) < 0:
            raise ValueError(
                f"prompt token id {largest} is outside the model's vocabulary "
                f"(vocab_size {vocab}); ids must be in 0..{vocab - 1}"
            )
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


def generate(
    model,
    params,
    prompt,
    max_new_tokens: int,
    key: jax.Array,
    *,
    sampling: Sampling = Sampling(),
    end_ids: Sequence[int] | int | None = None,
    pad_id: int = 0,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    model: a causal module that decodes with a ``cache`` collection
      (:class:`dew.nn.CausalTransformer`).
    params: its parameters (``state.params``), possibly sharded on a mesh.
    prompt: a list of prompts, each a list of token ids; lengths may differ.
    key: the PRNG key of the draws; the same key gives the same output.
    sampling: :class:`Sampling`; ``Sampling(temperature=0)`` is greedy.
    end_ids: token id(s) that end a row (included in its output).
    """
    rows = check_prompts(model, prompt, max_new_tokens)
    if end_ids is None:
        end_ids = ()
    elif isinstance(end_ids, int | np.integer):
        end_ids = (int(end_ids),)
    end_ids = tuple(int(e) for e in end_ids)
    tokens, mask = pad_prompts(rows, pad_id)
    fn = _compiled(model, sampling, int(max_new_tokens), end_ids, int(pad_id))
    new_tokens, logprobs, lengths = jax.device_get(fn(params, tokens, mask, key=key))
    out, out_logprobs = [], []
    for row, n in zip(rows, lengths.tolist()):
        r = len(out)
        out.append(row + new_tokens[r, :n].tolist())
        out_logprobs.append(logprobs[r, :n].tolist())
    return Generation(tokens=out, lengths=lengths.tolist(), logprobs=out_logprobs)

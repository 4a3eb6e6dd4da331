"""Token log-probabilities of a causal LM, masked reductions and KL estimators.

What DPO, GRPO, PPO and on-policy distillation share. For ids ``x`` and
logits ``z`` of a causal model (``z_t`` predicts ``x_{t+1}``) at temperature
``T``:

    log p_T(x_{t+1} | x_{<=t}) = z_t[x_{t+1}] / T - logsumexp(z_t / T)

in float32, computed as :func:`dew.sampling.sample_logits` computes the
log-probability of the token it draws (the logits cast to float32, divided by
``T`` as :func:`dew.sampling.filter_logits` divides them, the chosen logit
minus the ``logsumexp``), so given the same logits a rollout's log-probs and
the loss's agree bit for bit. At ``T = 1`` (the default) nothing is divided:
that is the model's own distribution, which ``sample_logits`` reports.

Layouts:

- :func:`sequence_logprobs`: one row of ids read left to right (prompt then
  completion then padding, as ``dew.data.PreferencePairs`` packs them); the
  result is aligned with the ids, so a completion mask over the ids selects
  the scored positions directly.
- :func:`completion_logprobs`: left-padded prompts ``[batch, prompt]`` followed
  by completions ``[batch, completion]``, as :func:`dew.sampling.decode` reads
  and writes them, with the positions and attention mask ``decode`` uses
  (position 0 at each row's first real prompt token).

KL estimators of ``KL(pi || ref)`` from samples of ``pi`` (Schulman 2020,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html), with
the log-ratio ``d = log ref(x) - log pi(x)``:

    k1 = -d                    unbiased, high variance, can be negative
    k2 = d^2 / 2               biased, low variance, >= 0
    k3 = exp(d) - 1 - d        unbiased, low variance, >= 0 (GRPO's per-token KL)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.sampling.causal.decoding import prompt_positions


def token_logprobs(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """``log softmax(logits / temperature)[targets]`` in float32.

    logits: ``[..., vocab]``; targets: ``[...]`` int ids.
    temperature: > 0; 1 = the model's own distribution (nothing is divided).
      A sampler drawing at temperature ``T`` samples from ``p_T``, whose
      log-probabilities this returns with ``temperature=T``.

    Returns ``[...]`` float32. At temperature 1, equal bit for bit to the log-prob
    :func:`dew.sampling.sample_logits` returns for the same logits and token; at
    ``T``, to ``chosen - logsumexp`` of ``filter_logits(logits, Sampling(temperature=T))``
    (no top-k/top-p/min-p filter).
    """
    if temperature <= 0:
        raise ValueError(
            f"token_logprobs needs temperature > 0, got {temperature}; a greedy (temperature 0) "
            f"rollout's tokens are scored at temperature 1"
        )
    logits = logits.astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    chosen = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def sequence_logprobs(
    model,
    params,
    ids: jax.Array,
    *,
    temperature: float = 1.0,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    logits_chunk_size: int | None = None,
) -> jax.Array:
    """Per-token log-probs of rows of ids under a causal model, aligned with the ids.

    model: a causal module, ``model.apply({'params': params}, ids) -> [batch, length,
      vocab]`` (``dew.nn.backbones.CausalTransformer``).
    ids: ``[batch, length]``; the model reads the whole row once.
    positions, attention_mask: passed to the model (left-padded rows); None = the
      model's defaults (positions ``0..length-1``, every token real).
    logits_chunk_size: None = the whole logits at once; a number = the model scores
      the ids itself, that many positions of every row at a time, never holding the
      ``[batch, length, vocab]`` float32 logits whole (``CausalTransformer(...,
      targets=, logits_chunk_size=)``, :mod:`dew.nn.token_scores`).

    Returns ``[batch, length]`` float32: entry ``t >= 1`` is
    ``log p(ids[t] | ids[<t])``, entry 0 is 0 (the first id has no context). Mask
    the result with the completion's mask; prompt and padding positions are
    never counted when that mask is False on them.
    """
    extra = {}
    if positions is not None:
        extra["positions"] = positions
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask
    if logits_chunk_size is not None:
        targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)  # the last is not scored
        scores = model.apply(
            {"params": params},
            ids,
            targets=targets,
            logits_chunk_size=logits_chunk_size,
            temperature=temperature,
            **extra,
        )
        return jnp.pad(scores.log_probs[:, :-1], ((0, 0), (1, 0)))  # [batch, length]
    logits = model.apply({"params": params}, ids, **extra)  # [batch, length, vocab]
    scored = token_logprobs(logits[:, :-1], ids[:, 1:], temperature=temperature)
    return jnp.pad(scored, ((0, 0), (1, 0)))  # [batch, length]


def rollout_positions(prompt_mask: jax.Array, completion_len: int):
    """Positions and attention mask of left-padded prompts ``[batch, prompt]``
    followed by ``completion_len`` new tokens, as :func:`dew.sampling.decode` feeds
    them: position 0 at each row's first real token, the first new token one past
    the prompt's last. Returns ``(positions, attention_mask)``, each
    ``[batch, prompt + completion_len]``. Tokens after a completion's end id are
    real to the model but come after every scored token, so a causal model's
    scores do not depend on them."""
    prompt = prompt_positions(prompt_mask)  # [batch, prompt]
    steps = jnp.arange(1, completion_len + 1, dtype=jnp.int32)
    new = prompt[:, -1:] + steps[None, :]  # [batch, completion]
    mask = jnp.concatenate(
        [prompt_mask.astype(bool), jnp.ones((prompt_mask.shape[0], completion_len), bool)], axis=1
    )
    return jnp.concatenate([prompt, new], axis=1), mask


def completion_logprobs(
    model,
    params,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    completion: jax.Array,
    *,
    temperature: float = 1.0,
    logits_chunk_size: int | None = None,
) -> jax.Array:
    """Log-probs of each completion token given its left-padded prompt.

    prompt, prompt_mask: ``[batch, prompt]`` left-padded ids and their mask (False on
      padding), as :func:`dew.sampling.decode` takes them.
    completion: ``[batch, completion]`` the new tokens ``decode`` returned.
    logits_chunk_size: as in :func:`sequence_logprobs`.

    Returns ``[batch, completion]`` float32: ``log p_T(completion[:, j] | prompt,
    completion[:, :j])`` with the positions and mask ``decode`` uses, so it equals
    ``decode``'s log-probs up to the rounding of cached vs. whole-sequence matmuls.
    Mask it with the completion's mask (``arange(completion) < lengths``).
    """
    ids = jnp.concatenate([prompt, completion], axis=1)  # [batch, prompt + completion]
    positions, mask = rollout_positions(prompt_mask, completion.shape[1])
    scored = sequence_logprobs(
        model,
        params,
        ids,
        temperature=temperature,
        positions=positions,
        attention_mask=mask,
        logits_chunk_size=logits_chunk_size,
    )
    return scored[:, prompt.shape[1] :]


def masked_sum(values: jax.Array, mask: jax.Array, axis=-1) -> jax.Array:
    """``sum(values * mask)`` over ``axis`` in float32 (a sequence's log-prob)."""
    return jnp.sum(values.astype(jnp.float32) * mask.astype(jnp.float32), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """``sum(values * mask) / sum(mask)`` over ``axis`` (None = all), float32.

    Where the mask sums to 0 the mean is 0, not NaN (an empty completion adds
    nothing to a loss); gradients stay finite there.
    """
    mask = jnp.broadcast_to(mask.astype(jnp.float32), values.shape)
    count = jnp.sum(mask, axis=axis)
    total = jnp.sum(values.astype(jnp.float32) * mask, axis=axis)
    return jnp.where(count > 0, total / jnp.maximum(count, 1e-30), 0.0)


def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``log pi - log ref`` per token (float32): unbiased for ``KL(pi || ref)`` under
    samples of ``pi``; PPO's per-token KL penalty (TRL's default)."""
    return logprobs.astype(jnp.float32) - ref_logprobs.astype(jnp.float32)


def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``(log ref - log pi)^2 / 2`` per token (float32): >= 0, biased, low variance;
    its gradient is the gradient of ``KL(pi || ref)``."""
    d = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
    return 0.5 * d * d


def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array, *, clamp: float = 20.0) -> jax.Array:
    """``exp(d) - 1 - d`` with ``d = log ref - log pi`` per token, float32: unbiased,
    >= 0, low variance (GRPO, Shao et al. 2024, arXiv 2402.03300, eq. 4).

    clamp: ``d`` is clipped to ``[-clamp, clamp]`` before the exponential, so a
      policy that drifted far from the reference gives a large finite value (at
      most ``exp(clamp)``), not inf (Tunix's ``kl_clamp_value``, verl's
      ``low_var_kl``); None = no clip.
    """
    d = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
    if clamp is not None:
        d = jnp.clip(d, -clamp, clamp)
    return jnp.exp(d) - 1.0 - d

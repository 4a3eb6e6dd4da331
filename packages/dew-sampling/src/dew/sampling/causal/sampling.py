"""Token sampling rules: temperature, top-k, top-p (nucleus) and min-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dew.nn.keywords import check_keywords, is_real_number, is_whole_number


@check_keywords
@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is drawn from the logits.

    temperature: divide logits by this; 0 picks the most likely token (greedy).
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches p (Holtzman et al., 2019); 1.0 = off.
    min_p: keep tokens with probability >= min_p * the top probability
      (Nguyen et al., 2024); 0.0 = off.

    Filters apply in that order, after the temperature, as in Hugging Face.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        problems = []
        if not is_real_number(self.temperature) or not self.temperature >= 0:
            problems.append(
                f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy, "
                f"1 = the model's own distribution)"
            )
        if not is_whole_number(self.top_k) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} must be a whole number >= 0 (0 = off)")
        if not is_real_number(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if not is_real_number(self.min_p) or not 0 <= self.min_p < 1:
            problems.append(f"min_p={self.min_p!r} must be in [0, 1) (0 = off)")
        if problems:
            # a NaN compares False with everything: unchecked, it samples id 0 every step
            raise ValueError(
                f"Sampling got {'; '.join(problems)}. Pass values in those ranges, e.g. "
                f"Sampling(temperature=0.7, top_p=0.9), or Sampling(temperature=0) for greedy"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filter_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Logits ``[..., vocab]`` with the tokens ``sampling`` excludes set to -inf."""
    scaled = logits.astype(jnp.float32) / (sampling.temperature or 1.0)
    neg_inf = jnp.finfo(jnp.float32).min
    if sampling.top_k > 0:
        kth = jax.lax.top_k(scaled, sampling.top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, neg_inf, scaled)
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(scaled, axis=-1)[..., ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < sampling.top_p  # the top token is always kept
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < threshold, neg_inf, scaled)
    if sampling.min_p > 0.0:
        probs = jax.nn.softmax(scaled, axis=-1)
        floor = sampling.min_p * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(probs < floor, neg_inf, scaled)
    return scaled


def sample_logits(logits: jax.Array, key: jax.Array | None, sampling: Sampling):
    """Draw one token per row of ``logits [batch, vocab]``.

    key: the draw's PRNG key; unused, and may be None, when ``sampling`` is greedy.

    Returns ``(tokens [batch] int32, logprobs [batch])``; the log-probability is
    the model's own (``log_softmax`` of the raw logits), which is what policy
    ratios in RL objectives need.
    """
    if sampling.is_greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        tokens = jax.random.categorical(key, filter_logits(logits, sampling), axis=-1)
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    logprobs = chosen - jax.nn.logsumexp(logits, axis=-1)
    return tokens.astype(jnp.int32), logprobs

"""Diffusion over tokens: the absorbing (masking) process and its samplers.

The forward process masks each token independently: ``q(z_t | x) = Cat(alpha_t x +
(1 - alpha_t) m)`` with ``m`` the mask id and ``alpha_t`` decreasing from 1 at ``t =
0`` to (about) 0 at ``t = 1`` (:class:`MaskSchedule`). The denoiser is read in the
SUBS parameterisation (Sahoo et al., 2024, MDLM, ``diffusion.py::_subs_parameterization``,
:func:`subs_log_probs`): the mask is never predicted (its logit -1e6 in float32) and
an unmasked token is carried over.

Samplers (pure functions over a ``denoise(z, t) -> logits`` callable, compiled by the
caller's ``jax.jit``):

- :func:`sample_masked`: MDLM's ancestral sampler. On the grid ``t_i = 1 - i / S``
  each masked token is unmasked with probability ``(alpha_s - alpha_t) / (1 - alpha_t)``
  to a draw from ``p(x | z_t)``; with ``use_cache`` the denoiser is called again only
  when a token changed (MDLM's ``_ddpm_caching_update``; exact for a denoiser that does
  not read ``t``). ``first_hitting=True`` unmasks exactly one uniformly chosen masked
  token per step (Zheng et al., 2024).
- :func:`sample_blocks`: BD3-LM's block-autoregressive sampler (Arriola et al., 2025):
  block after block, :func:`sample_masked` over the block's tokens conditioned on the
  clean prefix; with ``use_kv_cache`` the prefix lives in a KV cache that only ever
  holds clean blocks (each finished block is written by one extra forward pass; the
  denoising passes' writes are dropped). Stops early once every row has an end id.

Categorical draws (:func:`sample_categorical`) use an exponential race with 46-bit
uniforms and ``log1p``, so a token of probability 1e-12 is drawn at its rate (fp32
Gumbel-max truncates such tails and makes generative perplexity look better: Zheng et
al., 2024, arXiv 2409.02908); report :func:`sample_entropy` beside any generative
perplexity.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import masks
from dew.nn.keywords import is_whole_number
from dew.sampling.causal.decoding import init_cache
from dew.sampling.causal.sampling import Sampling, filter_logits

NEG_INF = -1e6  # MDLM's neg_infinity: finite, so float32 softmax never meets inf - inf
SCHEDULES = ("loglinear", "linear", "cosine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskSchedule:
    """``alpha_t``: the chance a token is still unmasked at time ``t`` in ``[0, 1]``.

    kind: ``'loglinear'`` (MDLM's default: ``sigma(t) = -log(1 - (1 - eps) t)``, so
      ``alpha_t = 1 - (1 - eps) t``), ``'linear'`` (``alpha_t = 1 - t``: every token
      masked at ``t = 1``; BD3-LM's ``p = t``) or ``'cosine'`` (``alpha_t = eps + (1 -
      eps) cos(pi t / 2)``).
    eps: the floor of ``alpha`` at ``t = 1`` (``'loglinear'``, ``'cosine'``).

    The continuous-time NELBO weight of a masked token is ``-alpha'_t / (1 - alpha_t)``
    (:meth:`weight`): ``1 / t`` for the log-linear and linear schedules.
    """

    kind: str = "loglinear"
    eps: float = 1e-3

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown mask schedule {self.kind!r}; use one of {SCHEDULES}")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"MaskSchedule eps must be in [0, 1), got {self.eps}")

    @property
    def floor(self) -> float:
        return 0.0 if self.kind == "linear" else self.eps

    def alpha(self, t: jax.Array) -> jax.Array:
        t = jnp.asarray(t, jnp.float32)
        if self.kind == "cosine":
            return self.floor + (1.0 - self.floor) * jnp.cos(0.5 * math.pi * t)
        return 1.0 - (1.0 - self.floor) * t

    def mask_chance(self, t: jax.Array) -> jax.Array:
        """``1 - alpha_t``: the chance a token is masked at ``t``."""
        return 1.0 - self.alpha(t)

    def weight(self, t: jax.Array) -> jax.Array:
        """``-alpha'_t / (1 - alpha_t)`` (>= 0), the weight of a masked token's NLL."""
        t = jnp.asarray(t, jnp.float32)
        if self.kind == "cosine":
            half = 0.5 * math.pi * t
            return 0.5 * math.pi * jnp.sin(half) / (1.0 - jnp.cos(half))
        return 1.0 / t

    def discrete_weight(self, t: jax.Array, num_timesteps: int) -> jax.Array:
        """The weight of the ``T``-step bound at ``t = i / T``: ``T (alpha_s - alpha_t)
        / (1 - alpha_t)`` with ``s = t - 1 / T`` (D3PM's discrete-time NELBO, MC over
        ``i``); tends to :meth:`weight` as ``T`` grows."""
        s = t - 1.0 / num_timesteps
        return num_timesteps * (self.alpha(s) - self.alpha(t)) / (1.0 - self.alpha(t))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "eps": self.eps}


def subs_log_probs(logits: jax.Array, z: jax.Array, mask_id: int) -> jax.Array:
    """``log p(x | z)`` ``[batch, length, vocab]`` (float32) under SUBS: the mask's
    logit -1e6 before the softmax; at an unmasked position of ``z`` the one-hot on
    ``z`` (0 there, -1e6 elsewhere), so its NLL of the data is exactly 0."""
    logits = logits.astype(jnp.float32).at[..., mask_id].set(NEG_INF)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    carried = jnp.where(jax.nn.one_hot(z, logits.shape[-1], dtype=bool), 0.0, NEG_INF)
    return jnp.where((z == mask_id)[..., None], log_probs, carried)


def subs_nll(logits: jax.Array, z: jax.Array, x: jax.Array, mask_id: int) -> jax.Array:
    """``-log p(x | z)`` ``[batch, length]`` (float32) under SUBS: the entries of
    :func:`subs_log_probs` at the data ``x``, negated, without the ``[batch, length,
    vocab]`` log-probabilities: at a masked position ``logsumexp - logit[x]`` (the
    mask's logit -1e6), at an unmasked one 0 where ``z == x`` (1e6 where it is not).
    The training loss reads only these, so it saves the full tensor's passes."""
    # a select, not a scatter, removes the mask: it fuses into the passes that read it
    is_mask = jnp.arange(logits.shape[-1]) == mask_id
    logits = jnp.where(is_mask, NEG_INF, logits.astype(jnp.float32))
    picked = jnp.take_along_axis(logits, x[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    return jnp.where(z == mask_id, nll, jnp.where(z == x, 0.0, -NEG_INF))


def _uniform46(key: jax.Array, shape) -> jax.Array:
    """Uniforms in ``[0, 1)`` with 46 bits near 0: ``(k + u) / 2^23``, ``k`` a 23-bit
    integer and ``u`` a float32 uniform, so ``P(U < x) = x`` down to ``x ~ 1e-14``."""
    k_int, k_frac = jax.random.split(key)
    whole = jax.random.randint(k_int, shape, 0, 2**23).astype(jnp.float32)
    return (whole + jax.random.uniform(k_frac, shape)) * jnp.float32(2.0**-23)


def sample_categorical(key: jax.Array, log_probs: jax.Array) -> jax.Array:
    """One draw per row of ``log_probs [..., vocab]`` (int32 ``[...]``).

    An exponential race: ``argmax_v log p_v - log E_v`` with ``E_v = -log1p(-U_v)``
    exponential, ``U_v`` a 46-bit uniform (:func:`_uniform46`), all in float32: the
    same law as ``probs / (-log u)`` in float64 (BD3-LM), without float64.
    """
    exponential = -jnp.log1p(-_uniform46(key, log_probs.shape))
    return jnp.argmax(log_probs.astype(jnp.float32) - jnp.log(exponential), axis=-1).astype(
        jnp.int32
    )


def sample_entropy(tokens, valid=None) -> np.ndarray:
    """Per row, the entropy (nats) of the empirical distribution of its tokens (the
    "entropy" MDLM, BD3-LM and DUO report beside generative perplexity; low entropy =
    repetitive samples). ``valid`` ``[batch, length]`` selects the tokens counted."""
    tokens = np.asarray(tokens)
    valid = np.ones(tokens.shape, bool) if valid is None else np.asarray(valid, bool)
    out = []
    for row, keep in zip(tokens, valid, strict=True):
        _, counts = np.unique(row[keep], return_counts=True)
        p = counts / max(counts.sum(), 1)
        out.append(float(-(p * np.log(p)).sum()) if counts.size else 0.0)
    return np.asarray(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskedSampler:
    """How :func:`sample_masked` unmasks.

    num_steps: denoising steps (the time grid ``1 - i / num_steps``); with
      ``first_hitting``, at least the number of masked tokens (one per step).
    first_hitting: unmask exactly one uniformly chosen masked token per step.
    use_cache: call the denoiser again only when some token changed (exact when it
      does not read ``t``: ``time_conditioning=False``).
    sampling: temperature / top-p (:class:`dew.sampling.Sampling`) applied to
      ``p(x | z)``; ``temperature=0`` = the most likely token.
    """

    num_steps: int = 64
    first_hitting: bool = False
    use_cache: bool = True
    sampling: Sampling = Sampling()

    def __post_init__(self):
        if not is_whole_number(self.num_steps) or self.num_steps < 1:
            raise ValueError(
                f"num_steps={self.num_steps!r} must be a whole number >= 1 (denoising steps)"
            )
        if not isinstance(self.sampling, Sampling):
            raise TypeError(
                f"sampling must be a dew.sampling.Sampling, got {type(self.sampling).__name__}"
            )

    def check_masked(self, masked: int, *, where: str = "") -> None:
        """A first-hitting sampler unmasks one token per step: it needs ``num_steps >=
        masked``."""
        if self.first_hitting and self.num_steps < masked:
            raise ValueError(
                f"a first-hitting sampler unmasks one token per step, so num_steps="
                f"{self.num_steps} cannot unmask {masked} masked tokens{where}; use "
                f"num_steps >= {masked} or first_hitting=False"
            )


def _draw(key, log_probs, sampling: Sampling):
    if sampling.is_greedy:
        return jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
    return sample_categorical(key, filter_logits(log_probs, sampling))


def sample_masked(
    denoise: Callable[[jax.Array, jax.Array], jax.Array],
    tokens: jax.Array,
    *,
    key: jax.Array,
    mask_id: int,
    schedule: MaskSchedule,
    sampler: MaskedSampler,
) -> tuple[jax.Array, jax.Array]:
    """Unmask every mask id of ``tokens [batch, length]``; the others stay.

    denoise: ``(z [batch, length], t [batch]) -> logits [batch, length, vocab]``.
    Returns ``(tokens [batch, length] int32, model_calls)``: the denoiser calls made
    (``num_steps`` without the cache; fewer with it, when steps change nothing).
    Step ``i``'s draws are a pure function of ``fold_in(key, i)``, so the cached and
    uncached samplers draw the same tokens.
    """
    z = jnp.asarray(tokens, jnp.int32)
    steps = sampler.num_steps
    logits = jax.eval_shape(denoise, z, jnp.ones(z.shape[:1], jnp.float32))

    def body(i, carry):
        z, cached, stale, calls = carry
        t = 1.0 - i / steps
        s = 1.0 - (i + 1) / steps
        times = jnp.full(z.shape[:1], t, jnp.float32)
        if sampler.use_cache:
            cached = jax.lax.cond(
                stale, lambda: denoise(z, times).astype(jnp.float32), lambda: cached
            )
            calls = calls + stale.astype(jnp.int32)
        else:
            cached, calls = denoise(z, times).astype(jnp.float32), calls + 1
        log_probs = subs_log_probs(cached, z, mask_id)
        k_token, k_unmask = jax.random.split(jax.random.fold_in(key, i))
        drawn = _draw(k_token, log_probs, sampler.sampling)
        masked = z == mask_id
        if sampler.first_hitting:
            score = jnp.where(masked, jax.random.uniform(k_unmask, z.shape), -1.0)
            pick = jax.nn.one_hot(jnp.argmax(score, axis=-1), z.shape[1], dtype=bool)
            unmask = pick & masked
        else:
            alpha_t, alpha_s = schedule.alpha(t), schedule.alpha(s)
            chance = jnp.where(s <= 0.0, 1.0, (alpha_s - alpha_t) / (1.0 - alpha_t))
            unmask = masked & (jax.random.uniform(k_unmask, z.shape) < chance)
        new = jnp.where(unmask, drawn, z)
        return new, cached, jnp.any(new != z), calls

    zero = jnp.zeros(logits.shape, jnp.float32)
    z, _, _, calls = jax.lax.fori_loop(0, steps, body, (z, zero, jnp.bool_(True), jnp.int32(0)))
    return z, calls


def check_prompt_fits(prompt_length: int, length: int, *, what: str) -> None:
    if prompt_length > length:
        raise ValueError(
            f"{what}: the prompt has {prompt_length} tokens but the sample is {length} tokens "
            f"long; give a shorter prompt or a longer length (at most the model's max_seq_len)"
        )


def sample_blocks(
    model,
    params,
    prompt: jax.Array,
    *,
    key: jax.Array,
    mask_id: int,
    block_size: int,
    length: int,
    schedule: MaskSchedule,
    sampler: MaskedSampler,
    use_kv_cache: bool = True,
    end_id: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """BD3-LM's block-autoregressive sampler: ``length`` tokens, the first
    ``prompt.shape[1]`` of them the prompt ``[batch, prompt]``, denoised one block of
    ``block_size`` after another by :func:`sample_masked` (``sampler`` steps per
    block), each block conditioned on the clean blocks before it.

    model: a :class:`dew.nn.Transformer` over token ids without time conditioning
      (its mask ``full()`` or ``block_causal(block_size)``).
    use_kv_cache: the clean prefix lives in a KV cache of clean blocks only; False
      recomputes the whole prefix at every step under a block-causal mask (the same
      numbers, slower).
    end_id: stop once every row holds it after its prompt (variable length); None =
      all ``length`` tokens.

    Returns ``(tokens [batch, length] int32, blocks run, model calls)``.
    """
    if length % block_size:
        raise ValueError(
            f"length {length} is not a multiple of block_size {block_size}; sample "
            f"k * {block_size} tokens"
        )
    batch, given = prompt.shape
    check_prompt_fits(given, length, what="sample_blocks")
    num_blocks = length // block_size
    first = given // block_size  # the first block holding a masked token
    tokens = jnp.full((batch, length), mask_id, jnp.int32).at[:, :given].set(prompt)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    apply = model.apply

    def block_slice(x, b):
        return jax.lax.dynamic_slice_in_dim(x, b * block_size, block_size, axis=1)

    slots = np.arange(length)[None]  # numpy: the mask is a constant of the program
    visible = masks.block_causal(block_size).allows(slots, slots)  # [1, length, length]

    def denoise_uncached(tokens, b):
        valid = positions < (b + 1) * block_size

        def denoise(zb, t):
            x = jax.lax.dynamic_update_slice_in_dim(tokens, zb, b * block_size, axis=1)
            logits = apply({"params": params}, x, attention_mask=valid, query_key_mask=visible)
            return block_slice(logits, b)

        return denoise

    def denoise_cached(cache, b):
        def denoise(zb, t):
            logits, _ = apply(
                {"params": params, "cache": cache},
                zb,
                positions=b * block_size + offsets[None].repeat(batch, 0),
                decode=True,
                mutable=["cache"],
            )  # the noisy block's writes are dropped: the cache keeps clean blocks only
            return logits

        return denoise

    def commit(cache, tokens, b):
        _, written = apply(
            {"params": params, "cache": cache},
            block_slice(tokens, b),
            positions=b * block_size + offsets[None].repeat(batch, 0),
            decode=True,
            mutable=["cache"],
        )
        return written["cache"]

    cache = None
    if use_kv_cache:
        cache = init_cache(model, params, batch, length)
        if first:  # the prompt's whole blocks, clean, in one pass
            _, written = apply(
                {"params": params, "cache": cache},
                tokens[:, : first * block_size],
                positions=positions[:, : first * block_size],
                decode=True,
                mutable=["cache"],
            )
            cache = written["cache"]
    after_prompt = positions >= given

    def cond(carry):
        b, tokens, _, _ = carry
        unfinished = True
        if end_id is not None:
            ended = jnp.any((tokens == end_id) & after_prompt, axis=1)
            unfinished = ~jnp.all(ended)
        return (b < num_blocks) & unfinished

    def body(carry):
        b, tokens, cache, calls = carry
        denoise = denoise_cached(cache, b) if use_kv_cache else denoise_uncached(tokens, b)
        block, used = sample_masked(
            denoise,
            block_slice(tokens, b),
            key=jax.random.fold_in(key, b),
            mask_id=mask_id,
            schedule=schedule,
            sampler=sampler,
        )
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, block, b * block_size, axis=1)
        if use_kv_cache:
            cache = jax.lax.cond(
                b + 1 < num_blocks, lambda: commit(cache, tokens, b), lambda: cache
            )
            used = used + (b + 1 < num_blocks).astype(jnp.int32)
        return b + 1, tokens, cache, calls + used

    b, tokens, _, calls = jax.lax.while_loop(
        cond, body, (jnp.int32(first), tokens, cache, jnp.int32(0))
    )
    return tokens, b - first, calls

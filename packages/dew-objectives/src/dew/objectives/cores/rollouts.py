"""Rollouts for on-policy objectives: prompts -> completions and their log-probs.

Everything here runs inside the trainer's compiled prepare phase, on the same
weights, mesh and dtype as the loss (GRPO, PPO, on-policy distillation):

1. :func:`sample_completions` repeats each prompt ``group_size`` times (row
   ``b * group_size + g`` is sample ``g`` of prompt ``b``) and continues every
   row with :func:`dew.sampling.decode`, the cached, traceable decoder of
   ``dew.sampling``; the draw of row ``r`` depends only on ``key`` and ``r``.
2. :func:`rollout_logprobs` scores the completions with one full forward
   pass over ``[prompt | completion]``:

       log pi(o_t | q, o_<t) = log_softmax(filter(logits_t / T))[o_t]

   with the sampler's temperature ``T`` and truncation (top-k / top-p /
   min-p, :func:`dew.sampling.filter_logits`), the prompt's left padding and
   positions. The loss calls the same function on the same rows, so the
   "old" log-probs a rollout stores and the log-probs of the first update
   come from one computation on the same weights: the importance ratio
   ``rho = exp(logp - old_logp)`` of the first update is 1 (TRL #454 and
   trlx #107 are the bugs this rules out: temperature missing from the
   training logits, other padding or positions). The decoder's own
   log-probs (raw logits, cached attention) are not reused for that reason.
3. :func:`dew.objectives.cores.rl.check_first_update` is the library's debug
   assertion of that contract (relative to the log-prob); objectives turn it
   on with a constructor flag, or ``DEW_DEBUG=1`` in the environment.

:class:`CausalRollouts` holds a family's sampler settings and calls the three
with them, so its prepare and its loss cannot read different ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract.batch import IDS, MASK, BatchField
from dew.objectives.cores.logprobs import rollout_positions, token_logprobs
from dew.objectives.cores.rl import (
    RATIO_TOLERANCE,
    RatioError,
    check_first_update,
    max_ratio_deviation,
)
from dew.sampling import Sampling, decode, filter_logits

__all__ = [  # RatioError and its tolerance live in dew.objectives.cores.rl; importable here too
    "RATIO_TOLERANCE",
    "CausalRollouts",
    "PROMPT_KEYS",
    "RatioError",
    "Rollout",
    "check_rollout_options",
    "check_rollout_rows",
    "debug_enabled",
    "in_chunks",
    "max_ratio_deviation",
    "prompt_fields",
    "repeat_rows",
    "rollout_logprobs",
    "sample_completions",
    "scored_logprobs",
    "traced_data_parallel",
]


PROMPT_KEYS = ("prompt", "prompt_mask")


def prompt_fields() -> tuple[BatchField, ...]:
    """The batch a rollout starts from: left-padded prompts (``dew.data.Prompts``)."""
    return (
        BatchField("prompt", ("prompt_len",), IDS),
        BatchField("prompt_mask", ("prompt_len",), MASK),
    )


def check_rollout_options(scoring_rows, prepared_updates) -> None:
    """``scoring_rows`` a positive int or None; ``prepared_updates`` an ``Updates``."""
    from dew.objectives.contract.objective import Updates

    if scoring_rows is not None and (isinstance(scoring_rows, bool) or scoring_rows < 1):
        raise ValueError(f"scoring_rows must be >= 1 rows or None, got {scoring_rows!r}")
    if not isinstance(prepared_updates, Updates):
        raise TypeError(
            f"prepared_updates must be dew.objectives.Updates(epochs=, minibatches=), got "
            f"{prepared_updates!r}"
        )


def check_rollout_rows(
    rows: int, *, minibatches: int, scoring_rows: int | None, what: str, made: str = ""
) -> None:
    """A rollout batch of ``rows`` rows (``made``: how, for the message) must split
    into the updates' ``minibatches`` and prepare's chunks of ``scoring_rows``."""
    if rows % minibatches:
        raise ValueError(
            f"{what}: a rollout batch of {rows} rows{made} does not split into {minibatches} "
            f"minibatches; use a batch that is a multiple of {minibatches}"
        )
    if scoring_rows and rows % scoring_rows:
        raise ValueError(
            f"{what}: a rollout batch of {rows} rows{made} does not split into chunks of "
            f"scoring_rows={scoring_rows}; use a divisor of {rows}"
        )


@flax.struct.dataclass
class Rollout:
    """Completions of a batch of prompts, one row per completion.

    prompt: int32 ``[rows, prompt_len]``, left-padded (each prompt ends in the last column).
    prompt_mask: bool ``[rows, prompt_len]``, False on padding.
    completion: int32 ``[rows, max_new_tokens]``: the new tokens, an end id
      included, then ``pad_id``.
    completion_mask: bool ``[rows, max_new_tokens]``, True on the new tokens
      (the end id included), False after a row ended.
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    completion: jax.Array
    completion_mask: jax.Array

    @property
    def lengths(self) -> jax.Array:
        """``[rows]`` new tokens per row (an end id counted)."""
        return jnp.sum(self.completion_mask, axis=-1, dtype=jnp.int32)

    def as_dict(self) -> dict[str, jax.Array]:
        """The four arrays by name (what a prepared batch stores)."""
        return {
            "prompt": self.prompt,
            "prompt_mask": self.prompt_mask,
            "completion": self.completion,
            "completion_mask": self.completion_mask,
        }

    @classmethod
    def from_batch(cls, batch) -> Rollout:
        """The rollout stored in a prepared batch (keys as :meth:`as_dict` names them)."""
        return cls(
            prompt=batch["prompt"],
            prompt_mask=batch["prompt_mask"],
            completion=batch["completion"],
            completion_mask=batch["completion_mask"],
        )


def repeat_rows(x: jax.Array, group_size: int) -> jax.Array:
    """``[batch, ...] -> [batch * group_size, ...]``, row ``b`` repeated ``group_size``
    times in a row (row ``b * group_size + g``)."""
    return jnp.repeat(x, group_size, axis=0, total_repeat_length=x.shape[0] * group_size)


def sample_completions(
    model,
    params,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    *,
    key: jax.Array,
    max_new_tokens: int,
    sampling: Sampling,
    group_size: int = 1,
    end_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> Rollout:
    """``group_size`` completions of each prompt, traceable (call it inside ``prepare``).

    prompt, prompt_mask: ``[batch, prompt_len]`` left-padded prompts (the
      ``dew.data.Prompts`` reader's ``prompt`` and ``prompt_mask``).
    key: the rollout's key (``step.key`` of the prepare phase).
    Returns a :class:`Rollout` of ``batch * group_size`` rows; no gradient
    flows through it.
    """
    prompt = repeat_rows(prompt, group_size)  # [batch * group, prompt_len]
    prompt_mask = repeat_rows(prompt_mask.astype(bool), group_size)
    tokens, _, lengths = decode(
        model,
        params,
        prompt,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        key=key,
        sampling=sampling,
        end_ids=tuple(end_ids),
        pad_id=pad_id,
    )
    mask = jnp.arange(max_new_tokens)[None, :] < lengths[:, None]  # [rows, new]
    return jax.lax.stop_gradient(
        Rollout(prompt=prompt, prompt_mask=prompt_mask, completion=tokens, completion_mask=mask)
    )


def right_aligned(rollout: Rollout) -> tuple[jax.Array, jax.Array]:
    """A rollout's rows as a reward model reads them: prompt (without its left
    padding), completion, then padding, ``(ids, mask)`` each ``[rows, prompt_len +
    new]``; ``mask`` True on the prompt's and the completion's ids."""
    ids = jnp.concatenate([rollout.prompt, rollout.completion], axis=1)
    rows, length = ids.shape
    left_pad = rollout.prompt.shape[1] - jnp.sum(rollout.prompt_mask, axis=1, dtype=jnp.int32)
    real = jnp.sum(rollout.prompt_mask, axis=1, dtype=jnp.int32) + rollout.lengths
    t = jnp.arange(length)[None, :]
    source = (t + left_pad[:, None]) % length
    return jnp.take_along_axis(ids, source, axis=1), t < real[:, None]


def rollout_logprobs(
    model, params, rollout: Rollout, *, sampling: Sampling, logits_chunk_size: int | None = None
) -> jax.Array:
    """``[rows, max_new_tokens]`` float32 ``log pi(o_t | q, o_<t)`` of each completion
    token under ``params``, with the sampler's temperature and truncation; 0 on
    positions after a row ended.

    One forward pass over ``[prompt | completion]`` with the positions and
    attention mask :func:`dew.sampling.decode` uses
    (:func:`dew.objectives.cores.logprobs.rollout_positions`); the logits at
    position ``prompt_len - 1 + t`` score completion token ``t``
    (:func:`scored_logprobs`). Differentiable in ``params``: the loss calls it
    for the new log-probs, a rollout for the old and the reference ones.

    logits_chunk_size: None = the whole logits; a number = the model scores the
    completion in chunks of that many positions (:func:`chunked_rollout_logprobs`).
    """
    if logits_chunk_size is not None:
        return chunked_rollout_logprobs(model, params, rollout, sampling, logits_chunk_size)
    prompt_len = rollout.prompt.shape[1]
    new = rollout.completion.shape[1]
    tokens = jnp.concatenate([rollout.prompt, rollout.completion], axis=1)  # [rows, length]
    positions, mask = rollout_positions(rollout.prompt_mask, new)
    logits = model.apply(
        {"params": nn.meta.unbox(params)}, tokens, positions=positions, attention_mask=mask
    )  # [rows, length, vocab]
    logits = logits[:, prompt_len - 1 : prompt_len - 1 + new]  # [rows, new, vocab]
    logps = scored_logprobs(logits, rollout.completion, sampling)
    return jnp.where(rollout.completion_mask, logps, 0.0)


def check_chunked_sampling(sampling: Sampling, logits_chunk_size, *, what: str) -> None:
    """Scoring in chunks computes ``log softmax(logits / T)``; a sampler that truncates
    (top-k, top-p, min-p) renormalises over tokens only the whole logits show."""
    truncates = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0.0
    if logits_chunk_size is not None and truncates and not sampling.is_greedy:
        raise ValueError(
            f"{what}: logits_chunk_size={logits_chunk_size} scores completions under "
            f"softmax(logits / temperature), but the sampling truncates (top_k="
            f"{sampling.top_k}, top_p={sampling.top_p}, min_p={sampling.min_p}), whose "
            f"log-probs need the whole logits; use logits_chunk_size=None or sampling "
            f"without top-k/top-p/min-p"
        )


def chunked_rollout_logprobs(
    model, params, rollout: Rollout, sampling: Sampling, logits_chunk_size: int, **apply_options
):
    """:func:`rollout_logprobs` with the model scoring the completion itself,
    ``logits_chunk_size`` positions at a time (``CausalTransformer(..., targets=,
    logits_chunk_size=)``), at the sampler's temperature (no truncation:
    :func:`check_chunked_sampling`). ``apply_options`` (``return_hidden=True``) go to
    the model; with them the result is ``(log-probs, what the model returned besides)``.
    """
    prompt_len = rollout.prompt.shape[1]
    new = rollout.completion.shape[1]
    tokens = jnp.concatenate([rollout.prompt, rollout.completion], axis=1)  # [rows, length]
    positions, mask = rollout_positions(rollout.prompt_mask, new)
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # the last is not scored
    out = model.apply(
        {"params": nn.meta.unbox(params)},
        tokens,
        positions=positions,
        attention_mask=mask,
        targets=targets,
        logits_chunk_size=logits_chunk_size,
        temperature=1.0 if sampling.is_greedy else sampling.temperature,
        **apply_options,
    )
    scores, rest = (out[0], out[1:]) if apply_options else (out, None)
    logps = scores.log_probs[:, prompt_len - 1 : prompt_len - 1 + new]  # [rows, new]
    logps = jnp.where(rollout.completion_mask, logps, 0.0)
    return (logps, *rest) if apply_options else logps


def scored_logprobs(logits: jax.Array, targets: jax.Array, sampling: Sampling) -> jax.Array:
    """``log p(targets)`` under the distribution ``sampling`` draws from: the
    logits divided by the temperature and, with top-k / top-p / min-p, the
    excluded tokens removed (:func:`dew.sampling.filter_logits`), renormalised.
    A greedy ``sampling`` scores at temperature 1. float32 ``[...]``."""
    truncates = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0.0
    if truncates and not sampling.is_greedy:
        return token_logprobs(filter_logits(logits, sampling), targets)
    temperature = 1.0 if sampling.is_greedy else sampling.temperature
    return token_logprobs(logits, targets, temperature=temperature)


def in_chunks(fn, tree, chunk_rows: int):
    """``fn(tree)`` computed over chunks of ``chunk_rows`` rows by ``lax.map``, the
    results put back in row order. Chunk ``c`` of ``n = rows / chunk_rows`` holds
    rows ``c, c + n, c + 2n, ...``, so a data-parallel split of the rows stays on
    its devices.

    Prepare scores its rollouts this way with the rows of one update: the loss's
    forward pass then has the shapes of the rollout's, and XLA computes the same
    float32 log-probs (the first update's ratio is exactly 1; the same pass over
    all rows at once can differ by ~1e-6), with the memory of one update
    (TRL's ``local_rollout_forward_batch_size``)."""
    rows = jax.tree.leaves(tree)[0].shape[0]
    if chunk_rows >= rows:
        return fn(tree)
    if rows % chunk_rows:
        raise ValueError(f"{rows} rows do not split into chunks of {chunk_rows}")
    n = rows // chunk_rows

    def split(x):
        return x.reshape(chunk_rows, n, *x.shape[1:]).swapaxes(0, 1)

    def merge(x):
        return x.swapaxes(0, 1).reshape(rows, *x.shape[2:])

    return jax.tree.map(merge, jax.lax.map(fn, jax.tree.map(split, tree)))


def traced_data_parallel() -> int:
    """The devices a batch's rows split over in the program being traced: the mesh
    axes the logical ``batch`` axis maps to under the active rules (the trainer's
    ``Programs.context``), multiplied; 1 outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = nn.logical_to_mesh_axes(("batch",))
    axes = spec[0] if len(spec) else None
    if mesh.empty or axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(int(mesh.shape[a]) for a in axes if a in mesh.shape)


def debug_enabled(flag: bool | None) -> bool:
    """An objective's debug flag: ``flag`` when given, else ``DEW_DEBUG=1`` in the
    environment (read when the objective is built)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("DEW_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CausalRollouts:
    """How an RL family of a causal LM draws completions and scores them (GRPO, PPO):
    its sampler settings, given once to :func:`sample_completions`,
    :func:`rollout_logprobs` and :func:`dew.objectives.cores.rl.check_first_update`.

    model, sampling, max_new_tokens, group_size, end_ids, pad_id, logits_chunk_size:
      the family's options of those names (``end_ids``: one id or a sequence).
    check_first_ratio: assert the first update's ratio; None = ``DEW_DEBUG=1``.
    """

    model: Any
    sampling: Sampling
    max_new_tokens: int
    group_size: int = 1
    end_ids: Any = ()
    pad_id: int = 0
    logits_chunk_size: int | None = None
    check_first_ratio: bool | None = None

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """``end_ids`` as a tuple of ints."""
        return tuple(int(e) for e in np.atleast_1d(np.asarray(self.end_ids)).reshape(-1))

    @functools.cached_property
    def checks_ratio(self) -> bool:
        """Assert the first update's ratio (``check_first_ratio``, else ``DEW_DEBUG``)."""
        return debug_enabled(self.check_first_ratio)

    def sample(self, params, batch, key: jax.Array) -> Rollout:
        """``group_size`` completions of each of ``batch``'s prompts (traced)."""
        return sample_completions(
            self.model,
            params,
            batch["prompt"],
            batch["prompt_mask"],
            key=key,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            group_size=self.group_size,
            end_ids=self.stop_ids,
            pad_id=self.pad_id,
        )

    def logprobs(self, params, rollout: Rollout) -> jax.Array:
        """``[rows, new]`` :func:`rollout_logprobs` of ``params`` with these settings."""
        return rollout_logprobs(
            self.model,
            params,
            rollout,
            sampling=self.sampling,
            logits_chunk_size=self.logits_chunk_size,
        )

    def check_first_update(self, logps, old_logps, mask, *, step, updates, what: str) -> None:
        """:func:`dew.objectives.cores.rl.check_first_update` when :attr:`checks_ratio`
        (``updates``: the family's :class:`~dew.objectives.Updates`)."""
        if self.checks_ratio:
            check_first_update(
                logps,
                old_logps,
                mask,
                step=step.index,
                updates_per_batch=updates.per_batch,
                what=what,
            )

"""Masked diffusion language modelling (MDLM: Sahoo et al., NeurIPS 2024, arXiv 2406.07524).

Absorbing process: each token of ``x [batch, length]`` is replaced by the mask id
with probability ``1 - alpha_t`` (:class:`dew.sampling.token_diffusion.MaskSchedule`,
log-linear by default), ``z_t ~ q(z_t | x)``. The denoiser is a bidirectional
:class:`dew.nn.Transformer` read in the SUBS parameterisation
(:func:`~dew.sampling.token_diffusion.subs_log_probs`: the mask logit -1e6 in
float32, unmasked tokens carried over). The loss is the continuous-time negative
ELBO, Rao-Blackwellised (kuleshov-group/mdlm ``diffusion.py``)::

    NELBO(x) = E_{t ~ U[eps, 1]} E_{z_t} [ sum_l 1[z_t^l = m] (-alpha'_t / (1 - alpha_t))
                                          (-log p_theta(x^l | z_t)) ]

(``1 / t`` times the masked tokens' NLL for the log-linear schedule), with
antithetic times over the batch (``t_i = eps + (1 - eps) ((u + i / n) mod 1)``);
``num_timesteps = T`` gives the discrete ``T``-step bound instead. Under SUBS an
unmasked position's NLL is exactly 0, so the sum runs over every position.

The loss is a :class:`~dew.objectives.Weighted` per-token mean: the sum over the
rows of the weighted NLLs over the number of real (unpadded) tokens, so
accumulation and data parallelism divide once by the global token count.

:meth:`MaskedDiffusionObjective.evaluate` is an unbiased, reproducible estimate of the
bound: per row, ``eval_times`` stratified times ``t_k = eps + (1 - eps) (k + u) /
eval_times`` with the row's own shift ``u ~ U[0, 1)``, and at each a masking, all drawn
from keys of ``eval_seed`` and the row's index in the evaluation set, so the figure depends neither
on the batch size nor on the device count. Each row's estimate is unbiased for its
``int_eps^1`` integral (one shift shared by every row, as evaluation drew before, biased the whole
figure by about ``(u - 1/2) (f(1) - f(eps)) / eval_times`` whatever the data's size),
so the mean over rows converges to the bound as the evaluation set grows;
:meth:`summarize` adds its standard error over rows (``nelbo_stderr``) and
``perplexity_bound = exp(nelbo)``. The integral starts at ``time_eps``: the part left
out, ``int_0^eps f``, is at most ``eps`` times the per-token NLL of a token given all
others (0.1% of it at MDLM's ``1e-3``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import is_whole_number
from dew.objectives.contract import registry
from dew.objectives.contract.batch import IDS, MASK, BatchField, check_token_ids, first_row
from dew.objectives.contract.objective import EMA, Objective, Step, with_initial_values
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.diffusion.denoisers import TokenDenoiser
from dew.objectives.diffusion.images import default_ema
from dew.sampling.token_diffusion import (
    MaskedSampler,
    MaskSchedule,
    TokenDiffusionGeneration,
    subs_log_probs,
    subs_nll,
)

# odd multipliers of a row hash (uint32 arithmetic wraps): a row's evaluation masking
# is a function of its ids, not of where it sits in a batch
_HASH_MULTIPLIER = 2654435761


def row_hashes(ids: jax.Array) -> jax.Array:
    """``[batch]`` uint32: a hash of each row of ``ids [batch, length]``."""
    length = ids.shape[1]
    multipliers = (np.arange(length, dtype=np.uint64) * _HASH_MULTIPLIER + 97531) % 2**32
    weights = jnp.asarray(multipliers.astype(np.uint32))
    return jnp.sum((ids.astype(jnp.uint32) + 1) * weights[None], axis=1, dtype=jnp.uint32)


def row_uniforms(key: jax.Array, ids: jax.Array) -> jax.Array:
    """``[batch, length]`` uniforms, row ``r``'s from ``fold_in(key, hash(ids[r]))``."""
    keys = jax.vmap(lambda h: jax.random.fold_in(key, h))(row_hashes(ids))
    return jax.vmap(lambda k: jax.random.uniform(k, ids.shape[1:]))(keys)


def indexed_uniforms(key: jax.Array, index: jax.Array, shape=()) -> jax.Array:
    """``[len(index), *shape]`` uniforms, row ``i``'s from ``fold_in(key, index[i])``: a
    row's draws follow its index in the whole evaluation set, not its batch or device,
    and two equal rows at different indices draw independently."""
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), shape))(index)


def antithetic_uniforms(key: jax.Array, count: int) -> jax.Array:
    """``(u + i / count) mod 1`` for ``i < count``, one ``u ~ U[0, 1)``: low-variance
    times covering ``[0, 1)`` evenly (MDLM ``_sample_t``)."""
    return antithetic_at(key, jnp.arange(count), count)


def antithetic_at(key: jax.Array, index: jax.Array, count: int) -> jax.Array:
    """Entries ``index`` of :func:`antithetic_uniforms` ``(key, count)``: a microbatch's
    share of the whole batch's antithetic draws (the same ``u`` for every share)."""
    u = jax.random.uniform(key, ())
    return jnp.mod(u + index.astype(jnp.float32) / count, 1.0)


def uniforms_at(key: jax.Array, index: jax.Array) -> jax.Array:
    """Independent ``U[0, 1)`` draws ``fold_in(key, i)`` for each ``i`` in ``index``."""
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), ()))(index)


# the per-row sums behind the bound's standard error (summarize drops them)
_MOMENTS = ("nelbo_rows", "nelbo_square", "nelbo_cross", "nelbo_tokens_square")


def nelbo_moments(row_total: jax.Array, row_tokens: jax.Array) -> dict[str, Summed]:
    """Sums over rows of ``(1, T_r^2, T_r n_r, n_r^2)`` (``T_r`` a row's NELBO in nats,
    ``n_r`` its tokens; rows without tokens left out): with ``nelbo``'s totals they give
    the standard error of the ratio ``sum T / sum n`` (:func:`with_nelbo_stderr`)."""
    real = (row_tokens > 0).astype(jnp.float32)
    return {
        "nelbo_rows": Summed(jnp.sum(real)),
        "nelbo_square": Summed(jnp.sum(real * row_total**2)),
        "nelbo_cross": Summed(jnp.sum(real * row_total * row_tokens)),
        "nelbo_tokens_square": Summed(jnp.sum(real * row_tokens**2)),
    }


def with_nelbo_stderr(results: Mapping[str, float]) -> dict[str, float]:
    """``results`` with ``nelbo_stderr``, the standard error over rows of the ratio
    estimate ``nelbo = sum_r T_r / sum_r n_r`` (delta method: ``sqrt(R / (R - 1)
    sum_r (T_r - nelbo n_r)^2) / sum_r n_r``, over ``R`` rows), in place of the sums of
    :func:`nelbo_moments`. It counts both the data's and the Monte-Carlo spread."""
    out = {k: v for k, v in results.items() if k not in _MOMENTS}
    if not all(k in results for k in _MOMENTS):
        return out
    rows, ratio, tokens = results["nelbo_rows"], results["nelbo"], results["tokens"]
    spread = (
        results["nelbo_square"]
        - 2 * ratio * results["nelbo_cross"]
        + ratio**2 * results["nelbo_tokens_square"]
    )
    if rows < 2 or tokens <= 0:
        out["nelbo_stderr"] = float("nan")
    else:
        out["nelbo_stderr"] = float(np.sqrt(max(spread, 0.0) * rows / (rows - 1)) / tokens)
    return out


def batch_rows(step: Step, rows: int) -> tuple[jax.Array, int]:
    """``(index, total)``: this (micro)batch's rows' indices in the step's whole batch
    and its row count (``Step.rows``; ``arange(rows)`` and ``rows`` outside the trainer)."""
    if step.rows is None:
        return jnp.arange(rows), rows
    return step.rows, step.batch_rows


def tokenizer_of(tokenizer):
    """``tokenizer``, or a ``ByteTokenizer()`` (mask id 258) for None."""
    if tokenizer is None:
        from dew.data import ByteTokenizer

        return ByteTokenizer()
    return tokenizer


def spec_length(spec, text_key: str, *, what: str) -> int:
    """The ids per row the data declares (``spec[text_key]``), or a ValueError."""
    if spec is None or text_key not in spec:
        raise ValueError(
            f"{what} has no seq_len and the data declares no {text_key!r} "
            f"field (Dataset.spec); pass seq_len=... or a Dataset with a spec"
        )
    return int(tuple(spec[text_key].shape)[0])


def valid_tokens(batch, ids, attention_mask_key: str | None) -> jax.Array:
    """``[rows, length]`` float32: 1 on real tokens, 0 on padding (the attention mask)
    and on padded rows (``example_mask``)."""
    valid = jnp.ones(ids.shape, jnp.float32)
    if attention_mask_key is not None:
        valid = valid * jnp.asarray(batch[attention_mask_key], jnp.float32)
    if "example_mask" in batch:  # padded rows of a last validation batch
        valid = valid * jnp.asarray(batch["example_mask"], jnp.float32)[:, None]
    return valid


def resolve_mask_id(mask_id, tokenizer, model, *, what: str) -> int:
    """The mask id: ``mask_id``, else the tokenizer's; it must lie inside the model's
    vocabulary. Errors name the values and what to do."""
    if mask_id is None:
        mask_id = getattr(tokenizer, "mask_id", None)
        if mask_id is None:
            raise ValueError(
                f"{what}: the tokenizer {type(tokenizer).__name__} has no mask id "
                f"(mask_id None) and its vocabulary is fixed; masked diffusion needs an "
                f"absorbing [MASK] id: pass mask_id=<an id the data never uses>, or load "
                f"the tokenizer with HFTokenizer(path, mask_token='[MASK]'), which adds one"
            )
    if not is_whole_number(mask_id) or mask_id < 0:
        raise ValueError(f"{what}: mask_id={mask_id!r} must be a token id >= 0")
    vocab = getattr(model, "vocab_size", None)
    if vocab is None:
        raise ValueError(
            f"{what}: the model has no vocab_size; masked diffusion needs a token model "
            f"(dew.nn.Transformer(vocab_size=...))"
        )
    if mask_id >= vocab:
        raise ValueError(
            f"{what}: mask_id {mask_id} is outside the model's vocabulary (vocab_size "
            f"{vocab}); build the model with vocab_size >= {mask_id + 1} (the tokenizer's "
            f"vocab_size counts its mask id)"
        )
    return int(mask_id)


@registry.register("masked_diffusion")
@dataclasses.dataclass(frozen=True, eq=False)
class MaskedDiffusionObjective(Objective):
    """MDLM training of a bidirectional token denoiser (module docstring).

    model: a :class:`dew.nn.Transformer` over token ids (``vocab_size`` counts the mask
      id); ``time_conditioning=True`` makes it read ``t`` (off by default, as MDLM).
    mask_id: the absorbing state; None = the tokenizer's ``mask_id``.
    tokenizer: ``encode`` / ``decode``; None = ``ByteTokenizer()`` (mask id 258).
    schedule: the masking schedule (``'loglinear'``, ``'linear'``, ``'cosine'``).
    num_timesteps: 0 = the continuous-time NELBO; ``T`` >= 1 = the discrete ``T``-step
      bound (times ``i / T``).
    time_eps: training times are drawn from ``[time_eps, 1]`` (MDLM's sampling_eps).
    antithetic: antithetic times over the rows of a batch; False = independent.
    text_key: the batch key of the rows of ids ``[rows, length]``; every id is
      modelled (``TokenWindows`` rows of ``seq_len + 1`` ids are ``seq_len + 1`` tokens).
    attention_mask_key: optional batch key of a 0/1 ``[rows, length]`` mask; 0 marks
      padding, never masked, never attended to, never counted. None = every id is real.
    seq_len: ids per row; None = from the data's batch spec.
    ema: the moving average (default 0.9999 with warm-up); evaluation and export use it.
    eval_times: stratified times per row in :meth:`evaluate` (one forward pass each);
      more lowers the estimate's variance, never its mean (it is unbiased for any count).
    eval_seed: the seed of evaluation's per-row time shifts and masking.
    sampler: the :class:`~dew.sampling.token_diffusion.MaskedSampler` of the exported
      pipeline (steps, first-hitting, cache, top-p).
    init_params: start from these parameters instead of a fresh initialisation.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    mask_id: int | None = None
    tokenizer: Any = None
    schedule: MaskSchedule = MaskSchedule()
    num_timesteps: int = 0
    time_eps: float = 1e-3
    antithetic: bool = True
    text_key: str = "text"
    attention_mask_key: str | None = None
    seq_len: int | None = None
    ema: EMA | None = dataclasses.field(default_factory=default_ema)
    eval_times: int = 16
    eval_seed: int = 0
    sampler: MaskedSampler = MaskedSampler()
    init_params: Any = None

    headline_metrics = ("nll_masked", "masked")
    what = "MaskedDiffusionObjective"

    def __post_init__(self):
        self.mask_token  # noqa: B018  (resolves and checks the mask id now)
        if not isinstance(self.schedule, MaskSchedule):
            raise TypeError(
                f"{self.what}: schedule must be a dew.sampling.token_diffusion.MaskSchedule, "
                f"got {type(self.schedule).__name__}"
            )
        if not is_whole_number(self.num_timesteps) or self.num_timesteps < 0:
            raise ValueError(
                f"{self.what}: num_timesteps={self.num_timesteps!r} must be 0 (continuous "
                f"time) or a whole number >= 1 (the discrete T-step bound)"
            )
        if not 0.0 < self.time_eps < 1.0:
            raise ValueError(f"{self.what}: time_eps must be in (0, 1), got {self.time_eps}")
        if not is_whole_number(self.eval_times) or self.eval_times < 1:
            raise ValueError(
                f"{self.what}: eval_times={self.eval_times!r} must be a whole number >= 1 "
                f"(grid points of the evaluation)"
            )
        if self.seq_len is not None:
            self.denoiser.check_length(self.seq_len)

    @functools.cached_property
    def mask_token(self) -> int:
        """The mask id: ``mask_id``, or the tokenizer's (checked against the model)."""
        return resolve_mask_id(
            self.mask_id, tokenizer_of(self.tokenizer), self.model, what=self.what
        )

    @functools.cached_property
    def denoiser(self) -> TokenDenoiser:
        """The forward pass (:mod:`dew.objectives.diffusion.denoisers`): the rows it
        reads, each token's time, the logits of the noisy rows."""
        return TokenDenoiser(
            model=self.model, attention_mask_key=self.attention_mask_key, what=self.what
        )

    # ------------------------------------------------------------------ batch
    def batch_fields(self):
        length = "length" if self.seq_len is None else self.seq_len
        fields = [BatchField(self.text_key, (length,), IDS)]
        if self.attention_mask_key is not None:
            fields.append(BatchField(self.attention_mask_key, (length,), MASK))
        return tuple(fields)

    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        super().check_batch(batch)
        ids = np.asarray(batch[self.text_key])
        self.denoiser.check_length(ids.shape[1])
        check_token_ids(ids, getattr(self.model, "vocab_size", None), key=self.text_key,
                        what=f"{self.what}'s model")  # fmt: skip
        found = first_row((ids == self.mask_token).any(axis=1))
        if found is not None:
            row, count = found
            raise ValueError(
                f"{self.what}: batch[{self.text_key!r}] holds the mask id {self.mask_token} as "
                f"data (row {row}, {count} rows in all); the mask id is the absorbing state "
                f"and must never occur in the data: use a tokenizer whose mask id is unused "
                f"(ByteTokenizer's {258}, HFTokenizer(mask_token=...)) or drop it in the reader"
            )

    # ------------------------------------------------------------------- init

    def init(self, key, spec=None):
        length = self.seq_len
        if length is None:
            length = spec_length(spec, self.text_key, what=self.what)
            self.denoiser.check_length(length)
        inputs = jnp.zeros((1, length), jnp.int32)
        extra = {"time": jnp.zeros((1,), jnp.float32)} if self.denoiser.is_timed else {}
        variables = self.model.init(key, inputs, **extra)
        if self.init_params is None:
            return {"params": {"policy": variables["params"]}}
        params = with_initial_values(
            variables["params"], self.init_params, what=f"{self.what} init_params"
        )
        return {"params": {"policy": params}}

    # ---------------------------------------------------------------- the loss
    def draw_times(self, key: jax.Array, rows: int, length: int, index=None, total=None):
        """The times of one training batch, per row ``[rows]`` (antithetic by default):
        rows ``index`` (default ``arange(rows)``) of a whole batch of ``total`` rows."""
        index = jnp.arange(rows) if index is None else index
        total = rows if total is None else total
        u = antithetic_at(key, index, total) if self.antithetic else uniforms_at(key, index)
        return self.time_eps + (1.0 - self.time_eps) * u

    def draws(self, step: Step, rows: int, length: int) -> tuple[jax.Array, jax.Array]:
        """``(times, noise)`` of one training (micro)batch: the times antithetic over the
        step's whole batch (one uniform a step, shifted by the row's index over the
        batch's rows) and each row's masking uniforms from its own key
        (:meth:`Step.row_keys`), so ``accumulate=k`` and any device count draw what one
        full batch on one device draws."""
        index, total = batch_rows(step, rows)
        shared = step.row_key if step.row_key is not None else step.key
        times = self.draw_times(jax.random.fold_in(shared, 1), rows, length, index, total)
        noise = jax.vmap(lambda k: jax.random.uniform(k, (length,)))(step.row_keys(rows))
        return times, noise

    def discretised(self, t: jax.Array) -> jax.Array:
        """``t`` itself (continuous time) or ``ceil(t T) / T`` (the discrete bound)."""
        if not self.num_timesteps:
            return t
        T = self.num_timesteps
        return jnp.clip(jnp.ceil(t * T), 1, T) / T

    def denoiser_log_probs(self, params, z, x, valid, t_tokens, times) -> jax.Array:
        """``log p(. | z)`` ``[rows, length, vocab]`` of the noisy rows ``z`` (SUBS)."""
        logits = self.denoiser.logits(params, z, x, valid, t_tokens, times)
        return subs_log_probs(logits, z, self.mask_token)

    def token_terms(self, params, batch, t_tokens, noise, times=None):
        """Per token ``[rows, length]``: ``(weighted NLL, valid, masked, NLL)`` at token
        times ``t_tokens`` and masking uniforms ``noise`` (a token is masked when its
        uniform is below ``1 - alpha_t``): the draws given, for tests and evaluation."""
        x = jnp.asarray(batch[self.text_key], jnp.int32)
        valid = valid_tokens(batch, x, self.attention_mask_key)
        t_tokens = self.discretised(t_tokens)
        masked = (noise < self.schedule.mask_chance(t_tokens)) & (valid > 0)
        z = jnp.where(masked, self.mask_token, x)
        if times is None:
            times = t_tokens[:, 0]
        logits = self.denoiser.logits(params, z, x, valid, t_tokens, times)
        nll = subs_nll(logits, z, x, self.mask_token)  # [rows, length]
        if self.num_timesteps:  # the NELBO weight of a masked token at time t
            weight = self.schedule.discrete_weight(t_tokens, self.num_timesteps)
        else:
            weight = self.schedule.weight(t_tokens)
        weighted = weight * nll * valid
        return weighted, valid, masked.astype(jnp.float32), nll * valid

    def loss(self, variables, batch, step: Step):
        x = batch[self.text_key]
        rows, length = x.shape
        times, noise = self.draws(step, rows, length)
        weighted, valid, masked, nll = self.token_terms(
            variables["params"]["policy"], batch, self.denoiser.token_times(times, length), noise
        )
        nelbo = Weighted(total=jnp.sum(weighted), weight=jnp.sum(valid))
        return nelbo, {
            "nelbo": nelbo,
            "nll_masked": Weighted(total=jnp.sum(nll * masked), weight=jnp.sum(masked)),
            "masked": Weighted(total=jnp.sum(masked), weight=jnp.sum(valid)),
            "tokens": Summed(jnp.sum(valid)),
        }

    # ------------------------------------------------------------- evaluation
    def evaluate(self, variables, batch, step: Step):
        """The NELBO per token (``nelbo``): per row the mean over ``eval_times``
        stratified times with the row's own shift, each with its own masking, all drawn
        from ``eval_seed`` and the row's index in the evaluation set (``step.rows``, set
        by the trainer; ``arange(rows)`` without it or with ``step`` None); plus the per-row sums
        :meth:`summarize` turns into the standard error (``nelbo_stderr``)."""
        x = jnp.asarray(batch[self.text_key], jnp.int32)
        rows, length = x.shape
        index = jnp.arange(rows) if step is None or step.rows is None else step.rows
        root = jax.random.key(self.eval_seed)
        shifts = indexed_uniforms(jax.random.fold_in(root, 0), index, ())  # [rows]
        row_total, valid = jnp.zeros((rows,), jnp.float32), None
        for k in range(self.eval_times):
            noise = indexed_uniforms(jax.random.fold_in(root, k + 1), index, (length,))
            times = self.time_eps + (1.0 - self.time_eps) * (k + shifts) / self.eval_times
            weighted, valid, _, _ = self.token_terms(
                variables["params"]["policy"],
                batch,
                self.denoiser.token_times(times, length),
                noise,
            )
            row_total = row_total + jnp.sum(weighted, axis=1)
        row_total = row_total / self.eval_times  # [rows]: each row's NELBO estimate (nats)
        row_tokens = jnp.sum(valid, axis=1)  # [rows]
        return {
            "nelbo": Weighted(total=jnp.sum(row_total), weight=jnp.sum(row_tokens)),
            "tokens": Summed(jnp.sum(row_tokens)),
            **nelbo_moments(row_total, row_tokens),
        }

    def summarize(self, results: Mapping[str, float]) -> dict[str, float]:
        out = with_nelbo_stderr(results)
        out["perplexity_bound"] = float(np.exp(min(results["nelbo"], 80.0)))
        return out

    # ----------------------------------------------------------------- export
    def export(self, variables, *, length: int | None = None, **options):
        """A :class:`~dew.sampling.token_diffusion.TokenDiffusionGeneration` of these
        weights (``objective.inference_task(state)`` passes the EMA ones): ``length`` tokens
        per sample (None = ``seq_len``, else the model's ``max_seq_len``)."""
        length = length or self.seq_len or getattr(self.model, "max_seq_len", None)
        return TokenDiffusionGeneration(
            model=self.model,
            params=variables["params"]["policy"],
            tokenizer=tokenizer_of(self.tokenizer),
            mask_id=self.mask_token,
            schedule=self.schedule,
            length=length,
            sampler=options.pop("sampler", self.sampler),
            **options,
        )

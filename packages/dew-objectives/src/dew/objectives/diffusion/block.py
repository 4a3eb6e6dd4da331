"""Block diffusion (BD3-LM: Arriola et al., ICLR 2025, arXiv 2503.09573).

A row of ``L`` ids is cut into blocks of ``block_size`` (``L'``) tokens, modelled left
to right, each block by masked diffusion given the clean blocks before it::

    log p(x) = sum_b log p(x^b | x^{<b})
    NELBO    = sum_b E_{t_b} [ sum_{l in b} 1[z^l = m] w(t_b) (-log p(x^l | z^b_{t_b}, x^{<b})) ]

with ``w = -alpha' / (1 - alpha)`` (``1 / t`` for the default linear schedule, BD3-LM's
``p = t``) and ``t_b`` drawn per (row, block) with antithetic offsets over all of
them, from the clipped range ``U[beta, omega]`` (``clip``). For ``block_size = 1``
``t = 1``: every token is masked and the loss is the autoregressive NLL.

Vectorised training (kuleshov-group/bd3lms ``diffusion.py``, ``models/dit.py``): one
forward pass of ``[z_t | x0]`` (``2L`` tokens, both halves at positions ``0..L-1``)
under :func:`dew.nn.masks.block_diffusion_mask` (block-diagonal, offset block-causal,
block-causal; given as :class:`dew.nn.masks.BlockDiffusionMask`, so attention computes
its non-empty pieces only) gives every block's logits at once; the logits of the noisy half are
read in the SUBS parameterisation, as :mod:`dew.objectives.diffusion.masked`.

Evaluation reports the NELBO per token over the full range ``t in [time_eps, 1]``
(the likelihood bound, estimated without bias as MDLM's: stratified times with a
shift per row, one time for all of a row's blocks, masking drawn from the row's
index, and its standard error ``nelbo_stderr``) and,
for each ``(beta, omega)`` of ``clip_search``, the variance of the per-row training
loss under ``t ~ U[beta, omega]``; :meth:`BlockDiffusionObjective.summarize` names the
pair of least variance (``clip_beta``, ``clip_omega``), the data-driven schedule to
train the next stage with (``clip=``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dew.objectives.contract import registry
from dew.objectives.contract.weighted import Weighted
from dew.objectives.diffusion.denoisers import BlockDenoiser
from dew.objectives.diffusion.masked import (
    MaskedDiffusionObjective,
    antithetic_at,
    row_uniforms,
    uniforms_at,
)
from dew.sampling.token_diffusion import MaskSchedule


def check_clip(clip, *, what: str) -> tuple[float, float]:
    """``(beta, omega)`` with ``0 <= beta < omega <= 1``, or a ValueError naming it."""
    try:
        beta, omega = (float(c) for c in clip)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: clip={clip!r} must be a pair (beta, omega)") from None
    if not (0.0 <= beta < omega <= 1.0) or math.isnan(beta) or math.isnan(omega):
        raise ValueError(
            f"{what}: the clipped schedule (beta, omega)=({beta}, {omega}) must satisfy "
            f"0 <= beta < omega <= 1 (times are drawn from U[beta, omega], so the range "
            f"must lie in [0, 1] and not be empty); e.g. clip=(0.3, 0.8)"
        )
    return beta, omega


@registry.register("block_diffusion")
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class BlockDiffusionObjective(MaskedDiffusionObjective):
    """BD3-LM training (module docstring); the fields of
    :class:`~dew.objectives.diffusion.masked.MaskedDiffusionObjective` and:

    block_size: tokens per block; must divide the row length. ``block_size = L`` is
      MDLM; ``block_size = 1`` (with ``t = 1``) is an autoregressive model.
    clip: ``(beta, omega)``, training times ``t ~ U[beta, omega]`` (the clipped,
      data-driven schedule); None = ``[time_eps, 1]``. Ignored for ``block_size = 1``.
    clip_search: the ``(beta, omega)`` pairs whose loss variance :meth:`evaluate`
      reports; () = none.
    use_kv_cache: the exported pipeline keeps clean blocks in a KV cache.

    The model's positions must cover the row length (``max_seq_len >= L``); its own
    mask policy may be ``masks.full()`` (an MDLM checkpoint fine-tunes as it is) or
    ``masks.block_causal(block_size)``.
    """

    block_size: int = 4
    schedule: MaskSchedule = MaskSchedule(kind="linear")
    clip: tuple[float, float] | None = None
    clip_search: tuple[tuple[float, float], ...] = ((0.0, 1.0), (0.3, 0.8), (0.45, 0.95))
    use_kv_cache: bool = True

    what = "BlockDiffusionObjective"

    def __post_init__(self):
        from dew.nn.keywords import is_whole_number

        if not is_whole_number(self.block_size) or self.block_size < 1:
            raise ValueError(f"{self.what}: block_size={self.block_size!r} must be >= 1 tokens")
        self.clip_range, self.clip_pairs  # noqa: B018  (checks both now)
        super().__post_init__()

    @functools.cached_property
    def clip_range(self) -> tuple[float, float] | None:
        """``clip`` as a checked float pair ``(beta, omega)``, or None."""
        return None if self.clip is None else check_clip(self.clip, what=self.what)

    @functools.cached_property
    def clip_pairs(self) -> tuple[tuple[float, float], ...]:
        """``clip_search`` as checked float pairs."""
        return tuple(check_clip(c, what=self.what) for c in self.clip_search)

    @functools.cached_property
    def denoiser(self) -> BlockDenoiser:
        """The vectorised ``[noisy | clean]`` pass over blocks of ``block_size``
        (:class:`~dew.objectives.diffusion.denoisers.BlockDenoiser`)."""
        return BlockDenoiser(
            model=self.model,
            attention_mask_key=self.attention_mask_key,
            what=self.what,
            block_size=self.block_size,
        )

    # --------------------------------------------------------------- times
    def _time_range(self) -> tuple[float, float]:
        return self.clip_range if self.clip_range is not None else (self.time_eps, 1.0)

    def draw_times(self, key, rows, length, index=None, total=None):
        """Per (row, block) ``[rows, blocks]``: antithetic over all ``total * blocks``
        draws of the step's whole batch (rows ``index`` of it, default ``arange(rows)``),
        in ``U[beta, omega]``; all 1 for ``block_size = 1``."""
        blocks = length // self.block_size
        if self.block_size == 1:
            return jnp.ones((rows, blocks), jnp.float32)
        index = jnp.arange(rows) if index is None else index
        total = rows if total is None else total
        cells = (index[:, None] * blocks + jnp.arange(blocks)[None]).reshape(-1)
        u = (
            antithetic_at(key, cells, total * blocks)
            if self.antithetic
            else uniforms_at(key, cells)
        )
        beta, omega = self._time_range()
        return (beta + (omega - beta) * u).reshape(rows, blocks)

    def token_times(self, times, length):
        """``[rows, length]``: each token takes its block's time (``times`` ``[rows]``
        = one time for every block of a row, as evaluation's grid)."""
        return self.denoiser.token_times(times, length)

    def token_terms(self, params, batch, t_tokens, noise, times=None):
        if self.block_size == 1:  # t = 1: every token masked (an AR model)
            t_tokens = jnp.ones_like(t_tokens)
        return super().token_terms(params, batch, t_tokens, noise, times=t_tokens)

    # ----------------------------------------------------------- evaluation
    def evaluate(self, variables, batch, step):
        """MDLM's unbiased NELBO over ``[time_eps, 1]`` (``nelbo``, its sums for
        ``nelbo_stderr``) and, per pair of
        ``clip_search``, the mean and mean square of the per-row loss at one time per
        block drawn from ``U[beta, omega]`` with fixed, row-hashed draws."""
        out = super().evaluate(variables, batch, step)
        if self.block_size == 1:
            return out
        x = jnp.asarray(batch[self.text_key], jnp.int32)
        rows, length = x.shape
        root = jax.random.fold_in(jax.random.key(self.eval_seed), 10**6)
        blocks = length // self.block_size
        u_time = row_uniforms(jax.random.fold_in(root, 0), x)[:, :blocks]
        noise = row_uniforms(jax.random.fold_in(root, 1), x)
        for i, (beta, omega) in enumerate(self.clip_pairs):
            t = beta + (omega - beta) * u_time
            t = jnp.maximum(t, self.time_eps)  # beta = 0: a time 0 would weigh 1 / 0
            weighted, valid, _, _ = self.token_terms(
                variables["params"]["policy"], batch, self.denoiser.token_times(t, length), noise
            )
            per_row = jnp.sum(weighted, axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1.0)
            row_weight = (jnp.sum(valid, axis=1) > 0).astype(jnp.float32)
            out[f"clip{i}_loss"] = Weighted.mean(per_row, row_weight)
            out[f"clip{i}_square"] = Weighted.mean(per_row**2, row_weight)
        return out

    def summarize(self, results: Mapping[str, float]) -> dict[str, float]:
        out = super().summarize(results)
        variances = []
        for i, pair in enumerate(self.clip_pairs):
            key = f"clip{i}_loss"
            if key not in results:
                continue
            variance = results[f"clip{i}_square"] - results[key] ** 2
            out[f"clip{i}_variance"] = float(variance)
            variances.append((variance, pair))
        if variances:
            _, (beta, omega) = min(variances)
            out["clip_beta"], out["clip_omega"] = beta, omega
        return out

    # --------------------------------------------------------------- export
    def export(self, variables, *, length=None, **options):
        """MDLM's export, sampling block after block (``block_size``) with the
        clean-block KV cache (``use_kv_cache``)."""
        options.setdefault("block_size", self.block_size)
        options.setdefault("use_kv_cache", self.use_kv_cache)
        return super().export(variables, length=length, **options)

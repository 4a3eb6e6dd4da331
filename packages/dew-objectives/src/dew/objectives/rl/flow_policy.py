"""The flow-matching denoiser as a stochastic policy, for Flow-GRPO
(:mod:`dew.objectives.rl.flow_grpo`): one denoiser (one guidance scale, one clip) for
rollouts, loss and evaluation; the log-probs of the rollout's SDE steps recomputed under
new weights; the KL of a step to the reference's; the deterministic ODE samples of
evaluation, previews and :meth:`FlowGRPOObjective.sample`.

A step's log-prob is the sampler's (:func:`dew.sampling.diffusion.flow_sde.
transition_log_prob`), reduced over the sample's dimensions as the sampler reduces it.
The KL of step ``j`` is ``reduce_dims (mean_theta - mean_ref)^2 / (2 v_j)`` with ``v_j``
by ``kl_convention``: ``"reference"`` = ``sigma_t^2`` (yifan123/flow_grpo's code),
``"exact"`` = ``sigma_t^2 |Delta t|``, the transition's own variance.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dew.objectives.cores.conditioning import guided_context_mask
from dew.sampling import FlowEuler, FlowSDE, model_denoiser, sample_diffusion
from dew.sampling.diffusion.flow_sde import transition_log_prob

KL_CONVENTIONS = ("reference", "exact")
CONDITION_KEYS = ("label", "context", "context_mask")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FlowPolicy:
    """A flow-matching denoiser sampled by an SDE (module docstring).

    model: the denoiser ``apply(vars, x, t, label=, context=)``.
    schedule, target: how it was trained (a ``FlowSchedule``; ``'flow'``, ``'v'``,
      ``'x0'``).
    sampler: the rollouts' :class:`~dew.sampling.FlowSDE`; its ``window`` holds the
      stochastic steps.
    guidance: classifier-free guidance everywhere; clip_denoised: ``x0`` clip (None =
      none).
    sample_shape: one sample's shape; None = the model's ``(H, W, C)``.
    timestep_fraction: share of the stochastic steps trained per row.
    kl_convention: ``"reference"`` | ``"exact"`` (module docstring).
    num_classes, context_features: the model's conditions (0 = none).
    """

    model: Any
    schedule: Any
    target: str
    sampler: FlowSDE
    guidance: float
    clip_denoised: float | None
    sample_shape: tuple[int, ...] | None
    timestep_fraction: float
    kl_convention: str
    num_classes: int
    context_features: int

    @property
    def train_steps(self) -> int:
        """``K``: stochastic steps trained per row."""
        return max(1, math.floor(self.sampler.window_steps * self.timestep_fraction + 1e-9))

    def example_shape(self) -> tuple[int, ...]:
        """One sample's shape: ``sample_shape``, else the model's."""
        if self.sample_shape is not None:
            return tuple(int(s) for s in self.sample_shape)
        if not hasattr(self.model, "sample_shape") or not hasattr(self.model, "in_channels"):
            raise ValueError(
                f"{type(self.model).__name__} does not say its sample size; pass "
                f"FlowGRPOObjective(sample_shape=(H, W, C))"
            )
        return (*self.model.sample_shape, self.model.in_channels)

    def conditions(self, batch) -> dict[str, jax.Array]:
        """The model's ``label`` / ``context`` / ``context_mask`` of a batch."""
        out = {}
        if self.num_classes:
            out["label"] = jnp.asarray(batch["label"], jnp.int32)
        if self.context_features:
            out["context"] = jnp.asarray(batch["context"], jnp.float32)
            if "context_mask" in batch:
                out["context_mask"] = jnp.asarray(batch["context_mask"], bool)
        return out

    def denoiser(self, params, conditions: Mapping[str, jax.Array]):
        """The denoiser of rollouts, loss and evaluation: one guidance, one clip."""
        apply_fn = functools.partial(self.model.apply, {"params": params})
        context = conditions.get("context")
        mask = conditions.get("context_mask")
        if mask is not None:
            apply_fn = functools.partial(
                apply_fn, context_mask=guided_context_mask(mask, self.guidance)
            )
        return model_denoiser(
            apply_fn,
            schedule=self.schedule,
            target=self.target,
            label=conditions.get("label"),
            null_label=self.num_classes,
            context=context,
            null_context=None if context is None else jnp.zeros(context.shape[1:], context.dtype),
            guidance=self.guidance,
            clip_denoised=self.clip_denoised,
        )

    def trained_steps(self, batch) -> jax.Array:
        """``[rows, K]`` the rows' trained window steps: a constant when every step is
        trained (prepare's ``arange``), so the loss slices the states, no gathers."""
        steps = batch["train_steps"]
        if self.train_steps < self.sampler.window_steps:
            return steps
        return jnp.broadcast_to(jnp.arange(self.train_steps, dtype=jnp.int32), steps.shape)

    def step_log_probs(self, params, batch):
        """``(log_probs [rows, K], means [rows * K, ...])`` of the stored transitions at
        the rows' trained steps under ``params`` (the sampler's computation, redone)."""
        latents = batch["latents"]  # [rows, W + 1, ...]
        steps = self.trained_steps(batch)  # [rows, K]
        rows, k = steps.shape
        example = latents.shape[2:]
        if k == self.sampler.window_steps:  # every step in order: slices, not gathers
            x = latents[:, :-1].reshape(rows * k, *example)
            x_next = latents[:, 1:].reshape(rows * k, *example)
        else:
            at = steps.reshape(rows, k, *(1,) * len(example))
            x = jnp.take_along_axis(latents, at, axis=1).reshape(rows * k, *example)
            x_next = jnp.take_along_axis(latents, at + 1, axis=1).reshape(x.shape)
        conditions = {
            c: jnp.repeat(batch[c], k, axis=0, total_repeat_length=rows * k)
            for c in CONDITION_KEYS
            if c in batch
        }
        denoise = self.denoiser(params, conditions)
        logp, mean = transition_log_prob(denoise, self.sampler, x, x_next, steps.reshape(-1))
        return logp.reshape(rows, k), mean

    def step_kl(self, mean, ref_mean, steps) -> jax.Array:
        """``[rows, K]``: ``reduce_dims (mean - ref_mean)^2 / (2 v)`` (``kl_convention``)."""
        rows, k = steps.shape
        table = self.sampler.window_table()
        scale = table["sigma"] if self.kl_convention == "reference" else table["std"]
        var = (scale**2)[steps.reshape(-1)]
        per = ((mean - ref_mean) ** 2).reshape(rows * k, -1) / (2.0 * var[:, None])
        reduced = (
            jnp.mean(per, axis=1) if self.sampler.reduction == "mean" else jnp.sum(per, axis=1)
        )
        return reduced.reshape(rows, k)

    def ode_samples(self, params, conditions, *, key, num_steps: int, shape):
        """``[*shape]`` float32 samples of the deterministic ODE (``FlowEuler``)."""
        return sample_diffusion(
            self.denoiser(params, conditions),
            schedule=self.schedule,
            sampler=FlowEuler(num_steps=num_steps),
            key=key,
            shape=shape,
        )

    def sample(self, params, key, *, num_steps: int, label=None, num=None):
        """ODE samples ``[num, *shape]`` float32 (``FlowEuler`` in ``num_steps``, the
        same guidance; the objective's ``eval_steps`` in its evaluation and previews);
        ``label`` ``[num]`` for a class-conditional model."""
        conditions = {} if label is None else {"label": jnp.asarray(label, jnp.int32)}
        if self.num_classes and label is None:
            raise ValueError(f"the model is class-conditional ({self.num_classes}); pass label=")
        num = len(label) if label is not None else num
        run = self.compiled_ode(num_steps, (num, *self.example_shape()))
        return run(params, key, conditions)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - one compiled ODE sampler per shape
    def compiled_ode(self, steps: int, shape):
        """The jitted ``run(params, key, conditions)`` of :meth:`ode_samples`."""

        def run(params, key, conditions):
            return self.ode_samples(params, conditions, key=key, num_steps=steps, shape=shape)

        return jax.jit(run)

"""Flow-GRPO: online RL for flow-matching image models (Liu et al. 2025, arXiv
2505.05470; reference: yifan123/flow_grpo ``scripts/train_sd3.py``).

A data batch holds ``B`` conditions (class labels, text contexts, or nothing for an
unconditional model); each is sampled ``G`` times (a group, rows ``b * G + g``) with
the SDE sampler of :mod:`dew.sampling.diffusion.flow_sde` on the pre-update weights, keeping
every stochastic step's states and log-prob. The samples get rewards
``r = sum_k w_k r_k(x)`` (:class:`ImageReward`, jittable; :class:`HostImageReward`,
host Python; each logged as ``reward/<name>``) and the advantages

    A = (r - mean_group(r)) / (std(r) + eps)      scale_rewards="batch" (global std, the
                                                  reference's global_std=True; ddof=1)
    "group": / (std_group + eps);  "none": r - mean_group;  then clipped to +-advantage_clip

(:func:`dew.objectives.cores.rl.group_advantages`). The loss, over the rollout's rows and
``K = max(1, floor(W timestep_fraction))`` of its ``W`` stochastic steps (a subset drawn
per row), minimizes

    rho = exp(log p_theta(x_{j+1} | x_j) - log p_old(x_{j+1} | x_j))
    l   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) + beta KL_j
    KL_j = reduce_dims (mean_theta - mean_ref)^2 / (2 v_j)

with the step's log-prob reduced over the sample's dimensions as the sampler reduces it
(``FlowSDE.reduction``: the mean, the reference's, or the sum). ``v_j``, the Delta t
convention (``kl_convention``): ``"reference"`` = ``sigma_t^2`` (what the reference's
code divides by: ``(mean - mean_ref)^2 / (2 std_dev_t^2)``, yifan123/flow_grpo #78),
``"exact"`` = ``sigma_t^2 |Delta t|``, the transition's own variance, so ``KL_j`` is the
KL between the two Gaussian steps (the paper's formula). ``"reference"`` keeps the
reference's ``beta`` meaning; ``"exact"`` is ``1 / |Delta t|`` (10x at 10 steps) larger.
For CPS both are ``s^2``. The reference is the frozen initial model (the base alone
under LoRA: a view, stored once), read without gradient.

**Invariance.** Every draw of a rollout is a function of the run's key, the step and the
row's index in the global rollout batch: the sampler's noise
(:func:`dew.sampling.diffusion.flow_sde.row_keys`) and the training-step subset. A rollout
computed in chunks (``rollout_rows``), on 8 devices or on 1, draws the same. The old
log-probs are the sampler's, and the loss recomputes them with the same denoiser (the
same guidance, clipping and float32 step math), so the first update's ratio is 1
(``check_first_ratio=True`` or ``DEW_DEBUG=1`` asserts it,
:func:`dew.objectives.cores.rl.check_first_update`, to :data:`FIRST_RATIO_TOLERANCE`).

**Sizes.** The recipe states the global group count (``groups``, the data batch ``B``)
and ``group_size``, and, for memory, ``device_rows``: the samples one device computes
at once. Dew derives the rest from the mesh (``RolloutSizes.of(objective, D)``): the
rollout is ``B * G`` rows, ``B / D`` conditions and ``B G / D`` samples per device on
``D`` data-parallel devices, sampled in chunks of ``device_rows`` per device;
``prepared_updates.minibatches`` updates split it, and each update of ``U`` rows is
accumulated over ``U / (D device_rows)`` microbatches (the trainer's accumulation,
set from :meth:`FlowGRPOObjective.accumulate_for`). Every split must divide, checked
before compiling. The draws do not depend on any of it, so 1 device, 8 devices and
microbatched rollouts make the same update.

Evaluation, previews and export use the deterministic ODE (:class:`dew.sampling.FlowEuler`,
``eval_steps``) with the same guidance, on the EMA of the trained (LoRA) weights.

Metrics: ``reward``, ``reward/<name>``, ``zero_variance_fraction``, ``clip_fraction``,
``ratio``, ``advantage`` (mean |A|), ``kl`` (with ``beta > 0``), ``log_prob``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import is_whole_number
from dew.objectives.contract import registry
from dew.objectives.contract.batch import IDS, BatchField
from dew.objectives.contract.objective import (
    EMA,
    Objective,
    Role,
    Step,
    Updates,
    with_initial_values,
)
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.conditioning import model_conditions
from dew.objectives.cores.rewards import READER, HostImageReward, ImageReward, ImageRewards
from dew.objectives.cores.rl import (
    SCALE_REWARDS,
    check_epsilons,
    check_first_update,
    check_group_size,
    clipped_policy_loss,
    group_advantages,
)
from dew.objectives.cores.rollouts import (
    check_rollout_rows,
    debug_enabled,
    in_chunks,
    repeat_rows,
    traced_data_parallel,
)
from dew.objectives.rl.flow_policy import CONDITION_KEYS, KL_CONVENTIONS, FlowPolicy
from dew.objectives.rl.flow_sizes import RolloutSizes
from dew.sampling import FlowSDE, sample_flow_sde
from dew.sampling.diffusion.pipelines import ClassToImage, sample_grid, to_pixels
from dew.sampling.diffusion.samplers import check_target_for
from dew.sampling.diffusion.schedules import FlowSchedule

FIRST_RATIO_TOLERANCE = 1e-5
"""The first update's largest relative log-prob gap (``check_first_ratio``): 10 times the
language policies' (:data:`dew.objectives.cores.rl.RATIO_TOLERANCE`). A step's Gaussian
log-prob divides the rounding of the step's mean by the step's standard deviation, so
the rollout's program and the loss's, partitioned differently over a mesh, differ by
more units in the last place than a token's log-softmax does (1.03e-6 seen on a
2 x 2 x 2 mesh under LoRA); a reconstruction bug (another guidance scale, time step,
clipping or noise level) is off by a fraction of the log-prob itself."""

__all__ = ["FlowGRPOObjective", "HostImageReward", "ImageReward", "RolloutSizes", "from_pipeline"]


# -------------------------------------------------------------------- objective
def default_ema() -> EMA:
    """0.99 per update (the reference: 0.9 every 8 steps, ~0.987 per step) with the
    ``(1 + u) / (10 + u)`` warm-up (the reference's ``EMAModuleWrapper`` too): without it
    the average of a 30-update run still held 74% of the initial weights, and its
    reward was 0.08 where the live policy's was 0.44."""
    return EMA(decay=0.99, use_warmup=True)


@registry.register("flow_grpo")
@dataclasses.dataclass(frozen=True, eq=False)
class FlowGRPOObjective(Objective):
    """Flow-GRPO on a flow-matching denoiser (module docstring for the math).

    model: the denoiser ``apply(vars, x, t, label=, context=)`` (a ``DiT``; a LoRA one
      from ``dew.nn.lora.LoRA.apply`` trains its adapters only), trained as a flow model.
    rewards: :class:`ImageReward` (jittable) / :class:`HostImageReward` (host) objects; a
      plain callable is a host reward of weight 1.
    group_size: samples per condition, ``G >= 2`` (the reference: 24).
    schedule, target: how the model was trained: a :class:`~dew.sampling.FlowSchedule`
      and ``'flow'`` (or ``'v'``, ``'x0'``, converted to the velocity).
    sampler: the training rollouts' :class:`~dew.sampling.FlowSDE` (reference: 10 steps,
      a = 0.7); its ``window`` picks the stochastic (trained) steps.
    eval_steps: steps of the ODE sampler of evaluation, previews and export (40).
    guidance: classifier-free guidance, identical in rollouts, loss and evaluation
      (reference: 4.5); needs a conditioned model trained with condition dropout.
    clip_denoised: clip ``x0`` to ``[-c, c]`` in the denoiser (everywhere); None = no clip.
    sample_shape: one sample's shape; None = the model's ``(H, W, C)``.
    epsilon, epsilon_high: the clip range below / above 1 (reference: 1e-4, tiny because
      the log-prob is a per-dimension mean); epsilon_high None = epsilon.
    advantage_clip: advantages clipped to ``[-c, c]`` (reference: 5).
    scale_rewards: ``"batch"`` (global std, the reference's) | ``"group"`` | ``"none"``.
    advantage_eps: added to the standard deviation (1e-4).
    beta: the KL weight (reference: 0.04 GenEval/OCR, 0.01 PickScore); 0 = no reference.
    kl_convention: ``"reference"`` | ``"exact"`` (module docstring: the Delta t).
    timestep_fraction: share of the stochastic steps trained per row (reference: 0.99).
    prepared_updates: updates per rollout batch (:class:`~dew.objectives.Updates`).
    rollout_rows: rows sampled at once in a rollout, all devices together (memory);
      None = all (or ``device_rows`` per device). Draws do not depend on it.
    groups: conditions per rollout batch, all devices together (the reference: 48); the
      data batch must hold this many rows; None = the data batch's rows.
    device_rows: samples one device computes at once, in the rollout's chunks and the
      update's microbatches (module docstring, Sizes; needs ``groups``); the trainer
      derives its accumulation from it. None = all of a device's rows at once.
    reference: the frozen reference's parameters; None = the initial model.
    init_params: the pretrained flow model's parameters (a ``Pretrained`` load or a
      diffusion run's); None = a fresh init.
    ema: the moving average of the trained (LoRA) weights for evaluation and export.
    check_first_ratio: assert the first update's ratio is 1; None = ``DEW_DEBUG=1``.
    preview_count: samples in a preview grid (images only); 0 = none.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    rewards: Sequence[Any] = ()
    group_size: int = 8
    schedule: Any = dataclasses.field(default_factory=FlowSchedule)
    target: str = "flow"
    sampler: FlowSDE = dataclasses.field(default_factory=FlowSDE)
    eval_steps: int = 40
    guidance: float = 1.0
    clip_denoised: float | None = None
    sample_shape: tuple[int, ...] | None = None
    epsilon: float = 1e-4
    epsilon_high: float | None = None
    advantage_clip: float = 5.0
    scale_rewards: str = "batch"
    advantage_eps: float = 1e-4
    beta: float = 0.04
    kl_convention: str = "reference"
    timestep_fraction: float = 0.99
    prepared_updates: Updates = dataclasses.field(default_factory=Updates)
    rollout_rows: int | None = None
    groups: int | None = None
    device_rows: int | None = None
    reference: Any = None
    init_params: Any = None
    ema: EMA | None = dataclasses.field(default_factory=default_ema)
    check_first_ratio: bool | None = None
    preview_count: int = 8

    headline_metrics = ("reward", "kl")

    def __post_init__(self):
        what = type(self).__name__
        check_group_size(self.group_size, what=what, samples="samples per condition")
        if getattr(self.schedule, "family", None) != "flow":
            raise ValueError(
                f"{what} fine-tunes a flow-matching model; this one was trained with "
                f"{type(self.schedule).__name__} ({getattr(self.schedule, 'family', None)!r}), "
                f"whose sampler has no flow SDE: train it with FlowSchedule() and target='flow'"
            )
        check_target_for(self.schedule, self.target)
        if not isinstance(self.sampler, FlowSDE):
            raise TypeError(f"sampler must be a dew.sampling.FlowSDE, got {self.sampler!r}")
        if self.sampler.window_steps == 0:
            raise ValueError(
                f"{what}: the sampler {self.sampler} has no stochastic step (noise_level 0 is "
                f"the ODE, which has no log-probs); use noise_level > 0 (0.7)"
            )
        if isinstance(self.eval_steps, bool) or self.eval_steps < 1:
            raise ValueError(f"eval_steps must be >= 1, got {self.eval_steps!r}")
        upper = self.epsilon if self.epsilon_high is None else self.epsilon_high
        check_epsilons(self.epsilon, upper, what=what)
        if not self.advantage_clip > 0:
            raise ValueError(f"advantage_clip must be > 0, got {self.advantage_clip}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}")
        if self.beta < 0:
            raise ValueError(f"beta (the KL weight) must be >= 0, got {self.beta}")
        if self.kl_convention not in KL_CONVENTIONS:
            raise ValueError(
                f"kl_convention must be one of {KL_CONVENTIONS} (module docstring), got "
                f"{self.kl_convention!r}"
            )
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.rollout_rows is not None and (
            isinstance(self.rollout_rows, bool) or self.rollout_rows < 1
        ):
            raise ValueError(f"rollout_rows must be >= 1 or None, got {self.rollout_rows!r}")
        for name in ("groups", "device_rows"):
            value = getattr(self, name)
            if value is not None and not is_whole_number(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.device_rows is not None and self.groups is None:
            raise ValueError(
                f"{what}(device_rows={self.device_rows}) needs the global group count: pass "
                f"groups= (conditions per rollout batch, all devices together)"
            )
        if self.device_rows is not None and self.rollout_rows is not None:
            raise ValueError(
                f"{what}: give rollout_rows ({self.rollout_rows}, all devices) or device_rows "
                f"({self.device_rows}, per device), not both"
            )
        if not isinstance(self.prepared_updates, Updates):
            raise TypeError(
                f"prepared_updates must be dew.objectives.Updates, got {self.prepared_updates!r}"
            )
        if self.guidance != 1.0 and not any(model_conditions(self.model)):
            raise ValueError(
                f"guidance {self.guidance} needs a conditioned model (num_classes or "
                f"context_features); this one is unconditional: use guidance=1.0"
            )
        self.reward_set  # noqa: B018  (checks the rewards now)

    @functools.cached_property
    def reward_set(self) -> ImageRewards:
        return ImageRewards.of(self.rewards)

    @functools.cached_property
    def policy(self) -> FlowPolicy:
        """The denoiser as a stochastic policy: its one denoiser, the SDE steps'
        log-probs and KL, the ODE samples (:mod:`dew.objectives.rl.flow_policy`)."""
        num_classes, context_features = model_conditions(self.model)
        return FlowPolicy(
            model=self.model,
            schedule=self.schedule,
            target=self.target,
            sampler=self.sampler,
            guidance=self.guidance,
            clip_denoised=self.clip_denoised,
            sample_shape=self.sample_shape,
            timestep_fraction=self.timestep_fraction,
            kl_convention=self.kl_convention,
            num_classes=num_classes,
            context_features=context_features,
        )

    def accumulate_for(self, data_parallel: int) -> int | None:
        """The trainer's accumulation on ``data_parallel`` devices (``RolloutSizes.of``), or
        None without ``device_rows`` (the trainer's own ``accumulate`` applies)."""
        if self.device_rows is None:
            return None
        return RolloutSizes.of(self, data_parallel).accumulate

    def roles(self):
        roles = [Role(name="policy", module=self.model)]
        if self.beta > 0:  # the initial model, unless reference weights are given
            initial = "policy" if self.reference is None else None
            roles.append(
                Role(name="reference", module=self.model, trained=False, initial_from=initial)
            )
        return tuple(roles)

    def batch_fields(self):
        return (BatchField("label", (), IDS),) if self.policy.num_classes else ()

    # ------------------------------------------------------------------- init

    def init(self, key, spec=None):
        x = jnp.zeros((1, *self.policy.example_shape()), jnp.float32)
        dummy = {}
        if self.policy.num_classes:
            dummy["label"] = jnp.zeros((1,), jnp.int32)
        if self.policy.context_features:
            tokens = int(spec["context"].shape[0]) if spec and "context" in spec else 1
            dummy["context"] = jnp.zeros((1, tokens, self.policy.context_features), jnp.float32)
        params = self.model.init(key, x, jnp.zeros((1,), jnp.float32), **dummy)["params"]
        if self.init_params is not None:
            params = with_initial_values(
                params, self.init_params, what=f"{type(self).__name__} init_params"
            )
        variables = {"params": {"policy": params}}
        if self.beta > 0:
            # the initial model: the same arrays (a view of the base under LoRA), or given weights
            ref = params
            if self.reference is not None:
                ref = with_initial_values(
                    params, self.reference, what="FlowGRPOObjective reference"
                )
            variables["reference"] = {"params": ref}
        return variables

    # ---------------------------------------------------------------- prepare
    phases = ("prepare", "prepare_host", "prepare_finish")

    def prepare(self, variables, batch, step: Step):
        """The rollout (compiled): ``G`` SDE samples per condition with their window
        states and log-probs, the compiled rewards, each row's trained steps."""
        params = variables["params"]["policy"]
        conditions = {
            k: repeat_rows(v, self.group_size) for k, v in self.policy.conditions(batch).items()
        }
        rows = _rows_of(batch) * self.group_size
        shape = self.policy.example_shape()
        k_rollout, k_select = jax.random.split(step.key)

        def rollout(part):
            index = part.pop("index")
            denoise = self.policy.denoiser(params, part)
            out = sample_flow_sde(
                denoise,
                sampler=self.sampler,
                key=k_rollout,
                shape=(index.shape[0], *shape),
                rows=index,
            )
            return {"samples": out.samples, "latents": out.latents, "old_logps": out.log_probs}

        index = jnp.arange(rows, dtype=jnp.int32)
        chunk = self.rollout_rows or rows
        if self.device_rows is not None:  # per device, on the mesh being traced
            chunk = self.device_rows * traced_data_parallel()
        out = in_chunks(rollout, {"index": index, **conditions}, chunk)
        out = jax.lax.stop_gradient(out)
        window, k = self.sampler.window_steps, self.policy.train_steps
        if k == window:
            chosen = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (rows, k))
        else:  # a subset of steps per row, drawn from the row's own key
            keys = jax.vmap(lambda r: jax.random.fold_in(k_select, r))(index.astype(jnp.uint32))
            chosen = jax.vmap(lambda key: jax.random.permutation(key, window)[:k])(keys)
        # every key of the data batch (the conditions included), per sample, for the rewards
        data = {k: repeat_rows(jnp.asarray(v), self.group_size) for k, v in batch.items()}
        out.update(conditions)
        out["train_steps"] = chosen.astype(jnp.int32)
        out["compiled_rewards"] = self.reward_set.compiled_values(out["samples"], data)
        out.update({READER + k: v for k, v in data.items()})
        return out

    def prepare_host(self, rollout):
        """Host stage: compiled rewards checked, host rewards called; ``rewards [rows, n]``."""
        columns = {k[len(READER) :]: v for k, v in rollout.items() if k.startswith(READER)}
        rewards = self.reward_set.host_stage(
            rollout["samples"], rollout["compiled_rewards"], columns, self.group_size
        )
        return {"rewards": rewards}

    def prepare_finish(self, variables, batch, step: Step):
        """Advantages (compiled); the training batch (the samples and the reader's keys
        dropped: the loss reads the window's states)."""
        rewards = batch["rewards"]
        total = self.reward_set.total(rewards)
        advantages, zero = group_advantages(
            total, self.group_size, scale_rewards=self.scale_rewards, eps=self.advantage_eps
        )
        keep = ("latents", "old_logps", "train_steps", *CONDITION_KEYS)
        out = {k: batch[k] for k in keep if k in batch}
        out.update(rewards=rewards, reward=total, advantages=advantages, zero_variance=zero)
        return out

    # ------------------------------------------------------------------- loss
    def loss(self, variables, batch, step: Step):
        logps, mean = self.policy.step_log_probs(variables["params"]["policy"], batch)  # [rows, K]
        old = batch["old_logps"]  # [rows, W]
        if self.policy.train_steps < self.sampler.window_steps:
            old = jnp.take_along_axis(old, batch["train_steps"], axis=1)
        advantages = jnp.clip(batch["advantages"], -self.advantage_clip, self.advantage_clip)
        upper = self.epsilon if self.epsilon_high is None else self.epsilon_high
        per_step, ratio, clipped = clipped_policy_loss(
            logps, old, advantages, epsilon_low=self.epsilon, epsilon_high=upper
        )
        if debug_enabled(self.check_first_ratio):  # else DEW_DEBUG=1
            check_first_update(
                logps,
                old,
                jnp.ones_like(logps, bool),
                step=step.index,
                updates_per_batch=self.prepared_updates.per_batch,
                what=type(self).__name__,
                tolerance=FIRST_RATIO_TOLERANCE,
            )
        metrics = {}
        if self.beta > 0:
            ref = jax.lax.stop_gradient(variables["reference"]["params"])
            _, ref_mean = self.policy.step_log_probs(ref, batch)
            kl = self.policy.step_kl(
                mean, jax.lax.stop_gradient(ref_mean), self.policy.trained_steps(batch)
            )
            per_step = per_step + self.beta * kl
            metrics["kl"] = Weighted.mean(kl)
        rows = logps.shape[0]
        first_epoch = (
            step.index % self.prepared_updates.per_batch
        ) < self.prepared_updates.minibatches
        metrics.update(
            reward=Weighted.mean(batch["reward"]),
            zero_variance_fraction=Weighted.mean(batch["zero_variance"]),
            clip_fraction=Weighted.mean(clipped),
            ratio=Weighted.mean(ratio),
            advantage=Weighted.mean(jnp.abs(advantages)),
            log_prob=Weighted.mean(logps),
            rollout_samples=Summed(jnp.where(first_epoch, jnp.float32(rows), 0.0)),
        )
        for i, name in enumerate(self.reward_set.names):
            metrics[f"reward/{name}"] = Weighted.mean(batch["rewards"][:, i])
        return Weighted.mean(per_step), metrics

    # ------------------------------------------------------------- evaluation
    def evaluate(self, variables, batch, step: Step):
        """The compiled rewards of one ODE sample per condition (host rewards are not
        evaluated): ``reward`` (their weighted sum) and ``reward/<name>``."""
        conditions = self.policy.conditions(batch)
        rows = _rows_of(batch)
        samples = self.policy.ode_samples(
            variables["params"]["policy"],
            conditions,
            key=step.key,
            num_steps=self.eval_steps,
            shape=(rows, *self.policy.example_shape()),
        )
        values = self.reward_set.compiled_values(samples, dict(batch))
        out = {}
        for i, r in enumerate(self.reward_set.compiled):
            out[f"reward/{r.label}"] = Weighted.mean(values[:, i])
        weights = jnp.asarray([r.weight for r in self.reward_set.compiled], jnp.float32)
        out["reward"] = Weighted.mean(values @ weights)
        return out

    def preview(self, variables, key):
        """A grid of ``preview_count`` ODE samples of an image model (labels cycled)."""
        shape = self.policy.example_shape()
        if not self.preview_count or len(shape) != 3 or self.policy.context_features:
            return None
        label = None
        if self.policy.num_classes:
            label = np.arange(self.preview_count) % self.policy.num_classes
        samples = self.policy.sample(
            variables["params"]["policy"],
            key,
            num_steps=self.eval_steps,
            label=label,
            num=self.preview_count,
        )
        return sample_grid(to_pixels(samples))

    def export(self, variables):
        """A ``ClassToImage`` pipeline of these weights with the ODE sampler."""
        if self.policy.context_features:
            raise NotImplementedError("export of a text-conditioned Flow-GRPO model")
        return ClassToImage(
            model=self.model,
            params=variables["params"]["policy"],
            schedule=self.schedule,
            target=self.target,
            sample_shape=self.policy.example_shape(),
            sampler="euler",
            num_steps=self.eval_steps,
            guidance=self.guidance,
            has_null_condition=True,
            clip_denoised=self.clip_denoised,
        )

    # ----------------------------------------------------------------- checks
    def check_batch(self, batch):
        super().check_batch(batch)
        what = type(self).__name__
        if not batch:
            raise ValueError(f"{what} needs a batch of conditions (any array of rows)")
        conditions = _rows_of(batch)
        if self.groups is not None and conditions != self.groups:
            raise ValueError(
                f"{what}(groups={self.groups}) got a data batch of {conditions} conditions; "
                f"give the Dataset batch={self.groups} (the global group count)"
            )
        check_rollout_rows(
            conditions * self.group_size,
            minibatches=self.prepared_updates.minibatches,
            scoring_rows=self.rollout_rows,
            what=what,
            made=f" ({conditions} conditions x group_size {self.group_size})",
        )
        classes = self.policy.num_classes
        if classes:
            label = np.asarray(batch["label"])
            if label.size and (label.min() < 0 or label.max() > classes):
                raise ValueError(
                    f"batch['label'] holds {label.min()}..{label.max()}; the model has "
                    f"num_classes={classes} (labels 0..{classes - 1}, and "
                    f"{classes} the null class: unconditional samples)"
                )
        if self.policy.context_features and "context" not in batch:
            raise KeyError(f"{what}: the model reads text contexts; the batch needs 'context'")


def from_pipeline(pipeline, **options) -> FlowGRPOObjective:
    """A :class:`FlowGRPOObjective` that starts from a trained flow pipeline
    (``ClassToImage``: a diffusion run's ``objective.inference_task(state)`` or a
    ``Pretrained`` load): its model, weights, schedule, target, guidance, clipping and
    sample shape; ``options`` the rest (``rewards=`` at least)."""
    fields = dict(
        model=pipeline.model,
        init_params=pipeline.params,
        schedule=pipeline.schedule,
        target=pipeline.target,
        guidance=pipeline.guidance,
        clip_denoised=pipeline.clip_denoised,
        sample_shape=tuple(pipeline.sample_shape),
    )
    return FlowGRPOObjective(**{**fields, **options})


def _rows_of(batch) -> int:
    return int(jax.tree.leaves(dict(batch))[0].shape[0])

"""Group Relative Policy Optimization (GRPO; Shao et al. 2024, DeepSeekMath,
arXiv 2402.03300, section 4).

Per prompt ``q`` the policy samples ``G`` completions ``o_1..o_G`` (a group);
each gets a reward ``r_i = sum_k w_k r_k(o_i)`` (:mod:`dew.objectives.cores.rewards`).
The advantage of every token of ``o_i`` is its reward against the group's:

    A_i = (r_i - mean(r)) / (std(r) + eps)     scale_rewards="group" (paper; std ddof=1)
    A_i = (r_i - mean(r)) / (std(R) + eps)     "batch": std over the whole rollout batch
    A_i =  r_i - mean(r)                       "none" (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783)

and a group whose rewards are all equal has ``A = 0`` exactly (it carries no
signal; its share is logged as ``zero_variance_fraction``). The loss minimizes

    l_{i,t} = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta k3_{i,t}
    rho     = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t)
    k3      = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1      (float32, log-ratio clamped)

aggregated over the completion tokens (``loss_aggregation``):

- ``"sequence-mean"`` (the paper): ``mean_i (1/|o_i|) sum_t l_{i,t}`` (length-biased);
- ``"token-mean"`` (DAPO, TRL's ``"dapo"``/``"bnpo"``): ``sum_{i,t} l / sum_i |o_i|``;
- ``"dr_grpo"``: ``sum_{i,t} l / (rows * max_new_tokens)``.

Each is a :class:`~dew.objectives.Weighted` mean, so microbatches and devices
divide once by the global weight.

Methods by name (issue 43; the maths in :mod:`dew.objectives.cores.rl`):
``advantage_estimator="rloo"`` (RLOO, Ahmadian et al. 2024: each completion
against the mean of the other ``G - 1`` rewards) or ``"reinforce"``
(REINFORCE++, Hu 2025: the batch's mean and std, no group baseline), and
``importance_sampling_level="sequence"`` (GSPO, Zheng et al. 2025: one
length-normalised ratio per completion, clipped per sequence; ``ratio`` and
``clip_fraction`` are then per completion). RLOO's loss as TRL's ``RLOOTrainer``
(trl 1.16) computes it: ``advantage_estimator="rloo"``,
``importance_sampling_level="sequence-sum"`` (the completion's probability ratio,
clipped per sequence, a mean over completions) and ``kl_penalty="reward"`` (beta
times the rollout's summed k1 taken off each reward before the advantages, where
``"loss"``, the default, adds ``beta k3`` per token to the loss).

The on-policy contract (``docs/concepts.md``): the rollout runs in the
trainer's prepare phase, compiled, on the pre-update weights, with
:func:`dew.sampling.decode`; its ``old_logps`` and ``ref_logps`` come from
:func:`dew.objectives.cores.rollouts.rollout_logprobs`, the function the loss
calls, with the sampler's temperature and truncation, so the first update's
``rho`` is 1 (asserted with ``check_first_ratio=True`` or ``DEW_DEBUG=1``).
Text rewards run on the host between the compiled rollout and the compiled
advantages (:meth:`Objective.prepare_host`). ``prepared_updates`` runs
several updates (epochs x minibatches) over one rollout batch; after the
first, ``rho != 1`` and the clip acts (``clip_fraction``).

The clipped loss, the clip fraction, the group advantages and the first-update
check are the RL core's (:mod:`dew.objectives.cores.rl`); initialisation, the
reference, the token checks and export the LM-policy core's
(:mod:`dew.objectives.cores.policy`).

Metrics: ``reward`` and ``reward/<name>`` per reward, ``zero_variance_fraction``
(groups with identical rewards), ``clip_fraction`` (tokens whose gradient the
clip removes, :func:`dew.objectives.cores.rl.clipped_policy_loss`), ``ratio``, ``kl``
(k3, with ``beta > 0``), ``completion_length``, ``tokens``; the log adds
``rollout_tokens_per_second`` and prints ``reward`` and ``kl``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.objective import Objective, Role, Step, Updates
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.logprobs import kl_k1, kl_k3
from dew.objectives.cores.policy import CausalPolicy, check_chunked_model, policy_of
from dew.objectives.cores.rewards import (
    READER,
    Rewards,
    check_reward_model,
    no_host_rewards,
    reward_model_scores,
    reward_roles,
)
from dew.objectives.cores.rl import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_PENALTIES,
    SCALE_REWARDS,
    advantages_by_name,
    check_epsilons,
    check_group_size,
    group_advantages,
    policy_loss,
    sequence_kl_k1,
)
from dew.objectives.cores.rollouts import (
    PROMPT_KEYS,
    CausalRollouts,
    Rollout,
    check_chunked_sampling,
    check_rollout_options,
    check_rollout_rows,
    in_chunks,
    prompt_fields,
    repeat_rows,
    rollout_logprobs,
)
from dew.sampling import Sampling

__all__ = ["GRPOObjective", "aggregate", "group_advantages"]

LOSS_AGGREGATION = ("sequence-mean", "token-mean", "dr_grpo")


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str) -> Weighted:
    """``per_token [rows, new]`` over the completion tokens as a :class:`Weighted`
    mean (``loss_aggregation``, module docstring)."""
    mask = mask.astype(jnp.float32)
    total = per_token * mask
    if mode == "sequence-mean":
        per_row = jnp.sum(total, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return Weighted.mean(per_row)
    if mode == "token-mean":
        return Weighted(total=jnp.sum(total), weight=jnp.sum(mask))
    if mode == "dr_grpo":
        rows, new = per_token.shape
        return Weighted(total=jnp.sum(total) / new, weight=jnp.float32(rows))
    raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATION}, got {mode!r}")


@registry.register("grpo")
@dataclasses.dataclass(frozen=True, eq=False)
class GRPOObjective(Objective):
    """GRPO on a causal language model (module docstring for the math).

    model: the policy, a causal module that decodes with a KV cache
      (:class:`dew.nn.CausalTransformer`).
    rewards: :class:`~dew.objectives.cores.rewards.Reward` objects, jitted
      (:func:`~dew.objectives.cores.rewards.TokenReward`) or on the host
      (:func:`~dew.objectives.cores.rewards.TextReward`) (a plain callable is a
      text reward of weight 1), weighted and summed.
    group_size: completions per prompt, ``G >= 2``.
    max_new_tokens: completion length, in tokens.
    sampling: how completions are drawn (temperature, top-k/p, min-p); the
      loss's log-probs use the same. Not greedy: a group would be identical.
    end_ids: ids that end a completion (counted in it); () = none.
    pad_id: fills completions after their end.
    epsilon: the clip range below 1 (and above, unless ``epsilon_high``).
    epsilon_high: the clip range above 1 (DAPO's clip-higher); None = ``epsilon``.
    beta: weight of the k3 KL to the reference; 0 = no reference policy at all.
    kl_clamp: the log-ratio ``log pi_ref - log pi`` is clipped to ``+-kl_clamp``
      before k3's exponential (float32 overflow, Tunix's ``kl_clamp_value``).
    scale_rewards: ``"group"`` | ``"batch"`` | ``"none"`` (Dr.GRPO).
    advantage_estimator: ``"grpo"`` (the group's mean as the baseline, the default),
      ``"rloo"`` (RLOO: the mean of the other ``G - 1`` rewards; ``scale_rewards="none"``
      is the paper's) or ``"reinforce"`` (REINFORCE++: the batch's mean and std)
      (:mod:`dew.objectives.cores.rl`).
    importance_sampling_level: ``"token"`` (GRPO's per-token ratio, the default),
      ``"sequence"`` (GSPO: one length-normalised ratio per completion, clipped per
      sequence; the paper clips at ``epsilon=3e-4``, ``epsilon_high=4e-4``) or
      ``"sequence-sum"`` (RLOO's, TRL's ``RLOOTrainer``: the completion's probability
      ratio, its token log-ratios summed, clipped per sequence).
    kl_penalty: where ``beta`` puts the KL to the reference: ``"loss"`` (``beta k3`` per
      token added to the loss, GRPO's, the default) or ``"reward"`` (``beta sum_t k1`` of
      the rollout taken off each reward before the advantages, RLOO's and TRL's
      ``RLOOTrainer``'s; ``reward`` is logged without it, ``kl`` is then k1 per token).
    advantage_eps: added to the standard deviation (TRL's 1e-4).
    loss_aggregation: ``"sequence-mean"`` | ``"token-mean"`` | ``"dr_grpo"``.
    prepared_updates: updates per rollout batch (:class:`~dew.objectives.Updates`);
      the default is one (the paper's: rho = 1, no clipping).
    reference: the frozen reference policy's parameters (another run's, a
      Hugging Face load); None = a copy of the initial policy.
    init_params: start the policy from these parameters instead of a random init.
    tokenizer: decodes prompts, completions and answers for text rewards and
      the exported pipeline; None = ``ByteTokenizer()``.
    check_first_ratio: assert on every first update that the loss's log-probs are the
      rollout's (:func:`dew.objectives.cores.rl.check_first_update`, relative to the
      log-prob; :class:`~dew.objectives.cores.rl.RatioError` otherwise); None = ``DEW_DEBUG=1``.
    scoring_rows: rows per forward pass when prepare scores its rollouts
      (:func:`dew.objectives.cores.rollouts.in_chunks`); None = the rows of one update
      (``rows / minibatches``), so the loss's first forward pass has the rollout
      scoring's shapes and the first update's ratio is 1 bit for bit. With
      ``Trainer(accumulate=k)`` give the microbatch's rows.
    reward_model, reward_model_params: a trained reward model
      (:class:`dew.objectives.preference.reward_model.CausalRewardModel`, or any module
      ``(ids, mask) -> [rows]`` of right-padded rows) and its weights: the frozen role
      ``"reward"``, scoring each completion after its prompt inside the compiled
      prepare; its vocabulary must be the policy's. Logged as ``reward/reward_model``.
    reward_model_weight: its weight in the summed reward.
    logits_chunk_size: score completions this many positions of every row at a time
      (:func:`dew.objectives.cores.rollouts.chunked_rollout_logprobs`), in prepare and in the
      loss alike, so the ``[rows, length, vocab]`` float32 logits are never held whole;
      None (the default) = the whole logits. Needs a model that takes it
      (:class:`dew.nn.CausalTransformer`) and sampling without top-k/top-p/min-p.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    rewards: Sequence[Any] = ()
    group_size: int = 8
    max_new_tokens: int = 16
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    end_ids: tuple[int, ...] = ()
    pad_id: int = 0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.04
    kl_clamp: float = 20.0
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"
    importance_sampling_level: str = "token"
    kl_penalty: str = "loss"
    advantage_eps: float = 1e-4
    loss_aggregation: str = "sequence-mean"
    prepared_updates: Updates = dataclasses.field(default_factory=Updates)
    reference: Any = None
    init_params: Any = None
    tokenizer: Any = None
    check_first_ratio: bool | None = None
    scoring_rows: int | None = None
    logits_chunk_size: int | None = None
    reward_model: Any = None
    reward_model_params: Any = None
    reward_model_weight: float = 1.0

    headline_metrics = ("reward", "kl")  # printed on the log line

    def __post_init__(self):
        what = type(self).__name__
        check_group_size(self.group_size, what=what, samples="completions per prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 tokens, got {self.max_new_tokens}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {self.sampling!r}")
        if self.sampling.is_greedy:
            raise ValueError(
                f"{what} samples its groups; {self.sampling} is greedy, so every "
                f"completion of a group would be the same. Use a temperature > 0"
            )
        check_epsilons(self.epsilon_low, self.epsilon_upper, what=what)
        if self.beta < 0:
            raise ValueError(f"beta (the KL weight) must be >= 0, got {self.beta}")
        for name, value, allowed in (
            ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
            ("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS),
            (
                "importance_sampling_level",
                self.importance_sampling_level,
                IMPORTANCE_SAMPLING_LEVELS,
            ),
            ("loss_aggregation", self.loss_aggregation, LOSS_AGGREGATION),
            ("kl_penalty", self.kl_penalty, KL_PENALTIES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        check_rollout_options(self.scoring_rows, self.prepared_updates)
        self.reward_set  # noqa: B018  (checks the rewards now)
        self.policy  # noqa: B018  (checks the tokenizer and vocabulary now)
        check_reward_model(
            self.reward_model, self.reward_model_params, self.policy.vocab_size, what=what
        )
        check_chunked_model(self.model, self.logits_chunk_size, what=type(self).__name__)
        check_chunked_sampling(self.sampling, self.logits_chunk_size, what=type(self).__name__)

    @functools.cached_property
    def rollouts(self) -> CausalRollouts:
        """The sampler settings prepare and the loss share (the first-update check too)."""
        return CausalRollouts(
            model=self.model,
            sampling=self.sampling,
            max_new_tokens=self.max_new_tokens,
            group_size=self.group_size,
            end_ids=self.end_ids,
            pad_id=self.pad_id,
            logits_chunk_size=self.logits_chunk_size,
            check_first_ratio=self.check_first_ratio,
        )

    @functools.cached_property
    def reward_set(self) -> Rewards:
        if not self.rewards and self.reward_model is not None:
            return Rewards(())  # the reward model alone
        return Rewards.of(self.rewards)

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core: policy, tokenizer, initial weights and reference."""
        return policy_of(self)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    # ----------------------------------------------------------------- roles
    def roles(self):
        roles = [Role(name="policy", module=self.model)]
        if self.beta > 0:  # the initial policy, unless reference weights are given
            initial = "policy" if self.reference is None else None
            roles.append(
                Role(name="reference", module=self.model, trained=False, initial_from=initial)
            )
        return (*roles, *reward_roles(self.reward_model))

    def batch_fields(self):
        return prompt_fields()

    def init(self, key, spec=None):
        length = self.policy.rollout_length(spec, self.max_new_tokens)
        params = self.policy.init_policy(key, length)
        variables = {"params": {"policy": params}}
        if self.beta > 0:
            # the initial policy: the same arrays (under LoRA the trainer makes it a view of
            # the base, stored nowhere), or the given reference weights
            variables["reference"] = {"params": self.policy.init_reference(key, length, params)}
        if self.reward_model is not None:
            variables["reward"] = {"params": self.reward_model_params}
        return variables

    # --------------------------------------------------------------- prepare
    phases = ("prepare", "prepare_host", "prepare_finish")

    def prepare(self, variables, batch, step: Step):
        """Rollouts (compiled): ``G`` completions per prompt, old and reference
        log-probs, token rewards; the reader's other keys repeated per completion."""
        params = variables["params"]["policy"]
        rollout = self.rollouts.sample(params, batch, step.key)
        out = dict(rollout.as_dict())
        # in chunks of one update's rows: the loss then scores the same shapes. The policy and
        # the reference score each chunk in one loop iteration (half the loop trips of two maps)
        chunk = self.scoring_rows or rollout.prompt.shape[0] // self.prepared_updates.minibatches
        scored = {"old_logps": params}
        if self.beta > 0:
            scored["ref_logps"] = variables["reference"]["params"]

        def scores(r):
            return {name: self.rollouts.logprobs(p, r) for name, p in scored.items()}

        out.update(in_chunks(scores, rollout, chunk))
        data = {
            k: repeat_rows(v, self.group_size) for k, v in batch.items() if k not in PROMPT_KEYS
        }
        seen = {**data, "prompt": rollout.prompt, "prompt_mask": rollout.prompt_mask}
        out["token_rewards"] = self.reward_set.token_values(
            rollout.completion, rollout.completion_mask, seen
        )
        if self.reward_model is not None:  # the frozen role scores prompt + completion
            out["model_rewards"] = reward_model_scores(self.reward_model, variables, rollout)
        out.update({READER + k: v for k, v in data.items()})
        return out

    def prepare_host(self, rollout):
        """Host stage (:meth:`dew.objectives.cores.rewards.Rewards.host_stage`): every reward,
        ``rewards [rows, rewards]``."""
        if not self.reward_set.items:  # the reward model alone
            return no_host_rewards(rollout)
        return self.reward_set.host_stage(
            rollout,
            self.policy.tokenizer,
            end_ids=self.rollouts.stop_ids,
            group_size=self.group_size,
        )

    def prepare_finish(self, variables, batch, step: Step):
        """Advantages (compiled) from the summed rewards; the training batch."""
        rewards = batch["rewards"]  # [rows, rewards]
        total = self.reward_set.total(rewards)  # [rows]
        if "model_rewards" in batch:
            total = total + self.reward_model_weight * batch["model_rewards"]
        penalised = total
        if self.beta > 0 and self.kl_penalty == "reward":  # RLOO's: the rollout's summed k1
            kl = sequence_kl_k1(batch["old_logps"], batch["ref_logps"], batch["completion_mask"])
            penalised = total - self.beta * kl
        advantages, zero = advantages_by_name(
            self.advantage_estimator,
            penalised,
            self.group_size,
            scale=self.scale_rewards,
            eps=self.advantage_eps,
        )
        keep = ("prompt", "prompt_mask", "completion", "completion_mask", "old_logps", "ref_logps")
        out = {k: batch[k] for k in keep if k in batch}
        out.update(rewards=rewards, reward=total, advantages=advantages, zero_variance=zero)
        if "model_rewards" in batch:
            out["model_rewards"] = batch["model_rewards"]
        return out

    # ------------------------------------------------------------------ loss
    def loss(self, variables, batch, step: Step):
        rollout = Rollout.from_batch(batch)
        mask = rollout.completion_mask
        logps = rollout_logprobs(
            self.model,
            variables["params"]["policy"],
            rollout,
            sampling=self.sampling,
            logits_chunk_size=self.logits_chunk_size,
        )  # [rows, new]
        per_token, ratio_mean, clip_fraction = policy_loss(
            logps,
            batch["old_logps"],
            mask,
            batch["advantages"],
            level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_upper,
        )
        updates = self.prepared_updates
        self.rollouts.check_first_update(
            logps, batch["old_logps"], mask, step=step, updates=updates, what=type(self).__name__
        )
        metrics = {}
        if self.beta > 0 and self.kl_penalty == "loss":
            kl = kl_k3(logps, batch["ref_logps"], clamp=self.kl_clamp)  # [rows, new] float32
            per_token = per_token + self.beta * kl
            metrics["kl"] = Weighted.mean(kl, mask)
        elif self.beta > 0:  # in the rewards already: the rollout's k1, logged
            metrics["kl"] = Weighted.mean(kl_k1(batch["old_logps"], batch["ref_logps"]), mask)
        loss = aggregate(per_token, mask, self.loss_aggregation)
        tokens = jnp.sum(mask, dtype=jnp.float32)
        first_epoch = (step.index % updates.per_batch) < updates.minibatches
        metrics.update(
            reward=Weighted.mean(batch["reward"]),
            zero_variance_fraction=Weighted.mean(batch["zero_variance"]),
            clip_fraction=clip_fraction,
            ratio=ratio_mean,
            completion_length=Weighted.mean(rollout.lengths),
            tokens=Summed(tokens),
            rollout_tokens=Summed(jnp.where(first_epoch, tokens, 0.0)),
        )
        for k, name in enumerate(self.reward_set.names):
            metrics[f"reward/{name}"] = Weighted.mean(batch["rewards"][:, k])
        if "model_rewards" in batch:
            metrics["reward/reward_model"] = Weighted.mean(batch["model_rewards"])
        return loss, metrics

    # ---------------------------------------------------------- validation
    def check_batch(self, batch):
        super().check_batch(batch)  # the declared fields
        prompt = np.asarray(batch["prompt"])
        self.policy.check_rollout_length(prompt.shape[1], self.max_new_tokens)
        check_rollout_rows(
            prompt.shape[0] * self.group_size,
            minibatches=self.prepared_updates.minibatches,
            scoring_rows=self.scoring_rows,
            what=type(self).__name__,
            made=f" ({prompt.shape[0]} prompts x group_size {self.group_size})",
        )
        self.policy.check_ids(prompt, key="prompt")

    def export(self, variables):
        return self.policy.export(
            variables["params"]["policy"],
            max_new_tokens=self.max_new_tokens,
            end_ids=self.rollouts.stop_ids or None,
        )

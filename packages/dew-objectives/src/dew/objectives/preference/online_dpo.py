"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI
Feedback", arXiv 2402.04792; TRL's ``OnlineDPOTrainer``): DPO on pairs the
policy samples inside the step.

Per prompt the current policy samples two completions (compiled, in the
prepare phase, as GRPO's rollouts); a judge orders them, the higher-rewarded
one chosen; the DPO loss (:func:`dew.objectives.preference.losses.dpo_losses`,
``"sigmoid"`` or ``"ipo"``) trains on the pair with sequence log-probs summed
over each completion's tokens::

    h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
    sigmoid: -log sigmoid(beta h)        ipo: (h - 1 / (2 beta))^2

The judge is a trained reward model (``reward_model=``, a
:class:`~dew.objectives.preference.reward_model.CausalRewardModel` with
``reward_model_params=``: the frozen role ``"reward"``, scoring the rollout inside the
compiled step), rewards as GRPO takes them (``rewards=``: token rewards traced
into the step, text rewards on the host), or both, summed with weights. A pair
whose two rewards are equal carries no preference: it adds 0 to the mean over
the pairs (its share is logged as ``tie_fraction``), so a batch of ties only
is a step without gradient (a policy that starts far from any reward).

As for GRPO, the rollout's log-probs (``old_logps``, ``ref_logps``) come from
:func:`dew.objectives.rollouts.rollout_logprobs`, the function the loss calls,
so the first update's ratio is 1 (asserted with ``check_first_ratio=True`` or
``DEW_DEBUG=1``: :func:`dew.objectives.rl.check_first_update`).

Metrics: ``reward`` (the judge's mean over the sampled completions),
``tie_fraction``, ``accuracy`` and ``margin`` of the implicit rewards
``beta (log pi - log ref)``, ``completion_length``.
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
from dew.objectives.contract.objective import Objective, Role, Step
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.logprobs import masked_sum
from dew.objectives.cores.policy import CausalPolicy, policy_of
from dew.objectives.cores.rewards import (
    READER,
    Rewards,
    check_reward_model,
    no_host_rewards,
    reward_model_scores,
    reward_roles,
)
from dew.objectives.cores.rl import check_first_update
from dew.objectives.cores.rollouts import (
    PROMPT_KEYS,
    Rollout,
    check_rollout_rows,
    debug_enabled,
    prompt_fields,
    repeat_rows,
    rollout_logprobs,
    sample_completions,
)
from dew.objectives.preference.losses import dpo_losses
from dew.sampling import Sampling

LOSSES = ("sigmoid", "ipo")


def rows_lengths(mask: jax.Array, pairs: int) -> jax.Array:
    """``[pairs, 2]`` completion lengths from the rows' mask ``[2 pairs, new]``."""
    return jnp.sum(mask, axis=-1, dtype=jnp.float32).reshape(pairs, 2)


@registry.register("online_dpo")
@dataclasses.dataclass(frozen=True, eq=False)
class OnlineDPOObjective(Objective):
    """Online DPO on a causal policy (module docstring).

    model: the policy (:class:`dew.nn.CausalTransformer`, decoding with a KV cache).
    reward_model, reward_model_params: a trained reward model and its parameters (the
      frozen role ``"reward"``); its vocabulary must be the policy's.
    rewards: GRPO's rewards (:class:`~dew.objectives.cores.rewards.Reward` objects,
      jitted or ``host=True``; plain callables = host rewards of decoded text).
    reward_model_weight: the reward model's weight in the sum.
    max_new_tokens, sampling, end_ids, pad_id: the rollout (as GRPO's; not greedy).
    beta: DPO's inverse temperature (TRL's default 0.1).
    loss_type: ``"sigmoid"`` or ``"ipo"``.
    reference: the reference's parameters; None = a copy of the initial policy.
    init_params, tokenizer, check_first_ratio: as :class:`~dew.objectives.GRPOObjective`'s.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    reward_model: Any = None
    reward_model_params: Any = None
    rewards: Sequence[Any] = ()
    reward_model_weight: float = 1.0
    max_new_tokens: int = 16
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    end_ids: tuple[int, ...] = ()
    pad_id: int = 0
    beta: float = 0.1
    loss_type: str = "sigmoid"
    reference: Any = None
    init_params: Any = None
    tokenizer: Any = None
    check_first_ratio: bool | None = None

    headline_metrics = ("reward", "accuracy")

    def __post_init__(self):
        what = "OnlineDPOObjective"
        if self.loss_type not in LOSSES:
            raise ValueError(f"{what}(loss_type={self.loss_type!r}): use one of {list(LOSSES)}")
        if not self.beta > 0:
            raise ValueError(f"{what} needs beta > 0, got {self.beta}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 tokens, got {self.max_new_tokens}")
        if self.sampling.is_greedy:
            raise ValueError(
                f"{what} samples two completions per prompt; {self.sampling} is greedy, so "
                f"they would be the same. Use a temperature > 0"
            )
        if self.reward_model is None and not self.rewards:
            raise ValueError(
                f"{what} needs a judge: reward_model= (with reward_model_params=) or rewards=[...]"
            )
        self.reward_set  # noqa: B018  (checks the rewards now)
        check_reward_model(
            self.reward_model, self.reward_model_params, self.policy.vocab_size, what=what
        )

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(int(e) for e in self.end_ids)

    @functools.cached_property
    def reward_set(self) -> Rewards:
        return Rewards.of(self.rewards) if self.rewards else Rewards(())

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core: policy, tokenizer, initial weights and reference."""
        return policy_of(self)

    @functools.cached_property
    def debug(self) -> bool:
        return debug_enabled(self.check_first_ratio)

    def roles(self):
        roles = [
            Role(name="policy", module=self.model),
            Role(
                name="reference",
                module=self.model,
                trained=False,
                initial_from="policy" if self.reference is None else None,
            ),
        ]
        return (*roles, *reward_roles(self.reward_model))

    def batch_fields(self):
        return prompt_fields()

    def init(self, key, spec=None):
        length = self.policy.rollout_length(spec, self.max_new_tokens)
        params = self.policy.init_policy(key, length)
        variables = {
            "params": {"policy": params},
            "reference": {"params": self.policy.init_reference(key, length, params)},
        }
        if self.reward_model is not None:
            variables["reward"] = {"params": self.reward_model_params}
        return variables

    # --------------------------------------------------------------- prepare
    def _logps(self, params, rollout):
        return rollout_logprobs(self.model, params, rollout, sampling=self.sampling)

    phases = ("prepare", "prepare_host", "prepare_finish")

    def prepare(self, variables, batch, step: Step):
        """Two completions per prompt, their old and reference log-probs, token
        rewards and the reward model's scores (compiled)."""
        rollout = sample_completions(
            self.model,
            variables["params"]["policy"],
            batch["prompt"],
            batch["prompt_mask"],
            key=step.key,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            group_size=2,
            end_ids=self.stop_ids,
            pad_id=self.pad_id,
        )
        out = dict(rollout.as_dict())
        out["old_logps"] = self._logps(variables["params"]["policy"], rollout)
        out["ref_logps"] = self._logps(variables["reference"]["params"], rollout)
        # the reader's other keys (answers) repeated per completion, for the rewards
        data = {k: repeat_rows(v, 2) for k, v in batch.items() if k not in PROMPT_KEYS}
        seen = {**data, "prompt": rollout.prompt, "prompt_mask": rollout.prompt_mask}
        out["token_rewards"] = self.reward_set.token_values(
            rollout.completion, rollout.completion_mask, seen
        )
        out.update({READER + k: v for k, v in data.items()})
        if self.reward_model is not None:
            out["model_rewards"] = reward_model_scores(self.reward_model, variables, rollout)
        return out

    def prepare_host(self, rollout):
        if not self.reward_set.items:  # the reward model alone
            return no_host_rewards(rollout)
        return self.reward_set.host_stage(
            rollout, self.policy.tokenizer, end_ids=self.stop_ids, group_size=2
        )

    def prepare_finish(self, variables, batch, step: Step):
        """The judge's total per completion, which of each pair is chosen, and the
        training batch with one row per pair (``[pairs, 2, ...]`` for the two
        completions), so microbatches and devices never split a pair."""
        total = self.reward_set.total(batch["rewards"])  # [rows]
        if "model_rewards" in batch:
            total = total + self.reward_model_weight * batch["model_rewards"]
        pairs = total.reshape(-1, 2)
        first_wins = (pairs[:, 0] > pairs[:, 1]).astype(jnp.float32)
        tie = (pairs[:, 0] == pairs[:, 1]).astype(jnp.float32)
        out = {k: batch[k][0::2] for k in ("prompt", "prompt_mask")}  # each pair's prompt
        for k in ("completion", "completion_mask", "old_logps", "ref_logps"):
            out[k] = batch[k].reshape(-1, 2, *batch[k].shape[1:])
        # +1 on the chosen completion, -1 on the rejected, 0 on both of a tie
        sign = jnp.stack([2 * first_wins - 1, 1 - 2 * first_wins], axis=1) * (1 - tie[:, None])
        out.update(reward=pairs, preference=sign, tie=tie)
        return out

    # ------------------------------------------------------------------ loss
    def loss(self, variables, batch, step: Step):
        pairs = batch["completion"].shape[0]
        rows = lambda x: x.reshape(2 * pairs, *x.shape[2:])  # noqa: E731  [pairs, 2, ...] -> rows
        rollout = Rollout(
            prompt=jnp.repeat(batch["prompt"], 2, axis=0),
            prompt_mask=jnp.repeat(batch["prompt_mask"], 2, axis=0),
            completion=rows(batch["completion"]),
            completion_mask=rows(batch["completion_mask"]),
        )
        mask = rollout.completion_mask
        logps = self._logps(variables["params"]["policy"], rollout)  # [rows, new]
        old_logps, ref_logps = rows(batch["old_logps"]), rows(batch["ref_logps"])
        if self.debug:
            check_first_update(
                logps,
                old_logps,
                mask,
                step=step.index,
                updates_per_batch=1,
                what="OnlineDPOObjective",
            )
        ratio = masked_sum(logps, mask) - masked_sum(ref_logps, mask)  # [rows]
        sign = batch["preference"]  # [pairs, 2]
        h = jnp.sum(ratio.reshape(pairs, 2) * sign, axis=1)  # chosen minus rejected
        valid = jnp.abs(sign[:, 0])  # 0 on ties
        # a mean over all pairs, ties adding 0: a batch of ties only is a step without
        # gradient, not an empty batch
        pair_losses = dpo_losses(h, beta=self.beta, loss_type=self.loss_type)
        loss = Weighted.mean(pair_losses * valid)
        margin = jax.lax.stop_gradient(self.beta * h)
        metrics = {
            "reward": Weighted.mean(jnp.mean(batch["reward"], axis=1)),
            "tie_fraction": Weighted.mean(batch["tie"]),
            "accuracy": Weighted.mean((margin > 0).astype(jnp.float32), valid),
            "margin": Weighted.mean(margin, valid),
            "completion_length": Weighted.mean(jnp.mean(rows_lengths(mask, pairs), axis=1)),
            "pairs": Summed(jnp.sum(valid)),
        }
        return loss, metrics

    def check_batch(self, batch):
        super().check_batch(batch)
        prompt = np.asarray(batch["prompt"])
        self.policy.check_rollout_length(prompt.shape[1], self.max_new_tokens)
        check_rollout_rows(
            prompt.shape[0] * 2, minibatches=1, scoring_rows=None, what="OnlineDPOObjective"
        )
        self.policy.check_ids(prompt, key="prompt")

    def export(self, variables):
        return self.policy.export(
            variables["params"]["policy"],
            tokenizer=self.policy.tokenizer,
            max_new_tokens=self.max_new_tokens,
            end_ids=self.stop_ids or None,
        )

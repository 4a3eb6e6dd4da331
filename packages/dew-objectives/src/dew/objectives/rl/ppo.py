"""Proximal policy optimization of a language model (RLHF-style, token level).

Papers: PPO (Schulman et al., 2017, arXiv 1707.06347), GAE (Schulman et al.,
2016, arXiv 1506.02438), Ziegler et al. (2019, arXiv 1909.08593), InstructGPT
(Ouyang et al., 2022, arXiv 2203.02155), "The N+ implementation details of
RLHF with PPO" (Huang et al., 2024). References: huggingface/trl
``trl/experimental/ppo/ppo_trainer.py``; google/tunix ``tunix/rl/ppo``.

Prepare (compiled, no gradient, the pre-update weights) samples a completion
``o`` of every prompt ``q`` with :func:`dew.objectives.cores.rollouts.sample_completions`,
scores it with the reward ``s(q, o)`` (the rewards summed, a frozen reward model's
score of ``[q | o]`` among them: :func:`dew.objectives.cores.rewards.reward_model_scores`),
and computes per completion token ``t``
(``m_t`` = 1 on the completion's tokens, its end id included, 0 on the padding
after it):

    kl_t = log pi_old(o_t) - log ref(o_t)               (k1; or k3)
    r_t  = -beta kl_t + [t = T_end] s(q, o)             T_end: the last real token
    delta_t = r_t + gamma V_old(t + 1) - V_old(t)       V_old(t) = 0 where m_t = 0
    A_t  = delta_t + gamma lambda A_{t+1}               (GAE, a reverse lax.scan)
    R_t  = A_t + V_old(t)                               (the value targets)
    A_t <- (A_t - mean(A)) / std(A)                     over every valid token of the batch

Each of the ``epochs x minibatches`` updates (:class:`~dew.objectives.Updates`)
then minimizes, with ``rho_t = pi(o_t) / pi_old(o_t)`` and token-weighted means:

    L_pg = mean_t max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps_high))
    L_vf = 0.5 mean_t max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -eps_v, eps_v) - R_t)^2)
    L    = L_pg + c_vf L_vf

Log-probs are those of the distribution the sampler draws from (temperature,
truncation; :func:`dew.objectives.cores.rollouts.scored_logprobs`), from one full
forward pass over ``[prompt | completion]`` in prepare and in the loss alike,
prepare's in chunks of one update's rows (:func:`in_chunks`), so the first
update's ratio is exactly 1 (``debug=True`` asserts it:
:func:`dew.objectives.cores.rl.check_first_update`).
The value of position ``t`` is read at the hidden state that predicts ``o_t``
(the state before the action). Values come from a :class:`dew.nn.value.ValueHead`
on the policy's trunk (one forward pass gives both; the value loss trains the
trunk too) or, with ``critic=``, from a separate :class:`dew.nn.value.Critic`,
a second trained role.

The clipped loss and its clip fraction, GAE, whitening and the first-update
check are the RL core's (:mod:`dew.objectives.cores.rl`); initialisation, the
reference, the token checks and export the LM-policy core's
(:mod:`dew.objectives.cores.policy`). The log line prints ``score`` and ``kl``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.objective import Objective, Role, Step, Updates, nn_unbox
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.logprobs import kl_k1, kl_k3, masked_mean, rollout_positions
from dew.objectives.cores.policy import CausalPolicy, check_chunked_model, policy_of
from dew.objectives.cores.rewards import (
    READER,
    Rewards,
    check_reward_model,
    reward_model_scores,
    reward_roles,
)
from dew.objectives.cores.rl import (
    check_epsilons,
    clipped_policy_loss,
    gae,
    max_ratio_deviation,
    upper_clip,
    whiten,
)
from dew.objectives.cores.rollouts import (
    PROMPT_KEYS,
    CausalRollouts,
    Rollout,
    check_chunked_sampling,
    check_rollout_options,
    check_rollout_rows,
    chunked_rollout_logprobs,
    in_chunks,
    prompt_fields,
    scored_logprobs,
)

__all__ = [  # gae, whiten and in_chunks are the RL core's and the rollouts', importable here
    "PPOObjective",
    "end_index",
    "evaluate_rollout",
    "explained_variance",
    "gae",
    "in_chunks",
    "token_rewards",
    "value_loss",
    "whiten",
]

KL_ESTIMATORS = ("k1", "k3")


# ------------------------------------------------------------------ the math
def end_index(mask: jax.Array) -> jax.Array:
    """``[rows]`` index of each row's last real token (its end id, or the last token
    of a completion cut at ``max_new_tokens``); -1 for an empty row."""
    return jnp.sum(mask.astype(jnp.int32), axis=-1) - 1


def token_rewards(
    scores: jax.Array, kl: jax.Array, mask: jax.Array, *, kl_coef: float
) -> jax.Array:
    """``r_t = -kl_coef kl_t + [t = end] score`` on valid tokens, 0 after the end.

    scores: ``[rows]``; kl, mask: ``[rows, new]``. An empty row gets no score.
    """
    mask = mask.astype(jnp.float32)
    at_end = jax.nn.one_hot(end_index(mask), mask.shape[-1], dtype=jnp.float32)  # [rows, new]
    return (-kl_coef * kl.astype(jnp.float32) + scores.astype(jnp.float32)[:, None] * at_end) * mask


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
    """``1 - Var(R - V) / Var(R)`` over the valid tokens: 1 = the values predict the
    returns, 0 = no better than their mean, < 0 worse."""
    mask = mask.astype(jnp.float32)

    def var(x):
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

    return 1.0 - var(returns - values) / jnp.maximum(var(returns), 1e-12)


def value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, *, clip_range_value: float
) -> tuple[jax.Array, jax.Array]:
    """Per token: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps_v) - R)^2)`` and
    whether the clipped term was the larger; each ``[rows, new]`` float32."""
    moved = jnp.clip(values - old_values, -clip_range_value, clip_range_value)
    unclipped = (values - returns) ** 2
    clipped = (old_values + moved - returns) ** 2
    return 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)


def evaluate_rollout(ppo: PPOObjective, params, rollout: Rollout) -> tuple[jax.Array, jax.Array]:
    """``(logps, values)`` of ``ppo``'s roles ``params`` (``{"policy", "value"}``), each
    ``[rows, new]`` float32, 0 after a row's end: the policy's log-probs of the
    completion tokens (as sampled: temperature, truncation) and the value of the state
    before each token. One forward pass of the policy when the value head is on its
    trunk. Prepare and the loss both call this, on the same rows."""
    prompt_len, new = rollout.prompt.shape[1], rollout.completion.shape[1]
    tokens = jnp.concatenate([rollout.prompt, rollout.completion], axis=1)  # [rows, length]
    positions, mask = rollout_positions(rollout.prompt_mask, new)
    scored = slice(prompt_len - 1, prompt_len - 1 + new)  # the states before o_0 .. o_new-1
    valid = rollout.completion_mask
    sampling, chunk = ppo.rollouts.sampling, ppo.logits_chunk_size
    if ppo.critic is None and chunk is not None:
        logps, hidden = chunked_rollout_logprobs(
            ppo.model, params["policy"], rollout, sampling, chunk, return_hidden=True
        )  # [rows, new], [rows, length, embed]
        values = ppo.head.apply({"params": nn_unbox(params["value"])}, hidden[:, scored])
    elif ppo.critic is None:
        logits, hidden = ppo.model.apply(
            {"params": nn_unbox(params["policy"])},
            tokens,
            positions=positions,
            attention_mask=mask,
            return_hidden=True,
        )  # [rows, length, vocab], [rows, length, embed]
        logps = scored_logprobs(logits[:, scored], rollout.completion, sampling)
        logps = jnp.where(valid, logps, 0.0)
        values = ppo.head.apply({"params": nn_unbox(params["value"])}, hidden[:, scored])
    else:
        logps = ppo.rollouts.logprobs(params["policy"], rollout)
        values = ppo.critic.apply(
            {"params": nn_unbox(params["value"])},
            tokens,
            positions=positions,
            attention_mask=mask,
        )[:, scored]
    return logps, jnp.where(valid, values, 0.0)  # [rows, new] each


# ----------------------------------------------------------------- objective
@registry.register("ppo")
@dataclasses.dataclass(frozen=True, eq=False)
class PPOObjective(Objective):
    """PPO with a KL penalty to a frozen reference policy and GAE (module docstring).

    model: the policy, a causal module (:class:`dew.nn.CausalTransformer`) that
      decodes with a cache and takes ``return_hidden=True``.
    reward: the score of a completion: a :class:`~dew.objectives.cores.rewards.Reward`,
      jitted (``TokenReward``, traced into prepare) or on the host (``TextReward``:
      host Python over decoded text, with the reader's other columns; a plain
      callable is one), or a sequence of them, weighted and summed, each logged as
      ``reward/<name>``. Text rewards run between two compiled parts of prepare.
      None: the reward model alone (``reward_model=``).
    max_new_tokens: completion length (tokens, an end id included).
    critic: None = a :class:`~dew.nn.value.ValueHead` on the policy's trunk
      (``value_head``); a module ``critic(tokens, positions=, attention_mask=) ->
      [batch, length]`` (:class:`~dew.nn.value.Critic`) = a separate critic model,
      a second trained role ``value``.
    reward_model, reward_model_params: a trained reward model
      (:class:`dew.objectives.preference.reward_model.CausalRewardModel`, or any module
      ``(ids, mask) -> [rows]`` of right-padded rows) and its weights: the frozen role
      ``"reward"``, scoring each completion after its prompt inside the compiled
      prepare; its vocabulary must be the policy's. Logged as ``reward/reward_model``,
      summed with ``reward`` (if any) into ``s(q, o)``.
    reward_model_weight: its weight in the summed score.
    value_head: the head used without a critic.
    sampling: how completions are drawn; the log-probs use its temperature and
      truncation (TRL's PPO demo: temperature 0.7).
    kl_coef: beta of the per-token KL penalty (TRL 0.05, InstructGPT 0.02); 0 = none.
    kl_estimator: ``'k1'`` (``log pi_old - log ref``, TRL's default) or ``'k3'``
      (Tunix's ``low_var_kl``).
    gamma, lam: discount and GAE lambda (1.0, 0.95 as TRL and Tunix).
    clip_range: epsilon of the policy ratio clip (below 1, and above unless
      ``clip_range_high``); clip_range_value: of the value clip.
    vf_coef: weight of the value loss (TRL 0.1).
    whiten_advantages: normalise the advantages over the batch's valid tokens.
    prepared_updates: optimizer updates per rollout batch (epochs x minibatches;
      TRL: 4 epochs, 1 minibatch).
    end_ids: ids that end a completion (included in it); pad_id: fills after it.
    reference: the reference policy's parameters; None = a copy of the initial policy.
    init_params: start the policy from these parameters (a ``Pretrained`` load).
    tokenizer: for text rewards and export; None = ``ByteTokenizer()``.
    debug: assert in the compiled step that the first update's log-probs are the
      rollout's (:func:`dew.objectives.cores.rl.check_first_update`); None = ``DEW_DEBUG``.
    scoring_rows: rows per forward pass when prepare scores its rollouts
      (:func:`in_chunks`); None = the rows of one update (``rows / minibatches``),
      so the first update's log-probs equal the rollout's bit for bit. With
      ``Trainer(accumulate=k)`` give the microbatch's rows.
    clip_range_high: the policy clip above 1 (DAPO's clip-higher); None = ``clip_range``.
    logits_chunk_size: score completions this many positions of every row at a time
      (:func:`dew.objectives.cores.rollouts.chunked_rollout_logprobs`), in prepare and in the
      loss alike, so the ``[rows, length, vocab]`` float32 logits are never held whole;
      None (the default) = the whole logits. Needs a model that takes it
      (:class:`dew.nn.CausalTransformer`) and sampling without top-k/top-p/min-p.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    reward: Any = None
    max_new_tokens: int
    critic: Any = None
    reward_model: Any = None
    reward_model_params: Any = None
    reward_model_weight: float = 1.0
    value_head: Any = None
    sampling: Any = None
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    clip_range: float = 0.2
    clip_range_value: float = 0.2
    vf_coef: float = 0.1
    whiten_advantages: bool = True
    prepared_updates: Updates = dataclasses.field(
        default_factory=lambda: Updates(epochs=4, minibatches=1)
    )
    end_ids: tuple[int, ...] = ()
    pad_id: int = 0
    reference: Any = None
    init_params: Any = None
    tokenizer: Any = None
    debug: bool | None = None
    scoring_rows: int | None = None
    logits_chunk_size: int | None = None
    clip_range_high: float | None = None

    headline_metrics = ("score", "kl")  # printed on the log line

    def __post_init__(self):
        what = type(self).__name__
        self.policy  # noqa: B018  (checks the tokenizer and vocabulary now)
        if self.reward is None and self.reward_model is None:
            raise ValueError(
                f"{what} needs a score: reward= (a TokenReward, a TextReward or a list) or "
                f"reward_model= with reward_model_params= (a trained reward model)"
            )
        self.rewards  # noqa: B018  (checks the reward now)
        check_reward_model(
            self.reward_model, self.reward_model_params, self.policy.vocab_size, what=what
        )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown kl_estimator {self.kl_estimator!r}; use one of {KL_ESTIMATORS}"
            )
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        for name in ("kl_coef", "clip_range_value", "vf_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PPOObjective {name} must be >= 0, got {getattr(self, name)}")
        high = upper_clip(self.clip_range, self.clip_range_high)
        check_epsilons(self.clip_range, high, what=what)
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"PPOObjective {name} must be in [0, 1], got {getattr(self, name)}"
                )
        check_rollout_options(self.scoring_rows, self.prepared_updates)
        check_chunked_model(self.model, self.logits_chunk_size, what=type(self).__name__)
        check_chunked_sampling(
            self.rollouts.sampling, self.logits_chunk_size, what=type(self).__name__
        )

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core: policy, tokenizer, initial weights and reference."""
        return policy_of(self)

    @functools.cached_property
    def rewards(self) -> Rewards:
        if self.reward is None:
            return Rewards(())  # the reward model alone
        return Rewards.of(self.reward)

    @functools.cached_property
    def rollouts(self) -> CausalRollouts:
        """The sampler settings prepare and the loss share (``sampling`` None =
        ``Sampling()``), the first-update check too."""
        from dew.sampling import Sampling

        return CausalRollouts(
            model=self.model,
            sampling=Sampling() if self.sampling is None else self.sampling,
            max_new_tokens=self.max_new_tokens,
            end_ids=self.end_ids,
            pad_id=self.pad_id,
            logits_chunk_size=self.logits_chunk_size,
            check_first_ratio=self.debug,
        )

    @functools.cached_property
    def head(self):
        """``value_head``, or the default ``ValueHead()``."""
        from dew.nn.value import ValueHead

        return ValueHead() if self.value_head is None else self.value_head

    # ------------------------------------------------------------- models
    def roles(self) -> tuple[Role, ...]:
        value = self.critic if self.critic is not None else self.head
        return (
            Role(name="policy", module=self.model),
            Role(name="value", module=value),
            # the initial policy, unless reference weights are given (init_reference)
            Role(
                name="reference",
                module=self.model,
                trained=False,
                initial_from="policy" if self.reference is None else None,
            ),
            *reward_roles(self.reward_model),
        )

    def batch_fields(self):
        return prompt_fields()

    def init(self, key, spec=None):
        k_policy, k_value = jax.random.split(key)
        prompt_len = int(tuple(spec["prompt"].shape)[0]) if spec and "prompt" in spec else 1
        self.policy.check_rollout_length(prompt_len, self.max_new_tokens)
        length = prompt_len + self.max_new_tokens
        tokens = jnp.zeros((1, length), jnp.int32)
        policy = self.policy.init_policy(k_policy, length)
        if self.critic is not None:
            value = self.critic.init(k_value, tokens)["params"]
        else:
            _, hidden = jax.eval_shape(
                lambda: self.model.apply({"params": nn_unbox(policy)}, tokens, return_hidden=True)
            )
            value = self.head.init(k_value, jnp.zeros(hidden.shape, hidden.dtype))["params"]
        reference = self.policy.init_reference(k_policy, length, policy)  # sharded like it
        variables = {
            "params": {"policy": policy, "value": value},
            "reference": {"params": reference},
        }
        if self.reward_model is not None:
            variables["reward"] = {"params": self.reward_model_params}
        return variables

    # ------------------------------------------------------------- prepare
    def prepare(self, variables, batch, step: Step):
        """The rollout (compiled): completions, old log-probs and values, reference
        log-probs, token rewards; with text rewards the reader's other keys ride
        along to :meth:`prepare_host`, else the advantages follow at once."""
        params = variables["params"]
        rollout = self.rollouts.sample(nn_unbox(params["policy"]), batch, step.key)
        mask = rollout.completion_mask
        chunk = self.scoring_rows or mask.shape[0] // self.prepared_updates.minibatches
        reference = variables["reference"]["params"]

        def scores(r):  # the policy and the reference in one loop iteration per chunk
            logps, values = evaluate_rollout(self, params, r)
            return logps, values, self.rollouts.logprobs(reference, r)

        logps, values, ref_logps = in_chunks(scores, rollout, chunk)
        out = dict(rollout.as_dict(), old_logps=logps, old_values=values, ref_logps=ref_logps)
        out["token_rewards"] = self.rewards.token_values(rollout.completion, mask, dict(batch))
        if self.reward_model is not None:  # the frozen role scores prompt + completion
            out["model_rewards"] = reward_model_scores(self.reward_model, variables, rollout)
        if not self.has_prepare_host:
            out["rewards"] = out.pop("token_rewards")  # every reward is a token reward
            return self.prepare_finish(variables, out, step)
        out.update({READER + k: v for k, v in batch.items() if k not in PROMPT_KEYS})
        return jax.lax.stop_gradient(out)

    @property
    def phases(self) -> tuple[str, ...]:
        """Only text rewards need the host stage (and the compiled part after it)."""
        if self.rewards.host:
            return ("prepare", "prepare_host", "prepare_finish")
        return ("prepare",)

    def prepare_host(self, rollout):
        """Host stage (:meth:`dew.objectives.cores.rewards.Rewards.host_stage`): every reward,
        ``rewards [rows, rewards]`` in order."""
        return self.rewards.host_stage(
            rollout, self.policy.tokenizer, end_ids=self.rollouts.stop_ids
        )

    def prepare_finish(self, variables, batch, step: Step):
        """Advantages (compiled): KL-penalised token rewards, GAE, whitening; the
        training batch."""
        mask = batch["completion_mask"]
        values = batch["old_values"]
        kl_fn = kl_k1 if self.kl_estimator == "k1" else kl_k3
        kl = jnp.where(mask, kl_fn(batch["old_logps"], batch["ref_logps"]), 0.0)  # [rows, new]
        columns = batch["rewards"]  # [rows, rewards]
        scores = self.rewards.total(columns)  # [rows]
        if self.reward_model is not None:
            scores = scores + self.reward_model_weight * batch["model_rewards"]
        rewards = token_rewards(scores, kl, mask, kl_coef=self.kl_coef)
        advantages, returns = gae(rewards, values, mask, gamma=self.gamma, lam=self.lam)
        if self.whiten_advantages:
            advantages = whiten(advantages, mask)
        rows = mask.shape[0]
        keep = ("prompt", "prompt_mask", "completion", "completion_mask", "old_logps")
        prepared = {k: batch[k] for k in keep}
        prepared.update(
            old_values=values,
            advantages=advantages,
            returns=returns,
            scores=scores,
            kl=jnp.sum(kl, axis=-1),  # [rows] the sequence's KL to the reference
            # a statistic of the whole rollout batch, carried per row
            explained_variance=jnp.full((rows,), explained_variance(values, returns, mask)),
        )
        for k, name in enumerate(self.rewards.names):
            prepared[f"reward/{name}"] = columns[:, k]
        if self.reward_model is not None:
            prepared["reward/reward_model"] = batch["model_rewards"]
        return jax.lax.stop_gradient(prepared)

    # ---------------------------------------------------------------- loss
    def loss(self, variables, batch, step: Step):
        rollout = Rollout.from_batch(batch)
        mask = rollout.completion_mask
        logps, values = evaluate_rollout(self, variables["params"], rollout)
        pg, ratio, pg_clipped = clipped_policy_loss(
            logps,
            batch["old_logps"],
            batch["advantages"],
            epsilon_low=self.clip_range,
            epsilon_high=upper_clip(self.clip_range, self.clip_range_high),
        )
        vf, vf_clipped = value_loss(
            values, batch["old_values"], batch["returns"], clip_range_value=self.clip_range_value
        )
        self.rollouts.check_first_update(
            logps,
            batch["old_logps"],
            mask,
            step=step,
            updates=self.prepared_updates,
            what=type(self).__name__,
        )
        weights = mask.astype(jnp.float32)
        policy = Weighted.mean(pg, weights)
        value = Weighted.mean(vf, weights)
        log_ratio = logps - batch["old_logps"]
        metrics = {
            "policy_loss": policy,
            "value_loss": value,
            "score": Weighted.mean(batch["scores"]),
            "kl": Weighted.mean(batch["kl"]),
            "policy_clip_fraction": Weighted.mean(pg_clipped, weights),
            "value_clip_fraction": Weighted.mean(vf_clipped, weights),
            "approx_kl": Weighted.mean(0.5 * log_ratio**2, weights),
            "ratio": Weighted.mean(ratio, weights),
            "ratio_max_deviation": max_ratio_deviation(ratio, mask),
            "explained_variance": Weighted.mean(batch["explained_variance"]),
            "completion_length": Weighted.mean(rollout.lengths),
            "tokens": Summed(jnp.sum(weights)),
        }
        for key in batch:  # each reward's column, then the reward model's (prepare_finish)
            if key.startswith("reward/"):
                metrics[key] = Weighted.mean(batch[key])
        return (policy, value.scale(self.vf_coef)), metrics

    # ------------------------------------------------------- checks, export
    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        super().check_batch(batch)  # the declared fields
        prompt = np.asarray(batch["prompt"])
        self.policy.check_rollout_length(prompt.shape[1], self.max_new_tokens)
        self.policy.check_ids(prompt, key="prompt")
        check_rollout_rows(
            prompt.shape[0],
            minibatches=self.prepared_updates.minibatches,
            scoring_rows=self.scoring_rows,
            what=type(self).__name__,
        )

    def export(self, variables):
        """A :class:`dew.sampling.TextGeneration` of the policy."""
        return self.policy.export(
            variables["params"]["policy"],
            sampling=self.rollouts.sampling,
            max_new_tokens=self.max_new_tokens,
            end_ids=self.rollouts.stop_ids or None,
        )
